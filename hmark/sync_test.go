package hmark

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestSyncFromScratch(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, testParams)
	changed, err := c.Sync(targetsOf(vipC, vipA, vipB))
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if changed != 5 {
		t.Errorf("Sync changed = %d; want 5 (chain, jump, three rules)", changed)
	}
	if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB, printedRuleC); got != want {
		t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
	}
	wantWrites := []string{
		"new mangle/KST-HMARK",
		"insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK",
		"restore mangle",
	}
	if !slices.Equal(f.writes, wantWrites) {
		t.Errorf("writes:\n%s\nwant:\n%s", strings.Join(f.writes, "\n"), strings.Join(wantWrites, "\n"))
	}
	wantPayload := `*mangle
:KST-HMARK - [0:0]
-A KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
-A KST-HMARK -d 10.96.0.30/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
COMMIT
`
	if len(f.restores) != 1 || f.restores[0] != wantPayload {
		t.Errorf("restore payloads %q, want one:\n%s", f.restores, wantPayload)
	}
}

// TestSyncAdoptsWithoutWrites gives a new Chain a kernel state that is
// already right, in the several forms iptables may print it, and expects
// no write at all.
func TestSyncAdoptsWithoutWrites(t *testing.T) {
	protoMask00ff := strings.Replace(printedRuleA, "--hmark-proto-mask 0xffff", "--hmark-proto-mask 0xff", 1)
	tests := []struct {
		name   string
		params Params
		lines  []string
	}{
		{"as Chain wrote it", testParams, []string{printedChainN, printedJump, printedRuleA, printedRuleB}},
		{"jump not first in PREROUTING", testParams, []string{printedChainN, "-A PREROUTING -j ACCEPT", printedJump, printedRuleB, printedRuleA}},
		{"protocol mask 0xff", testParams, []string{printedChainN, printedJump, protoMask00ff, printedRuleB}},
		{"offset 0 omitted by iptables", Params{Buckets: 16, Offset: 0, Seed: 0xc0ffee}, []string{printedChainN, printedJump,
			strings.TrimSuffix(printedRuleA, " --hmark-offset 256"), strings.Replace(printedRuleB, "--hmark-offset 256", "--hmark-offset 0", 1)}},
		{"decimal seed, hex modulus", testParams, []string{printedChainN, printedJump, printedRuleA,
			strings.Replace(strings.Replace(printedRuleB, "0x00c0ffee", "12648430", 1), "--hmark-mod 16", "--hmark-mod 0x10", 1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			before := f.dump()
			changed, err := newTestChain(t, f, tt.params).Sync(targetsOf(vipA, vipB))
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if changed != 0 || len(f.writes) != 0 {
				t.Errorf("Sync changed = %d, writes %q; want none", changed, f.writes)
			}
			if f.dump() != before {
				t.Errorf("state changed:\n%s\nwant:\n%s", f.dump(), before)
			}
		})
	}
}

// TestSyncRepairs starts from drifted states and expects the canonical
// state for vipA and vipB, with exactly the writes needed, and the rules of
// others untouched.
func TestSyncRepairs(t *testing.T) {
	hmarkA := func(mod string) string { return strings.Replace(printedRuleA, "--hmark-mod 16", mod, 1) }
	tests := []struct {
		name  string
		lines []string
		// changed is the number of differences: rules added plus removed,
		// chains created, jumps inserted or deleted.
		changed int
		// writes are prefixes of the expected write calls, in order.
		writes []string
	}{
		{"chain missing", []string{printedJump}, 3, []string{"new", "restore mangle"}},
		{"jump missing", []string{printedChainN, printedRuleA, printedRuleB}, 1, []string{"insert mangle/PREROUTING 1"}},
		{"rule missing", []string{printedChainN, printedJump, printedRuleB}, 1, []string{"restore mangle"}},
		{"stale tunnel IP", []string{printedChainN, printedJump, printedRuleA, printedRuleC, printedRuleB}, 1, []string{"restore mangle"}},
		{"duplicate rule", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedRuleA}, 1, []string{"restore mangle"}},
		{"foreign rules in own chain", []string{printedChainN, printedJump,
			"-A KST-HMARK -j MARK --set-xmark 0x1/0xffffffff",
			printedRuleA,
			`-A KST-HMARK -d 10.96.0.20/32 -m comment --comment "not ours" -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256`,
			"-A KST-HMARK -d 10.96.0.20/32 -p tcp -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK ! -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.0/24 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256 --hmark-tuple ct",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 24 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-sport 0x0050 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xfff0 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j MARK --set-xmark 0x100/0xffffffff",
		}, 12, []string{"restore mangle"}},
		{"other parameters after a config change", []string{printedChainN, printedJump, hmarkA("--hmark-mod 8"),
			strings.Replace(printedRuleB, "0x00c0ffee", "0x00c0fffe", 1)}, 4, []string{"restore mangle"}},
		{"duplicate jump", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedJump}, 1,
			[]string{"delete mangle/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"}},
		{"jump of another shape", []string{printedChainN, "-A PREROUTING -i eth0 -g KST-HMARK", printedRuleA, printedRuleB}, 2,
			[]string{"insert mangle/PREROUTING 1", "delete mangle/PREROUTING -i eth0 -g KST-HMARK"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipB, vipA))
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if changed != tt.changed {
				t.Errorf("Sync changed = %d, want %d differences", changed, tt.changed)
			}
			checkWrites(t, "Sync", f, tt.writes)
			if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB); !sameState(got, want) {
				t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
			}
			// A second Sync has nothing left to do.
			f.writes = nil
			if changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB)); err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("second Sync: changed %d, err %v, writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

func TestSyncEmptyVIPsEmptiesChain(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump, printedRuleA, printedRuleB})...)
	changed, err := newTestChain(t, f, testParams).Sync(nil)
	if err != nil || changed != 2 {
		t.Fatalf("Sync(nil) = %d, %v; want 2 deletes", changed, err)
	}
	if got, want := f.dump(), canonicalState(t); !sameState(got, want) {
		t.Errorf("mangle after Sync(nil):\n%s\nwant:\n%s", got, want)
	}
	if want := "*mangle\n:KST-HMARK - [0:0]\nCOMMIT\n"; len(f.restores) != 1 || f.restores[0] != want {
		t.Errorf("restore payloads %q, want one: %q", f.restores, want)
	}
}

func TestSyncRejectsNonIPv4(t *testing.T) {
	f := newFakeIPTables(t)
	_, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, netip.MustParseAddr("2001:db8::1")))
	if err == nil || !strings.Contains(err.Error(), "not an IPv4") {
		t.Errorf("Sync with an IPv6 tunnel IP: err = %v, want not an IPv4 address", err)
	}
	if len(f.writes) != 0 {
		t.Errorf("writes %q, want none", f.writes)
	}
	mapped := netip.AddrFrom16(vipA.As16())
	if _, err := newTestChain(t, f, testParams).Sync(targetsOf(mapped)); err != nil {
		t.Errorf("Sync with 4-in-6 %s: %v", mapped, err)
	}
}

// TestSyncWriteFailures makes one write fail: Sync returns an error that
// wraps it, names the chain and what failed (the restore's error quotes
// the failed rule, its seed replaced by its fingerprint) without the seed, counts only what was applied before
// it, writes nothing after it, and leaves the chain's rules as they were (a
// restore is all or nothing).
func TestSyncWriteFailures(t *testing.T) {
	jump := "insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK"
	tests := []struct {
		name, failWrite string
		// rules are the chain's rules, before and after.
		rules []string
		// inErr must all be in the error.
		inErr   []string
		changed int
		writes  []string
	}{
		{"restore after the jump", "restore mangle", []string{printedRuleC}, []string{"table mangle", "10.96.0.10/32", "<seed " + SeedFingerprint(testParams.Seed) + ">"}, 1, []string{jump, "restore mangle"}},
		{"jump after the chain", "insert mangle/PREROUTING", nil, []string{"table mangle", "insert jump in PREROUTING"}, 1, []string{"new mangle/KST-HMARK", jump}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lines := othersLines
			if tt.rules != nil {
				lines = slices.Concat(othersLines, []string{printedChainN}, tt.rules)
			}
			f := newFakeIPTables(t, lines...)
			f.failWrite = tt.failWrite
			changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB))
			if !errors.Is(err, errFake) {
				t.Fatalf("Sync err = %v, want it to wrap the iptables error", err)
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
			if !slices.Equal(f.writes, tt.writes) {
				t.Errorf("writes %q, want %q", f.writes, tt.writes)
			}
			var got []string
			for _, r := range f.chains["mangle/KST-HMARK"] {
				got = append(got, "-A KST-HMARK "+r.spec)
			}
			if !slices.Equal(got, tt.rules) {
				t.Errorf("chain after the failure: %q, want %q", got, tt.rules)
			}
		})
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

// TestSyncLargeDiffOneRestore syncs 10,000 tunnel IPs: the chain is
// written in one restore call, a restarted Chain writes nothing, and
// swapping one tunnel IP for another is one restore that changes 2.
func TestSyncLargeDiffOneRestore(t *testing.T) {
	const n = 10000
	vips := manyVIPs(n)
	f := newFakeIPTables(t, othersLines...)
	changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vips...))
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if changed != 2+n {
		t.Errorf("Sync changed = %d, want %d (chain, jump, %d rules)", changed, 2+n, n)
	}
	if want := []string{"new mangle/KST-HMARK", "insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK", "restore mangle"}; !slices.Equal(f.writes, want) {
		t.Errorf("writes %q, want %q", f.writes, want)
	}
	checkChain := func(step string, want []netip.Addr) {
		t.Helper()
		rules := f.chains["mangle/KST-HMARK"]
		got := make([]netip.Addr, 0, len(rules))
		for _, r := range rules {
			vip, params, ok := rule{spec: strings.Fields(r.spec)}.vipRule()
			if !ok || params != testParams {
				t.Fatalf("%s: unexpected rule %q", step, r.spec)
			}
			got = append(got, vip)
		}
		want = slices.SortedFunc(slices.Values(want), netip.Addr.Compare)
		if !slices.Equal(got, want) {
			t.Errorf("%s: chain has %d rules, want %d, in address order", step, len(got), len(want))
		}
	}
	checkChain("first sync", vips)

	f.writes = nil
	if changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vips...)); err != nil || changed != 0 || len(f.writes) != 0 {
		t.Errorf("adoption: changed %d, err %v, writes %q; want 0, nil, none", changed, err, f.writes)
	}

	swapped := slices.Concat(vips[1:], []netip.Addr{netip.MustParseAddr("10.200.0.1")})
	f.writes, f.restores = nil, nil
	changed, err = newTestChain(t, f, testParams).Sync(targetsOf(swapped...))
	if err != nil || changed != 2 {
		t.Errorf("swap one tunnel IP: changed %d, err %v; want 2, nil", changed, err)
	}
	if !slices.Equal(f.writes, []string{"restore mangle"}) {
		t.Errorf("swap one tunnel IP: writes %q, want one restore", f.writes)
	}
	if len(f.restores) == 1 {
		if got := strings.Count(f.restores[0], "\n-A KST-HMARK "); got != n {
			t.Errorf("swap one tunnel IP: restore payload has %d rules, want %d", got, n)
		}
	}
	checkChain("swap one tunnel IP", swapped)

	f.writes = nil
	other := Params{Buckets: 32, Offset: testParams.Offset, Seed: testParams.Seed}
	if changed, err := newTestChain(t, f, other).Sync(targetsOf(swapped...)); err != nil || changed != 2*n || !slices.Equal(f.writes, []string{"restore mangle"}) {
		t.Errorf("config change: changed %d, err %v, writes %q; want %d, nil, one restore", changed, err, f.writes, 2*n)
	}
}
