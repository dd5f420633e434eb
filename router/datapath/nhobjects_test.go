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
	if n := unsafe.Sizeof(nextHop{}); n != 16 {
		t.Errorf("nextHop is %d bytes, want 16 (the router keeps one per slot per tunnel IP, twice)", n)
	}
}

func TestNextHopIDs(t *testing.T) {
	for _, tc := range []struct {
		protocol    uint8
		first, last uint32
	}{
		{245, 0xf5000001, 0xf5ffffff},
		{5, 0x05000001, 0x05ffffff},
		{255, 0xff000001, 0xffffffff},
	} {
		cfg := testConfig()
		cfg.RouteProtocol = tc.protocol
		if first, last := cfg.NextHopIDs(); first != tc.first || last != tc.last {
			t.Errorf("protocol %d: ids %#x-%#x, want %#x-%#x", tc.protocol, first, last, tc.first, tc.last)
		}
	}
}

func TestNexthopTableAllocatesFreeIDsAndWraps(t *testing.T) {
	cfg := testConfig()
	cfg.RouteProtocol = 255
	first, last := cfg.NextHopIDs()
	nt := newNexthopTable(cfg)
	nt.load(cfg, []rtnl.NextHop{
		{ID: first, Protocol: 4, LinkIndex: 1},                        // another owner's, in the range
		cfg.nextHopObject(greHop("10.244.0.2"), first+1),              // ours
		{ID: first + 2, Protocol: cfg.RouteProtocol, Blackhole: true}, // ours, not built by the router
	})
	nt.next = last
	var got []uint32
	for i := range 3 {
		id, err := nt.allocate(greHop(fmt.Sprintf("10.244.1.%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
	}
	if want := []uint32{last, first + 3, first + 4}; !slices.Equal(got, want) {
		t.Errorf("allocated %#x, want %#x (after the last id, the first free ones)", got, want)
	}
	if nt.ids[greHop("10.244.1.0")] != last || nt.hops[last] != greHop("10.244.1.0") {
		t.Errorf("allocation not recorded: %v %v", nt.ids, nt.hops)
	}
}

func TestNexthopTableKeepsOneObjectPerNextHop(t *testing.T) {
	cfg := testConfig()
	first, _ := cfg.NextHopIDs()
	h := greHop("10.244.0.2")
	nt := newNexthopTable(cfg)
	nt.load(cfg, []rtnl.NextHop{cfg.nextHopObject(h, first+9), cfg.nextHopObject(h, first+3)})
	if nt.ids[h] != first+3 {
		t.Errorf("next hop %v maps to %#x, want the lower id of its two objects %#x", h, nt.ids[h], first+3)
	}
	// A route through the other one is rewritten, and keeps it alive
	// until then.
	vip := netip.MustParseAddr("192.0.2.1")
	r := cfg.route(vip, 0, h, first+9)
	if _, _, got, _ := cfg.hopOf(&r, nt); got.kind != hopUnknown || nt.idOf(got) != first+9 {
		t.Errorf("route through the duplicate reads as %v (id %d), want an unknown route using it", got, nt.idOf(got))
	}
}

func greHop(pod string) nextHop {
	return nextHop{kind: hopGRE, addr: netip.MustParseAddr(pod).As4(), link: 42}
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
			for key, r := range k.Routes {
				if r.NextHopID == 0 {
					continue
				}
				h := cfg.hopOfNextHop(ptr(k.NextHops[r.NextHopID]))
				k.Routes[key] = cfg.inlineRoute(vip, int(r.Table)-cfg.TableBase, h)
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
	stray := cfg.nextHopObject(greHop("10.9.9.8"), first+50)
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
