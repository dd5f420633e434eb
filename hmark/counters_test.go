package hmark

import (
	"maps"
	"net/netip"
	"slices"
	"testing"
)

// TestCounters reads the counters of the set of all tunnel IPs, and
// moving a tunnel IP to another generation or rewriting the chain keeps
// them.
func TestCounters(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, syncedLines)...)
	f.count("KST-HMARK", vipA, 10, 1500)
	c := newTestChain(t, f, testParams)
	got, err := c.Counters()
	want := map[netip.Addr]Counter{vipA: {Packets: 10, Bytes: 1500}, vipB: {}}
	if err != nil || !maps.Equal(got, want) {
		t.Errorf("Counters = %v, %v; want %v", got, err, want)
	}
	if len(f.writes) != 0 {
		t.Errorf("Counters wrote %q", f.writes)
	}
	f.chains["mangle/KST-HMARK"] = f.chains["mangle/KST-HMARK"][:1] // HMARK rule lost
	if _, err := c.Sync([]Target{{VIP: vipA, Offset: testParams.Offset + testParams.Buckets}, {VIP: vipB}}); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if got, err := c.Counters(); err != nil || !maps.Equal(got, want) {
		t.Errorf("Counters after a move and a repair = %v, %v; want %v", got, err, want)
	}
	if got, err := newTestChain(t, newFakeIPTables(t), testParams).Counters(); err != nil || len(got) != 0 {
		t.Errorf("Counters with no set = %v, %v; want none", got, err)
	}
}
