package rtnl

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// RouteType is the rtm_type of a route (RTN_*).
type RouteType uint8

// Route types the router uses. List reports other types (local, broadcast,
// ...) with their raw RTN_* value.
const (
	Unicast     RouteType = unix.RTN_UNICAST
	Blackhole   RouteType = unix.RTN_BLACKHOLE
	Unreachable RouteType = unix.RTN_UNREACHABLE
	Prohibit    RouteType = unix.RTN_PROHIBIT
)

// String returns the iproute2 name of t.
func (t RouteType) String() string {
	switch t {
	case Unicast:
		return "unicast"
	case Blackhole:
		return "blackhole"
	case Unreachable:
		return "unreachable"
	case Prohibit:
		return "prohibit"
	case unix.RTN_LOCAL:
		return "local"
	case unix.RTN_BROADCAST:
		return "broadcast"
	}
	return fmt.Sprintf("type%d", uint8(t))
}

// reject reports whether t is a route type that drops packets, which takes
// no next hop.
func (t RouteType) reject() bool {
	switch t {
	case Blackhole, Unreachable, Prohibit, unix.RTN_THROW:
		return true
	}
	return false
}

// Route is an IPv4 or IPv6 route in one routing table, holding exactly what
// the tunnel router programs: a unicast route with an IP (IP6) or MPLS
// encapsulation, or a blackhole.
//
// At most one of IPEncap and MPLSLabels is set, and only on unicast routes.
type Route struct {
	// Table is the routing table id; tables above 255 are fine. Required.
	Table uint32
	// Dst is the destination prefix, e.g. VIP/32 or VIP6/128. Required,
	// masked; its family is the route's (an IPv4-mapped IPv6 address is
	// refused).
	Dst netip.Prefix
	// Type is Unicast or Blackhole. The zero value is not a valid type.
	Type RouteType
	// Protocol (rtm_protocol) marks who owns the route, as "proto N" in
	// iproute2. The router sets its own number; Delete only removes routes
	// of the given protocol unless it is 0.
	Protocol uint8
	// LinkIndex is the output interface (RTA_OIF), e.g. the flow-based GRE
	// device. The kernel reports the device it resolved even for routes
	// added with only a gateway, so set it to compare with listed routes.
	LinkIndex int
	// Gateway is the next hop (RTA_GATEWAY; RTA_VIA for an IPv6 next hop of
	// an IPv4 route), e.g. the node in MPLS mode. An IPv6 route takes no
	// IPv4 gateway. Unset for IP-encap and blackhole routes.
	Gateway netip.Addr
	// IPEncap is the LWTUNNEL_ENCAP_IP or LWTUNNEL_ENCAP_IP6 encapsulation
	// (GRE mode).
	IPEncap *IPEncap
	// MPLSLabels is the label stack pushed by LWTUNNEL_ENCAP_MPLS (MPLS
	// mode), outermost label first.
	MPLSLabels []uint32
	// NextHopID, if not zero, makes the route use a nexthop object (see
	// NextHop, "ip route ... nhid ID") instead of LinkIndex, Gateway and an
	// encapsulation of its own, which must then be unset; List leaves them
	// unset too. List reports Type Blackhole for a route whose nexthop is a
	// blackhole.
	NextHopID uint32

	// Facts List found that this package does not model. They only make
	// Equal fail against a route built by the router, so that such a route
	// gets replaced.
	otherEncap uint16 // encap type other than IP or MPLS
	multipath  bool   // RTA_MULTIPATH next hops
}

// RouteKey identifies a route: one destination in one table. (The kernel
// can hold several routes per key that differ in metric or TOS; this package
// only programs the default metric, 0 for IPv4 and 1024 for IPv6, and TOS
// 0.) IPv4 and IPv6 tables are apart in the kernel: the keys of a table
// number's routes of both families never collide, their prefixes differ.
type RouteKey struct {
	Table uint32
	Dst   netip.Prefix
}

// String formats k as "table T DST".
func (k RouteKey) String() string { return fmt.Sprintf("table %d %s", k.Table, k.Dst) }

// Key returns the table and destination of r.
func (r *Route) Key() RouteKey { return RouteKey{Table: r.Table, Dst: r.Dst} }

// Equal reports whether r and o are the same route as far as the router is
// concerned: same table, destination, type, protocol, output interface,
// gateway, encapsulation and nexthop id. Everything else the kernel keeps
// (scope, metric, TOS, flags) is not compared.
func (r *Route) Equal(o *Route) bool {
	return r.Table == o.Table && r.Dst == o.Dst && r.Type == o.Type &&
		r.Protocol == o.Protocol && r.LinkIndex == o.LinkIndex &&
		r.Gateway == o.Gateway && r.NextHopID == o.NextHopID &&
		r.IPEncap.Equal(o.IPEncap) &&
		slices.Equal(r.MPLSLabels, o.MPLSLabels) &&
		r.otherEncap == o.otherEncap && r.multipath == o.multipath
}

// String formats r roughly like "ip route show table all".
func (r *Route) String() string {
	var sb strings.Builder
	if r.Type != Unicast {
		sb.WriteString(r.Type.String() + " ")
	}
	sb.WriteString(r.Dst.String())
	if r.IPEncap != nil {
		sb.WriteString(" encap " + r.IPEncap.String())
	}
	if r.MPLSLabels != nil {
		sb.WriteString(" encap mpls " + formatLabels(r.MPLSLabels))
	}
	if r.otherEncap != 0 {
		fmt.Fprintf(&sb, " encap type%d", r.otherEncap)
	}
	if r.NextHopID != 0 {
		fmt.Fprintf(&sb, " nhid %d", r.NextHopID)
	}
	if r.Gateway.IsValid() {
		sb.WriteString(" via " + r.Gateway.String())
	}
	if r.LinkIndex != 0 {
		fmt.Fprintf(&sb, " oif %d", r.LinkIndex)
	}
	if r.multipath {
		sb.WriteString(" multipath")
	}
	fmt.Fprintf(&sb, " table %d proto %d", r.Table, r.Protocol)
	return sb.String()
}

// validate checks what the kernel would otherwise reject with a less
// specific error, or silently interpret differently.
func (r *Route) validate() error {
	if err := r.validateKey(); err != nil {
		return err
	}
	switch {
	case r.Type == 0:
		return fmt.Errorf("%w: no route type", ErrInvalidRoute)
	case r.IPEncap != nil && r.MPLSLabels != nil:
		return fmt.Errorf("%w: both IP and MPLS encapsulation", ErrInvalidRoute)
	case r.Type != Unicast && (r.IPEncap != nil || r.MPLSLabels != nil):
		return fmt.Errorf("%w: encapsulation on a %s route", ErrInvalidRoute, r.Type)
	case r.Type != Unicast && (r.Gateway.IsValid() || r.LinkIndex != 0):
		return fmt.Errorf("%w: next hop on a %s route", ErrInvalidRoute, r.Type)
	case r.Dst.Addr().Is6() && r.Gateway.Is4():
		return fmt.Errorf("%w: IPv6 route with IPv4 gateway %s", ErrInvalidRoute, r.Gateway)
	case r.Gateway.Is4In6():
		return fmt.Errorf("%w: gateway %s is an IPv4-mapped IPv6 address", ErrInvalidRoute, r.Gateway)
	case r.NextHopID != 0 && (r.Type != Unicast || r.Gateway.IsValid() || r.LinkIndex != 0 ||
		r.IPEncap != nil || r.MPLSLabels != nil):
		return fmt.Errorf("%w: nexthop id on a %s route with a next hop of its own", ErrInvalidRoute, r.Type)
	case r.otherEncap != 0 || r.multipath:
		return fmt.Errorf("%w: listed route with unsupported encap or multipath", ErrInvalidRoute)
	}
	if r.IPEncap != nil {
		if err := r.IPEncap.validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
		}
	}
	return validateLabels(r.MPLSLabels)
}

// validateKey checks the fields that identify a route, which is all Delete
// needs.
func (r *Route) validateKey() error {
	switch {
	case r.Table == 0:
		return fmt.Errorf("%w: table 0 (unspecified)", ErrInvalidRoute)
	case !r.Dst.IsValid() || r.Dst.Addr().Is4In6():
		return fmt.Errorf("%w: destination %s is not an IPv4 or IPv6 prefix", ErrInvalidRoute, r.Dst)
	case r.Dst != r.Dst.Masked():
		return fmt.Errorf("%w: destination %s has host bits set", ErrInvalidRoute, r.Dst)
	}
	return nil
}
