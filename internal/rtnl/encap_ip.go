package rtnl

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Attributes of LWTUNNEL_ENCAP_IP (enum lwtunnel_ip_t in
// include/uapi/linux/lwtunnel.h). x/sys/unix does not define them.
// LWTUNNEL_ENCAP_IP6's (enum lwtunnel_ip6_t) have the same numbers: ID, DST
// and SRC (struct in6_addr), HOPLIMIT where the TTL is, TC where the TOS is,
// FLAGS, PAD, OPTS.
const (
	lwtunnelIPID    = 1 // __be64 tunnel id (key)
	lwtunnelIPDst   = 2 // __be32 (in_addr); IP6: struct in6_addr
	lwtunnelIPSrc   = 3 // __be32 (in_addr); IP6: struct in6_addr
	lwtunnelIPTTL   = 4 // u8; IP6: LWTUNNEL_IP6_HOPLIMIT
	lwtunnelIPTOS   = 5 // u8; IP6: LWTUNNEL_IP6_TC
	lwtunnelIPFlags = 6 // __be16 TUNNEL_* flags
	lwtunnelIPPad   = 7 // alignment padding for ID
	lwtunnelIPOpts  = 8 // nested geneve/vxlan/erspan options
)

// TunnelFlags are the TUNNEL_* flags of an IP tunnel key as the kernel puts
// them in LWTUNNEL_IP_FLAGS (sent big-endian on the wire).
type TunnelFlags uint16

// Tunnel flags understood by "ip route ... encap ip" (iproute2 keywords csum,
// key and seq). FlagKey makes GRE put ID in the header as its key.
const (
	FlagCsum TunnelFlags = 0x01
	FlagKey  TunnelFlags = 0x04
	FlagSeq  TunnelFlags = 0x08
)

// IPEncap is the lightweight-tunnel IP encapsulation: with IPv4 addresses
// LWTUNNEL_ENCAP_IP, iproute2's "encap ip id ID src SRC dst DST ttl TTL tos
// TOS"; with IPv6 addresses LWTUNNEL_ENCAP_IP6, "encap ip6 id ID src SRC
// dst DST hoplimit TTL tc TOS". It sends the route's packets to a
// flow-based ("external") tunnel device (gre, ip6gre, ...) with DST as the
// outer destination. The outer family is the addresses' family, which need
// not be the route's: an IPv4 route may have an IPv6 outer header.
//
// It implements netlink.Encap, so it also works with netlink.RouteAdd.
type IPEncap struct {
	// ID is the tunnel id (GRE key, VXLAN VNI); it is sent big-endian.
	ID uint64
	// Dst is the outer destination (the tunnel endpoint); required in
	// practice. Its family (with Src's, which must agree) chooses IP or IP6.
	Dst netip.Addr
	// Src is the outer source; the zero Addr lets the device choose.
	Src netip.Addr
	// TTL of the outer header (IPv6: the hop limit); 0 inherits the
	// device's setting.
	TTL uint8
	// TOS of the outer header (IPv6: the traffic class).
	TOS uint8
	// Flags are the TUNNEL_* flags (FlagKey, FlagCsum, FlagSeq).
	Flags TunnelFlags
	// Opts holds the raw LWTUNNEL_IP_OPTS attribute payload (geneve, vxlan
	// or erspan options); nil when there are none.
	Opts []byte

	// ip6 records that the kernel reported an IP6 encapsulation, whose
	// family the addresses alone may not tell (both ::, which decode as
	// unset).
	ip6 bool
}

var _ netlink.Encap = (*IPEncap)(nil)

// IPv6 reports whether e is an IP6 encapsulation (IPv6 outer header).
func (e *IPEncap) IPv6() bool { return e.ip6 || e.Dst.Is6() || e.Src.Is6() }

// Type returns LWTUNNEL_ENCAP_IP, or LWTUNNEL_ENCAP_IP6 for IPv6 addresses.
func (e *IPEncap) Type() int {
	if e.IPv6() {
		return unix.LWTUNNEL_ENCAP_IP6
	}
	return unix.LWTUNNEL_ENCAP_IP
}

// Encode returns the payload of RTA_ENCAP: the LWTUNNEL_IP_* (or
// LWTUNNEL_IP6_*) attributes. Zero Src, TTL, TOS and Flags are left out,
// as iproute2 does.
func (e *IPEncap) Encode() ([]byte, error) {
	return e.appendAttrs(make([]byte, 0, 96))
}

// appendAttrs appends the LWTUNNEL_IP_* (LWTUNNEL_IP6_*) attributes of e
// to b.
func (e *IPEncap) appendAttrs(b []byte) ([]byte, error) {
	if err := e.validate(); err != nil {
		return b, err
	}
	b = appendAttrBE64(b, lwtunnelIPID, e.ID)
	switch {
	case e.Dst.IsValid():
		b = appendAttrAddr(b, lwtunnelIPDst, e.Dst)
	case e.ip6 && !e.Src.IsValid():
		// Only a destination of 16 bytes keeps a listed IP6
		// encapsulation without addresses IP6 when sent back.
		b = appendAttrAddr(b, lwtunnelIPDst, netip.IPv6Unspecified())
	}
	if e.Src.IsValid() {
		b = appendAttrAddr(b, lwtunnelIPSrc, e.Src)
	}
	if e.TTL != 0 {
		b = appendAttrU8(b, lwtunnelIPTTL, e.TTL)
	}
	if e.TOS != 0 {
		b = appendAttrU8(b, lwtunnelIPTOS, e.TOS)
	}
	if e.Flags != 0 {
		b = appendAttrBE16(b, lwtunnelIPFlags, uint16(e.Flags))
	}
	if e.Opts != nil {
		b = appendAttrBytes(b, lwtunnelIPOpts, e.Opts)
	}
	return b, nil
}

func (e *IPEncap) validate() error {
	for _, a := range []struct {
		name string
		addr netip.Addr
	}{{"dst", e.Dst}, {"src", e.Src}} {
		switch {
		case a.addr.Is4In6():
			return fmt.Errorf("ip encap: %s %s is an IPv4-mapped IPv6 address: use the IPv4 address", a.name, a.addr)
		case a.addr.IsValid() && a.addr.Is6() != e.IPv6():
			return fmt.Errorf("ip encap: dst %s and src %s are of different families", e.Dst, e.Src)
		}
	}
	return nil
}

// appendAttrAddr appends an address attribute: 4 bytes for IPv4, 16 for
// IPv6.
func appendAttrAddr(b []byte, typ uint16, a netip.Addr) []byte {
	if a.Is4() {
		v := a.As4()
		return append(appendAttrHeader(b, typ, len(v)), v[:]...)
	}
	v := a.As16()
	return append(appendAttrHeader(b, typ, len(v)), v[:]...)
}

// Decode parses the payload of RTA_ENCAP (LWTUNNEL_IP_* or LWTUNNEL_IP6_*
// attributes, told apart by the length of the addresses) into e, replacing
// its previous contents. The kernel reports every field, including zero
// ones; an all-zero address decodes as the zero Addr. Unknown attributes
// are ignored. Malformed input gives an error, never a panic.
func (e *IPEncap) Decode(buf []byte) error {
	return e.decode(buf, 0)
}

// decode is Decode for the encapsulation type typ (LWTUNNEL_ENCAP_IP or
// LWTUNNEL_ENCAP_IP6; 0: either, by the addresses' length), whose
// addresses must then have its length.
func (e *IPEncap) decode(buf []byte, typ uint16) error {
	*e = IPEncap{ip6: typ == unix.LWTUNNEL_ENCAP_IP6}
	name := "ip encap"
	if e.ip6 {
		name = "ip6 encap"
	}
	addrLen := 0
	switch typ {
	case unix.LWTUNNEL_ENCAP_IP:
		addrLen = 4
	case unix.LWTUNNEL_ENCAP_IP6:
		addrLen = 16
	}
	s := newAttrScanner(buf)
	for s.next() {
		if err := e.decodeAttr(s.typ, s.val, addrLen); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	if s.err != nil {
		return fmt.Errorf("%s: %w", name, s.err)
	}
	if e.Dst.IsValid() && e.Src.IsValid() && e.Dst.Is6() != e.Src.Is6() {
		return fmt.Errorf("%s: %w: dst %s and src %s are of different families", name, errMalformed, e.Dst, e.Src)
	}
	return nil
}

// decodeAttr decodes one attribute; addresses must have addrLen bytes (4
// or 16; 0: either).
func (e *IPEncap) decodeAttr(typ uint16, v []byte, addrLen int) error {
	var err error
	switch typ {
	case lwtunnelIPID:
		if err = wantLen("LWTUNNEL_IP_ID", v, 8); err == nil {
			e.ID = binary.BigEndian.Uint64(v)
		}
	case lwtunnelIPDst:
		e.Dst, err = e.decodeAddr("LWTUNNEL_IP_DST", v, addrLen)
	case lwtunnelIPSrc:
		e.Src, err = e.decodeAddr("LWTUNNEL_IP_SRC", v, addrLen)
	case lwtunnelIPTTL:
		if err = wantLen("LWTUNNEL_IP_TTL", v, 1); err == nil {
			e.TTL = v[0]
		}
	case lwtunnelIPTOS:
		if err = wantLen("LWTUNNEL_IP_TOS", v, 1); err == nil {
			e.TOS = v[0]
		}
	case lwtunnelIPFlags:
		if err = wantLen("LWTUNNEL_IP_FLAGS", v, 2); err == nil {
			e.Flags = TunnelFlags(binary.BigEndian.Uint16(v))
		}
	case lwtunnelIPOpts:
		e.Opts = append([]byte{}, v...)
	}
	return err
}

func wantLen(name string, v []byte, n int) error {
	if len(v) != n {
		return attrLenError(name, len(v), n)
	}
	return nil
}

// decodeAddr decodes an address of addrLen bytes (0: 4 or 16); 0.0.0.0
// and :: become the zero Addr, and a 16-byte one marks e as IP6.
func (e *IPEncap) decodeAddr(name string, v []byte, addrLen int) (netip.Addr, error) {
	var a netip.Addr
	switch {
	case addrLen != 0 && len(v) != addrLen:
		return a, attrLenError(name, len(v), addrLen)
	case len(v) == 16:
		a, e.ip6 = netip.AddrFrom16([16]byte(v)), true
	case len(v) == 4:
		a = netip.AddrFrom4([4]byte(v))
	default:
		return a, attrLenError(name, len(v), 4)
	}
	return unspecifiedToZero(a), nil
}

// String formats e like iproute2's "encap ip" arguments.
func (e *IPEncap) String() string {
	if e == nil {
		return "<nil>"
	}
	kind, ttl, tos := "ip", "ttl", "tos"
	if e.IPv6() {
		kind, ttl, tos = "ip6", "hoplimit", "tc"
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%s id %d", kind, e.ID)
	if e.Src.IsValid() {
		fmt.Fprintf(&sb, " src %s", e.Src)
	}
	if e.Dst.IsValid() {
		fmt.Fprintf(&sb, " dst %s", e.Dst)
	}
	if e.TTL != 0 {
		fmt.Fprintf(&sb, " %s %d", ttl, e.TTL)
	}
	if e.TOS != 0 {
		fmt.Fprintf(&sb, " %s %#x", tos, e.TOS)
	}
	sb.WriteString(e.Flags.keywords())
	if e.Opts != nil {
		fmt.Fprintf(&sb, " opts %x", e.Opts)
	}
	return sb.String()
}

// keywords renders the flags as iproute2 keywords, each preceded by a space.
func (f TunnelFlags) keywords() string {
	var sb strings.Builder
	for _, k := range []struct {
		flag TunnelFlags
		name string
	}{{FlagKey, "key"}, {FlagCsum, "csum"}, {FlagSeq, "seq"}} {
		if f&k.flag != 0 {
			sb.WriteString(" " + k.name)
			f &^= k.flag
		}
	}
	if f != 0 {
		fmt.Fprintf(&sb, " flags %#x", uint16(f))
	}
	return sb.String()
}

// Equal reports whether x is an *IPEncap of the same family with the same
// fields. An unset address equals 0.0.0.0 and :: (the kernel reports the
// former as one of the latter).
func (e *IPEncap) Equal(x netlink.Encap) bool {
	o, ok := x.(*IPEncap)
	if !ok {
		return false
	}
	if e == nil || o == nil {
		return e == o
	}
	return e.IPv6() == o.IPv6() && e.ID == o.ID &&
		sameAddr(e.Dst, o.Dst) && sameAddr(e.Src, o.Src) &&
		e.TTL == o.TTL && e.TOS == o.TOS && e.Flags == o.Flags &&
		string(e.Opts) == string(o.Opts)
}

// sameAddr compares addresses treating the zero Addr as 0.0.0.0 and ::.
func sameAddr(a, b netip.Addr) bool {
	return unspecifiedToZero(a) == unspecifiedToZero(b)
}

func unspecifiedToZero(a netip.Addr) netip.Addr {
	if a.IsUnspecified() {
		return netip.Addr{}
	}
	return a
}
