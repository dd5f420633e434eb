package topology

import (
	"fmt"
	"slices"
	"testing"
)

func TestParseHMARKOffset(t *testing.T) {
	const (
		exit = "-A KST-HMARK -m set ! --match-set KST-HMARK dst -m comment --comment kube-service-tunnel -j RETURN\n"
		gen  = "-A KST-HMARK -m set --match-set KST-HMARK-%d dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x5eed1e55 --hmark-mod 64 --hmark-offset %s\n"
	)
	rules := exit + fmt.Sprintf(gen, 0, "4096") + fmt.Sprintf(gen, 1, "0x1040")
	for _, tc := range []struct {
		name   string
		sets   []string // the sets holding the tunnel IP
		rules  string
		want   uint32
		wantOK bool
	}{
		{"generation 0, decimal", []string{"KST-HMARK", "KST-HMARK-0"}, rules, 0x1000, true},
		{"generation 1, hex", []string{"KST-HMARK", "KST-HMARK-1"}, rules, 0x1040, true},
		{"in both: the later rule wins", []string{"KST-HMARK", "KST-HMARK-0", "KST-HMARK-1"}, rules, 0x1040, true},
		{"not in the set of all", []string{"KST-HMARK-0"}, rules, 0, false},
		{"in no generation", []string{"KST-HMARK"}, rules, 0, false},
		{"among other rules", []string{"KST-HMARK", "KST-HMARK-1"}, "*mangle\n-A KST-HMARK -j CONNMARK --restore-mark\n" + rules + "COMMIT\n", 0x1040, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inSet := func(set string) (bool, error) { return slices.Contains(tc.sets, set), nil }
			got, ok, err := parseHMARKOffset(tc.rules, inSet)
			if err != nil || got != tc.want || ok != tc.wantOK {
				t.Errorf("got %#x, %v, %v; want %#x, %v", got, ok, err, tc.want, tc.wantOK)
			}
		})
	}
	all := func(string) (bool, error) { return true, nil }
	if _, _, err := parseHMARKOffset(fmt.Sprintf(gen, 0, "0xzz"), all); err == nil {
		t.Error("a garbled offset was accepted")
	}
}

func TestGenerationOf(t *testing.T) {
	for _, tc := range []struct {
		offset uint32
		want   int
		ok     bool
	}{
		{0x1000, 0, true}, {0x1040, 1, true}, {0x10c0, 3, true},
		{0x1041, 0, false}, {0x0fc0, 0, false},
	} {
		got, err := generationOf(tc.offset, 0x1000, 64)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("generationOf(%#x) = %d, %v; want %d (ok %v)", tc.offset, got, err, tc.want, tc.ok)
		}
	}
}

func TestSlotOf(t *testing.T) {
	for _, tc := range []struct {
		table int
		want  slot
		ok    bool
	}{
		{7600, slot{0, 0}, true}, {7663, slot{0, 63}, true}, {7664, slot{1, 0}, true},
		{7600 + 3*64 + 17, slot{3, 17}, true}, {7599, slot{}, false}, {254, slot{}, false},
	} {
		got, ok := slotOf(tc.table, 7600, 64)
		if ok != tc.ok || got != tc.want {
			t.Errorf("slotOf(%d) = %v, %v; want %v, %v", tc.table, got, ok, tc.want, tc.ok)
		}
	}
}
