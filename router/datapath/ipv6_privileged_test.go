package datapath

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The IPv6 datapath on the real kernel of a test namespace, next to an
// IPv4 one. The host has neither GRE nor ip6gre nor MPLS: a veth stands in
// for the flow-based device (the kernel takes IP6 encapsulations, in routes
// and AF_INET6 nexthop objects, on any device), and the HMARK chains are
// fakes (package hmark tests its own). What only the lab can show: packets
// leaving through ip6gre, and mpls mode's IPv6 routes.

// familyRouter is one family's Datapath on the namespace's kernel, with
// counting seams; marks is its fake HMARK chain, kept across restarts.
type familyRouter struct {
	dp     *Datapath
	routes *seamtest.CountingRoutes
	rules  *seamtest.CountingRules
	marks  *seamtest.Kernel
}

func (r *familyRouter) writes() int { return r.routes.Writes + r.rules.Writes }

func newFamilyRouter(ns *testnetns.NS, cfg Config, marks *seamtest.Kernel) *familyRouter {
	nl := ns.Netlink()
	r := &familyRouter{routes: &seamtest.CountingRoutes{Client: ns.Routes()}, rules: &seamtest.CountingRules{Handle: nl}, marks: marks}
	r.dp = NewDatapath(cfg, r.routes, r.rules, marks.Chain(), &ExistingDevice{Name: "veth0", Links: nl}, nil, seamtest.QuietLog())
	return r
}

// familyState is what an operator sees of one family: its routes (without
// the ones the kernel adds for addresses and links by itself), nexthop
// objects and rules.
func familyState(ns *testnetns.NS, f Family) string {
	flag := "-4"
	if f == IPv6 {
		flag = "-6"
	}
	var routes []string
	for _, l := range strings.Split(ns.Run("ip", flag, "route", "show", "table", "all"), "\n") {
		if !strings.Contains(l, "fe80::") && !strings.Contains(l, "table local") && !strings.HasPrefix(l, "multicast") {
			routes = append(routes, l)
		}
	}
	return strings.Join(routes, "\n") + ns.Run("ip", flag, "nexthop", "show") + ns.Run("ip", flag, "rule", "show")
}

func TestIPv6DatapathInNetns(t *testing.T) {
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	ns.Run("ip", "-6", "addr", "add", "fd00:50::1/64", "dev", "veth0", "nodad")
	cfg := testConfig()
	cfg.Buckets = 16
	cfg6 := cfg.ForFamily(IPv6)
	proto := fmt.Sprint(cfg.RouteProtocol)

	// IPv6 state that is not the router's: it must survive everything.
	first6, _ := cfg6.NextHopIDs()
	ns.Run("ip", "-6", "route", "add", "2001:db8:99::/64", "dev", "veth0", "table", fmt.Sprint(cfg.Table(0)), "proto", "static")
	ns.Run("ip", "-6", "route", "add", "2001:db8::1/128", "dev", "veth0", "table", "100", "proto", proto)
	ns.Run("ip", "-6", "nexthop", "add", "id", fmt.Sprint(first6), "encap", "ip6", "dst", "fd00:244::5", "hoplimit", "64", "dev", "veth0", "proto", "static")
	ns.Run("ip", "-6", "nexthop", "add", "id", "78", "encap", "ip6", "dst", "fd00:244::5", "hoplimit", "64", "dev", "veth0", "proto", proto)
	ns.Run("ip", "-6", "rule", "add", "pref", fmt.Sprint(cfg.Priority(1)), "fwmark", "0x99", "lookup", "100")
	// A probe: another owner's route in each slot table, to a destination
	// of the slot's own (see below).
	probe := func(b int) netip.Addr { return netip.AddrFrom16([16]byte{0xfd, 0, 0, 0xff, 15: byte(b + 1)}) }
	for b := 0; b < cfg.Buckets; b++ {
		ns.Run("ip", "-6", "route", "add", "2001:db8:ff::1/128", "encap", "ip6", "dst", probe(b).String(), "dev", "veth0", "table", fmt.Sprint(cfg.Table(b)), "proto", "static")
	}
	pristine6, pristine4 := familyState(ns, IPv6), familyState(ns, IPv4)

	marks4, marks6 := seamtest.NewKernel(), seamtest.NewKernel()
	v4, v6 := newFamilyRouter(ns, cfg, marks4), newFamilyRouter(ns, cfg6, marks6)
	fs, err := NewFamilies(v4.dp, v6.dp)
	if err != nil {
		t.Fatal(err)
	}
	withEndpoints := tunnel6(cfg, "2001:db8::1", "fd00:244::5", "fd00:244:1::6", "fd00:244:2::7")
	withoutEndpoints := tunnel6(cfg, "2001:db8::2")
	tunnel4 := tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6")
	tunnels := []Tunnel{withEndpoints, withoutEndpoints, tunnel4}
	if err := fs.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	programmed6, programmed4 := familyState(ns, IPv6), familyState(ns, IPv4)
	if programmed6 == pristine6 || !strings.Contains(programmed6, "encap ip6") || !strings.Contains(programmed4, "encap ip ") {
		t.Fatalf("Resync programmed nothing:\n%s\n%s", programmed6, programmed4)
	}

	t.Run("the kernel routes each bucket's mark to its endpoint over IPv6", func(t *testing.T) {
		for b := 0; b < cfg.Buckets; b++ {
			// The IPv6 slot rules send the mark to the slot's table: the
			// probe's route there answers. (IPv6 reports the table of the
			// route that first used a nexthop object's cached route for
			// every route through it, so the router's own routes cannot
			// show it.)
			mark := fmt.Sprintf("%#x", cfg.Mark(b))
			if got := ns.Run("ip", "-6", "route", "get", "2001:db8:ff::1", "mark", mark); !strings.Contains(got, "dst "+probe(b).String()+" ") {
				t.Errorf("bucket %d (mark %s): the probe says %q, want table %d's route to %v", b, mark, got, cfg.Table(b), probe(b))
			}
			got := ns.Run("ip", "-6", "route", "get", "2001:db8::1", "mark", mark)
			want := "dst " + withEndpoints.Table[b].Addr.String() + " hoplimit 64"
			if !strings.Contains(got, "encap ip6 id 0") || !strings.Contains(got, want) {
				t.Errorf("bucket %d (mark %s): ip -6 route get says %q, want encap ip6 to %s", b, mark, got, withEndpoints.Table[b].Addr)
			}
			if out, err := ns.Output("ip", "-6", "route", "get", "2001:db8::2", "mark", mark); err == nil && !strings.Contains(out, "blackhole") {
				t.Errorf("bucket %d: tunnel IP without endpoints is routed: %q", b, out)
			}
		}
		blackholes := ns.Run("ip", "-6", "route", "show", "table", "all", "proto", proto, "type", "blackhole")
		if n := strings.Count(blackholes, "blackhole 2001:db8::2 "); n != cfg.Buckets {
			t.Errorf("%d IPv6 blackhole routes, want one per bucket:\n%s", n, blackholes)
		}
		// One AF_INET6 nexthop object per endpoint, in IPv6's id range,
		// besides the foreign ones.
		ids := routerNextHopIDs(ns, cfg6)
		objects := ns.Run("ip", "-6", "nexthop", "show", "proto", proto)
		if len(ids) != 3 || ids[0] != first6+1 || strings.Count(objects, "encap ip6") != 3+1 {
			t.Errorf("IPv6 nexthop objects %v (want 3 from %#x):\n%s", ids, first6+1, objects)
		}
		// The slot rules, in IPv6: the same priorities, marks and tables.
		rules := ns.Run("ip", "-6", "rule", "show")
		for _, b := range []int{0, cfg.Buckets - 1} {
			if want := fmt.Sprintf("%d:\tfrom all fwmark %#x lookup %d proto %d", cfg.Priority(b), cfg.Mark(b), cfg.Table(b), cfg.RouteProtocol); !strings.Contains(rules, want) {
				t.Errorf("ip -6 rule show lacks %q:\n%s", want, rules)
			}
		}
	})

	t.Run("a restarted router changes nothing", func(t *testing.T) {
		again6, again4 := newFamilyRouter(ns, cfg6, marks6), newFamilyRouter(ns, cfg, marks4)
		again, err := NewFamilies(again4.dp, again6.dp)
		if err != nil {
			t.Fatal(err)
		}
		if err := again.Resync(tunnels); err != nil {
			t.Fatal(err)
		}
		if w := again6.writes() + again4.writes(); w != 0 {
			t.Errorf("restart made %d kernel writes, want 0", w)
		}
		if got := familyState(ns, IPv6); got != programmed6 {
			t.Errorf("restart changed the kernel state:\nbefore:\n%s\nafter:\n%s", programmed6, got)
		}
	})

	t.Run("one family's resync leaves the other's alone", func(t *testing.T) {
		// Drift in both families; an IPv6 resync repairs IPv6's only.
		ns.Run("ip", "-6", "route", "del", "2001:db8::1/128", "table", fmt.Sprint(cfg.Table(3)))
		ns.Run("ip", "-6", "route", "replace", "2001:db8::1/128", "encap", "ip6", "dst", "fd00::9", "hoplimit", "64", "dev", "veth0", "table", fmt.Sprint(cfg.Table(4)), "proto", proto)
		ns.Run("ip", "-6", "route", "add", "blackhole", "2001:db8::77/128", "table", fmt.Sprint(cfg.Table(5)), "proto", proto)
		ns.Run("ip", "-6", "rule", "del", "pref", fmt.Sprint(cfg.Priority(6)), "proto", proto)
		ids := routerNextHopIDs(ns, cfg6)
		ns.Run("ip", "-6", "nexthop", "replace", "id", fmt.Sprint(ids[1]), "encap", "ip6", "dst", "fd00::8", "hoplimit", "64", "dev", "veth0", "proto", proto)
		ns.Run("ip", "-4", "route", "del", "192.0.2.1/32", "table", fmt.Sprint(cfg.Table(3)))
		drifted4 := familyState(ns, IPv4)
		if err := v6.dp.Resync([]Tunnel{withEndpoints, withoutEndpoints}); err != nil {
			t.Fatal(err)
		}
		if got := familyState(ns, IPv6); withoutNextHopIDs(got) != withoutNextHopIDs(programmed6) {
			t.Errorf("IPv6 drift not repaired:\nwant:\n%s\ngot:\n%s", programmed6, got)
		}
		if got := familyState(ns, IPv4); got != drifted4 {
			t.Errorf("the IPv6 resync changed IPv4:\nbefore:\n%s\nafter:\n%s", drifted4, got)
		}
		programmed6 = familyState(ns, IPv6)
		if err := v4.dp.Resync([]Tunnel{tunnel4}); err != nil {
			t.Fatal(err)
		}
		if got := familyState(ns, IPv4); got != programmed4 {
			t.Errorf("IPv4 drift not repaired:\nwant:\n%s\ngot:\n%s", programmed4, got)
		}
		if got := familyState(ns, IPv6); got != programmed6 {
			t.Errorf("the IPv4 resync changed IPv6:\nbefore:\n%s\nafter:\n%s", programmed6, got)
		}
		if w := newFamilyRouter(ns, cfg6, marks6); w.dp.Resync([]Tunnel{withEndpoints, withoutEndpoints}) != nil || w.writes() != 0 {
			t.Errorf("a restart after the repair made %d writes, want 0", w.writes())
		}
	})

	t.Run("draining starts a generation, kept for its flows and adopted", func(t *testing.T) {
		pods := []string{"fd00:244::5", "fd00:244:1::6", "fd00:244:2::7"}
		drained := drainTunnel(cfg6, "2001:db8::1", pods, "fd00:244:2::7")
		before := v6.writes()
		if err := fs.SetTunnel(drained); err != nil {
			t.Fatal(err)
		}
		// The new generation's routes, through the existing objects.
		if w := v6.writes() - before; w != cfg.Buckets {
			t.Errorf("%d writes for a new generation, want %d (one route per bucket)", w, cfg.Buckets)
		}
		if g := fs.CurrentGeneration(drained.VIP); g != 1 {
			t.Errorf("generation %d after draining, want 1", g)
		}
		for b := 0; b < cfg.Buckets; b++ {
			got := ns.Run("ip", "-6", "route", "get", "2001:db8::1", "mark", fmt.Sprintf("%#x", cfg.Mark(cfg.Slot(0, b))))
			if !strings.Contains(got, "dst "+withEndpoints.Table[b].Addr.String()+" ") {
				t.Errorf("generation 0, bucket %d: %q, want it kept on %v", b, got, withEndpoints.Table[b].Addr)
			}
			got = ns.Run("ip", "-6", "route", "get", "2001:db8::1", "mark", fmt.Sprintf("%#x", cfg.Mark(cfg.Slot(1, b))))
			if !strings.Contains(got, "dst "+drained.Table[b].Addr.String()+" ") {
				t.Errorf("generation 1, bucket %d: %q, want %v", b, got, drained.Table[b].Addr)
			}
		}
		if err := fs.RemoveTunnel(withoutEndpoints.VIP); err != nil {
			t.Fatal(err)
		}
		if got := ns.Run("ip", "-6", "route", "show", "table", "all"); strings.Contains(got, "2001:db8::2 ") {
			t.Errorf("routes of the removed tunnel remain:\n%s", got)
		}
		if w := newFamilyRouter(ns, cfg6, marks6); w.dp.Resync([]Tunnel{drained}) != nil || w.writes() != 0 {
			t.Errorf("adopting two generations made %d writes, want 0", w.writes())
		}
	})

	t.Run("cleanup restores each family as it was", func(t *testing.T) {
		before4 := familyState(ns, IPv4)
		if err := newFamilyRouter(ns, cfg6, marks6).dp.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if got := familyState(ns, IPv6); got != pristine6 {
			t.Errorf("after the IPv6 cleanup:\n%s\nwant the state before the router ran:\n%s", got, pristine6)
		}
		if got := familyState(ns, IPv4); got != before4 {
			t.Errorf("the IPv6 cleanup changed IPv4:\n%s\nwas:\n%s", got, before4)
		}
		if err := fs.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if got := familyState(ns, IPv4); got != pristine4 {
			t.Errorf("after the cleanup:\n%s\nwant:\n%s", got, pristine4)
		}
		if got := familyState(ns, IPv6); got != pristine6 {
			t.Errorf("after the cleanup:\n%s\nwant:\n%s", got, pristine6)
		}
	})
}
