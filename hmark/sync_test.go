package hmark

import (
	"errors"
	"maps"
	"math"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Lines as iptables v1.8.9 (nft and legacy alike, Linux 6.18) printed the
// set rules for testParams (offset 256, 16 buckets) and stickyParams.
const (
	printedExit    = "-A KST-HMARK -m set ! --match-set KST-HMARK dst -m comment --comment kube-service-tunnel -j RETURN"
	printedGen0    = "-A KST-HMARK -m set --match-set KST-HMARK-0 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	printedGen1    = "-A KST-HMARK -m set --match-set KST-HMARK-1 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 272"
	printedRawRule = "-t raw -A KST-HMARK -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set KST-HMARK dst ! --update-counters -m comment --comment kube-service-tunnel -j KST-HMARK-SYN"
	// printedRawSynAck keeps the SYN-ACKs from tunnel IPs untracked.
	printedRawSynAck = "-t raw -A KST-HMARK -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN,ACK -m set --match-set KST-HMARK src ! --update-counters -m comment --comment kube-service-tunnel -j CT --notrack"
)

// syncedLines is the fake's content once a stateless Chain with
// testParams synced vipA and vipB in generation 0: what the first Sync
// writes on top of othersLines.
var syncedLines = []string{printedChainN, printedJump, printedExit, printedGen0,
	"-S KST-HMARK 10.96.0.10 10.96.0.20", "-S KST-HMARK-0 10.96.0.10 10.96.0.20"}

// stateOf is the fake's mangle and raw tables and its sets.
func stateOf(f *fakeIPTables) string {
	return f.dump() + "\n" + f.dumpTable("raw") + "\n" + f.dumpSets()
}

// canonical is the state Sync leaves for lines (sets and rules) on top
// of othersLines, the jump first in PREROUTING as Sync inserts it.
func canonical(t *testing.T, lines ...string) string {
	t.Helper()
	return canonicalOf(t, IPv4, othersLines, printedJump, lines...)
}

// canonicalOf is canonical for a fake of family, with the rules of others
// and the chain's printed jump.
func canonicalOf(t *testing.T, family Family, others []string, jump string, lines ...string) string {
	t.Helper()
	var rest []string
	hasJump := false
	for _, l := range lines {
		if l == jump {
			hasJump = true
			continue
		}
		rest = append(rest, l)
	}
	f := newFakeIPTablesFamily(t, family, slices.Concat(others, rest)...)
	if hasJump {
		f.chains["mangle/PREROUTING"] = slices.Insert(f.chains["mangle/PREROUTING"], 0,
			fakeRule{spec: strings.TrimPrefix(jump, "-A PREROUTING ")})
	}
	return stateOf(f)
}

// TestSyncFromScratch: an IPv4 and an IPv6 Chain create their sets (inet
// and inet6) and write their rules exactly as iptables and ip6tables print
// them, in the same order.
func TestSyncFromScratch(t *testing.T) {
	for _, tt := range []struct {
		family       Family
		others       []string
		vipA, vipB   netip.Addr
		synced       []string
		all, gen0    string
		wantAF       uint8
		canonicalize func(*testing.T, ...string) string
	}{
		{IPv4, othersLines, vipA, vipB, syncedLines, "KST-HMARK", "KST-HMARK-0", unix.AF_INET, canonical},
		{IPv6, othersLines6, vip6A, vip6B, synced6Lines, "KST-HMARK6", "KST-HMARK6-0", unix.AF_INET6, canonical6},
	} {
		t.Run(tt.family.String(), func(t *testing.T) {
			f := newFakeIPTablesFamily(t, tt.family, tt.others...)
			c, err := NewChainFamily(tt.family, f, f, "", testParams, f)
			if err != nil {
				t.Fatal(err)
			}
			changed, err := c.Sync(targetsOf(tt.vipB, tt.vipA))
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			// Sets, chain, jump, members (all first, in address order), rules.
			a, b := tt.vipA.String(), tt.vipB.String()
			checkWrites(t, "first sync", f, []string{
				"ipset create " + tt.all, "ipset create " + tt.gen0,
				"new mangle/" + tt.all, "insert mangle/PREROUTING 1",
				"ipset add " + tt.all + " " + a, "ipset add " + tt.all + " " + b,
				"ipset add " + tt.gen0 + " " + a, "ipset add " + tt.gen0 + " " + b,
				"restore mangle",
			})
			if want := 2 + 1 + 1 + 4 + 2; changed != want {
				t.Errorf("Sync changed = %d, want %d", changed, want)
			}
			if got, want := stateOf(f), tt.canonicalize(t, tt.synced...); got != want {
				t.Errorf("state:\n%s\nwant:\n%s", got, want)
			}
			for name, counters := range map[string]bool{tt.all: true, tt.gen0: false} {
				if s := f.sets[name]; s.typ != SetType || s.family != tt.wantAF || s.counters != counters {
					t.Errorf("set %s is %s family %d counters %t, want %s family %d counters %t (only in the set of all tunnel IPs)",
						name, s.typ, s.family, s.counters, SetType, tt.wantAF, counters)
				}
			}
		})
	}
}

// TestSyncAdoptsWithoutWrites: what Sync wrote, or an equivalent state
// printed otherwise (offset in hex), is adopted with no write.
func TestSyncAdoptsWithoutWrites(t *testing.T) {
	hexGen0 := strings.Replace(printedGen0, "--hmark-offset 256", "--hmark-offset 0x100", 1)
	for name, lines := range map[string][]string{
		"as Sync wrote it": syncedLines,
		"hex offset":       slices.Concat(syncedLines[:3], []string{hexGen0}, syncedLines[4:]),
	} {
		t.Run(name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, lines)...)
			changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB))
			if err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

// TestSyncRepairs starts from a damaged state and expects the canonical
// one, with the number of repairs.
func TestSyncRepairs(t *testing.T) {
	tests := []struct {
		name    string
		lines   []string
		changed int
	}{
		{"jump missing", slices.Delete(slices.Clone(syncedLines), 1, 2), 1},
		{"HMARK rule missing", slices.Delete(slices.Clone(syncedLines), 3, 4), 1},
		{"rules swapped", slices.Concat(syncedLines[:2], []string{printedGen0, printedExit}, syncedLines[4:]), 2},
		{"foreign rule in the chain", slices.Concat(syncedLines, []string{"-A KST-HMARK -j MARK --set-xmark 0x1/0xffffffff"}), 1},
		{"rule of an older version", slices.Concat(syncedLines, []string{printedRuleC}), 1},
		{"member missing", slices.Concat(syncedLines[:4], []string{"-S KST-HMARK 10.96.0.10", syncedLines[5]}), 1},
		{"member of a tunnel IP gone", slices.Concat(syncedLines[:4], []string{"-S KST-HMARK 10.96.0.10 10.96.0.20 10.96.0.30", syncedLines[5]}), 1},
		{"tunnel IP in another generation too", slices.Concat(syncedLines, []string{"-S KST-HMARK-1 10.96.0.10"}), 2},
		{"generation set missing", syncedLines[:5], 1 + 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB))
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if changed != tt.changed {
				t.Errorf("Sync changed = %d, want %d (writes %q)", changed, tt.changed, f.writes)
			}
			if got, want := stateOf(f), canonical(t, syncedLines...); got != want && !sameState(got, want) {
				t.Errorf("state:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

// TestSyncOrder: a tunnel IP joins the set of all tunnel IPs before its
// generation's set, and leaves it after; moving to another generation adds
// it to the new set before the rules change and deletes it from the old
// one after, and the old generation's set is destroyed once its rule is
// gone.
func TestSyncOrder(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, syncedLines)...)
	c := newTestChain(t, f, testParams)
	gen1 := testParams.Offset + testParams.Buckets
	if _, err := c.Sync([]Target{{VIP: vipA, Offset: gen1}, {VIP: vipC, Offset: gen1}}); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	checkWrites(t, "move", f, []string{
		"ipset create KST-HMARK-1",
		"ipset add KST-HMARK 10.96.0.30",
		"ipset add KST-HMARK-1 10.96.0.10", "ipset add KST-HMARK-1 10.96.0.30",
		"restore mangle",
		"ipset del KST-HMARK-0 10.96.0.10", "ipset del KST-HMARK-0 10.96.0.20",
		"ipset del KST-HMARK 10.96.0.20",
		"ipset destroy KST-HMARK-0",
	})
	want := canonical(t, printedChainN, printedJump, printedExit, printedGen1,
		"-S KST-HMARK 10.96.0.10 10.96.0.30", "-S KST-HMARK-1 10.96.0.10 10.96.0.30")
	if got := stateOf(f); !sameState(got, want) {
		t.Errorf("state:\n%s\nwant:\n%s", got, want)
	}
	offsets, err := c.Offsets()
	if wantOffsets := map[netip.Addr]uint32{vipA: gen1, vipC: gen1}; err != nil || !maps.Equal(offsets, wantOffsets) {
		t.Errorf("Offsets = %v, %v; want %v", offsets, err, wantOffsets)
	}
}

// TestOffsetsOfAnOlderVersion: without the set of all tunnel IPs, Offsets
// reads the per-tunnel-IP rules an older version wrote, so that an upgrade
// keeps each tunnel IP on its generation; Sync then replaces them.
func TestOffsetsOfAnOlderVersion(t *testing.T) {
	ruleB272 := strings.Replace(printedRuleB, "--hmark-offset 256", "--hmark-offset 0x110", 1)
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump, printedRuleA, ruleB272,
		strings.Replace(printedRuleC, "--hmark-mod 16", "--hmark-mod 8", 1)})...)
	c := newTestChain(t, f, testParams)
	offsets, err := c.Offsets()
	if want := map[netip.Addr]uint32{vipA: 256, vipB: 272}; err != nil || !maps.Equal(offsets, want) {
		t.Fatalf("Offsets = %v, %v; want %v", offsets, err, want)
	}
	if _, err := c.Sync([]Target{{VIP: vipA, Offset: 256}, {VIP: vipB, Offset: 272}}); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	want := canonical(t, printedChainN, printedJump, printedExit, printedGen0, printedGen1,
		"-S KST-HMARK 10.96.0.10 10.96.0.20", "-S KST-HMARK-0 10.96.0.10", "-S KST-HMARK-1 10.96.0.20")
	if got := stateOf(f); !sameState(got, want) {
		t.Errorf("state after the upgrade:\n%s\nwant:\n%s", got, want)
	}
}

func TestSyncRejectsTargets(t *testing.T) {
	tests := []struct {
		name    string
		sticky  bool
		targets []Target
		wantErr string
	}{
		{"not IPv4", false, []Target{{VIP: netip.MustParseAddr("2001:db8::1")}}, "not an IPv4 address"},
		{"duplicate vip", false, []Target{{VIP: vipA}, {VIP: vipB}, {VIP: vipA, Offset: gen1}}, "10.96.0.10 appears more than once"},
		{"duplicate vip, 4-in-6", true, []Target{{VIP: vipA}, {VIP: netip.AddrFrom16(vipA.As16())}}, "more than once"},
		{"offset between generations", false, []Target{{VIP: vipB, Offset: gen0 + 3}}, "is not 4096 + g×16"},
		{"offset below the first generation", false, []Target{{VIP: vipB, Offset: 0x10}}, "is not 4096 + g×16"},
		{"generation too high", false, []Target{{VIP: vipB, Offset: gen0 + MaxGenerations*16}}, "below 8"},
		{"offset outside block", true, []Target{{VIP: vipB, Offset: gen0 + 16*7}}, "not all in the sticky block"},
		{"offset overflowing", false, []Target{{VIP: vipB, Offset: math.MaxUint32 - 8}}, "is not"},
	}
	for _, tt := range tests {
		f := newFakeIPTables(t)
		c := newTestChain(t, f, stickyParams)
		if tt.sticky {
			// A block of 0x80 marks: generations 0-7 of 16 buckets, but
			// the test's narrower block only holds 0-6.
			if err := c.SetSticky(&Sticky{Block: 0x1000, Mask: 0xffffff80}); err != nil {
				t.Fatal(err)
			}
			if tt.name == "offset outside block" {
				if err := c.SetSticky(&Sticky{Block: 0x1000, Mask: 0xffffffc0}); err != nil {
					t.Fatal(err)
				}
			}
		}
		changed, err := c.Sync(tt.targets)
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) || changed != 0 {
			t.Errorf("%s: Sync = %d, %v; want 0 and an error containing %q", tt.name, changed, err, tt.wantErr)
		}
		if len(f.writes) != 0 {
			t.Errorf("%s: writes %q, want none", tt.name, f.writes)
		}
	}
}

// TestSyncWriteFailures: a failing write stops Sync with an error that
// wraps it, names the chain or set, never shows the seed, and counts what
// was applied before it.
func TestSyncWriteFailures(t *testing.T) {
	tests := []struct {
		name, failWrite string
		inErr           []string
		changed         int
	}{
		{"set creation", "ipset create KST-HMARK-0", []string{"create set KST-HMARK-0"}, 1},
		{"jump", "insert mangle/PREROUTING", []string{"table mangle", "insert jump in PREROUTING"}, 3},
		{"set member", "ipset add KST-HMARK-0 10.96.0.20", []string{"add 10.96.0.20 to set KST-HMARK-0"}, 7},
		{"restore", "restore mangle", []string{"table mangle", "--match-set KST-HMARK dst"}, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, othersLines...)
			f.failWrite = tt.failWrite
			changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB))
			if !errors.Is(err, errFake) {
				t.Fatalf("Sync err = %v, want it to wrap the failure", err)
			}
			for _, want := range append(tt.inErr, "KST-HMARK") {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Sync err = %q, want %q in it", err, want)
				}
			}
			if strings.Contains(err.Error(), "c0ffee") {
				t.Errorf("Sync err = %q shows the seed", err)
			}
			if changed != tt.changed {
				t.Errorf("Sync changed = %d, want %d (what was applied before the failure)", changed, tt.changed)
			}
		})
	}
}

// TestSyncRefusesForeignSets: a set of the router's name that the router
// would not have created is an error, and nothing is written into it.
func TestSyncRefusesForeignSets(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	f.sets["KST-HMARK"] = &fakeSet{typ: "hash:net", family: 2, members: map[netip.Addr]Counter{}}
	_, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA))
	if err == nil || !strings.Contains(err.Error(), "set KST-HMARK is hash:net") {
		t.Errorf("Sync err = %v, want one naming the set and its type", err)
	}
	if len(f.writes) != 0 {
		t.Errorf("writes %q, want none", f.writes)
	}
}

// TestStickySync: the sticky chains around the same sets, and leaving
// sticky mode removes the raw chains and turns the exit back into the
// counting one.
func TestStickySync(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, stickyParams)
	if err := c.SetSticky(&testSticky); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Sync([]Target{{VIP: vipA}, {VIP: vipB, Offset: gen1}}); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	gen := func(g int) string {
		return strings.NewReplacer("--hmark-offset 256", "--hmark-offset "+[]string{"4096", "4112"}[g], "KST-HMARK-0", "KST-HMARK-"+[]string{"0", "1"}[g]).Replace(printedGen0)
	}
	// The exit counts every packet in both modes; the raw rule sends SYNs
	// alone to the set's lookup, and does not count them again.
	want := canonical(t, slices.Concat([]string{printedChainN, printedJump, printedExit}, stickyHeadLines(), []string{
		gen(0), gen(1)}, handshakeLines("0", "1"), stickyTailLines, []string{
		printedRawJump, printedRawChainN, printedSynChainN, printedSynRule, printedRawRule, printedRawSynAck,
		"-S KST-HMARK 10.96.0.10 10.96.0.20", "-S KST-HMARK-0 10.96.0.10", "-S KST-HMARK-1 10.96.0.20"})...)
	got := stateOf(f)
	// The raw jump is inserted first in raw PREROUTING: compare without order.
	if !sameIgnoringOrder(got, want, "-A PREROUTING ") {
		t.Errorf("sticky state:\n%s\nwant:\n%s", got, want)
	}
	if changed, err := c.Sync([]Target{{VIP: vipA}, {VIP: vipB, Offset: gen1}}); err != nil || changed != 0 {
		t.Errorf("second Sync = %d, %v; want 0, nil", changed, err)
	}

	if err := c.SetSticky(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Sync([]Target{{VIP: vipA}, {VIP: vipB, Offset: gen1}}); err != nil {
		t.Fatalf("stateless Sync: %v", err)
	}
	if got := f.dumpTable("raw"); got != newFakeIPTables(t, othersLines...).dumpTable("raw") {
		t.Errorf("raw after leaving sticky mode:\n%s", got)
	}
	rules := f.chains["mangle/KST-HMARK"]
	if len(rules) != 3 || "-A KST-HMARK "+rules[0].spec != printedExit {
		t.Errorf("stateless chain %v, want the counting exit and two HMARK rules", rules)
	}
}

// manyVIPs returns n distinct tunnel IPs from 10.96.0.0 on, shuffled, so
// that Sync has to sort them.
func manyVIPs(n int) []netip.Addr {
	vips := make([]netip.Addr, n)
	for i := range vips {
		vips[i] = netip.AddrFrom4([4]byte{10, 96 + byte(i>>16), byte(i >> 8), byte(i)})
	}
	rand.New(rand.NewPCG(1, 2)).Shuffle(n, func(i, j int) { vips[i], vips[j] = vips[j], vips[i] })
	return vips
}

// TestUpdate: after a Sync, Update writes only the changed tunnel IPs' set
// elements, in Sync's order, and reads nothing; a generation coming into
// use, and a failure, make the next call a full Sync.
func TestUpdate(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, testParams)
	gen1 := testParams.Offset + testParams.Buckets
	if _, err := c.Update([]Target{{VIP: vipA}, {VIP: vipB}, {VIP: vipC, Offset: gen1}}); err != nil {
		t.Fatalf("first Update (a Sync): %v", err)
	}
	f.writes = nil
	// vipB leaves, vipC moves to generation 0, vipD joins generation 1
	// (which stays in use: no rule changes).
	vipD := netip.MustParseAddr("10.96.0.40")
	changed, err := c.Update([]Target{{VIP: vipA}, {VIP: vipC}, {VIP: vipD, Offset: gen1}})
	if err != nil {
		t.Fatalf("Update: %v", err)
	}
	checkWrites(t, "update", f, []string{
		"ipset add KST-HMARK 10.96.0.40",
		"ipset add KST-HMARK-1 10.96.0.40", "ipset add KST-HMARK-0 10.96.0.30",
		"ipset del KST-HMARK-1 10.96.0.30", "ipset del KST-HMARK-0 10.96.0.20",
		"ipset del KST-HMARK 10.96.0.20",
	})
	if changed != 6 {
		t.Errorf("Update changed = %d, want 6", changed)
	}
	// The state is what a full Sync leaves: a Sync now changes nothing.
	if n, err := c.Sync([]Target{{VIP: vipA}, {VIP: vipC}, {VIP: vipD, Offset: gen1}}); err != nil || n != 0 {
		t.Errorf("Sync after Update = %d, %v; want 0, nil", n, err)
	}

	// Generation 1 goes out of use: its rule and set go, a full Sync.
	f.writes = nil
	if _, err := c.Update([]Target{{VIP: vipA}, {VIP: vipC}}); err != nil {
		t.Fatalf("Update: %v", err)
	}
	if !slices.Contains(f.writes, "ipset destroy KST-HMARK-1") || !slices.Contains(f.writes, "restore mangle") {
		t.Errorf("writes %q: want generation 1's rule and set removed", f.writes)
	}

	// A failed write: the next Update reads and repairs (here, the element
	// deleted behind its back).
	f.failWrite = "ipset add KST-HMARK 10.96.0.20"
	if _, err := c.Update([]Target{{VIP: vipA}, {VIP: vipB}, {VIP: vipC}}); !errors.Is(err, errFake) {
		t.Fatalf("Update with a failing write: %v", err)
	}
	f.failWrite = ""
	delete(f.sets["KST-HMARK-0"].members, vipA)
	if _, err := c.Update([]Target{{VIP: vipA}, {VIP: vipB}, {VIP: vipC}}); err != nil {
		t.Fatalf("Update after the failure: %v", err)
	}
	if _, ok := f.sets["KST-HMARK-0"].members[vipA]; !ok {
		t.Errorf("Update after a failure did not repair: %v", f.dumpSets())
	}
}

// A tunnel IP with client affinity goes to the set NAME-c<g>, matched by an
// HMARK rule with port and protocol masks 0 (printed as iptables prints
// them, which the next Sync adopts without a write); turning affinity off
// moves it back to NAME-g with an add and a delete.
func TestClientAffinityClass(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, testParams)
	targets := []Target{{VIP: vipA}, {VIP: vipB, ClientAffinity: true}}
	if _, err := c.Sync(targets); err != nil {
		t.Fatal(err)
	}
	printedAffinity0 := "-A KST-HMARK -m set --match-set KST-HMARK-c0 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0x0 --hmark-dport-mask 0x0 --hmark-proto-mask 0x0 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	want := canonical(t, printedChainN, printedJump, printedExit, printedGen0, printedAffinity0,
		"-S KST-HMARK 10.96.0.10 10.96.0.20", "-S KST-HMARK-0 10.96.0.10", "-S KST-HMARK-c0 10.96.0.20")
	if got := stateOf(f); got != want {
		t.Errorf("state:\n%s\nwant:\n%s", got, want)
	}
	f.writes = nil
	if n, err := c.Sync(targets); err != nil || n != 0 || len(f.writes) != 0 {
		t.Errorf("second Sync = %d, %v, writes %q; want nothing", n, err, f.writes)
	}
	offsets, err := c.Offsets()
	if err != nil || offsets[vipB] != testParams.Offset {
		t.Errorf("Offsets = %v, %v: an affinity tunnel IP keeps its generation's offset", offsets, err)
	}
	// Off again: one add, one delete, and the affinity rule and set go.
	if _, err := c.Update([]Target{{VIP: vipA}, {VIP: vipB}}); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"ipset add KST-HMARK-0 10.96.0.20", "ipset del KST-HMARK-c0 10.96.0.20", "ipset destroy KST-HMARK-c0"} {
		if !slices.Contains(f.writes, w) {
			t.Errorf("writes %q lack %q", f.writes, w)
		}
	}
	if got, want := stateOf(f), canonical(t, syncedLines...); got != want {
		t.Errorf("state after affinity off:\n%s\nwant:\n%s", got, want)
	}
	// A rule with other masks is not the router's.
	partial := strings.Replace(printedAffinity0, "--hmark-dport-mask 0x0", "--hmark-dport-mask 0xffff", 1)
	optionsOf := func(line string) []string {
		words := strings.Fields(line)
		return words[slices.Index(words, "HMARK")+1:]
	}
	if o, ok := parseHMARKOptions(optionsOf(printedAffinity0)); !ok || !o.affinity {
		t.Errorf("the affinity rule parsed as ok=%t affinity=%t", ok, o.affinity)
	}
	if _, ok := parseHMARKOptions(optionsOf(partial)); ok {
		t.Errorf("a rule hashing only the destination port parsed as the router's")
	}
}

// TestSyncIPTablesCalls counts the iptables processes a Sync runs (reads
// and writes, ipset's netlink calls aside), by table, in stateless and
// sticky mode: a Sync that changes nothing reads each table once and
// writes nothing; one that changes set elements only reads each table
// once; one that brings a generation into use reads each table once and
// rewrites the mangle chain in one restore. Every one of these is under
// the bound a table change on an emulated node must keep to: one read
// per table for a no-op, two processes per table for a change of set
// elements or of a chain's rules.
func TestSyncIPTablesCalls(t *testing.T) {
	for _, sticky := range []bool{false, true} {
		t.Run(map[bool]string{false: "stateless", true: "sticky"}[sticky], func(t *testing.T) {
			params := testParams
			if sticky {
				params = stickyParams
			}
			f := newFakeIPTables(t, othersLines...)
			c := newTestChain(t, f, params)
			if sticky {
				if err := c.SetSticky(&testSticky); err != nil {
					t.Fatal(err)
				}
			}
			gen1 := params.Offset + params.Buckets
			if _, err := c.Sync(targetsOf(vipA, vipB)); err != nil {
				t.Fatalf("first Sync: %v", err)
			}
			for _, step := range []struct {
				name    string
				targets []Target
				want    map[string]int
				// bound is the most processes a table may cost.
				bound int
				// changed: the step writes set elements or rules.
				changed bool
			}{
				{"no change", targetsOf(vipA, vipB), map[string]int{Table: 1, RawTable: 1}, 1, false},
				{"a tunnel IP added", targetsOf(vipA, vipB, vipC), map[string]int{Table: 1, RawTable: 1}, 2, true},
				{"a tunnel IP removed", targetsOf(vipA, vipC), map[string]int{Table: 1, RawTable: 1}, 2, true},
				{"generation 1 comes into use", []Target{{VIP: vipA}, {VIP: vipC, Offset: gen1}}, map[string]int{Table: 2, RawTable: 1}, 2, true},
				{"no change again", []Target{{VIP: vipA}, {VIP: vipC, Offset: gen1}}, map[string]int{Table: 1, RawTable: 1}, 1, false},
			} {
				f.reads, f.writes = nil, nil
				changed, err := c.Sync(step.targets)
				if err != nil {
					t.Fatalf("%s: Sync: %v", step.name, err)
				}
				if (changed > 0) != step.changed {
					t.Errorf("%s: Sync changed = %d (writes %q)", step.name, changed, f.writes)
				}
				got := f.iptablesCalls()
				for table, n := range got {
					if n > step.bound {
						t.Errorf("%s: %d iptables processes for table %s, more than %d (reads %q, writes %q)", step.name, n, table, step.bound, f.reads, f.writes)
					}
				}
				if !maps.Equal(got, step.want) {
					t.Errorf("%s: iptables processes by table %v, want %v (reads %q, writes %q)", step.name, got, step.want, f.reads, f.writes)
				}
			}
		})
	}
}
