package rtnl

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Route messages: struct nlmsghdr, struct rtmsg, then attributes.

const (
	nlmsgHeaderLen = unix.NLMSG_HDRLEN // 16
	rtmsgLen       = unix.SizeofRtMsg  // 12
	// rtaNHID is RTA_NH_ID (u32 nexthop object id), missing from x/sys/unix.
	rtaNHID = 30
)

// rtmsg mirrors struct rtmsg.
type rtmsg struct {
	family, dstLen, srcLen, tos uint8
	table, protocol, scope      uint8
	typ                         RouteType
	flags                       uint32
}

func (m *rtmsg) append(b []byte) []byte {
	b = append(b, m.family, m.dstLen, m.srcLen, m.tos, m.table, m.protocol, m.scope, uint8(m.typ))
	return binary.NativeEndian.AppendUint32(b, m.flags)
}

func parseRtmsg(b []byte) (rtmsg, error) {
	if len(b) < rtmsgLen {
		return rtmsg{}, fmt.Errorf("%w: route message of %d bytes", errMalformed, len(b))
	}
	return rtmsg{
		family: b[0], dstLen: b[1], srcLen: b[2], tos: b[3],
		table: b[4], protocol: b[5], scope: b[6], typ: RouteType(b[7]),
		flags: binary.NativeEndian.Uint32(b[8:]),
	}, nil
}

// appendNlmsghdr appends a header whose length appendEnd fills in later.
func appendNlmsghdr(b []byte, typ, flags uint16, seq uint32) []byte {
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = binary.NativeEndian.AppendUint16(b, flags)
	b = binary.NativeEndian.AppendUint32(b, seq)
	return binary.NativeEndian.AppendUint32(b, 0) // port id: the kernel
}

// finishMessage sets the length of the message that starts at off.
func finishMessage(b []byte, off int) []byte {
	binary.NativeEndian.PutUint32(b[off:], uint32(len(b)-off))
	return b
}

// legacyTable is the rtm_table value for a table id; ids above 255 travel in
// RTA_TABLE only, which is always sent.
func legacyTable(table uint32) uint8 {
	if table > 255 {
		return unix.RT_TABLE_UNSPEC
	}
	return uint8(table)
}

// familyOf is the address family of the routes to prefix p: AF_INET or
// AF_INET6.
func familyOf(p netip.Prefix) uint8 {
	if p.Addr().Is6() {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// scopeOf picks the scope iproute2 would: link for a unicast route without a
// gateway (a device or encap route), universe otherwise.
func scopeOf(r *Route) uint8 {
	if r.Type == Unicast && !r.Gateway.IsValid() && r.NextHopID == 0 {
		return unix.RT_SCOPE_LINK
	}
	return unix.RT_SCOPE_UNIVERSE
}

// appendNewRoute appends an RTM_NEWROUTE request that creates or replaces r.
// r must have passed validate.
func appendNewRoute(b []byte, r *Route, seq uint32) []byte {
	off := len(b)
	flags := uint16(unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE | unix.NLM_F_REPLACE)
	b = appendNlmsghdr(b, unix.RTM_NEWROUTE, flags, seq)
	hdr := rtmsg{
		family: familyOf(r.Dst), dstLen: uint8(r.Dst.Bits()), table: legacyTable(r.Table),
		protocol: r.Protocol, scope: scopeOf(r), typ: r.Type,
	}
	b = hdr.append(b)
	b = appendAttrU32(b, unix.RTA_TABLE, r.Table)
	b = appendAttrAddr(b, unix.RTA_DST, r.Dst.Addr())
	if r.NextHopID != 0 {
		b = appendAttrU32(b, rtaNHID, r.NextHopID)
	}
	if r.LinkIndex != 0 {
		b = appendAttrU32(b, unix.RTA_OIF, uint32(r.LinkIndex))
	}
	b = appendGateway(b, r.Dst, r.Gateway)
	b = appendEncap(b, r)
	return finishMessage(b, off)
}

// appendDelRoute appends an RTM_DELROUTE request for the route at r.Key().
// Only the protocol narrows the match (when non-zero): whatever next hop or
// type the route has, it is removed.
func appendDelRoute(b []byte, r *Route, seq uint32) []byte {
	off := len(b)
	b = appendNlmsghdr(b, unix.RTM_DELROUTE, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq)
	hdr := rtmsg{
		family: familyOf(r.Dst), dstLen: uint8(r.Dst.Bits()), table: legacyTable(r.Table),
		protocol: r.Protocol, scope: unix.RT_SCOPE_NOWHERE,
	}
	b = hdr.append(b)
	b = appendAttrU32(b, unix.RTA_TABLE, r.Table)
	b = appendAttrAddr(b, unix.RTA_DST, r.Dst.Addr())
	return finishMessage(b, off)
}

// appendGateway adds the next hop of a route to dst: RTA_GATEWAY for a next
// hop of dst's family, RTA_VIA for an IPv6 next hop of an IPv4 route (an
// IPv6 route takes no IPv4 next hop; validate refuses it).
func appendGateway(b []byte, dst netip.Prefix, gw netip.Addr) []byte {
	switch {
	case !gw.IsValid():
		return b
	case gw.Is6() == dst.Addr().Is6():
		return appendAttrAddr(b, unix.RTA_GATEWAY, gw)
	}
	a := gw.As16()
	b = appendAttrHeader(b, unix.RTA_VIA, 2+len(a))
	b = binary.NativeEndian.AppendUint16(b, unix.AF_INET6)
	return padTo4(append(b, a[:]...))
}

// appendEncap adds RTA_ENCAP_TYPE and RTA_ENCAP when r has an encapsulation.
func appendEncap(b []byte, r *Route) []byte {
	return appendLWTEncap(b, unix.RTA_ENCAP_TYPE, unix.RTA_ENCAP, r.IPEncap, r.MPLSLabels)
}

// appendLWTEncap adds a lightweight-tunnel encapsulation, IP or MPLS, as the
// pair of attributes typeAttr (the LWTUNNEL_ENCAP_* type) and encapAttr (the
// nested encap), which routes and nexthops number differently.
func appendLWTEncap(b []byte, typeAttr, encapAttr uint16, ip *IPEncap, labels []uint32) []byte {
	var off int
	switch {
	case ip != nil:
		b = appendAttrU16(b, typeAttr, uint16(ip.Type()))
		b, off = beginNested(b, encapAttr|unix.NLA_F_NESTED)
		b, _ = ip.appendAttrs(b) // validated before
	case labels != nil:
		b = appendAttrU16(b, typeAttr, unix.LWTUNNEL_ENCAP_MPLS)
		b, off = beginNested(b, encapAttr|unix.NLA_F_NESTED)
		b = appendMPLSEncap(b, labels)
	default:
		return b
	}
	return endNested(b, off)
}

// routeAttrs holds the attributes of one route message, pointing into the
// receive buffer, so that filtering costs no allocation.
type routeAttrs struct {
	hdr       rtmsg
	table     uint32
	dst       []byte
	oif       []byte
	gateway   []byte
	via       []byte
	encapType []byte
	encap     []byte
	nhID      []byte
	multipath bool
}

// scanRoute splits an RTM_NEWROUTE payload (after struct nlmsghdr).
func scanRoute(b []byte) (routeAttrs, error) {
	var a routeAttrs
	var err error
	if a.hdr, err = parseRtmsg(b); err != nil {
		return a, err
	}
	a.table = uint32(a.hdr.table)
	s := newAttrScanner(b[rtmsgLen:])
	for s.next() {
		if err := a.set(s.typ, s.val); err != nil {
			return a, err
		}
	}
	return a, s.err
}

func (a *routeAttrs) set(typ uint16, v []byte) error {
	switch typ {
	case unix.RTA_TABLE:
		if err := wantLen("RTA_TABLE", v, 4); err != nil {
			return err
		}
		a.table = binary.NativeEndian.Uint32(v)
	case unix.RTA_DST:
		a.dst = v
	case unix.RTA_OIF:
		a.oif = v
	case unix.RTA_GATEWAY:
		a.gateway = v
	case unix.RTA_VIA:
		a.via = v
	case unix.RTA_ENCAP_TYPE:
		a.encapType = v
	case unix.RTA_ENCAP:
		a.encap = v
	case unix.RTA_MULTIPATH:
		a.multipath = true
	case rtaNHID:
		a.nhID = v
	}
	return nil
}

// route builds the Route described by a (an AF_INET or AF_INET6 route
// message).
func (a *routeAttrs) route() (Route, error) {
	r := Route{Table: a.table, Type: a.hdr.typ, Protocol: a.hdr.protocol}
	var err error
	if r.Dst, err = a.dstPrefix(); err != nil {
		return r, err
	}
	if a.nhID != nil {
		// The next hop attributes that follow describe the nexthop object.
		if err := wantLen("RTA_NH_ID", a.nhID, 4); err != nil {
			return r, err
		}
		r.NextHopID = binary.NativeEndian.Uint32(a.nhID)
		return r, nil
	}
	r.multipath = a.multipath
	if a.oif != nil {
		if err := wantLen("RTA_OIF", a.oif, 4); err != nil {
			return r, err
		}
		r.LinkIndex = int(binary.NativeEndian.Uint32(a.oif))
	}
	if a.hdr.family == unix.AF_INET6 && r.Type.reject() {
		// The kernel puts every IPv6 reject route (blackhole, unreachable,
		// prohibit, throw) on the loopback device, whatever the request
		// said, and reports it; it is no next hop of the route's.
		r.LinkIndex = 0
	}
	if r.Gateway, err = a.nextHop(); err != nil {
		return r, err
	}
	return r, a.decodeEncap(&r)
}

// addrLen is the length of an address of the message's family.
func (a *routeAttrs) addrLen() int {
	if a.hdr.family == unix.AF_INET6 {
		return 16
	}
	return 4
}

// addr decodes an address of the message's family.
func (a *routeAttrs) addr(name string, v []byte) (netip.Addr, error) {
	if err := wantLen(name, v, a.addrLen()); err != nil {
		return netip.Addr{}, err
	}
	if len(v) == 16 {
		return netip.AddrFrom16([16]byte(v)), nil
	}
	return netip.AddrFrom4([4]byte(v)), nil
}

func (a *routeAttrs) dstPrefix() (netip.Prefix, error) {
	addr := netip.IPv4Unspecified()
	if a.hdr.family == unix.AF_INET6 {
		addr = netip.IPv6Unspecified()
	}
	if a.dst != nil {
		var err error
		if addr, err = a.addr("RTA_DST", a.dst); err != nil {
			return netip.Prefix{}, err
		}
	}
	p := netip.PrefixFrom(addr, int(a.hdr.dstLen))
	if !p.IsValid() {
		return p, fmt.Errorf("%w: prefix length %d of %s", errMalformed, a.hdr.dstLen, addr)
	}
	return p, nil
}

// nextHop decodes RTA_GATEWAY or, failing that, RTA_VIA.
func (a *routeAttrs) nextHop() (netip.Addr, error) {
	if a.gateway != nil {
		return a.addr("RTA_GATEWAY", a.gateway)
	}
	if a.via == nil {
		return netip.Addr{}, nil
	}
	if len(a.via) < 2 {
		return netip.Addr{}, attrLenError("RTA_VIA", len(a.via), 2)
	}
	switch addr := a.via[2:]; binary.NativeEndian.Uint16(a.via) {
	case unix.AF_INET:
		if err := wantLen("RTA_VIA address", addr, 4); err != nil {
			return netip.Addr{}, err
		}
		return netip.AddrFrom4([4]byte(addr)), nil
	case unix.AF_INET6:
		if err := wantLen("RTA_VIA address", addr, 16); err != nil {
			return netip.Addr{}, err
		}
		return netip.AddrFrom16([16]byte(addr)), nil
	}
	return netip.Addr{}, nil // e.g. AF_MPLS: not a next hop this package models
}

func (a *routeAttrs) decodeEncap(r *Route) error {
	if a.encapType == nil {
		return nil
	}
	if err := wantLen("RTA_ENCAP_TYPE", a.encapType, 2); err != nil {
		return err
	}
	switch typ := binary.NativeEndian.Uint16(a.encapType); typ {
	case unix.LWTUNNEL_ENCAP_IP, unix.LWTUNNEL_ENCAP_IP6:
		r.IPEncap = new(IPEncap)
		return r.IPEncap.decode(a.encap, typ)
	case unix.LWTUNNEL_ENCAP_MPLS:
		var err error
		r.MPLSLabels, err = decodeMPLSEncap(a.encap)
		return err
	case unix.LWTUNNEL_ENCAP_NONE:
		return nil
	default:
		r.otherEncap = typ
		return nil
	}
}

// decodeRoute decodes an RTM_NEWROUTE payload (after struct nlmsghdr).
func decodeRoute(b []byte) (Route, error) {
	a, err := scanRoute(b)
	if err != nil {
		return Route{}, err
	}
	if a.hdr.family != unix.AF_INET && a.hdr.family != unix.AF_INET6 {
		return Route{}, fmt.Errorf("%w: address family %d is neither IPv4 nor IPv6", errMalformed, a.hdr.family)
	}
	return a.route()
}
