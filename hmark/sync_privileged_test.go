package hmark

// Privileged tests of Sync, Counters and Cleanup: each runs in a fresh
// network namespace of its own (see test/support/testnetns), with the real
// iptables binaries of both backends. They skip when not root or when
// iptables is missing.

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"

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

// nsRestorer runs the iptables-restore matching an iptables binary inside
// a test namespace, and counts its calls independently of what the code
// under test reports.
type nsRestorer struct {
	ns    *testnetns.NS
	exec  *ExecRestorer
	Calls int
}

func newNSRestorer(ns *testnetns.NS, iptablesBinary string) *nsRestorer {
	return &nsRestorer{ns: ns, exec: NewExecRestorer(iptablesBinary)}
}

// Restore is ExecRestorer.Restore inside the namespace.
func (r *nsRestorer) Restore(table string, payload []byte) error {
	r.Calls++
	return r.ns.Do(func() error { return r.exec.Restore(table, payload) })
}

// lineChanges is the number of lines that differ between two outputs of
// `iptables -S`, counted as a multiset: what was added plus what was
// removed. It measures a Sync's changes independently of its count.
func lineChanges(before, after string) int {
	count := make(map[string]int)
	for _, l := range strings.Split(before, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(after, "\n") {
		count[l]--
	}
	n := 0
	for _, c := range count {
		n += max(c, -c)
	}
	return n
}

// iptablesBinaries are the two backends: nft, and legacy.
var iptablesBinaries = []string{"iptables", "iptables-legacy"}

// TestSyncInNetns drives Chain against the real iptables of each backend in
// a fresh namespace: creation, adoption by a new Chain with no write,
// repair of a rule deleted by hand, removal of a rule added by hand to the
// chain, rules of other chains left alone, counters, and Cleanup.
func TestSyncInNetns(t *testing.T) {
	for _, binary := range iptablesBinaries {
		t.Run(binary, func(t *testing.T) { testSyncInNetns(t, binary) })
	}
}

func testSyncInNetns(t *testing.T, binary string) {
	ns := testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	params := Params{Buckets: 16, Offset: 0x100, Seed: 0xc0ffee}
	vips := kernelVIPs
	mangleS := func() string { return ns.Run(binary, "-t", "mangle", "-S") }
	newChain := func() *Chain {
		t.Helper()
		c, err := NewChain(ipt, "", params, restorer)
		if err != nil {
			t.Fatalf("NewChain: %v", err)
		}
		return c
	}

	// Rules of others, in another chain of mangle and in PREROUTING itself.
	ns.Run(binary, "-t", "mangle", "-N", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "OPERATOR", "-d", "10.1.1.1/32", "-j", "MARK", "--set-mark", "5")
	ns.Run(binary, "-t", "mangle", "-A", "FORWARD", "-j", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-m", "comment", "--comment", "someone else", "-j", "MARK", "--set-mark", "9")
	before := mangleS()
	othersUntouched := func(step string) {
		t.Helper()
		if got := withoutChain(mangleS(), DefaultChainName); got != before {
			t.Errorf("%s: rules outside %s changed:\n got: %s\nwant: %s", step, DefaultChainName, got, before)
		}
	}

	chain := newChain()
	// syncExpect syncs and checks the changes Sync reports against the
	// lines that changed in `iptables -S`, and the writes iptables and
	// iptables-restore saw: wantIPT of the changes go through go-iptables
	// (chain and jump) and the rest through at most one restore.
	syncExpect := func(step string, c *Chain, want, wantIPT int) {
		t.Helper()
		ipt.Writes, restorer.Calls = 0, 0
		before := mangleS()
		changed, err := c.Sync(targetsOf(vips...))
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		wantRestores := 0
		if want > wantIPT {
			wantRestores = 1
		}
		if diff := lineChanges(before, mangleS()); changed != want || diff != want {
			t.Errorf("%s: Sync changed = %d (%d lines of iptables -S changed), want %d", step, changed, diff, want)
		}
		if ipt.Writes != wantIPT || restorer.Calls != wantRestores {
			t.Errorf("%s: iptables saw %d writes and iptables-restore %d calls, want %d and %d",
				step, ipt.Writes, restorer.Calls, wantIPT, wantRestores)
		}
		assertKernelChain(t, step, ipt, params, vips)
		othersUntouched(step)
	}

	syncExpect("first sync", chain, 1+1+len(vips), 2)
	t.Logf("%s prints the router's rules as:\n%s", binary, ns.Run(binary, "-t", "mangle", "-S", DefaultChainName))

	adopter := newChain()
	syncExpect("adoption by a new Chain", adopter, 0, 0)

	ns.Run(binary, "-t", "mangle", "-D", DefaultChainName, "2")
	syncExpect("rule deleted by hand", adopter, 1, 0)

	ns.Run(binary, "-t", "mangle", "-I", DefaultChainName, "2", "-j", "MARK", "--set-mark", "3")
	ns.Run(binary, "-t", "mangle", "-A", DefaultChainName, "-d", vips[0].String()+"/32",
		"-j", "HMARK", "--hmark-tuple", "src,dst", "--hmark-mod", "16", "--hmark-offset", "256", "--hmark-rnd", "0xc0ffee")
	syncExpect("foreign rules added by hand to the chain", adopter, 2, 0)

	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-i", "lo", "-j", DefaultChainName)
	syncExpect("second jump added by hand", adopter, 1, 1)

	// One datagram to a tunnel IP shows up in the counters.
	sendDatagrams(t, ns, vipAbove, 1)
	counters, err := adopter.Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	if len(counters) != len(vips) {
		t.Errorf("Counters has %d tunnel IPs, want %d: %v", len(counters), len(vips), counters)
	}
	if c := counters[vipAbove]; c.Packets != 1 || c.Bytes != 28+8 {
		t.Errorf("Counters[%s] = %+v, want 1 packet of 36 bytes", vipAbove, c)
	}
	if c := counters[vipBelow]; c.Packets != 0 {
		t.Errorf("Counters[%s] = %+v, want no packet", vipBelow, c)
	}

	// Another tunnel IP removed, then added back, then the chain repaired
	// (each a restore): the tunnel IP's counters stay.
	all := vips
	vips = []netip.Addr{vipLoopback, vipAbove}
	syncExpect("a tunnel IP removed", adopter, 1, 0)
	assertCounter(t, "a tunnel IP removed", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})
	vips = all
	syncExpect("the tunnel IP added back", adopter, 1, 0)
	assertCounter(t, "the tunnel IP added back", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})
	ns.Run(binary, "-t", "mangle", "-I", DefaultChainName, "1", "-j", "MARK", "--set-mark", "3")
	syncExpect("foreign rule removed", adopter, 1, 0)
	assertCounter(t, "foreign rule removed", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})

	if err := adopter.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if got := mangleS(); got != before {
		t.Errorf("after Cleanup, mangle is\n%s\nwant what it was before the router:\n%s", got, before)
	}
	if err := chain.Cleanup(); err != nil {
		t.Errorf("second Cleanup (nothing left): %v", err)
	}
}

// sendDatagrams sends n datagrams of 8 bytes (36 with the headers) from
// 127.0.0.1 to vip:9 inside ns, where a socket bound to vip receives them
// (so that no ICMP error goes back to the same address). Sent over lo,
// they come back in through PREROUTING.
func sendDatagrams(t *testing.T, ns *testnetns.NS, vip netip.Addr, n int) {
	t.Helper()
	err := ns.Do(func() error {
		rx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(rx) }()
		if err := unix.Bind(rx, sockaddr(vip, 9)); err != nil {
			return err
		}
		tx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(tx) }()
		if err := unix.Bind(tx, sockaddr(netip.MustParseAddr("127.0.0.1"), 0)); err != nil {
			return err
		}
		for range n {
			if err := unix.Sendto(tx, []byte("count me"), 0, sockaddr(vip, 9)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("send %d datagrams to %s: %v", n, vip, err)
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

// TestSyncManyVIPsInNetns syncs 10,000 tunnel IPs into a fresh namespace
// with each backend: one iptables-restore writes them all, a restarted
// Chain writes nothing, and swapping one tunnel IP for another changes 2.
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
	vips := manyVIPs(n)
	sync := func(step string, vips []netip.Addr, want, wantIPT, wantRestores int) {
		t.Helper()
		chain, err := NewChain(ipt, "", params, restorer)
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
		out := ns.Run(binary, "-t", "mangle", "-S", DefaultChainName)
		if got := strings.Count(out, " -j HMARK "); got != len(vips) {
			t.Errorf("%s: %s -t mangle -S %s has %d HMARK rules, want %d", step, binary, DefaultChainName, got, len(vips))
		}
		assertKernelChain(t, step, ipt, params, vips)
	}

	sync("first sync", vips, 1+1+n, 2, 1)
	sync("adoption by a new Chain", vips, 0, 0, 0)
	swapped := slices.Concat(vips[1:], []netip.Addr{netip.MustParseAddr("10.200.0.1")})
	sync("one tunnel IP removed, one added", swapped, 2, 0, 1)
}

// assertKernelChain checks the chain in the kernel: one parsed rule per
// tunnel IP with params, nothing else, and one jump from PREROUTING.
func assertKernelChain(t *testing.T, step string, ipt IPTables, params Params, vips []netip.Addr) {
	t.Helper()
	lines, err := ipt.List(Table, DefaultChainName)
	if err != nil {
		t.Fatalf("%s: list chain: %v", step, err)
	}
	var got []netip.Addr
	for _, line := range lines {
		r, ok, err := parseRule(line, DefaultChainName, false)
		if err != nil || !ok {
			continue
		}
		vip, p, ok := r.vipRule()
		if !ok || p != params {
			t.Errorf("%s: unexpected rule in chain: %s", step, line)
			continue
		}
		got = append(got, vip)
	}
	slices.SortFunc(got, netip.Addr.Compare)
	want := slices.SortedFunc(slices.Values(vips), netip.Addr.Compare)
	if !slices.Equal(got, want) {
		t.Errorf("%s: chain has rules for %v, want %v", step, got, want)
	}
	pre, err := ipt.List(Table, ParentChain)
	if err != nil {
		t.Fatalf("%s: list %s: %v", step, ParentChain, err)
	}
	jumps := 0
	for _, line := range pre {
		if strings.Contains(line, "-j "+DefaultChainName) {
			jumps++
		}
	}
	if jumps != 1 {
		t.Errorf("%s: %d jumps to %s in %s, want 1:\n%s", step, jumps, DefaultChainName, ParentChain, strings.Join(pre, "\n"))
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
