package hmark

import (
	"math"
	"strconv"
	"strings"
	"testing"
)

// Sticky test setup: two generations of 16 buckets in the block
// 0x1000/0xffffff00, generation 0 at 0x1000 (the chain's own offset),
// generation 1 at 0x1010.
var (
	stickyParams = Params{Buckets: 16, Offset: 0x1000, Seed: 0xc0ffee}
	testSticky   = Sticky{Block: 0x1000, Mask: 0xffffff00, Generations: 2}
)

const (
	gen0 = 0x1000
	gen1 = 0x1010
)

// Lines as iptables v1.8.9 (nft and legacy alike, Linux 6.18) printed the
// sticky rules for stickyParams and testSticky.
const (
	printedRestoreOpen     = "-A KST-HMARK -m connmark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	printedRestoreClosing  = "-A KST-HMARK -p tcp -m connmark --mark 0x1100/0xffffff00 -m set ! --match-set KST-HMARK-s0 src,src,dst -m set ! --match-set KST-HMARK-s1 src,src,dst -m set ! --match-set KST-HMARK-sc0 src,src,dst -m set ! --match-set KST-HMARK-sc1 src,src,dst -m comment --comment kube-service-tunnel -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xfffffeff"
	printedReturnOther     = "-A KST-HMARK ! -p tcp -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j RETURN"
	printedReturnNotFIN    = "-A KST-HMARK -p tcp -m tcp ! --tcp-flags FIN FIN -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j RETURN"
	printedCloseOnFIN      = "-A KST-HMARK -p tcp -m tcp --tcp-flags FIN FIN -m connmark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --set-xmark 0x100/0x100"
	printedFINForget       = "-A KST-HMARK -p tcp -m tcp --tcp-flags FIN FIN -m connmark --mark 0x1100/0xffffff00 -m comment --comment kube-service-tunnel -j SET --del-set KST-HMARK-s0 src,src,dst"
	printedReturn          = "-A KST-HMARK -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j RETURN"
	printedSaveOverClosing = "-A KST-HMARK -m connmark --mark 0x1100/0xffffff00 -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	printedSave            = "-A KST-HMARK -m connmark --mark 0x0 -m mark --mark 0x1000/0xffffff00 -m comment --comment kube-service-tunnel -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff"
	// The handshake memory of generation 0: the rule that remembers its
	// SYNs, and the rule that hashes the packets after a remembered SYN
	// (and the same for client affinity).
	printedSynForget  = "-A KST-HMARK -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j SET --del-set KST-HMARK-s0 src,src,dst"
	printedSynRecord  = "-A KST-HMARK -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set KST-HMARK-0 dst -m comment --comment kube-service-tunnel -j SET --add-set KST-HMARK-s0 src,src,dst --exist"
	printedHandshake  = "-A KST-HMARK -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set KST-HMARK-s0 src,src,dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 4096"
	printedHandshakeC = "-A KST-HMARK -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set KST-HMARK-sc0 src,src,dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0x0 --hmark-dport-mask 0x0 --hmark-proto-mask 0x0 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 4096"
	printedRawChainN  = "-t raw -N KST-HMARK"
	printedRawJump    = "-t raw -A PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"
	printedSynChainN  = "-t raw -N KST-HMARK-SYN"
	printedSynRule    = "-t raw -A KST-HMARK-SYN -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack"
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
		{"two-bit mask", Params{Buckets: 16, Offset: 0x10, Seed: 1}, Sticky{Block: 0x10, Mask: 0x30}, ""},
		{"one-bit mask: no bit left for closing", Params{Buckets: 16, Offset: 0x10, Seed: 1}, Sticky{Block: 0x10, Mask: 0x10}, "no bit is left"},
		{"zero mask", stickyParams, Sticky{Block: 0x1000}, "mask is 0"},
		{"zero block", Params{Buckets: 16, Offset: 1, Seed: 1}, Sticky{Mask: 0xff000000}, "block is 0"},
		{"block outside mask", stickyParams, Sticky{Block: 0x1001, Mask: 0xffffff00}, "outside mask"},
		{"offset outside block", Params{Buckets: 16, Offset: 0x2000, Seed: 1}, testSticky, "not all in the sticky block"},
		{"marks run past block", Params{Buckets: 0x200, Offset: 0x1000, Seed: 1}, testSticky, "not all in the sticky block"},
		{"last mark leaves block", Params{Buckets: 16, Offset: 0x10f8, Seed: 1}, testSticky, "not all in the sticky block"},
		{"two-bit mask, range crosses it", Params{Buckets: 16, Offset: 0x18, Seed: 1}, Sticky{Block: 0x10, Mask: 0x30}, "not all in the sticky block"},
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

// stickyHeadLines are the sticky rules before the HMARK rules, for
// testSticky (classes 0, 1, c0, c1); stickyTailLines those after the
// handshake memory's.
func stickyHeadLines() []string {
	lines := []string{printedRestoreOpen, printedRestoreClosing, printedReturnOther, printedReturnNotFIN, printedCloseOnFIN}
	for _, k := range []string{"0", "1", "c0", "c1"} {
		lines = append(lines, strings.Replace(printedFINForget, "KST-HMARK-s0 ", "KST-HMARK-s"+k+" ", 1))
	}
	return append(lines, printedReturn)
}

var stickyTailLines = []string{printedSave, printedSaveOverClosing}

// handshakeLines are the handshake memory's rules and sets for testSticky
// (2 generations of 16 buckets) when the classes record hold tunnel IPs
// (generations 0 and 1; "c0", "c1" with client affinity): a record rule
// per class in use, the re-hash rules of all four classes, the SYN sets.
func handshakeLines(record ...string) []string {
	var lines []string
	for _, k := range []string{"0", "1", "c0", "c1"} {
		lines = append(lines, strings.Replace(printedSynForget, "KST-HMARK-s0 ", "KST-HMARK-s"+k+" ", 1))
	}
	for _, k := range record {
		lines = append(lines, strings.NewReplacer("KST-HMARK-0 ", "KST-HMARK-"+k+" ", "KST-HMARK-s0 ", "KST-HMARK-s"+k+" ").Replace(printedSynRecord))
	}
	for _, printed := range []string{printedHandshake, printedHandshakeC} {
		for g, offset := range []string{"4096", "4112"} {
			lines = append(lines, strings.NewReplacer("KST-HMARK-s0 ", "KST-HMARK-s"+strconv.Itoa(g)+" ", "KST-HMARK-sc0 ", "KST-HMARK-sc"+strconv.Itoa(g)+" ",
				"--hmark-offset 4096", "--hmark-offset "+offset).Replace(printed))
		}
	}
	return append(lines, "-S KST-HMARK-s0", "-S KST-HMARK-s1", "-S KST-HMARK-sc0", "-S KST-HMARK-sc1")
}
