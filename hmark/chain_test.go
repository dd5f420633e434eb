package hmark

import (
	"slices"
	"strings"
	"testing"
)

func TestNewChainValidates(t *testing.T) {
	f := newFakeIPTables(t)
	tests := []struct {
		name    string
		chain   string
		params  Params
		wantErr string
	}{
		{"default name", "", testParams, ""},
		{"own name", "KST-HMARK-2", testParams, ""},
		{"too long", strings.Repeat("K", 29), testParams, "longer than 28"},
		{"space", "KST HMARK", testParams, "without spaces"},
		{"option-like", "-KST", testParams, "must not start"},
		{"built-in", "PREROUTING", testParams, "reserved"},
		{"no buckets", "", Params{Seed: 1}, "at least 1"},
	}
	for _, tt := range tests {
		c, err := NewChain(f, f, tt.chain, tt.params, f)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%s: NewChain: %v", tt.name, err)
		case tt.wantErr == "" && tt.chain == "" && c.Name() != DefaultChainName:
			t.Errorf("%s: Name() = %q, want %q", tt.name, c.Name(), DefaultChainName)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%s: NewChain err = %v, want one containing %q", tt.name, err, tt.wantErr)
		}
	}
	r := NewExecRestorer("iptables-legacy")
	if c, err := NewChain(f, f, "", testParams, r); err != nil || c.restorer != Restorer(r) {
		t.Errorf("NewChain: %v, %v; want a chain writing through the restorer given", c, err)
	}
	if _, err := NewChain(f, f, "", testParams, nil); err == nil {
		t.Errorf("NewChain(nil restorer): want an error")
	}
	if _, err := NewChain(nil, f, "", testParams, r); err == nil {
		t.Errorf("NewChain(nil iptables): want an error")
	}
}

func TestCleanup(t *testing.T) {
	tests := []struct {
		name  string
		lines []string
	}{
		{"synced", syncedLines},
		{"an older version's rules", []string{printedChainN, printedJump, printedRuleA, printedRuleB}},
		{"extra jumps", []string{printedChainN, printedJump, printedRuleA, "-A PREROUTING -i eth0 -j KST-HMARK"}},
		{"chain without jump", []string{printedChainN, printedRuleA}},
		{"nothing there", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			if err := newTestChain(t, f, testParams).Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			if got, want := stateOf(f), stateOf(newFakeIPTables(t, othersLines...)); got != want {
				t.Errorf("state after Cleanup:\n%s\nwant:\n%s", got, want)
			}
			if err := newTestChain(t, f, testParams).Cleanup(); err != nil {
				t.Errorf("second Cleanup: %v", err)
			}
		})
	}
}

// TestCleanupLeavesASetInUse: a set still matched by a rule that is not
// the router's is not destroyed, and Cleanup says why.
func TestCleanupLeavesASetInUse(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, syncedLines, []string{"-A OPERATOR -m set --match-set KST-HMARK-0 dst -j RETURN"})...)
	err := newTestChain(t, f, testParams).Cleanup()
	if err == nil || !strings.Contains(err.Error(), "a rule that is not the router's still uses it") {
		t.Errorf("Cleanup = %v, want an error naming the set in use", err)
	}
	if f.sets["KST-HMARK-0"] == nil {
		t.Errorf("Cleanup destroyed a set in use")
	}
}

// TestRulesAhead: the rules of mangle PREROUTING before the router's jump
// are reported (Calico's Felix inserts its chain first and accepts
// established connections there); none when the jump is first or absent,
// and a sync does not move the jump.
func TestRulesAhead(t *testing.T) {
	const felix = `-A PREROUTING -m comment --comment "cali:6gwbT8clXdHdC1b1" -j cali-PREROUTING`
	tests := []struct {
		name  string
		lines []string
		want  []string
	}{
		{"first", []string{printedChainN, printedJump, "-N cali-PREROUTING", felix}, nil},
		{"behind Felix", []string{"-N cali-PREROUTING", felix, printedChainN, printedJump},
			[]string{"-m comment --comment cali:6gwbT8clXdHdC1b1 -j cali-PREROUTING"}},
		{"no jump", []string{"-N cali-PREROUTING", felix}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, tt.lines...)
			c := newTestChain(t, f, testParams)
			got, err := c.RulesAhead()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("RulesAhead() = %q, want %q", got, tt.want)
			}
		})
	}
	f := newFakeIPTables(t, "-N cali-PREROUTING", felix, printedChainN, printedJump)
	c := newTestChain(t, f, testParams)
	if _, err := c.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.RulesAhead(); len(got) != 1 {
		t.Errorf("after Sync, RulesAhead() = %q: the jump moved", got)
	}
}
