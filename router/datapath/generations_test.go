package datapath

import (
	"net"
	"net/netip"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// fakeFlows is a conntrack table, which lists, as the kernel does, only
// the entries with a mark in the ranges asked for.
type fakeFlows struct {
	entries []*netlink.ConntrackFlow
	asked   [][]ctmarks.Range
}

func (f *fakeFlows) EachMarked(_ netlink.InetFamily, ranges []ctmarks.Range, fn func(*netlink.ConntrackFlow)) error {
	f.asked = append(f.asked, ranges)
	for _, e := range markedIn(f.entries, ranges) {
		fn(e)
	}
	return nil
}

// markedIn returns the entries with a mark in one of ranges.
func markedIn(entries []*netlink.ConntrackFlow, ranges []ctmarks.Range) []*netlink.ConntrackFlow {
	var out []*netlink.ConntrackFlow
	for _, e := range entries {
		for _, r := range ranges {
			if e.Mark >= r.First && uint64(e.Mark) < uint64(r.First)+uint64(r.Count) {
				out = append(out, e)
				break
			}
		}
	}
	return out
}

func flow(proto uint8, vip netip.Addr, mark, timeout uint32) *netlink.ConntrackFlow {
	f := &netlink.ConntrackFlow{Mark: mark, TimeOut: timeout}
	f.Forward.Protocol = proto
	f.Forward.SrcIP = net.ParseIP("198.51.100.10")
	f.Forward.DstIP = net.IP(vip.AsSlice())
	return f
}

// drainTunnel is the tunnel of vip over pods, with the pods listed in
// draining kept present but given no bucket.
func drainTunnel(cfg Config, vip string, pods []string, draining ...string) Tunnel {
	var ready []string
	isDraining := map[string]bool{}
	for _, p := range draining {
		isDraining[p] = true
	}
	for _, p := range pods {
		if !isDraining[p] {
			ready = append(ready, p)
		}
	}
	t := tunnel(cfg, vip, ready...)
	for _, p := range pods {
		t.Present = append(t.Present, Endpoint{Addr: netip.MustParseAddr(p), Draining: isDraining[p]})
	}
	return t
}

// kernelTable reads generation g's bucket table of vip from the fake kernel:
// the GRE destination of the nexthop object of each bucket's route, or an
// invalid address.
func kernelTable(cfg Config, k *seamtest.Kernel, vip netip.Addr, g int) []netip.Addr {
	out := make([]netip.Addr, cfg.Buckets)
	for _, r := range k.Routes {
		slot := int(r.Table) - cfg.TableBase
		n, ok := k.NextHops[r.NextHopID]
		if r.Dst.Addr() != vip || slot/cfg.Buckets != g || !ok || n.IPEncap == nil {
			continue
		}
		out[slot%cfg.Buckets] = n.IPEncap.Dst
	}
	return out
}

func addrsOf(t Tunnel) []netip.Addr {
	out := make([]netip.Addr, len(t.Table))
	for b, ep := range t.Table {
		out[b] = ep.Addr
	}
	return out
}

func sameAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A draining endpoint: new flows get a new generation without it, the old
// generation stays for established flows until conntrack shows none, then
// goes; a restarted router adopts all of it without a write.
func TestDrainingKeepsOldGenerationUntilItsFlowsEnd(t *testing.T) {
	cfg := testConfig()
	cfg.Buckets = 16
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	flows := &fakeFlows{}
	d.EnableGenerationCollection(flows)
	vip := netip.MustParseAddr("192.0.2.1")
	pods := []string{"10.244.1.11", "10.244.1.12", "10.244.2.11", "10.244.2.12"}
	all := drainTunnel(cfg, vip.String(), pods)
	if err := d.Resync([]Tunnel{all}); err != nil {
		t.Fatal(err)
	}
	if k.Marked[vip] != cfg.GenerationOffset(0) {
		t.Fatalf("first table in generation 0 (offset %#x), chain has %#x", cfg.GenerationOffset(0), k.Marked[vip])
	}

	drained := drainTunnel(cfg, vip.String(), pods, "10.244.2.12")
	k.Journal = nil
	if err := d.SetTunnel(drained); err != nil {
		t.Fatal(err)
	}
	if got := k.Marked[vip]; got != cfg.GenerationOffset(1) {
		t.Fatalf("after draining, new flows use offset %#x, want generation 1's %#x", got, cfg.GenerationOffset(1))
	}
	if !sameAddrs(kernelTable(cfg, k, vip, 0), addrsOf(all)) {
		t.Errorf("generation 0 changed: %v, want %v", kernelTable(cfg, k, vip, 0), addrsOf(all))
	}
	if !sameAddrs(kernelTable(cfg, k, vip, 1), addrsOf(drained)) {
		t.Errorf("generation 1 is %v, want %v", kernelTable(cfg, k, vip, 1), addrsOf(drained))
	}
	if n := len(k.Journal); n == 0 || k.Journal[n-1] != "mark~ "+vip.String() {
		t.Errorf("the offset must switch after every route is in: %v", k.Journal)
	}

	// Flows on generation 0 keep it; a closing TCP entry does not count.
	gen0 := cfg.Mark(cfg.Slot(0, 3))
	flows.entries = []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, vip, gen0, 30)}
	if n, err := d.CollectGenerations(); err != nil || n != 0 {
		t.Fatalf("collected %d generations (%v) while a UDP flow uses generation 0", n, err)
	}
	flows.entries = []*netlink.ConntrackFlow{flow(unix.IPPROTO_TCP, vip, gen0, 299)}
	if n, err := d.CollectGenerations(); err != nil || n != 0 {
		t.Fatalf("collected %d generations (%v) while an established TCP flow uses generation 0", n, err)
	}
	// An open connection idle for minutes still has its decision restored.
	flows.entries = []*netlink.ConntrackFlow{flow(unix.IPPROTO_TCP, vip, gen0, 60)}
	if n, err := d.CollectGenerations(); err != nil || n != 0 {
		t.Fatalf("collected %d generations (%v) while an idle TCP flow (60 s left) uses generation 0", n, err)
	}
	// Only the older generation's marks are listed: new flows (a flood)
	// have the current generation's.
	if last := flows.asked[len(flows.asked)-1]; len(last) != 1 || last[0] != (ctmarks.Range{First: cfg.GenerationOffset(0), Count: uint32(cfg.Buckets)}) {
		t.Errorf("CollectGenerations listed the marks %+v, want only generation 0's (%#x, %d)", last, cfg.GenerationOffset(0), cfg.Buckets)
	}

	// Restart while both generations are in use: nothing is written.
	writes := k.Writes
	restarted := newTestDatapath(cfg, k)
	restarted.EnableGenerationCollection(flows)
	if err := restarted.Resync([]Tunnel{drained}); err != nil {
		t.Fatal(err)
	}
	if k.Writes != writes {
		t.Fatalf("a restarted router wrote %d times; want none", k.Writes-writes)
	}

	flows.entries = []*netlink.ConntrackFlow{
		flow(unix.IPPROTO_TCP, vip, gen0|cfg.Sticky().ClosingBit(), 3600),    // closing (kube-proxy's CLOSE_WAIT hour)
		flow(unix.IPPROTO_TCP, vip, cfg.Mark(cfg.Slot(1, 0)), 299),           // current generation
		flow(unix.IPPROTO_TCP, netip.MustParseAddr("192.0.2.99"), gen0, 299), // another tunnel IP
		flow(unix.IPPROTO_TCP, vip, 0x8000, 299),                             // a foreign mark
	}
	writes = k.Writes
	if n, err := restarted.CollectGenerations(); err != nil || n != 1 {
		t.Fatalf("collected %d generations (%v), want generation 0", n, err)
	}
	// The drained pod's nexthop object goes with its last route.
	if k.Writes-writes != cfg.Buckets+1 || len(k.NextHops) != len(pods)-1 {
		t.Errorf("%d writes to remove a generation, %d nexthop objects left; want %d route deletions and the drained pod's nexthop object's",
			k.Writes-writes, len(k.NextHops), cfg.Buckets)
	}
	for _, a := range kernelTable(cfg, k, vip, 0) {
		if a.IsValid() {
			t.Fatalf("generation 0 still routes: %v", kernelTable(cfg, k, vip, 0))
		}
	}
	if !sameAddrs(kernelTable(cfg, k, vip, 1), addrsOf(drained)) {
		t.Errorf("generation 1 changed: %v", kernelTable(cfg, k, vip, 1))
	}
	if n, err := restarted.CollectGenerations(); err != nil || n != 0 {
		t.Fatalf("second collection removed %d (%v)", n, err)
	}
}

// An endpoint that is gone needs no new generation: its buckets are
// re-pointed in place, in the current and the older generations.
func TestGoneEndpointIsRepointedInPlace(t *testing.T) {
	cfg := testConfig()
	cfg.Buckets = 16
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	vip := netip.MustParseAddr("192.0.2.1")
	pods := []string{"10.244.1.11", "10.244.1.12", "10.244.2.11", "10.244.2.12"}
	if err := d.Resync([]Tunnel{drainTunnel(cfg, vip.String(), pods)}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetTunnel(drainTunnel(cfg, vip.String(), pods, "10.244.2.12")); err != nil {
		t.Fatal(err)
	}
	gone := drainTunnel(cfg, vip.String(), pods[:3])
	if err := d.SetTunnel(gone); err != nil {
		t.Fatal(err)
	}
	if got := k.Marked[vip]; got != cfg.GenerationOffset(1) {
		t.Fatalf("removing a gone endpoint switched generations: offset %#x", got)
	}
	for g := 0; g < 2; g++ {
		if !sameAddrs(kernelTable(cfg, k, vip, g), addrsOf(gone)) {
			t.Errorf("generation %d is %v, want every bucket of the gone pod on the current owner: %v", g, kernelTable(cfg, k, vip, g), addrsOf(gone))
		}
	}
}

func TestPlanGenerations(t *testing.T) {
	cfg := testConfig()
	cfg.Buckets = 4
	hop := func(last byte) nextHop { return nextHop{kind: hopGRE, addr: uint32(last), link: 42} }
	a, b, c := hop(1), hop(2), hop(3)
	alive := func(hs ...nextHop) func(nextHop) bool {
		return func(h nextHop) bool {
			for _, x := range hs {
				if x == h {
					return true
				}
			}
			return false
		}
	}
	gen := func(slots []nextHop, g int) []nextHop { return slots[g*cfg.Buckets : (g+1)*cfg.Buckets] }
	equal := func(x, y []nextHop) bool {
		for i := range x {
			if x[i] != y[i] {
				return false
			}
		}
		return len(x) == len(y)
	}

	t.Run("first table goes in place", func(t *testing.T) {
		next, cur, switched, _ := planGenerations(cfg, nil, 0, nil, []nextHop{a, b, a, b}, alive(a, b), nil)
		if switched || cur != 0 || !equal(gen(next, 0), []nextHop{a, b, a, b}) || inUse(gen(next, 1)) {
			t.Fatalf("cur=%d switched=%v slots=%v", cur, switched, next)
		}
	})
	t.Run("adding an endpoint starts a generation", func(t *testing.T) {
		have, _, _, _ := planGenerations(cfg, nil, 0, nil, []nextHop{a, b, a, b}, alive(a, b), nil)
		next, cur, switched, _ := planGenerations(cfg, have, 0, nil, []nextHop{a, b, c, b}, alive(a, b, c), nil)
		if !switched || cur != 1 || !equal(gen(next, 0), []nextHop{a, b, a, b}) || !equal(gen(next, 1), []nextHop{a, b, c, b}) {
			t.Fatalf("cur=%d switched=%v slots=%v", cur, switched, next)
		}
	})
	t.Run("stateless router overwrites", func(t *testing.T) {
		one := cfg
		one.Generations = 1
		have, _, _, _ := planGenerations(one, nil, 0, nil, []nextHop{a, b, a, b}, alive(a, b), nil)
		next, cur, switched, _ := planGenerations(one, have, 0, nil, []nextHop{a, b, c, b}, alive(a, b, c), nil)
		if switched || cur != 0 || len(next) != one.Buckets || !equal(next, []nextHop{a, b, c, b}) {
			t.Fatalf("cur=%d switched=%v slots=%v", cur, switched, next)
		}
	})
	t.Run("with every generation used the oldest is reused", func(t *testing.T) {
		var have []nextHop
		cur := 0
		tables := [][]nextHop{{a, a, a, a}, {a, b, a, a}, {a, b, c, a}, {a, b, c, b}}
		present := alive(a, b, c)
		age := make([]uint64, cfg.Generations)
		for i, tbl := range tables {
			var switched bool
			have, cur, switched, _ = planGenerations(cfg, have, cur, age, tbl, present, nil)
			if switched {
				age[cur] = uint64(i + 1)
			}
		}
		if cur != 3 || len(generationsInUse(cfg, have)) != 4 {
			t.Fatalf("after 4 tables: cur=%d in use %v", cur, generationsInUse(cfg, have))
		}
		age[0] = 100 // generation 0 became current most recently... except 3
		age[1] = 1
		next, cur, _, _ := planGenerations(cfg, have, cur, age, []nextHop{c, c, c, c}, present, nil)
		if cur != 1 || !equal(gen(next, 1), []nextHop{c, c, c, c}) || !equal(gen(next, 0), tables[0]) {
			t.Fatalf("reused generation %d, want the oldest (1): %v", cur, next)
		}

		// With conntrack's counts, the generation whose overwriting moves
		// the fewest established flows is reused instead: a rolling
		// update's intermediate tables hold none.
		live := make([]int, cfg.Slots())
		live[cfg.Slot(1, 1)] = 5 // generation 1 (the oldest): 5 flows on b, which {c,c,c,c} moves
		live[cfg.Slot(0, 0)] = 3 // generation 0: 3 flows on a, moved too
		live[cfg.Slot(2, 2)] = 7 // generation 2: 7 flows on c, which stays c
		calls := 0
		counts := func() []int { calls++; return live }
		next, cur, switched, moved := planGenerations(cfg, have, 3, age, []nextHop{c, c, c, c}, present, counts)
		if cur != 2 || !switched || moved != 0 || calls != 1 || !equal(gen(next, 1), tables[1]) || !equal(gen(next, 2), []nextHop{c, c, c, c}) {
			t.Fatalf("reused generation %d (moved %d, %d conntrack listings), want 2 (no flow moves): %v", cur, moved, calls, next)
		}
		live[cfg.Slot(2, 0)] = 4 // now generation 2 has 4 flows on a; generation 0 has 3 and is chosen
		live[cfg.Slot(3, 3)] = 9 // the current one, 9 flows on b
		next, cur, _, moved = planGenerations(cfg, have, 3, age, []nextHop{c, c, c, c}, present, counts)
		if cur != 0 || moved != 3 || !equal(gen(next, 2), tables[2]) {
			t.Fatalf("reused generation %d (moved %d), want 0 (3 flows move): %v", cur, moved, next)
		}
		// A free generation is used without listing conntrack.
		calls = 0
		have2, _, _, _ := planGenerations(cfg, nil, 0, nil, []nextHop{a, b, a, b}, alive(a, b), counts)
		if _, cur, _, _ := planGenerations(cfg, have2, 0, nil, []nextHop{a, b, c, b}, alive(a, b, c), counts); cur != 1 || calls != 0 {
			t.Fatalf("cur=%d after %d conntrack listings, want 1 after none", cur, calls)
		}
	})
}

// The conntrack entries that count as a slot's live flows are the ones
// whose mark conntrack restores: the router's marks, of this tunnel IP, and
// not closing (no closing bit). CollectGenerations counts the same ones.
func TestLiveFlowsBySlot(t *testing.T) {
	cfg := testConfig()
	d := newTestDatapath(cfg, seamtest.NewKernel())
	vip, other := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	if live := d.liveFlowsBySlot(vip); live != nil {
		t.Fatalf("without conntrack: %v, want nil", live)
	}
	flows := &fakeFlows{}
	d.EnableGenerationCollection(flows)
	s1, s2 := cfg.Slot(1, 2), cfg.Slot(0, 5)
	flows.entries = []*netlink.ConntrackFlow{
		flow(unix.IPPROTO_TCP, vip, cfg.Mark(s1), 299),
		flow(unix.IPPROTO_TCP, vip, cfg.Mark(s1), 299),
		flow(unix.IPPROTO_UDP, vip, cfg.Mark(s2), 30),
		flow(unix.IPPROTO_TCP, vip, cfg.Mark(s2)|cfg.Sticky().ClosingBit(), 120), // closing
		flow(unix.IPPROTO_TCP, other, cfg.Mark(s2), 299),                         // another tunnel IP
		flow(unix.IPPROTO_TCP, vip, cfg.MarkOffset+uint32(cfg.Slots()), 299),     // not the router's mark
		flow(unix.IPPROTO_TCP, vip, 0, 299),
	}
	live := d.liveFlowsBySlot(vip)
	if len(live) != cfg.Slots() || live[s1] != 2 || live[s2] != 1 {
		t.Fatalf("live flows by slot: %v, want 2 in slot %d and 1 in slot %d", live, s1, s2)
	}
	total := 0
	for _, n := range live {
		total += n
	}
	if total != 3 {
		t.Errorf("%d live flows counted, want 3: %v", total, live)
	}
}
