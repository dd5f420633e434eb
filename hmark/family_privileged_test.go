package hmark

// Privileged tests of the address families: real packets marked by the
// rules a Chain of each family wrote, and the IPv4 and IPv6 chains of one
// dual-stack router side by side in one namespace.

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

const (
	chainMarkUDPFlows     = 300
	chainMarkDstOptsFlows = 60
	chainMarkTCPFlows     = 60
	chainMarkRawFlows     = 30
)

// TestChainMarksMatchGo sends real flows of each family (UDP, for IPv6
// also behind a destination options header, TCP, and ICMP or ICMPv6 and
// ESP from raw sockets) to tunnel IPs in two generations, one of them
// with client affinity, through the rules Chain synced, and checks that
// every packet has the mark Params.Mark predicts at its tunnel IP's
// generation offset (of ClientFlow for affinity). Then every tunnel IP
// changes class (Update) and the flows are checked again.
func TestChainMarksMatchGo(t *testing.T) { forEachBackend(t, testChainMarksMatchGo) }

func testChainMarksMatchGo(t *testing.T, nf netnsFamily, binary string) {
	ns := nf.newNS(t)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	rng := rand.New(rand.NewPCG(20261201, uint64(nf.family)))
	rawProtos := []uint8{protoICMP, protoESP}
	if nf.family == IPv6 {
		rawProtos = []uint8{protoICMPv6, protoESP}
	}
	v := nf.vips
	// 64 buckets (generations far apart), and 2^31-1, whose marks show
	// almost the whole hash, so that hashing a port or the protocol where
	// the prediction does not (client affinity) cannot go unnoticed.
	for _, params := range kernelParamSets[:2] {
		chain := nf.newChain(t, ns, ipt, restorer, params)
		gen1 := params.Offset + params.Buckets
		for _, targets := range [][]Target{
			{{VIP: v[0]}, {VIP: v[1], Offset: gen1}, {VIP: v[2], ClientAffinity: true}},
			{{VIP: v[0], Offset: gen1, ClientAffinity: true}, {VIP: v[1]}, {VIP: v[2], Offset: gen1}},
		} {
			if _, err := chain.Update(targets); err != nil {
				t.Fatalf("%v: Update(%v): %v", params, targets, err)
			}
			all, err := sendMixedFlows(ns, nf.flows, rng, chainMarkUDPFlows, chainMarkTCPFlows, rawProtos, chainMarkRawFlows)
			if err != nil {
				t.Fatalf("%v: send flows: %v", params, err)
			}
			want := chainMarkUDPFlows + chainMarkTCPFlows + len(rawProtos)*chainMarkRawFlows
			if nf.family == IPv6 {
				err := ns.Do(func() error {
					obs, err := sendUDPFlows(nf.flows, rng, chainMarkDstOptsFlows, true)
					all = append(all, obs...)
					return err
				})
				if err != nil {
					t.Fatalf("%v: send UDP flows behind destination options: %v", params, err)
				}
				want += chainMarkDstOptsFlows
			}
			if len(all) != want {
				t.Fatalf("%v: observed %d flows, want %d", params, len(all), want)
			}
			checkChainMarks(t, params, targets, all)
		}
	}
}

// checkChainMarks checks every observed mark against the prediction for
// its tunnel IP's target, and that every target got flows.
func checkChainMarks(t *testing.T, params Params, targets []Target, all []observation) {
	t.Helper()
	byVIP := make(map[netip.Addr]Target, len(targets))
	for _, tg := range targets {
		if tg.Offset == 0 {
			tg.Offset = params.Offset
		}
		byVIP[tg.VIP] = tg
	}
	seen := make(map[netip.Addr]int)
	mismatches := 0
	for _, o := range all {
		tg, ok := byVIP[o.flow.Dst]
		if !ok {
			t.Fatalf("flow %+v to no tunnel IP of %v", o.flow, targets)
		}
		seen[tg.VIP]++
		p, flow := params, o.flow
		p.Offset = tg.Offset
		if tg.ClientAffinity {
			flow = ClientFlow(flow)
		}
		if want := p.Mark(flow); o.mark != want {
			mismatches++
			if mismatches <= 10 {
				t.Errorf("%v, target %+v: flow %+v: kernel mark %#x, Go predicts %#x", params, tg, o.flow, o.mark, want)
			}
		}
	}
	if mismatches > 0 {
		t.Fatalf("%v: %d of %d flows marked differently from the Go prediction for targets %v", params, mismatches, len(all), targets)
	}
	for _, tg := range targets {
		if seen[tg.VIP] == 0 {
			t.Errorf("%v: no flow to %s: its target %+v is untested", params, tg.VIP, tg)
		}
	}
	t.Logf("%v: targets %v: %d flows (%v by tunnel IP), kernel mark == Params.Mark at each target's offset for all", params, targets, len(all), seen)
}

// dualStackBackends pairs the iptables and ip6tables of one backend, as a
// dual-stack router runs them.
var dualStackBackends = [][2]string{{"iptables", "ip6tables"}, {"iptables-legacy", "ip6tables-legacy"}}

// TestDualStackChainsInNetns runs the sticky IPv4 and IPv6 chains of one
// router (KST-HMARK and KST-HMARK6) in one namespace, with each backend:
// each syncs and re-syncs without touching the other's rules or sets,
// counts only its own family's packets, adopts only its own tunnel IPs;
// an IPv6 chain given the IPv4 chain's name refuses the IPv4 sets and
// writes nothing; and the Cleanup of either leaves the other whole and
// working, in both orders.
func TestDualStackChainsInNetns(t *testing.T) {
	for _, pair := range dualStackBackends {
		for _, first := range []Family{IPv4, IPv6} {
			t.Run(fmt.Sprintf("%s+%s/cleanup-%s-first", pair[0], pair[1], first), func(t *testing.T) {
				testDualStackChainsInNetns(t, pair, first)
			})
		}
	}
}

// dualStackSide is one family's chain in the dual-stack test.
type dualStackSide struct {
	nf       netnsFamily
	binary   string
	ipt      *testnetns.IPTables
	restorer *nsRestorer
	targets  []Target
	chain    *Chain
}

func testDualStackChainsInNetns(t *testing.T, binaries [2]string, first Family) {
	ns := testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
	setUpIPv6Lab(t, ns)
	sides := make(map[Family]*dualStackSide)
	for i, nf := range []netnsFamily{netnsIPv4, netnsIPv6} {
		s := &dualStackSide{nf: nf, binary: binaries[i], ipt: ns.IPTables(binaries[i])}
		s.restorer = newNSRestorer(ns, s.binary)
		s.targets = []Target{{VIP: nf.vips[0]}, {VIP: nf.vips[1], Offset: gen1}, {VIP: nf.vips[2], ClientAffinity: true}}
		sides[nf.family] = s
	}
	// tables is what one family's iptables holds, as an operator lists it.
	tables := func(s *dualStackSide) string {
		return ns.Run(s.binary, "-t", "mangle", "-S") + ns.Run(s.binary, "-t", "raw", "-S")
	}
	// setLines is the set listing's lines of the sets named chain or
	// chain-* (each set's line with its family, then its members).
	setLines := func(chain string) []string {
		var out []string
		for _, l := range strings.Split(ns.IPSetState(), "\n") {
			f := strings.Fields(l)
			if len(f) >= 2 && (f[1] == chain || strings.HasPrefix(f[1], chain+"-")) {
				out = append(out, l)
			}
		}
		return out
	}
	setsOf := func(chain string) string { return strings.Join(setLines(chain), "\n") }
	newChain := func(s *dualStackSide, name string) *Chain {
		t.Helper()
		c, err := NewChainFamily(s.nf.family, s.ipt, ns.IPSets(), name, stickyParams, s.restorer)
		if err != nil {
			t.Fatalf("NewChainFamily(%s): %v", s.nf.family, err)
		}
		if err := c.SetSticky(&testSticky); err != nil {
			t.Fatalf("SetSticky: %v", err)
		}
		return c
	}
	empty := map[Family]string{IPv4: tables(sides[IPv4]), IPv6: tables(sides[IPv6])}
	if got := ns.IPSetState(); got != "" {
		t.Fatalf("a fresh namespace has sets:\n%s", got)
	}

	for _, fam := range []Family{IPv4, IPv6} {
		s := sides[fam]
		s.chain = newChain(s, "")
		if changed, err := s.chain.Sync(s.targets); err != nil || changed == 0 {
			t.Fatalf("%s: first Sync = %d, %v; want changes", fam, changed, err)
		}
	}
	if n4, n6 := sides[IPv4].chain.Name(), sides[IPv6].chain.Name(); n4 != DefaultChainName || n6 != DefaultChainName6 {
		t.Fatalf("default chain names %q and %q, want %q and %q", n4, n6, DefaultChainName, DefaultChainName6)
	}
	synced := map[Family]string{IPv4: tables(sides[IPv4]), IPv6: tables(sides[IPv6])}
	syncedSets := map[Family]string{IPv4: setsOf(DefaultChainName), IPv6: setsOf(DefaultChainName6)}
	for fam, s := range sides {
		lines := setLines(s.chain.Name())
		wantAF := fmt.Sprintf(" family %d ", fam.setFamily())
		sets := slices.DeleteFunc(slices.Clone(lines), func(l string) bool { return !strings.HasPrefix(l, "set ") })
		if len(sets) != 8 || slices.ContainsFunc(sets, func(l string) bool { return !strings.Contains(l, wantAF) }) {
			t.Errorf("%s sets:\n%s\nwant 8 sets (all, generations 0 and 1, affinity 0, the SYN sets of both generations and tuples), each of%s", fam, strings.Join(lines, "\n"), wantAF)
		}
	}
	// unchanged checks that each family's rules and sets are as synced,
	// but for the families in gone, which must have left nothing.
	unchanged := func(step string, gone ...Family) {
		t.Helper()
		for fam, s := range sides {
			wantTables, wantSets := synced[fam], syncedSets[fam]
			if slices.Contains(gone, fam) {
				wantTables, wantSets = empty[fam], ""
			}
			if got := tables(s); got != wantTables {
				t.Errorf("%s: %s holds\n%s\nwant\n%s", step, s.binary, got, wantTables)
			}
			if got := setsOf(s.chain.Name()); got != wantSets {
				t.Errorf("%s: %s sets\n%s\nwant\n%s", step, fam, got, wantSets)
			}
		}
		all := ns.IPSetState()
		if n := len(setLines(DefaultChainName)) + len(setLines(DefaultChainName6)); all != "" && n != strings.Count(all, "\n")+1 {
			t.Errorf("%s: the namespace has sets of neither chain:\n%s", step, all)
		}
	}

	// Each re-syncs, through a new Chain too, with nothing to write, and
	// adopts only its own tunnel IPs.
	for fam, s := range sides {
		for _, c := range []*Chain{s.chain, newChain(s, "")} {
			s.ipt.Writes, s.restorer.Calls = 0, 0
			if changed, err := c.Sync(s.targets); err != nil || changed != 0 || s.ipt.Writes+s.restorer.Calls != 0 {
				t.Errorf("%s: re-Sync = %d, %v with %d writes; want nothing to change", fam, changed, err, s.ipt.Writes+s.restorer.Calls)
			}
		}
		offsets, err := newChain(s, "").Offsets()
		if err != nil || len(offsets) != len(s.targets) || offsets[s.nf.vips[1]] != gen1 {
			t.Errorf("%s: Offsets = %v, %v; want the %d tunnel IPs of %s, %s at %#x", fam, offsets, err, len(s.targets), fam, s.nf.vips[1], gen1)
		}
	}
	unchanged("re-sync")

	// Datagrams to a tunnel IP of each family (2 IPv4, 3 IPv6) count in
	// its chain's set alone.
	sent := map[Family]int{IPv4: 2, IPv6: 3}
	for _, s := range sides {
		sendDatagrams(t, ns, s.nf.loopback, s.nf.vips[0], sent[s.nf.family])
	}
	for fam, s := range sides {
		n := uint64(sent[fam])
		want := Counter{Packets: n, Bytes: n * (s.nf.headers + 8)}
		counters, err := s.chain.Counters()
		if err != nil || len(counters) != len(s.targets) || counters[s.nf.vips[0]] != want {
			t.Errorf("%s: Counters = %v, %v; want %s: %+v and the other tunnel IPs of %s at 0", fam, counters, err, s.nf.vips[0], want, fam)
		}
	}

	// The IPv6 chain under the IPv4 chain's name finds the IPv4 sets, and
	// refuses them without a write.
	clash := newChain(sides[IPv6], DefaultChainName)
	sides[IPv6].ipt.Writes, sides[IPv6].restorer.Calls = 0, 0
	_, err := clash.Sync(sides[IPv6].targets)
	if err == nil || !strings.Contains(err.Error(), "family inet,") || !strings.Contains(err.Error(), "(inet6,") {
		t.Errorf("IPv6 chain named %s: Sync = %v; want an error naming the inet set it found and the inet6 it needs", DefaultChainName, err)
	}
	if w := sides[IPv6].ipt.Writes + sides[IPv6].restorer.Calls; w != 0 {
		t.Errorf("IPv6 chain named %s: %d writes, want none", DefaultChainName, w)
	}
	unchanged("IPv6 chain under the IPv4 chain's name")

	// Cleanup of the first family leaves the other's whole and working;
	// then the other's leaves nothing.
	second := IPv4
	if first == IPv4 {
		second = IPv6
	}
	if err := sides[first].chain.Cleanup(); err != nil {
		t.Fatalf("%s: Cleanup: %v", first, err)
	}
	unchanged("Cleanup of "+first.String(), first)
	s := sides[second]
	if changed, err := newChain(s, "").Sync(s.targets); err != nil || changed != 0 {
		t.Errorf("%s: Sync after the %s Cleanup = %d, %v; want nothing to change", second, first, changed, err)
	}
	if err := s.chain.Cleanup(); err != nil {
		t.Fatalf("%s: Cleanup: %v", second, err)
	}
	unchanged("Cleanup of both", first, second)
}
