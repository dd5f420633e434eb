package carrierexempt

import (
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

const (
	block, mask = 0x1000, 0xffffff00
	// routerAddr sends the carrier; natAddr is the source the node's NAT
	// gives it (Flannel's masquerade, played by an SNAT rule).
	routerAddr = "10.77.0.1"
	podAddr    = "10.77.0.2"
	natAddr    = "10.77.0.99"
)

// carrierPath is a router namespace joined to a pod namespace by a veth,
// with a NAT rule in the router's that rewrites the source of every GRE
// packet it sends, and a raw GRE socket in the pod's namespace.
func carrierPath(t *testing.T) (router *testnetns.NS, received *net.IPConn) {
	testnetns.RequireRoot(t)
	router, pod := testnetns.New(t), testnetns.New(t)
	router.AddVeth("c-router", "c-pod", netip.MustParsePrefix(routerAddr+"/24"))
	l, err := router.Netlink().LinkByName("c-pod")
	if err != nil {
		t.Fatal(err)
	}
	if err := router.Netlink().LinkSetNsFd(l, int(pod.Handle)); err != nil {
		t.Fatal(err)
	}
	if l, err = pod.Netlink().LinkByName("c-pod"); err != nil {
		t.Fatal(err)
	}
	if err := pod.Netlink().AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(netip.MustParsePrefix(podAddr + "/24"))}); err != nil {
		t.Fatal(err)
	}
	if err := pod.Netlink().LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	router.Run("iptables", "-t", "nat", "-A", "POSTROUTING", "-p", "gre", "-j", "SNAT", "--to-source", natAddr)
	err = pod.Do(func() error {
		c, err := net.ListenPacket("ip4:gre", "0.0.0.0")
		if err == nil {
			received = c.(*net.IPConn)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { received.Close() })
	return router, received
}

// sendGRE sends one GRE packet from the router's namespace to the pod with
// the packet mark mark, and returns the source address the pod saw.
func sendGRE(t *testing.T, router *testnetns.NS, received *net.IPConn, mark uint32) netip.Addr {
	t.Helper()
	err := router.Do(func() error {
		c, err := net.ListenPacket("ip4:gre", "0.0.0.0")
		if err != nil {
			return err
		}
		defer c.Close()
		raw, err := c.(*net.IPConn).SyscallConn()
		if err != nil {
			return err
		}
		var sockErr error
		if err := raw.Control(func(fd uintptr) {
			sockErr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
		}); err != nil {
			return err
		}
		if sockErr != nil {
			return sockErr
		}
		// A GRE header carrying IPv4, then a few bytes.
		_, err = c.WriteTo([]byte{0, 0, 0x08, 0x00, 1, 2, 3, 4}, &net.IPAddr{IP: net.ParseIP(podAddr)})
		return err
	})
	if err != nil {
		t.Fatalf("sending GRE with mark %#x: %v", mark, err)
	}
	buf := make([]byte, 1500)
	_ = received.SetReadDeadline(time.Now().Add(3 * time.Second))
	_, from, err := received.ReadFrom(buf)
	if err != nil {
		t.Fatalf("the pod received no GRE packet with mark %#x: %v", mark, err)
	}
	a, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP)
	return a.Unmap()
}

// TestCarrierKeepsItsSourcePastTheNodesNAT sends GRE from a router's
// namespace whose NAT rewrites every GRE packet's source: without the
// table the pod sees the NAT's address; with it, a packet with one of the
// router's marks keeps the router's address, and a packet with another
// mark is still rewritten.
func TestCarrierKeepsItsSourcePastTheNodesNAT(t *testing.T) {
	router, received := carrierPath(t)
	if got := sendGRE(t, router, received, block|0x05); got.String() != natAddr {
		t.Fatalf("without the table the pod saw %v, want the NAT's %s: the test shows nothing", got, natAddr)
	}
	changed, err := Ensure(router.Handle, block, mask)
	if err != nil || !changed {
		t.Fatalf("Ensure = %v, %v; want a change", changed, err)
	}
	if got := sendGRE(t, router, received, block|0x05); got.String() != routerAddr {
		t.Errorf("with the table, the carrier reached the pod from %v, want the router's %s", got, routerAddr)
	}
	if got := sendGRE(t, router, received, 0x2000); got.String() != natAddr {
		t.Errorf("GRE with a mark not the router's reached the pod from %v, want the NAT's %s (tracked as before)", got, natAddr)
	}
	st, err := Read(router.Handle)
	if err != nil || !st.Current || st.Block != block || st.Mask != mask || st.Exempted != 1 {
		t.Errorf("Read = %+v, %v; want current, %#x/%#x, 1 packet exempted", st, err, block, mask)
	}
	if changed, err := Ensure(router.Handle, block, mask); err != nil || changed {
		t.Errorf("Ensure again = %v, %v; want no change", changed, err)
	}
	if changed, err := Ensure(router.Handle, 0x2000, mask); err != nil || !changed {
		t.Errorf("Ensure with other marks = %v, %v; want a change", changed, err)
	}
	if st, err := Read(router.Handle); err != nil || st.Block != 0x2000 {
		t.Errorf("Read after the change = %+v, %v", st, err)
	}
	if err := Remove(router.Handle); err != nil {
		t.Fatal(err)
	}
	if st, err := Read(router.Handle); err != nil || st.Present {
		t.Errorf("Read after Remove = %+v, %v", st, err)
	}
	if err := Remove(router.Handle); err != nil && !errors.Is(err, unix.ENOENT) {
		t.Errorf("Remove without the table: %v", err)
	}
}
