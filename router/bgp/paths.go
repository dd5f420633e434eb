package bgp

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
)

// NextHops are the next hops of the tunnel IPs of each family. An invalid
// one means that the tunnel IPs of its family are not announced.
type NextHops struct {
	IPv4, IPv6 netip.Addr
}

// NextHopsFor returns the next hops a configuration and a node give: the
// configured nextHop and nextHopIPv6, else the node's address of each
// family.
func NextHopsFor(cfg Config, node Node) NextHops {
	h := NextHops{IPv4: node.Address, IPv6: node.AddressIPv6}
	if cfg.NextHop != "" {
		h.IPv4 = netip.MustParseAddr(cfg.NextHop)
	}
	if cfg.NextHopIPv6 != "" {
		h.IPv6 = netip.MustParseAddr(cfg.NextHopIPv6)
	}
	if !h.IPv4.Is4() {
		h.IPv4 = netip.Addr{}
	}
	if !usableIPv6NextHop(h.IPv6) {
		h.IPv6 = netip.Addr{}
	}
	return h
}

// For returns the next hop of vip's family, invalid when there is none.
func (h NextHops) For(vip netip.Addr) netip.Addr {
	if vip.Is4() {
		return h.IPv4
	}
	return h.IPv6
}

// familyName is "IPv4" or "IPv6", the family of a tunnel IP.
func familyName(vip netip.Addr) string {
	if vip.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

// missingNextHop says why the tunnel IPs of vip's family are not announced
// and what to set.
func missingNextHop(vip netip.Addr, node string) error {
	field, family := "nextHop", "IPv4"
	if vip.Is6() {
		field, family = "nextHopIPv6", "IPv6"
	}
	if node == "" {
		return fmt.Errorf("no node (--node-name) to take an %s address from for the next hop of %s tunnel IPs; set %s in the BGP configuration",
			family, family, field)
	}
	return fmt.Errorf("node %s has no %s InternalIP or ExternalIP for the next hop of %s tunnel IPs; set %s in the BGP configuration",
		node, family, family, field)
}

// PathPlan is what the speaker changes to go from what it announces to
// what is wanted.
type PathPlan struct {
	// Announce are the tunnel IPs to announce, new or with a next hop that
	// changed, with their next hop, sorted by tunnel IP.
	Announce []Announcement
	// Withdraw are the announced tunnel IPs that are no longer wanted or
	// whose family lost its next hop, sorted.
	Withdraw []netip.Addr
	// Unrouted are the wanted tunnel IPs left unannounced because their
	// family has no next hop, sorted.
	Unrouted []netip.Addr
}

// Announcement is one tunnel IP and the next hop it is announced with.
type Announcement struct {
	VIP, NextHop netip.Addr
}

// Plan compares the tunnel IPs wanted (desired) with those announced (each
// with the next hop it was announced with) and says what to announce and
// withdraw so that every wanted tunnel IP is announced with the next hop of
// its family. A tunnel IP whose family has no next hop is not announced.
func Plan(desired map[netip.Addr]bool, hops NextHops, announced map[netip.Addr]netip.Addr) PathPlan {
	var plan PathPlan
	for _, vip := range slices.SortedFunc(maps.Keys(desired), netip.Addr.Compare) {
		nh := hops.For(vip)
		switch {
		case !nh.IsValid():
			plan.Unrouted = append(plan.Unrouted, vip)
		case announced[vip] != nh:
			plan.Announce = append(plan.Announce, Announcement{VIP: vip, NextHop: nh})
		}
	}
	for _, vip := range slices.SortedFunc(maps.Keys(announced), netip.Addr.Compare) {
		if !desired[vip] || !hops.For(vip).IsValid() {
			plan.Withdraw = append(plan.Withdraw, vip)
		}
	}
	return plan
}

// path is the announcement of one tunnel IP: a host prefix with origin IGP
// and nextHop, of the tunnel IP's family, as the next hop (IPv4: the
// NEXT_HOP attribute; IPv6: MP_REACH_NLRI, RFC 4760).
func path(vip, nextHop netip.Addr) (*apiutil.Path, error) {
	if vip.Is4() != nextHop.Is4() {
		return nil, fmt.Errorf("next hop %v is not of the tunnel IP's family", nextHop)
	}
	nlri, err := bgp.NewIPAddrPrefix(netip.PrefixFrom(vip, vip.BitLen()))
	if err != nil {
		return nil, err
	}
	family := bgp.RF_IPv4_UC
	attrs := []bgp.PathAttributeInterface{bgp.NewPathAttributeOrigin(bgp.BGP_ORIGIN_ATTR_TYPE_IGP)}
	if vip.Is4() {
		nh, err := bgp.NewPathAttributeNextHop(nextHop)
		if err != nil {
			return nil, err
		}
		attrs = append(attrs, nh)
	} else {
		family = bgp.RF_IPv6_UC
		mp, err := bgp.NewPathAttributeMpReachNLRI(family, []bgp.PathNLRI{{NLRI: nlri}}, nextHop)
		if err != nil {
			return nil, err
		}
		attrs = append(attrs, mp)
	}
	return &apiutil.Path{Family: family, Nlri: nlri, Attrs: attrs}, nil
}
