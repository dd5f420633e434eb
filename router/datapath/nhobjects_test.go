package datapath

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

func TestNextHopStaysSixteenBytes(t *testing.T) {
	// 16 bytes at 10,000 tunnel IPs x 64 buckets: 10 MB per state. The
	// address is an index into the addrTable (about 90 bytes per distinct
	// pod or node address); an IPv6 address inline would make it 28 bytes.
	if n := unsafe.Sizeof(nextHop{}); n != 16 {
		t.Errorf("nextHop is %d bytes, want 16 (the router keeps one per slot per tunnel IP, twice)", n)
	}
}

func TestNextHopIDs(t *testing.T) {
	for _, tc := range []struct {
		protocol    uint8
		family      Family
		first, last uint32
	}{
		{245, IPv4, 0xf5000001, 0xf57fffff},
		{245, IPv6, 0xf5800000, 0xf5ffffff},
		{5, IPv4, 0x05000001, 0x057fffff},
		{255, IPv4, 0xff000001, 0xff7fffff},
		{255, IPv6, 0xff800000, 0xffffffff},
	} {
		cfg := testConfig().ForFamily(tc.family)
		cfg.RouteProtocol = tc.protocol
		if first, last := cfg.NextHopIDs(); first != tc.first || last != tc.last {
			t.Errorf("protocol %d %v: ids %#x-%#x, want %#x-%#x", tc.protocol, tc.family, first, last, tc.first, tc.last)
		}
	}
}

// TestNextHopOwnership: each family owns its objects precisely, by
// protocol, family and id; IPv4 keeps the ids older routers gave it in the
// upper half of the block, which IPv6 allocates from but skips those.
func TestNextHopOwnership(t *testing.T) {
	v4, v6 := testConfig(), testConfig().ForFamily(IPv6)
	first4, last4 := v4.NextHopIDs()
	first6, last6 := v6.NextHopIDs()
	obj := func(id uint32, ipv6 bool, protocol uint8) rtnl.NextHop {
		return rtnl.NextHop{ID: id, IPv6: ipv6, Protocol: protocol, LinkIndex: 42}
	}
	for _, tc := range []struct {
		name       string
		n          rtnl.NextHop
		own4, own6 bool
	}{
		{"ipv4 in the ipv4 range", obj(first4, false, v4.RouteProtocol), true, false},
		{"ipv4 of an older router, upper half", obj(last6, false, v4.RouteProtocol), true, false},
		{"ipv6 in the ipv6 range", obj(first6, true, v4.RouteProtocol), false, true},
		{"ipv6 in the ipv4 range", obj(last4, true, v4.RouteProtocol), false, false},
		{"another protocol", obj(first6, true, 4), false, false},
		{"id 0 of the block", obj(first4-1, false, v4.RouteProtocol), false, false},
		{"the next block", obj(last6+1, true, v4.RouteProtocol), false, false},
	} {
		if got := v4.ownsNextHop(&tc.n); got != tc.own4 {
			t.Errorf("%s: IPv4 owns it: %v, want %v", tc.name, got, tc.own4)
		}
		if got := v6.ownsNextHop(&tc.n); got != tc.own6 {
			t.Errorf("%s: IPv6 owns it: %v, want %v", tc.name, got, tc.own6)
		}
	}
	// The IPv6 allocator skips an older IPv4 object in its range.
	nt := newNexthopTable(v6, newAddrTable())
	nt.load(v6, []rtnl.NextHop{obj(first6, false, v4.RouteProtocol)})
	if id, err := nt.allocate(greHop(nt.addrs, "fd00::1")); err != nil || id != first6+1 {
		t.Errorf("allocated %#x (%v), want %#x: the first id is an IPv4 object's", id, err, first6+1)
	}
}

func TestNexthopTableAllocatesFreeIDsAndWraps(t *testing.T) {
	cfg := testConfig()
	cfg.RouteProtocol = 255
	first, last := cfg.NextHopIDs()
	addrs := newAddrTable()
	nt := newNexthopTable(cfg, addrs)
	nt.load(cfg, []rtnl.NextHop{
		{ID: first, Protocol: 4, LinkIndex: 1},                                    // another owner's, in the range
		cfg.nextHopObject(greHop(addrs, "10.244.0.2"), first+1, addrs),            // ours
		{ID: first + 2, Protocol: cfg.RouteProtocol, Blackhole: true},             // ours, not built by the router
		{ID: first + 3, Protocol: cfg.RouteProtocol, IPv6: true, Blackhole: true}, // IPv6's, in IPv4's range
	})
	nt.next = last
	var got []uint32
	for i := range 3 {
		id, err := nt.allocate(greHop(addrs, fmt.Sprintf("10.244.1.%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
	}
	if want := []uint32{last, first + 4, first + 5}; !slices.Equal(got, want) {
		t.Errorf("allocated %#x, want %#x (after the last id, the first free ones)", got, want)
	}
	if nt.ids[greHop(addrs, "10.244.1.0")] != last || nt.hops[last] != greHop(addrs, "10.244.1.0") {
		t.Errorf("allocation not recorded: %v %v", nt.ids, nt.hops)
	}
}

func TestNexthopTableKeepsOneObjectPerNextHop(t *testing.T) {
	cfg := testConfig()
	first, _ := cfg.NextHopIDs()
	addrs := newAddrTable()
	h := greHop(addrs, "10.244.0.2")
	nt := newNexthopTable(cfg, addrs)
	nt.load(cfg, []rtnl.NextHop{cfg.nextHopObject(h, first+9, addrs), cfg.nextHopObject(h, first+3, addrs)})
	if nt.ids[h] != first+3 {
		t.Errorf("next hop %v maps to %#x, want the lower id of its two objects %#x", h, nt.ids[h], first+3)
	}
	// A route through the other one is rewritten, and keeps it alive
	// until then.
	vip := netip.MustParseAddr("192.0.2.1")
	r := cfg.route(vip, 0, h, first+9)
	if _, _, got, _ := cfg.hopOf(&r, nt, addrs); got.kind != hopUnknown || nt.idOf(got) != first+9 {
		t.Errorf("route through the duplicate reads as %v (id %d), want an unknown route using it", got, nt.idOf(got))
	}
}

// greHop is the gre next hop to pod (of either family) over device 42, pod
// interned in addrs.
func greHop(addrs *addrTable, pod string) nextHop {
	return nextHop{kind: hopGRE, addr: addrs.intern(netip.MustParseAddr(pod)), link: 42}
}

// TestNextHopObjectsComeFirstAndGoLast checks the order of the kernel
// writes: an object before the first route that uses it, its deletion
// after the last route that used it is gone (deleting it first would
// delete the routes).
func TestNextHopObjectsComeFirstAndGoLast(t *testing.T) {
	cfg := testConfig()
	cfg.Generations = 1
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	if err := d.Resync(nil); err != nil {
		t.Fatal(err)
	}
	k.Journal = nil
	if err := d.SetTunnel(tunnel(cfg, "192.0.2.1", "10.244.1.5")); err != nil {
		t.Fatal(err)
	}
	if len(k.Journal) < 2 || !strings.HasPrefix(k.Journal[0], "nexthop+ ") || len(k.NextHops) != 1 {
		t.Fatalf("journal %v, want the nexthop object first", k.Journal)
	}
	k.Journal = nil
	if err := d.SetTunnel(tunnel(cfg, "192.0.2.1", "10.244.1.6")); err != nil {
		t.Fatal(err)
	}
	j := k.Journal
	if len(j) != 1+cfg.Buckets+1 || !strings.HasPrefix(j[0], "nexthop+ ") || !strings.HasPrefix(j[len(j)-1], "nexthop- ") {
		t.Fatalf("journal %v, want the new pod's object, the routes, then the old object's deletion", j)
	}
	if len(k.NextHops) != 1 {
		t.Errorf("%d nexthop objects, want 1", len(k.NextHops))
	}
	k.Journal = nil
	if err := d.RemoveTunnel(netip.MustParseAddr("192.0.2.1")); err != nil {
		t.Fatal(err)
	}
	if j := k.Journal; !strings.HasPrefix(j[len(j)-1], "nexthop- ") || len(k.NextHops) != 0 || len(k.Routes) != 0 {
		t.Errorf("journal %v, nexthops %v: want everything gone, the object last", j, k.NextHops)
	}
}

// TestSharedNextHopObjects: endpoints shared by tunnel IPs share one object,
// which stays while any route uses it.
func TestSharedNextHopObjects(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	a := tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.1.6")
	b := tunnel(cfg, "192.0.2.2", "10.244.1.6", "10.244.1.7")
	if err := d.Resync([]Tunnel{a, b}); err != nil {
		t.Fatal(err)
	}
	if len(k.NextHops) != 3 {
		t.Fatalf("%d nexthop objects, want 3 (one per pod)", len(k.NextHops))
	}
	if err := d.RemoveTunnel(a.VIP); err != nil {
		t.Fatal(err)
	}
	if len(k.NextHops) != 2 {
		t.Fatalf("%d nexthop objects after removing %v, want those of %v's 2 pods", len(k.NextHops), a.VIP, b.VIP)
	}
	writes := k.Writes
	if err := newTestDatapath(cfg, k).Resync([]Tunnel{b}); err != nil || k.Writes != writes {
		t.Errorf("restart: %v, %d writes, want none", err, k.Writes-writes)
	}
}

// TestUpgradeFromInlineRoutes: a router of an earlier version left routes
// with inline next hops, in two generations. The new one rewrites them to
// nexthop objects in place: no generation switch, each generation keeps its
// endpoints. (mpls mode keeps inline routes: TestMPLSRoutes.)
func TestUpgradeFromInlineRoutes(t *testing.T) {
	for _, mode := range []encap.Mode{encap.GRE} {
		t.Run(string(mode), func(t *testing.T) {
			cfg := testConfig()
			cfg.Mode = mode
			k := seamtest.NewKernel()
			d := newTestDatapath(cfg, k)
			vip := netip.MustParseAddr("192.0.2.1")
			pods := []string{"10.244.1.11", "10.244.1.12", "10.244.2.11"}
			all := drainTunnel(cfg, vip.String(), pods)
			drained := drainTunnel(cfg, vip.String(), pods, "10.244.2.11")
			if err := d.Resync([]Tunnel{all}); err != nil {
				t.Fatal(err)
			}
			if err := d.SetTunnel(drained); err != nil {
				t.Fatal(err)
			}
			want := resolved(k.Routes, k.NextHops)
			// What the earlier version wrote: the same next hops, inline.
			addrs := newAddrTable()
			for key, r := range k.Routes {
				if r.NextHopID == 0 {
					continue
				}
				h := cfg.hopOfNextHop(ptr(k.NextHops[r.NextHopID]), addrs)
				k.Routes[key] = cfg.inlineRoute(vip, int(r.Table)-cfg.TableBase, h, addrs)
			}
			clear(k.NextHops)

			writes := k.Writes
			if err := newTestDatapath(cfg, k).Resync([]Tunnel{drained}); err != nil {
				t.Fatal(err)
			}
			if got := resolved(k.Routes, k.NextHops); got != want {
				t.Errorf("after the upgrade:\n%s\nwant:\n%s", got, want)
			}
			if w := k.Writes - writes; w != len(k.Routes)+len(k.NextHops) {
				t.Errorf("%d writes, want one per route and nexthop object (%d)", w, len(k.Routes)+len(k.NextHops))
			}
			writes = k.Writes
			if err := newTestDatapath(cfg, k).Resync([]Tunnel{drained}); err != nil || k.Writes != writes {
				t.Errorf("second restart: %v, %d writes, want none", err, k.Writes-writes)
			}
		})
	}
}

// resolved formats routes with the content of their nexthop objects, sorted,
// leaving the ids out.
func resolved(routes map[rtnl.RouteKey]rtnl.Route, nexthops map[uint32]rtnl.NextHop) string {
	var lines []string
	for _, r := range routes {
		line := r.String()
		if n, ok := nexthops[r.NextHopID]; ok {
			n.ID = 0
			line = strings.Replace(line, fmt.Sprintf("nhid %d", r.NextHopID), "via object "+n.String(), 1)
		}
		lines = append(lines, line)
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func ptr[T any](v T) *T { return &v }

// TestNextHopDriftRepaired: objects deleted or changed behind the router's
// back, and a stray one of its own, are repaired by a resync; another
// owner's object in the router's id range is skipped and left alone.
func TestNextHopDriftRepaired(t *testing.T) {
	cfg := testConfig()
	first, _ := cfg.NextHopIDs()
	k := seamtest.NewKernel()
	foreign := rtnl.NextHop{ID: first, Protocol: 4, LinkIndex: 42, IPEncap: &rtnl.IPEncap{Dst: netip.MustParseAddr("10.9.9.1")}}
	k.NextHops[foreign.ID] = foreign
	d := newTestDatapath(cfg, k)
	tunnels := []Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6", "10.244.3.7")}
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	want := resolved(k.Routes, k.NextHops)
	var ids []uint32
	for id := range k.NextHops {
		if id != foreign.ID {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	if len(ids) != 3 || ids[0] != first+1 {
		t.Fatalf("nexthop ids %#x, want 3 from %#x (the first one is taken)", ids, first+1)
	}
	k.DeleteNextHop(ids[0])
	changed := k.NextHops[ids[1]]
	changed.IPEncap = &rtnl.IPEncap{Dst: netip.MustParseAddr("10.9.9.9"), TTL: greTTL}
	k.NextHops[ids[1]] = changed
	addrs := newAddrTable()
	stray := cfg.nextHopObject(greHop(addrs, "10.9.9.8"), first+50, addrs)
	k.NextHops[stray.ID] = stray
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if got := resolved(k.Routes, k.NextHops); got != want {
		t.Errorf("after the repair:\n%s\nwant:\n%s", got, want)
	}
	if len(k.NextHops) != 4 || !ptr(k.NextHops[foreign.ID]).Equal(&foreign) {
		t.Errorf("nexthops %v: want the 3 endpoints' and the other owner's, unchanged", k.NextHops)
	}
}
