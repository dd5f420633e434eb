package hmark

// Privileged tests of Sync, Counters and Cleanup: each runs in a fresh
// network namespace of its own (see test/support/testnetns), with the real
// iptables and ip6tables binaries of both backends. They skip when not
// root or when a binary is missing.

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"golang.org/x/sys/unix"
)

// Chain's seam is satisfied by go-iptables itself and by the test wrapper.
var (
	_ IPTables = (*iptables.IPTables)(nil)
	_ IPTables = (*testnetns.IPTables)(nil)
	_ Restorer = (*ExecRestorer)(nil)
	_ Restorer = (*nsRestorer)(nil)
)

// nsRestorer runs the iptables-restore and iptables-save matching an
// iptables binary inside a test namespace, and counts their calls
// independently of what the code under test reports.
type nsRestorer struct {
	ns   *testnetns.NS
	exec *ExecRestorer
	// Calls counts restores, Saves saves.
	Calls, Saves int
}

func newNSRestorer(ns *testnetns.NS, iptablesBinary string) *nsRestorer {
	return &nsRestorer{ns: ns, exec: NewExecRestorer(iptablesBinary)}
}

// Restore is ExecRestorer.Restore inside the namespace.
func (r *nsRestorer) Restore(table string, payload []byte) error {
	r.Calls++
	return r.ns.Do(func() error { return r.exec.Restore(table, payload) })
}

// Save is ExecRestorer.Save inside the namespace.
func (r *nsRestorer) Save(table string) (out []byte, err error) {
	r.Saves++
	err = r.ns.Do(func() (err error) { out, err = r.exec.Save(table); return err })
	return out, err
}

// lineChanges is the number of lines that differ between two outputs of
// `iptables -S`, counted as a multiset: what was added plus what was
// removed (empty lines aside). It measures a Sync's changes independently
// of its count.
func lineChanges(before, after string) int {
	count := make(map[string]int)
	for _, l := range strings.Split(before, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(after, "\n") {
		count[l]--
	}
	delete(count, "")
	n := 0
	for _, c := range count {
		n += max(c, -c)
	}
	return n
}

// iptablesBinaries are the two backends: nft, and legacy; ip6tablesBinaries
// the same for IPv6.
var (
	iptablesBinaries  = []string{"iptables", "iptables-legacy"}
	ip6tablesBinaries = []string{"ip6tables", "ip6tables-legacy"}
)

// netnsFamily is what the privileged tests of Chain run with for one
// address family, so that one test proves the same of both.
type netnsFamily struct {
	family Family
	// binaries are the family's iptables of each backend.
	binaries []string
	// vips are three tunnel IPs, local in the test namespace (see newNS),
	// all of them in the family's set listings.
	vips []netip.Addr
	// flows sends flows to vips and observes their marks (see
	// sendUDPFlows).
	flows flowFamily
	// loopback is the address sendDatagrams sends from.
	loopback netip.Addr
	// other is an address that is no tunnel IP, for others' rules.
	other netip.Addr
	// headers is the size of a datagram's IP and UDP headers.
	headers uint64
}

var (
	netnsIPv4 = netnsFamily{family: IPv4, binaries: iptablesBinaries, vips: kernelVIPs, flows: ipv4Flows,
		loopback: netip.MustParseAddr("127.0.0.1"), other: netip.MustParseAddr("10.1.1.1"), headers: 20 + 8}
	netnsIPv6 = netnsFamily{family: IPv6, binaries: ip6tablesBinaries, vips: kernelVIPs6, flows: ipv6Flows,
		loopback: netip.IPv6Loopback(), other: netip.MustParseAddr("2001:db8:1::1"), headers: 40 + 8}
	netnsFamilies = []netnsFamily{netnsIPv4, netnsIPv6}
)

// newNS returns a fresh namespace where the family's tunnel IPs are local
// and the flows' sources can be bound (see setUpIPv6Lab).
func (nf netnsFamily) newNS(t *testing.T) *testnetns.NS {
	t.Helper()
	if nf.family == IPv6 {
		ns := testnetns.New(t)
		setUpIPv6Lab(t, ns)
		return ns
	}
	return testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
}

// newChain returns a Chain of the family with its default name, reading
// and writing through ipt, ns's sets and restorer.
func (nf netnsFamily) newChain(t *testing.T, ns *testnetns.NS, ipt IPTables, restorer Restorer, params Params) *Chain {
	t.Helper()
	c, err := NewChainFamily(nf.family, ipt, ns.IPSets(), "", params, restorer)
	if err != nil {
		t.Fatalf("NewChainFamily(%s): %v", nf.family, err)
	}
	return c
}

// hostPrefix is "ADDR/32" or "ADDR/128", as iptables takes and prints a
// single address.
func hostPrefix(a netip.Addr) string { return netip.PrefixFrom(a, a.BitLen()).String() }

// forEachBackend runs test as a subtest for each iptables binary of each
// family.
func forEachBackend(t *testing.T, test func(t *testing.T, nf netnsFamily, binary string)) {
	for _, nf := range netnsFamilies {
		for _, binary := range nf.binaries {
			t.Run(binary, func(t *testing.T) { test(t, nf, binary) })
		}
	}
}

// TestSyncInNetns drives Chain against the real iptables and ip6tables of
// each backend in a fresh namespace: creation, adoption by a new Chain
// with no write, repair of a rule deleted by hand, removal of a rule added
// by hand to the chain, rules of other chains left alone, counters of
// real packets, and Cleanup, which leaves others' rules and sets.
func TestSyncInNetns(t *testing.T) { forEachBackend(t, testSyncInNetns) }

func testSyncInNetns(t *testing.T, nf netnsFamily, binary string) {
	ns := nf.newNS(t)
	ipt := ns.IPTables(binary)
	params := Params{Buckets: 16, Offset: 0x100, Seed: 0xc0ffee}
	vips := nf.vips
	restorer := newNSRestorer(ns, binary)
	mangleS := func() string { return ns.Run(binary, "-t", "mangle", "-S") }
	newChain := func() *Chain {
		t.Helper()
		return nf.newChain(t, ns, ipt, restorer, params)
	}

	// Rules of others, in another chain of mangle and in PREROUTING
	// itself, and a set of others (with a tunnel IP in it).
	ns.Run(binary, "-t", "mangle", "-N", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "OPERATOR", "-d", hostPrefix(nf.other), "-j", "MARK", "--set-mark", "5")
	ns.Run(binary, "-t", "mangle", "-A", "FORWARD", "-j", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-m", "comment", "--comment", "someone else", "-j", "MARK", "--set-mark", "9")
	addForeignSet(t, ns, nf.family, "OPERATOR", vips[0])
	before, setsBefore := mangleS(), ns.IPSetState()

	chain := newChain()
	name := chain.Name()
	othersUntouched := func(step string) {
		t.Helper()
		if got := withoutChain(mangleS(), name); got != before {
			t.Errorf("%s: rules outside %s changed:\n got: %s\nwant: %s", step, name, got, before)
		}
	}

	// state is what Sync owns, as an operator lists it: mangle's rules and
	// the namespace's ipsets with their members.
	state := func() string { return mangleS() + "\n" + ns.IPSetState() }
	// syncExpect syncs and checks the changes Sync reports against the
	// lines that changed in `iptables -S` and the set listing, and the
	// writes iptables and iptables-restore saw: wantIPT of the changes go
	// through go-iptables (chain and jump), the set elements through
	// netlink, and the rules through wantRestores restores. Every Sync
	// reads each table, mangle and raw, in one iptables-save, and nothing
	// else.
	syncExpect := func(step string, c *Chain, want, wantIPT, wantRestores int) {
		t.Helper()
		ipt.Writes, ipt.Reads, restorer.Calls, restorer.Saves = 0, 0, 0, 0
		before := state()
		changed, err := c.Sync(targetsOf(vips...))
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		if ipt.Reads != 0 || restorer.Saves != 2 {
			t.Errorf("%s: Sync read with %d iptables calls and %d iptables-save calls, want 0 and 2 (one per table)", step, ipt.Reads, restorer.Saves)
		}
		if diff := lineChanges(before, state()); changed != want || diff != want {
			t.Errorf("%s: Sync changed = %d (%d lines of iptables -S and the sets changed), want %d", step, changed, diff, want)
		}
		if ipt.Writes != wantIPT || restorer.Calls != wantRestores {
			t.Errorf("%s: iptables saw %d writes and iptables-restore %d calls, want %d and %d",
				step, ipt.Writes, restorer.Calls, wantIPT, wantRestores)
		}
		assertKernelChain(t, step, ns, c, vips)
		othersUntouched(step)
	}

	// Two sets, every tunnel IP in both, chain, jump, exit and HMARK rule.
	syncExpect("first sync", chain, 2+2*len(vips)+1+1+2, 2, 1)
	t.Logf("%s prints the router's rules as:\n%s", binary, ns.Run(binary, "-t", "mangle", "-S", name))

	adopter := newChain()
	syncExpect("adoption by a new Chain", adopter, 0, 0, 0)

	ns.Run(binary, "-t", "mangle", "-D", name, "2")
	syncExpect("HMARK rule deleted by hand", adopter, 1, 0, 1)

	ns.Run(binary, "-t", "mangle", "-I", name, "2", "-j", "MARK", "--set-mark", "3")
	ns.Run(binary, "-t", "mangle", "-A", name, "-d", hostPrefix(vips[0]),
		"-j", "HMARK", "--hmark-tuple", "src,dst", "--hmark-mod", "16", "--hmark-offset", "256", "--hmark-rnd", "0xc0ffee")
	syncExpect("foreign rules added by hand to the chain", adopter, 2, 0, 1)

	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-i", "lo", "-j", name)
	syncExpect("second jump added by hand", adopter, 1, 1, 0)

	// One datagram to a tunnel IP shows up in the counters.
	counted, idle := vips[2], vips[1]
	sendDatagrams(t, ns, nf.loopback, counted, 1)
	counters, err := adopter.Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	if len(counters) != len(vips) {
		t.Errorf("Counters has %d tunnel IPs, want %d: %v", len(counters), len(vips), counters)
	}
	one := Counter{Packets: 1, Bytes: nf.headers + 8}
	if c := counters[counted]; c != one {
		t.Errorf("Counters[%s] = %+v, want %+v (1 packet of 8 bytes and the headers)", counted, c, one)
	}
	if c := counters[idle]; c.Packets != 0 {
		t.Errorf("Counters[%s] = %+v, want no packet", idle, c)
	}

	// Another tunnel IP removed (from both sets), then added back, then
	// the chain repaired (a restore): the tunnel IP's counters stay.
	all := vips
	vips = []netip.Addr{vips[0], counted}
	syncExpect("a tunnel IP removed", adopter, 2, 0, 0)
	assertCounter(t, "a tunnel IP removed", adopter, counted, one)
	vips = all
	syncExpect("the tunnel IP added back", adopter, 2, 0, 0)
	assertCounter(t, "the tunnel IP added back", adopter, counted, one)
	ns.Run(binary, "-t", "mangle", "-I", name, "1", "-j", "MARK", "--set-mark", "3")
	syncExpect("foreign rule removed", adopter, 1, 0, 1)
	assertCounter(t, "foreign rule removed", adopter, counted, one)

	// A tunnel IP deleted from its generation's set behind the router's
	// back is put back.
	if err := ns.IPSets().IpsetDel(name+"-0", &netlink.IPSetEntry{IP: counted.AsSlice()}); err != nil {
		t.Fatal(err)
	}
	syncExpect("set element deleted by hand", adopter, 1, 0, 0)
	assertCounter(t, "set element deleted by hand", adopter, counted, one)

	if err := adopter.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if got := mangleS(); got != before {
		t.Errorf("after Cleanup, mangle is\n%s\nwant what it was before the router:\n%s", got, before)
	}
	if got := ns.IPSetState(); got != setsBefore {
		t.Errorf("after Cleanup, the sets are\n%s\nwant only others':\n%s", got, setsBefore)
	}
	if err := chain.Cleanup(); err != nil {
		t.Errorf("second Cleanup (nothing left): %v", err)
	}
}

// addForeignSet creates in ns a set of others, name (hash:ip of family,
// without counters), holding members, and fails the test on error.
func addForeignSet(t *testing.T, ns *testnetns.NS, family Family, name string, members ...netip.Addr) {
	t.Helper()
	h := ns.IPSets()
	if err := h.IpsetCreate(name, SetType, netlink.IpsetCreateOptions{Family: family.setFamily()}); err != nil {
		t.Fatalf("create set %s of others: %v", name, err)
	}
	for _, a := range members {
		if err := h.IpsetAdd(name, &netlink.IPSetEntry{IP: a.AsSlice()}); err != nil {
			t.Fatalf("add %s to set %s of others: %v", a, name, err)
		}
	}
}

// sendDatagrams sends n datagrams of 8 bytes from src (a local address of
// vip's family) to vip:9 inside ns, where a socket bound to vip receives
// them (so that no ICMP error goes back to the same address). Sent over
// lo, they come back in through PREROUTING.
func sendDatagrams(t *testing.T, ns *testnetns.NS, src, vip netip.Addr, n int) {
	t.Helper()
	af := unix.AF_INET
	if vip.Is6() {
		af = unix.AF_INET6
	}
	err := ns.Do(func() error {
		rx, err := unix.Socket(af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(rx) }()
		if err := unix.Bind(rx, sockaddrOf(vip, 9)); err != nil {
			return err
		}
		tx, err := unix.Socket(af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(tx) }()
		if err := unix.Bind(tx, sockaddrOf(src, 0)); err != nil {
			return err
		}
		for range n {
			if err := unix.Sendto(tx, []byte("count me"), 0, sockaddrOf(vip, 9)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("send %d datagrams %s -> %s: %v", n, src, vip, err)
	}
}

// assertCounter checks one tunnel IP's counters as Counters reads them.
func assertCounter(t *testing.T, step string, c *Chain, vip netip.Addr, want Counter) {
	t.Helper()
	counters, err := c.Counters()
	if err != nil {
		t.Fatalf("%s: Counters: %v", step, err)
	}
	if got := counters[vip]; got != want {
		t.Errorf("%s: Counters[%s] = %+v, want %+v (all: %v)", step, vip, got, want, counters)
	}
}

// TestSyncManyVIPsInNetns syncs 10 tunnel IPs into a fresh namespace
// with each backend, then 10,000: the chains hold the same rules (the
// number of rules a packet walks does not grow with the tunnel IPs), one
// set element per tunnel IP and set is written, a restarted Chain writes
// nothing, and swapping one tunnel IP for another changes 4 set elements
// and no rule.
func TestSyncManyVIPsInNetns(t *testing.T) {
	for _, binary := range iptablesBinaries {
		t.Run(binary, func(t *testing.T) { testSyncManyVIPsInNetns(t, binary) })
	}
}

func testSyncManyVIPsInNetns(t *testing.T, binary string) {
	const n = 10000
	ns := testnetns.New(t)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	params := Params{Buckets: 64, Offset: 0x100, Seed: 0xc0ffee}
	rulesOf := func() string {
		return ns.Run(binary, "-t", "mangle", "-S", DefaultChainName) + ns.Run(binary, "-t", "mangle", "-S", ParentChain)
	}
	sync := func(step string, vips []netip.Addr, want, wantIPT, wantRestores int) {
		t.Helper()
		chain, err := NewChain(ipt, ns.IPSets(), "", params, restorer)
		if err != nil {
			t.Fatalf("NewChain: %v", err)
		}
		ipt.Writes, restorer.Calls = 0, 0
		start := time.Now()
		changed, err := chain.Sync(targetsOf(vips...))
		took := time.Since(start)
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		t.Logf("%s: %s: Sync of %d tunnel IPs took %v (changed %d)", binary, step, len(vips), took, changed)
		if changed != want || ipt.Writes != wantIPT || restorer.Calls != wantRestores {
			t.Errorf("%s: Sync changed = %d with %d iptables writes and %d restores, want %d with %d and %d",
				step, changed, ipt.Writes, restorer.Calls, want, wantIPT, wantRestores)
		}
		assertKernelChain(t, step, ns, chain, vips)
	}

	few := manyVIPs(10)
	sync("first sync of 10", few, 2+2*len(few)+1+1+2, 2, 1)
	rulesWithFew := rulesOf()
	vips := manyVIPs(n)
	sync("10,000", vips, 2*(n-len(few)), 0, 0)
	if got := rulesOf(); got != rulesWithFew {
		t.Errorf("the rules changed between 10 and %d tunnel IPs:\n%s\nwant, as with 10:\n%s", n, got, rulesWithFew)
	}
	t.Logf("rules with 10 and with %d tunnel IPs:\n%s", n, rulesWithFew)
	sync("adoption by a new Chain", vips, 0, 0, 0)
	swapped := slices.Concat(vips[1:], []netip.Addr{netip.MustParseAddr("10.200.0.1")})
	sync("one tunnel IP removed, one added", swapped, 4, 0, 0)
}

// assertKernelChain checks what c owns in the kernel, stateless with every
// tunnel IP in generation 0: its chain holds exactly the exit rule and the
// generation's HMARK rule, both sets hold exactly vips, and PREROUTING
// one jump to the chain.
func assertKernelChain(t *testing.T, step string, ns *testnetns.NS, c *Chain, vips []netip.Addr) {
	t.Helper()
	want := c.mangleRules([]int{0}, false)
	rules, err := c.listRules(Table, c.name)
	if err != nil {
		t.Fatalf("%s: list chain: %v", step, err)
	}
	same := len(rules) == len(want)
	for i := 0; same && i < len(rules); i++ {
		same = sameRule(rules[i].spec, want[i])
	}
	if !same {
		t.Errorf("%s: chain %s holds %v, want %v", step, c.name, rules, want)
	}
	wantVIPs := slices.SortedFunc(slices.Values(vips), netip.Addr.Compare)
	for _, set := range []string{c.allSetName(), c.generationSetName(0)} {
		got, err := ipsetstate.Members(ns.IPSets(), set)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, wantVIPs) {
			t.Errorf("%s: set %s holds %d tunnel IPs, want %d", step, set, len(got), len(wantVIPs))
		}
	}
	pre, err := c.ipt.List(Table, ParentChain)
	if err != nil {
		t.Fatalf("%s: list %s: %v", step, ParentChain, err)
	}
	jumps := 0
	for _, line := range pre {
		if strings.Contains(line, "-j "+c.name) {
			jumps++
		}
	}
	if jumps != 1 {
		t.Errorf("%s: %d jumps to %s in %s, want 1:\n%s", step, jumps, c.name, ParentChain, strings.Join(pre, "\n"))
	}
}

// withoutChain drops from `iptables -S` output every line that creates,
// fills or jumps to chain.
func withoutChain(s, chain string) string {
	var keep []string
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, " "+chain) && (strings.HasPrefix(line, "-N "+chain) ||
			strings.HasPrefix(line, "-A "+chain+" ") || strings.HasSuffix(line, "-j "+chain)) {
			continue
		}
		keep = append(keep, line)
	}
	return strings.Join(keep, "\n")
}
