package datapath

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// kernelRouter is a Datapath on the real kernel of a test namespace. The
// host has no GRE, so the flow-based device is stood in for by a veth: encap
// ip routes accept any device, and routing decisions are the same.
type kernelRouter struct {
	dp     *Datapath
	routes *seamtest.CountingRoutes
	rules  *seamtest.CountingRules
	ipt    *testnetns.IPTables
}

func (k *kernelRouter) writes() int { return k.routes.Writes + k.rules.Writes + k.ipt.Writes }

func newKernelRouter(t *testing.T, ns *testnetns.NS, cfg Config) *kernelRouter {
	t.Helper()
	rc := ns.Routes()
	nl := ns.Netlink()
	ipt := ns.IPTables("iptables")
	chain, err := hmark.NewChain(ipt, ns.IPSets(), cfg.Chain, cfg.HMARKParams(), ipt)
	if err != nil {
		t.Fatal(err)
	}
	k := &kernelRouter{routes: &seamtest.CountingRoutes{Client: rc}, rules: &seamtest.CountingRules{Handle: nl}, ipt: ipt}
	k.dp = NewDatapath(cfg, k.routes, k.rules, chain, &ExistingDevice{Name: "veth0", Links: nl}, nil, seamtest.QuietLog())
	return k
}

// kernelState is what an operator would look at: every route, nexthop
// object, rule, mangle rule and ipset (with its members) in the namespace.
// Comment lines of iptables-save (which carry a timestamp) are left out.
func kernelState(ns *testnetns.NS) string {
	var mangle []string
	for _, l := range strings.Split(ns.Run("iptables-save", "-t", "mangle"), "\n") {
		if !strings.HasPrefix(l, "#") {
			mangle = append(mangle, l)
		}
	}
	// IPv4 only: the router writes nothing else, and the veths' IPv6
	// link-local routes appear whenever the kernel gets to them (a busy
	// machine made this test fail when they came after the first look).
	return ns.Run("ip", "-4", "route", "show", "table", "all") + ns.Run("ip", "nexthop", "show") +
		ns.Run("ip", "-4", "rule", "show") + strings.Join(mangle, "\n") + "\n" + ns.IPSetState()
}

func TestDatapathInNetns(t *testing.T) {
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	cfg := testConfig()
	cfg.Buckets = 16

	// State that is not the router's: it must survive everything below.
	first, _ := cfg.NextHopIDs()
	ns.Run("ip", "route", "add", "198.51.100.0/24", "dev", "veth0", "table", fmt.Sprint(cfg.Table(0)), "proto", "static")
	// Nexthop objects of others: another protocol in the router's id
	// range (its id must be skipped), and the router's protocol outside it.
	ns.Run("ip", "nexthop", "add", "id", fmt.Sprint(first), "encap", "ip", "id", "0", "dst", "10.244.1.5", "ttl", "64", "dev", "veth0", "proto", "static")
	ns.Run("ip", "nexthop", "add", "id", "77", "encap", "ip", "id", "0", "dst", "10.244.1.5", "ttl", "64", "dev", "veth0", "proto", fmt.Sprint(cfg.RouteProtocol))
	ns.Run("ip", "route", "add", "192.0.2.1/32", "dev", "veth0", "table", "100", "proto", fmt.Sprint(cfg.RouteProtocol))
	ns.Run("ip", "rule", "add", "pref", fmt.Sprint(cfg.Priority(1)), "fwmark", "0x99", "lookup", "100")
	ns.Run("iptables", "-t", "mangle", "-A", "PREROUTING", "-d", "203.0.113.7/32", "-j", "MARK", "--set-mark", "7")
	pristine := kernelState(ns)

	withEndpoints := tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6", "10.244.3.7")
	withoutEndpoints := tunnel(cfg, "192.0.2.2")
	tunnels := []Tunnel{withEndpoints, withoutEndpoints}
	k := newKernelRouter(t, ns, cfg)
	if err := k.dp.Resync(tunnels); err != nil {
		t.Fatal(err)
	}
	programmed := kernelState(ns)
	if programmed == pristine || !strings.Contains(programmed, "encap ip") {
		t.Fatalf("Resync programmed nothing:\n%s", programmed)
	}
	// One nexthop object per endpoint, in the router's range; every
	// unicast route names one.
	ours := ns.Run("ip", "nexthop", "show", "proto", fmt.Sprint(cfg.RouteProtocol))
	if n := strings.Count(ours, "encap ip"); n != 3+1 || strings.Contains(ours, fmt.Sprintf("id %d ", first)) {
		t.Errorf("want 3 nexthop objects of the router's (and id 77), none with the taken id %d:\n%s", first, ours)
	}
	for _, l := range strings.Split(ns.Run("ip", "route", "show", "table", "all", "proto", fmt.Sprint(cfg.RouteProtocol)), "\n") {
		if strings.HasPrefix(l, "192.0.2.1 ") && !strings.Contains(l, "table 100 ") && !strings.Contains(l, "nhid ") {
			t.Errorf("route without a nexthop object: %s", l)
		}
	}
	t.Logf("bucket 0 of 192.0.2.1: %s", ns.Run("ip", "route", "get", "192.0.2.1", "mark", fmt.Sprintf("%#x", cfg.Mark(0))))

	t.Run("kernel routes each bucket's mark to its endpoint", func(t *testing.T) {
		for b := 0; b < cfg.Buckets; b++ {
			mark := fmt.Sprintf("%#x", cfg.Mark(b))
			got := ns.Run("ip", "route", "get", "192.0.2.1", "mark", mark)
			want := "dst " + withEndpoints.Table[b].Addr.String() + " "
			if !strings.Contains(got, "encap ip id 0") || !strings.Contains(got, want) {
				t.Errorf("bucket %d (mark %s): ip route get says %q, want encap to %s", b, mark, got, withEndpoints.Table[b].Addr)
			}
			if out, err := ns.Output("ip", "route", "get", "192.0.2.2", "mark", mark); err == nil || !strings.Contains(out, "Invalid argument") && !strings.Contains(out, "No route") {
				// A blackhole route answers EINVAL to route get.
				t.Errorf("bucket %d: tunnel IP without endpoints is routed: %q, %v", b, out, err)
			}
		}
		// Both tunnel IPs are hashed: in the set of all and in generation
		// 0's, which the one HMARK rule matches.
		if hm := ns.Run("iptables", "-t", "mangle", "-S", cfg.Chain); strings.Count(hm, "-j HMARK") != 1 || !strings.Contains(hm, "--match-set "+cfg.Chain+"-0 dst") {
			t.Errorf("want 1 HMARK rule for generation 0, got:\n%s", hm)
		}
		for _, set := range []string{cfg.Chain, cfg.Chain + "-0"} {
			if got, err := ipsetstate.Members(ns.IPSets(), set); err != nil || len(got) != 2 {
				t.Errorf("set %s holds %v (%v), want both tunnel IPs", set, got, err)
			}
		}
	})

	t.Run("unmarked packets skip the slot rules", func(t *testing.T) {
		guard, target := cfg.GuardRules()
		rules := ns.Run("ip", "rule", "show")
		want := fmt.Sprintf("%d:\tnot from all fwmark %#x/%#x goto %d proto %d", guard.Priority, guard.Mark, *guard.Mask, target.Priority, cfg.RouteProtocol)
		if !strings.Contains(rules, want) || strings.Contains(rules, "unresolved") || !strings.Contains(rules, fmt.Sprintf("%d:\tfrom all nop", target.Priority)) {
			t.Errorf("want the guard %q, resolved, and its nop target:\n%s", want, rules)
		}
		// A packet marked by someone else (kube-proxy's 0x4000) or not at
		// all is routed by the main table, which has no route to the
		// tunnel IP here.
		for _, mark := range []string{"0", "0x4000"} {
			if out, err := ns.Output("ip", "route", "get", "192.0.2.1", "mark", mark); err == nil && strings.Contains(out, "table 76") {
				t.Errorf("mark %s: routed by a bucket table: %s", mark, out)
			}
		}
	})

	t.Run("a restarted router changes nothing", func(t *testing.T) {
		again := newKernelRouter(t, ns, cfg)
		if err := again.dp.Resync(tunnels); err != nil {
			t.Fatal(err)
		}
		if w := again.writes(); w != 0 {
			t.Errorf("restart made %d kernel writes, want 0", w)
		}
		if got := kernelState(ns); got != programmed {
			t.Errorf("restart changed the kernel state:\nbefore:\n%s\nafter:\n%s", programmed, got)
		}
	})

	t.Run("resync repairs drift", func(t *testing.T) {
		ns.Run("ip", "route", "del", "192.0.2.1/32", "table", fmt.Sprint(cfg.Table(3)))
		ns.Run("ip", "route", "replace", "192.0.2.1/32", "encap", "ip", "id", "0", "dst", "10.9.9.9", "dev", "veth0", "table", fmt.Sprint(cfg.Table(4)), "proto", fmt.Sprint(cfg.RouteProtocol))
		ns.Run("ip", "route", "add", "blackhole", "192.0.2.77/32", "table", fmt.Sprint(cfg.Table(5)), "proto", fmt.Sprint(cfg.RouteProtocol))
		ns.Run("ip", "rule", "del", "pref", fmt.Sprint(cfg.Priority(6)))
		ns.Run("iptables", "-t", "mangle", "-F", cfg.Chain)
		if err := k.dp.Resync(tunnels); err != nil {
			t.Fatal(err)
		}
		if got := kernelState(ns); got != programmed {
			t.Errorf("drift not repaired:\nwant:\n%s\ngot:\n%s", programmed, got)
		}
	})

	t.Run("resync repairs nexthop objects changed behind its back", func(t *testing.T) {
		ids := routerNextHopIDs(ns, cfg)
		// Deleting one deletes the routes that use it; another points
		// elsewhere; a stray one of the router's has no route.
		ns.Run("ip", "nexthop", "del", "id", fmt.Sprint(ids[0]))
		ns.Run("ip", "nexthop", "replace", "id", fmt.Sprint(ids[1]), "encap", "ip", "id", "0", "dst", "10.9.9.9", "ttl", "64", "dev", "veth0", "proto", fmt.Sprint(cfg.RouteProtocol))
		ns.Run("ip", "nexthop", "add", "id", fmt.Sprint(ids[2]+100), "encap", "ip", "id", "0", "dst", "10.9.9.8", "ttl", "64", "dev", "veth0", "proto", fmt.Sprint(cfg.RouteProtocol))
		if err := k.dp.Resync(tunnels); err != nil {
			t.Fatal(err)
		}
		// The ids may differ (new objects for the endpoints of the deleted
		// and the changed one); what the kernel does may not.
		if got, want := withoutNextHopIDs(kernelState(ns)), withoutNextHopIDs(programmed); got != want {
			t.Errorf("drift not repaired:\nwant:\n%s\ngot:\n%s", want, got)
		}
		again := newKernelRouter(t, ns, cfg)
		if err := again.dp.Resync(tunnels); err != nil {
			t.Fatal(err)
		}
		if w := again.writes(); w != 0 {
			t.Errorf("a restart after the repair made %d kernel writes, want 0", w)
		}
		programmed = kernelState(ns)
	})

	t.Run("removing a tunnel removes all it had", func(t *testing.T) {
		if err := k.dp.RemoveTunnel(withoutEndpoints.VIP); err != nil {
			t.Fatal(err)
		}
		if got := ns.Run("ip", "route", "show", "table", "all"); strings.Contains(got, "192.0.2.2") {
			t.Errorf("routes of the removed tunnel remain:\n%s", got)
		}
		if sets := ns.IPSetState(); strings.Contains(sets, "192.0.2.2") {
			t.Errorf("the removed tunnel remains in a set:\n%s", sets)
		}
	})

	t.Run("cleanup restores the kernel as it was", func(t *testing.T) {
		if err := newKernelRouter(t, ns, cfg).dp.Cleanup(); err != nil {
			t.Fatal(err)
		}
		if got := kernelState(ns); got != pristine {
			t.Errorf("after cleanup:\n%s\nwant the state before the router ran:\n%s", got, pristine)
		}
	})
}

// routerNextHopIDs lists the ids of the router's nexthop objects, in order.
func routerNextHopIDs(ns *testnetns.NS, cfg Config) []uint32 {
	first, last := cfg.NextHopIDs()
	var ids []uint32
	for _, l := range strings.Split(ns.Run("ip", "nexthop", "show", "proto", fmt.Sprint(cfg.RouteProtocol)), "\n") {
		var id uint32
		if _, err := fmt.Sscanf(l, "id %d ", &id); err == nil && id >= first && id <= last {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// withoutNextHopIDs replaces every nexthop id in ip's output by "N", and
// sorts the lines: which ids the router allocated after a repair is its own
// business.
func withoutNextHopIDs(s string) string {
	lines := strings.Split(nextHopIDPattern.ReplaceAllString(s, "${1} N"), "\n")
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

var nextHopIDPattern = regexp.MustCompile(`\b(nhid|id) \d{5,}`)

func TestDatapathShrinkingBucketsRemovesOldTables(t *testing.T) {
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	// Stateless: with several generations, the old tables would stay as
	// older generations until conntrack shows no flow uses their marks.
	big := testConfig()
	big.Buckets = 16
	big.Generations = 1
	if err := newKernelRouter(t, ns, big).dp.Resync([]Tunnel{tunnel(big, "192.0.2.1", "10.244.1.5", "10.244.2.6")}); err != nil {
		t.Fatal(err)
	}
	small := big
	small.Buckets = 4
	if err := newKernelRouter(t, ns, small).dp.Resync([]Tunnel{tunnel(small, "192.0.2.1", "10.244.1.5", "10.244.2.6")}); err != nil {
		t.Fatal(err)
	}
	routes := ns.Run("ip", "route", "show", "table", "all", "proto", fmt.Sprint(big.RouteProtocol))
	if n := strings.Count(routes, "192.0.2.1"); n != 4 {
		t.Errorf("%d routes after shrinking to 4 buckets, want 4:\n%s", n, routes)
	}
	// 4 slots' tree (4 lookups, 3 tests), the guard (now to the target
	// after them) and its target.
	rules := ns.Run("ip", "rule", "show")
	if strings.Count(rules, "proto 245") != 7+2 || strings.Count(rules, " lookup 76") != 4 || !strings.Contains(rules, "goto 7607") || !strings.Contains(rules, "7607:\tfrom all nop") {
		t.Errorf("want 4 slots' rules, the guard and its target after shrinking:\n%s", rules)
	}
}

// TestDatapathEverySlotIsAdopted programs 512 buckets x 4 generations, 2,048
// slots, all in use, and checks that every slot's route is read back: a
// restarted router writes nothing, and cleanup leaves nothing. (Routes in
// slots from 1,024 on were once written but never recognised.)
func TestDatapathEverySlotIsAdopted(t *testing.T) {
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	cfg := testConfig()
	cfg.Buckets, cfg.Generations = 512, 4
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	pristine := kernelState(ns)
	k := newKernelRouter(t, ns, cfg)
	if err := k.dp.Resync(nil); err != nil {
		t.Fatal(err)
	}
	// Each added endpoint takes buckets from live ones: a new generation.
	pods := []string{"10.244.1.1", "10.244.1.2", "10.244.1.3", "10.244.1.4"}
	var last Tunnel
	for n := 1; n <= len(pods); n++ {
		last = tunnel(cfg, "192.0.2.1", pods[:n]...)
		if err := k.dp.SetTunnel(last); err != nil {
			t.Fatal(err)
		}
	}
	routes := ns.Run("ip", "-4", "route", "show", "table", "all", "proto", fmt.Sprint(cfg.RouteProtocol))
	if n := strings.Count(routes, "192.0.2.1 nhid"); n != cfg.Slots() {
		t.Fatalf("%d routes, want one in each of the %d slots", n, cfg.Slots())
	}
	if !strings.Contains(routes, fmt.Sprintf("table %d ", cfg.Table(cfg.Slots()-1))) {
		t.Fatalf("no route in the last slot's table %d", cfg.Table(cfg.Slots()-1))
	}
	programmed := kernelState(ns)

	again := newKernelRouter(t, ns, cfg)
	if err := again.dp.Resync([]Tunnel{last}); err != nil {
		t.Fatal(err)
	}
	if w := again.writes(); w != 0 {
		t.Errorf("restart made %d kernel writes, want 0", w)
	}
	if got := kernelState(ns); got != programmed {
		t.Errorf("restart changed the kernel state")
	}
	// Without endpoints every slot in use becomes a blackhole route, which
	// uses no nexthop object: cleanup must find each of them by its table.
	empty := tunnel(cfg, "192.0.2.1")
	if err := again.dp.SetTunnel(empty); err != nil {
		t.Fatal(err)
	}
	routes = ns.Run("ip", "-4", "route", "show", "table", "all", "proto", fmt.Sprint(cfg.RouteProtocol))
	if n := strings.Count(routes, "blackhole 192.0.2.1"); n != cfg.Slots() {
		t.Fatalf("%d blackhole routes, want one in each of the %d slots", n, cfg.Slots())
	}
	if w := newKernelRouter(t, ns, cfg); w.dp.Resync([]Tunnel{empty}) != nil || w.writes() != 0 {
		t.Errorf("restart with blackholes made %d kernel writes, want 0", w.writes())
	}
	if err := newKernelRouter(t, ns, cfg).dp.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := kernelState(ns); got != pristine {
		t.Errorf("after cleanup:\n%s\nwant the state before the router ran:\n%s", got, pristine)
	}
}

// TestDatapathRandomChangesNeverFail makes random changes (endpoints added,
// removed, drained; tunnels removed and added back) on the real kernel,
// with several generations, in each family: no write may fail (a route
// naming a missing nexthop object, an object created twice, one deleted
// under a route), and the end state is a fresh router's, without a stray
// nexthop object.
func TestDatapathRandomChangesNeverFail(t *testing.T) {
	t.Run("IPv4", func(t *testing.T) {
		ns := testnetns.New(t)
		ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
		cfg := testConfig()
		cfg.Generations = 3
		randomChanges(t, ns, cfg, "10.244.%d.%d", []string{"192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"},
			func() (*Datapath, func() int) { k := newKernelRouter(t, ns, cfg); return k.dp, k.writes })
	})
	t.Run("IPv6", func(t *testing.T) {
		ns := testnetns.New(t)
		ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
		cfg := testConfig().ForFamily(IPv6)
		cfg.Generations = 3
		marks := seamtest.NewKernel()
		randomChanges(t, ns, cfg, "fd00:244:%d::%x", []string{"2001:db8::1", "2001:db8::2", "2001:db8::3", "2001:db8::4"},
			func() (*Datapath, func() int) { r := newFamilyRouter(ns, cfg, marks); return r.dp, r.writes })
	})
}

// randomChanges runs TestDatapathRandomChangesNeverFail on the routers
// open returns (with the count of their kernel writes), over tunnel IPs
// vips and 12 pods named by podFormat (from a subnet and a host number).
func randomChanges(t *testing.T, ns *testnetns.NS, cfg Config, podFormat string, vips []string, open func() (*Datapath, func() int)) {
	dp, _ := open()
	if err := dp.Resync(nil); err != nil {
		t.Fatal(err)
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	pods := make([]string, 12)
	for i := range pods {
		pods[i] = fmt.Sprintf(podFormat, i%3, 10+i)
	}
	state := map[string]Tunnel{}
	for step := range 150 {
		vip := vips[rnd.IntN(len(vips))]
		if rnd.IntN(8) == 0 {
			if err := dp.RemoveTunnel(netip.MustParseAddr(vip)); err != nil {
				t.Fatalf("step %d: remove %s: %v", step, vip, err)
			}
			delete(state, vip)
			continue
		}
		var ready, draining []string
		for _, p := range pods {
			switch rnd.IntN(4) {
			case 0:
				ready = append(ready, p)
			case 1:
				draining = append(draining, p)
			}
		}
		tun := drainTunnel(cfg, vip, append(ready, draining...), draining...)
		if err := dp.SetTunnel(tun); err != nil {
			t.Fatalf("step %d: set %s: %v", step, vip, err)
		}
		state[vip] = tun
	}
	var final []Tunnel
	for _, tun := range state {
		final = append(final, tun)
	}
	if err := dp.Resync(final); err != nil {
		t.Fatal(err)
	}
	if again, writes := open(); again.Resync(final) != nil || writes() != 0 {
		t.Errorf("a restart after the random changes made %d writes, want 0", writes())
	}
	// Every nexthop object of the router's is used by a route.
	family := "-4"
	if cfg.Family == IPv6 {
		family = "-6"
	}
	used := map[string]bool{}
	for _, l := range strings.Split(ns.Run("ip", family, "route", "show", "table", "all", "proto", fmt.Sprint(cfg.RouteProtocol)), "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[1] == "nhid" {
			used[f[2]] = true
		}
	}
	ids := routerNextHopIDs(ns, cfg)
	for _, id := range ids {
		if !used[fmt.Sprint(id)] {
			t.Errorf("nexthop object %d is used by no route", id)
		}
	}
	if len(ids) == 0 {
		t.Error("no nexthop objects")
	}
	t.Logf("%d nexthop objects, %d writes", len(ids), dp.Ops())
}
