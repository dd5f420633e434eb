package hmark

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// Sticky test setup: two generations of 16 buckets in the block
// 0x1000/0xffffff00, generation 0 at 0x1000 (the chain's own offset),
// generation 1 at 0x1010.
var (
	stickyParams = Params{Buckets: 16, Offset: 0x1000, Seed: 0xc0ffee}
	testSticky   = Sticky{Block: 0x1000, Mask: 0xffffff00, TCPMinExpire: 120}
)

const (
	gen0 = 0x1000
	gen1 = 0x1010
)

// Lines as iptables v1.8.9 (nft and legacy alike, Linux 6.18) printed the
// sticky rules for stickyParams and testSticky.
const (
	printedRestoreTCP   = "-A KST-HMARK -p tcp -m connmark --mark 0x1000/0xffffff00 -m conntrack --ctexpire 121:4294967295 -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	printedRestoreOther = "-A KST-HMARK ! -p tcp -m connmark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	printedReturn       = "-A KST-HMARK -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j RETURN"
	printedSave         = "-A KST-HMARK -m connmark --mark 0x0 -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	printedRawChainN    = "-t raw -N KST-HMARK"
	printedRawJump      = "-t raw -A PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"
	printedSynChainN    = "-t raw -N KST-HMARK-SYN"
	printedSynRule      = "-t raw -A KST-HMARK-SYN -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack"
)

// rawOthersLines are rules of others in the raw table.
var rawOthersLines = []string{
	"-t raw -A PREROUTING -p udp -m udp --dport 53 -j CT --notrack",
	"-t raw -N OPERATOR",
	"-t raw -A OPERATOR -d 10.96.0.10/32 -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack",
}

// printedStickyRule is the HMARK rule for vip with offset, as iptables
// prints it (decimal offset).
func printedStickyRule(vip netip.Addr, offset uint32) string {
	return fmt.Sprintf("-A KST-HMARK -d %s/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset %d", vip, offset)
}

// printedRawRule is vip's rule in the raw chain, to the SYN subchain, as
// iptables prints it.
func printedRawRule(vip netip.Addr) string {
	return fmt.Sprintf("-t raw -A KST-HMARK -d %s/32 -m comment --comment kube-service-tunnel -j KST-HMARK-SYN", vip)
}

// printedLegacyRawRule is the notrack rule for vip that an older version
// wrote in the raw chain, as iptables prints it.
func printedLegacyRawRule(vip netip.Addr) string {
	return fmt.Sprintf("-t raw -A KST-HMARK -d %s/32 -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack", vip)
}

// stickyLines is the printed sticky state (the three chains, both jumps)
// for targets, in the order Chain writes it; the SYN subchain comes last.
func stickyLines(targets ...Target) []string {
	lines := []string{printedChainN, printedJump, printedRestoreTCP, printedRestoreOther, printedReturn}
	for _, t := range targets {
		lines = append(lines, printedStickyRule(t.VIP, t.Offset))
	}
	lines = append(lines, printedSave, printedRawChainN, printedRawJump)
	for _, t := range targets {
		lines = append(lines, printedRawRule(t.VIP))
	}
	return append(lines, printedSynChainN, printedSynRule)
}

// legacyStickyLines is the printed sticky state an older version left for
// targets: no SYN subchain, a notrack rule per tunnel IP in the raw chain.
func legacyStickyLines(targets ...Target) []string {
	var lines []string
	for _, l := range stickyLines(targets...) {
		switch {
		case l == printedSynChainN || l == printedSynRule:
		case strings.HasPrefix(l, "-t raw -A KST-HMARK -d "):
			vip := netip.MustParsePrefix(strings.Fields(l)[5]).Addr()
			lines = append(lines, printedLegacyRawRule(vip))
		default:
			lines = append(lines, l)
		}
	}
	return lines
}

// stickyState is both tables, as dumpTable prints them, once a sticky
// Chain has synced targets (sorted, offsets explicit) on top of the rules
// of others.
func stickyState(t *testing.T, targets ...Target) (mangle, raw string) {
	t.Helper()
	f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, stickyLines(targets...))...)
	return f.dumpTable("mangle"), f.dumpTable("raw")
}

// samePrerouting compares two dumps of a table, ignoring the order of the
// rules in PREROUTING (Chain inserts its jump first, or keeps it where it
// finds it); every other chain must be identical, order included (the
// sticky chain's order matters).
func samePrerouting(a, b string) bool {
	return sameIgnoringOrder(a, b, "-A PREROUTING ")
}

// newStickyChain returns a sticky Chain over f.
func newStickyChain(t *testing.T, f *fakeIPTables) *Chain {
	t.Helper()
	c := newTestChain(t, f, stickyParams)
	if err := c.SetSticky(&testSticky); err != nil {
		t.Fatalf("SetSticky: %v", err)
	}
	return c
}

// newChainInMode returns a Chain over f with stickyParams: sticky (see
// newStickyChain) or stateless.
func newChainInMode(t *testing.T, f *fakeIPTables, sticky bool) *Chain {
	t.Helper()
	if sticky {
		return newStickyChain(t, f)
	}
	return newTestChain(t, f, stickyParams)
}

// checkState compares both tables of f with the sticky state for targets.
func checkState(t *testing.T, step string, f *fakeIPTables, targets ...Target) {
	t.Helper()
	wantMangle, wantRaw := stickyState(t, targets...)
	if got := f.dumpTable("mangle"); !samePrerouting(got, wantMangle) {
		t.Errorf("%s: mangle:\n%s\nwant:\n%s", step, got, wantMangle)
	}
	if got := f.dumpTable("raw"); !samePrerouting(got, wantRaw) {
		t.Errorf("%s: raw:\n%s\nwant:\n%s", step, got, wantRaw)
	}
}

func TestStickySyncFromScratch(t *testing.T) {
	targets := []Target{{VIP: vipB, Offset: gen1}, {VIP: vipA}}
	synced := []Target{{VIP: vipA, Offset: gen0}, {VIP: vipB, Offset: gen1}}
	// chain, SYN subchain and its rule, jump, 2 raw rules in raw; chain,
	// jump, 4 fixed and 2 HMARK rules in mangle.
	const wantChanged = 2 + 4 + 2 + 6
	f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines)...)
	changed, err := newStickyChain(t, f).Sync(targets)
	if err != nil || changed != wantChanged {
		t.Fatalf("Sync = %d, %v; want %d, nil", changed, err, wantChanged)
	}
	checkState(t, "after Sync", f, synced...)
	// The raw rules go in before the mangle rules hash the tunnel IPs.
	checkWrites(t, "Sync", f, []string{
		"new mangle/KST-HMARK", "insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK",
		"new raw/KST-HMARK", "new raw/KST-HMARK-SYN", "restore raw",
		"insert raw/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK",
		"restore raw", "restore mangle",
	})
	wantMangle := `*mangle
:KST-HMARK - [0:0]
-A KST-HMARK -p tcp -m connmark --mark 0x1000/0xffffff00 -m conntrack --ctexpire 121:4294967295 -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A KST-HMARK ! -p tcp -m connmark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A KST-HMARK -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j RETURN
-A KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 4096 --hmark-rnd 0x00c0ffee
-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 4112 --hmark-rnd 0x00c0ffee
-A KST-HMARK -m connmark --mark 0x0 -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
`
	wantSyn := `*raw
:KST-HMARK-SYN - [0:0]
-A KST-HMARK-SYN -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack
COMMIT
`
	wantRaw := `*raw
:KST-HMARK - [0:0]
-A KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j KST-HMARK-SYN
-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j KST-HMARK-SYN
COMMIT
`
	if len(f.restores) != 3 || f.restores[0] != wantSyn || f.restores[1] != wantRaw || f.restores[2] != wantMangle {
		t.Errorf("restore payloads:\n%s\nwant:\n%s%s%s", strings.Join(f.restores, ""), wantSyn, wantRaw, wantMangle)
	}
}

// TestStickyAdoptsWithoutWrites gives a new sticky Chain the state a
// predecessor left, with tunnel IPs on different generations, and expects
// Offsets to report them and Sync with those offsets to write nothing in
// either table.
func TestStickyAdoptsWithoutWrites(t *testing.T) {
	left := []Target{{VIP: vipA, Offset: gen1}, {VIP: vipB, Offset: gen0}, {VIP: vipC, Offset: gen1}}
	hexOffset := slices.Clone(stickyLines(left...))
	for i, l := range hexOffset {
		// Other iptables versions print the offset in hex.
		hexOffset[i] = strings.Replace(l, "--hmark-offset 4112", "--hmark-offset 0x1010", 1)
	}
	for name, lines := range map[string][]string{"decimal offsets": stickyLines(left...), "hex offsets": hexOffset} {
		t.Run(name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, lines)...)
			beforeMangle, beforeRaw := f.dumpTable("mangle"), f.dumpTable("raw")
			c := newStickyChain(t, f)
			offsets, err := c.Offsets()
			if err != nil {
				t.Fatalf("Offsets: %v", err)
			}
			want := map[netip.Addr]uint32{vipA: gen1, vipB: gen0, vipC: gen1}
			if !maps.Equal(offsets, want) {
				t.Errorf("Offsets = %v, want %v", offsets, want)
			}
			var targets []Target
			for vip, offset := range offsets {
				targets = append(targets, Target{VIP: vip, Offset: offset})
			}
			changed, err := c.Sync(targets)
			if err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
			if f.dumpTable("mangle") != beforeMangle || f.dumpTable("raw") != beforeRaw {
				t.Errorf("state changed")
			}
			// Offset 0 means the chain's own offset, generation 0.
			if changed, err := c.Sync([]Target{{VIP: vipA, Offset: gen1}, {VIP: vipB}, {VIP: vipC, Offset: gen1}}); err != nil || changed != 0 {
				t.Errorf("Sync with vip B on offset 0 = %d, %v; want 0, nil", changed, err)
			}
		})
	}
}

// TestSyncPerVIPOffsets moves one tunnel IP to another generation, in
// stateless and in sticky mode: exactly that rule is replaced (changed 2),
// the raw table is not written, and Offsets reads the new offsets back.
func TestSyncPerVIPOffsets(t *testing.T) {
	before := []Target{{VIP: vipA, Offset: gen0}, {VIP: vipB, Offset: gen0}, {VIP: vipC, Offset: gen1}}
	after := []Target{{VIP: vipA, Offset: gen0}, {VIP: vipB, Offset: gen1}, {VIP: vipC, Offset: gen1}}
	for _, sticky := range []bool{false, true} {
		t.Run(fmt.Sprintf("sticky=%v", sticky), func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines)...)
			newChain := func() *Chain { return newChainInMode(t, f, sticky) }
			if offsets, err := newChain().Offsets(); err != nil || len(offsets) != 0 {
				t.Errorf("Offsets without a chain = %v, %v; want empty, nil", offsets, err)
			}
			if _, err := newChain().Sync(before); err != nil {
				t.Fatalf("first Sync: %v", err)
			}
			f.writes = nil
			changed, err := newChain().Sync(after)
			if err != nil || changed != 2 {
				t.Errorf("Sync moving %s to generation 1 = %d, %v; want 2, nil", vipB, changed, err)
			}
			checkWrites(t, "offset change", f, []string{"restore mangle"})
			if sticky {
				checkState(t, "offset change", f, after...)
			}
			offsets, err := newChain().Offsets()
			wantOffsets := map[netip.Addr]uint32{vipA: gen0, vipB: gen1, vipC: gen1}
			if err != nil || !maps.Equal(offsets, wantOffsets) {
				t.Errorf("Offsets = %v, %v; want %v", offsets, err, wantOffsets)
			}
			f.writes = nil
			if changed, err := newChain().Sync(after); err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("second Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

// TestStickyVIPOrdering checks when the raw rules change relative to the
// mangle ones: a new tunnel IP's notrack rule is written before its HMARK
// rule, a removed tunnel IP's after.
func TestStickyVIPOrdering(t *testing.T) {
	tA, tB, tC := Target{VIP: vipA, Offset: gen0}, Target{VIP: vipB, Offset: gen0}, Target{VIP: vipC, Offset: gen1}
	tests := []struct {
		name     string
		from, to []Target
		changed  int
		writes   []string
	}{
		{"add", []Target{tA}, []Target{tA, tB}, 2, []string{"restore raw", "restore mangle"}},
		{"remove", []Target{tA, tB}, []Target{tA}, 2, []string{"restore mangle", "restore raw"}},
		{"add and remove", []Target{tA, tB}, []Target{tA, tC}, 4, []string{"restore raw", "restore mangle", "restore raw"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, stickyLines(tt.from...))...)
			changed, err := newStickyChain(t, f).Sync(tt.to)
			if err != nil || changed != tt.changed {
				t.Errorf("Sync = %d, %v; want %d, nil", changed, err, tt.changed)
			}
			checkWrites(t, "Sync", f, tt.writes)
			checkState(t, "after Sync", f, tt.to...)
			if tt.name == "add and remove" && len(f.restores) == 3 {
				// The first raw restore keeps B's rule (it goes after
				// the mangle rules) and adds C's.
				if got := strings.Count(f.restores[0], "-j KST-HMARK-SYN"); got != 3 || !strings.Contains(f.restores[0], "10.96.0.20/32") {
					t.Errorf("first raw restore has %d rules, want A, B and C:\n%s", got, f.restores[0])
				}
				if strings.Contains(f.restores[2], "10.96.0.20/32") {
					t.Errorf("second raw restore still has B:\n%s", f.restores[2])
				}
			}
			f.writes = nil
			if changed, err := newStickyChain(t, f).Sync(tt.to); err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("second Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

// TestStickyRepairs starts from drifted sticky states: fixed rules out of
// order or missing need a rewrite of the whole mangle chain, a foreign rule
// among the HMARK rules only its removal; each table is restored once, the
// raw one twice when its rules change both ways.
func TestStickyRepairs(t *testing.T) {
	targets := []Target{{VIP: vipA, Offset: gen0}, {VIP: vipB, Offset: gen1}}
	base := stickyLines(targets...) // chain, jump, 3 head, A, B, save, raw...
	swap := func(lines []string, i, j int) []string {
		out := slices.Clone(lines)
		out[i], out[j] = out[j], out[i]
		return out
	}
	without := func(lines []string, i int) []string { return slices.Delete(slices.Clone(lines), i, i+1) }
	foreign := "-A KST-HMARK -d 10.96.0.20/32 -j MARK --set-xmark 0x1010/0xffffffff"
	wrongExpire := strings.Replace(printedRestoreTCP, "121:4294967295", "61:4294967295", 1)
	mangle, raw := []string{"restore mangle"}, []string{"restore raw"}
	tests := []struct {
		name    string
		lines   []string
		changed int
		// writes are prefixes of the expected write calls, in order.
		writes []string
	}{
		{"restore rules swapped", swap(base, 2, 3), 2, mangle},
		{"save rule first", slices.Insert(without(base, 7), 2, printedSave), 2, mangle},
		{"save rule missing", without(base, 7), 1, mangle},
		{"RETURN missing", without(base, 4), 1, mangle},
		{"other TCP expiry", slices.Concat(base[:2], []string{wrongExpire}, base[3:]), 2, mangle},
		{"stateless chain", slices.Concat(base[:2], base[5:7], base[8:]), 4, mangle},
		{"foreign rule among the HMARK rules", slices.Insert(slices.Clone(base), 6, foreign), 1, mangle},
		{"raw duplicate and foreign rule", slices.Concat(base, []string{printedRawRule(vipA), "-t raw -A KST-HMARK -j CT --notrack"}), 2, raw},
		{"raw jump missing", without(base, 9), 1, []string{"insert raw/PREROUTING 1"}},
		{"SYN rule missing", base[:len(base)-1], 1, raw},
		{"SYN subchain missing", base[:len(base)-2], 2, []string{"new raw/KST-HMARK-SYN", "restore raw"}},
		{"foreign rule before the SYN rule", slices.Insert(slices.Clone(base), len(base)-1, "-t raw -A KST-HMARK-SYN -p udp -j CT --notrack"), 1, raw},
		{"raw rules of an older version", legacyStickyLines(targets...), 2 + 2 + 2,
			[]string{"new raw/KST-HMARK-SYN", "restore raw", "restore raw"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, tt.lines)...)
			changed, err := newStickyChain(t, f).Sync(targets)
			if err != nil || changed != tt.changed {
				t.Errorf("Sync = %d, %v; want %d, nil", changed, err, tt.changed)
			}
			checkWrites(t, "Sync", f, tt.writes)
			checkState(t, "after Sync", f, targets...)
			f.writes = nil
			if changed, err := newStickyChain(t, f).Sync(targets); err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("second Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

// TestStickyModeChanges switches a chain from sticky to stateless mode
// and back: leaving sticky mode removes the raw chain and its jump (and
// nothing else of raw), entering it writes them again.
func TestStickyModeChanges(t *testing.T) {
	targets := []Target{{VIP: vipA, Offset: gen0}, {VIP: vipB, Offset: gen0}}
	statelessLines := []string{printedChainN, printedJump, printedStickyRule(vipA, gen0), printedStickyRule(vipB, gen0)}
	stateless := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, statelessLines)...)
	wantStatelessMangle, wantStatelessRaw := stateless.dumpTable("mangle"), stateless.dumpTable("raw")
	f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, stickyLines(targets...))...)
	c := newStickyChain(t, f)
	if err := c.SetSticky(nil); err != nil || c.Sticky() != nil {
		t.Fatalf("SetSticky(nil) = %v, Sticky() = %v; want stateless", err, c.Sticky())
	}
	// Mangle: 4 fixed rules removed; raw: jump, 2 rules, chain,
	// the SYN rule and subchain.
	changed, err := c.Sync(targets)
	if err != nil || changed != 4+6 {
		t.Errorf("sticky -> stateless: Sync = %d, %v; want 10, nil", changed, err)
	}
	if got := f.dumpTable("mangle"); !sameState(got, wantStatelessMangle) {
		t.Errorf("sticky -> stateless: mangle:\n%s\nwant:\n%s", got, wantStatelessMangle)
	}
	if got := f.dumpTable("raw"); got != wantStatelessRaw {
		t.Errorf("sticky -> stateless: raw:\n%s\nwant:\n%s", got, wantStatelessRaw)
	}
	wantTail := []string{"delete raw/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK", "clear raw/KST-HMARK", "delete-chain raw/KST-HMARK",
		"clear raw/KST-HMARK-SYN", "delete-chain raw/KST-HMARK-SYN"}
	if len(f.writes) < len(wantTail) || !slices.Equal(f.writes[len(f.writes)-len(wantTail):], wantTail) {
		t.Errorf("sticky -> stateless: writes %q, want the mangle chain first, then %q", f.writes, wantTail)
	}
	f.writes = nil
	if changed, err := c.Sync(targets); err != nil || changed != 0 || len(f.writes) != 0 {
		t.Errorf("stateless again: Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
	}

	if err := c.SetSticky(&testSticky); err != nil {
		t.Fatalf("SetSticky: %v", err)
	}
	// Raw: chain, SYN subchain and rule, jump, 2 rules; mangle: 4
	// fixed rules.
	if changed, err := c.Sync(targets); err != nil || changed != 4+6 {
		t.Errorf("stateless -> sticky: Sync = %d, %v; want 10, nil", changed, err)
	}
	checkState(t, "stateless -> sticky", f, targets...)
}

// TestStickyLeavesForeignRawJump: in stateless mode, only the canonical
// jump to the raw chain is Chain's to delete; with another rule jumping
// to it, Sync reports that the chain cannot go.
func TestStickyLeavesForeignRawJump(t *testing.T) {
	lines := slices.Concat(othersLines, stickyLines(Target{VIP: vipA, Offset: gen0}), []string{"-t raw -A PREROUTING -i eth0 -j KST-HMARK"})
	f := newFakeIPTables(t, lines...)
	_, err := newTestChain(t, f, stickyParams).Sync(targetsOf(vipA))
	if err == nil || !strings.Contains(err.Error(), "table raw") || !strings.Contains(err.Error(), "KST-HMARK") {
		t.Errorf("Sync = %v, want an error naming the raw chain", err)
	}
	if !slices.Contains(f.writes, "delete raw/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK") ||
		slices.ContainsFunc(f.writes, func(w string) bool { return strings.Contains(w, "-i eth0") }) {
		t.Errorf("writes %q: want the canonical jump deleted and the other one left", f.writes)
	}
}

func TestSetStickyValidates(t *testing.T) {
	tests := []struct {
		name    string
		params  Params
		sticky  Sticky
		wantErr string
	}{
		{"valid", stickyParams, testSticky, ""},
		{"full mask, one bucket", Params{Buckets: 1, Offset: 0x1000, Seed: 1}, Sticky{Block: 0x1000, Mask: math.MaxUint32}, ""},
		{"one-bit mask", Params{Buckets: 16, Offset: 0x10, Seed: 1}, Sticky{Block: 0x10, Mask: 0x10}, ""},
		{"max expiry", stickyParams, Sticky{Block: 0x1000, Mask: 0xffffff00, TCPMinExpire: math.MaxUint32 - 1}, ""},
		{"zero mask", stickyParams, Sticky{Block: 0x1000}, "mask is 0"},
		{"zero block", Params{Buckets: 16, Offset: 1, Seed: 1}, Sticky{Mask: 0xff000000}, "block is 0"},
		{"block outside mask", stickyParams, Sticky{Block: 0x1001, Mask: 0xffffff00}, "outside mask"},
		{"expiry too large", stickyParams, Sticky{Block: 0x1000, Mask: 0xffffff00, TCPMinExpire: math.MaxUint32}, "below 4294967295"},
		{"offset outside block", Params{Buckets: 16, Offset: 0x2000, Seed: 1}, testSticky, "not all in the sticky block"},
		{"marks run past block", Params{Buckets: 0x200, Offset: 0x1000, Seed: 1}, testSticky, "not all in the sticky block"},
		{"last mark leaves block", Params{Buckets: 16, Offset: 0x10f8, Seed: 1}, testSticky, "not all in the sticky block"},
		{"one-bit mask, range crosses it", Params{Buckets: 16, Offset: 0x18, Seed: 1}, Sticky{Block: 0x10, Mask: 0x10}, "not all in the sticky block"},
		{"full mask, two buckets", Params{Buckets: 2, Offset: 0x1000, Seed: 1}, Sticky{Block: 0x1000, Mask: math.MaxUint32}, "not all in the sticky block"},
	}
	for _, tt := range tests {
		c := newTestChain(t, newFakeIPTables(t), tt.params)
		err := c.SetSticky(&tt.sticky)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%s: SetSticky: %v", tt.name, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%s: SetSticky err = %v, want one containing %q", tt.name, err, tt.wantErr)
		case tt.wantErr != "" && c.Sticky() != nil:
			t.Errorf("%s: a failed SetSticky left the chain sticky", tt.name)
		}
	}
}

// TestSyncRejectsTargets: duplicate tunnel IPs, and (in sticky mode)
// offsets whose marks leave the block, fail before any write.
func TestSyncRejectsTargets(t *testing.T) {
	tests := []struct {
		name    string
		sticky  bool
		targets []Target
		wantErr string
	}{
		{"duplicate vip", false, []Target{{VIP: vipA}, {VIP: vipB}, {VIP: vipA, Offset: gen1}}, "10.96.0.10 appears more than once"},
		{"duplicate vip, 4-in-6", true, []Target{{VIP: vipA}, {VIP: netip.AddrFrom16(vipA.As16())}}, "more than once"},
		{"offset outside block", true, []Target{{VIP: vipA}, {VIP: vipB, Offset: 0x2000}}, "vip 10.96.0.20: marks 0x2000-0x200f"},
		{"offset running past block", true, []Target{{VIP: vipB, Offset: 0x10f8}}, "not all in the sticky block"},
		{"offset overflowing", false, []Target{{VIP: vipB, Offset: math.MaxUint32 - 8}}, "overflows"},
	}
	for _, tt := range tests {
		f := newFakeIPTables(t)
		c := newTestChain(t, f, stickyParams)
		if tt.sticky {
			c = newStickyChain(t, f)
		}
		changed, err := c.Sync(tt.targets)
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) || changed != 0 {
			t.Errorf("%s: Sync = %d, %v; want 0 and an error containing %q", tt.name, changed, err, tt.wantErr)
		}
		if len(f.writes) != 0 {
			t.Errorf("%s: writes %q, want none", tt.name, f.writes)
		}
	}
	// Outside the block is fine in stateless mode.
	if _, err := newTestChain(t, newFakeIPTables(t), stickyParams).Sync([]Target{{VIP: vipA, Offset: 0x2000}}); err != nil {
		t.Errorf("stateless Sync with offset 0x2000: %v", err)
	}
}

// TestStickyErrorsRedactSeed fails writes on the new code paths and
// expects errors that wrap the cause, name chain, table and tunnel IP, and
// never show the seed.
func TestStickyErrorsRedactSeed(t *testing.T) {
	tests := []struct {
		name, failWrite string
		want            []string
	}{
		{"raw restore", "restore raw", []string{"table raw"}},
		{"mangle restore", "restore mangle", []string{"table mangle", "--restore-mark"}},
		{"raw jump", "insert raw/PREROUTING", []string{"table raw", "PREROUTING"}},
	}
	for _, tt := range tests {
		f := newFakeIPTables(t, othersLines...)
		f.failWrite = tt.failWrite
		_, err := newStickyChain(t, f).Sync(targetsOf(vipA, vipB))
		if !errors.Is(err, errFake) {
			t.Errorf("%s: Sync err = %v, want it to wrap the iptables error", tt.name, err)
			continue
		}
		for _, w := range append(tt.want, "KST-HMARK") {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: Sync err = %q, want %q in it", tt.name, err, w)
			}
		}
		if strings.Contains(err.Error(), "c0ffee") {
			t.Errorf("%s: Sync err = %q shows the seed", tt.name, err)
		}
	}
}

// TestStickyCleanup removes both chains and both jumps, and nothing of
// others, from a sticky state, a half-written one and an empty one.
func TestStickyCleanup(t *testing.T) {
	full := stickyLines(Target{VIP: vipA, Offset: gen0}, Target{VIP: vipB, Offset: gen1})
	raw := slices.Index(full, printedRawChainN)
	tests := map[string][]string{
		"synced":                full,
		"extra raw jump":        slices.Concat(full, []string{"-t raw -A PREROUTING -i eth0 -g KST-HMARK"}),
		"raw chains only":       full[raw:],
		"mangle chain only":     full[:raw],
		"SYN subchain only":     full[len(full)-2:],
		"older version's state": legacyStickyLines(Target{VIP: vipA, Offset: gen0}),
		"nothing there":         nil,
	}
	for name, lines := range tests {
		t.Run(name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines, lines)...)
			clean := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines)...)
			for range 2 { // the second Cleanup finds nothing to do
				if err := newStickyChain(t, f).Cleanup(); err != nil {
					t.Fatalf("Cleanup: %v", err)
				}
				for _, table := range []string{"mangle", "raw"} {
					if got, want := f.dumpTable(table), clean.dumpTable(table); got != want {
						t.Errorf("%s after Cleanup:\n%s\nwant:\n%s", table, got, want)
					}
				}
			}
		})
	}
}

// TestStickyCounters: in sticky mode, the counters of every tunnel IP's
// raw rule (which every packet to it goes through), not those of the
// HMARK rules (which see only fresh decisions); other raw rules, the SYN
// rule and an older version's rules are left out.
func TestStickyCounters(t *testing.T) {
	lines := slices.Concat(othersLines, rawOthersLines, stickyLines(Target{VIP: vipA, Offset: gen0}, Target{VIP: vipB, Offset: gen1}),
		[]string{printedLegacyRawRule(vipC)})
	f := newFakeIPTables(t, lines...)
	for _, key := range []string{"mangle/KST-HMARK", "raw/KST-HMARK", "raw/KST-HMARK-SYN", "raw/OPERATOR"} {
		rules := f.chains[key]
		for i := range rules {
			rules[i].packets, rules[i].bytes = uint64(10*len(key)+i+1), uint64(1000*len(key)+100*(i+1))
		}
	}
	// raw/KST-HMARK is 13 characters: A's rule is its first, B's its second.
	got, err := newStickyChain(t, f).Counters()
	want := map[netip.Addr]Counter{vipA: {Packets: 131, Bytes: 13100}, vipB: {Packets: 132, Bytes: 13200}}
	if err != nil || !maps.Equal(got, want) {
		t.Errorf("Counters = %v, %v; want %v", got, err, want)
	}
	if len(f.writes) != 0 {
		t.Errorf("Counters wrote %q", f.writes)
	}
}

// TestStickyNeedsRoomForSynChain: the SYN subchain's name is the chain's
// and "-SYN", so a sticky chain's name has at most 24 characters; a
// stateless one keeps the 28 of iptables.
func TestStickyNeedsRoomForSynChain(t *testing.T) {
	f := newFakeIPTables(t)
	for _, tt := range []struct {
		name string
		ok   bool
	}{{strings.Repeat("K", 24), true}, {strings.Repeat("K", 25), false}} {
		c, err := NewChain(f, f, tt.name, stickyParams, f)
		if err != nil {
			t.Fatalf("NewChain(%q): %v", tt.name, err)
		}
		err = c.SetSticky(&testSticky)
		if tt.ok != (err == nil) || (err != nil && (!strings.Contains(err.Error(), tt.name+"-SYN") || c.Sticky() != nil)) {
			t.Errorf("SetSticky on chain %q = %v, sticky %v; want ok: %v (an error naming the subchain)", tt.name, err, c.Sticky(), tt.ok)
		}
		if err := c.Cleanup(); err != nil {
			t.Errorf("Cleanup of chain %q: %v", tt.name, err)
		}
	}
}

// TestCountersSurviveRestores gives every rule of a synced chain counters,
// then restores the chains in ways that leave tunnel IP A in place (B
// removed, C added, A moved to another generation, a foreign rule
// removed), in either mode: Counters reports the same for A after each,
// and the restore payload carries them as "[PACKETS:BYTES]".
func TestCountersSurviveRestores(t *testing.T) {
	for _, sticky := range []bool{false, true} {
		t.Run(fmt.Sprintf("sticky=%v", sticky), func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, rawOthersLines)...)
			newChain := func() *Chain { return newChainInMode(t, f, sticky) }
			tA, tB, tC := Target{VIP: vipA, Offset: gen0}, Target{VIP: vipB, Offset: gen0}, Target{VIP: vipC, Offset: gen0}
			if _, err := newChain().Sync([]Target{tA, tB}); err != nil {
				t.Fatalf("first Sync: %v", err)
			}
			table := "mangle"
			if sticky {
				table = "raw"
			}
			// Counters as if traffic went through every rule of both tables.
			for _, key := range []string{"mangle/KST-HMARK", "raw/KST-HMARK"} {
				for i := range f.chains[key] {
					f.chains[key][i].packets, f.chains[key][i].bytes = uint64(7+i), uint64(700+i)
				}
			}
			want, err := newChain().Counters()
			if err != nil || want[vipA] == (Counter{}) {
				t.Fatalf("Counters = %v, %v; want A's non-zero", want, err)
			}
			carried := fmt.Sprintf("[%d:%d] -A KST-HMARK -d 10.96.0.10/32 ", want[vipA].Packets, want[vipA].Bytes)
			steps := []struct {
				name    string
				setup   func()
				targets []Target
			}{
				{"B removed", nil, []Target{tA}},
				{"C added", nil, []Target{tA, tC}},
				{"A to generation 1", nil, []Target{{VIP: vipA, Offset: gen1}, tC}},
				{"foreign rule removed", func() {
					f.chains[table+"/KST-HMARK"] = slices.Insert(f.chains[table+"/KST-HMARK"], 0, fakeRule{spec: "-j MARK --set-xmark 0x3/0xffffffff"})
				}, []Target{{VIP: vipA, Offset: gen1}, tC}},
			}
			for _, step := range steps {
				if step.setup != nil {
					step.setup()
				}
				f.restores = nil
				if _, err := newChain().Sync(step.targets); err != nil {
					t.Fatalf("%s: Sync: %v", step.name, err)
				}
				got, err := newChain().Counters()
				if err != nil || got[vipA] != want[vipA] {
					t.Errorf("%s: Counters = %v, %v; want A's unchanged: %v", step.name, got, err, want[vipA])
				}
				// A's rule was written anew (the table read was restored)
				// with its counters, or not written at all.
				for _, payload := range f.restores {
					if strings.HasPrefix(payload, "*"+table+"\n:KST-HMARK -") && !strings.Contains(payload, carried) {
						t.Errorf("%s: restore without A's counters %q:\n%s", step.name, carried, payload)
					}
				}
				if !slices.ContainsFunc(f.restores, func(p string) bool { return strings.HasPrefix(p, "*"+table+"\n") }) && step.name != "A to generation 1" {
					t.Errorf("%s: %s not restored, the step proves nothing (restores: %q)", step.name, table, f.restores)
				}
			}
		})
	}
}
