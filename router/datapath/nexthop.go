package datapath

import (
	"fmt"
	"net/netip"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// hopKind says what a bucket does with a tunnel IP's packets.
type hopKind uint8

const (
	hopNone    hopKind = iota // no route
	hopDrop                   // blackhole: the tunnel IP has no ready endpoint
	hopGRE                    // IP encap to the pod through the flow-based GRE device
	hopMPLS                   // MPLS label towards the pod's node
	hopUnknown                // a route in our table that the router did not build
)

// greTTL is the outer TTL of GRE packets.
const greTTL = 64

// nextHop is the compact form, 16 bytes, in which the router keeps each bucket
// of each tunnel IP: 10,000 tunnel IPs x 64 buckets fit in about 10 MB. A
// next hop towards an endpoint (hopGRE, hopMPLS) is also the content of the
// endpoint's nexthop object, which every bucket route to it names by id.
type nextHop struct {
	kind hopKind
	// inline marks a listed route that reaches this next hop with a next
	// hop of its own (as routers before nexthop objects wrote them) instead
	// of through the nexthop object: it is rewritten, but planning counts
	// it as this next hop, so that an upgrade keeps every generation's
	// endpoints. It fits in padding: the struct stays 16 bytes.
	inline bool
	// addr is the index of the next hop's address in the Datapath's
	// addrTable (gre: the pod IP; mpls: the node IP): an address of either
	// family in 4 bytes, where an IPv6 one would take 16.
	addr uint32
	// label is the MPLS label (hopMPLS), or, for hopUnknown, the id of the
	// router's nexthop object that the route uses (0 if none), so that the
	// object is not deleted while the route still needs it.
	label uint32
	link  int32 // output device
}

// String names the address by its index (see addrTable).
func (h nextHop) String() string {
	var s string
	switch h.kind {
	case hopDrop:
		return "drop"
	case hopGRE:
		s = fmt.Sprintf("gre to address #%d", h.addr)
	case hopMPLS:
		s = fmt.Sprintf("mpls %d via address #%d", h.label, h.addr)
	case hopUnknown:
		return "foreign route"
	default:
		return "none"
	}
	if h.inline {
		s += " (inline)"
	}
	return s
}

// nextHopObjects reports whether the bucket routes name nexthop objects:
// in gre mode. In mpls mode they carry their next hop inline, as before:
// a nexthop object's device is the node link, and the kernel deletes every
// nexthop object on a device (and the routes that name it) when the device
// loses its carrier, and refuses to create one while it has none, whereas
// an inline route only goes "linkdown" and works again when the carrier
// returns. A flapping uplink would take the router's routes away, older
// generations' too. gre mode's device is the router's own flow-based GRE
// device, which has no carrier to lose.
func (c Config) nextHopObjects() bool { return c.Mode != encap.MPLS }

// endpoint reports whether h leads to an endpoint (in gre mode through a
// nexthop object).
func (h nextHop) endpoint() bool { return h.kind == hopGRE || h.kind == hopMPLS }

// content is h without the inline mark: the next hop itself, as planning
// and the nexthop objects see it.
func (h nextHop) content() nextHop {
	h.inline = false
	return h
}

// route builds the kernel route for slot k of vip: a blackhole, or a
// unicast route through nexthop object id (the endpoint's, see
// nextHopObject).
func (c Config) route(vip netip.Addr, k int, h nextHop, id uint32) rtnl.Route {
	r := rtnl.Route{
		Table:    uint32(c.Table(k)),
		Dst:      netip.PrefixFrom(vip, c.Family.bits()),
		Type:     rtnl.Unicast,
		Protocol: c.RouteProtocol,
	}
	if h.kind == hopDrop {
		r.Type = rtnl.Blackhole
	} else {
		r.NextHopID = id
	}
	return r
}

// inlineRoute is the route of slot k of vip with next hop h in the route
// itself, as routers before nexthop objects wrote it: in gre mode only
// read (and rewritten to name the endpoint's object), in mpls mode written
// (see nextHopObjects). addrs holds h's address.
func (c Config) inlineRoute(vip netip.Addr, k int, h nextHop, addrs *addrTable) rtnl.Route {
	r := c.route(vip, k, h, 0)
	switch h.kind {
	case hopGRE:
		r.LinkIndex = int(h.link)
		r.IPEncap = &rtnl.IPEncap{Dst: addrs.addr(h.addr), Src: c.encapSource(), TTL: greTTL}
	case hopMPLS:
		r.LinkIndex = int(h.link)
		r.Gateway = addrs.addr(h.addr)
		r.MPLSLabels = []uint32{h.label}
	}
	return r
}

// nextHopObject is the nexthop object id for endpoint next hop h (gre: the
// IP encapsulation to the pod over the GRE device; mpls: the label push via
// the node on the node's link), of c's family (an IPv6 route takes only an
// IPv6 one), marked as the router's by its protocol. addrs holds h's
// address.
func (c Config) nextHopObject(h nextHop, id uint32, addrs *addrTable) rtnl.NextHop {
	n := rtnl.NextHop{ID: id, Protocol: c.RouteProtocol, IPv6: c.Family == IPv6, LinkIndex: int(h.link)}
	switch h.kind {
	case hopGRE:
		n.IPEncap = &rtnl.IPEncap{Dst: addrs.addr(h.addr), Src: c.encapSource(), TTL: greTTL}
	case hopMPLS:
		n.Gateway = addrs.addr(h.addr)
		n.MPLSLabels = []uint32{h.label}
	}
	return n
}

// hopOfNextHop reads one of the router's listed nexthop objects back into
// the next hop it leads to, its address interned in addrs, or hopUnknown
// if the router would not have built it exactly so.
func (c Config) hopOfNextHop(n *rtnl.NextHop, addrs *addrTable) nextHop {
	var h nextHop
	switch {
	case n.IPEncap != nil && c.Family.has(n.IPEncap.Dst):
		h = nextHop{kind: hopGRE, addr: addrs.intern(n.IPEncap.Dst), link: int32(n.LinkIndex)}
	case len(n.MPLSLabels) == 1 && c.Family.has(n.Gateway):
		h = nextHop{kind: hopMPLS, addr: addrs.intern(n.Gateway), label: n.MPLSLabels[0], link: int32(n.LinkIndex)}
	default:
		return nextHop{kind: hopUnknown}
	}
	if want := c.nextHopObject(h, n.ID, addrs); !want.Equal(n) {
		return nextHop{kind: hopUnknown}
	}
	return h
}

// hopOf reads a listed kernel route back into (tunnel IP, slot, next hop),
// given the router's nexthop objects, interning addresses in addrs. ok is
// false for routes outside the router's tables (all ownedSlots of them,
// whatever the configured slot count, so that routes in tables the
// configuration no longer uses are found and removed) and for routes of
// the other family (which a listing of c's family never holds). A route the router would not have written exactly
// so comes back as hopUnknown, so that it gets replaced; one that names a
// nexthop object of the router's other than the endpoint's (a duplicate)
// too. A route with an inline next hop comes back marked inline.
func (c Config) hopOf(r *rtnl.Route, objs *nexthopTable, addrs *addrTable) (vip netip.Addr, slot int, h nextHop, ok bool) {
	slot = int(r.Table) - c.TableBase
	vip = r.Dst.Addr()
	if slot < 0 || slot >= ownedSlots || r.Protocol != c.RouteProtocol || vip.Is6() != (c.Family == IPv6) {
		return netip.Addr{}, 0, nextHop{}, false
	}
	if r.Dst.Bits() != c.Family.bits() || !c.Family.has(vip) {
		return vip, slot, nextHop{kind: hopUnknown}, true
	}
	if id := r.NextHopID; id != 0 {
		unknown := nextHop{kind: hopUnknown}
		h, ours := objs.hops[id]
		if !ours {
			return vip, slot, unknown, true
		}
		unknown.label = id
		if !h.endpoint() || objs.ids[h] != id {
			return vip, slot, unknown, true
		}
		if want := c.route(vip, slot, h, id); !want.Equal(r) {
			return vip, slot, unknown, true
		}
		return vip, slot, h, true
	}
	switch {
	case r.Type == rtnl.Blackhole:
		h = nextHop{kind: hopDrop}
	case r.IPEncap != nil && c.Family.has(r.IPEncap.Dst):
		h = nextHop{kind: hopGRE, addr: addrs.intern(r.IPEncap.Dst), link: int32(r.LinkIndex), inline: true}
	case len(r.MPLSLabels) == 1 && c.Family.has(r.Gateway):
		h = nextHop{kind: hopMPLS, addr: addrs.intern(r.Gateway), label: r.MPLSLabels[0], link: int32(r.LinkIndex), inline: true}
	default:
		return vip, slot, nextHop{kind: hopUnknown}, true
	}
	if want := c.inlineRoute(vip, slot, h, addrs); !want.Equal(r) {
		h = nextHop{kind: hopUnknown}
	}
	return vip, slot, h, true
}

// hopFor is the next hop that sends a bucket to endpoint ep, its address
// interned in addrs. The endpoint (and in mpls mode its node) must be of
// c's family.
func (c Config) hopFor(ep Endpoint, greLink int, nodeLink func(netip.Addr) (int, error), addrs *addrTable) (nextHop, error) {
	if !c.Family.has(ep.Addr) {
		return nextHop{}, fmt.Errorf("endpoint %v: %w: not an %v address", ep.Addr, ErrWrongFamily, c.Family)
	}
	switch c.Mode {
	case encap.GRE:
		return nextHop{kind: hopGRE, addr: addrs.intern(ep.Addr), link: int32(greLink)}, nil
	case encap.MPLS:
		if !c.Family.has(ep.NodeIP) {
			return nextHop{}, fmt.Errorf("endpoint %v: node %q has no known %v address", ep.Addr, ep.NodeName, c.Family)
		}
		label, err := mplslabel.ForEndpoint(ep.Addr)
		if err != nil {
			return nextHop{}, err
		}
		link, err := nodeLink(ep.NodeIP)
		if err != nil {
			return nextHop{}, fmt.Errorf("endpoint %v: route to node %v: %w", ep.Addr, ep.NodeIP, err)
		}
		return nextHop{kind: hopMPLS, addr: addrs.intern(ep.NodeIP), label: label, link: int32(link)}, nil
	}
	return nextHop{}, fmt.Errorf("unknown mode %q", c.Mode)
}
