package hmark

import (
	"slices"
	"strings"
	"testing"
)

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
		r, ok, err := parseRule(tt.line, "KST-HMARK", true)
		if err != nil || !ok || !r.hasCounters || r.packets != tt.packets || r.bytes != tt.bytes || strings.Join(r.spec, " ") != tt.spec {
			t.Errorf("parseRule(%q) = %+v, %v, %v; want %d/%d and spec %q", tt.line, r, ok, err, tt.packets, tt.bytes, tt.spec)
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
