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
// Chain on the kernel: spoofed SYNs to the tunnel IP from 10.9.0.0/16,
// more distinct (address, port) pairs than a SYN set holds, as fast as one
// raw socket sends them. Then:
//
//   - the handshake memory stays bounded: the SYN set of the tunnel IP's
//     class holds at most SynSetMaxElements entries (full), and conntrack
//     holds no entry for the flood (its SYNs are untracked);
//   - TCP connection A, open before the flood, keeps generation 0 for all
//     its packets, across a change to generation 1 made while the set is
//     full; so does B, opened while the set is full (its SYN is not
//     remembered, its next packet is hashed alike and saved in conntrack);
//   - a connection opened after the change (F's port) takes generation 1;
//   - the limit, as documented (SynSetMaxElements): H, whose SYN passes
//     while the set is full and whose next packet passes after the change,
//     is split: its SYN in generation 0, the rest in generation 1.
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
	// Send until the set stops growing: full.
	start := time.Now()
	sent, entries := 0, 0
	for batch := SynSetMaxElements / 4; sent < 3*SynSetMaxElements; {
		flood(sent, batch)
		sent += batch
		n, _ := synSetHeader(t, r, synSet)
		if n == entries || n >= SynSetMaxElements {
			entries = n
			break
		}
		entries = n
	}
	took := time.Since(start)
	_, memory := synSetHeader(t, r, synSet)
	t.Logf("flood: %d spoofed SYNs in %v; SYN set %s: full at %d entries (SynSetMaxElements %d), %d bytes in memory", sent, took.Round(time.Millisecond), synSet, entries, SynSetMaxElements, memory)
	if entries > SynSetMaxElements {
		t.Errorf("SYN set %s holds %d entries, more than its bound %d", synSet, entries, SynSetMaxElements)
	}
	if entries == 0 {
		t.Fatalf("the flood left SYN set %s empty", synSet)
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
	if e, _ := synSetHeader(t, r, synSet); e < entries*9/10 {
		t.Fatalf("SYN set %s emptied to %d entries before the change (the test was too slow)", synSet, e)
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
