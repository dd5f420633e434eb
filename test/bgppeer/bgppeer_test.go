package bgppeer

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Captured from bird 2.0.12 (Debian 12): "show route 192.0.2.20/32 all" on
// a peer with two eBGP neighbors announcing the prefix, greeting removed.
const twoRoutesOutput = `Table master4:
192.0.2.20/32        unicast [n2 21:53:04.737] * (100) [AS65001i]
	via 198.51.100.2 on br0
	Type: BGP univ
	BGP.origin: IGP
	BGP.as_path: 65001
	BGP.next_hop: 198.51.100.2
	BGP.local_pref: 100
                     unicast [n3 21:53:04.497] (100) [AS65001i]
	via 198.51.100.3 on br0
	Type: BGP univ
	BGP.origin: IGP
	BGP.as_path: 65001
	BGP.next_hop: 198.51.100.3
	BGP.local_pref: 100
`

// Captured from bird 2.0.12: an originated static blackhole (primary by
// its preference) and the same prefix from an iBGP neighbor (empty AS path;
// note the space after "BGP.as_path:").
const staticAndIBGPOutput = "Table master4:\n" +
	"192.0.2.30/32        blackhole [originated 21:55:13.675] * (200)\n" +
	"\tType: static univ\n" +
	"                     unicast [a 21:55:14.689] (100) [i]\n" +
	"\tvia 198.51.100.1 on vb\n" +
	"\tType: BGP univ\n" +
	"\tBGP.origin: IGP\n" +
	"\tBGP.as_path: \n" +
	"\tBGP.next_hop: 198.51.100.1\n" +
	"\tBGP.local_pref: 100\n"

// Captured from bird 2.0.12: "show route 2001:db8:5::68/128 all" on a peer
// with an IPv6 session (router_a6) and an IPv4 session carrying IPv6 too
// (router_a, "from" its IPv4 address) with the same GoBGP speaker.
const ipv6RoutesOutput = `Table master6:
2001:db8:5::68/128   unicast [router_a 10:58:11.065 from 198.51.100.2] * (100) [AS64512i]
	via 2001:db8:100::2 on br0
	Type: BGP univ
	BGP.origin: IGP
	BGP.as_path: 64512
	BGP.next_hop: 2001:db8:100::2
	BGP.local_pref: 100
                     unicast [router_a6 10:58:10.931] (100) [AS64512i]
	via 2001:db8:100::2 on br0
	Type: BGP univ
	BGP.origin: IGP
	BGP.as_path: 64512
	BGP.next_hop: 2001:db8:100::2
	BGP.local_pref: 100
`

func TestParseRoutes(t *testing.T) {
	a2, a3 := netip.MustParseAddr("198.51.100.2"), netip.MustParseAddr("198.51.100.3")
	for _, tc := range []struct {
		name string
		out  string
		want []Route
	}{
		{"two eBGP routes", twoRoutesOutput, []Route{
			{NextHop: a2, FromNeighbor: "n2", ASPath: "65001", Primary: true},
			{NextHop: a3, FromNeighbor: "n3", ASPath: "65001"},
		}},
		{"static and iBGP", staticAndIBGPOutput, []Route{
			{FromNeighbor: "originated", Primary: true},
			{NextHop: netip.MustParseAddr("198.51.100.1"), FromNeighbor: "a"},
		}},
		{"IPv6, over an IPv6 and an IPv4 session", ipv6RoutesOutput, []Route{
			{NextHop: netip.MustParseAddr("2001:db8:100::2"), FromNeighbor: "router_a", ASPath: "64512", Primary: true},
			{NextHop: netip.MustParseAddr("2001:db8:100::2"), FromNeighbor: "router_a6", ASPath: "64512"},
		}},
		{"network not found", "Network not found\n", []Route{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseRoutes(tc.out)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("parseRoutes:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
	if _, err := parseRoutes("syntax error, unexpected CF_SYM_UNDEFINED\n"); err == nil {
		t.Error("parseRoutes accepted an error reply")
	}
}

func fullConfig() Config {
	return Config{
		RouterID: netip.MustParseAddr("198.51.100.1"),
		ASN:      65000,
		Neighbors: []Neighbor{
			{Name: "direct_bfd", Address: netip.MustParseAddr("198.51.100.2"), ASN: 65001,
				Password: "s3cret", HoldTime: 9 * time.Second, KeepaliveTime: 3 * time.Second, BFD: true, Passive: true},
			{Name: "ibgp_multihop", Address: netip.MustParseAddr("198.51.100.3"), ASN: 65000, Multihop: 2,
				LocalAddress: netip.MustParseAddr("198.51.100.1"), CarryIPv6: true},
			{Name: "direct6", Address: netip.MustParseAddr("2001:db8:100::2"), ASN: 65001,
				LocalAddress: netip.MustParseAddr("2001:db8:100::1")},
		},
		ImportHostRoutesIn:  netip.MustParsePrefix("192.0.2.0/24"),
		ImportHostRoutesIn6: netip.MustParsePrefix("2001:db8:2::/64"),
		BFD:                 BFDIntervals{MinTx: 100 * time.Millisecond, MinRx: 100 * time.Millisecond, Multiplier: 3},
		Originate: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("192.0.2.10/32"),
			netip.MustParsePrefix("2001:db8:5::10/128")},
	}
}

func TestRenderConfigRejects(t *testing.T) {
	for name, mutate := range map[string]func(*Config){
		"no router id":          func(c *Config) { c.RouterID = netip.Addr{} },
		"no ASN":                func(c *Config) { c.ASN = 0 },
		"name with dash":        func(c *Config) { c.Neighbors[0].Name = "a-b" },
		"duplicate name":        func(c *Config) { c.Neighbors[1].Name = c.Neighbors[0].Name },
		"internal name":         func(c *Config) { c.Neighbors[0].Name = "kernel1" },
		"link-local neighbor":   func(c *Config) { c.Neighbors[0].Address = netip.MustParseAddr("fe80::1") },
		"IPv4-mapped":           func(c *Config) { c.Neighbors[0].Address = netip.MustParseAddr("::ffff:198.51.100.2") },
		"IPv4 local for IPv6":   func(c *Config) { c.Neighbors[2].LocalAddress = netip.MustParseAddr("198.51.100.1") },
		"CarryIPv6 on IPv6":     func(c *Config) { c.Neighbors[2].CarryIPv6 = true },
		"IPv6 host bits":        func(c *Config) { c.Originate[2] = netip.MustParsePrefix("2001:db8:5::10/64") },
		"quote in password":     func(c *Config) { c.Neighbors[0].Password = `a"b` },
		"fractional hold":       func(c *Config) { c.Neighbors[0].HoldTime = 1500 * time.Millisecond },
		"host bits":             func(c *Config) { c.Originate[0] = netip.MustParsePrefix("192.0.2.1/24") },
		"multihop too large":    func(c *Config) { c.Neighbors[1].Multihop = 256 },
		"negative multiplier":   func(c *Config) { c.BFD.Multiplier = -1 },
		"import host bits":      func(c *Config) { c.ImportHostRoutesIn = netip.MustParsePrefix("192.0.2.1/24") },
		"IPv6 import for IPv4":  func(c *Config) { c.ImportHostRoutesIn = netip.MustParsePrefix("2001:db8:2::/64") },
		"IPv4 import for IPv6":  func(c *Config) { c.ImportHostRoutesIn6 = netip.MustParsePrefix("192.0.2.0/24") },
		"IPv6 import host bits": func(c *Config) { c.ImportHostRoutesIn6 = netip.MustParsePrefix("2001:db8:2::1/64") },
		"IPv6 local address":    func(c *Config) { c.Neighbors[0].LocalAddress = netip.MustParseAddr("2001:db8::2") },
	} {
		cfg := fullConfig()
		cfg.Neighbors = slices.Clone(cfg.Neighbors)
		cfg.Originate = slices.Clone(cfg.Originate)
		mutate(&cfg)
		if conf, err := renderConfig(cfg, "/dev/null"); err == nil {
			t.Errorf("%s: renderConfig accepted it:\n%s", name, conf)
		}
	}
}

// TestRenderConfigParses has bird itself parse (bird -p) a configuration
// using every option; it needs bird but not root.
func TestRenderConfigParses(t *testing.T) {
	RequireBird(t)
	conf, err := renderConfig(fullConfig(), filepath.Join(t.TempDir(), "bird.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"merge paths on;", "password \"s3cret\";", "passive on;", "bfd on;", "multihop 2;",
		"hold time 9;", "keepalive time 3;", "route 192.0.2.10/32 blackhole;", "min tx interval 100000 us;", "multiplier 3;",
		"local 198.51.100.1 as 65000;", "import where net ~ [ 192.0.2.0/24{32,32} ];",
		"protocol kernel kernel6 {", "route 2001:db8:5::10/128 blackhole;", "neighbor 2001:db8:100::2 as 65001;",
		"\tipv6 { import where net ~ [ 2001:db8:2::/64{128,128} ]; export where source = RTS_STATIC; };"} {
		if !strings.Contains(conf, want) {
			t.Errorf("config lacks %q:\n%s", want, conf)
		}
	}
	file := filepath.Join(t.TempDir(), "bird.conf")
	if err := os.WriteFile(file, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("bird", "-p", "-c", file).CombinedOutput(); err != nil {
		t.Fatalf("bird -p: %v: %s\n%s", err, out, conf)
	}
	// The IPv4 multihop session carries IPv6 too; the IPv6 one IPv6 only.
	if i, j := strings.Index(conf, "protocol bgp ibgp_multihop"), strings.Index(conf, "protocol bgp direct6"); i < 0 || j < i ||
		!strings.Contains(conf[i:j], "ipv4 {") || !strings.Contains(conf[i:j], "ipv6 {") || strings.Contains(conf[j:], "ipv4 {") {
		t.Errorf("channels of the sessions:\n%s", conf)
	}
	// Without IPv6 sessions the configuration stays IPv4-only.
	v4 := fullConfig()
	v4.Neighbors = v4.Neighbors[:1]
	v4.Originate = v4.Originate[:2]
	if conf, err := renderConfig(v4, "/dev/null"); err != nil || strings.Contains(conf, "ipv6") {
		t.Errorf("IPv4-only configuration (%v) mentions IPv6:\n%s", err, conf)
	}
}

var (
	addrA  = netip.MustParseAddr("198.51.100.1")
	addrB  = netip.MustParseAddr("198.51.100.2")
	addrA1 = netip.MustParseAddr("198.51.100.2")
	addrA2 = netip.MustParseAddr("198.51.100.3")
)

// moveLink moves link name from one namespace to another, sets it up there
// and gives it addr (when valid).
func moveLink(t *testing.T, from, to *testnetns.NS, name string, addr netip.Prefix) {
	t.Helper()
	l, err := from.Netlink().LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := from.Netlink().LinkSetNsFd(l, int(to.Handle)); err != nil {
		t.Fatalf("move %s: %v", name, err)
	}
	nl := to.Netlink()
	if l, err = nl.LinkByName(name); err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	if addr.IsValid() {
		if err := nl.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(addr)}); err != nil {
			t.Fatalf("add %s to %s: %v", addr, name, err)
		}
	}
}

// TestOriginateAndWithdraw: two namespaces joined by a veth, each with its
// own bird. A originates a prefix; B (passive, MD5, BFD) learns it with A
// as next hop and installs it in its kernel, and loses it when A stops.
func TestOriginateAndWithdraw(t *testing.T) {
	testnetns.RequireRoot(t)
	RequireBird(t)
	nsA, nsB := testnetns.New(t), testnetns.New(t)
	nsA.AddVeth("veth_a", "veth_b", netip.PrefixFrom(addrA, 24))
	moveLink(t, nsA, nsB, "veth_b", netip.PrefixFrom(addrB, 24))
	prefix := netip.MustParsePrefix("192.0.2.10/32")
	bfd := BFDIntervals{MinTx: 100 * time.Millisecond, MinRx: 100 * time.Millisecond, Multiplier: 3}

	start := time.Now()
	peerA := Start(t, nsA, Config{RouterID: addrA, ASN: 65001, BFD: bfd, Originate: []netip.Prefix{prefix},
		Neighbors: []Neighbor{{Name: "b", Address: addrB, ASN: 65002, Password: "s3cret",
			HoldTime: 9 * time.Second, KeepaliveTime: 3 * time.Second, BFD: true}}})
	peerB := Start(t, nsB, Config{RouterID: addrB, ASN: 65002, BFD: bfd,
		Neighbors: []Neighbor{{Name: "a", Address: addrA, ASN: 65001, Password: "s3cret",
			HoldTime: 9 * time.Second, KeepaliveTime: 3 * time.Second, BFD: true, Passive: true}}})
	t.Logf("established after %v", peerB.WaitEstablished(t, "a", start, 20*time.Second))
	t.Logf("route at B after %v", peerB.WaitRoutes(t, prefix, 1, start, 10*time.Second))

	if up, state, err := peerB.Established("a"); err != nil || !up {
		t.Errorf("B's session to A: %v %q %v", up, state, err)
	}
	routes, err := peerB.Routes(prefix)
	if err != nil {
		t.Fatal(err)
	}
	want := []Route{{NextHop: addrA, FromNeighbor: "a", ASPath: "65001", Primary: true}}
	if !slices.Equal(routes, want) {
		t.Errorf("B's routes for %s = %+v, want %+v", prefix, routes, want)
	}
	peerB.WaitKernelNextHops(t, prefix, start, 5*time.Second, addrA)
	if hops, err := peerA.KernelNextHops(prefix); err != nil || len(hops) != 0 {
		t.Errorf("A's own kernel has next hops %v (%v) for the prefix it originates, want none", hops, err)
	}
	if out, err := peerB.Birdc("show", "bfd", "sessions"); err != nil || !strings.Contains(out, " Up ") {
		t.Errorf("B's BFD session to A is not up: %v\n%s", err, out)
	}
	if routes, err := peerB.Routes(netip.MustParsePrefix("192.0.2.11/32")); err != nil || len(routes) != 0 {
		t.Errorf("routes for an unknown prefix: %+v, %v", routes, err)
	}

	start = time.Now()
	peerA.Stop()
	t.Logf("withdrawn at B %v after A stopped", peerB.WaitRoutes(t, prefix, 0, start, 5*time.Second))
	t.Logf("gone from B's kernel after %v", peerB.WaitKernelNextHops(t, prefix, start, 5*time.Second))
	if up, state, err := peerB.Established("a"); err != nil || up {
		t.Errorf("B's session to stopped A: %v %q %v", up, state, err)
	}
}

// TestECMPFromTwoNeighbors: three namespaces on a bridge; A1 and A2 (the
// same AS) originate one prefix and B installs one kernel route with both as
// next hops. Only "merge paths on" in B's kernel protocol is needed: BIRD
// 2.0.12 merges its best BGP route with the others its BGP compares as
// equal (same local pref, AS path length, origin, MED), from separate
// sessions, without "add paths" (that is for several paths over one
// session); it even merges paths from two different neighbor ASes. When A2
// goes silent (its link down; killing its bird would not do, the kernel
// would close the TCP session at once), BFD (100 ms x 3) withdraws its path
// well within the 9 s hold time; the path is back soon after the link.
func TestECMPFromTwoNeighbors(t *testing.T) {
	testnetns.RequireRoot(t)
	RequireBird(t)
	nsB, nsA1, nsA2 := testnetns.New(t), testnetns.New(t), testnetns.New(t)
	nl := nsB.Netlink()
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := nl.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrAdd(br, &netlink.Addr{IPNet: testnetns.IPNet(netip.PrefixFrom(addrA, 24))}); err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	for _, a := range []struct {
		ns   *testnetns.NS
		port string
		addr netip.Addr
	}{{nsA1, "port_a1", addrA1}, {nsA2, "port_a2", addrA2}} {
		port := nsB.AddVeth(a.port, "eth_"+a.port, netip.Prefix{})
		l, err := nl.LinkByIndex(port)
		if err != nil {
			t.Fatal(err)
		}
		if err := nl.LinkSetMaster(l, br); err != nil {
			t.Fatal(err)
		}
		moveLink(t, nsB, a.ns, "eth_"+a.port, netip.PrefixFrom(a.addr, 24))
	}
	addrB := addrA // B owns the bridge address
	prefix := netip.MustParsePrefix("192.0.2.20/32")
	bfd := BFDIntervals{MinTx: 100 * time.Millisecond, MinRx: 100 * time.Millisecond, Multiplier: 3}
	hold := 9 * time.Second

	start := time.Now()
	peerB := Start(t, nsB, Config{RouterID: addrB, ASN: 65000, BFD: bfd, Neighbors: []Neighbor{
		{Name: "a1", Address: addrA1, ASN: 65001, HoldTime: hold, BFD: true},
		{Name: "a2", Address: addrA2, ASN: 65001, HoldTime: hold, BFD: true},
	}})
	for _, a := range []struct {
		ns   *testnetns.NS
		addr netip.Addr
	}{{nsA1, addrA1}, {nsA2, addrA2}} {
		Start(t, a.ns, Config{RouterID: a.addr, ASN: 65001, BFD: bfd, Originate: []netip.Prefix{prefix},
			Neighbors: []Neighbor{{Name: "b", Address: addrB, ASN: 65000, HoldTime: hold, BFD: true}}})
	}
	t.Logf("two routes at B after %v", peerB.WaitRoutes(t, prefix, 2, start, 20*time.Second))
	t.Logf("ECMP route in B's kernel after %v", peerB.WaitKernelNextHops(t, prefix, start, 5*time.Second, addrA2, addrA1))

	routes, err := peerB.Routes(prefix)
	if err != nil {
		t.Fatal(err)
	}
	var from []string
	primaries := 0
	for _, r := range routes {
		from = append(from, r.FromNeighbor+"="+r.NextHop.String())
		if r.Primary {
			primaries++
		}
	}
	slices.Sort(from)
	if want := []string{"a1=" + addrA1.String(), "a2=" + addrA2.String()}; !slices.Equal(from, want) || primaries != 1 {
		t.Errorf("B's routes = %+v, want from %v with one primary", routes, want)
	}

	nlA2 := nsA2.Netlink()
	eth, err := nlA2.LinkByName("eth_port_a2")
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := nlA2.LinkSetDown(eth); err != nil {
		t.Fatal(err)
	}
	took := peerB.WaitKernelNextHops(t, prefix, start, hold, addrA1)
	t.Logf("A2's path gone from B's kernel %v after A2 went silent", took)
	if took > 3*time.Second {
		t.Errorf("BFD took %v to drop the silent neighbor's path", took)
	}
	if up, state, err := peerB.Established("a2"); err != nil || up || !strings.Contains(state, "BFD") {
		t.Errorf("B's session to silent A2: %v %q %v, want down by BFD", up, state, err)
	}

	// A BFD failure is a BGP error: B keeps the session idle for its
	// error wait time, 1 s here (BIRD's default would be 60 s).
	start = time.Now()
	if err := nlA2.LinkSetUp(eth); err != nil {
		t.Fatal(err)
	}
	took = peerB.WaitKernelNextHops(t, prefix, start, 20*time.Second, addrA1, addrA2)
	t.Logf("ECMP back in B's kernel %v after A2's link came back", took)
}

// addAddr6 gives link an IPv6 address without duplicate address detection,
// so that it is usable at once.
func addAddr6(t *testing.T, ns *testnetns.NS, link string, addr netip.Prefix) {
	t.Helper()
	nl := ns.Netlink()
	l, err := nl.LinkByName(link)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(addr), Flags: unix.IFA_F_NODAD}); err != nil {
		t.Fatalf("add %s to %s: %v", addr, link, err)
	}
}

// TestOriginateAndWithdrawIPv6: as TestOriginateAndWithdraw, over an IPv6
// session: B learns A's IPv6 prefix with A's global address as BGP next
// hop and gateway of its kernel route, and loses it when A stops.
func TestOriginateAndWithdrawIPv6(t *testing.T) {
	testnetns.RequireRoot(t)
	RequireBird(t)
	addrA6, addrB6 := netip.MustParseAddr("2001:db8:100::1"), netip.MustParseAddr("2001:db8:100::2")
	nsA, nsB := testnetns.New(t), testnetns.New(t)
	nsA.AddVeth("veth_a", "veth_b", netip.PrefixFrom(addrA, 24))
	moveLink(t, nsA, nsB, "veth_b", netip.PrefixFrom(addrB, 24))
	addAddr6(t, nsA, "veth_a", netip.PrefixFrom(addrA6, 64))
	addAddr6(t, nsB, "veth_b", netip.PrefixFrom(addrB6, 64))
	prefix := netip.MustParsePrefix("2001:db8:5::10/128")

	start := time.Now()
	peerA := Start(t, nsA, Config{RouterID: addrA, ASN: 65001, Originate: []netip.Prefix{prefix},
		Neighbors: []Neighbor{{Name: "b6", Address: addrB6, ASN: 65002}}})
	peerB := Start(t, nsB, Config{RouterID: addrB, ASN: 65002,
		Neighbors: []Neighbor{{Name: "a6", Address: addrA6, ASN: 65001, Passive: true}}})
	t.Logf("established after %v", peerB.WaitEstablished(t, "a6", start, 20*time.Second))
	t.Logf("route at B after %v", peerB.WaitRoutes(t, prefix, 1, start, 10*time.Second))
	routes, err := peerB.Routes(prefix)
	if err != nil {
		t.Fatal(err)
	}
	want := []Route{{NextHop: addrA6, FromNeighbor: "a6", ASPath: "65001", Primary: true}}
	if !slices.Equal(routes, want) {
		t.Errorf("B's routes for %s = %+v, want %+v", prefix, routes, want)
	}
	peerB.WaitKernelNextHops(t, prefix, start, 5*time.Second, addrA6)

	start = time.Now()
	peerA.Stop()
	t.Logf("withdrawn at B %v after A stopped", peerB.WaitRoutes(t, prefix, 0, start, 5*time.Second))
	t.Logf("gone from B's kernel after %v", peerB.WaitKernelNextHops(t, prefix, start, 5*time.Second))
}
