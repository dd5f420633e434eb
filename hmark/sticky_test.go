package hmark

import (
	"math"
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
