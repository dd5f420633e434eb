package datapath

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

func testConfig() Config {
	cfg := DefaultConfig()
	cfg.Buckets, cfg.Seed, cfg.GenerationCheckPeriod = 8, 1, time.Second
	return cfg
}

func newTestDatapath(cfg Config, k *seamtest.Kernel) *Datapath {
	return NewDatapath(cfg, k, k, k.Chain(), k.Device(), func(ip netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
}

func tunnel(cfg Config, vip string, pods ...string) Tunnel {
	var eps []netip.Addr
	for _, p := range pods {
		eps = append(eps, netip.MustParseAddr(p))
	}
	t := Tunnel{VIP: netip.MustParseAddr(vip)}
	for _, a := range bucket.Assign(cfg.Buckets, eps) {
		t.Table = append(t.Table, Endpoint{Addr: a, NodeName: "node-" + a.String(), NodeIP: netip.MustParseAddr("192.168.0.1")})
	}
	return t
}

func TestResyncProgramsEverythingAndAdoptsOnRestart(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	tunnels := []Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6"), tunnel(cfg, "192.0.2.2")}
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	// The slot rules' tree, the guard and its target.
	if len(k.Routes) != 2*cfg.Buckets || len(k.Rules) != len(cfg.SlotRules())+2 || len(k.Marked) != 2 || !k.DevUp {
		t.Fatalf("routes=%d rules=%d marked=%v dev=%v", len(k.Routes), len(k.Rules), k.Marked, k.DevUp)
	}
	if len(k.NextHops) != 2 {
		t.Fatalf("%d nexthop objects, want one per endpoint (2): %v", len(k.NextHops), k.NextHops)
	}
	first, last := cfg.NextHopIDs()
	for b := 0; b < cfg.Buckets; b++ {
		r := k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(b)), Dst: netip.MustParsePrefix("192.0.2.2/32")}]
		if r.Type != rtnl.Blackhole || r.NextHopID != 0 {
			t.Errorf("bucket %d of a tunnel without endpoints: %v, want blackhole", b, r.String())
		}
		r = k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(b)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
		n, ok := k.NextHops[r.NextHopID]
		if r.Type != rtnl.Unicast || r.IPEncap != nil || r.LinkIndex != 0 || !ok {
			t.Fatalf("bucket %d: %v, want a route through a nexthop object", b, r.String())
		}
		if n.ID < first || n.ID > last || n.Protocol != cfg.RouteProtocol || n.IPEncap == nil ||
			n.IPEncap.Dst != tunnels[0].Table[b].Addr || n.LinkIndex != 42 || n.IPEncap.TTL != greTTL {
			t.Errorf("bucket %d: nexthop %v, want ours (id %#x-%#x, proto %d) with encap to %v via link 42", b, n.String(), first, last, cfg.RouteProtocol, tunnels[0].Table[b].Addr)
		}
	}

	// A restarted router (a new Datapath over the same kernel) changes nothing.
	before := k.Writes
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if k.Writes != before {
		t.Fatalf("restart made %d kernel writes, want 0", k.Writes-before)
	}
}

func TestResyncRepairsDriftAndLeavesForeignStateAlone(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	foreignRoute := rtnl.Route{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("198.51.100.0/24"), Type: rtnl.Unicast, Protocol: 4}
	otherTable := rtnl.Route{Table: 100, Dst: netip.MustParsePrefix("192.0.2.1/32"), Type: rtnl.Blackhole, Protocol: cfg.RouteProtocol}
	k.Routes[foreignRoute.Key()] = foreignRoute
	k.Routes[otherTable.Key()] = otherTable
	foreignRule := netlink.Rule{Priority: cfg.RulePriority, Table: 500, Mark: 9, Protocol: 4}
	k.Rules = append(k.Rules, foreignRule)

	d := newTestDatapath(cfg, k)
	tunnels := []Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6")}
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	// Drift: a route deleted by hand, one changed by hand, a stale tunnel IP, a rule deleted.
	delete(k.Routes, rtnl.RouteKey{Table: uint32(cfg.Table(3)), Dst: netip.MustParsePrefix("192.0.2.1/32")})
	changed := k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(4)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
	changed.NextHopID, changed.LinkIndex = 0, 42
	changed.IPEncap = &rtnl.IPEncap{Dst: netip.MustParseAddr("10.9.9.9"), TTL: greTTL}
	k.Routes[changed.Key()] = changed
	stale := cfg.route(netip.MustParseAddr("192.0.2.99"), 5, nextHop{kind: hopDrop}, 0)
	k.Routes[stale.Key()] = stale
	k.Rules = slices.DeleteFunc(k.Rules, func(r netlink.Rule) bool { return r.Priority == cfg.Priority(2) && r.Protocol == cfg.RouteProtocol })

	before := k.Writes
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if got := k.Writes - before; got != 4 {
		t.Errorf("repair made %d writes, want 4 (2 routes replaced, 1 stale deleted, 1 rule added)", got)
	}
	if _, ok := k.Routes[stale.Key()]; ok {
		t.Error("stale tunnel IP route survived")
	}
	if _, ok := k.Routes[foreignRoute.Key()]; !ok {
		t.Error("route of another protocol in our table was removed")
	}
	if _, ok := k.Routes[otherTable.Key()]; !ok {
		t.Error("route outside our tables was removed")
	}
	if len(k.Rules) != len(cfg.SlotRules())+2+1 {
		t.Errorf("%d rules, want %d ours + 1 foreign", len(k.Rules), len(cfg.SlotRules())+2)
	}

	if err := d.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if len(k.Routes) != 2 || len(k.Rules) != 1 || k.Marked != nil || k.DevUp || len(k.NextHops) != 0 {
		t.Fatalf("after cleanup: routes=%v rules=%v marked=%v dev=%v nexthops=%v; want only the foreign route, rule and nothing else", k.Routes, k.Rules, k.Marked, k.DevUp, k.NextHops)
	}
}

func TestRoutesBeforeMarksAndMarksBeforeRouteRemoval(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	if err := d.Resync(nil); err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr("192.0.2.1")
	if err := d.SetTunnel(tunnel(cfg, vip.String(), "10.244.1.5")); err != nil {
		t.Fatal(err)
	}
	if err := d.RemoveTunnel(vip); err != nil {
		t.Fatal(err)
	}
	firstMark, firstUnmark := slices.Index(k.Journal, "mark+ "+vip.String()), slices.Index(k.Journal, "mark- "+vip.String())
	lastRouteAdd, firstRouteDel := -1, -1
	for i, j := range k.Journal {
		if j == "route+ "+vip.String() {
			lastRouteAdd = i
		}
		if j == "route- "+vip.String() && firstRouteDel < 0 {
			firstRouteDel = i
		}
	}
	if firstMark < lastRouteAdd || firstMark < 0 {
		t.Errorf("mark added before routes: %v", k.Journal)
	}
	if firstRouteDel < firstUnmark || firstUnmark < 0 {
		t.Errorf("routes deleted before the mark: %v", k.Journal)
	}
	if len(k.Routes) != 0 {
		t.Errorf("%d routes left after RemoveTunnel", len(k.Routes))
	}
}

func TestRemovingOneEndpointTouchesOnlyMovedBuckets(t *testing.T) {
	cfg := testConfig()
	cfg.Buckets = 64
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	var pods []string
	for i := 1; i <= 10; i++ {
		pods = append(pods, fmt.Sprintf("10.244.%d.%d", i, i))
	}
	before := tunnel(cfg, "192.0.2.1", pods...)
	if err := d.Resync([]Tunnel{before}); err != nil {
		t.Fatal(err)
	}
	after := tunnel(cfg, "192.0.2.1", pods[1:]...)
	writes := k.Writes
	if err := d.SetTunnel(after); err != nil {
		t.Fatal(err)
	}
	movedBuckets := 0
	for b := range before.Table {
		if before.Table[b] != after.Table[b] {
			movedBuckets++
		}
	}
	// The removed pod's nexthop object goes once no route uses it.
	if got := k.Writes - writes; got != movedBuckets+1 {
		t.Fatalf("%d kernel writes, want one per moved bucket (%d) and the nexthop object's deletion", got, movedBuckets)
	}
	if len(k.NextHops) != len(pods)-1 {
		t.Errorf("%d nexthop objects, want one per remaining pod (%d)", len(k.NextHops), len(pods)-1)
	}
}

func TestMPLSRoutes(t *testing.T) {
	cfg := testConfig()
	cfg.Mode = encap.MPLS
	k := seamtest.NewKernel()
	d := NewDatapath(cfg, k, k, k.Chain(), NoDevice{}, func(ip netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
	tun := tunnel(cfg, "192.0.2.1", "10.244.1.5")
	if err := d.Resync([]Tunnel{tun}); err != nil {
		t.Fatal(err)
	}
	// The next hop inline, no nexthop object (see Config.nextHopObjects).
	r := k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
	if r.NextHopID != 0 || !slices.Equal(r.MPLSLabels, []uint32{1024 + 1*256 + 5}) || r.Gateway != netip.MustParseAddr("192.168.0.1") || r.LinkIndex != 7 || len(k.NextHops) != 0 {
		t.Fatalf("mpls route %v, nexthop objects %v; want the label push via the node inline", r.String(), k.NextHops)
	}
	writes := k.Writes
	if err := NewDatapath(cfg, k, k, k.Chain(), NoDevice{}, func(ip netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog()).Resync([]Tunnel{tun}); err != nil || k.Writes != writes {
		t.Fatalf("restart: %v, %d writes; want none", err, k.Writes-writes)
	}
	tun.Table[0].NodeIP = netip.Addr{}
	if err := d.SetTunnel(tun); err == nil {
		t.Fatal("endpoint without node address accepted in mpls mode")
	}
}

func TestOneUnprogrammableTunnelDoesNotBlockTheOthers(t *testing.T) {
	cfg := testConfig()
	cfg.Mode = encap.MPLS
	k := seamtest.NewKernel()
	unreachable := netip.MustParseAddr("192.168.9.9")
	nodeLink := func(ip netip.Addr) (int, error) {
		if ip == unreachable {
			return 0, fmt.Errorf("no route to %v", ip)
		}
		return 7, nil
	}
	d := NewDatapath(cfg, k, k, k.Chain(), NoDevice{}, nodeLink, seamtest.QuietLog())
	good := tunnel(cfg, "192.0.2.1", "10.244.1.5")
	bad := tunnel(cfg, "192.0.2.2", "10.244.2.6")
	for b := range bad.Table {
		bad.Table[b].NodeIP = unreachable
	}
	if err := d.Resync([]Tunnel{good, bad}); err != nil {
		t.Fatalf("Resync failed because of one tunnel: %v", err)
	}
	if _, ok := k.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]; !ok {
		t.Fatal("the good tunnel was not programmed")
	}
	if isMarked(k.Marked, bad.VIP) {
		t.Fatal("the unprogrammable tunnel got an HMARK rule without routes")
	}
}

// failingKernel fails route writes for one tunnel IP.
type failingKernel struct {
	*seamtest.Kernel
	failVIP netip.Addr
}

func (f *failingKernel) Apply(ops []rtnl.Op) error {
	var ok []rtnl.Op
	for _, op := range ops {
		if op.Route.Dst.Addr() != f.failVIP {
			ok = append(ok, op)
		}
	}
	_ = f.Kernel.Apply(ok)
	if len(ok) != len(ops) {
		return fmt.Errorf("injected failure for %v", f.failVIP)
	}
	return nil
}

func TestFailedRoutesNeverGetAMark(t *testing.T) {
	cfg := testConfig()
	k := &failingKernel{Kernel: seamtest.NewKernel(), failVIP: netip.MustParseAddr("192.0.2.9")}
	d := NewDatapath(cfg, k, k, k.Kernel.Chain(), k.Kernel.Device(), nil, seamtest.QuietLog())
	if err := d.Resync([]Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5")}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetTunnel(tunnel(cfg, "192.0.2.9", "10.244.1.6")); err == nil {
		t.Fatal("injected failure not reported")
	}
	// Later changes to other tunnels must not mark the failed one.
	if err := d.SetTunnel(tunnel(cfg, "192.0.2.3", "10.244.1.7")); err != nil {
		t.Fatal(err)
	}
	if isMarked(k.Marked, k.failVIP) {
		t.Fatalf("tunnel without routes is marked: %v", k.Marked)
	}
	if !isMarked(k.Marked, netip.MustParseAddr("192.0.2.3")) || !isMarked(k.Marked, netip.MustParseAddr("192.0.2.1")) {
		t.Fatalf("marks %v, want the programmed tunnels", k.Marked)
	}
}

func isMarked(marked map[netip.Addr]uint32, vip netip.Addr) bool {
	_, ok := marked[vip]
	return ok
}

// TestStateKeepsOnlyGenerationsInUse: a tunnel IP on generation 0 keeps
// Buckets slots in the datapath's state, not Buckets × Generations, after
// Resync (read from the kernel and planned) and after SetTunnel; a
// generation switch extends it to the generations in use.
func TestStateKeepsOnlyGenerationsInUse(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	vip := netip.MustParseAddr("192.0.2.1")
	d := newTestDatapath(cfg, k)
	if err := d.Resync([]Tunnel{tunnel(cfg, vip.String(), "10.244.1.5", "10.244.2.6")}); err != nil {
		t.Fatal(err)
	}
	restarted := newTestDatapath(cfg, k)
	if err := restarted.Resync([]Tunnel{tunnel(cfg, vip.String(), "10.244.1.5", "10.244.2.6")}); err != nil {
		t.Fatal(err)
	}
	for name, dp := range map[string]*Datapath{"first": d, "restarted": restarted} {
		if got := len(dp.desired[vip]); got != cfg.Buckets {
			t.Errorf("%s: desired holds %d slots, want %d (one generation)", name, got, cfg.Buckets)
		}
		if got := len(dp.observed[vip]); got != cfg.Buckets {
			t.Errorf("%s: observed holds %d slots, want %d", name, got, cfg.Buckets)
		}
	}
	// 10.244.1.5 drains: new flows go to generation 1, the old one stays.
	if err := d.SetTunnel(drainTunnel(cfg, vip.String(), []string{"10.244.1.5", "10.244.2.6"}, "10.244.1.5")); err != nil {
		t.Fatal(err)
	}
	if got := len(d.desired[vip]); got != 2*cfg.Buckets || d.current[vip] != 1 {
		t.Errorf("after a switch: %d slots, generation %d; want %d and 1", got, d.current[vip], 2*cfg.Buckets)
	}
}

// Client affinity reaches the HMARK chain with the tunnel IP, turning it
// on or off rewrites only the mark (the tables, and so the generation,
// stay), and a restart adopts it with no write.
func TestClientAffinityChangesOnlyTheMark(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	dp := newTestDatapath(cfg, k)
	tun := tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6")
	if err := dp.Resync([]Tunnel{tun}); err != nil {
		t.Fatal(err)
	}
	routes := len(k.Routes)
	tun.ClientAffinity = true
	before := k.Writes
	if err := dp.SetTunnel(tun); err != nil {
		t.Fatal(err)
	}
	if !k.Affinity[tun.VIP] || k.Writes != before+1 || len(k.Routes) != routes || dp.CurrentGeneration(tun.VIP) != 0 {
		t.Fatalf("affinity on: chain affinity %v, %d writes, %d routes (was %d), generation %d; want only the mark rewritten",
			k.Affinity, k.Writes-before, len(k.Routes), routes, dp.CurrentGeneration(tun.VIP))
	}
	before = k.Writes
	if err := newTestDatapath(cfg, k).Resync([]Tunnel{tun}); err != nil || k.Writes != before {
		t.Fatalf("restart with affinity: %v, %d writes", err, k.Writes-before)
	}
	tun.ClientAffinity = false
	if err := dp.SetTunnel(tun); err != nil || k.Affinity[tun.VIP] {
		t.Fatalf("affinity off: %v, chain affinity %v", err, k.Affinity)
	}
}
