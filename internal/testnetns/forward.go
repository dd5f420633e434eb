package testnetns

import (
	"fmt"
	"io"
	"net"
	"sync"

	"github.com/vishvananda/netns"
)

// ForwardLoopback makes addr (a host loopback address such as the test API
// server's 127.0.0.1:PORT) reachable at the same address inside the
// namespace ns: it listens inside ns and relays each connection to addr in
// the calling process's own namespace. It returns a function that stops it.
func ForwardLoopback(ns netns.NsHandle, addr string) (stop func(), err error) {
	var ln net.Listener
	err = RunOnDiscardedThread(func() error {
		if err := netns.Set(ns); err != nil {
			return fmt.Errorf("enter netns: %w", err)
		}
		var err error
		ln, err = net.Listen("tcp", addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening on %s inside the namespace: %w", addr, err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				relay(in, addr)
			}()
		}
	}()
	return func() { ln.Close() }, nil
}

func relay(in net.Conn, addr string) {
	defer in.Close()
	out, err := net.Dial("tcp", addr)
	if err != nil {
		return
	}
	defer out.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(out, in); done <- struct{}{} }()
	go func() { _, _ = io.Copy(in, out); done <- struct{}{} }()
	<-done
}
