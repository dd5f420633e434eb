package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// RouteOps is the route seam: a netns-bound rtnetlink client (*rtnl.Client),
// for routes and nexthop objects.
type RouteOps interface {
	// Walk visits the routes f selects one by one (see rtnl.Client.Walk).
	Walk(f rtnl.ListFilter, reset func(), visit func(rtnl.Route) error) error
	ListNextHops(protocol uint8) ([]rtnl.NextHop, error)
	Apply([]rtnl.Op) error
}

// RuleOps is the policy-rule seam (*netlink.Handle).
type RuleOps interface {
	RuleListFiltered(family int, filter *netlink.Rule, filterMask uint64) ([]netlink.Rule, error)
	RuleAdd(*netlink.Rule) error
	RuleDel(*netlink.Rule) error
}

// markChain is the HMARK seam (*hmark.Chain).
type markChain interface {
	Sync(targets []hmark.Target) (changed int, err error)
	Update(targets []hmark.Target) (changed int, err error)
	Offsets() (map[netip.Addr]uint32, error)
	Cleanup() error
}

// flowLister is the conntrack seam (ctmarks.Lister): fn is called with
// each entry of family whose mark lies in one of ranges, filtered by the
// kernel and decoded as it arrives, so that neither a flood of other
// entries nor the number of the router's own grows the router's memory.
type flowLister interface {
	EachMarked(family netlink.InetFamily, ranges []ctmarks.Range, fn func(*netlink.ConntrackFlow)) error
}

// TunnelDevice is the encapsulation device seam: the flow-based GRE device in
// gre mode, nothing in mpls mode.
type TunnelDevice interface {
	// Ensure creates the device if needed and returns its index (0 if none).
	Ensure() (int, error)
	// Remove deletes the device if the router created it.
	Remove() error
}

// ErrWrongFamily is wrapped by the errors about a tunnel IP or endpoint of a
// family the datapath does not program (see Config.Family and Families).
var ErrWrongFamily = errors.New("address family not served")

// Datapath owns the router's kernel state of one address family (see
// Config.Family): one policy rule per slot (generation x bucket), one route
// per tunnel IP per slot table in use, one nexthop object per endpoint those
// routes lead to, the HMARK rules, and the tunnel device. It programs and
// reads only its family's rules, routes, nexthop objects and conntrack
// entries, and refuses tunnel IPs of the other family.
//
// It keeps what it believes the kernel holds, diffs the desired state against
// it and applies only the difference. Resync re-reads the kernel, which adopts
// existing state after a restart and repairs drift.
type Datapath struct {
	cfg      Config
	routes   RouteOps
	rules    RuleOps
	chain    markChain
	device   TunnelDevice
	nodeLink func(netip.Addr) (int, error)
	log      logrus.FieldLogger

	// flows lists conntrack entries (generation collection); nil disables it.
	flows flowLister

	mu      sync.Mutex
	greLink int
	// observed and desired hold, per tunnel IP, one entry per slot. Once a
	// change is applied both maps name the same slice: a slots slice is
	// never written in place, only replaced.
	observed map[netip.Addr][]nextHop
	desired  map[netip.Addr][]nextHop
	nexthops *nexthopTable             // the nexthop objects the observed routes use
	addrs    *addrTable                // the addresses the next hops hold
	current  map[netip.Addr]int        // per tunnel IP, the generation of new flows
	age      map[netip.Addr][]uint64   // per tunnel IP and generation, when it became current
	clock    uint64                    // advances at every generation switch
	affinity map[netip.Addr]bool       // tunnel IPs hashed on the client's address alone
	ports    map[netip.Addr]portFilter // tunnel IPs whose ports are filtered
	marked   map[netip.Addr]int        // the chain's classes (see markClasses) at the last sync; nil: unknown
	// markedPorts are the port filters (portKey) at the last sync.
	markedPorts map[netip.Addr]string
	stale       bool // a write failed: re-read the kernel before the next change
	ops         uint64
}

// NewDatapath wires the kernel seams together, for the family cfg.Family:
// chain is that family's HMARK chain, device its flow-based device (a
// GREDevice of the family in gre mode), and nodeLink returns the output
// interface towards a node address of the family (mpls mode; it may be nil
// in gre mode). routes and rules serve both families.
func NewDatapath(cfg Config, routes RouteOps, rules RuleOps, chain markChain, device TunnelDevice, nodeLink func(netip.Addr) (int, error), log logrus.FieldLogger) *Datapath {
	addrs := newAddrTable()
	return &Datapath{
		cfg: cfg, routes: routes, rules: rules, chain: chain, device: device, nodeLink: nodeLink,
		log:      log.WithField("family", cfg.Family.String()),
		observed: map[netip.Addr][]nextHop{},
		desired:  map[netip.Addr][]nextHop{},
		nexthops: newNexthopTable(cfg, addrs),
		addrs:    addrs,
		current:  map[netip.Addr]int{},
		age:      map[netip.Addr][]uint64{},
		affinity: map[netip.Addr]bool{},
		ports:    map[netip.Addr]portFilter{},
	}
}

// Family is the address family of the tunnel IPs d programs.
func (d *Datapath) Family() Family { return d.cfg.Family }

// checkFamily refuses a tunnel IP of the other family.
func (d *Datapath) checkFamily(vip netip.Addr) error {
	if !d.cfg.Family.has(vip) {
		return fmt.Errorf("tunnel %v: %w: this datapath programs %v tunnel IPs", vip, ErrWrongFamily, d.cfg.Family)
	}
	return nil
}

// compactAddrs frees the interned addresses no next hop holds any more,
// once there are enough of them (see addrTable). It runs at the end of each
// change, when the desired and observed states and the nexthop objects
// hold every next hop in use.
func (d *Datapath) compactAddrs() {
	if !d.addrs.sweepDue() {
		return
	}
	d.addrs.sweep(func(mark func(nextHop)) {
		for _, states := range []map[netip.Addr][]nextHop{d.observed, d.desired} {
			for _, hops := range states {
				for _, h := range hops {
					mark(h)
				}
			}
		}
		for h := range d.nexthops.ids {
			mark(h)
		}
		for _, h := range d.nexthops.hops {
			mark(h)
		}
	})
}

// EnableGenerationCollection gives the datapath the conntrack table, in which
// CollectGenerations looks for flows of older generations.
func (d *Datapath) EnableGenerationCollection(flows flowLister) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flows = flows
}

// Ops returns the number of kernel write operations done so far: routes
// replaced or deleted, nexthop objects added or deleted, rules added or
// deleted, iptables rules written.
func (d *Datapath) Ops() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ops
}

// hops turns a bucket table into next hops.
func (d *Datapath) hops(t Tunnel) ([]nextHop, error) {
	hops := make([]nextHop, d.cfg.Buckets)
	if len(t.Table) == 0 {
		for b := range hops {
			hops[b] = nextHop{kind: hopDrop}
		}
		return hops, nil
	}
	if len(t.Table) != d.cfg.Buckets {
		return nil, fmt.Errorf("tunnel %v: table has %d buckets, want %d", t.VIP, len(t.Table), d.cfg.Buckets)
	}
	byAddr := map[netip.Addr]nextHop{}
	for b, ep := range t.Table {
		h, ok := byAddr[ep.Addr]
		if !ok {
			var err error
			if h, err = d.cfg.hopFor(ep, d.greLink, d.nodeLink, d.addrs); err != nil {
				return nil, fmt.Errorf("tunnel %v bucket %d: %w", t.VIP, b, err)
			}
			byAddr[ep.Addr] = h
		}
		hops[b] = h
	}
	return hops, nil
}

// presentHops returns whether a next hop leads to one of t's present endpoints.
func (d *Datapath) presentHops(t Tunnel) func(nextHop) bool {
	set := map[nextHop]bool{}
	for _, ep := range append(slices.Clone(t.Present), t.Table...) {
		if h, err := d.cfg.hopFor(ep, d.greLink, d.nodeLink, d.addrs); err == nil {
			set[h] = true
		}
	}
	return func(h nextHop) bool { return set[h] }
}

// plan sets the desired slots and current generation of t.VIP from have,
// the slots it has now.
func (d *Datapath) plan(t Tunnel, have []nextHop, cur int) error {
	want, err := d.hops(t)
	if err != nil {
		return err
	}
	have = contents(have)
	next, newCur, switched, moved := planGenerations(d.cfg, have, cur, d.age[t.VIP], want, d.presentHops(t),
		func() []int { return d.liveFlowsBySlot(t.VIP) })
	next = trimSlots(next)
	if !d.cfg.nextHopObjects() {
		// The routes carry their next hops inline (see nextHopObjects).
		for i := range next {
			next[i].inline = next[i].endpoint()
		}
	}
	d.desired[t.VIP] = next
	d.current[t.VIP] = newCur
	if t.ClientAffinity {
		d.affinity[t.VIP] = true
	} else {
		delete(d.affinity, t.VIP)
	}
	if t.FilterPorts {
		d.ports[t.VIP] = portFilter{ports: slices.Clone(t.Ports), key: t.portKey()}
	} else {
		delete(d.ports, t.VIP)
	}
	if switched {
		d.clock++
		age := d.age[t.VIP]
		if len(age) < d.cfg.Generations {
			age = append(age, make([]uint64, d.cfg.Generations-len(age))...)
		}
		age[newCur] = d.clock
		d.age[t.VIP] = age
		d.log.WithFields(logrus.Fields{"vip": t.VIP, "from_generation": cur, "to_generation": newCur,
			"generations_in_use": generationsInUse(d.cfg, next)}).Info("new flows go to a new generation; established flows keep theirs")
	}
	if moved > 0 {
		d.log.WithFields(logrus.Fields{"vip": t.VIP, "generation": newCur, "established_flows_moved": moved, "generations": d.cfg.Generations}).
			Warn("every routing generation holds established flows: overwrote the one with the fewest that change endpoint; those flows break (raise --generations)")
	}
	return nil
}

// SetTunnel programs one tunnel IP of the datapath's family. Routes go in
// before the HMARK rule, so a marked packet always finds a route in its
// bucket table (never the main table); nexthop objects go in before the
// routes that use them, and those no route uses any more go last.
func (d *Datapath) SetTunnel(t Tunnel) error {
	if err := d.checkFamily(t.VIP); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.compactAddrs()
	if d.greLink == 0 {
		link, err := d.device.Ensure()
		if err != nil {
			return fmt.Errorf("tunnel device: %w", err)
		}
		d.greLink = link
	}
	if err := d.refreshIfStale(); err != nil {
		return err
	}
	previous, existed := d.desired[t.VIP]
	previousCur, hadCur := d.current[t.VIP]
	have, cur := previous, previousCur
	if !existed {
		// Not programmed by this process yet: adopt what the kernel has.
		have, cur = d.observed[t.VIP], d.current[t.VIP]
	}
	start := time.Now()
	if err := d.plan(t, have, cur); err != nil {
		return err
	}
	planned := time.Now()
	ops, err := d.diffVIP(t.VIP, nil)
	if err == nil {
		err = d.applyRoutes(ops)
	}
	routed := time.Now()
	if err != nil {
		// A new tunnel IP must not get its HMARK rule without its routes.
		if existed {
			d.desired[t.VIP] = previous
		} else {
			delete(d.desired, t.VIP)
		}
		if hadCur {
			d.current[t.VIP] = previousCur
		} else {
			delete(d.current, t.VIP)
		}
		return err
	}
	err = errors.Join(d.syncMarks(false), d.collectNextHops())
	if took := time.Since(start); took > slowWrite {
		d.log.WithFields(logrus.Fields{"vip": t.VIP, "took_ms": took.Milliseconds(),
			"plan_ms":   planned.Sub(start).Milliseconds(),  // the generation's choice (a conntrack listing)
			"routes_ms": routed.Sub(planned).Milliseconds(), // the bucket routes
			"rules_ms":  time.Since(routed).Milliseconds(),  // the HMARK chain and sets, unused nexthops
			"route_ops": len(ops)}).Info("slow table write")
	}
	return err
}

// slowWrite is how long a SetTunnel may take before it logs where its
// time went ("slow table write").
const slowWrite = time.Second

// CurrentGeneration returns the routing generation new flows to vip are
// hashed into, as last programmed (0 for a tunnel IP it does not hold).
func (d *Datapath) CurrentGeneration(vip netip.Addr) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.current[vip]
}

// refreshIfStale re-reads the kernel's routes after a failed write.
func (d *Datapath) refreshIfStale() error {
	if !d.stale {
		return nil
	}
	if err := d.readRoutes(); err != nil {
		return err
	}
	d.stale = false
	return nil
}

// RemoveTunnel removes everything a tunnel IP had: the HMARK rule first, so no
// packet is marked for a table that no longer routes it, then its routes. A
// tunnel IP of the other family has nothing here to remove.
func (d *Datapath) RemoveTunnel(vip netip.Addr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.compactAddrs()
	if _, ok := d.desired[vip]; !ok && d.observed[vip] == nil {
		return nil
	}
	if err := d.refreshIfStale(); err != nil {
		return err
	}
	delete(d.desired, vip)
	delete(d.current, vip)
	delete(d.age, vip)
	delete(d.affinity, vip)
	delete(d.ports, vip)
	if err := d.syncMarks(false); err != nil {
		return err
	}
	ops, err := d.diffVIP(vip, nil)
	if err == nil {
		err = d.applyRoutes(ops)
	}
	if err != nil {
		return err
	}
	if err := d.collectNextHops(); err != nil {
		return err
	}
	return d.removeDeviceIfUnused()
}

// removeDeviceIfUnused removes the tunnel device (one the router created)
// once no tunnel IP of the family is wanted or left in the kernel: the
// router creates it for the first tunnel IP and keeps it only while one
// needs it.
func (d *Datapath) removeDeviceIfUnused() error {
	if len(d.desired) > 0 || len(d.observed) > 0 {
		return nil
	}
	if err := d.device.Remove(); err != nil {
		return fmt.Errorf("tunnel device: %w", err)
	}
	d.greLink = 0
	return nil
}

// Resync makes the kernel match the desired tunnels exactly: it ensures the
// device and the bucket rules, re-reads the routes in the router's tables,
// replaces what differs and deletes what is not wanted. tunnels is the whole
// desired state. At start-up this adopts what a previous run left, changing
// nothing that is already right; later it repairs drift.
func (d *Datapath) Resync(tunnels []Tunnel) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.compactAddrs()
	// A tunnel IP of the other family is refused; the others go on.
	var errs []error
	own := make([]Tunnel, 0, len(tunnels))
	for _, t := range tunnels {
		if err := d.checkFamily(t.VIP); err != nil {
			errs = append(errs, err)
			continue
		}
		own = append(own, t)
	}
	tunnels = own
	// The device is needed once a tunnel IP is: a family that has none
	// (an IPv4-only cluster's IPv6 datapath) neither creates nor requires
	// its device.
	if len(tunnels) > 0 {
		link, err := d.device.Ensure()
		if err != nil {
			return errors.Join(append(errs, fmt.Errorf("tunnel device: %w", err))...)
		}
		d.greLink = link
	}
	if err := d.syncRules(); err != nil {
		errs = append(errs, err)
	}
	if err := d.readRoutes(); err != nil {
		return errors.Join(append(errs, err)...)
	}
	// Which generation each tunnel IP's new flows use is in its HMARK rule.
	offsets, err := d.chain.Offsets()
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("hmark chain: reading generations: %w", err))...)
	}
	kernelCur := make(map[netip.Addr]int, len(offsets))
	for vip, off := range offsets {
		if g, ok := d.cfg.generationOfOffset(off); ok {
			kernelCur[vip] = g
		}
	}
	// A tunnel whose next hops cannot be computed (say, an MPLS endpoint
	// whose node has no route) keeps what the kernel has for it; it never
	// holds up the others.
	oldCurrent := d.current
	d.desired, d.current = make(map[netip.Addr][]nextHop, len(tunnels)), make(map[netip.Addr]int, len(tunnels))
	d.affinity = map[netip.Addr]bool{}
	d.ports = map[netip.Addr]portFilter{}
	for _, t := range tunnels {
		cur, ok := kernelCur[t.VIP]
		if !ok {
			cur = oldCurrent[t.VIP]
		}
		if err := d.plan(t, d.observed[t.VIP], cur); err != nil {
			d.log.WithError(err).WithField("vip", t.VIP).Warn("tunnel cannot be programmed; keeping its current state")
			if have := d.observed[t.VIP]; have != nil {
				d.desired[t.VIP] = slices.Clone(have)
				d.current[t.VIP] = cur
			} else {
				delete(d.desired, t.VIP)
				delete(d.current, t.VIP)
			}
			continue
		}
	}
	for vip := range d.age {
		if _, ok := d.desired[vip]; !ok {
			delete(d.age, vip)
		}
	}
	// New tunnel IPs get their routes before their mark; removed ones lose
	// their mark before their routes.
	var wanted []netip.Addr
	for vip := range d.desired {
		wanted = append(wanted, vip)
	}
	if err := d.applyChunked(wanted); err != nil {
		return errors.Join(append(errs, err)...)
	}
	if err := d.syncMarks(true); err != nil {
		return errors.Join(append(errs, err)...)
	}
	var unwanted []netip.Addr
	for vip := range d.observed {
		if _, ok := d.desired[vip]; !ok {
			unwanted = append(unwanted, vip)
		}
	}
	if err := d.applyChunked(unwanted); err != nil {
		errs = append(errs, err)
	}
	if err := d.collectNextHops(); err != nil {
		errs = append(errs, err)
	} else if err := d.removeDeviceIfUnused(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// applyChunk bounds the route operations held in memory at once: a full
// resync of 640,000 routes would otherwise build them all before sending.
const applyChunk = 8192

// applyChunked converges the routes of vips, a chunk of operations at a time.
func (d *Datapath) applyChunked(vips []netip.Addr) error {
	ops := make([]rtnl.Op, 0, applyChunk+2*ownedSlots)
	for _, vip := range vips {
		var err error
		if ops, err = d.diffVIP(vip, ops); err != nil {
			return errors.Join(err, d.applyRoutes(ops))
		}
		if len(ops) >= applyChunk {
			if err := d.applyRoutes(ops); err != nil {
				return err
			}
			ops = ops[:0]
		}
	}
	return d.applyRoutes(ops)
}

// diffVIP appends the operations that turn the observed routes of vip into
// the desired ones, updating the observed state (and the nexthop objects'
// references) as if they succeeded. A route to an endpoint whose nexthop
// object does not exist yet comes after the operation that creates it. If
// no id is left for a new object, the operations so far are returned with
// the error, and the kernel is re-read before the next change.
func (d *Datapath) diffVIP(vip netip.Addr, ops []rtnl.Op) ([]rtnl.Op, error) {
	want, have := d.desired[vip], d.observed[vip]
	for b := 0; b < max(len(want), len(have)); b++ {
		var w, h nextHop
		if b < len(want) {
			w = want[b]
		}
		if b < len(have) {
			h = have[b]
		}
		if w == h {
			continue
		}
		var id uint32
		switch {
		case w.kind == hopNone:
			ops = append(ops, rtnl.Op{Kind: rtnl.Delete, Route: d.cfg.route(vip, b, nextHop{kind: hopDrop}, 0)})
		case w.inline:
			ops = append(ops, rtnl.Op{Kind: rtnl.Replace, Route: d.cfg.inlineRoute(vip, b, w, d.addrs)})
		case w.endpoint():
			var ok bool
			if id, ok = d.nexthops.ids[w]; !ok {
				var err error
				if id, err = d.nexthops.allocate(w); err != nil {
					d.stale = true
					return ops, fmt.Errorf("tunnel %v, slot %d: %w", vip, b, err)
				}
				ops = append(ops, rtnl.Op{Kind: rtnl.AddNextHop, NextHop: d.cfg.nextHopObject(w, id, d.addrs)})
			}
			fallthrough
		default:
			ops = append(ops, rtnl.Op{Kind: rtnl.Replace, Route: d.cfg.route(vip, b, w, id)})
		}
		d.nexthops.unref(d.nexthops.idOf(h))
		d.nexthops.ref(id)
	}
	if want == nil {
		delete(d.observed, vip)
	} else {
		d.observed[vip] = want // shared with desired: slots are never written in place
	}
	return ops, nil
}

// collectNextHops deletes the router's nexthop objects that no route in its
// tables uses any more, once the route changes that left them unused are in
// the kernel (never after a failed write: deleting an object deletes the
// routes that still use it).
func (d *Datapath) collectNextHops() error {
	if d.stale {
		return nil
	}
	ids := d.nexthops.collectable()
	if len(ids) == 0 {
		return nil
	}
	ops := make([]rtnl.Op, len(ids))
	for i, id := range ids {
		ops[i] = rtnl.Op{Kind: rtnl.DeleteNextHop, NextHop: rtnl.NextHop{ID: id}}
	}
	if err := d.applyRoutes(ops); err != nil {
		return fmt.Errorf("deleting unused nexthop objects: %w", err)
	}
	for _, id := range ids {
		d.nexthops.forget(id)
	}
	return nil
}

// applyRoutes sends route operations. On failure the observed state is
// unknown: it is re-read before the next change.
func (d *Datapath) applyRoutes(ops []rtnl.Op) error {
	if len(ops) == 0 {
		return nil
	}
	err := d.routes.Apply(ops)
	d.ops += uint64(len(ops))
	if err != nil {
		var ae *rtnl.ApplyError
		if errors.As(err, &ae) {
			d.ops -= uint64(len(ae.Failed))
		}
		d.stale = true
		return fmt.Errorf("programming %d routes and nexthop objects: %w", len(ops), err)
	}
	return nil
}

// readRoutes replaces the observed state with what the kernel holds: the
// router's nexthop objects, and the routes in the router's tables (every
// table it could have used, up to ownedSlots, so that a smaller bucket or
// generation count still finds the old tables' routes).
func (d *Datapath) readRoutes() error {
	nexthops, err := d.routes.ListNextHops(0) // every owner's and family's: their ids are taken
	if errors.Is(err, unix.EOPNOTSUPP) {
		// A kernel without nexthop objects (before Linux 5.3) holds none;
		// the kernel check keeps the router from starting on one, but
		// --cleanup may run there.
		nexthops, err = nil, nil
	}
	if err != nil {
		return fmt.Errorf("listing nexthop objects: %w", err)
	}
	// The routes are read one by one: at 10,000 tunnel IPs the tables hold
	// 640,000 of them, several hundred MB as a list.
	var observed map[netip.Addr][]nextHop
	reset := func() {
		d.nexthops.load(d.cfg, nexthops)
		observed = make(map[netip.Addr][]nextHop, len(d.desired))
	}
	reset()
	last := d.cfg.TableBase + ownedSlots - 1
	err = d.routes.Walk(rtnl.ListFilter{
		IPv6:     d.cfg.Family == IPv6,
		Tables:   rtnl.TableRange{First: uint32(d.cfg.TableBase), Last: uint32(last)},
		Protocol: d.cfg.RouteProtocol,
	}, reset, func(r rtnl.Route) error {
		vip, slot, hop, ok := d.cfg.hopOf(&r, d.nexthops, d.addrs)
		if !ok {
			return nil
		}
		hops := observed[vip]
		if len(hops) <= slot {
			// Up to the end of the slot's generation: most tunnel IPs
			// only use generation 0 (see trimSlots).
			end := (slot/d.cfg.Buckets + 1) * d.cfg.Buckets
			hops = append(hops, make([]nextHop, end-len(hops))...)
			observed[vip] = hops
		}
		hops[slot] = hop
		d.nexthops.ref(d.nexthops.idOf(hop))
		return nil
	})
	if err != nil {
		return fmt.Errorf("listing routes in tables %d-%d: %w", d.cfg.TableBase, last, err)
	}
	d.nexthops.markUnreferenced()
	d.observed = observed
	d.stale = false
	return nil
}

// syncMarks gives the HMARK chain exactly the desired tunnel IPs, each with
// the offset of its current generation. Unless force is set, it is skipped
// when nothing changed since the last sync, and otherwise writes only the
// changed tunnel IPs' set elements (hmark's Update, which reads nothing);
// force (Resync) reads and repairs everything (Sync).
func (d *Datapath) syncMarks(force bool) error {
	if !force && d.marksCurrent() && len(d.current) == len(d.desired) {
		return nil
	}
	targets := make([]hmark.Target, 0, len(d.desired))
	for vip := range d.desired {
		p, filter := d.ports[vip]
		targets = append(targets, hmark.Target{VIP: vip, Offset: d.cfg.GenerationOffset(d.current[vip]), ClientAffinity: d.affinity[vip],
			FilterPorts: filter, Ports: p.ports})
	}
	slices.SortFunc(targets, func(a, b hmark.Target) int { return a.VIP.Compare(b.VIP) })
	sync := d.chain.Update
	if force {
		sync = d.chain.Sync
	}
	n, err := sync(targets)
	d.ops += uint64(n)
	if err != nil {
		d.marked = nil
		return fmt.Errorf("hmark chain: %w", err)
	}
	d.marked = make(map[netip.Addr]int, len(d.current))
	for vip, g := range d.current {
		d.marked[vip] = d.markClass(vip, g)
	}
	d.markedPorts = make(map[netip.Addr]string, len(d.ports))
	for vip, p := range d.ports {
		d.markedPorts[vip] = p.key
	}
	return nil
}

// markClass is what tunnel IP vip's HMARK rule depends on: its current
// generation g, plus MaxGenerations with client affinity.
func (d *Datapath) markClass(vip netip.Addr, g int) int {
	if d.affinity[vip] {
		return g + MaxGenerations
	}
	return g
}

// marksCurrent reports whether the chain holds every tunnel IP's class as
// of the last sync (no allocation: it runs at every SetTunnel).
func (d *Datapath) marksCurrent() bool {
	if d.marked == nil || len(d.marked) != len(d.current) {
		return false
	}
	for vip, g := range d.current {
		if k, ok := d.marked[vip]; !ok || k != d.markClass(vip, g) {
			return false
		}
	}
	if len(d.markedPorts) != len(d.ports) {
		return false
	}
	for vip, p := range d.ports {
		if k, ok := d.markedPorts[vip]; !ok || k != p.key {
			return false
		}
	}
	return true
}

// portFilter is a filtered tunnel IP's ports, and its portKey.
type portFilter struct {
	ports []hmark.Port
	key   string
}

// GuardRules are the two rules that let packets without a router mark skip
// the slot rules, so that the router's policy rules cost the rest of a
// node's traffic two rules: at RulePriority-1 "not fwmark BLOCK/MASK goto
// P", and at P, just after the slot rules, a rule that does nothing
// (FR_ACT_NOP), the goto's target. A packet the router marked (its mark in
// the block, see MarkBlock) goes on to the slot rules. Should the target be
// missing, the kernel skips the goto (every packet then walks the slot
// rules' tests, as without the guard).
func (c Config) GuardRules() (guard, target netlink.Rule) {
	value, mask := c.MarkBlock()
	target = c.newRule(c.RulePriority + slotRuleCount(c.Slots()))
	target.Type = ruleActionNop
	guard = c.newRule(c.RulePriority - 1)
	guard.Invert = true
	guard.Mark = value
	guard.Mask = &mask
	guard.Goto = target.Priority
	return guard, target
}

// Policy-rule actions (FR_ACT_*, the rule message's type).
const (
	ruleActionToTable = 1
	ruleActionGoto    = 2
	ruleActionNop     = 3
)

// ownsRule reports whether r is one of the router's rules: of its family,
// in its priority range (the guard at RulePriority-1, then the rules of up
// to ownedSlots slots, fewer than 2*ownedSlots, and the guard's target
// after them) and carrying its protocol.
func (c Config) ownsRule(r *netlink.Rule) bool {
	return r.Family == c.Family.af() && r.Priority >= c.RulePriority-1 && r.Priority <= c.RulePriority+2*ownedSlots && r.Protocol == c.RouteProtocol
}

func sameRule(a, b *netlink.Rule) bool {
	mask := func(r *netlink.Rule) uint32 {
		if r.Mask == nil {
			return 0xffffffff
		}
		return *r.Mask
	}
	// netlink's rule listing leaves Type out: a rule without a goto and
	// without a table does nothing (a "to table" rule needs its table).
	action := func(r *netlink.Rule) uint8 {
		switch {
		case r.Type != 0:
			return r.Type
		case r.Goto >= 0:
			return ruleActionGoto
		case r.Table == 0:
			return ruleActionNop
		}
		return ruleActionToTable
	}
	goTo := func(r *netlink.Rule) int { return max(r.Goto, -1) }
	return a.Priority == b.Priority && a.Mark == b.Mark && mask(a) == mask(b) && a.Table == b.Table &&
		a.Invert == b.Invert && goTo(a) == goTo(b) && action(a) == action(b) &&
		a.Src == nil && a.Dst == nil && a.IifName == "" && a.OifName == ""
}

// syncRules makes the router's policy rules exactly one per slot, and the
// guard with its target (see GuardRules).
func (d *Datapath) syncRules() error {
	all, err := d.rules.RuleListFiltered(d.cfg.Family.af(), nil, 0)
	if err != nil {
		return fmt.Errorf("listing rules: %w", err)
	}
	have := map[int][]netlink.Rule{}
	for _, r := range all {
		if d.cfg.ownsRule(&r) {
			have[r.Priority] = append(have[r.Priority], r)
		}
	}
	guard, target := d.cfg.GuardRules()
	// The lookups first, then the tests that jump to them, then the guard's
	// target, then the guard (so that each goto resolves at once); stale
	// rules go last. While an older layout's rules (a row of lookups)
	// remain, every rule that matches still looks up the packet's own
	// slot's table, and a test only skips lookups of other slots.
	tree := d.cfg.SlotRules()
	want := make([]netlink.Rule, 0, len(tree)+2)
	for _, r := range tree {
		if r.Goto <= 0 {
			want = append(want, r)
		}
	}
	for _, r := range slices.Backward(tree) {
		if r.Goto > 0 {
			want = append(want, r)
		}
	}
	want = append(want, target, guard)
	var errs []error
	for _, w := range want {
		found := false
		for i, r := range have[w.Priority] {
			if sameRule(&r, &w) {
				found = true
				have[w.Priority] = slices.Delete(have[w.Priority], i, i+1)
				break
			}
		}
		if !found {
			d.ops++
			if err := d.rules.RuleAdd(&w); err != nil {
				errs = append(errs, fmt.Errorf("adding rule pref %d (fwmark %#x table %d goto %d): %w", w.Priority, w.Mark, w.Table, w.Goto, err))
			}
		}
	}
	for _, rules := range have {
		for _, r := range rules {
			d.ops++
			if err := d.rules.RuleDel(&r); err != nil {
				errs = append(errs, fmt.Errorf("deleting stale rule pref %d table %d: %w", r.Priority, r.Table, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Cleanup removes everything the router owns of its family and nothing
// else: the HMARK chain, the rules of the family in its priority range with
// its protocol, the routes of the family in its tables with its protocol,
// its nexthop objects of the family, and the device it created.
func (d *Datapath) Cleanup() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.compactAddrs()
	var errs []error
	if err := d.chain.Cleanup(); err != nil {
		errs = append(errs, fmt.Errorf("hmark chain: %w", err))
	}
	d.desired, d.current, d.age = map[netip.Addr][]nextHop{}, map[netip.Addr]int{}, map[netip.Addr][]uint64{}
	d.marked = nil
	if all, err := d.rules.RuleListFiltered(d.cfg.Family.af(), nil, 0); err != nil {
		errs = append(errs, fmt.Errorf("listing rules: %w", err))
	} else {
		for _, r := range all {
			if d.cfg.ownsRule(&r) {
				if err := d.rules.RuleDel(&r); err != nil {
					errs = append(errs, fmt.Errorf("deleting rule pref %d: %w", r.Priority, err))
				}
			}
		}
	}
	if err := d.readRoutes(); err != nil {
		errs = append(errs, err)
	} else {
		var vips []netip.Addr
		for vip := range d.observed {
			vips = append(vips, vip)
		}
		if err := d.applyChunked(vips); err != nil {
			errs = append(errs, err)
		} else if err := d.collectNextHops(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := d.device.Remove(); err != nil {
		errs = append(errs, fmt.Errorf("tunnel device: %w", err))
	}
	return errors.Join(errs...)
}

// trimSlots drops the trailing slots without a route (the generations
// after the last one in use), in a copy when it drops any, so that a tunnel
// IP on one generation keeps Buckets slots, not Buckets × Generations: at
// 10,000 tunnel IPs × 64 buckets × 4 generations that is 20 MB instead of
// 80 MB for the desired and observed states. Every reader treats a missing
// slot as hopNone.
func trimSlots(hops []nextHop) []nextHop {
	n := len(hops)
	for n > 0 && hops[n-1].kind == hopNone {
		n--
	}
	if n == len(hops) {
		return hops
	}
	return slices.Clone(hops[:n])
}

// contents returns hops without their inline marks (a copy, if any is set).
func contents(hops []nextHop) []nextHop {
	if !slices.ContainsFunc(hops, func(h nextHop) bool { return h.inline }) {
		return hops
	}
	out := make([]nextHop, len(hops))
	for i, h := range hops {
		out[i] = h.content()
	}
	return out
}
