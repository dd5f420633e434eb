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
