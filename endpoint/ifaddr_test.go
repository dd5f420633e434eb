package endpoint

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestAddrRequestRoundTrip: what addrRequest sends reads back, through
// parseIfAddr, as the address it was built from, flags and protocol
// included; the header asks for an acknowledgement.
func TestAddrRequestRoundTrip(t *testing.T) {
	for _, a := range []ifAddr{
		{LinkIndex: 1, Prefix: netip.MustParsePrefix("2001:db8::10/128"), Flags: tunnelIPFlags, Proto: 245},
		{LinkIndex: 7, Prefix: netip.MustParsePrefix("192.0.2.10/32")},
		{LinkIndex: 300, Prefix: netip.MustParsePrefix("fd00::/64"), Flags: unix.IFA_F_NODAD, Proto: 5},
	} {
		req := addrRequest(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, a)
		b := req.Serialize()
		if req.Type != unix.RTM_NEWADDR || req.Flags&unix.NLM_F_ACK == 0 || req.Flags&unix.NLM_F_EXCL == 0 {
			t.Errorf("%v: header type %d flags %#x", a, req.Type, req.Flags)
		}
		got, err := parseIfAddr(b[unix.SizeofNlMsghdr:])
		if err != nil {
			t.Fatalf("%v: %v", a, err)
		}
		if got != a {
			t.Errorf("round trip: got %+v, want %+v", got, a)
		}
	}
}

// TestParseIfAddrKernelMessage reads an RTM_NEWADDR message laid out as
// the kernel dumps an IPv6 address (IFA_ADDRESS only, IFA_CACHEINFO,
// IFA_FLAGS beyond the header's 8 bits, IFA_PROTO padded to 4 bytes).
func TestParseIfAddrKernelMessage(t *testing.T) {
	msg := nl.NewIfAddrmsg(unix.AF_INET6)
	msg.Prefixlen, msg.Flags, msg.Index = 128, unix.IFA_F_PERMANENT|unix.IFA_F_NODAD, 1
	b := msg.Serialize()
	for _, attr := range []*nl.RtAttr{
		nl.NewRtAttr(unix.IFA_ADDRESS, netip.MustParseAddr("2001:db8::10").AsSlice()),
		nl.NewRtAttr(unix.IFA_CACHEINFO, make([]byte, 16)),
		nl.NewRtAttr(unix.IFA_FLAGS, nl.Uint32Attr(unix.IFA_F_PERMANENT|unix.IFA_F_NODAD|unix.IFA_F_NOPREFIXROUTE)),
		nl.NewRtAttr(ifaProto, nl.Uint8Attr(245)),
	} {
		b = append(b, attr.Serialize()...)
	}
	got, err := parseIfAddr(b)
	want := ifAddr{LinkIndex: 1, Prefix: netip.MustParsePrefix("2001:db8::10/128"), Flags: unix.IFA_F_PERMANENT | unix.IFA_F_NODAD | unix.IFA_F_NOPREFIXROUTE, Proto: 245}
	if err != nil || got != want {
		t.Fatalf("parseIfAddr = %+v, %v; want %+v", got, err, want)
	}

	for name, bad := range map[string][]byte{
		"short":      b[:4],
		"no address": msg.Serialize(),
		"prefix too long": func() []byte {
			m := nl.NewIfAddrmsg(unix.AF_INET)
			m.Prefixlen = 33
			return append(m.Serialize(), nl.NewRtAttr(unix.IFA_LOCAL, []byte{192, 0, 2, 10}).Serialize()...)
		}(),
	} {
		if a, err := parseIfAddr(bad); err == nil {
			t.Errorf("%s: parsed as %+v, want an error", name, a)
		}
	}
}

// TestAddrConnOnTheKernel: an IPv6 address added with an address protocol
// keeps it, as the agent's ownership of lo's IPv6 addresses needs; the
// kernel's ::1 and an address added as ip does carry another; an address
// already there is never taken over.
func TestAddrConnOnTheKernel(t *testing.T) {
	ns := testnetns.New(t)
	ns.Run("ip", "-6", "addr", "add", "2001:db8::50/128", "dev", "lo") // someone else's
	ac, err := dialAddrs(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	lo, err := ns.Netlink().LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	ours := ifAddr{LinkIndex: lo.Attrs().Index, Prefix: netip.MustParsePrefix("2001:db8::10/128"), Flags: tunnelIPFlags, Proto: 245}
	if err := ac.add(ours); err != nil {
		t.Fatal(err)
	}
	byAddr := func() map[netip.Addr]ifAddr {
		t.Helper()
		addrs, err := ac.list(unix.AF_INET6)
		if err != nil {
			t.Fatal(err)
		}
		out := map[netip.Addr]ifAddr{}
		for _, a := range addrs {
			out[a.Prefix.Addr()] = a
		}
		return out
	}
	got := byAddr()
	a, ok := got[ours.Prefix.Addr()]
	if !ok || a.Proto != 245 || a.Flags&tunnelIPFlags != tunnelIPFlags || a.Flags&unix.IFA_F_TENTATIVE != 0 || a.LinkIndex != ours.LinkIndex {
		t.Fatalf("the agent's address reads back as %+v (found %t), want protocol 245, flags nodad and noprefixroute, not tentative", a, ok)
	}
	for _, other := range []string{"::1", "2001:db8::50"} {
		if a := got[netip.MustParseAddr(other)]; a.Proto == 245 {
			t.Errorf("%s has the agent's protocol: %+v", other, a)
		}
	}
	// Usable at once and without a prefix route, as an IPv4 /32 on lo.
	if main := ns.Run("ip", "-6", "route", "show", "table", "main"); strings.Contains(main, "2001:db8::10") {
		t.Errorf("a prefix route came with the address:\n%s", main)
	}
	waitForLocalRoute(t, ns, ours.Prefix.Addr())
	someones := ifAddr{LinkIndex: lo.Attrs().Index, Prefix: netip.MustParsePrefix("2001:db8::50/128"), Flags: tunnelIPFlags, Proto: 245}
	if err := ac.add(someones); !errors.Is(err, unix.EEXIST) {
		t.Fatalf("adding over someone else's address: %v, want EEXIST", err)
	}
	if a := byAddr()[someones.Prefix.Addr()]; a.Proto == 245 {
		t.Fatalf("someone else's address was taken over: %+v", a)
	}
	if err := ac.del(ours); err != nil {
		t.Fatal(err)
	}
	got = byAddr()
	var left []string
	for ip := range got {
		left = append(left, ip.String())
	}
	slices.Sort(left)
	if strings.Join(left, " ") != "2001:db8::50 ::1" {
		t.Errorf("after removing the agent's address lo holds %v, want ::1 and 2001:db8::50", left)
	}
}
