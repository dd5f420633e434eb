package rtnl

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Payloads (after struct nlmsghdr) the kernel (6.18) dumped for
//
//	ip nexthop add id 7 encap ip id 0 dst 10.244.0.1 ttl 64 dev veth0 proto 200
//	ip nexthop add id 8 blackhole proto 200
//	ip route add 10.96.0.1/32 nhid 7 table 7600 proto 200
var (
	kernelEncapNextHop = []byte{
		0x02, 0xfe, 0xc8, 0x00, 0x00, 0x00, 0x00, 0x00, // nhmsg: inet, scope host, proto 200
		0x08, 0x00, 0x01, 0x00, 0x07, 0x00, 0x00, 0x00, // NHA_ID 7
		0x08, 0x00, 0x05, 0x00, 0x03, 0x00, 0x00, 0x00, // NHA_OIF 3
		0x38, 0x00, 0x08, 0x00, // NHA_ENCAP
		0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x02, 0x00, 0x0a, 0xf4, 0x00, 0x01,
		0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x04, 0x00, 0x40, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x06, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x07, 0x00, 0x02, 0x00, 0x00, 0x00, // NHA_ENCAP_TYPE IP
	}
	kernelBlackholeNextHop = []byte{
		0x02, 0x00, 0xc8, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x01, 0x00, 0x08, 0x00, 0x00, 0x00, // NHA_ID 8
		0x04, 0x00, 0x04, 0x00, // NHA_BLACKHOLE
	}
	// The route carries RTA_NH_ID and, for old tools, the nexthop's
	// attributes (net.ipv4.nexthop_compat_mode).
	kernelNextHopRoute = []byte{
		0x02, 0x20, 0x00, 0x00, 0xfc, 0xc8, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x0f, 0x00, 0xb0, 0x1d, 0x00, 0x00,
		0x08, 0x00, 0x01, 0x00, 0x0a, 0x60, 0x00, 0x01,
		0x08, 0x00, 0x1e, 0x00, 0x07, 0x00, 0x00, 0x00, // RTA_NH_ID 7
		0x08, 0x00, 0x04, 0x00, 0x03, 0x00, 0x00, 0x00,
		0x38, 0x00, 0x16, 0x00,
		0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x02, 0x00, 0x0a, 0xf4, 0x00, 0x01,
		0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x04, 0x00, 0x40, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x06, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x15, 0x00, 0x02, 0x00, 0x00, 0x00,
	}
)

// Payloads the kernel (6.18) dumped for the IPv6 equivalents:
//
//	ip -6 nexthop add id 7 encap ip6 dst fd00:244::1 hoplimit 64 dev veth0 proto 200
//	ip -6 nexthop add id 8 blackhole proto 200
//	ip -6 route add 2001:db8::1/128 nhid 7 table 7600 proto 200
var (
	kernelEncapNextHop6 = []byte{
		0x0a, 0xfd, 0xc8, 0x00, 0x00, 0x00, 0x00, 0x00, // nhmsg: inet6, scope link, proto 200
		0x08, 0x00, 0x01, 0x00, 0x07, 0x00, 0x00, 0x00, // NHA_ID 7
		0x08, 0x00, 0x05, 0x00, 0x03, 0x00, 0x00, 0x00, // NHA_OIF 3
		0x50, 0x00, 0x08, 0x00, // NHA_ENCAP
		0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x14, 0x00, 0x02, 0x00, 0xfd, 0x00, 0x02, 0x44, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01,
		0x14, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x04, 0x00, 0x40, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x06, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x07, 0x00, 0x04, 0x00, 0x00, 0x00, // NHA_ENCAP_TYPE IP6
	}
	kernelBlackholeNextHop6 = []byte{
		0x0a, 0x00, 0xc8, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x01, 0x00, 0x08, 0x00, 0x00, 0x00, // NHA_ID 8
		0x04, 0x00, 0x04, 0x00, // NHA_BLACKHOLE
	}
	// Like IPv4's, with RTA_PRIORITY, RTA_CACHEINFO and RTA_PREF.
	kernelNextHopRoute6 = []byte{
		0x0a, 0x80, 0x00, 0x00, 0xfc, 0xc8, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
		0x08, 0x00, 0x0f, 0x00, 0xb0, 0x1d, 0x00, 0x00,
		0x14, 0x00, 0x01, 0x00, 0x20, 0x01, 0x0d, 0xb8, 0x00, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01,
		0x08, 0x00, 0x06, 0x00, 0x00, 0x04, 0x00, 0x00,
		0x08, 0x00, 0x1e, 0x00, 0x07, 0x00, 0x00, 0x00, // RTA_NH_ID 7
		0x08, 0x00, 0x04, 0x00, 0x03, 0x00, 0x00, 0x00,
		0x50, 0x00, 0x16, 0x00,
		0x0c, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x14, 0x00, 0x02, 0x00, 0xfd, 0x00, 0x02, 0x44, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01,
		0x14, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x04, 0x00, 0x40, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x06, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x06, 0x00, 0x15, 0x00, 0x04, 0x00, 0x00, 0x00,
		0x24, 0x00, 0x0c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x05, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00,
	}
)

func TestDecodeKernelNextHops(t *testing.T) {
	for _, tc := range []struct {
		name string
		msg  []byte
		want NextHop
	}{
		{"encap", kernelEncapNextHop, NextHop{ID: 7, Protocol: 200, LinkIndex: 3,
			IPEncap: &IPEncap{Dst: netip.MustParseAddr("10.244.0.1"), TTL: 64}}},
		{"blackhole", kernelBlackholeNextHop, NextHop{ID: 8, Protocol: 200, Blackhole: true}},
		{"ipv6 encap", kernelEncapNextHop6, NextHop{ID: 7, Protocol: 200, IPv6: true, LinkIndex: 3,
			IPEncap: &IPEncap{Dst: netip.MustParseAddr("fd00:244::1"), TTL: 64}}},
		{"ipv6 blackhole", kernelBlackholeNextHop6, NextHop{ID: 8, Protocol: 200, IPv6: true, Blackhole: true}},
	} {
		got, err := decodeNextHop(tc.msg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !got.Equal(&tc.want) {
			t.Errorf("%s: decoded %v, want %v", tc.name, &got, &tc.want)
		}
	}
	r, err := decodeRoute(kernelNextHopRoute)
	if err != nil {
		t.Fatal(err)
	}
	want := Route{Table: 7600, Dst: netip.MustParsePrefix("10.96.0.1/32"), Type: Unicast, Protocol: 200, NextHopID: 7}
	if !r.Equal(&want) {
		t.Errorf("decoded route %v, want %v", &r, &want)
	}
}

func TestNextHopMessageRoundTrip(t *testing.T) {
	// MPLS cannot be programmed on the development host; see
	// TestNewRouteMessageRoundTrip.
	for _, n := range []NextHop{
		{ID: 1, Protocol: 200, LinkIndex: 3, IPEncap: &IPEncap{Dst: netip.MustParseAddr("10.244.0.1"), TTL: 64}},
		{ID: 2, Protocol: 200, LinkIndex: 2, Gateway: netip.MustParseAddr("192.168.1.20"), MPLSLabels: []uint32{1000, 1}},
		{ID: 3, Protocol: 200, Blackhole: true},
		{ID: 1 << 31, LinkIndex: 9},
		{ID: 4, Protocol: 200, IPv6: true, LinkIndex: 3, IPEncap: &IPEncap{Dst: netip.MustParseAddr("fd00:244::1"), TTL: 64}},
		{ID: 5, Protocol: 200, IPv6: true, LinkIndex: 2, Gateway: netip.MustParseAddr("fd00:1::20"), MPLSLabels: []uint32{1 << 19}},
		{ID: 6, Protocol: 200, IPv6: true, Blackhole: true},
		{ID: 7, Protocol: 200, LinkIndex: 3, IPEncap: &IPEncap{Dst: netip.MustParseAddr("fd00:244::1")}}, // IPv4, IPv6 outer
	} {
		if err := n.validate(); err != nil {
			t.Fatalf("validate(%v): %v", &n, err)
		}
		s := newMsgScanner(appendNewNextHop(nil, &n, unix.NLM_F_REPLACE, 4))
		if !s.next() || s.hdr.typ != unix.RTM_NEWNEXTHOP || s.hdr.seq != 4 {
			t.Fatalf("%v: bad message (%v) %+v", &n, s.err, s.hdr)
		}
		if want := uint16(unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE | unix.NLM_F_REPLACE); s.hdr.flags != want {
			t.Errorf("%v: flags %#x, want %#x", &n, s.hdr.flags, want)
		}
		got, err := decodeNextHop(s.payload)
		if err != nil {
			t.Fatalf("decode %v: %v", &n, err)
		}
		if !got.Equal(&n) {
			t.Errorf("round trip of %v gave %v", &n, &got)
		}
		if family := s.payload[0]; family != n.nhFamily() {
			t.Errorf("%v: nhm_family %d", &n, family)
		}
	}
	s := newMsgScanner(appendDelNextHop(nil, 42, 5))
	if !s.next() || s.hdr.typ != unix.RTM_DELNEXTHOP {
		t.Fatalf("delete: %v %+v", s.err, s.hdr)
	}
	if got, err := decodeNextHop(s.payload); err != nil || got.ID != 42 {
		t.Errorf("delete request decodes as %v, %v", &got, err)
	}
}

func TestNextHopValidate(t *testing.T) {
	encap := &IPEncap{Dst: netip.MustParseAddr("10.244.0.1")}
	for _, tc := range []struct {
		name string
		op   Op
	}{
		{"no id", Op{Kind: ReplaceNextHop, NextHop: NextHop{LinkIndex: 1}}},
		{"no link", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, IPEncap: encap}}},
		{"blackhole with link", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, Blackhole: true, LinkIndex: 1}}},
		{"ipv6 gateway", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, LinkIndex: 1, Gateway: netip.MustParseAddr("fe80::1")}}},
		{"ipv4 gateway of ipv6", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, IPv6: true, LinkIndex: 1, Gateway: netip.MustParseAddr("10.0.0.1")}}},
		{"ipv4-mapped gateway", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, IPv6: true, LinkIndex: 1, Gateway: netip.MustParseAddr("::ffff:10.0.0.1")}}},
		{"two encaps", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, LinkIndex: 1, IPEncap: encap, MPLSLabels: []uint32{1}}}},
		{"group", Op{Kind: ReplaceNextHop, NextHop: NextHop{ID: 1, LinkIndex: 1, group: true}}},
		{"delete id 0", Op{Kind: DeleteNextHop}},
		{"add without link", Op{Kind: AddNextHop, NextHop: NextHop{ID: 1, IPEncap: encap}}},
		{"route with nhid and encap", Op{Kind: Replace, Route: Route{Table: 1, Dst: netip.MustParsePrefix("10.0.0.1/32"),
			Type: Unicast, NextHopID: 1, IPEncap: encap}}},
		{"blackhole route with nhid", Op{Kind: Replace, Route: Route{Table: 1, Dst: netip.MustParsePrefix("10.0.0.1/32"),
			Type: Blackhole, NextHopID: 1}}},
	} {
		if err := tc.op.validate(); !errors.Is(err, ErrInvalidRoute) {
			t.Errorf("%s: validate = %v, want ErrInvalidRoute", tc.name, err)
		}
	}
}

func TestDecodeNextHopMalformed(t *testing.T) {
	for name, b := range map[string][]byte{
		"short header":  kernelBlackholeNextHop[:6],
		"truncated":     kernelEncapNextHop[:len(kernelEncapNextHop)-3],
		"short id":      {2, 0, 0, 0, 0, 0, 0, 0, 0x06, 0x00, 0x01, 0x00, 1, 0, 0, 0},
		"short oif":     {2, 0, 0, 0, 0, 0, 0, 0, 0x05, 0x00, 0x05, 0x00, 1, 0, 0, 0},
		"odd gateway":   {2, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x00, 0x06, 0x00, 1, 2, 3, 0},
		"bad encap":     append(slices.Clone(kernelBlackholeNextHop), 0x06, 0x00, 0x07, 0x00, 1, 0, 0, 0),
		"long encap ty": append(slices.Clone(kernelBlackholeNextHop), 0x08, 0x00, 0x07, 0x00, 1, 0, 0, 0),
	} {
		if _, err := decodeNextHop(b); !errors.Is(err, errMalformed) {
			t.Errorf("%s: error %v, want errMalformed", name, err)
		}
	}
}

// FuzzDecodeNextHop checks that decoding arbitrary nexthop messages never
// panics.
func FuzzDecodeNextHop(f *testing.F) {
	f.Add(kernelEncapNextHop)
	f.Add(kernelBlackholeNextHop)
	f.Add(kernelEncapNextHop6)
	f.Add(kernelBlackholeNextHop6)
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := decodeNextHop(b)
		if err != nil || n.validate() != nil {
			return
		}
		again, err := decodeNextHop(appendNewNextHop(nil, &n, unix.NLM_F_REPLACE, 1)[nlmsgHeaderLen:])
		if err != nil || !again.Equal(&n) {
			t.Fatalf("round trip of %v gave %v, %v", &n, &again, err)
		}
	})
}

// TestNextHopObjects programs routes through nexthop objects: one per
// endpoint, shared by all buckets that choose it.
func TestNextHopObjects(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	pod := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, 0, byte(i)}) }
	var nexthops []NextHop
	var ops []Op
	for i := 1; i <= 4; i++ {
		n := NextHop{ID: uint32(i), Protocol: testProtocol, LinkIndex: ns.veth, IPEncap: &IPEncap{Dst: pod(i), TTL: 64}}
		nexthops = append(nexthops, n)
		ops = append(ops, Op{Kind: ReplaceNextHop, NextHop: n})
	}
	var routes []Route
	for table := testTables.First; table <= testTables.Last; table++ {
		for v := 1; v <= 10; v++ {
			r := Route{Table: table, Dst: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 96, 0, byte(v)}), 32),
				Type: Unicast, Protocol: testProtocol, NextHopID: uint32(1 + (v+int(table))%4)}
			routes = append(routes, r)
			ops = append(ops, Op{Kind: Replace, Route: r})
		}
	}
	mustApply(t, c, ops)
	assertRoutes(t, listTunnelRoutes(t, c), routes)
	assertNextHops(t, c, nexthops)

	// Moving an endpoint is one nexthop replace; the routes follow.
	nexthops[0].IPEncap = &IPEncap{Dst: pod(99), TTL: 64}
	mustApply(t, c, []Op{{Kind: ReplaceNextHop, NextHop: nexthops[0]}})
	assertNextHops(t, c, nexthops)
	shown := normalizeSpaces(runIP(t, "-n", ns.name, "route", "show", "table", "all"))
	want := fmt.Sprintf("nhid 1 encap ip id 0 src 0.0.0.0 dst %s ttl 64 tos 0 dev veth0", pod(99))
	if !strings.Contains(shown, want) {
		t.Errorf("ip route show lacks %q:\n%s", want, shown)
	}

	// A route naming a missing nexthop fails alone; deleting a nexthop
	// deletes its routes; deleting it twice is fine.
	bad := Route{Table: 7600, Dst: netip.MustParsePrefix("10.96.1.1/32"), Type: Unicast, Protocol: testProtocol, NextHopID: 77}
	err := c.Apply([]Op{
		{Kind: Replace, Route: bad},
		{Kind: DeleteNextHop, NextHop: NextHop{ID: 2}},
		{Kind: DeleteNextHop, NextHop: NextHop{ID: 2}},
	})
	var applyErr *ApplyError
	if !errors.As(err, &applyErr) || len(applyErr.Failed) != 1 || applyErr.Failed[0].Index != 0 ||
		!strings.Contains(err.Error(), "nhid 77") {
		t.Fatalf("Apply = %v, want one failure naming the nhid 77 route", err)
	}
	routes = slices.DeleteFunc(routes, func(r Route) bool { return r.NextHopID == 2 })
	assertRoutes(t, listTunnelRoutes(t, c), routes)
	assertNextHops(t, c, slices.Delete(nexthops, 1, 2))
}

// TestAddNextHopNeverReplaces shows what AddNextHop is for: a taken ID
// fails the add, whoever owns the nexthop, while ReplaceNextHop would take
// it over. Listing by protocol leaves other owners' nexthops out.
func TestAddNextHopNeverReplaces(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	// Someone else's nexthop, with another protocol.
	runIP(t, "-n", ns.name, "nexthop", "add", "id", "9", "encap", "ip", "id", "0", "dst", "10.244.9.9", "dev", "veth0", "proto", "static")
	ours := NextHop{ID: 10, Protocol: testProtocol, LinkIndex: ns.veth, IPEncap: &IPEncap{Dst: netip.MustParseAddr("10.244.0.10"), TTL: 64}}
	taken := ours
	taken.ID = 9
	err := c.Apply([]Op{{Kind: AddNextHop, NextHop: ours}, {Kind: AddNextHop, NextHop: taken}})
	var applyErr *ApplyError
	if !errors.As(err, &applyErr) || len(applyErr.Failed) != 1 || applyErr.Failed[0].Index != 1 ||
		!errors.Is(err, unix.EEXIST) || !strings.Contains(err.Error(), "add nexthop id 9") {
		t.Fatalf("Apply = %v, want the add of the taken id 9 to fail with EEXIST", err)
	}
	// Adding our own again fails too: AddNextHop is not idempotent.
	if err := c.Apply([]Op{{Kind: AddNextHop, NextHop: ours}}); !errors.Is(err, unix.EEXIST) {
		t.Errorf("adding id 10 twice: %v, want EEXIST", err)
	}
	assertNextHops(t, c, []NextHop{ours})
	all, err := c.ListNextHops(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 2 {
		t.Errorf("ListNextHops(0) = %v, want the static one and ours", all)
	}
	if shown := runIP(t, "-n", ns.name, "nexthop", "show", "id", "9"); !strings.Contains(shown, "10.244.9.9") {
		t.Errorf("the other owner's nexthop changed: %s", shown)
	}
}

func assertNextHops(t *testing.T, c *Client, want []NextHop) {
	t.Helper()
	got, err := c.ListNextHops(testProtocol)
	if err != nil {
		t.Fatalf("ListNextHops: %v", err)
	}
	slices.SortFunc(got, func(a, b NextHop) int { return int(a.ID) - int(b.ID) })
	if len(got) != len(want) {
		t.Fatalf("listed %d nexthops, want %d", len(got), len(want))
	}
	for i := range want {
		if !got[i].Equal(&want[i]) {
			t.Errorf("nexthop %d: listed %v, want %v", i, &got[i], &want[i])
		}
	}
}
