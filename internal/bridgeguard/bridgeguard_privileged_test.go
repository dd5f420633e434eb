package bridgeguard

import (
	"bytes"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/lab/attack"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

const podLabel = 100

// bridgedPods builds a node namespace with a bridge br0 and two pod
// namespaces, each with an eth0 whose peer is a port of br0.
func bridgedPods(t *testing.T) (node, attacker, victim *testnetns.NS) {
	t.Helper()
	node, attacker, victim = testnetns.New(t), testnetns.New(t), testnetns.New(t)
	nnl := node.Netlink()
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := nnl.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	if err := nnl.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	for i, pod := range []*testnetns.NS{attacker, victim} {
		port := fmt.Sprintf("veth%d", i)
		if err := nnl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: port, MasterIndex: mustIndex(t, nnl, "br0")}, PeerName: "eth0"}); err != nil {
			t.Fatal(err)
		}
		eth0, err := nnl.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		if err := nnl.LinkSetNsFd(eth0, int(pod.Handle)); err != nil {
			t.Fatal(err)
		}
		if err := nnl.LinkSetUp(mustLink(t, nnl, port)); err != nil {
			t.Fatal(err)
		}
		pnl := pod.Netlink()
		if err := pnl.LinkSetUp(mustLink(t, pnl, "eth0")); err != nil {
			t.Fatal(err)
		}
	}
	return node, attacker, victim
}

func mustLink(t *testing.T, nl *netlink.Handle, name string) netlink.Link {
	t.Helper()
	l, err := nl.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func mustIndex(t *testing.T, nl *netlink.Handle, name string) int {
	return mustLink(t, nl, name).Attrs().Index
}

// mplsCatcher counts the MPLS frames eth0 of ns receives, by payload.
type mplsCatcher struct{ fd int }

func catchMPLS(t *testing.T, ns *testnetns.NS) *mplsCatcher {
	t.Helper()
	var fd int
	err := ns.Do(func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		const proto = 0x4788 // htons(ETH_P_MPLS_UC)
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, proto)
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifi.Index, Protocol: uint16(proto)})
	})
	if err != nil {
		t.Fatalf("packet socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	tv := unix.Timeval{Usec: 300_000}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	return &mplsCatcher{fd: fd}
}

// count reads until the socket has been quiet for 300 ms and returns how
// many frames carried payload.
func (c *mplsCatcher) count(payload []byte) int {
	n := 0
	buf := make([]byte, 2048)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		got, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err != nil {
			break
		}
		if bytes.Equal(buf[:got], payload) {
			n++
		}
	}
	return n
}

// TestBridgedPodLabelIsDropped sends MPLS frames from one pod to another
// across a real bridge: with the guard, those with the pods' label are
// dropped and counted; those with another label, and those the node itself
// sends through the bridge (its local output, as the node's swap routes
// do), still arrive. Remove restores the first behaviour.
func TestBridgedPodLabelIsDropped(t *testing.T) {
	node, attacker, victim := bridgedPods(t)
	victimMAC, err := attack.LinkMAC(victim.Handle, "eth0")
	if err != nil {
		t.Fatal(err)
	}
	catcher := catchMPLS(t, victim)
	inner := []byte("forged client says hello")
	forged := attack.MPLS(podLabel, inner)
	other := attack.MPLS(podLabel+1, inner)
	send := func(from *testnetns.NS, link string, payload []byte) int {
		t.Helper()
		if err := attack.SendFrame(from.Handle, link, victimMAC, 0x8847, payload, 5); err != nil {
			t.Fatal(err)
		}
		return catcher.count(payload)
	}
	if got := send(attacker, "eth0", forged); got != 5 {
		t.Fatalf("without the guard, %d of 5 bridged frames with label %d arrived; the test's bridge does not bridge them", got, podLabel)
	}
	st, err := Read(node.Handle, podLabel)
	if err != nil || st.Present {
		t.Fatalf("before Install: %+v, %v", st, err)
	}
	if err := Install(node.Handle, podLabel, false); err != nil {
		t.Fatal(err)
	}
	if got := send(attacker, "eth0", forged); got != 0 {
		t.Errorf("with the guard, %d of 5 bridged frames with label %d arrived, want 0", got, podLabel)
	}
	if got := send(attacker, "eth0", other); got != 5 {
		t.Errorf("with the guard, %d of 5 bridged frames with label %d arrived, want 5 (only the pods' label is the guard's)", got, podLabel+1)
	}
	if got := send(node, "br0", forged); got != 5 {
		t.Errorf("with the guard, %d of 5 frames the node sent through br0 arrived, want 5", got)
	}
	st, err = Read(node.Handle, podLabel)
	if err != nil || !st.Present || !st.Current || st.Dropped != 5 {
		t.Errorf("after the attack: %+v, %v; want present, current, 5 dropped", st, err)
	}
	if st, err := Read(node.Handle, podLabel+7); err != nil || !st.Present || st.Current {
		t.Errorf("read for another label: %+v, %v; want present, not current", st, err)
	}
	// Replacing keeps one rule (for the new label).
	if err := Install(node.Handle, podLabel+1, true); err != nil {
		t.Fatal(err)
	}
	if got := send(attacker, "eth0", forged); got != 5 {
		t.Errorf("after replacing the label, %d of 5 frames with label %d arrived, want 5", got, podLabel)
	}
	if err := Remove(node.Handle); err != nil {
		t.Fatal(err)
	}
	if got := send(attacker, "eth0", other); got != 5 {
		t.Errorf("after Remove, %d of 5 frames with label %d arrived, want 5", got, podLabel+1)
	}
	if st, err := Read(node.Handle, podLabel); err != nil || st.Present {
		t.Errorf("after Remove: %+v, %v", st, err)
	}
	if err := Remove(node.Handle); err != nil {
		t.Errorf("Remove of an absent table: %v", err)
	}
}
