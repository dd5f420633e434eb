package netpol

// Privileged test: the rendered rules on the real kernel, in a fresh
// network namespace standing in for a served pod, with the tunnel IP and
// the clients' addresses on lo (local packets to a local address cross
// INPUT like decapsulated ones).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

var (
	vip        = netip.MustParseAddr("192.0.2.10")
	officeA    = netip.MustParseAddr("203.0.113.1")
	officeExcl = netip.MustParseAddr("203.0.113.4")
	elsewhere  = netip.MustParseAddr("198.51.100.10")
)

// apply makes ns's filter table hold in for vip, as the agent does:
// read, plan the difference, restore. It then checks that a second pass
// has nothing to write (the parser reads back exactly what was written)
// and returns what the table holds.
func apply(t *testing.T, ns *testnetns.NS, in Ingress) Observed {
	t.Helper()
	return applyTo(t, ns, in, vip, "iptables")
}

// applyTo is apply for the tunnel IP to, with the iptables command of its
// family (iptables, ip6tables).
func applyTo(t *testing.T, ns *testnetns.NS, in Ingress, to netip.Addr, iptables string) Observed {
	t.Helper()
	want := Render(in, []netip.Addr{to})
	payload := Update(want, ParseSave(ns.Run(iptables+"-save", "-c")))
	if payload != nil {
		err := ns.Do(func() error {
			cmd := exec.Command(iptables+"-restore", "--noflush")
			cmd.Stdin = strings.NewReader(string(payload))
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("%s-restore: %v: %s\n%s", iptables, err, out, payload)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	have := ParseSave(ns.Run(iptables+"-save", "-c"))
	if again := Update(want, have); again != nil {
		t.Fatalf("after applying, the table does not read back as the policy; the agent would write again:\n%s\ntable:\n%s", again, ns.Run(iptables+"-save"))
	}
	return have
}

// dial connects from src to vip:port inside ns; a dropped SYN times out.
func dial(ns *testnetns.NS, src netip.Addr, port int) (net.Conn, error) {
	return dialTo(ns, src, vip, port)
}

// dialTo connects from src to to:port inside ns.
func dialTo(ns *testnetns.NS, src, to netip.Addr, port int) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 400 * time.Millisecond}
		var err error
		c, err = d.DialContext(context.Background(), "tcp", netip.AddrPortFrom(to, uint16(port)).String())
		return err
	})
	return c, err
}

func TestRulesOnTheKernel(t *testing.T) {
	ns := testnetns.New(t, netip.MustParsePrefix("192.0.2.10/32"), netip.MustParsePrefix("203.0.113.1/32"),
		netip.MustParsePrefix("203.0.113.4/32"), netip.MustParsePrefix("198.51.100.10/32"))
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		t.Skip("no iptables-restore")
	}
	// Echo servers on the tunnel IP, ports 80 and 443.
	for _, port := range []uint16{80, 443} {
		ns.ServeTCP("tcp4", netip.AddrPortFrom(vip, port), func(c net.Conn) { _, _ = io.Copy(c, c); c.Close() })
	}

	// Served before any policy: only connection tracking. A connection
	// opened now survives the first policy that isolates the pod, even one
	// that would not admit it as a new connection.
	apply(t, ns, Ingress{})
	before, err := dial(ns, elsewhere, 443)
	if err != nil {
		t.Fatalf("before any policy: %v", err)
	}
	defer before.Close()
	if err := echo(before); err != nil {
		t.Fatal(err)
	}

	office := &networkingv1.NetworkPolicy{Spec: networkingv1.NetworkPolicySpec{Ingress: []networkingv1.NetworkPolicyIngressRule{{
		From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/29", Except: []string{"203.0.113.4/32"}}}},
		Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromInt32(80))}},
	}}}}
	office.Namespace = served.Namespace
	in, problems := ForPod(served, []*networkingv1.NetworkPolicy{office}, cluster)
	if len(problems) > 0 {
		t.Fatal(problems)
	}
	apply(t, ns, in)
	if err := echo(before); err != nil {
		t.Errorf("a connection opened before the first policy broke when the policy isolated the pod: %v", err)
	}
	t.Logf("rules:\n%s", ns.Run("iptables", "-S", Chain)+ns.Run("iptables", "-S", Chain+"-0"))
	for _, c := range []struct {
		src  netip.Addr
		port int
		want bool
	}{
		{officeA, 80, true}, {officeA, 443, false}, {officeExcl, 80, false}, {elsewhere, 80, false},
	} {
		conn, err := dial(ns, c.src, c.port)
		if conn != nil {
			conn.Close()
		}
		if got := err == nil; got != c.want {
			t.Errorf("%v -> %v:%d: connected %t (%v), want %t", c.src, vip, c.port, got, err, c.want)
		}
		if got := in.Allows(c.src, "TCP", uint16(c.port)); got != c.want {
			t.Errorf("Ingress.Allows(%v, %d) = %t, the kernel's verdict is to be %t", c.src, c.port, got, c.want)
		}
	}

	// An open connection survives a change to deny-all; a new one does not.
	conn, err := dial(ns, officeA, 80)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	apply(t, ns, Ingress{Isolated: true})
	if err := echo(conn); err != nil {
		t.Errorf("the open connection broke when the policy changed: %v", err)
	}
	if c, err := dial(ns, officeA, 80); err == nil {
		c.Close()
		t.Error("a new connection passed a deny-all policy")
	}
	// Not isolated any more: everything passes.
	apply(t, ns, Ingress{})
	if c, err := dial(ns, elsewhere, 443); err != nil {
		t.Errorf("without isolation: %v", err)
	} else {
		c.Close()
	}
	// Denied-all again: every refused SYN is counted on the tunnel IP's DROP.
	apply(t, ns, Ingress{Isolated: true})
	for range 2 {
		if c, err := dial(ns, elsewhere, 80); err == nil {
			c.Close()
			t.Error("a new connection passed a deny-all policy")
		}
	}
	have := ParseSave(ns.Run("iptables-save", "-c"))
	if d := have.Dropped[vip]; d.Packets < 2 || d.Bytes == 0 {
		t.Errorf("dropped counters of %v: %+v, want at least the 2 refused SYNs", vip, d)
	}
	// Removed: nothing of ours is left, and nothing else was touched.
	ns.Run("iptables", "-A", "INPUT", "-s", "192.0.2.99/32", "-j", "ACCEPT")
	if err := ns.Do(func() error {
		cmd := exec.Command("iptables-restore", "--noflush")
		cmd.Stdin = strings.NewReader(string(Update(nil, have)))
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	after := ns.Run("iptables-save")
	if o := ParseSave(after); !o.Empty() {
		t.Errorf("after removal the table still holds the agent's rules: %+v\n%s", o, after)
	}
	if !strings.Contains(after, "-A INPUT -s 192.0.2.99/32 -j ACCEPT") {
		t.Errorf("removal touched a rule it did not write:\n%s", after)
	}
}

func echo(c net.Conn) error {
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != "ping\n" {
		return errors.New("garbled echo")
	}
	return nil
}

// TestRulesOnTheKernelIPv6: the rules of an IPv6 tunnel IP in ip6tables,
// from a policy whose peers are of both families: the IPv6 ones admit, the
// IPv4 ones are left out (ip6tables would refuse them), and removal leaves
// the pod's own rule.
func TestRulesOnTheKernelIPv6(t *testing.T) {
	vip6 := netip.MustParseAddr("2001:db8::10")
	office6, excl6, elsewhere6 := netip.MustParseAddr("2001:db8:77::1"), netip.MustParseAddr("2001:db8:77::4"), netip.MustParseAddr("2001:db8:99::10")
	ns := testnetns.New(t)
	if _, err := exec.LookPath("ip6tables-restore"); err != nil {
		t.Skip("no ip6tables-restore")
	}
	// nodad: usable at once (an IPv6 address is tentative a moment even on lo).
	for _, a := range []netip.Addr{vip6, office6, excl6, elsewhere6} {
		ns.Run("ip", "-6", "addr", "add", a.String()+"/128", "dev", "lo", "nodad")
	}
	var l net.Listener
	if err := ns.Do(func() (err error) { l, err = net.Listen("tcp6", netip.AddrPortFrom(vip6, 80).String()); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	ns.Run("ip6tables", "-A", "INPUT", "-s", "2001:db8:5::1/128", "-j", "ACCEPT") // the pod's own

	office := &networkingv1.NetworkPolicy{Spec: networkingv1.NetworkPolicySpec{Ingress: []networkingv1.NetworkPolicyIngressRule{{
		From: []networkingv1.NetworkPolicyPeer{
			{IPBlock: &networkingv1.IPBlock{CIDR: "2001:db8:77::/64", Except: []string{"2001:db8:77::4/128"}}},
			{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/29"}},
		},
		Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromInt32(80))}},
	}}}}
	office.Namespace = served.Namespace
	in, problems := ForPod(served, []*networkingv1.NetworkPolicy{office}, cluster)
	if len(problems) > 0 {
		t.Fatal(problems)
	}
	have := applyTo(t, ns, in, vip6, "ip6tables")
	if rules := ns.Run("ip6tables", "-S"); strings.Contains(rules, "203.0.113") {
		t.Fatalf("an IPv4 peer in the IPv6 rules:\n%s", rules)
	}
	for _, c := range []struct {
		src  netip.Addr
		want bool
	}{{office6, true}, {excl6, false}, {elsewhere6, false}} {
		conn, err := dialTo(ns, c.src, vip6, 80)
		if conn != nil {
			conn.Close()
		}
		if got := err == nil; got != c.want {
			t.Errorf("%v -> [%v]:80: connected %t (%v), want %t", c.src, vip6, got, err, c.want)
		}
		if got := in.Allows(c.src, "TCP", 80); got != c.want {
			t.Errorf("Ingress.Allows(%v) = %t, the kernel's verdict is to be %t", c.src, got, c.want)
		}
	}
	have = ParseSave(ns.Run("ip6tables-save", "-c"))
	if d := have.Dropped[vip6]; d.Packets == 0 {
		t.Errorf("dropped counters of %v: %+v, want the refused SYNs", vip6, d)
	}
	if err := ns.Do(func() error {
		cmd := exec.Command("ip6tables-restore", "--noflush")
		cmd.Stdin = strings.NewReader(string(Update(nil, have)))
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	after := ns.Run("ip6tables-save")
	if o := ParseSave(after); !o.Empty() || !strings.Contains(after, "-A INPUT -s 2001:db8:5::1/128 -j ACCEPT") {
		t.Errorf("after removal:\n%s", after)
	}
}
