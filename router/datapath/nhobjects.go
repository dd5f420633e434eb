package datapath

import (
	"fmt"
	"slices"

	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// Nexthop objects.
//
// Every bucket route to an endpoint names the endpoint's nexthop object by
// id ("ip route ... nhid ID"); the object holds the encapsulation. With the
// next hop inline in each route, the kernel compares every new route's
// next hop with each distinct one already on the device, so programming
// slowed down with the number of distinct pods; a route that names a
// nexthop object skips that.
//
// The router's nexthop objects carry its route protocol, its family and an
// id in its range (Config.NextHopIDs); it never touches another nexthop.
// Nexthop ids are global across families, so each family has ids of its
// own. The ids live
// only in the kernel: a restarted router lists the objects, maps each
// content (next hop) to its id, and adopts them with the routes that use
// them. A new next hop gets the next free id of the range. An object is
// created before the first route that uses it, and deleted (deleting it
// would delete its routes) only once no route in the router's tables
// uses it.

// nextHopIDBits is the size of the router's id block: 2^24 ids per route
// protocol, half of them per family.
const nextHopIDBits = 24

// NextHopIDs is the range of ids the router gives its nexthop objects of
// c's family, in the block of the route protocol times 2^24, so that
// routers with different protocols in one namespace never compete for an
// id: IPv4 takes its lower half from 1 (0xf5000001-0xf57fffff for protocol
// 245), IPv6 its upper half (0xf5800000-0xf5ffffff).
func (c Config) NextHopIDs() (first, last uint32) {
	base := uint32(c.RouteProtocol) << nextHopIDBits
	half := uint32(1) << (nextHopIDBits - 1)
	if c.Family == IPv6 {
		return base + half, base + 2*half - 1
	}
	return base + 1, base + half - 1
}

// ownedNextHopIDs is the range of ids in which the router's objects of c's
// family are found: IPv6 its range, IPv4 the whole block, since routers
// before IPv6 gave IPv4 objects ids in all of it (an IPv6 object there is
// told apart by its family).
func (c Config) ownedNextHopIDs() (first, last uint32) {
	if c.Family == IPv6 {
		return c.NextHopIDs()
	}
	base := uint32(c.RouteProtocol) << nextHopIDBits
	return base + 1, base + 1<<nextHopIDBits - 1
}

// ownsNextHop reports whether n is one of the router's nexthop objects: its
// protocol, its family, and an id in its range.
func (c Config) ownsNextHop(n *rtnl.NextHop) bool {
	first, last := c.ownedNextHopIDs()
	return n.Protocol == c.RouteProtocol && n.IPv6 == (c.Family == IPv6) && n.ID >= first && n.ID <= last
}

// nexthopTable is what the router knows of its nexthop objects: read from
// the kernel, then kept up to date with every change it makes.
type nexthopTable struct {
	// first and last bound the ids allocate gives.
	first, last uint32
	// addrs interns the next hops' addresses.
	addrs *addrTable
	// ids maps an endpoint's next hop to the id of its nexthop object.
	ids map[nextHop]uint32
	// hops maps the id of each of the router's nexthop objects to its next
	// hop (hopUnknown: an object the router would not have built so).
	hops map[uint32]nextHop
	// refs counts, per id, the routes in the router's tables that use it.
	refs map[uint32]int
	// taken holds the ids of the range that other owners' nexthops use.
	taken map[uint32]bool
	// unused holds ids that lost their last route (or never had one): the
	// objects to delete once the route changes are applied.
	unused map[uint32]bool
	// next is where the search for a free id starts.
	next uint32
}

func newNexthopTable(cfg Config, addrs *addrTable) *nexthopTable {
	t := &nexthopTable{addrs: addrs}
	t.first, t.last = cfg.NextHopIDs()
	t.next = t.first
	t.load(cfg, nil)
	return t
}

// load replaces what t knows with the listed nexthop objects (of every
// owner). The reference counts start at zero; ref adds the routes.
func (t *nexthopTable) load(cfg Config, listed []rtnl.NextHop) {
	t.ids, t.hops, t.refs = map[nextHop]uint32{}, map[uint32]nextHop{}, map[uint32]int{}
	t.taken, t.unused = map[uint32]bool{}, map[uint32]bool{}
	for i := range listed {
		n := &listed[i]
		if !cfg.ownsNextHop(n) {
			if n.ID >= t.first && n.ID <= t.last {
				t.taken[n.ID] = true
			}
			continue
		}
		h := cfg.hopOfNextHop(n, t.addrs)
		t.hops[n.ID] = h
		// Two objects with one content: the lowest id is the endpoint's,
		// routes through the other are rewritten, and it is collected.
		if cur, ok := t.ids[h]; h.endpoint() && (!ok || n.ID < cur) {
			t.ids[h] = n.ID
		}
	}
}

// markUnreferenced queues every object without a route for deletion:
// after load and the routes' refs.
func (t *nexthopTable) markUnreferenced() {
	for id := range t.hops {
		if t.refs[id] == 0 {
			t.unused[id] = true
		}
	}
}

// idOf returns the id of the nexthop object the route of next hop h uses,
// as the router sees it: 0 for blackholes, inline routes and routes through
// someone else's nexthop.
func (t *nexthopTable) idOf(h nextHop) uint32 {
	switch {
	case h.kind == hopUnknown:
		return h.label
	case !h.endpoint() || h.inline:
		return 0
	}
	return t.ids[h]
}

// ref counts one more route using id (0: none).
func (t *nexthopTable) ref(id uint32) {
	if id != 0 {
		t.refs[id]++
		delete(t.unused, id)
	}
}

// unref counts one route less using id; an object left without routes is
// queued for deletion.
func (t *nexthopTable) unref(id uint32) {
	if id == 0 {
		return
	}
	if t.refs[id]--; t.refs[id] <= 0 {
		delete(t.refs, id)
		if _, ours := t.hops[id]; ours {
			t.unused[id] = true
		}
	}
}

// allocate gives endpoint next hop h a free id of the range, the next one
// after the last given (skipping the router's objects and other owners'),
// and records it. The object still has to be created.
func (t *nexthopTable) allocate(h nextHop) (uint32, error) {
	for range uint64(t.last-t.first) + 1 {
		id := t.next
		if t.next++; t.next > t.last || t.next < t.first {
			t.next = t.first
		}
		if _, used := t.hops[id]; used || t.taken[id] {
			continue
		}
		t.hops[id], t.ids[h] = h, id
		return id, nil
	}
	return 0, fmt.Errorf("no free nexthop id in %#x-%#x", t.first, t.last)
}

// collectable returns, in order, the queued objects that still have no route.
func (t *nexthopTable) collectable() []uint32 {
	var ids []uint32
	for id := range t.unused {
		if t.refs[id] == 0 {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// forget drops a deleted object.
func (t *nexthopTable) forget(id uint32) {
	if h, ok := t.hops[id]; ok && t.ids[h] == id {
		delete(t.ids, h)
	}
	delete(t.hops, id)
	delete(t.refs, id)
	delete(t.unused, id)
}
