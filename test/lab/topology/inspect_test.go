package topology

import (
	"net/netip"
	"testing"
)

func TestParseHMARKOffset(t *testing.T) {
	vip := netip.MustParseAddr("192.0.2.9")
	const rule = "-A KST-HMARK -d 192.0.2.9/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x5eed1e55 --hmark-mod 64 --hmark-offset "
	for _, tc := range []struct {
		name   string
		rules  string
		want   uint32
		wantOK bool
	}{
		{"hex", rule + "0x1040\n", 0x1040, true},
		{"decimal", rule + "4096\n", 4096, true},
		{"another tunnel IP only", "-A KST-HMARK -d 192.0.2.90/32 -j HMARK --hmark-offset 0x1000\n", 0, false},
		{"not an HMARK rule", "-A KST-HMARK -d 192.0.2.9/32 -j CONNMARK --restore-mark\n", 0, false},
		{"among other rules", "*mangle\n-A KST-HMARK -j CONNMARK --restore-mark\n" + rule + "0x1080\nCOMMIT\n", 0x1080, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := parseHMARKOffset(tc.rules, vip)
			if err != nil || got != tc.want || ok != tc.wantOK {
				t.Errorf("got %#x, %v, %v; want %#x, %v", got, ok, err, tc.want, tc.wantOK)
			}
		})
	}
	if _, _, err := parseHMARKOffset(rule+"0xzz\n", vip); err == nil {
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
