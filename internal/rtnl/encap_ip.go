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
const (
	lwtunnelIPID    = 1 // __be64 tunnel id (key)
	lwtunnelIPDst   = 2 // __be32 (in_addr)
	lwtunnelIPSrc   = 3 // __be32 (in_addr)
	lwtunnelIPTTL   = 4 // u8
	lwtunnelIPTOS   = 5 // u8
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

// IPEncap is the IPv4 lightweight-tunnel encapsulation (LWTUNNEL_ENCAP_IP),
// iproute2's "encap ip id ID src SRC dst DST ttl TTL tos TOS". It sends the
// route's packets to a flow-based ("external") tunnel device with DST as the
// outer destination.
//
// It implements netlink.Encap, so it also works with netlink.RouteAdd.
type IPEncap struct {
	// ID is the tunnel id (GRE key, VXLAN VNI); it is sent big-endian.
	ID uint64
	// Dst is the outer destination (the tunnel endpoint); required in practice.
	Dst netip.Addr
	// Src is the outer source; the zero Addr lets the device choose.
	Src netip.Addr
	// TTL of the outer header; 0 inherits the device's setting.
	TTL uint8
	// TOS of the outer header.
	TOS uint8
	// Flags are the TUNNEL_* flags (FlagKey, FlagCsum, FlagSeq).
	Flags TunnelFlags
	// Opts holds the raw LWTUNNEL_IP_OPTS attribute payload (geneve, vxlan
	// or erspan options); nil when there are none.
	Opts []byte
}

var _ netlink.Encap = (*IPEncap)(nil)

// Type returns LWTUNNEL_ENCAP_IP.
func (e *IPEncap) Type() int { return unix.LWTUNNEL_ENCAP_IP }

// Encode returns the payload of RTA_ENCAP: the LWTUNNEL_IP_* attributes.
// Zero Src, TTL, TOS and Flags are left out, as iproute2 does.
func (e *IPEncap) Encode() ([]byte, error) {
	return e.appendAttrs(make([]byte, 0, 64))
}

// appendAttrs appends the LWTUNNEL_IP_* attributes of e to b.
func (e *IPEncap) appendAttrs(b []byte) ([]byte, error) {
	if err := e.validate(); err != nil {
		return b, err
	}
	b = appendAttrBE64(b, lwtunnelIPID, e.ID)
	if e.Dst.IsValid() {
		b = appendAttrBytes4(b, lwtunnelIPDst, e.Dst.As4())
	}
	if e.Src.IsValid() {
		b = appendAttrBytes4(b, lwtunnelIPSrc, e.Src.As4())
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
	if e.Dst.IsValid() && !e.Dst.Is4() {
		return fmt.Errorf("ip encap: dst %s is not IPv4", e.Dst)
	}
	if e.Src.IsValid() && !e.Src.Is4() {
		return fmt.Errorf("ip encap: src %s is not IPv4", e.Src)
	}
	return nil
}

func appendAttrBytes4(b []byte, typ uint16, a [4]byte) []byte {
	b = appendAttrHeader(b, typ, 4)
	return append(b, a[:]...)
}

// Decode parses the payload of RTA_ENCAP (LWTUNNEL_IP_* attributes) into e,
// replacing its previous contents. The kernel reports every field, including
// zero ones; an all-zero address decodes as the zero Addr. Unknown attributes
// are ignored. Malformed input gives an error, never a panic.
func (e *IPEncap) Decode(buf []byte) error {
	*e = IPEncap{}
	s := newAttrScanner(buf)
	for s.next() {
		if err := e.decodeAttr(s.typ, s.val); err != nil {
			return fmt.Errorf("ip encap: %w", err)
		}
	}
	if s.err != nil {
		return fmt.Errorf("ip encap: %w", s.err)
	}
	return nil
}

func (e *IPEncap) decodeAttr(typ uint16, v []byte) error {
	var err error
	switch typ {
	case lwtunnelIPID:
		if err = wantLen("LWTUNNEL_IP_ID", v, 8); err == nil {
			e.ID = binary.BigEndian.Uint64(v)
		}
	case lwtunnelIPDst:
		e.Dst, err = decodeIPv4("LWTUNNEL_IP_DST", v)
	case lwtunnelIPSrc:
		e.Src, err = decodeIPv4("LWTUNNEL_IP_SRC", v)
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

// decodeIPv4 decodes a 4-byte address; 0.0.0.0 becomes the zero Addr.
func decodeIPv4(name string, v []byte) (netip.Addr, error) {
	if err := wantLen(name, v, 4); err != nil {
		return netip.Addr{}, err
	}
	a := netip.AddrFrom4([4]byte(v))
	if a.IsUnspecified() {
		return netip.Addr{}, nil
	}
	return a, nil
}

// String formats e like iproute2's "encap ip" arguments.
func (e *IPEncap) String() string {
	if e == nil {
		return "<nil>"
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "ip id %d", e.ID)
	if e.Src.IsValid() {
		fmt.Fprintf(&sb, " src %s", e.Src)
	}
	if e.Dst.IsValid() {
		fmt.Fprintf(&sb, " dst %s", e.Dst)
	}
	if e.TTL != 0 {
		fmt.Fprintf(&sb, " ttl %d", e.TTL)
	}
	if e.TOS != 0 {
		fmt.Fprintf(&sb, " tos %#x", e.TOS)
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

// Equal reports whether x is an *IPEncap with the same fields. An unset
// address and 0.0.0.0 are equal (the kernel reports the former as the latter).
func (e *IPEncap) Equal(x netlink.Encap) bool {
	o, ok := x.(*IPEncap)
	if !ok {
		return false
	}
	if e == nil || o == nil {
		return e == o
	}
	return e.ID == o.ID &&
		sameIPv4(e.Dst, o.Dst) && sameIPv4(e.Src, o.Src) &&
		e.TTL == o.TTL && e.TOS == o.TOS && e.Flags == o.Flags &&
		string(e.Opts) == string(o.Opts)
}

// sameIPv4 compares addresses treating the zero Addr as 0.0.0.0.
func sameIPv4(a, b netip.Addr) bool {
	return unspecifiedToZero(a) == unspecifiedToZero(b)
}

func unspecifiedToZero(a netip.Addr) netip.Addr {
	if a.IsUnspecified() {
		return netip.Addr{}
	}
	return a
}
