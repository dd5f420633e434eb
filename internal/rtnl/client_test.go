package rtnl

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The tests in this file program routes in a fresh network namespace each;
// they skip unless run as root.

const testProtocol = 200

var testTables = TableRange{First: 7600, Last: 7663}

// tunnelRoutes builds, for each VIP 10.96.0.1..vips and each table of
// testTables, an IP-encap route via veth, or a blackhole for every fifth VIP
// (a VIP without endpoints).
func tunnelRoutes(vips, link int) []Route { return familyRoutes(false, vips, link) }

// tunnelRoutes6 is tunnelRoutes for IPv6 tunnel IPs 2001:db8::1..vips with
// IPv6 outer destinations (LWTUNNEL_ENCAP_IP6).
func tunnelRoutes6(vips, link int) []Route { return familyRoutes(true, vips, link) }

func familyRoutes(ipv6 bool, vips, link int) []Route {
	vip := func(v int) netip.Prefix {
		if ipv6 {
			return netip.PrefixFrom(netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 14: byte(v >> 8), 15: byte(v)}), 128)
		}
		return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 96, byte(v >> 8), byte(v)}), 32)
	}
	pod := func(n int) netip.Addr {
		if ipv6 {
			return netip.AddrFrom16([16]byte{0xfd, 0x00, 0x02, 0x44, 15: byte(10 + n)})
		}
		return netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + n)})
	}
	var routes []Route
	for table := testTables.First; table <= testTables.Last; table++ {
		for v := 1; v <= vips; v++ {
			r := Route{Table: table, Dst: vip(v), Type: Blackhole, Protocol: testProtocol}
			if v%5 != 0 {
				r.Type, r.LinkIndex = Unicast, link
				r.IPEncap = &IPEncap{Dst: pod((v + int(table)) % 8), TTL: 64}
			}
			routes = append(routes, r)
		}
	}
	return routes
}

func replaceOps(routes []Route) []Op {
	ops := make([]Op, len(routes))
	for i, r := range routes {
		ops[i] = Op{Kind: Replace, Route: r}
	}
	return ops
}

func mustApply(t *testing.T, c *Client, ops []Op) {
	t.Helper()
	if err := c.Apply(ops); err != nil {
		t.Fatalf("Apply: %v", err)
	}
}

// listTunnelRoutes lists this test's routes, sorted by key.
func listTunnelRoutes(t *testing.T, c *Client) []Route {
	t.Helper()
	routes, err := c.List(ListFilter{Tables: testTables, Protocol: testProtocol})
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	sortRoutes(routes)
	return routes
}

func sortRoutes(routes []Route) {
	slices.SortFunc(routes, func(a, b Route) int {
		return cmp.Or(cmp.Compare(a.Table, b.Table), a.Dst.Addr().Compare(b.Dst.Addr()))
	})
}

// assertRoutes compares listed routes with the wanted ones exactly.
func assertRoutes(t *testing.T, got, want []Route) {
	t.Helper()
	want = slices.Clone(want)
	sortRoutes(want)
	if len(got) != len(want) {
		t.Fatalf("listed %d routes, want %d", len(got), len(want))
	}
	bad := 0
	for i := range want {
		if !got[i].Equal(&want[i]) {
			if bad++; bad <= 5 {
				t.Errorf("route %d: listed %v, want %v", i, &got[i], &want[i])
			}
		}
	}
}

func TestApplyAndList(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(20, ns.veth)
	mustApply(t, c, replaceOps(routes))
	assertRoutes(t, listTunnelRoutes(t, c), routes)

	// iproute2 must see the same routes, with tables above 255 intact.
	shown := normalizeSpaces(runIP(t, "-n", ns.name, "route", "show", "table", "all"))
	for _, r := range routes {
		var line string
		if r.Type == Blackhole {
			line = fmt.Sprintf("blackhole %s table %d proto %d", r.Dst.Addr(), r.Table, r.Protocol)
		} else {
			line = fmt.Sprintf("%s encap ip id 0 src 0.0.0.0 dst %s ttl 64 tos 0 dev veth0 table %d proto %d scope link",
				r.Dst.Addr(), r.IPEncap.Dst, r.Table, r.Protocol)
		}
		if !strings.Contains(shown, line+"\n") {
			t.Fatalf("ip route show lacks %q; it shows:\n%s", line, shown)
		}
	}
}

func normalizeSpaces(s string) string {
	var sb strings.Builder
	for _, line := range strings.Split(s, "\n") {
		sb.WriteString(strings.Join(strings.Fields(line), " ") + "\n")
	}
	return sb.String()
}

func TestApplyManyBatches(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(400, ns.veth) // 25,600 routes: several sendmsg batches
	mustApply(t, c, replaceOps(routes))
	assertRoutes(t, listTunnelRoutes(t, c), routes)
}

func TestApplyReplaceChangesRoutes(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(10, ns.veth)
	mustApply(t, c, replaceOps(routes))

	var changes []Route
	for i := range routes {
		r := &routes[i]
		switch {
		case i%7 == 0 && r.Type == Unicast: // endpoint moved
			r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("10.244.9.9"), TTL: 64}
		case i%7 == 1 && r.Type == Unicast: // service lost its endpoints
			*r = Route{Table: r.Table, Dst: r.Dst, Type: Blackhole, Protocol: r.Protocol}
		case i%7 == 2 && r.Type == Blackhole: // service gained one
			r.Type, r.LinkIndex = Unicast, ns.veth
			r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("10.244.8.8"), TTL: 64}
		default:
			continue
		}
		changes = append(changes, *r)
	}
	if len(changes) == 0 {
		t.Fatal("test built no changes")
	}
	mustApply(t, c, replaceOps(changes))
	assertRoutes(t, listTunnelRoutes(t, c), routes)
}

func TestApplyDelete(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(10, ns.veth)
	mustApply(t, c, replaceOps(routes))

	var ops []Op
	var kept []Route
	for i, r := range routes {
		if i%3 == 0 {
			// Only the key and protocol matter: drop the next hop.
			ops = append(ops, Op{Kind: Delete, Route: Route{Table: r.Table, Dst: r.Dst, Protocol: r.Protocol}})
		} else {
			kept = append(kept, r)
		}
	}
	absent := []Op{
		{Kind: Delete, Route: Route{Table: 7600, Dst: netip.MustParsePrefix("10.97.0.1/32"), Protocol: testProtocol}},
		{Kind: Delete, Route: Route{Table: 9999, Dst: netip.MustParsePrefix("10.97.0.1/32")}}, // no such table
	}
	mustApply(t, c, append(ops, absent...))
	assertRoutes(t, listTunnelRoutes(t, c), kept)

	// Deleting the same routes again is not an error.
	mustApply(t, c, ops)
	// A delete with another protocol leaves the route alone.
	other := Op{Kind: Delete, Route: Route{Table: kept[0].Table, Dst: kept[0].Dst, Protocol: testProtocol + 1}}
	mustApply(t, c, []Op{other})
	assertRoutes(t, listTunnelRoutes(t, c), kept)
}

func TestApplyReportsFailedRoutes(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(5, ns.veth)
	ops := replaceOps(routes)

	missingLink := encapRoute()
	missingLink.LinkIndex = 4242
	missingIdx := len(ops) / 2
	ops = slices.Insert(ops, missingIdx, Op{Kind: Replace, Route: missingLink})
	hostBits := Route{Table: 7600, Dst: netip.MustParsePrefix("10.98.0.1/24"), Type: Blackhole}
	ops = append(ops, Op{Kind: Replace, Route: hostBits})

	err := c.Apply(ops)
	var applyErr *ApplyError
	if !errors.As(err, &applyErr) || len(applyErr.Failed) != 2 {
		t.Fatalf("Apply error = %v, want an ApplyError with 2 failures", err)
	}
	first, second := applyErr.Failed[0], applyErr.Failed[1]
	if first.Index != missingIdx || !first.Op.Route.Equal(&missingLink) || !errors.Is(first, unix.ENODEV) {
		t.Errorf("first failure = %v (index %d), want ENODEV for op %d", first, first.Index, missingIdx)
	}
	if !strings.Contains(err.Error(), "oif 4242 table 7600") {
		t.Errorf("error does not name the route: %v", err)
	}
	if second.Index != len(ops)-1 || !errors.Is(second, ErrInvalidRoute) {
		t.Errorf("second failure = %v (index %d), want ErrInvalidRoute for the last op", second, second.Index)
	}
	// Every other route of the batch was applied.
	assertRoutes(t, listTunnelRoutes(t, c), routes)
}

func TestApplyRecoversFromDroppedAcks(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	// A tiny receive buffer and a batch size that ignores it: the kernel
	// drops most acks (ENOBUFS) and Apply must resend from the first
	// unacknowledged request.
	if err := unix.SetsockoptInt(c.conn.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4096); err != nil {
		t.Fatal(err)
	}
	c.maxBatch = 1 << 20
	routes := tunnelRoutes(50, ns.veth)
	ops := replaceOps(routes)
	missing := encapRoute()
	missing.LinkIndex = 4242
	ops = append(ops, Op{Kind: Replace, Route: missing})
	// Deleting routes that were just added, within the same call, checks
	// that resending keeps the order of operations.
	for _, r := range routes[:100] {
		ops = append(ops, Op{Kind: Delete, Route: r})
	}

	err := c.Apply(ops)
	var applyErr *ApplyError
	if !errors.As(err, &applyErr) || len(applyErr.Failed) != 1 || applyErr.Failed[0].Index != len(routes) {
		t.Fatalf("Apply error = %v, want only the missing-link failure", err)
	}
	if c.maxBatch >= 1<<20 {
		t.Error("no acks were dropped; the test did not exercise recovery")
	}
	assertRoutes(t, listTunnelRoutes(t, c), routes[100:])
}

func TestListFilters(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(3, ns.veth)
	foreign := Route{Table: 7600, Dst: netip.MustParsePrefix("10.99.0.1/32"), Type: Blackhole, Protocol: testProtocol + 1}
	low := Route{Table: 100, Dst: netip.MustParsePrefix("10.99.0.2/32"), Type: Blackhole, Protocol: testProtocol}
	mustApply(t, c, replaceOps(append(slices.Clone(routes), foreign, low)))

	count := func(f ListFilter) int {
		t.Helper()
		got, err := c.List(f)
		if err != nil {
			t.Fatalf("List(%+v): %v", f, err)
		}
		for _, r := range got {
			if !f.matches(familyOf(r.Dst), r.Table, r.Protocol) {
				t.Errorf("List(%+v) returned %v", f, &r)
			}
		}
		return len(got)
	}
	for _, tc := range []struct {
		f    ListFilter
		want int
	}{
		{ListFilter{Tables: testTables, Protocol: testProtocol}, len(routes)},
		{ListFilter{Tables: testTables}, len(routes) + 1},
		{ListFilter{Protocol: testProtocol}, len(routes) + 1},
		{ListFilter{Tables: TableRange{7600, 7600}, Protocol: testProtocol}, 3},
		{ListFilter{Tables: TableRange{100, 100}}, 1},
		{ListFilter{Tables: TableRange{5000, 5000}}, 0}, // table does not exist
		{ListFilter{Tables: TableRange{5000, 6000}}, 0},
	} {
		if got := count(tc.f); got != tc.want {
			t.Errorf("List(%+v) returned %d routes, want %d", tc.f, got, tc.want)
		}
	}
	if n := count(ListFilter{}); n < len(routes)+2 {
		t.Errorf("List(all) returned %d routes, want at least %d", n, len(routes)+2)
	}
}

// TestNetlinkRouteAddWithIPEncap checks that IPEncap works as a
// netlink.Encap with vishvananda/netlink, and that List decodes the result.
func TestNetlinkRouteAddWithIPEncap(t *testing.T) {
	ns := newTestNS(t)
	h, err := netlink.NewHandleAt(ns.handle, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	want := encapRoute()
	want.LinkIndex = ns.veth
	want.IPEncap.Flags = FlagKey
	want.IPEncap.ID = 7
	err = h.RouteAdd(&netlink.Route{
		Table: int(want.Table), Dst: netipToIPNet(want.Dst), LinkIndex: ns.veth,
		Protocol: netlink.RouteProtocol(want.Protocol), Scope: netlink.SCOPE_LINK, Encap: want.IPEncap,
	})
	if err != nil {
		t.Fatalf("netlink.RouteAdd: %v", err)
	}
	assertRoutes(t, listTunnelRoutes(t, ns.open(t)), []Route{want})
	if shown := normalizeSpaces(runIP(t, "-n", ns.name, "route", "show", "table", "7600")); !strings.Contains(shown, "encap ip id 7 src 0.0.0.0 dst 10.244.0.9 ttl 64 tos 0 key dev veth0") {
		t.Errorf("ip route show:\n%s", shown)
	}
}

func TestOpenCurrentNetns(t *testing.T) {
	ns := newTestNS(t)
	// Open(netns.None()) uses the calling thread's namespace: enter the
	// test's namespace on a locked thread that is discarded afterwards.
	result := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		if err := netns.Set(ns.handle); err != nil {
			result <- err
			return
		}
		c, err := Open(netns.None())
		if err != nil {
			result <- err
			return
		}
		defer c.Close()
		result <- c.Apply([]Op{{Kind: Replace, Route: Route{Table: 7600, Dst: netip.MustParsePrefix("10.96.0.1/32"), Type: Blackhole, Protocol: testProtocol}}})
	}()
	if err := <-result; err != nil {
		t.Fatal(err)
	}
	assertRoutes(t, listTunnelRoutes(t, ns.open(t)),
		[]Route{{Table: 7600, Dst: netip.MustParsePrefix("10.96.0.1/32"), Type: Blackhole, Protocol: testProtocol}})
}

func TestClosedClient(t *testing.T) {
	ns := newTestNS(t)
	c, err := Open(ns.handle)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.List(ListFilter{}); !errors.Is(err, ErrClosed) {
		t.Errorf("List after Close: %v", err)
	}
	if err := c.Apply(nil); !errors.Is(err, ErrClosed) {
		t.Errorf("Apply after Close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestListAfterFailedDecode(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes := tunnelRoutes(100, ns.veth) // a dump of many datagrams
	mustApply(t, c, replaceOps(routes))
	// A handler failing on the first message must not leave the kernel's
	// dump unfinished, which would make the next dump fail with EBUSY.
	failure := errors.New("decode failure")
	c.mu.Lock()
	err := c.dumpConsistent(
		func(b []byte, seq uint32) []byte { return appendRouteDumpRequest(b, &ListFilter{}, seq) },
		func() {},
		func(uint16, []byte) error { return failure })
	c.mu.Unlock()
	if !errors.Is(err, failure) {
		t.Fatalf("dump error = %v, want the handler's", err)
	}
	assertRoutes(t, listTunnelRoutes(t, c), routes)
	mustApply(t, c, []Op{{Kind: Delete, Route: routes[0]}})
	assertRoutes(t, listTunnelRoutes(t, c), routes[1:])
}

// TestApplyAndListIPv6 programs IPv6 routes (IP6 encapsulation and
// blackholes) next to IPv4 ones in the same tables: each family's listing
// holds exactly its own, iproute2 shows what was asked, deleting is by
// family, protocol and key.
func TestApplyAndListIPv6(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	routes6 := tunnelRoutes6(20, ns.veth)
	routes4 := tunnelRoutes(5, ns.veth)
	mustApply(t, c, replaceOps(append(slices.Clone(routes6), routes4...)))
	list6 := func() []Route {
		t.Helper()
		got, err := c.List(ListFilter{IPv6: true, Tables: testTables, Protocol: testProtocol})
		if err != nil {
			t.Fatalf("List IPv6: %v", err)
		}
		sortRoutes(got)
		return got
	}
	assertRoutes(t, list6(), routes6)
	assertRoutes(t, listTunnelRoutes(t, c), routes4)

	shown := normalizeSpaces(runIP(t, "-n", ns.name, "-6", "route", "show", "table", "all"))
	for _, r := range routes6[:10] {
		var line string
		if r.Type == Blackhole {
			line = fmt.Sprintf("blackhole %s dev lo table %d proto %d", r.Dst.Addr(), r.Table, r.Protocol)
		} else {
			line = fmt.Sprintf("%s encap ip6 id 0 src :: dst %s hoplimit 64 tc 0 dev veth0 table %d proto %d",
				r.Dst.Addr(), r.IPEncap.Dst, r.Table, r.Protocol)
		}
		if !strings.Contains(shown, line) {
			t.Fatalf("ip -6 route show lacks %q; it shows:\n%s", line, shown)
		}
	}

	// Replacing changes the encapsulation, or a blackhole into a route and
	// back; the listing shows it, and nothing else changed.
	routes6[0].IPEncap = &IPEncap{Dst: netip.MustParseAddr("fd00:244::99"), TTL: 64}
	routes6[1] = Route{Table: routes6[1].Table, Dst: routes6[1].Dst, Type: Blackhole, Protocol: testProtocol}
	routes6[4].Type, routes6[4].LinkIndex = Unicast, ns.veth
	routes6[4].IPEncap = &IPEncap{Dst: netip.MustParseAddr("fd00:244::98"), TTL: 64}
	mustApply(t, c, replaceOps(routes6[:5]))
	assertRoutes(t, list6(), routes6)

	// A delete of another protocol or of the other family's key leaves
	// the route; deleting by key and protocol removes it, twice is fine.
	other := routes6[2]
	other.Protocol++
	v4key := Route{Table: routes6[2].Table, Dst: netip.MustParsePrefix("10.96.0.1/32"), Protocol: testProtocol + 1}
	mustApply(t, c, []Op{{Kind: Delete, Route: other}, {Kind: Delete, Route: v4key}})
	assertRoutes(t, list6(), routes6)
	del := Route{Table: routes6[2].Table, Dst: routes6[2].Dst, Protocol: testProtocol}
	mustApply(t, c, []Op{{Kind: Delete, Route: del}, {Kind: Delete, Route: del}})
	assertRoutes(t, list6(), slices.Delete(slices.Clone(routes6), 2, 3))
	assertRoutes(t, listTunnelRoutes(t, c), routes4)
}

// TestNextHopObjectsIPv6: IPv6 routes through AF_INET6 nexthop objects with
// an IP6 encapsulation, listed back as written; the kernel refuses an IPv6
// route that names an IPv4 nexthop, which is why NextHop.IPv6 exists.
func TestNextHopObjectsIPv6(t *testing.T) {
	ns := newTestNS(t)
	c := ns.open(t)
	pod := func(i int) netip.Addr { return netip.AddrFrom16([16]byte{0xfd, 0x00, 0x02, 0x44, 15: byte(i)}) }
	var nexthops []NextHop
	var ops []Op
	for i := 1; i <= 4; i++ {
		n := NextHop{ID: uint32(i), Protocol: testProtocol, IPv6: true, LinkIndex: ns.veth, IPEncap: &IPEncap{Dst: pod(i), TTL: 64}}
		nexthops = append(nexthops, n)
		ops = append(ops, Op{Kind: AddNextHop, NextHop: n})
	}
	v4 := NextHop{ID: 5, Protocol: testProtocol, LinkIndex: ns.veth, IPEncap: &IPEncap{Dst: netip.MustParseAddr("10.244.0.5"), TTL: 64}}
	ops = append(ops, Op{Kind: AddNextHop, NextHop: v4})
	var routes []Route
	for table := testTables.First; table < testTables.First+8; table++ {
		for v := 1; v <= 10; v++ {
			r := Route{Table: table, Dst: netip.PrefixFrom(netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(v)}), 128),
				Type: Unicast, Protocol: testProtocol, NextHopID: uint32(1 + (v+int(table))%4)}
			routes = append(routes, r)
			ops = append(ops, Op{Kind: Replace, Route: r})
		}
	}
	mustApply(t, c, ops)
	listed, err := c.List(ListFilter{IPv6: true, Tables: testTables, Protocol: testProtocol})
	if err != nil {
		t.Fatal(err)
	}
	sortRoutes(listed)
	assertRoutes(t, listed, routes)
	assertNextHops(t, c, append(slices.Clone(nexthops), v4))
	shown := normalizeSpaces(runIP(t, "-n", ns.name, "nexthop", "show", "id", "1"))
	if want := "id 1 encap ip6 id 0 src :: dst fd00:244::1 hoplimit 64 tc 0 dev veth0 scope link proto 200"; !strings.Contains(shown, want) {
		t.Errorf("ip nexthop show: %q, want %q", shown, want)
	}

	bad := Route{Table: testTables.First, Dst: netip.MustParsePrefix("2001:db8::99/128"), Type: Unicast, Protocol: testProtocol, NextHopID: v4.ID}
	if err := c.Apply([]Op{{Kind: Replace, Route: bad}}); !errors.Is(err, unix.EINVAL) {
		t.Errorf("an IPv6 route through an IPv4 nexthop: %v, want EINVAL", err)
	}
	// Moving an endpoint is one nexthop replace; deleting one deletes its
	// routes.
	nexthops[0].IPEncap = &IPEncap{Dst: pod(99), TTL: 64}
	mustApply(t, c, []Op{{Kind: ReplaceNextHop, NextHop: nexthops[0]}, {Kind: DeleteNextHop, NextHop: NextHop{ID: 2}}})
	assertNextHops(t, c, []NextHop{nexthops[0], nexthops[2], nexthops[3], v4})
	listed, err = c.List(ListFilter{IPv6: true, Tables: testTables, Protocol: testProtocol})
	if err != nil {
		t.Fatal(err)
	}
	sortRoutes(listed)
	assertRoutes(t, listed, slices.DeleteFunc(routes, func(r Route) bool { return r.NextHopID == 2 }))
}
