package testnetns

import (
	"github.com/cmdnu/kube-service-tunnel/test/support/nsrelay"
	"github.com/vishvananda/netns"
)

// ForwardLoopback makes addr (a host loopback address such as the test API
// server's 127.0.0.1:PORT) reachable at the same address inside the
// namespace ns: it listens inside ns and relays each connection to addr in
// the calling process's own namespace. It returns a function that stops it.
func ForwardLoopback(ns netns.NsHandle, addr string) (stop func(), err error) {
	return nsrelay.Relay(ns, addr, addr)
}
