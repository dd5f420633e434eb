package datapath

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// Routing generations (draining and connection stickiness).
//
// The router keeps up to Config.Generations bucket tables per tunnel IP. New
// flows are hashed into the CURRENT generation (the tunnel IP's HMARK offset);
// conntrack remembers each flow's mark, so an established flow keeps the
// generation, and so the endpoint, it started with (see hmark.Sticky for the
// iptables side). When a tunnel IP's table changes so that a live endpoint
// would lose flows it is serving (it starts draining, or an endpoint is added
// and wins some of its buckets), the new table goes into another generation
// and becomes current; the previous one stays for the flows that use it, until
// conntrack shows none does (CollectGenerations).
//
// A change that only removes endpoints that are gone needs no new generation:
// their flows are dead anyway, so their buckets are re-pointed in place, in
// every generation, to the current owner.

// planGenerations computes the desired slots of one tunnel IP (len
// cfg.Slots(), hopNone for a slot without a route; the caller trims them) and its current
// generation, from what it has now (have, any length; cur its current
// generation) and the new table for new flows (want, one hop per bucket).
// present reports whether a hop still leads to an endpoint that exists (ready
// or draining). age orders generations for reuse when none is free: the
// lowest age is overwritten first, unless liveFlows (called only when every
// generation holds a table) counts, per slot, the flows conntrack holds
// now: then the generation whose overwriting moves the fewest of them is
// chosen. moved is the number of those flows sent elsewhere (0 when
// liveFlows was not called or returned nil). switched is true when cur
// changed.
func planGenerations(cfg Config, have []nextHop, cur int, age []uint64, want []nextHop, present func(nextHop) bool, liveFlows func() []int) (next []nextHop, newCur int, switched bool, moved int) {
	B, G := cfg.Buckets, cfg.Generations
	next = make([]nextHop, cfg.Slots())
	copy(next, have) // slots beyond cfg.Slots() are not wanted any more
	if cur < 0 || cur >= G {
		cur = 0
	}
	gen := func(g int) []nextHop { return next[g*B : (g+1)*B] }
	// Buckets whose endpoint is gone follow the new table in every generation.
	for g := 0; g < G; g++ {
		if !inUse(gen(g)) {
			continue
		}
		for b, h := range gen(g) {
			if h.kind == hopNone || !present(h) {
				gen(g)[b] = want[b]
			}
		}
	}
	newCur = cur
	if !inUse(gen(cur)) || G == 1 || !movesLiveFlows(gen(cur), want, present) {
		copy(gen(cur), want)
		return next, cur, false, 0
	}
	used := func(g int) bool { return inUse(gen(g)) }
	newCur = pickGeneration(G, cur, age, used)
	if used(newCur) && liveFlows != nil {
		if live := liveFlows(); live != nil {
			newCur, moved = leastMovingGeneration(G, cur, age, live, func(g int) []nextHop { return gen(g) }, want)
		}
	}
	copy(gen(newCur), want)
	return next, newCur, newCur != cur, moved
}

// leastMovingGeneration chooses, when every generation holds a table, the
// one to overwrite with want: the one in which the fewest flows conntrack
// holds now (live, per slot) would be sent to another endpoint. Ties go to
// the oldest generation other than cur, then to cur (overwriting cur in
// place). A rolling update makes this the common case: it changes a tunnel
// IP's table more often than --generations allows, but the generations in
// between usually hold no established flow.
func leastMovingGeneration(G, cur int, age []uint64, live []int, gen func(int) []nextHop, want []nextHop) (best, moved int) {
	movedIn := func(g int) int {
		n := 0
		for b, h := range gen(g) {
			if k := g*len(want) + b; h != want[b] && k < len(live) {
				n += live[k]
			}
		}
		return n
	}
	// Candidates in order of preference: the others oldest first, cur last.
	var order []int
	for i := 1; i < G; i++ {
		order = append(order, (cur+i)%G)
	}
	slices.SortStableFunc(order, func(x, y int) int { return cmp.Compare(ageOf(age, x), ageOf(age, y)) })
	order = append(order, cur)
	best, moved = -1, 0
	for _, g := range order {
		if n := movedIn(g); best < 0 || n < moved {
			best, moved = g, n
		}
	}
	return best, moved
}

// movesLiveFlows reports whether going from table have to want would send
// some bucket of a still existing endpoint elsewhere.
func movesLiveFlows(have, want []nextHop, present func(nextHop) bool) bool {
	for b := range want {
		if have[b] != want[b] && have[b].kind != hopNone && present(have[b]) {
			return true
		}
	}
	return false
}

// pickGeneration chooses where a new table goes: the first free generation
// after cur, else the oldest other one (its remaining flows then follow the
// new table).
func pickGeneration(G, cur int, age []uint64, used func(int) bool) int {
	for i := 1; i < G; i++ {
		if g := (cur + i) % G; !used(g) {
			return g
		}
	}
	best := -1
	for i := 1; i < G; i++ {
		g := (cur + i) % G
		if best < 0 || ageOf(age, g) < ageOf(age, best) {
			best = g
		}
	}
	return best
}

func ageOf(age []uint64, g int) uint64 {
	if g < len(age) {
		return age[g]
	}
	return 0
}

// inUse reports whether a generation's table has any route.
func inUse(table []nextHop) bool {
	return slices.ContainsFunc(table, func(h nextHop) bool { return h.kind != hopNone })
}

// generationsInUse lists the generations of slots that hold routes.
func generationsInUse(cfg Config, slots []nextHop) []int {
	var out []int
	for g := 0; g*cfg.Buckets < len(slots) && g < cfg.Generations; g++ {
		if inUse(slots[g*cfg.Buckets : min((g+1)*cfg.Buckets, len(slots))]) {
			out = append(out, g)
		}
	}
	return out
}

// flowKey counts conntrack entries per tunnel IP and generation.
type flowKey struct {
	vip netip.Addr
	gen int
}

// slotOfMark returns the slot a conntrack mark belongs to; ok is false for
// marks that are not the router's.
func (c Config) slotOfMark(mark uint32) (slot int, ok bool) {
	if mark < c.MarkOffset || uint64(mark) >= uint64(c.MarkOffset)+uint64(c.Slots()) {
		return 0, false
	}
	return int(mark - c.MarkOffset), true
}

// restoredFlow returns the tunnel IP and slot of a conntrack entry whose
// mark conntrack restores: of the datapath's family, one of the router's
// marks (both families' entries carry the same marks). A TCP connection
// the client closed has the closing bit in its connmark, which is none of
// the router's marks: its last packets still get the decision back until a
// new connection takes the 4-tuple (hmark.Sticky), but it keeps no
// generation. ok is false for any other entry.
func (d *Datapath) restoredFlow(f *netlink.ConntrackFlow) (vip netip.Addr, slot int, ok bool) {
	if vip, ok = flowAddr(f.Forward.DstIP); !ok || !d.cfg.Family.has(vip) {
		return vip, 0, false
	}
	if slot, ok = d.cfg.slotOfMark(f.Mark); !ok {
		return vip, 0, false
	}
	return vip, slot, true
}

// flowAddr converts a conntrack address: 4 bytes, or 16 holding an IPv4
// address (net.IP's form of one), is IPv4; other 16 bytes are IPv6.
func flowAddr(ip net.IP) (netip.Addr, bool) {
	if v4 := ip.To4(); v4 != nil {
		return netip.AddrFrom4([4]byte(v4)), true
	}
	return netip.AddrFromSlice(ip)
}

// generationMarks returns the mark ranges of the generations gens, in
// order.
func (c Config) generationMarks(gens map[int]bool) []ctmarks.Range {
	var out []ctmarks.Range
	for g := range c.Generations {
		if gens[g] {
			out = append(out, ctmarks.Range{First: c.GenerationOffset(g), Count: uint32(c.Buckets)})
		}
	}
	return out
}

// conntrackFamily is the conntrack table family of c's tunnel IPs.
func (c Config) conntrackFamily() netlink.InetFamily { return netlink.InetFamily(c.Family.af()) }

// generationOfOffset returns the generation an HMARK offset selects.
func (c Config) generationOfOffset(offset uint32) (gen int, ok bool) {
	if offset < c.MarkOffset || (offset-c.MarkOffset)%uint32(c.Buckets) != 0 {
		return 0, false
	}
	g := int(offset-c.MarkOffset) / c.Buckets
	return g, g < c.Generations
}

// liveFlowsBySlot counts, per slot, the conntrack entries of tunnel IP vip
// whose mark conntrack would restore (restoredFlow). nil when conntrack is
// not available.
func (d *Datapath) liveFlowsBySlot(vip netip.Addr) []int {
	if d.flows == nil {
		return nil
	}
	live := make([]int, d.cfg.Slots())
	err := d.flows.EachMarked(d.cfg.conntrackFamily(), []ctmarks.Range{{First: d.cfg.MarkOffset, Count: uint32(d.cfg.Slots())}}, func(f *netlink.ConntrackFlow) {
		if a, slot, ok := d.restoredFlow(f); ok && a == vip {
			live[slot]++
		}
	})
	if err != nil {
		d.log.WithError(err).WithField("vip", vip).Warn("listing conntrack entries to choose a generation to overwrite; overwriting the oldest")
		return nil
	}
	return live
}

// CollectGenerations removes the routes of older generations that no flow
// uses any more: no conntrack entry with one of their marks is left (for TCP:
// none in an established state, the only ones whose mark is restored). It
// lists conntrack only when some tunnel IP has an older generation, and
// then only the entries with the marks of the generations that are older
// for some tunnel IP: new flows (a flood included) get the current
// generation's marks, and other traffic none of the router's, so neither
// is copied out of the kernel. It returns the number of generations removed.
func (d *Datapath) CollectGenerations() (removed int, err error) {
	d.mu.Lock()
	flows := d.flows
	older := map[netip.Addr]bool{} // tunnel IPs with an older generation
	olderGens := map[int]bool{}    // generations older for some tunnel IP
	for vip, slots := range d.desired {
		gens := generationsInUse(d.cfg, slots)
		if len(gens) <= 1 {
			continue
		}
		older[vip] = true
		for _, g := range gens {
			if g != d.current[vip] {
				olderGens[g] = true
			}
		}
	}
	clock := d.clock
	d.mu.Unlock()
	if flows == nil || len(older) == 0 {
		return 0, nil
	}
	inUse := map[flowKey]int{}
	err = flows.EachMarked(d.cfg.conntrackFamily(), d.cfg.generationMarks(olderGens), func(f *netlink.ConntrackFlow) {
		if vip, slot, ok := d.restoredFlow(f); ok && older[vip] {
			inUse[flowKey{vip, slot / d.cfg.Buckets}]++
		}
	})
	if err != nil {
		return 0, fmt.Errorf("listing conntrack entries (needs the nf_conntrack_netlink module, CONFIG_NF_CT_NETLINK): %w", err)
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.clock != clock {
		// A generation switched meanwhile; a generation that was older
		// then may be current now. Look again next time.
		return 0, nil
	}
	var ops []rtnl.Op
	for vip := range older {
		slots, ok := d.desired[vip]
		if !ok {
			continue
		}
		cur := d.current[vip]
		slots = slices.Clone(slots) // the observed state may share it
		for _, g := range generationsInUse(d.cfg, slots) {
			if g == cur || inUse[flowKey{vip, g}] > 0 {
				continue
			}
			for k := g * d.cfg.Buckets; k < min((g+1)*d.cfg.Buckets, len(slots)); k++ {
				slots[k] = nextHop{}
			}
			removed++
			d.log.WithFields(logrus.Fields{"vip": vip, "generation": g, "current_generation": cur}).Info("older generation unused by any flow; removed")
		}
		d.desired[vip] = trimSlots(slots)
		var err error
		if ops, err = d.diffVIP(vip, ops); err != nil {
			return removed, errors.Join(err, d.applyRoutes(ops))
		}
	}
	if err := d.applyRoutes(ops); err != nil {
		return removed, err
	}
	return removed, d.collectNextHops()
}
