// Package nsexec runs code inside another network namespace safely, for the
// few things that need a thread in it: sysctls under /proc/sys/net, and
// commands an operator would run there.
//
// Do runs the function on a fresh goroutine locked to its own OS thread,
// switches that thread into the namespace and never switches back nor unlocks
// it: the Go runtime terminates the thread when the goroutine ends, so no other
// goroutine ever runs in the namespace by accident, and a failed switch-back
// cannot leave a thread in the wrong place. Netlink work does not need this:
// use a handle bound to the namespace (netlink.NewHandleAt).
package nsexec

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// OnDiscardedThread runs fn on a new goroutine locked to its OS thread and
// waits for it. The goroutine never unlocks, so the runtime discards the
// thread, with whatever namespace fn left it in, when fn returns.
func OnDiscardedThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread, on purpose.
		errc <- fn()
	}()
	return <-errc
}

// Do runs fn with its thread inside the network namespace ns.
func Do(ns netns.NsHandle, fn func() error) error {
	return OnDiscardedThread(func() error {
		if err := netns.Set(ns); err != nil {
			return fmt.Errorf("entering network namespace: %w", err)
		}
		return fn()
	})
}

// NetlinkSocket opens a netlink socket of protocol (unix.NETLINK_ROUTE,
// unix.NETLINK_NETFILTER, ...) with the extra socket flags (such as
// unix.SOCK_NONBLOCK), bound to a kernel-chosen port, in network namespace
// ns, or in the caller's when ns is not open. A socket stays in the
// namespace it was created in, so no later call on it switches namespaces.
// The thread that entered ns is reused only if it got back to its own.
func NetlinkSocket(ns netns.NsHandle, protocol, flags int) (int, error) {
	if !ns.IsOpen() {
		return netlinkSocket(protocol, flags)
	}
	type result struct {
		fd  int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		fd, restored, err := netlinkSocketIn(ns, protocol, flags)
		if restored {
			runtime.UnlockOSThread()
		}
		done <- result{fd, err}
	}()
	r := <-done
	return r.fd, r.err
}

// netlinkSocketIn runs on a locked thread; restored reports whether the
// thread is back in its original namespace.
func netlinkSocketIn(ns netns.NsHandle, protocol, flags int) (fd int, restored bool, err error) {
	orig, err := netns.Get()
	if err != nil {
		return -1, true, fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		return -1, true, fmt.Errorf("enter netns %s: %w", ns, err)
	}
	fd, err = netlinkSocket(protocol, flags)
	// The socket keeps its namespace; a failed return only costs the thread.
	return fd, netns.Set(orig) == nil, err
}

func netlinkSocket(protocol, flags int) (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|flags, protocol)
	if err != nil {
		return -1, fmt.Errorf("create netlink socket (protocol %d): %w", protocol, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind netlink socket (protocol %d): %w", protocol, err)
	}
	return fd, nil
}
