package hmark

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestCounters(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump, printedRuleA, printedRuleB,
		"-A KST-HMARK -j MARK --set-xmark 0x1/0xffffffff",
		strings.Replace(printedRuleC, "--hmark-mod 16", "--hmark-mod 8", 1)})...)
	rules := f.chains["mangle/KST-HMARK"]
	rules[0].packets, rules[0].bytes = 10, 1500
	rules[1].packets, rules[1].bytes = 0, 0
	rules[2].packets, rules[2].bytes = 99, 99
	rules[3].packets, rules[3].bytes = 98, 98
	got, err := newTestChain(t, f, testParams).Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	want := map[netip.Addr]Counter{vipA: {Packets: 10, Bytes: 1500}, vipB: {}}
	if len(got) != len(want) || got[vipA] != want[vipA] || got[vipB] != want[vipB] {
		t.Errorf("Counters = %v, want %v", got, want)
	}
	if len(f.writes) != 0 {
		t.Errorf("Counters wrote %q", f.writes)
	}
}
