package rtnl

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// testNS is a fresh network namespace with lo up and a veth pair whose
// veth0 (192.0.2.1/24) serves as the device of encap routes.
type testNS struct {
	name   string
	handle netns.NsHandle
	veth   int // ifindex of veth0
}

var netnsCounter atomic.Int64

// requireRoot skips tests that need CAP_NET_ADMIN and namespaces.
func requireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root (network namespaces, route programming)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		tb.Skip("needs iproute2's ip")
	}
}

// newTestNS creates the namespace and removes it when the test ends.
func newTestNS(tb testing.TB) *testNS {
	tb.Helper()
	requireRoot(tb)
	name := fmt.Sprintf("rtnl-test-%d-%d", os.Getpid(), netnsCounter.Add(1))
	runIP(tb, "netns", "add", name)
	tb.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			tb.Errorf("delete netns %s: %v: %s", name, err, out)
		}
	})
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "veth0", "type", "veth", "peer", "name", "veth1"},
		{"addr", "add", "192.0.2.1/24", "dev", "veth0"},
		{"link", "set", "veth0", "up"},
		{"link", "set", "veth1", "up"},
	} {
		runIP(tb, append([]string{"-n", name}, args...)...)
	}
	h, err := netns.GetFromName(name)
	if err != nil {
		tb.Fatalf("open netns %s: %v", name, err)
	}
	tb.Cleanup(func() { h.Close() })
	return &testNS{name: name, handle: h, veth: linkIndex(tb, h, "veth0")}
}

func linkIndex(tb testing.TB, ns netns.NsHandle, name string) int {
	tb.Helper()
	nh, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		tb.Fatalf("netlink handle: %v", err)
	}
	defer nh.Close()
	l, err := nh.LinkByName(name)
	if err != nil {
		tb.Fatalf("link %s: %v", name, err)
	}
	return l.Attrs().Index
}

// runIP runs ip with args and returns its output, failing the test on error.
func runIP(tb testing.TB, args ...string) string {
	tb.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		tb.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// open returns a Client for the namespace, closed when the test ends.
func (ns *testNS) open(tb testing.TB) *Client {
	tb.Helper()
	c, err := Open(ns.handle)
	if err != nil {
		tb.Fatalf("Open: %v", err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}

func netipToIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
