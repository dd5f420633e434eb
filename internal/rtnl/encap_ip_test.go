package rtnl

import (
	"bytes"
	"errors"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// kernelIPEncap is the RTA_ENCAP payload the kernel (6.18) dumped for
//
//	ip route add 10.96.0.11/32 encap ip id 42 src 192.0.2.1 dst 192.0.2.8 \
//	    ttl 32 tos 16 key csum dev veth0 table 7601 proto 200
//
// (iproute2 reads "tos 16" as hex). The kernel always reports every field,
// in the order ID, DST, SRC, TOS, TTL, FLAGS.
var kernelIPEncap = []byte{
	0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2a, // ID be64 42
	0x08, 0x00, 0x02, 0x00, 0xc0, 0x00, 0x02, 0x08, // DST 192.0.2.8
	0x08, 0x00, 0x03, 0x00, 0xc0, 0x00, 0x02, 0x01, // SRC 192.0.2.1
	0x05, 0x00, 0x05, 0x00, 0x16, 0x00, 0x00, 0x00, // TOS 0x16
	0x05, 0x00, 0x04, 0x00, 0x20, 0x00, 0x00, 0x00, // TTL 32
	0x06, 0x00, 0x06, 0x00, 0x00, 0x05, 0x00, 0x00, // FLAGS be16 key|csum
}

// kernelIP6Encap is the RTA_ENCAP payload the kernel (6.18) dumped for
//
//	ip -6 route add 2001:db8::10/128 encap ip6 id 42 src fd00::1 \
//	    dst fd00:244::8 hoplimit 32 tc 16 key csum dev veth0 table 7601 proto 200
//
// LWTUNNEL_ENCAP_IP6 numbers its attributes as LWTUNNEL_ENCAP_IP does,
// with 16-byte addresses, HOPLIMIT for TTL and TC for TOS.
var kernelIP6Encap = []byte{
	0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2a, // ID be64 42
	0x14, 0x00, 0x02, 0x00, 0xfd, 0x00, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x08, // DST fd00:244::8
	0x14, 0x00, 0x03, 0x00, 0xfd, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, // SRC fd00::1
	0x05, 0x00, 0x05, 0x00, 0x16, 0x00, 0x00, 0x00, // TC 0x16
	0x05, 0x00, 0x04, 0x00, 0x20, 0x00, 0x00, 0x00, // HOPLIMIT 32
	0x06, 0x00, 0x06, 0x00, 0x00, 0x05, 0x00, 0x00, // FLAGS be16 key|csum
}

func TestIPEncapDecodeKernelBytes(t *testing.T) {
	var got IPEncap
	if err := got.Decode(kernelIPEncap); err != nil {
		t.Fatalf("Decode: %v", err)
	}
	want := IPEncap{
		ID: 42, Dst: netip.MustParseAddr("192.0.2.8"), Src: netip.MustParseAddr("192.0.2.1"),
		TTL: 32, TOS: 0x16, Flags: FlagKey | FlagCsum,
	}
	if !got.Equal(&want) || got.Opts != nil || got.Src != want.Src {
		t.Errorf("Decode = %+v, want %+v", got, want)
	}
	if s := got.String(); s != "ip id 42 src 192.0.2.1 dst 192.0.2.8 ttl 32 tos 0x16 key csum" {
		t.Errorf("String = %q", s)
	}
}

func TestIP6EncapDecodeKernelBytes(t *testing.T) {
	want := IPEncap{
		ID: 42, Dst: netip.MustParseAddr("fd00:244::8"), Src: netip.MustParseAddr("fd00::1"),
		TTL: 32, TOS: 0x16, Flags: FlagKey | FlagCsum,
	}
	// As the netlink.Encap interface decodes it (the address length tells
	// the family), and as a route's LWTUNNEL_ENCAP_IP6 does.
	var got, typed IPEncap
	if err := got.Decode(kernelIP6Encap); err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if err := typed.decode(kernelIP6Encap, unix.LWTUNNEL_ENCAP_IP6); err != nil {
		t.Fatalf("decode as IP6: %v", err)
	}
	for _, e := range []*IPEncap{&got, &typed} {
		if !e.Equal(&want) || !e.IPv6() || e.Type() != unix.LWTUNNEL_ENCAP_IP6 {
			t.Errorf("decoded %v (IPv6 %v, type %d), want %v", e, e.IPv6(), e.Type(), &want)
		}
	}
	if s := got.String(); s != "ip6 id 42 src fd00::1 dst fd00:244::8 hoplimit 32 tc 0x16 key csum" {
		t.Errorf("String = %q", s)
	}
	// Re-encoded, the kernel's attributes come back (in the order of
	// Encode, which puts the hop limit before the traffic class).
	b, err := want.Encode()
	if err != nil {
		t.Fatal(err)
	}
	var again IPEncap
	if err := again.decode(b, unix.LWTUNNEL_ENCAP_IP6); err != nil || !again.Equal(&want) || len(b) != len(kernelIP6Encap) {
		t.Errorf("Encode = %x (%v), want the kernel's %d bytes", b, err, len(kernelIP6Encap))
	}
}

func TestIPEncapEncodeBytes(t *testing.T) {
	e := IPEncap{ID: 0x0102030405060708, Dst: netip.MustParseAddr("10.244.1.2"), TTL: 64}
	got, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{
		0x0c, 0x00, 0x01, 0x00, 1, 2, 3, 4, 5, 6, 7, 8, // ID, big-endian
		0x08, 0x00, 0x02, 0x00, 10, 244, 1, 2, // DST
		0x05, 0x00, 0x04, 0x00, 64, 0, 0, 0, // TTL, padded
	}
	if !bytes.Equal(got, want) {
		t.Errorf("Encode =\n%x, want\n%x", got, want)
	}
	e6 := IPEncap{Dst: netip.MustParseAddr("fd00::a"), TTL: 64}
	got, err = e6.Encode()
	if err != nil {
		t.Fatal(err)
	}
	want = []byte{
		0x0c, 0x00, 0x01, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, // ID
		0x14, 0x00, 0x02, 0x00, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a, // DST, 16 bytes
		0x05, 0x00, 0x04, 0x00, 64, 0, 0, 0, // HOPLIMIT
	}
	if !bytes.Equal(got, want) || e6.Type() != unix.LWTUNNEL_ENCAP_IP6 {
		t.Errorf("IPv6 Encode =\n%x (type %d), want\n%x (LWTUNNEL_ENCAP_IP6)", got, e6.Type(), want)
	}
}

func TestIPEncapRoundTrip(t *testing.T) {
	for _, e := range []IPEncap{
		{},
		{Dst: netip.MustParseAddr("10.244.0.7"), TTL: 64},
		{
			ID: 1<<64 - 1, Dst: netip.MustParseAddr("10.244.0.7"), Src: netip.MustParseAddr("10.0.0.1"),
			TTL: 255, TOS: 0xfc, Flags: FlagKey | FlagSeq | 0x8000,
			Opts: []byte{0x08, 0x00, 0x02, 0x00, 0x04, 0x00, 0x01, 0x00}, // vxlan gbp, nested
		},
		{Dst: netip.MustParseAddr("fd00:244::7"), TTL: 64},
		{
			ID: 7, Dst: netip.MustParseAddr("fd00:244::7"), Src: netip.MustParseAddr("fd00::1"),
			TTL: 1, TOS: 0xb8, Flags: FlagCsum,
		},
	} {
		b, err := e.Encode()
		if err != nil {
			t.Fatalf("Encode(%v): %v", &e, err)
		}
		var got IPEncap
		if err := got.Decode(b); err != nil {
			t.Fatalf("Decode(Encode(%v)): %v", &e, err)
		}
		if !got.Equal(&e) {
			t.Errorf("round trip of %v gave %v", &e, &got)
		}
	}
}

func TestIPEncapEncodeRejectsMixedFamilies(t *testing.T) {
	for _, e := range []IPEncap{
		{Dst: netip.MustParseAddr("2001:db8::1"), Src: netip.MustParseAddr("10.0.0.1")},
		{Dst: netip.MustParseAddr("10.0.0.1"), Src: netip.MustParseAddr("::ffff:10.0.0.2")},
		{Dst: netip.MustParseAddr("::ffff:10.0.0.1")},
	} {
		if _, err := e.Encode(); err == nil {
			t.Errorf("Encode(%v) succeeded, want an error", &e)
		}
	}
}

func TestIPEncapDecodeResets(t *testing.T) {
	e := IPEncap{ID: 9, TTL: 9, Opts: []byte{1}}
	if err := e.Decode(nil); err != nil {
		t.Fatal(err)
	}
	if !e.Equal(&IPEncap{}) {
		t.Errorf("Decode(nil) left %v", &e)
	}
}

func TestIPEncapDecodeMalformed(t *testing.T) {
	for name, b := range map[string][]byte{
		"short header":     {0x08, 0x00},
		"length below 4":   {0x02, 0x00, 0x02, 0x00},
		"length past end":  {0x08, 0x00, 0x02, 0x00, 10, 0},
		"short dst":        {0x06, 0x00, 0x02, 0x00, 10, 0, 0, 0},
		"long src":         {0x0c, 0x00, 0x03, 0x00, 1, 2, 3, 4, 5, 6, 7, 8},
		"short id":         {0x08, 0x00, 0x01, 0x00, 0, 0, 0, 1},
		"empty ttl":        {0x04, 0x00, 0x04, 0x00},
		"long tos":         {0x06, 0x00, 0x05, 0x00, 1, 2, 0, 0},
		"short flags":      {0x05, 0x00, 0x06, 0x00, 1, 0, 0, 0},
		"trailing garbage": append(append([]byte{}, kernelIPEncap...), 1, 2),
		"8-byte dst":       {0x0c, 0x00, 0x02, 0x00, 1, 2, 3, 4, 5, 6, 7, 8},
		"mixed families":   append(append([]byte{}, kernelIP6Encap[:32]...), 0x08, 0x00, 0x03, 0x00, 10, 0, 0, 1),
	} {
		var e IPEncap
		err := e.Decode(b)
		if !errors.Is(err, errMalformed) {
			t.Errorf("%s: Decode error = %v, want errMalformed", name, err)
		}
	}
	// A route's encap type fixes the address length.
	for name, tc := range map[string]struct {
		typ uint16
		b   []byte
	}{
		"ipv6 dst in IP":  {unix.LWTUNNEL_ENCAP_IP, kernelIP6Encap},
		"ipv4 dst in IP6": {unix.LWTUNNEL_ENCAP_IP6, kernelIPEncap},
	} {
		var e IPEncap
		if err := e.decode(tc.b, tc.typ); !errors.Is(err, errMalformed) {
			t.Errorf("%s: decode error = %v, want errMalformed", name, err)
		}
	}
}

func TestIPEncapDecodeIgnoresUnknownAndPad(t *testing.T) {
	b := append([]byte{
		0x04, 0x00, lwtunnelIPPad, 0x00, // pad before a 64-bit attribute
		0x08, 0x00, 0x63, 0x00, 1, 2, 3, 4, // unknown type 99
	}, kernelIPEncap...)
	var e IPEncap
	if err := e.Decode(b); err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if e.ID != 42 {
		t.Errorf("ID = %d, want 42", e.ID)
	}
}

func TestIPEncapEqual(t *testing.T) {
	a := &IPEncap{Dst: netip.MustParseAddr("10.0.0.1"), TTL: 64}
	withZeroSrc := &IPEncap{Dst: netip.MustParseAddr("10.0.0.1"), Src: netip.IPv4Unspecified(), TTL: 64}
	var nilEncap *IPEncap
	for _, tc := range []struct {
		name string
		a    *IPEncap
		b    netlink.Encap
		want bool
	}{
		{"same", a, &IPEncap{Dst: netip.MustParseAddr("10.0.0.1"), TTL: 64}, true},
		{"0.0.0.0 src is unset", a, withZeroSrc, true},
		{"other dst", a, &IPEncap{Dst: netip.MustParseAddr("10.0.0.2"), TTL: 64}, false},
		{"other ttl", a, &IPEncap{Dst: netip.MustParseAddr("10.0.0.1")}, false},
		{"other id", a, &IPEncap{ID: 1, Dst: netip.MustParseAddr("10.0.0.1"), TTL: 64}, false},
		{"other flags", a, &IPEncap{Dst: netip.MustParseAddr("10.0.0.1"), TTL: 64, Flags: FlagKey}, false},
		{"other type", a, &netlink.MPLSEncap{Labels: []int{100}}, false},
		{"nil vs value", nilEncap, a, false},
		{"value vs nil", a, nilEncap, false},
		{"nil vs nil", nilEncap, nilEncap, true},
		{"ipv6", &IPEncap{Dst: netip.MustParseAddr("fd00::1")}, &IPEncap{Dst: netip.MustParseAddr("fd00::1")}, true},
		{":: src is unset", &IPEncap{Dst: netip.MustParseAddr("fd00::1")},
			&IPEncap{Dst: netip.MustParseAddr("fd00::1"), Src: netip.IPv6Unspecified()}, true},
		{"ipv4 vs ipv6", a, &IPEncap{Dst: netip.MustParseAddr("::ffff:10.0.0.1"), TTL: 64}, false},
		// No address at all: only the kernel's encap type tells IP6.
		{"unset ip vs unset ip6", &IPEncap{TTL: 64}, &IPEncap{TTL: 64, ip6: true}, false},
	} {
		if got := tc.a.Equal(tc.b); got != tc.want {
			t.Errorf("%s: Equal = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// FuzzIPEncapDecode checks that Decode never panics and that whatever it
// accepts survives an Encode/Decode round trip.
func FuzzIPEncapDecode(f *testing.F) {
	f.Add(kernelIPEncap)
	f.Add([]byte{})
	f.Add([]byte{0x08, 0x00, 0x02, 0x00, 10, 0, 0, 1})
	f.Add([]byte{0x0c, 0x00, 0x08, 0x80, 0x08, 0x00, 0x02, 0x00, 0, 0, 0, 1})
	f.Add(kernelIP6Encap)
	f.Fuzz(func(t *testing.T, b []byte) {
		var e IPEncap
		if err := e.Decode(b); err != nil {
			return
		}
		enc, err := e.Encode()
		if err != nil {
			t.Fatalf("Encode of decoded %v: %v", &e, err)
		}
		var again IPEncap
		if err := again.Decode(enc); err != nil {
			t.Fatalf("Decode(Encode(%v)): %v", &e, err)
		}
		if !again.Equal(&e) {
			t.Fatalf("round trip changed %v into %v", &e, &again)
		}
	})
}
