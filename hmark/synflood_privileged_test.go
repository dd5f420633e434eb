package hmark

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/lab/attack"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestStickySYNFloodInNetns sends a SYN flood for real through a sticky
// Chain on the kernel, whose sets are created as the router creates them
// (KernelSets): spoofed SYNs to the tunnel IP from 10.9.0.0/16, more
// distinct (address, port) pairs than a SYN set holds, as fast as one raw
// socket sends them, until the set stops growing. Then:
//
//   - the handshake memory is full and stays bounded: the SYN set of the
//     tunnel IP's class holds at least 99% of SynSetMaxElements (90% when
//     the flood outlasts SynMemorySeconds on a loaded machine) and no
//     more than that and 1% (about 131,500: the kernel lets racing adds
//     pass maxelem by a few hundred; created with the default 1024
//     buckets instead, it would be full at 12,288: the kernel does not
//     grow a set from the packet path), and conntrack holds no entry of
//     the flood (its SYNs are untracked);
//   - TCP connection A, open before the flood, keeps generation 0 for all
//     its packets, across a change to generation 1 made while the set is
//     full; so does B, opened while the set is full (its SYN is not
//     remembered, its next packet is hashed alike and saved in conntrack);
//   - a connection opened after the change (F's port) takes generation 1;
//   - the limit, as documented: H, whose SYN passes while the set is full
//     and whose next packet passes after the change, is split: its SYN in
//     generation 0, the rest in generation 1 (unless its SYN found room).
//
// It logs how long the flood took and the set's size in memory.
func TestStickySYNFloodInNetns(t *testing.T) {
	const binary = "iptables"
	c, r, chain, ipt := newStickyDrainingLab(t, binary)
	synSet := chain.synSetName(0)

	connA := dialVIP(t, c, portA)
	roundTrips(t, "A", connA, 3)

	// The flood: distinct spoofed sources, to a port nothing listens on
	// (the server resets them; its answers are not routed back).
	flood := func(from, n int) {
		packets := make([][]byte, n)
		for i := range packets {
			k := from + i
			src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 9, byte(k >> 16), byte(k >> 8)}), uint16(1024+k&0xff))
			packets[i] = attack.TCPSyn(src, netip.AddrPortFrom(labVIP, 9), uint32(k))
		}
		if err := attack.SendRaw(c.Handle, packets); err != nil {
			t.Fatalf("flood: %v", err)
		}
	}
	// Send until the set stops growing: full. Entries live
	// SynMemorySeconds; on a loaded machine (CI runs packages side by
	// side) the flood can outlast that, and the kernel's garbage
	// collection then frees the oldest third of the set at a time while
	// the flood refills it. So the set's size is sampled often and its
	// peak is what is checked.
	start := time.Now()
	sent, entries, peak := 0, 0, 0
	for batch := SynSetMaxElements / 16; sent < 3*SynSetMaxElements; {
		flood(sent, batch)
		sent += batch
		n, _ := synSetHeader(t, r, synSet)
		peak = max(peak, n)
		if n == entries || n >= SynSetMaxElements {
			entries = n
			break
		}
		entries = n
	}
	took := time.Since(start)
	_, memory := synSetHeader(t, r, synSet)
	t.Logf("flood: %d spoofed SYNs in %v; SYN set %s: full at %d entries, peak %d (SynSetMaxElements %d), %d bytes in memory", sent, took.Round(time.Millisecond), synSet, entries, peak, SynSetMaxElements, memory)
	// The kernel checks maxelem before an add without holding the set's
	// lock across CPUs, so adds racing on both CPUs pass it by a few
	// hundred.
	if peak > SynSetMaxElements*101/100 {
		t.Errorf("SYN set %s held %d entries, more than its bound %d (and 1%%)", synSet, peak, SynSetMaxElements)
	}
	// Measured: full at 131,440 to 131,623 entries. With fewer buckets
	// than SynSetHashSize it would stop short: at 12,288 with the
	// kernel's default 1024, at 98,304 (75%) with 8192. A flood that
	// outlasted its first entries (measured on a loaded CI machine: 22 s,
	// last sample 128,634) is held to 90%, still above any shorter hash.
	want := SynSetMaxElements * 99 / 100
	if took > SynMemorySeconds*time.Second {
		want = SynSetMaxElements * 90 / 100
		t.Logf("the flood outlasted the SYN set's timeout (%ds): its first entries expired while it ran; want a peak of at least %d", SynMemorySeconds, want)
	}
	if peak < want {
		t.Fatalf("the flood filled SYN set %s at a peak of %d entries, want at least %d (SynSetMaxElements %d): %s", synSet, peak, want, SynSetMaxElements, r.Run("ipset", "list", "-terse", synSet))
	}
	ct := conntrackOf(t, r)
	if n := ct.countFrom(t, netip.MustParsePrefix("10.9.0.0/16")); n != 0 {
		t.Errorf("conntrack holds %d entries of the flood, want none (SYNs are untracked)", n)
	}

	// While the set is full (its entries live SynMemorySeconds).
	roundTrips(t, "A", connA, 2)
	connB := dialVIP(t, c, portB)
	roundTrips(t, "B", connB, 3)
	holdH := []string{"-t", "filter", "OUTPUT", "-p", "tcp", "--sport", fmt.Sprint(portH), "!", "--syn", "-j", "DROP"}
	c.Run(binary, slices.Insert(slices.Clone(holdH), 2, "-A")...)
	connH := dialVIP(t, c, portH)
	// The checks below hold whether or not the set is still full (H's
	// SYN found room or not); on a loaded machine it may no longer be.
	if e, _ := synSetHeader(t, r, synSet); e < want {
		t.Logf("SYN set %s emptied to %d entries before the change (its entries expire after %ds; the machine was slow): the checks below ran with room in the set", synSet, e, SynMemorySeconds)
	}
	_, testErr := r.Output("ipset", "test", synSet, fmt.Sprintf("%s,tcp:%d,%s", labClient, portH, labVIP))
	hRemembered := testErr == nil
	if _, err := chain.Sync([]Target{{VIP: labVIP, Offset: 0x1040}}); err != nil {
		t.Fatalf("Sync generation 1: %v", err)
	}
	c.Run(binary, slices.Insert(slices.Clone(holdH), 2, "-D")...)
	roundTrips(t, "H", connH, 3)
	roundTrips(t, "A", connA, 3)
	roundTrips(t, "B", connB, 3)
	connF := dialVIP(t, c, portF)
	roundTrips(t, "F", connF, 3)

	got := readCounters(t, ipt)
	t.Logf("counters: %v", got)
	for _, f := range []string{"A", "B"} {
		if got[f+" all"] == 0 || got[f+" gen0"] != got[f+" all"] || got[f+" gen1"] != 0 {
			t.Errorf("%s: %d packets, %d in generation 0, %d in generation 1; want all in generation 0", f, got[f+" all"], got[f+" gen0"], got[f+" gen1"])
		}
	}
	if got["F all"] == 0 || got["F gen1"] != got["F all"] || got["F gen0"] != 0 {
		t.Errorf("F (opened after the change): %d packets, %d in generation 1, %d in generation 0; want all in generation 1", got["F all"], got["F gen1"], got["F gen0"])
	}
	switch {
	case hRemembered:
		// A full set's bucket had room for H's SYN.
		t.Logf("H's SYN was remembered although the set was full")
		if got["H all"] < 4 || got["H gen0"] != got["H all"] || got["H gen1"] != 0 {
			t.Errorf("H (SYN remembered, the rest after the change): %d packets, %d in generation 0, %d in generation 1; want all in generation 0", got["H all"], got["H gen0"], got["H gen1"])
		}
	case got["H syn gen0"] != 1 || got["H gen1"] == 0 || got["H gen0"] != 1:
		t.Errorf("H (SYN not remembered, the set being full; the rest after the change): SYN in generation 0 %d, %d packets in generation 0, %d in generation 1; want the documented split: the SYN alone in generation 0", got["H syn gen0"], got["H gen0"], got["H gen1"])
	}
	if got["unmarked"] != 0 {
		t.Errorf("%d packets to %s forwarded without a mark in %s, want none", got["unmarked"], labVIP, labBlock)
	}
}

// synSetHeader returns the number of entries of ipset set in r and its
// size in memory, as `ipset list -terse` prints them.
func synSetHeader(t *testing.T, r *testnetns.NS, set string) (entries, memory int) {
	t.Helper()
	out := r.Run("ipset", "list", "-terse", set)
	for _, line := range strings.Split(out, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(v))
		switch strings.TrimSpace(k) {
		case "Number of entries":
			if err != nil {
				t.Fatalf("ipset list %s: %q", set, line)
			}
			entries = n
		case "Size in memory":
			memory = n
		}
	}
	return entries, memory
}

// countFrom counts r's conntrack entries whose original source is in p.
func (ct conntrack) countFrom(t *testing.T, p netip.Prefix) int {
	t.Helper()
	flows, err := ct.h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatalf("list conntrack in r: %v", err)
	}
	n := 0
	for _, f := range flows {
		if a, ok := netip.AddrFromSlice(f.Forward.SrcIP.To4()); ok && p.Contains(a) {
			n++
		}
	}
	return n
}

// TestKernelSetsCreateHashSize: a set KernelSets creates has the hashsize,
// maxelem, timeout, type and family asked for, as the kernel lists it; a
// second create of the name fails.
func TestKernelSetsCreateHashSize(t *testing.T) {
	ns := testnetns.New(t)
	sets := KernelSets{Handle: ns.IPSets(), NetNS: ns.Handle}
	timeout := uint32(10)
	opts := netlink.IpsetCreateOptions{Family: unix.AF_INET6, MaxElements: 5000, Timeout: &timeout}
	if err := sets.IpsetCreateHashSize("kst-sized", SynSetType, opts, 4096); err != nil {
		t.Fatal(err)
	}
	got, err := sets.IpsetList("kst-sized")
	if err != nil {
		t.Fatal(err)
	}
	if got.TypeName != SynSetType || got.Family != unix.AF_INET6 || got.HashSize != 4096 || got.MaxElements != 5000 || got.Timeout == nil || *got.Timeout != 10 {
		t.Errorf("listed %s family %d hashsize %d maxelem %d timeout %v; want %s family %d hashsize 4096 maxelem 5000 timeout 10",
			got.TypeName, got.Family, got.HashSize, got.MaxElements, got.Timeout, SynSetType, unix.AF_INET6)
	}
	if err := sets.IpsetCreateHashSize("kst-sized", SynSetType, opts, 4096); err == nil {
		t.Error("a second create of kst-sized succeeded")
	}
}

// TestSynSetsEnlargedOnRestart: SYN sets an earlier version created with
// the kernel's default 1024 buckets (IpsetCreate) are replaced, when the
// router restarts with KernelSets, by sets of SynSetHashSize buckets,
// under the same names and with the rules that use them untouched, and a
// connection through the chain still works after it.
func TestSynSetsEnlargedOnRestart(t *testing.T) {
	const binary = "iptables"
	c, r, s := newDrainingLab(t)
	ipt := r.IPTables(binary)
	params := Params{Buckets: 64, Offset: 0x1000, Seed: 0x5eed}
	sticky := &Sticky{Block: 0x1000, Mask: 0xffffff00, Generations: 2}
	start := func(sets IPSets) *Chain {
		t.Helper()
		chain, err := NewChain(ipt, sets, "", params, newNSRestorer(r, binary))
		if err != nil {
			t.Fatalf("NewChain: %v", err)
		}
		if err := chain.SetSticky(sticky); err != nil {
			t.Fatalf("SetSticky: %v", err)
		}
		if _, err := chain.Sync([]Target{{VIP: labVIP, Offset: 0x1000}}); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		return chain
	}
	hashSizes := func(chain *Chain) map[string]uint32 {
		out := map[string]uint32{}
		for _, k := range chain.synClasses() {
			res, err := r.IPSets().IpsetList(chain.synSetName(k))
			if err != nil {
				t.Fatal(err)
			}
			out[res.SetName] = res.HashSize
		}
		return out
	}
	old := start(r.IPSets()) // the earlier version: IpsetCreate
	for name, size := range hashSizes(old) {
		if size >= SynSetHashSize {
			t.Fatalf("set %s created with IpsetCreate has hashsize %d: the test needs a smaller one", name, size)
		}
	}
	rulesBefore := r.Run(binary, "-t", "mangle", "-S", old.Name())

	restarted := start(KernelSets{Handle: r.IPSets(), NetNS: r.Handle})
	sizes := hashSizes(restarted)
	if len(sizes) != 4 {
		t.Errorf("SYN sets %v, want 4 (2 generations, both tuples)", sizes)
	}
	for name, size := range sizes {
		if size != SynSetHashSize {
			t.Errorf("after the restart set %s has hashsize %d, want %d", name, size, SynSetHashSize)
		}
	}
	if after := r.Run(binary, "-t", "mangle", "-S", restarted.Name()); after != rulesBefore {
		t.Errorf("the restart changed the rules:\nbefore:\n%s\nafter:\n%s", rulesBefore, after)
	}
	if leftover := r.Run("ipset", "list", "-n"); strings.Contains(leftover, "-r\n") {
		t.Errorf("a temporary set is left: %s", leftover)
	}
	startEchoServers(t, s)
	roundTrips(t, "A", dialVIP(t, c, portA), 3)
}
