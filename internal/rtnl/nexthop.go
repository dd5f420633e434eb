package rtnl

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// NextHop is a nexthop object ("ip nexthop"): one next hop that any number
// of routes share through Route.NextHopID. Replacing it moves all of them at
// once. It also keeps route programming fast with many distinct
// encapsulations: the kernel compares a route's own (inline) next hop with
// every distinct next hop on the same device before inserting it, while a
// route that names a nexthop object skips that.
type NextHop struct {
	// ID identifies the nexthop; required, not zero.
	ID uint32
	// Protocol marks the owner, like Route.Protocol.
	Protocol uint8
	// IPv6 makes it an AF_INET6 nexthop, the only kind IPv6 routes may
	// name (the kernel refuses IPv4 nexthops for them); an IPv4 one
	// (AF_INET) otherwise. Its Gateway, if any, is of that family; its
	// IPEncap may be of either.
	IPv6 bool
	// Blackhole makes the nexthop drop packets; nothing below may be set.
	Blackhole bool
	// LinkIndex is the output interface; required unless Blackhole.
	LinkIndex int
	// Gateway is a next hop router of the nexthop's family, e.g. the node
	// in MPLS mode.
	Gateway netip.Addr
	// IPEncap is an LWTUNNEL_ENCAP_IP or LWTUNNEL_ENCAP_IP6 encapsulation
	// (GRE mode).
	IPEncap *IPEncap
	// MPLSLabels is an MPLS label stack to push (MPLS mode).
	MPLSLabels []uint32

	group bool // a nexthop group, which this package does not model
}

// Equal reports whether n and o are the same nexthop.
func (n *NextHop) Equal(o *NextHop) bool {
	return n.ID == o.ID && n.Protocol == o.Protocol && n.IPv6 == o.IPv6 && n.Blackhole == o.Blackhole &&
		n.LinkIndex == o.LinkIndex && n.Gateway == o.Gateway &&
		n.IPEncap.Equal(o.IPEncap) && slices.Equal(n.MPLSLabels, o.MPLSLabels) &&
		n.group == o.group
}

// String formats n roughly like "ip nexthop show".
func (n *NextHop) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "id %d", n.ID)
	if n.IPv6 {
		sb.WriteString(" inet6")
	}
	if n.IPEncap != nil {
		sb.WriteString(" encap " + n.IPEncap.String())
	}
	if n.MPLSLabels != nil {
		sb.WriteString(" encap mpls " + formatLabels(n.MPLSLabels))
	}
	if n.Gateway.IsValid() {
		sb.WriteString(" via " + n.Gateway.String())
	}
	if n.LinkIndex != 0 {
		fmt.Fprintf(&sb, " oif %d", n.LinkIndex)
	}
	if n.Blackhole {
		sb.WriteString(" blackhole")
	}
	if n.group {
		sb.WriteString(" group")
	}
	fmt.Fprintf(&sb, " proto %d", n.Protocol)
	return sb.String()
}

func (n *NextHop) validate() error {
	hasNextHop := n.LinkIndex != 0 || n.Gateway.IsValid() || n.IPEncap != nil || n.MPLSLabels != nil
	switch {
	case n.ID == 0:
		return fmt.Errorf("%w: nexthop id 0", ErrInvalidRoute)
	case n.group:
		return fmt.Errorf("%w: nexthop groups are not supported", ErrInvalidRoute)
	case n.Blackhole && hasNextHop:
		return fmt.Errorf("%w: blackhole nexthop with a next hop", ErrInvalidRoute)
	case !n.Blackhole && n.LinkIndex == 0:
		return fmt.Errorf("%w: nexthop without an output interface", ErrInvalidRoute)
	case n.Gateway.IsValid() && (n.Gateway.Is6() != n.IPv6 || n.Gateway.Is4In6()):
		return fmt.Errorf("%w: nexthop gateway %s is not of the nexthop's family (%s)", ErrInvalidRoute, n.Gateway, n.family())
	case n.IPEncap != nil && n.MPLSLabels != nil:
		return fmt.Errorf("%w: both IP and MPLS encapsulation", ErrInvalidRoute)
	}
	if n.IPEncap != nil {
		if err := n.IPEncap.validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
		}
	}
	return validateLabels(n.MPLSLabels)
}

// family names the nexthop's address family.
func (n *NextHop) family() string {
	if n.IPv6 {
		return "IPv6"
	}
	return "IPv4"
}

// nhFamily is the nhm_family of n.
func (n *NextHop) nhFamily() uint8 {
	if n.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// nhmsgLen is the size of struct nhmsg.
const nhmsgLen = 8

// appendNhmsg appends struct nhmsg.
func appendNhmsg(b []byte, family, protocol uint8) []byte {
	b = append(b, family, 0, protocol, 0) // family, scope, protocol, reserved
	return binary.NativeEndian.AppendUint32(b, 0)
}

// appendNewNextHop appends an RTM_NEWNEXTHOP request that creates n and,
// with mode NLM_F_REPLACE, replaces the nexthop with its ID, or, with
// NLM_F_EXCL, fails if that ID is taken. n must have passed validate.
func appendNewNextHop(b []byte, n *NextHop, mode uint16, seq uint32) []byte {
	off := len(b)
	flags := unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE | mode
	b = appendNlmsghdr(b, unix.RTM_NEWNEXTHOP, flags, seq)
	b = appendNhmsg(b, n.nhFamily(), n.Protocol)
	b = appendAttrU32(b, unix.NHA_ID, n.ID)
	if n.Blackhole {
		b = appendAttrHeader(b, unix.NHA_BLACKHOLE, 0)
	}
	if n.LinkIndex != 0 {
		b = appendAttrU32(b, unix.NHA_OIF, uint32(n.LinkIndex))
	}
	if n.Gateway.IsValid() {
		b = appendAttrAddr(b, unix.NHA_GATEWAY, n.Gateway)
	}
	b = appendNextHopEncap(b, n)
	return finishMessage(b, off)
}

func appendNextHopEncap(b []byte, n *NextHop) []byte {
	return appendLWTEncap(b, unix.NHA_ENCAP_TYPE, unix.NHA_ENCAP, n.IPEncap, n.MPLSLabels)
}

// appendDelNextHop appends an RTM_DELNEXTHOP request for nexthop id. The
// kernel also deletes the routes that use it.
func appendDelNextHop(b []byte, id uint32, seq uint32) []byte {
	off := len(b)
	b = appendNlmsghdr(b, unix.RTM_DELNEXTHOP, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq)
	b = appendNhmsg(b, unix.AF_UNSPEC, 0)
	b = appendAttrU32(b, unix.NHA_ID, id)
	return finishMessage(b, off)
}

// decodeNextHop decodes an RTM_NEWNEXTHOP payload (after struct nlmsghdr).
func decodeNextHop(b []byte) (NextHop, error) {
	if len(b) < nhmsgLen {
		return NextHop{}, fmt.Errorf("%w: nexthop message of %d bytes", errMalformed, len(b))
	}
	n := NextHop{IPv6: b[0] == unix.AF_INET6, Protocol: b[2]}
	var encapType, encap []byte
	s := newAttrScanner(b[nhmsgLen:])
	for s.next() {
		var err error
		switch s.typ {
		case unix.NHA_ID:
			err = decodeU32("NHA_ID", s.val, &n.ID)
		case unix.NHA_BLACKHOLE:
			n.Blackhole = true
		case unix.NHA_GROUP:
			n.group = true
		case unix.NHA_OIF:
			var oif uint32
			err = decodeU32("NHA_OIF", s.val, &oif)
			n.LinkIndex = int(oif)
		case unix.NHA_GATEWAY:
			n.Gateway, err = decodeAddr("NHA_GATEWAY", s.val)
		case unix.NHA_ENCAP_TYPE:
			encapType = s.val
		case unix.NHA_ENCAP:
			encap = s.val
		}
		if err != nil {
			return n, err
		}
	}
	if s.err != nil {
		return n, s.err
	}
	return n, decodeNextHopEncap(&n, encapType, encap)
}

func decodeNextHopEncap(n *NextHop, encapType, encap []byte) error {
	if encapType == nil {
		return nil
	}
	if err := wantLen("NHA_ENCAP_TYPE", encapType, 2); err != nil {
		return err
	}
	switch typ := binary.NativeEndian.Uint16(encapType); typ {
	case unix.LWTUNNEL_ENCAP_IP, unix.LWTUNNEL_ENCAP_IP6:
		n.IPEncap = new(IPEncap)
		return n.IPEncap.decode(encap, typ)
	case unix.LWTUNNEL_ENCAP_MPLS:
		var err error
		n.MPLSLabels, err = decodeMPLSEncap(encap)
		return err
	}
	return nil
}

func decodeU32(name string, v []byte, dst *uint32) error {
	if err := wantLen(name, v, 4); err != nil {
		return err
	}
	*dst = binary.NativeEndian.Uint32(v)
	return nil
}

// decodeAddr decodes a 4- or 16-byte address.
func decodeAddr(name string, v []byte) (netip.Addr, error) {
	switch len(v) {
	case 4:
		return netip.AddrFrom4([4]byte(v)), nil
	case 16:
		return netip.AddrFrom16([16]byte(v)), nil
	}
	return netip.Addr{}, attrLenError(name, len(v), 4)
}

// ListNextHops returns the nexthop objects of both families with the given
// protocol (all of them if protocol is 0). Nexthop groups are listed but
// cannot be applied.
func (c *Client) ListNextHops(protocol uint8) ([]NextHop, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var nexthops []NextHop
	err := c.dumpConsistent(
		appendNextHopDumpRequest,
		func() { nexthops = nexthops[:0] },
		func(typ uint16, payload []byte) error {
			if typ != unix.RTM_NEWNEXTHOP {
				return nil
			}
			n, err := decodeNextHop(payload)
			if err != nil {
				return fmt.Errorf("decode nexthop: %w", err)
			}
			if protocol == 0 || n.Protocol == protocol {
				nexthops = append(nexthops, n)
			}
			return nil
		})
	if err != nil {
		return nil, fmt.Errorf("list nexthops: %w", err)
	}
	return nexthops, nil
}

func appendNextHopDumpRequest(b []byte, seq uint32) []byte {
	b = appendNlmsghdr(b, unix.RTM_GETNEXTHOP, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq)
	b = appendNhmsg(b, unix.AF_UNSPEC, 0)
	return finishMessage(b, 0)
}
