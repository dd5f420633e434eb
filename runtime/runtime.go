// Package runtime finds the network namespace of a pod on this node, for the
// endpoint agent. It asks the container runtime (Docker, or containerd and
// CRI-O through the CRI API) for the pod's sandbox, and falls back to a
// runtime-free search for the namespace that holds the pod's addresses (its
// IPv4 and its IPv6 one, whichever it has).
//
// A Locator only finds and opens a namespace; it never changes one. The
// caller owns the returned handle and must close it.
package runtime

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netns"
)

// ErrNotFound means the runtime has no running sandbox for the pod (not started
// yet, or gone). The caller retries later with back-off.
var ErrNotFound = errors.New("pod sandbox not found")

// ErrHostNetwork means the pod's sandbox shares the node's network namespace
// (a host-network pod). It is never handed out, and no fallback is tried.
var ErrHostNetwork = errors.New("pod sandbox uses the host network namespace; refusing to hand it out")

// Pod identifies the pod whose network namespace is wanted.
type Pod struct {
	Namespace string
	Name      string
	UID       string
	// IP is the pod's IPv4 address and IPv6 its IPv6 address, from
	// status.podIPs; each is the zero Addr when the pod has no address of
	// that family (an IPv6-only pod has no IP).
	IP   netip.Addr
	IPv6 netip.Addr
}

func (p Pod) String() string { return p.Namespace + "/" + p.Name }

// Addrs returns the pod's addresses, IPv4 first; none when it has no
// address yet.
func (p Pod) Addrs() []netip.Addr {
	var out []netip.Addr
	for _, a := range []netip.Addr{p.IP, p.IPv6} {
		if a.IsValid() {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// Addr returns the pod's address of the family of ip (IP for an IPv4
// one, IPv6 for an IPv6 one).
func (p Pod) Addr(ipv6 bool) netip.Addr {
	if ipv6 {
		return p.IPv6
	}
	return p.IP
}

// Netns is an opened network namespace of a pod.
type Netns struct {
	// Handle is an open file descriptor of the namespace; the caller closes it.
	Handle netns.NsHandle
	// Path is where it was opened from, for logs (/proc/PID/ns/net, /var/run/netns/NAME).
	Path string
	// Via names the Locator that found it ("docker", "cri", "netns").
	Via string
}

// Close closes the namespace handle.
func (n Netns) Close() error { return n.Handle.Close() }

// Locator finds the network namespace of a pod.
type Locator interface {
	// Name is a short name for logs and the --runtime flag: docker, cri, netns.
	Name() string
	// Locate opens the network namespace of the pod's running sandbox. It
	// returns an error wrapping ErrNotFound when there is none.
	Locate(ctx context.Context, pod Pod) (Netns, error)
	// Close releases connections to the runtime.
	Close() error
}

// NotFoundf returns an error wrapping ErrNotFound with a description.
func NotFoundf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrNotFound, fmt.Sprintf(format, args...))
}
