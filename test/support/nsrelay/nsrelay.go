// Package nsrelay makes a TCP service of one network namespace reachable
// inside another: it listens inside the target namespace and relays each
// connection to an upstream address dialled from the caller's own namespace.
// Tests and the lab use it to give daemons in node namespaces the API server.
package nsrelay

import (
	"fmt"
	"io"
	"net"
	"sync"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/vishvananda/netns"
)

// Relay listens on listenAddr inside ns and relays each connection to
// upstream, dialled in the calling process's namespace. The returned stop
// closes the listener and every open relayed connection, and waits for them.
func Relay(ns netns.NsHandle, listenAddr, upstream string) (stop func(), err error) {
	var ln net.Listener
	err = nsexec.Do(ns, func() error {
		var err error
		ln, err = net.Listen("tcp", listenAddr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening on %s inside the namespace: %w", listenAddr, err)
	}
	r := &relay{conns: map[net.Conn]bool{}}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			if !r.track(in) {
				in.Close()
				return
			}
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				r.pipe(in, upstream)
			}()
		}
	}()
	return func() {
		ln.Close()
		r.closeAll()
		r.wg.Wait()
	}, nil
}

type relay struct {
	wg     sync.WaitGroup
	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]bool
}

func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = true
	return true
}

func (r *relay) untrack(c net.Conn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.conns, c)
}

func (r *relay) closeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	for c := range r.conns {
		c.Close()
	}
}

func (r *relay) pipe(in net.Conn, upstream string) {
	defer r.untrack(in)
	defer in.Close()
	out, err := net.Dial("tcp", upstream)
	if err != nil {
		return
	}
	if !r.track(out) {
		out.Close()
		return
	}
	defer r.untrack(out)
	defer out.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(out, in); done <- struct{}{} }()
	go func() { _, _ = io.Copy(in, out); done <- struct{}{} }()
	<-done
}
