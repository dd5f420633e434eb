package replyexempt

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/internal/nfttable"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The tunnel IPs the pod serves, and the client's addresses.
var (
	vip4, vip6       = netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("2001:db8:7::7")
	client4, client6 = netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("fd01::1")
)

// asymmetricPath builds what a tunneled connection looks like to the pod's
// node: the client reaches the pod's tunnel IP over a link of its own (the
// carrier, which the node does not see inside), and the pod replies through
// its node, which forwards the replies to the client. The node holds
// kube-proxy's rule that drops conntrack INVALID packets in forwarding, in
// both families. rp_filter is off on the paths, as the tunnel needs it.
func asymmetricPath(t *testing.T) (client, node, pod *testnetns.NS) {
	t.Helper()
	client, node = testnetns.New(t), testnetns.New(t)
	pod = testnetns.New(t, netip.PrefixFrom(vip4, 32), netip.PrefixFrom(vip6, 128))
	for _, ns := range []*testnetns.NS{client, node, pod} {
		ns.Run("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
			"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")
	}
	link(t, client, "c-node", "10.1.0.1/24", "fd01::1/64", node, "n-client", "10.1.0.2/24", "fd01::2/64")
	link(t, node, "n-pod", "10.2.0.1/24", "fd02::1/64", pod, "p-node", "10.2.0.2/24", "fd02::2/64")
	link(t, client, "c-pod", "10.3.0.1/24", "fd03::1/64", pod, "p-client", "10.3.0.2/24", "fd03::2/64")
	// From the client's address on the node's side, so that the replies
	// go through the node.
	client.Run("ip", "route", "add", vip4.String()+"/32", "via", "10.3.0.2", "src", client4.String())
	client.Run("ip", "-6", "route", "add", vip6.String()+"/128", "via", "fd03::2", "src", client6.String())
	pod.Run("ip", "route", "add", "default", "via", "10.2.0.1")
	pod.Run("ip", "-6", "route", "add", "default", "via", "fd02::1")
	for _, bin := range []string{"iptables", "ip6tables"} {
		node.Run(bin, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
	}
	return client, node, pod
}

// link connects namespace a (interface an, addresses a4 and a6) to b.
func link(t *testing.T, a *testnetns.NS, an, a4, a6 string, b *testnetns.NS, bn, b4, b6 string) {
	t.Helper()
	anl := a.Netlink()
	if err := anl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: an}, PeerName: bn}); err != nil {
		t.Fatal(err)
	}
	peer, err := anl.LinkByName(bn)
	if err != nil {
		t.Fatal(err)
	}
	if err := anl.LinkSetNsFd(peer, int(b.Handle)); err != nil {
		t.Fatal(err)
	}
	for _, side := range []struct {
		ns           *testnetns.NS
		name, v4, v6 string
	}{{a, an, a4, a6}, {b, bn, b4, b6}} {
		side.ns.Run("sysctl", "-qw", "net.ipv4.conf."+side.name+".rp_filter=0")
		side.ns.Run("ip", "addr", "add", side.v4, "dev", side.name)
		side.ns.Run("ip", "-6", "addr", "add", side.v6, "dev", side.name, "nodad")
		side.ns.Run("ip", "link", "set", side.name, "up")
	}
}

// echoOn listens on addr:7 in ns and echoes one line per connection.
func echoOn(t *testing.T, ns *testnetns.NS, addr netip.Addr) {
	t.Helper()
	ns.ServeTCP("tcp", netip.AddrPortFrom(addr, 7), func(c net.Conn) {
		defer c.Close()
		line, _ := bufio.NewReader(c).ReadString('\n')
		_, _ = c.Write([]byte(line))
	})
}

// roundTrip connects from ns to addr:7 and checks the echo.
func roundTrip(ns *testnetns.NS, addr netip.Addr) error {
	var c net.Conn
	if err := ns.Do(func() (err error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		c, err = (&net.Dialer{}).DialContext(ctx, "tcp", netip.AddrPortFrom(addr, 7).String())
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("hello\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "hello\n" {
		return fmt.Errorf("echo %q", line)
	}
	return nil
}

// invalidDrops reads the packet counter of the node's INVALID drop rule.
func invalidDrops(t *testing.T, node *testnetns.NS, bin string) string {
	t.Helper()
	for _, line := range strings.Split(node.Run(bin+"-save", "-c", "-t", "filter"), "\n") {
		if strings.Contains(line, "INVALID") && strings.Contains(line, "DROP") {
			return strings.Fields(line)[0] // [packets:bytes]
		}
	}
	t.Fatalf("no INVALID drop rule in the node's %s", bin)
	return ""
}

// TestRepliesPassKubeProxysInvalidDrop: with kube-proxy's rule on the
// pod's node, a tunneled TCP handshake fails, since the node's conntrack
// sees the SYN-ACK first and marks it INVALID; with the table, the replies
// from the tunnel IPs on the pod's interface are untracked and the
// connection works, in both families.
func TestRepliesPassKubeProxysInvalidDrop(t *testing.T) {
	client, node, pod := asymmetricPath(t)
	for _, vip := range []netip.Addr{vip4, vip6} {
		echoOn(t, pod, vip)
	}
	for _, tc := range []struct {
		vip netip.Addr
		bin string
	}{{vip4, "iptables"}, {vip6, "ip6tables"}} {
		if err := roundTrip(client, tc.vip); err == nil {
			t.Fatalf("a connection to %v through kube-proxy's INVALID drop worked without the table: the test shows nothing", tc.vip)
		} else {
			t.Logf("without the table, to %v: %v; the node's INVALID drop counted %s", tc.vip, err, invalidDrops(t, node, tc.bin))
		}
	}

	want := Want{Sources: []netip.Addr{vip6, vip4}, Links: []string{"n-pod"}}
	if err := Install(node.Handle, want, false); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.Addr{vip4, vip6} {
		if err := roundTrip(client, vip); err != nil {
			t.Errorf("with the table, to %v: %v", vip, err)
		}
	}
	st, err := Read(node.Handle)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Present || !st.Current || !st.Have.Equal(want) || st.Exempted == 0 {
		t.Errorf("state after Install: %+v, want current with %+v and packets exempted", st, want)
	}
	t.Logf("with the table: both connections worked; %d reply packets untracked", st.Exempted)
	// What an operator reads: nft lists the interface by its name (a set
	// without its key's byte order showed every name as "").
	if _, err := exec.LookPath("nft"); err == nil {
		if out := node.Run("nft", "list", "set", "inet", Table, setLinks); !strings.Contains(out, `"n-pod"`) {
			t.Errorf("nft list set inet %s %s shows no \"n-pod\":\n%s", Table, setLinks, out)
		}
	}

	// The table is the only exemption: replies from another address, or
	// on another interface, are tracked as before.
	other := Want{Sources: []netip.Addr{netip.MustParseAddr("198.51.100.8")}, Links: []string{"n-pod"}}
	if err := Install(node.Handle, other, true); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(client, vip4); err == nil {
		t.Error("a reply from a tunnel IP not in the table passed the INVALID drop")
	}
	if err := Install(node.Handle, Want{Sources: want.Sources, Links: []string{"n-client"}}, true); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(client, vip4); err == nil {
		t.Error("a reply arriving on an interface not in the table passed the INVALID drop")
	}
	if st, err := Read(node.Handle); err != nil || !st.Current || st.Have.Links[0] != "n-client" {
		t.Errorf("state after replacing: %+v, %v", st, err)
	}

	if err := Remove(node.Handle); err != nil {
		t.Fatal(err)
	}
	if st, err := Read(node.Handle); err != nil || st.Present {
		t.Errorf("state after Remove: %+v, %v", st, err)
	}
	if err := Remove(node.Handle); err != nil {
		t.Errorf("Remove without the table: %v", err)
	}
}

// TestProbeLeavesNothing: the kernel check's probe writes its table and
// removes it, and refuses the agent's own table's name.
func TestProbeLeavesNothing(t *testing.T) {
	node := testnetns.New(t)
	if err := Probe(node.Handle, "kst-probe"); err != nil {
		t.Fatal(err)
	}
	if out := node.Run("iptables-save"); strings.Contains(out, "kst-probe") {
		t.Errorf("probe left %s", out)
	}
	if err := Probe(node.Handle, Table); err == nil {
		t.Error("Probe accepted the agent's own table name")
	}
	c, err := nfttable.Conn(node.Handle)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := c.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	if len(tables) != 0 {
		t.Errorf("after the probe the namespace holds %d nftables tables, want 0", len(tables))
	}
}
