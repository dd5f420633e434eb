package router

import (
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// fakeKernel stands in for rtnetlink, the rule table, the HMARK chain and the
// device. It records the order of route and mark changes per tunnel IP.
type fakeKernel struct {
	routes  map[rtnl.RouteKey]rtnl.Route
	rules   []netlink.Rule
	marked  map[netip.Addr]uint32 // HMARK offset per tunnel IP
	writes  int
	journal []string
	devUp   bool
}

func newFakeKernel() *fakeKernel { return &fakeKernel{routes: map[rtnl.RouteKey]rtnl.Route{}} }

func (k *fakeKernel) List(f rtnl.ListFilter) ([]rtnl.Route, error) {
	var out []rtnl.Route
	for _, r := range k.routes {
		if r.Table >= f.Tables.First && r.Table <= f.Tables.Last && (f.Protocol == 0 || r.Protocol == f.Protocol) {
			out = append(out, r)
		}
	}
	return out, nil
}

func (k *fakeKernel) Apply(ops []rtnl.Op) error {
	for _, op := range ops {
		k.writes++
		switch op.Kind {
		case rtnl.Replace:
			k.routes[op.Route.Key()] = op.Route
			k.journal = append(k.journal, "route+ "+op.Route.Dst.Addr().String())
		case rtnl.Delete:
			if r, ok := k.routes[op.Route.Key()]; ok && r.Protocol == op.Route.Protocol {
				delete(k.routes, op.Route.Key())
			}
			k.journal = append(k.journal, "route- "+op.Route.Dst.Addr().String())
		}
	}
	return nil
}

func (k *fakeKernel) RuleListFiltered(int, *netlink.Rule, uint64) ([]netlink.Rule, error) {
	return slices.Clone(k.rules), nil
}

func (k *fakeKernel) RuleAdd(r *netlink.Rule) error {
	k.writes++
	k.rules = append(k.rules, *r)
	return nil
}

func (k *fakeKernel) RuleDel(r *netlink.Rule) error {
	k.writes++
	for i := range k.rules {
		if k.rules[i].Priority == r.Priority && k.rules[i].Table == r.Table && k.rules[i].Mark == r.Mark {
			k.rules = slices.Delete(k.rules, i, i+1)
			return nil
		}
	}
	return fmt.Errorf("no such rule")
}

type fakeChain struct{ k *fakeKernel }

func (c fakeChain) Sync(targets []hmark.Target) (int, error) {
	want := map[netip.Addr]uint32{}
	for _, t := range targets {
		want[t.VIP] = t.Offset
	}
	if maps.Equal(want, c.k.marked) {
		return 0, nil
	}
	for _, t := range targets {
		if off, ok := c.k.marked[t.VIP]; !ok {
			c.k.journal = append(c.k.journal, "mark+ "+t.VIP.String())
		} else if off != t.Offset {
			c.k.journal = append(c.k.journal, "mark~ "+t.VIP.String())
		}
	}
	for v := range c.k.marked {
		if _, ok := want[v]; !ok {
			c.k.journal = append(c.k.journal, "mark- "+v.String())
		}
	}
	c.k.marked = want
	c.k.writes++
	return 1, nil
}

func (c fakeChain) Offsets() (map[netip.Addr]uint32, error) { return maps.Clone(c.k.marked), nil }

func (c fakeChain) Cleanup() error { c.k.marked = nil; return nil }

type fakeDevice struct{ k *fakeKernel }

func (d fakeDevice) Ensure() (int, error) { d.k.devUp = true; return 42, nil }
func (d fakeDevice) Remove() error        { d.k.devUp = false; return nil }

func testConfig() Config {
	return Config{
		Mode: ModeGRE, Buckets: 8, MarkOffset: DefaultMarkOffset, Seed: 1,
		RulePriority: DefaultRulePriority, TableBase: DefaultTableBase, RouteProtocol: DefaultRouteProtocol,
		GREDevice: DefaultGREDevice, Chain: "KST-HMARK",
		Generations: 4, GenerationCheckPeriod: time.Second,
	}
}

func quietLog() logrus.FieldLogger {
	l := logrus.New()
	l.Out = io.Discard
	return l
}

func newTestDatapath(cfg Config, k *fakeKernel) *Datapath {
	return NewDatapath(cfg, k, k, fakeChain{k}, fakeDevice{k}, func(ip netip.Addr) (int, error) { return 7, nil }, quietLog())
}

func tunnel(cfg Config, vip string, pods ...string) Tunnel {
	var eps []netip.Addr
	for _, p := range pods {
		eps = append(eps, netip.MustParseAddr(p))
	}
	t := Tunnel{VIP: netip.MustParseAddr(vip)}
	for _, a := range Assign(cfg.Buckets, eps) {
		t.Table = append(t.Table, Endpoint{Addr: a, NodeName: "node-" + a.String(), NodeIP: netip.MustParseAddr("192.168.0.1")})
	}
	return t
}

func TestResyncProgramsEverythingAndAdoptsOnRestart(t *testing.T) {
	cfg := testConfig()
	k := newFakeKernel()
	tunnels := []Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6"), tunnel(cfg, "192.0.2.2")}
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if len(k.routes) != 2*cfg.Buckets || len(k.rules) != cfg.Slots() || len(k.marked) != 2 || !k.devUp {
		t.Fatalf("routes=%d rules=%d marked=%v dev=%v", len(k.routes), len(k.rules), k.marked, k.devUp)
	}
	for b := 0; b < cfg.Buckets; b++ {
		r := k.routes[rtnl.RouteKey{Table: uint32(cfg.Table(b)), Dst: netip.MustParsePrefix("192.0.2.2/32")}]
		if r.Type != rtnl.Blackhole {
			t.Errorf("bucket %d of a tunnel without endpoints: %v, want blackhole", b, r.String())
		}
		r = k.routes[rtnl.RouteKey{Table: uint32(cfg.Table(b)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
		if r.IPEncap == nil || r.IPEncap.Dst != tunnels[0].Table[b].Addr || r.LinkIndex != 42 || r.IPEncap.TTL != greTTL {
			t.Errorf("bucket %d: %v, want encap to %v via link 42", b, r.String(), tunnels[0].Table[b].Addr)
		}
	}

	// A restarted router (a new Datapath over the same kernel) changes nothing.
	before := k.writes
	if err := newTestDatapath(cfg, k).Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if k.writes != before {
		t.Fatalf("restart made %d kernel writes, want 0", k.writes-before)
	}
}

func TestResyncRepairsDriftAndLeavesForeignStateAlone(t *testing.T) {
	cfg := testConfig()
	k := newFakeKernel()
	foreignRoute := rtnl.Route{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("198.51.100.0/24"), Type: rtnl.Unicast, Protocol: 4}
	otherTable := rtnl.Route{Table: 100, Dst: netip.MustParsePrefix("192.0.2.1/32"), Type: rtnl.Blackhole, Protocol: cfg.RouteProtocol}
	k.routes[foreignRoute.Key()] = foreignRoute
	k.routes[otherTable.Key()] = otherTable
	foreignRule := netlink.Rule{Priority: cfg.RulePriority, Table: 500, Mark: 9, Protocol: 4}
	k.rules = append(k.rules, foreignRule)

	d := newTestDatapath(cfg, k)
	tunnels := []Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6")}
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	// Drift: a route deleted by hand, one changed by hand, a stale tunnel IP, a rule deleted.
	delete(k.routes, rtnl.RouteKey{Table: uint32(cfg.Table(3)), Dst: netip.MustParsePrefix("192.0.2.1/32")})
	changed := k.routes[rtnl.RouteKey{Table: uint32(cfg.Table(4)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
	changed.IPEncap = &rtnl.IPEncap{Dst: netip.MustParseAddr("10.9.9.9"), TTL: greTTL}
	k.routes[changed.Key()] = changed
	stale := cfg.route(netip.MustParseAddr("192.0.2.99"), 5, nextHop{kind: hopDrop})
	k.routes[stale.Key()] = stale
	k.rules = slices.DeleteFunc(k.rules, func(r netlink.Rule) bool { return r.Priority == cfg.Priority(2) && r.Protocol == cfg.RouteProtocol })

	before := k.writes
	if err := d.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	if got := k.writes - before; got != 4 {
		t.Errorf("repair made %d writes, want 4 (2 routes replaced, 1 stale deleted, 1 rule added)", got)
	}
	if _, ok := k.routes[stale.Key()]; ok {
		t.Error("stale tunnel IP route survived")
	}
	if _, ok := k.routes[foreignRoute.Key()]; !ok {
		t.Error("route of another protocol in our table was removed")
	}
	if _, ok := k.routes[otherTable.Key()]; !ok {
		t.Error("route outside our tables was removed")
	}
	if len(k.rules) != cfg.Slots()+1 {
		t.Errorf("%d rules, want %d ours + 1 foreign", len(k.rules), cfg.Slots())
	}

	if err := d.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if len(k.routes) != 2 || len(k.rules) != 1 || k.marked != nil || k.devUp {
		t.Fatalf("after cleanup: routes=%v rules=%v marked=%v dev=%v; want only the foreign route, rule and nothing else", k.routes, k.rules, k.marked, k.devUp)
	}
}

func TestRoutesBeforeMarksAndMarksBeforeRouteRemoval(t *testing.T) {
	cfg := testConfig()
	k := newFakeKernel()
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
	firstMark, firstUnmark := slices.Index(k.journal, "mark+ "+vip.String()), slices.Index(k.journal, "mark- "+vip.String())
	lastRouteAdd, firstRouteDel := -1, -1
	for i, j := range k.journal {
		if j == "route+ "+vip.String() {
			lastRouteAdd = i
		}
		if j == "route- "+vip.String() && firstRouteDel < 0 {
			firstRouteDel = i
		}
	}
	if firstMark < lastRouteAdd || firstMark < 0 {
		t.Errorf("mark added before routes: %v", k.journal)
	}
	if firstRouteDel < firstUnmark || firstUnmark < 0 {
		t.Errorf("routes deleted before the mark: %v", k.journal)
	}
	if len(k.routes) != 0 {
		t.Errorf("%d routes left after RemoveTunnel", len(k.routes))
	}
}

func TestRemovingOneEndpointTouchesOnlyMovedBuckets(t *testing.T) {
	cfg := testConfig()
	cfg.Buckets = 64
	k := newFakeKernel()
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
	writes := k.writes
	if err := d.SetTunnel(after); err != nil {
		t.Fatal(err)
	}
	movedBuckets := 0
	for b := range before.Table {
		if before.Table[b] != after.Table[b] {
			movedBuckets++
		}
	}
	if got := k.writes - writes; got != movedBuckets {
		t.Fatalf("%d kernel writes, want one per moved bucket (%d)", got, movedBuckets)
	}
}

func TestMPLSRoutes(t *testing.T) {
	cfg := testConfig()
	cfg.Mode = ModeMPLS
	k := newFakeKernel()
	d := NewDatapath(cfg, k, k, fakeChain{k}, NoDevice{}, func(ip netip.Addr) (int, error) { return 7, nil }, quietLog())
	tun := tunnel(cfg, "192.0.2.1", "10.244.1.5")
	if err := d.Resync([]Tunnel{tun}); err != nil {
		t.Fatal(err)
	}
	r := k.routes[rtnl.RouteKey{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]
	if !slices.Equal(r.MPLSLabels, []uint32{1024 + 1*256 + 5}) || r.Gateway != netip.MustParseAddr("192.168.0.1") || r.LinkIndex != 7 {
		t.Fatalf("mpls route %v", r.String())
	}
	tun.Table[0].NodeIP = netip.Addr{}
	if err := d.SetTunnel(tun); err == nil {
		t.Fatal("endpoint without node address accepted in mpls mode")
	}
}

func TestOneUnprogrammableTunnelDoesNotBlockTheOthers(t *testing.T) {
	cfg := testConfig()
	cfg.Mode = ModeMPLS
	k := newFakeKernel()
	unreachable := netip.MustParseAddr("192.168.9.9")
	nodeLink := func(ip netip.Addr) (int, error) {
		if ip == unreachable {
			return 0, fmt.Errorf("no route to %v", ip)
		}
		return 7, nil
	}
	d := NewDatapath(cfg, k, k, fakeChain{k}, NoDevice{}, nodeLink, quietLog())
	good := tunnel(cfg, "192.0.2.1", "10.244.1.5")
	bad := tunnel(cfg, "192.0.2.2", "10.244.2.6")
	for b := range bad.Table {
		bad.Table[b].NodeIP = unreachable
	}
	if err := d.Resync([]Tunnel{good, bad}); err != nil {
		t.Fatalf("Resync failed because of one tunnel: %v", err)
	}
	if _, ok := k.routes[rtnl.RouteKey{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]; !ok {
		t.Fatal("the good tunnel was not programmed")
	}
	if isMarked(k.marked, bad.VIP) {
		t.Fatal("the unprogrammable tunnel got an HMARK rule without routes")
	}
}

// failingKernel fails route writes for one tunnel IP.
type failingKernel struct {
	*fakeKernel
	failVIP netip.Addr
}

func (f *failingKernel) Apply(ops []rtnl.Op) error {
	var ok []rtnl.Op
	for _, op := range ops {
		if op.Route.Dst.Addr() != f.failVIP {
			ok = append(ok, op)
		}
	}
	_ = f.fakeKernel.Apply(ok)
	if len(ok) != len(ops) {
		return fmt.Errorf("injected failure for %v", f.failVIP)
	}
	return nil
}

func TestFailedRoutesNeverGetAMark(t *testing.T) {
	cfg := testConfig()
	k := &failingKernel{fakeKernel: newFakeKernel(), failVIP: netip.MustParseAddr("192.0.2.9")}
	d := NewDatapath(cfg, k, k, fakeChain{k.fakeKernel}, fakeDevice{k.fakeKernel}, nil, quietLog())
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
	if isMarked(k.marked, k.failVIP) {
		t.Fatalf("tunnel without routes is marked: %v", k.marked)
	}
	if !isMarked(k.marked, netip.MustParseAddr("192.0.2.3")) || !isMarked(k.marked, netip.MustParseAddr("192.0.2.1")) {
		t.Fatalf("marks %v, want the programmed tunnels", k.marked)
	}
}

func isMarked(marked map[netip.Addr]uint32, vip netip.Addr) bool {
	_, ok := marked[vip]
	return ok
}
