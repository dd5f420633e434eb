package hmark

import (
	"slices"
	"strconv"
	"strings"
	"testing"
)

// ruleCounters is a line of `iptables -v -S chain` (counters read by the
// privileged tests' counting rules): the rule without "-c PACKETS BYTES",
// and the counters when the line has them. The router reads its counters
// from the set elements, not from rules.
type ruleCounters struct {
	rule
	hasCounters    bool
	packets, bytes uint64
}

func parseRuleCounters(line, chain string) (r ruleCounters, ok bool, err error) {
	r.rule, ok, err = parseRule(line, chain)
	if !ok || err != nil {
		return r, ok, err
	}
	// "-c PACKETS BYTES" sits before the target; go-iptables moves nft's
	// "[P:B]" prefix to the end of the line instead.
	for i := 0; i+2 < len(r.spec); i++ {
		if r.spec[i] != "-c" {
			continue
		}
		p, perr := strconv.ParseUint(r.spec[i+1], 10, 64)
		b, berr := strconv.ParseUint(r.spec[i+2], 10, 64)
		if perr != nil || berr != nil {
			continue
		}
		r.hasCounters, r.packets, r.bytes = true, p, b
		r.spec = slices.Delete(slices.Clone(r.spec), i, i+3)
		break
	}
	return r, true, nil
}

func TestParseRuleCounters(t *testing.T) {
	tests := []struct {
		line           string
		packets, bytes uint64
		spec           string
	}{
		// iptables 1.8 (legacy and nft): before the target.
		{"-A KST-HMARK -d 10.96.0.10/32 -c 12 3456 -j HMARK --hmark-mod 2", 12, 3456, "-d 10.96.0.10/32 -j HMARK --hmark-mod 2"},
		// go-iptables' rewrite of nft's "[P:B]" prefix: at the end.
		{"-A KST-HMARK -d 10.96.0.10/32 -j HMARK --hmark-mod 2 -c 7 8", 7, 8, "-d 10.96.0.10/32 -j HMARK --hmark-mod 2"},
	}
	for _, tt := range tests {
		r, ok, err := parseRuleCounters(tt.line, "KST-HMARK")
		if err != nil || !ok || !r.hasCounters || r.packets != tt.packets || r.bytes != tt.bytes || strings.Join(r.spec, " ") != tt.spec {
			t.Errorf("parseRuleCounters(%q) = %+v, %v, %v; want %d/%d and spec %q", tt.line, r, ok, err, tt.packets, tt.bytes, tt.spec)
		}
	}
}

func TestSplitWords(t *testing.T) {
	tests := []struct {
		line string
		want []string
	}{
		{"-A X -j ACCEPT", []string{"-A", "X", "-j", "ACCEPT"}},
		{`-A X -m comment --comment "a b \"c\" \\ d" -j ACCEPT`, []string{"-A", "X", "-m", "comment", "--comment", `a b "c" \ d`, "-j", "ACCEPT"}},
		{`-A X --comment ""  -j  Y `, []string{"-A", "X", "--comment", "", "-j", "Y"}},
	}
	for _, tt := range tests {
		got, err := splitWords(tt.line)
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("splitWords(%q) = %q, %v; want %q", tt.line, got, err, tt.want)
		}
	}
	if _, err := splitWords(`-A X --comment "open`); err == nil {
		t.Errorf("splitWords with an open quote: want an error")
	}
}
