package datapath

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// The IPv6 datapath, on the fake kernel: the same plan as IPv4's, in
// IPv6 routes, rules and nexthop objects.

var node6 = netip.MustParseAddr("fd00:1::1")

// tunnel6 is tunnel for an IPv6 tunnel IP over IPv6 pods on a node with
// an IPv6 address.
func tunnel6(cfg Config, vip string, pods ...string) Tunnel {
	t := tunnel(cfg, vip, pods...)
	for b := range t.Table {
		t.Table[b].NodeIP = node6
	}
	return t
}

func route6(cfg Config, k *seamtest.Kernel, vip string, slot int) (rtnl.Route, bool) {
	r, ok := k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(slot)), Dst: netip.PrefixFrom(netip.MustParseAddr(vip), 128)}]
	return r, ok
}

func TestIPv6ResyncProgramsEverythingAndAdoptsOnRestart(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	k := seamtest.NewKernel()
	tunnels := []Tunnel{tunnel6(cfg, "2001:db8::1", "fd00:244::5", "fd00:244:1::6"), tunnel6(cfg, "2001:db8::2")}
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if len(k.Routes) != 2*cfg.Buckets || len(k.Rules) != len(cfg.SlotRules())+2 || len(k.Marked) != 2 || !k.DevUp {
		t.Fatalf("routes=%d rules=%d marked=%v dev=%v", len(k.Routes), len(k.Rules), k.Marked, k.DevUp)
	}
	for _, r := range k.Rules {
		if r.Family != unix.AF_INET6 {
			t.Fatalf("rule %+v is not IPv6", r)
		}
	}
	if len(k.NextHops) != 2 {
		t.Fatalf("%d nexthop objects, want one per endpoint (2): %v", len(k.NextHops), k.NextHops)
	}
	first, last := cfg.NextHopIDs()
	for b := 0; b < cfg.Buckets; b++ {
		r, _ := route6(cfg, k, "2001:db8::2", b)
		if r.Type != rtnl.Blackhole || r.NextHopID != 0 || r.Dst.Bits() != 128 {
			t.Errorf("bucket %d of a tunnel without endpoints: %v, want an IPv6 blackhole", b, r.String())
		}
		r, _ = route6(cfg, k, "2001:db8::1", b)
		n, ok := k.NextHops[r.NextHopID]
		if r.Type != rtnl.Unicast || r.IPEncap != nil || r.LinkIndex != 0 || r.Protocol != cfg.RouteProtocol || !ok {
			t.Fatalf("bucket %d: %v, want a route through a nexthop object", b, r.String())
		}
		if n.ID < first || n.ID > last || !n.IPv6 || n.Protocol != cfg.RouteProtocol || n.IPEncap == nil || !n.IPEncap.IPv6() ||
			n.IPEncap.Dst != tunnels[0].Table[b].Addr || n.LinkIndex != 42 || n.IPEncap.TTL != greTTL {
			t.Errorf("bucket %d: nexthop %v, want an IPv6 one of ours (id %#x-%#x) with IP6 encap to %v (hop limit %d) via link 42",
				b, n.String(), first, last, tunnels[0].Table[b].Addr, greTTL)
		}
	}
	before := k.Writes
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if k.Writes != before {
		t.Fatalf("restart made %d kernel writes, want 0", k.Writes-before)
	}
}

func TestIPv6ResyncRepairsDriftAndCleansUp(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	k := seamtest.NewKernel()
	foreignRoute := rtnl.Route{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("2001:db8:99::/64"), Type: rtnl.Unicast, Protocol: 4}
	k.Routes[foreignRoute.Key()] = foreignRoute
	first, _ := cfg.NextHopIDs()
	foreignObject := rtnl.NextHop{ID: first, Protocol: 4, IPv6: true, LinkIndex: 42}
	k.NextHops[first] = foreignObject
	foreignRule := netlink.Rule{Family: unix.AF_INET6, Priority: cfg.RulePriority, Table: 500, Mark: 9, Protocol: 4}
	k.Rules = append(k.Rules, foreignRule)
	d := newTestDatapath(cfg, k)
	tunnels := []Tunnel{tunnel6(cfg, "2001:db8::1", "fd00:244::5", "fd00:244:1::6")}
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	want := resolved(k.Routes, k.NextHops)
	// Drift: a route deleted, one changed to an inline encapsulation, a
	// stale tunnel IP's blackhole, an object changed, a rule deleted.
	r3, _ := route6(cfg, k, "2001:db8::1", 3)
	delete(k.Routes, r3.Key())
	r4, _ := route6(cfg, k, "2001:db8::1", 4)
	r4.NextHopID, r4.LinkIndex, r4.IPEncap = 0, 42, &rtnl.IPEncap{Dst: netip.MustParseAddr("fd00::9"), TTL: greTTL}
	k.Routes[r4.Key()] = r4
	stale := cfg.route(netip.MustParseAddr("2001:db8::99"), 5, nextHop{kind: hopDrop}, 0)
	k.Routes[stale.Key()] = stale
	r0, _ := route6(cfg, k, "2001:db8::1", 0)
	changed := k.NextHops[r0.NextHopID]
	changed.IPEncap = &rtnl.IPEncap{Dst: netip.MustParseAddr("fd00::8"), TTL: greTTL}
	k.NextHops[changed.ID] = changed
	k.Rules = slices.DeleteFunc(k.Rules, func(r netlink.Rule) bool { return r.Priority == cfg.Priority(2) && r.Protocol == cfg.RouteProtocol })
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if got := resolved(k.Routes, k.NextHops); got != want {
		t.Errorf("after the repair:\n%s\nwant:\n%s", got, want)
	}
	if len(k.Rules) != len(cfg.SlotRules())+2+1 {
		t.Errorf("%d rules, want %d ours + 1 foreign", len(k.Rules), len(cfg.SlotRules())+2)
	}
	if err := d.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if len(k.Routes) != 1 || len(k.Rules) != 1 || k.Rules[0].Table != 500 || k.Marked != nil || k.DevUp ||
		len(k.NextHops) != 1 || !ptr(k.NextHops[first]).Equal(&foreignObject) {
		t.Fatalf("after cleanup: routes=%v rules=%v marked=%v dev=%v nexthops=%v; want only the foreign route, rule and object",
			k.Routes, k.Rules, k.Marked, k.DevUp, k.NextHops)
	}
}

// TestIPv6MPLSRoutes: in mpls mode an IPv6 tunnel IP's buckets push the
// pod's IPv6 label towards the node's IPv6 address, inline.
func TestIPv6MPLSRoutes(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	cfg.Mode = encap.MPLS
	k := seamtest.NewKernel()
	var asked []netip.Addr
	nodeLink := func(ip netip.Addr) (int, error) { asked = append(asked, ip); return 7, nil }
	d := NewDatapath(cfg, k, k, k.Chain(), NoDevice{}, nodeLink, seamtest.QuietLog())
	pod := netip.MustParseAddr("fd00:244:1::1:5")
	tun := tunnel6(cfg, "2001:db8::1", pod.String())
	if err := d.Resync([]Tunnel{tun}); err != nil {
		t.Fatal(err)
	}
	label, err := mplslabel.ForEndpoint(pod)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := route6(cfg, k, "2001:db8::1", 0)
	if label < mplslabel.Base6 || r.NextHopID != 0 || !slices.Equal(r.MPLSLabels, []uint32{label}) || r.Gateway != node6 || r.LinkIndex != 7 || len(k.NextHops) != 0 {
		t.Fatalf("mpls route %v, nexthop objects %v; want label %d (IPv6 range) via %v inline", r.String(), k.NextHops, label, node6)
	}
	if len(asked) == 0 || slices.ContainsFunc(asked, func(a netip.Addr) bool { return a != node6 }) {
		t.Errorf("asked for the links towards %v, want only the node's IPv6 address", asked)
	}
	writes := k.Writes
	if err := NewDatapath(cfg, k, k, k.Chain(), NoDevice{}, nodeLink, seamtest.QuietLog()).Resync([]Tunnel{tun}); err != nil || k.Writes != writes {
		t.Fatalf("restart: %v, %d writes; want none", err, k.Writes-writes)
	}
	// A node known only by its IPv4 address cannot carry IPv6.
	tun.Table[0].NodeIP = netip.MustParseAddr("192.168.0.1")
	if err := d.SetTunnel(tun); err == nil || !strings.Contains(err.Error(), "no known IPv6 address") {
		t.Fatalf("endpoint whose node has no IPv6 address: %v", err)
	}
}

// TestDatapathRefusesTheOtherFamily: a tunnel IP of the other family, or an
// endpoint of the other family, is refused with ErrWrongFamily and programs
// nothing; the datapath's own tunnels go on.
func TestDatapathRefusesTheOtherFamily(t *testing.T) {
	v4cfg, v6cfg := testConfig(), testConfig().ForFamily(IPv6)
	k4, k6 := seamtest.NewKernel(), seamtest.NewKernel()
	v4, v6 := newTestDatapath(v4cfg, k4), newTestDatapath(v6cfg, k6)
	for _, tc := range []struct {
		name string
		d    *Datapath
		k    *seamtest.Kernel
		tun  Tunnel
	}{
		{"IPv6 tunnel IP to the IPv4 datapath", v4, k4, tunnel6(v4cfg, "2001:db8::1", "fd00:244::5")},
		{"IPv4 tunnel IP to the IPv6 datapath", v6, k6, tunnel(v6cfg, "192.0.2.1", "10.244.1.5")},
		{"IPv4-mapped tunnel IP to the IPv6 datapath", v6, k6, tunnel6(v6cfg, "::ffff:192.0.2.1", "fd00:244::5")},
		{"IPv4 endpoints of an IPv6 tunnel IP", v6, k6, tunnel6(v6cfg, "2001:db8::1", "10.244.1.5")},
		{"IPv6 endpoints of an IPv4 tunnel IP", v4, k4, tunnel(v4cfg, "192.0.2.1", "fd00:244::5")},
	} {
		writes := tc.k.Writes
		if err := tc.d.SetTunnel(tc.tun); !errors.Is(err, ErrWrongFamily) {
			t.Errorf("%s: SetTunnel = %v, want ErrWrongFamily", tc.name, err)
		}
		if tc.k.Writes != writes || len(tc.k.Routes) != 0 {
			t.Errorf("%s: %d writes, routes %v; want none", tc.name, tc.k.Writes-writes, tc.k.Routes)
		}
		if err := tc.d.RemoveTunnel(tc.tun.VIP); err != nil {
			t.Errorf("%s: RemoveTunnel = %v, want nothing to do", tc.name, err)
		}
	}
	own, other := tunnel6(v6cfg, "2001:db8::1", "fd00:244::5"), tunnel(v6cfg, "192.0.2.1", "10.244.1.5")
	err := v6.Resync([]Tunnel{other, own})
	if !errors.Is(err, ErrWrongFamily) || !strings.Contains(err.Error(), "192.0.2.1") {
		t.Fatalf("Resync with a tunnel of the other family: %v, want an error naming it", err)
	}
	if _, ok := route6(v6cfg, k6, "2001:db8::1", 0); !ok || len(k6.Routes) != v6cfg.Buckets {
		t.Errorf("the IPv6 tunnel was not programmed: %v", k6.Routes)
	}
}

// TestIPv6GenerationsCountIPv6Flows: the IPv6 datapath lists IPv6
// conntrack entries, and counts only IPv6 flows of its tunnel IPs, though
// IPv4 flows carry the same marks.
func TestIPv6GenerationsCountIPv6Flows(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	cfg.Buckets = 16
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	flows := &familyFlows{}
	d.EnableGenerationCollection(flows)
	vip := netip.MustParseAddr("2001:db8::1")
	pods := []string{"fd00:244::11", "fd00:244::12", "fd00:244:1::11", "fd00:244:1::12"}
	all := drainTunnel(cfg, vip.String(), pods)
	if err := d.Resync([]Tunnel{all}); err != nil {
		t.Fatal(err)
	}
	drained := drainTunnel(cfg, vip.String(), pods, "fd00:244:1::12")
	if err := d.SetTunnel(drained); err != nil {
		t.Fatal(err)
	}
	if got := k.Marked[vip]; got != cfg.GenerationOffset(1) {
		t.Fatalf("after draining, new flows use offset %#x, want generation 1's %#x", got, cfg.GenerationOffset(1))
	}
	if !sameAddrs(kernelTable(cfg, k, vip, 0), addrsOf(all)) || !sameAddrs(kernelTable(cfg, k, vip, 1), addrsOf(drained)) {
		t.Fatalf("generations %v and %v, want %v and %v", kernelTable(cfg, k, vip, 0), kernelTable(cfg, k, vip, 1), addrsOf(all), addrsOf(drained))
	}
	gen0 := cfg.Mark(cfg.Slot(0, 3))
	flows.entries = []*netlink.ConntrackFlow{flow(unix.IPPROTO_TCP, vip, gen0, 299)}
	if n, err := d.CollectGenerations(); err != nil || n != 0 {
		t.Fatalf("collected %d generations (%v) while an IPv6 flow uses generation 0", n, err)
	}
	if !slices.Equal(flows.asked, []netlink.InetFamily{unix.AF_INET6}) {
		t.Fatalf("listed conntrack families %v, want IPv6's", flows.asked)
	}
	// The IPv4 flow with generation 0's mark is not the IPv6 tunnel IP's.
	flows.entries = []*netlink.ConntrackFlow{flow(unix.IPPROTO_TCP, netip.MustParseAddr("192.0.2.1"), gen0, 299)}
	if n, err := d.CollectGenerations(); err != nil || n != 1 {
		t.Fatalf("collected %d generations (%v), want generation 0", n, err)
	}
	if !sameAddrs(kernelTable(cfg, k, vip, 1), addrsOf(drained)) || len(k.NextHops) != len(pods)-1 {
		t.Errorf("generation 1 %v, %d nexthop objects; want %v and the drained pod's object gone", kernelTable(cfg, k, vip, 1), len(k.NextHops), addrsOf(drained))
	}
	// restoredFlow itself keeps to the family, whatever a listing holds.
	v4 := flow(unix.IPPROTO_TCP, netip.MustParseAddr("192.0.2.1"), gen0, 299)
	if _, _, ok := d.restoredFlow(v4); ok {
		t.Error("the IPv6 datapath counts an IPv4 flow")
	}
	if _, _, ok := newTestDatapath(testConfig(), k).restoredFlow(flow(unix.IPPROTO_TCP, vip, gen0, 299)); ok {
		t.Error("the IPv4 datapath counts an IPv6 flow")
	}
}

// familyFlows is a conntrack table holding flows of both families, which
// lists, as the kernel does, only those of the family asked for.
type familyFlows struct {
	entries []*netlink.ConntrackFlow
	asked   []netlink.InetFamily
}

func (f *familyFlows) EachMarked(family netlink.InetFamily, ranges []ctmarks.Range, fn func(*netlink.ConntrackFlow)) error {
	f.asked = append(f.asked, family)
	for _, e := range markedIn(f.entries, ranges) {
		if (e.Forward.DstIP.To4() == nil) == (family == unix.AF_INET6) {
			fn(e)
		}
	}
	return nil
}
