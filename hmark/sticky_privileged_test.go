package hmark

// Privileged tests of sticky mode: the rules as the real iptables prints
// them (adoption without writes), and stickiness itself on the real
// kernel, with the router seeing only the client's half of each flow.

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestStickySyncInNetns drives a sticky Chain against the real iptables
// and ip6tables of each backend: creation of both chains, adoption by a
// new Chain without any write (which proves that Chain writes its rules
// exactly as iptables prints them), Offsets, moving one tunnel IP to
// another generation, leaving and re-entering sticky mode, and Cleanup.
func TestStickySyncInNetns(t *testing.T) { forEachBackend(t, testStickySyncInNetns) }

func testStickySyncInNetns(t *testing.T, nf netnsFamily, binary string) {
	ns := nf.newNS(t)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	tableS := func(table string) string { return ns.Run(binary, "-t", table, "-S") }
	ns.Run(binary, "-t", "raw", "-A", "PREROUTING", "-p", "udp", "--dport", "53", "-j", "CT", "--notrack")
	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-j", "MARK", "--set-mark", "9")
	beforeMangle, beforeRaw := tableS("mangle"), tableS("raw")
	addForeignSet(t, ns, nf.family, "OPERATOR", nf.vips[0])
	setsBefore := ns.IPSetState()
	name := nf.newChain(t, ns, ipt, restorer, stickyParams).Name()

	newChain := func(sticky bool) *Chain {
		t.Helper()
		c := nf.newChain(t, ns, ipt, restorer, stickyParams)
		if sticky {
			if err := c.SetSticky(&testSticky); err != nil {
				t.Fatalf("SetSticky: %v", err)
			}
		}
		return c
	}
	// state is what Sync owns, as an operator lists it: both tables and
	// the sets with their members.
	state := func() string { return tableS("mangle") + "\n" + tableS("raw") + "\n" + ns.IPSetState() }
	// syncExpect syncs and checks the changes Sync reports against the
	// lines that changed in `iptables -S` of both tables and in the sets,
	// and the writes; and that it read each table in one iptables-save
	// and nothing else.
	syncExpect := func(step string, c *Chain, targets []Target, want int) {
		t.Helper()
		ipt.Writes, ipt.Reads, restorer.Calls, restorer.Saves = 0, 0, 0, 0
		before := state()
		changed, err := c.Sync(targets)
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		if ipt.Reads != 0 || restorer.Saves != 2 {
			t.Errorf("%s: Sync read with %d iptables calls and %d iptables-save calls, want 0 and 2 (one per table)", step, ipt.Reads, restorer.Saves)
		}
		diff := lineChanges(before, state())
		if changed != want || diff != want {
			t.Errorf("%s: Sync changed = %d (%d lines of iptables -S and the sets changed), want %d", step, changed, diff, want)
		}
		if want == 0 && ipt.Writes+restorer.Calls != 0 {
			t.Errorf("%s: %d iptables writes and %d restores, want none", step, ipt.Writes, restorer.Calls)
		}
	}

	counted, stays, moves := nf.vips[0], nf.vips[1], nf.vips[2]
	targets := []Target{{VIP: moves, Offset: gen1}, {VIP: stays}, {VIP: counted, Offset: gen0}}
	// Three sets (all, generations 0 and 1) with 3+2+1 members, both
	// chains and jumps, the SYN subchain and its rule, the raw rules (SYN,
	// SYN-ACK), the exit, 12 fixed (among them 4 that forget a FIN's tuple)
	// and 2 HMARK rules (one per generation);
	// the handshake memory: 4 SYN sets (both tuples of testSticky's 2
	// generations), 4 forget rules, 2 record rules (one per generation in
	// use) and 4 re-hash rules.
	syncExpect("first sync", newChain(true), targets, 3+6+2+2+2+2+1+12+2+4+4+2+4)
	t.Logf("%s prints the sticky chains as:\n%s\n%s", binary,
		ns.Run(binary, "-t", "mangle", "-S", name), ns.Run(binary, "-t", "raw", "-S", name))

	adopter := newChain(true)
	offsets, err := adopter.Offsets()
	wantOffsets := map[netip.Addr]uint32{moves: gen1, stays: gen0, counted: gen0}
	if err != nil || !maps.Equal(offsets, wantOffsets) {
		t.Errorf("Offsets = %v, %v; want %v", offsets, err, wantOffsets)
	}
	syncExpect("adoption by a new Chain", adopter, targets, 0)

	// Every packet to a tunnel IP counts once, in the set element the
	// mangle exit matches (the raw rule does not count); a rewrite of
	// either chain keeps the count.
	sendDatagrams(t, ns, nf.loopback, counted, 3)
	sent := Counter{Packets: 3, Bytes: 3 * (nf.headers + 8)}
	assertCounter(t, "3 datagrams sent", adopter, counted, sent)
	targets[0].Offset = gen0
	// Added to generation 0's set, generation 1's HMARK and SYN record
	// rules removed, then the element and its set.
	syncExpect("one tunnel IP to generation 0", adopter, targets, 5)
	ns.Run(binary, "-t", "mangle", "-D", name, "1")
	syncExpect("fixed rule deleted by hand", adopter, targets, 1)
	syncExpect("a tunnel IP removed", adopter, targets[1:], 2)
	assertCounter(t, "a tunnel IP removed", adopter, counted, sent)
	syncExpect("the tunnel IP added back", adopter, targets, 2)
	assertCounter(t, "the tunnel IP added back", adopter, counted, sent)
	ns.Run(binary, "-t", "raw", "-I", name, "1", "-j", "CT", "--notrack")
	syncExpect("foreign raw rule removed", adopter, targets, 1)
	assertCounter(t, "foreign raw rule removed", adopter, counted, sent)

	// What an older version left: a notrack rule per tunnel IP in the raw
	// chain, no SYN subchain. The rules are replaced by the one set rule,
	// the subchain and its rule created; then a new Chain adopts it all.
	ns.Run(binary, "-t", "raw", "-F", name)
	ns.Run(binary, "-t", "raw", "-F", name+"-SYN")
	ns.Run(binary, "-t", "raw", "-X", name+"-SYN")
	for _, tg := range targets {
		ns.Run(binary, "-t", "raw", "-A", name, "-d", hostPrefix(tg.VIP), "-p", "tcp", "-m", "tcp",
			"--tcp-flags", "FIN,SYN,RST,ACK", "SYN", "-m", "comment", "--comment", RuleComment, "-j", "CT", "--notrack")
	}
	syncExpect("upgrade from an older version's raw rules", adopter, targets, len(targets)+2+2)
	syncExpect("adoption after the upgrade", newChain(true), targets, 0)

	// What the previous version left: a raw rule that every packet to a
	// tunnel IP went through (counting it there), and a mangle exit that
	// did not count. Both are replaced (2 out, 2 in).
	ns.Run(binary, "-t", "raw", "-R", name, "1", "-m", "set", "--match-set", name, "dst",
		"-m", "comment", "--comment", RuleComment, "-j", name+"-SYN")
	ns.Run(binary, "-t", "mangle", "-R", name, "1", "-m", "set", "!", "--match-set", name, "dst", "!", "--update-counters",
		"-m", "comment", "--comment", RuleComment, "-j", "RETURN")
	syncExpect("upgrade from the version that counted in raw", newChain(true), targets, 4)
	syncExpect("adoption after that upgrade", newChain(true), targets, 0)

	stateless := newChain(false)
	// Mangle: the 12 fixed rules out (the exit, which counts in both modes,
	// stays), and the handshake memory's 4 forget rules, record rule and 4
	// re-hash rules; raw: jump, two rules, chain, SYN rule and subchain;
	// the 4 SYN sets.
	syncExpect("sticky -> stateless", stateless, targets, 12+9+6+4)
	if got := tableS("raw"); got != beforeRaw {
		t.Errorf("raw after leaving sticky mode:\n%s\nwant:\n%s", got, beforeRaw)
	}
	syncExpect("stateless -> sticky", newChain(true), targets, 12+9+6+4)

	if err := adopter.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if m, r := tableS("mangle"), tableS("raw"); m != beforeMangle || r != beforeRaw {
		t.Errorf("after Cleanup:\n%s\n%s\nwant what was there before:\n%s\n%s", m, r, beforeMangle, beforeRaw)
	}
	if sets := ns.IPSetState(); sets != setsBefore {
		t.Errorf("after Cleanup, the sets are\n%s\nwant only others':\n%s", sets, setsBefore)
	}
}

// The draining lab: a client, a router and a server namespace. The server
// holds the tunnel IP and answers the client directly over their own link,
// so the router sees only client -> tunnel IP packets, as in production.
var (
	labVIP       = netip.MustParseAddr("192.0.2.1")
	labClient    = netip.MustParseAddr("10.1.0.1") // c, on the c-r link
	labRouterC   = netip.MustParseAddr("10.1.0.2") // r, on the c-r link
	labRouterS   = netip.MustParseAddr("10.2.0.1") // r, on the r-s link
	labServerR   = netip.MustParseAddr("10.2.0.2") // s, on the r-s link
	labClientS   = netip.MustParseAddr("10.3.0.1") // c, on the c-s link
	labServerC   = netip.MustParseAddr("10.3.0.2") // s, on the c-s link
	labTCPPort   = 8080
	labUDPPort   = 9000
	labGen0Match = "0x1000/0xffffffc0" // marks 0x1000-0x103f
	labGen1Match = "0x1040/0xffffffc0" // marks 0x1040-0x107f
	labBlock     = "0x1000/0xffffff00"
	// labClosingBit is the connmark bit of a closing decision in that block.
	labClosingBit = 0x100
)

// Client source ports, one per flow the test follows.
const (
	portA = 40001 // TCP, opened before the generation change
	portB = 40002 // TCP, opened after it
	portU = 40003 // UDP, started before it
	portF = 40004 // TCP, closed with FIN before it, reopened after it
	portH = 40005 // TCP, its SYN before the change, every later packet after it
	portR = 40006 // TCP, opened and closed after the change, reopened after a change back
)

// TestStickyDrainingInNetns proves stickiness on the real kernel with
// asymmetric routing. The router namespace r installs a sticky Chain for
// the tunnel IP with generation 0 (offset 0x1000), then moves it to
// generation 1 (offset 0x1040). Rules owned by the test in r's mangle
// FORWARD count, per flow, the packets forwarded with a generation 0 mark,
// with a generation 1 mark, and in all, after the Chain marked them:
//
//   - TCP connection A, open before the change, stays on generation 0 for
//     all its packets, also after the change; its conntrack mark too.
//   - TCP connection B, opened after the change, is on generation 1 for all
//     its packets, its (untracked) SYN included.
//   - A UDP flow started before the change stays on generation 0.
//   - TCP connection H straddles the change: its SYN goes through before
//     it, and its client's ACK is held back (dropped in c) until after
//     it. Its conntrack entry, made by that ACK, still takes generation
//     0, the SYN's (the handshake memory), so all its packets are on
//     generation 0.
//   - TCP connection F, closed with FIN before the change (its conntrack
//     mark gets the closing bit) and reopened on the same 4-tuple right
//     after it, hits the stale closing conntrack entry: all its packets
//     take generation 1, its SYN's (the handshake memory), and the entry's
//     mark becomes generation 1's without the closing bit; so, once the
//     handshake memory has forgotten its SYN, and after a change back to
//     generation 0, it stays on generation 1 (a client that reuses its
//     ports, as NAT gateways do, is as sticky as any other).
//   - No packet to the tunnel IP is forwarded without a mark of the block.
func TestStickyDrainingInNetns(t *testing.T) {
	for _, binary := range iptablesBinaries {
		t.Run(binary, func(t *testing.T) { testStickyDrainingInNetns(t, binary) })
	}
}

func testStickyDrainingInNetns(t *testing.T, binary string) {
	c, r, chain, ipt := newStickyDrainingLab(t, binary)

	// Before the change: A and F open, F closed with FIN (the server closes
	// first, so that the client ends in CLOSED, not TIME_WAIT, and can
	// reuse its port), U sends.
	connA := dialVIP(t, c, portA)
	roundTrips(t, "A", connA, 3)
	connF := dialVIP(t, c, portF)
	roundTrips(t, "F", connF, 2)
	closeFromServer(t, connF)
	connU := dialUDP(t, c, portU)
	roundTrips(t, "U", connU, 3)
	// H's handshake: the SYN passes, the client's ACK (and anything after
	// it) is dropped in c until after the change.
	holdH := []string{"-t", "filter", "OUTPUT", "-p", "tcp", "--sport", fmt.Sprint(portH), "!", "--syn", "-j", "DROP"}
	c.Run(binary, slices.Insert(slices.Clone(holdH), 2, "-A")...)
	connH := dialVIP(t, c, portH)

	ct := conntrackOf(t, r)
	// The FIN went through r once its entry is closing (FIN_WAIT or later).
	ct.waitTCPState(t, portF, func(state uint8) bool { return state > tcpConntrackEstablished })
	if flow := ct.flow(t, unix.IPPROTO_TCP, portA); flow == nil || flow.Mark&0xffffffc0 != 0x1000 {
		t.Fatalf("conntrack of A before the change: %v, want mark in generation 0", flow)
	}
	if flow := ct.flow(t, unix.IPPROTO_TCP, portF); flow == nil || flow.Mark&0xffffffc0 != 0x1000|uint32(labClosingBit) {
		t.Fatalf("conntrack of F after its FIN: %v, want mark in generation 0 with the closing bit %#x", flow, labClosingBit)
	}
	before := readCounters(t, ipt)
	for _, f := range []string{"A", "F", "U"} {
		if before[f+" all"] == 0 || before[f+" gen0"] != before[f+" all"] || before[f+" gen1"] != 0 {
			t.Errorf("before the change, flow %s: %d packets, %d in generation 0, %d in generation 1; want all in generation 0",
				f, before[f+" all"], before[f+" gen0"], before[f+" gen1"])
		}
	}

	changed, err := chain.Sync([]Target{{VIP: labVIP, Offset: 0x1040}})
	// Generation 1's set created with the tunnel IP, generation 0's HMARK
	// rule and SYN record rule replaced by generation 1's, then the tunnel
	// IP deleted from generation 0's set and the set destroyed.
	if err != nil || changed != 8 {
		t.Fatalf("Sync generation 1 = %d, %v; want 8, nil", changed, err)
	}
	c.Run(binary, slices.Insert(slices.Clone(holdH), 2, "-D")...)
	roundTrips(t, "H", connH, 3)

	roundTrips(t, "A", connA, 3)
	roundTrips(t, "U", connU, 3)
	connB := dialVIP(t, c, portB)
	roundTrips(t, "B", connB, 3)
	connF = dialVIP(t, c, portF) // same 4-tuple as before
	roundTrips(t, "F reopened", connF, 3)
	roundTrips(t, "A", connA, 2)
	roundTrips(t, "B", connB, 2)
	after := readCounters(t, ipt)
	delta := func(name string) uint64 { return after[name] - before[name] }
	t.Logf("counters before the change: %v", before)
	t.Logf("counters after the change:  %v", after)

	if delta("A all") == 0 || after["A gen0"] != after["A all"] || after["A gen1"] != 0 {
		t.Errorf("A: %d packets (%d after the change), %d in generation 0, %d in generation 1; want all in generation 0",
			after["A all"], delta("A all"), after["A gen0"], after["A gen1"])
	}
	if delta("U all") == 0 || after["U gen0"] != after["U all"] || after["U gen1"] != 0 {
		t.Errorf("U: %d packets (%d after the change), %d in generation 0, %d in generation 1; want all in generation 0",
			after["U all"], delta("U all"), after["U gen0"], after["U gen1"])
	}
	if after["B all"] == 0 || after["B gen1"] != after["B all"] || after["B gen0"] != 0 || after["B syn gen1"] != 1 {
		t.Errorf("B: %d packets, %d in generation 1 (SYN: %d), %d in generation 0; want all in generation 1, its SYN too",
			after["B all"], after["B gen1"], after["B syn gen1"], after["B gen0"])
	}
	if delta("F all") == 0 || delta("F gen1") != delta("F all") || delta("F gen0") != 0 || delta("F syn gen1") != 1 {
		t.Errorf("F reopened: %d packets, %d in generation 1 (SYN: %d), %d in generation 0; want all in generation 1, its SYN too",
			delta("F all"), delta("F gen1"), delta("F syn gen1"), delta("F gen0"))
	}
	if after["H all"] < 4 || after["H gen0"] != after["H all"] || after["H gen1"] != 0 || after["H syn gen0"] != 1 {
		t.Errorf("H (SYN before the change, the rest after): %d packets, %d in generation 0 (SYN: %d), %d in generation 1; want all in generation 0, the SYN's",
			after["H all"], after["H gen0"], after["H syn gen0"], after["H gen1"])
	}
	if after["unmarked"] != 0 {
		t.Errorf("%d packets to %s forwarded without a mark in %s, want none", after["unmarked"], labVIP, labBlock)
	}

	for _, tc := range []struct {
		name  string
		proto uint8
		port  int
		gen   uint32
	}{{"A", unix.IPPROTO_TCP, portA, 0x1000}, {"B", unix.IPPROTO_TCP, portB, 0x1040}, {"U", unix.IPPROTO_UDP, portU, 0x1000}, {"H", unix.IPPROTO_TCP, portH, 0x1000},
		{"F reopened (no closing bit)", unix.IPPROTO_TCP, portF, 0x1040}} {
		flow := ct.flow(t, tc.proto, tc.port)
		if flow == nil || flow.Mark&0xffffffc0 != tc.gen {
			t.Errorf("conntrack of %s: %v, want mark in the generation at %#x", tc.name, flow, tc.gen)
		}
	}
	// The tunnel IP's counters count every packet the router received for
	// it, a generation change (a mangle rewrite) notwithstanding: the
	// packets forwarded to it, counted in FORWARD just before and just
	// after (the client's delayed ACKs may still arrive meanwhile; each
	// packet crosses raw PREROUTING before FORWARD).
	forwardedBefore := readCounters(t, ipt)["to vip"]
	counters, err := chain.Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	forwardedAfter := readCounters(t, ipt)["to vip"]
	if got := counters[labVIP].Packets; got < forwardedBefore || got > forwardedAfter || forwardedBefore < after["A all"]+after["B all"]+after["U all"]+after["F all"]+after["H all"] {
		t.Errorf("Counters[%s] = %+v, want between the %d and %d packets forwarded to it", labVIP, counters[labVIP], forwardedBefore, forwardedAfter)
	}
	t.Logf("tunnel IP counters (every packet): %v; forwarded to the tunnel IP: %d, then %d", counters, forwardedBefore, forwardedAfter)

	// R reuses its port across a change back to generation 0, within the
	// handshake memory's 10 s: its first connection's SYN is remembered in
	// generation 1's SYN set, the reopened connection's SYN in generation
	// 0's, which must be the only one left (the later rule, generation
	// 1's, would otherwise hash every packet after the SYN, its stale
	// closing conntrack entry restoring nothing).
	connR := dialVIP(t, c, portR)
	roundTrips(t, "R", connR, 2)
	closeFromServer(t, connR)
	ct.waitTCPState(t, portR, func(state uint8) bool { return state > tcpConntrackEstablished })
	if _, err := chain.Sync([]Target{{VIP: labVIP, Offset: 0x1000}}); err != nil {
		t.Fatalf("Sync back to generation 0: %v", err)
	}
	beforeR := readCounters(t, ipt)
	connR = dialVIP(t, c, portR) // same 4-tuple as before
	roundTrips(t, "R reopened", connR, 3)
	afterR := readCounters(t, ipt)
	deltaR := func(name string) uint64 { return afterR[name] - beforeR[name] }
	if deltaR("R all") < 4 || deltaR("R gen0") != deltaR("R all") || deltaR("R gen1") != 0 || deltaR("R syn gen0") != 1 {
		t.Errorf("R reopened after the change back: %d packets, %d in generation 0 (SYN: %d), %d in generation 1; want all in generation 0, its SYN's",
			deltaR("R all"), deltaR("R gen0"), deltaR("R syn gen0"), deltaR("R gen1"))
	}

	// F, reopened on a closing entry's 4-tuple in generation 1, once the
	// handshake memory has forgotten its SYN (flushed here rather than
	// waited for) and after the change back to generation 0: generation 1
	// still, restored from its entry. Before the closing bit, a closing
	// entry's mark was not restored, and F followed the current generation.
	for _, k := range chain.synClasses() {
		r.Run("ipset", "flush", chain.synSetName(k))
	}
	beforeF := readCounters(t, ipt)
	roundTrips(t, "F reopened, its SYN forgotten, after the change back", connF, 3)
	afterF := readCounters(t, ipt)
	deltaF := func(name string) uint64 { return afterF[name] - beforeF[name] }
	if deltaF("F all") < 3 || deltaF("F gen1") != deltaF("F all") || deltaF("F gen0") != 0 {
		t.Errorf("F (reopened on a reused 4-tuple in generation 1), after the change back to generation 0: %d packets, %d in generation 1, %d in generation 0; want all in generation 1",
			deltaF("F all"), deltaF("F gen1"), deltaF("F gen0"))
	}
}

// newStickyDrainingLab is the draining lab with a sticky Chain in r
// (written with binary, its sets created as the router creates them:
// KernelSets) serving the tunnel IP in generation 0 (offset 0x1000), r's
// counting rules, and the echo servers in s.
func newStickyDrainingLab(t *testing.T, binary string) (c, r *testnetns.NS, chain *Chain, ipt *testnetns.IPTables) {
	t.Helper()
	c, r, s := newDrainingLab(t)
	ipt = r.IPTables(binary)
	sets := KernelSets{Handle: r.IPSets(), NetNS: r.Handle} // as the router's
	chain, err := NewChain(ipt, sets, "", Params{Buckets: 64, Offset: 0x1000, Seed: 0x5eed}, newNSRestorer(r, binary))
	if err != nil {
		t.Fatalf("NewChain: %v", err)
	}
	if err := chain.SetSticky(&Sticky{Block: 0x1000, Mask: 0xffffff00}); err != nil {
		t.Fatalf("SetSticky: %v", err)
	}
	if _, err := chain.Sync([]Target{{VIP: labVIP, Offset: 0x1000}}); err != nil {
		t.Fatalf("Sync generation 0: %v", err)
	}
	addCountingRules(r, binary)
	startEchoServers(t, s)
	return c, r, chain, ipt
}

// newDrainingLab creates the namespaces c, r and s, linked in a triangle,
// with the tunnel IP on s's lo: c routes it via r, r forwards it to s, s
// answers c directly. Reverse-path filtering is off everywhere, since each
// of c and s receives from an address it would not route back to that way.
func newDrainingLab(t *testing.T) (c, r, s *testnetns.NS) {
	t.Helper()
	c = testnetns.New(t)
	r = testnetns.New(t)
	s = testnetns.New(t, netip.PrefixFrom(labVIP, 32))
	for _, ns := range []*testnetns.NS{c, r, s} {
		writeSysctls(t, ns, map[string]string{"net/ipv4/conf/all/rp_filter": "0", "net/ipv4/conf/default/rp_filter": "0"})
	}
	linkNamespaces(t, c, "c-r", netip.PrefixFrom(labClient, 24), r, "r-c", netip.PrefixFrom(labRouterC, 24))
	linkNamespaces(t, r, "r-s", netip.PrefixFrom(labRouterS, 24), s, "s-r", netip.PrefixFrom(labServerR, 24))
	linkNamespaces(t, c, "c-s", netip.PrefixFrom(labClientS, 24), s, "s-c", netip.PrefixFrom(labServerC, 24))
	addRoute(t, c, netip.PrefixFrom(labVIP, 32), labRouterC)
	addRoute(t, r, netip.PrefixFrom(labVIP, 32), labServerR)
	addRoute(t, s, netip.MustParsePrefix("10.1.0.0/24"), labClientS)
	writeSysctls(t, r, map[string]string{"net/ipv4/ip_forward": "1"})
	for ns, ifaces := range map[*testnetns.NS][]string{c: {"c-r", "c-s"}, r: {"r-c", "r-s"}, s: {"s-r", "s-c", "lo"}} {
		for _, i := range ifaces {
			writeSysctls(t, ns, map[string]string{"net/ipv4/conf/" + i + "/rp_filter": "0"})
		}
	}
	return c, r, s
}

// linkNamespaces creates a veth pair between a and b, with an address on
// each end, both ends up.
func linkNamespaces(t *testing.T, a *testnetns.NS, aName string, aAddr netip.Prefix, b *testnetns.NS, bName string, bAddr netip.Prefix) {
	t.Helper()
	nlA, nlB := a.Netlink(), b.Netlink()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: aName}, PeerName: bName, PeerNamespace: netlink.NsFd(int(b.Handle))}
	if err := nlA.LinkAdd(veth); err != nil {
		t.Fatalf("add veth %s/%s: %v", aName, bName, err)
	}
	for _, end := range []struct {
		nl   *netlink.Handle
		name string
		addr netip.Prefix
	}{{nlA, aName, aAddr}, {nlB, bName, bAddr}} {
		l, err := end.nl.LinkByName(end.name)
		if err != nil {
			t.Fatalf("find %s: %v", end.name, err)
		}
		if err := end.nl.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(end.addr)}); err != nil {
			t.Fatalf("add %s to %s: %v", end.addr, end.name, err)
		}
		if err := end.nl.LinkSetUp(l); err != nil {
			t.Fatalf("set %s up: %v", end.name, err)
		}
	}
}

func addRoute(t *testing.T, ns *testnetns.NS, dst netip.Prefix, via netip.Addr) {
	t.Helper()
	if err := ns.Netlink().RouteAdd(&netlink.Route{Dst: testnetns.IPNet(dst), Gw: via.AsSlice()}); err != nil {
		t.Fatalf("route %s via %s: %v", dst, via, err)
	}
}

// writeSysctls writes /proc/sys files from a thread inside ns (the net
// sysctls are those of the writing thread's namespace).
func writeSysctls(t *testing.T, ns *testnetns.NS, values map[string]string) {
	t.Helper()
	err := ns.Do(func() error {
		for key, v := range values {
			if err := os.WriteFile("/proc/sys/"+key, []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("sysctls %v: %v", values, err)
	}
}

// addCountingRules adds the test's counting rules to r's mangle FORWARD,
// each named by its comment: per flow, packets in generation 0, in
// generation 1 and in all, and SYNs in generation 1 for the TCP flows;
// packets to the tunnel IP without a mark of the block; and all packets
// to the tunnel IP.
func addCountingRules(r *testnetns.NS, binary string) {
	add := func(comment string, match ...string) {
		args := append([]string{"-t", "mangle", "-A", "FORWARD", "-s", labClient.String(), "-d", labVIP.String()}, match...)
		r.Run(binary, append(args, "-m", "comment", "--comment", comment)...)
	}
	flows := []struct {
		name, proto string
		port        int
	}{{"A", "tcp", portA}, {"B", "tcp", portB}, {"U", "udp", portU}, {"F", "tcp", portF}, {"H", "tcp", portH}, {"R", "tcp", portR}}
	for _, f := range flows {
		flow := []string{"-p", f.proto, "--sport", fmt.Sprint(f.port)}
		add(f.name+" all", flow...)
		add(f.name+" gen0", append(flow, "-m", "mark", "--mark", labGen0Match)...)
		add(f.name+" gen1", append(flow, "-m", "mark", "--mark", labGen1Match)...)
		if f.proto == "tcp" {
			add(f.name+" syn gen0", append(flow, "--syn", "-m", "mark", "--mark", labGen0Match)...)
			add(f.name+" syn gen1", append(flow, "--syn", "-m", "mark", "--mark", labGen1Match)...)
		}
	}
	add("unmarked", "-m", "mark", "!", "--mark", labBlock)
	add("to vip")
}

// readCounters returns the packet counters of the counting rules by
// comment.
func readCounters(t *testing.T, ipt *testnetns.IPTables) map[string]uint64 {
	t.Helper()
	lines, err := ipt.ListWithCounters("mangle", "FORWARD")
	if err != nil {
		t.Fatalf("list FORWARD: %v", err)
	}
	out := make(map[string]uint64)
	for _, line := range lines {
		r, ok, err := parseRuleCounters(line, "FORWARD")
		if err != nil || !ok || !r.hasCounters {
			continue
		}
		for i := 0; i+1 < len(r.spec); i++ {
			if r.spec[i] == "--comment" {
				out[r.spec[i+1]] = r.packets
			}
		}
	}
	return out
}

// startEchoServers serves, on the tunnel IP in s, a TCP echo of lines
// (closing the connection on "bye") and a UDP echo of datagrams.
func startEchoServers(t *testing.T, s *testnetns.NS) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	err := s.Do(func() error {
		var err error
		if ln, err = net.Listen("tcp4", netip.AddrPortFrom(labVIP, uint16(labTCPPort)).String()); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp4", netip.AddrPortFrom(labVIP, uint16(labUDPPort)).String())
		return err
	})
	if err != nil {
		t.Fatalf("listen on %s in s: %v", labVIP, err)
	}
	t.Cleanup(func() { _ = ln.Close(); _ = pc.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = conn.Close() }()
				br := bufio.NewReader(conn)
				for {
					line, err := br.ReadString('\n')
					if err != nil || line == "bye\n" {
						return
					}
					if _, err := conn.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
}

// dialVIP opens a TCP connection from c's client address and port to the
// tunnel IP. The socket belongs to c's namespace for its whole life.
func dialVIP(t *testing.T, c *testnetns.NS, port int) net.Conn {
	t.Helper()
	var conn net.Conn
	err := c.Do(func() error {
		d := net.Dialer{
			LocalAddr: &net.TCPAddr{IP: labClient.AsSlice(), Port: port},
			Timeout:   5 * time.Second,
			Control: func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
				}); err != nil {
					return err
				}
				return serr
			},
		}
		var err error
		conn, err = d.Dial("tcp4", netip.AddrPortFrom(labVIP, uint16(labTCPPort)).String())
		return err
	})
	if err != nil {
		t.Fatalf("dial %s:%d from port %d: %v", labVIP, labTCPPort, port, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// dialUDP opens a UDP socket from c's client address and port, connected
// to the tunnel IP.
func dialUDP(t *testing.T, c *testnetns.NS, port int) net.Conn {
	t.Helper()
	var conn net.Conn
	err := c.Do(func() error {
		var err error
		conn, err = net.DialUDP("udp4", &net.UDPAddr{IP: labClient.AsSlice(), Port: port},
			&net.UDPAddr{IP: labVIP.AsSlice(), Port: labUDPPort})
		return err
	})
	if err != nil {
		t.Fatalf("UDP socket from port %d: %v", port, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// roundTrips sends n messages on conn and reads each echo back, so that
// each message has crossed the router before the next one.
func roundTrips(t *testing.T, flow string, conn net.Conn, n int) {
	t.Helper()
	buf := make([]byte, 64)
	for i := range n {
		msg := fmt.Sprintf("%s %d\n", flow, i)
		if err := conn.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write([]byte(msg)); err != nil {
			t.Fatalf("flow %s: send %q: %v", flow, msg, err)
		}
		got := 0
		for got < len(msg) {
			m, err := conn.Read(buf[got:])
			if err != nil {
				t.Fatalf("flow %s: read echo of %q: %v", flow, msg, err)
			}
			got += m
		}
		if string(buf[:got]) != msg {
			t.Fatalf("flow %s: echo %q, want %q", flow, buf[:got], msg)
		}
	}
}

// closeFromServer asks the server to close conn, waits for its FIN (end of
// stream), then closes the client side, which sends the client's FIN
// through the router.
func closeFromServer(t *testing.T, conn net.Conn) {
	t.Helper()
	if _, err := conn.Write([]byte("bye\n")); err != nil {
		t.Fatalf("send bye: %v", err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := conn.Read(make([]byte, 16)); !errors.Is(err, io.EOF) {
		t.Fatalf("after bye: read %d bytes, %v; want end of stream", n, err)
	}
	if err := conn.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
}

// tcpConntrackEstablished is TCP_CONNTRACK_ESTABLISHED; the closing
// states (FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT, CLOSE) follow it.
const tcpConntrackEstablished = 3

// conntrack reads r's conntrack table over netlink.
type conntrack struct{ h *netlink.Handle }

func conntrackOf(t *testing.T, r *testnetns.NS) conntrack {
	t.Helper()
	h, err := netlink.NewHandleAt(r.Handle, unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatalf("netfilter netlink handle in r: %v", err)
	}
	t.Cleanup(h.Close)
	return conntrack{h: h}
}

// flow returns the entry of the client's flow from port, or nil.
func (ct conntrack) flow(t *testing.T, proto uint8, port int) *netlink.ConntrackFlow {
	t.Helper()
	flows, err := ct.h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatalf("list conntrack in r: %v", err)
	}
	for _, f := range flows {
		if f.Forward.Protocol == proto && f.Forward.SrcPort == uint16(port) && f.Forward.SrcIP.Equal(labClient.AsSlice()) {
			return f
		}
	}
	return nil
}

// waitTCPState waits until the TCP entry of the client's flow from port is
// in a state ok accepts.
func (ct conntrack) waitTCPState(t *testing.T, port int, ok func(state uint8) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		flow := ct.flow(t, unix.IPPROTO_TCP, port)
		state := -1
		if flow != nil {
			if info, isTCP := flow.ProtoInfo.(*netlink.ProtoInfoTCP); isTCP {
				if ok(info.State) {
					return
				}
				state = int(info.State)
			}
		}
		if time.Now().After(deadline) {
			// SYN_SENT (1) here means the SYN was tracked: every later
			// packet of the flow is INVALID.
			t.Fatalf("conntrack entry of port %d in TCP state %d, not the one awaited: %v", port, state, flow)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
