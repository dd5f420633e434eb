package hmark

import (
	"errors"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Lines as ip6tables v1.8.9 (nft and legacy alike, Linux 6.18) printed
// an IPv6 Chain's rules: with testParams (offset 256, 16 buckets), and
// for the sticky ones with stickyParams and testSticky.
const (
	printed6ChainN    = "-N KST-HMARK6"
	printed6Jump      = "-A PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK6"
	printed6Exit      = "-A KST-HMARK6 -m set ! --match-set KST-HMARK6 dst -m comment --comment kube-service-tunnel -j RETURN"
	printed6Gen0      = "-A KST-HMARK6 -m set --match-set KST-HMARK6-0 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	printed6Affinity1 = "-A KST-HMARK6 -m set --match-set KST-HMARK6-c1 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0x0000 --hmark-dport-mask 0x0000 --hmark-proto-mask 0x00 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 272"
	// An older version's per-tunnel-IP rule, had there been one for IPv6.
	printed6RuleA = "-A KST-HMARK6 -d 2001:db8:96::10/128 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"

	printed6StickyExit    = "-A KST-HMARK6 -m set ! --match-set KST-HMARK6 dst -m comment --comment kube-service-tunnel -j RETURN"
	printed6StickyGen0    = "-A KST-HMARK6 -m set --match-set KST-HMARK6-0 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 4096"
	printed6StickyGen1    = "-A KST-HMARK6 -m set --match-set KST-HMARK6-1 dst -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 4112"
	printed6RawChainN     = "-t raw -N KST-HMARK6"
	printed6RawJump       = "-t raw -A PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK6"
	printed6RawRule       = "-t raw -A KST-HMARK6 -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set KST-HMARK6 dst ! --update-counters -m comment --comment kube-service-tunnel -j KST-HMARK6-SYN"
	printed6RawSynAck     = "-t raw -A KST-HMARK6 -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN,ACK -m set --match-set KST-HMARK6 src ! --update-counters -m comment --comment kube-service-tunnel -j CT --notrack"
	printed6SynChainN     = "-t raw -N KST-HMARK6-SYN"
	printed6SynRule       = "-t raw -A KST-HMARK6-SYN -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m comment --comment kube-service-tunnel -j CT --notrack"
	printed6OthersMark    = "-A OPERATOR -d 2001:db8:1::1/128 -j MARK --set-xmark 0x5/0xffffffff"
	printed6OthersHMARK   = "-A OPERATOR -d 2001:db8:96::10/128 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 128 --hmark-dst-prefix 128 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00000001 --hmark-mod 2"
	printed6OthersPrerout = `-A PREROUTING -p tcp -m comment --comment "someone else's \"rule\"" -j MARK --set-xmark 0x9/0xffffffff`
)

var (
	vip6A = netip.MustParseAddr("2001:db8:96::10")
	vip6B = netip.MustParseAddr("2001:db8:96::20")
	vip6C = netip.MustParseAddr("2001:db8:96::30")
	// othersLines6 are rules of others in ip6tables, which an IPv6 Chain
	// must never touch.
	othersLines6 = []string{"-N OPERATOR", printed6OthersMark, printed6OthersHMARK, "-A FORWARD -j OPERATOR", printed6OthersPrerout}
	// synced6Lines is the IPv6 fake's content once a stateless IPv6 Chain
	// with testParams synced vip6A and vip6B in generation 0.
	synced6Lines = []string{printed6ChainN, printed6Jump, printed6Exit, printed6Gen0,
		"-S KST-HMARK6 2001:db8:96::10 2001:db8:96::20", "-S KST-HMARK6-0 2001:db8:96::10 2001:db8:96::20"}
)

// newTestChain6 returns the default IPv6 chain over f, with params; f is
// its restorer too.
func newTestChain6(t *testing.T, f *fakeIPTables, params Params) *Chain {
	t.Helper()
	c, err := NewChainFamily(IPv6, f, f, "", params, f)
	if err != nil {
		t.Fatalf("NewChainFamily(IPv6): %v", err)
	}
	return c
}

// canonical6 is canonical for an IPv6 Chain on top of othersLines6.
func canonical6(t *testing.T, lines ...string) string {
	t.Helper()
	return canonicalOf(t, IPv6, othersLines6, printed6Jump, lines...)
}

func TestNewChainFamily(t *testing.T) {
	f := newFakeIPTablesFamily(t, IPv6)
	c6, err := NewChainFamily(IPv6, f, f, "", testParams, f)
	if err != nil || c6.Family() != IPv6 || c6.Name() != DefaultChainName6 {
		t.Fatalf("NewChainFamily(IPv6, \"\") = %v, %v; want an IPv6 chain named %s", c6, err, DefaultChainName6)
	}
	c4, err := NewChain(f, f, "", testParams, f)
	if err != nil || c4.Family() != IPv4 || c4.Name() != DefaultChainName {
		t.Fatalf("NewChain = %v, %v; want an IPv4 chain named %s", c4, err, DefaultChainName)
	}
	if IPv4.String() != "IPv4" || IPv6.String() != "IPv6" || Family(0).String() != "Family(0)" {
		t.Errorf("Family strings %q, %q, %q", IPv4, IPv6, Family(0))
	}
	for _, fam := range []Family{0, 5, 41} {
		if _, err := NewChainFamily(fam, f, f, "", testParams, f); err == nil || !strings.Contains(err.Error(), "neither IPv4 nor IPv6") {
			t.Errorf("NewChainFamily(%s) = %v, want an error naming the family", fam, err)
		}
	}

	// An ExecRestorer of the other family's iptables writes where the
	// chain never reads.
	for _, tt := range []struct {
		family Family
		binary string
		ok     bool
	}{
		{IPv6, "ip6tables", true},
		{IPv6, "ip6tables-legacy", true},
		{IPv6, "/usr/sbin/ip6tables-nft", true},
		{IPv6, "/opt/kst/wrapper", true}, // not named after iptables: the caller's to get right
		{IPv6, "iptables", false},
		{IPv6, "", false}, // iptables
		{IPv6, "/usr/sbin/iptables-legacy", false},
		{IPv4, "iptables", true},
		{IPv4, "ip6tables", false},
		{IPv4, "/usr/sbin/ip6tables-legacy", false},
	} {
		r := NewExecRestorer(tt.binary)
		_, err := NewChainFamily(tt.family, f, f, "", testParams, r)
		if tt.ok != (err == nil) || (err != nil && (!strings.Contains(err.Error(), r.Command) || !strings.Contains(err.Error(), tt.family.String()))) {
			t.Errorf("NewChainFamily(%s) with restorer %s = %v; want ok: %t (an error naming the restorer and the family)", tt.family, r.Command, err, tt.ok)
		}
	}

	// The longest chain name leaves room for every set's name (ipset
	// takes 31 characters), and the IPv6 default name for the sticky SYN
	// subchain.
	long, err := NewChainFamily(IPv6, f, f, strings.Repeat("K", maxChainNameLen), testParams, f)
	if err != nil {
		t.Fatal(err)
	}
	const ipsetMaxNameLen = 31 // IPSET_MAXNAMELEN - 1
	for k := range classes {
		if n := long.classSetName(k); len(n) > ipsetMaxNameLen {
			t.Errorf("set name %q is longer than %d characters", n, ipsetMaxNameLen)
		}
	}
	if err := newTestChain6(t, f, stickyParams).SetSticky(&testSticky); err != nil {
		t.Errorf("SetSticky on %s: %v", DefaultChainName6, err)
	}
}

// TestSync6AdoptsPrintedRules: what real ip6tables printed for an IPv6
// Chain's rules, stateless, with client affinity in another generation,
// and sticky, is adopted without a write; which proves that Chain writes
// its IPv6 rules word for word (HMARK options by value) as ip6tables
// prints them.
func TestSync6AdoptsPrintedRules(t *testing.T) {
	gen1 := testParams.Offset + testParams.Buckets
	stickyGen1 := stickyParams.Offset + stickyParams.Buckets
	tests := []struct {
		name    string
		params  Params
		sticky  bool
		lines   []string
		targets []Target
	}{
		{"stateless", testParams, false, synced6Lines, targetsOf(vip6A, vip6B)},
		{"client affinity in generation 1", testParams, false,
			[]string{printed6ChainN, printed6Jump, printed6Exit, printed6Gen0, printed6Affinity1,
				"-S KST-HMARK6 2001:db8:96::10 2001:db8:96::20", "-S KST-HMARK6-0 2001:db8:96::10", "-S KST-HMARK6-c1 2001:db8:96::20"},
			[]Target{{VIP: vip6A}, {VIP: vip6B, Offset: gen1, ClientAffinity: true}}},
		{"sticky", stickyParams, true,
			slices.Concat([]string{printed6ChainN, printed6Jump, printed6StickyExit}, to6(stickyHeadLines()), []string{
				printed6StickyGen0, printed6StickyGen1}, handshakeLines6("0", "1"), to6(stickyTailLines), []string{
				printed6RawChainN, printed6SynChainN, printed6RawJump, printed6RawRule, printed6RawSynAck, printed6SynRule,
				"-S KST-HMARK6 2001:db8:96::10 2001:db8:96::20", "-S KST-HMARK6-0 2001:db8:96::10", "-S KST-HMARK6-1 2001:db8:96::20"}),
			[]Target{{VIP: vip6A}, {VIP: vip6B, Offset: stickyGen1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTablesFamily(t, IPv6, slices.Concat(othersLines6, tt.lines)...)
			c := newTestChain6(t, f, tt.params)
			if tt.sticky {
				if err := c.SetSticky(&testSticky); err != nil {
					t.Fatal(err)
				}
			}
			offsets, err := c.Offsets()
			wantOffsets := make(map[netip.Addr]uint32)
			for _, tg := range tt.targets {
				wantOffsets[tg.VIP] = max(tg.Offset, tt.params.Offset)
			}
			if err != nil || !maps.Equal(offsets, wantOffsets) {
				t.Errorf("Offsets = %v, %v; want %v", offsets, err, wantOffsets)
			}
			changed, err := c.Sync(tt.targets)
			if err != nil || changed != 0 || len(f.writes) != 0 {
				t.Errorf("Sync = %d, %v with writes %q; want 0, nil, none", changed, err, f.writes)
			}
		})
	}
}

// TestStickySync6: a sticky IPv6 Chain from nothing leaves what ip6tables
// printed (both tables), and leaving sticky mode removes the raw chains.
func TestStickySync6(t *testing.T) {
	f := newFakeIPTablesFamily(t, IPv6, othersLines6...)
	c := newTestChain6(t, f, stickyParams)
	if err := c.SetSticky(&testSticky); err != nil {
		t.Fatal(err)
	}
	targets := []Target{{VIP: vip6A}, {VIP: vip6B, Offset: gen1}}
	if _, err := c.Sync(targets); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	want := canonical6(t, slices.Concat([]string{printed6ChainN, printed6Jump, printed6StickyExit}, to6(stickyHeadLines()), []string{
		printed6StickyGen0, printed6StickyGen1}, handshakeLines6("0", "1"), to6(stickyTailLines), []string{
		printed6RawChainN, printed6SynChainN, printed6SynRule, printed6RawJump, printed6RawRule, printed6RawSynAck,
		"-S KST-HMARK6 2001:db8:96::10 2001:db8:96::20", "-S KST-HMARK6-0 2001:db8:96::10", "-S KST-HMARK6-1 2001:db8:96::20"})...)
	if got := stateOf(f); got != want {
		t.Errorf("sticky state:\n%s\nwant:\n%s", got, want)
	}
	if err := c.SetSticky(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Sync(targets); err != nil {
		t.Fatalf("stateless Sync: %v", err)
	}
	if got, want := f.dumpTable("raw"), newFakeIPTablesFamily(t, IPv6).dumpTable("raw"); got != want {
		t.Errorf("raw after leaving sticky mode:\n%s\nwant:\n%s", got, want)
	}
}

// TestSyncRejectsTargetsOfTheOtherFamily: each Chain takes its own
// family's tunnel IPs only, and says which value it refused; nothing is
// written.
func TestSyncRejectsTargetsOfTheOtherFamily(t *testing.T) {
	tests := []struct {
		family  Family
		vip     netip.Addr
		wantErr string
	}{
		{IPv6, vipA, `vip "10.96.0.10" is not an IPv6 address`},
		{IPv6, netip.AddrFrom16(vipA.As16()), `vip "::ffff:10.96.0.10" is an IPv4-mapped IPv6 address`},
		{IPv6, netip.MustParseAddr("fe80::1%eth0"), `vip "fe80::1%eth0" has a zone`},
		{IPv6, netip.Addr{}, `vip "invalid IP" is not an IPv6 address`},
		{IPv4, vip6A, `vip "2001:db8:96::10" is not an IPv4 address`},
		{IPv4, netip.Addr{}, `vip "invalid IP" is not an IPv4 address`},
	}
	for _, tt := range tests {
		f := newFakeIPTablesFamily(t, tt.family)
		c, err := NewChainFamily(tt.family, f, f, "", testParams, f)
		if err != nil {
			t.Fatal(err)
		}
		targets := []Target{{VIP: tt.vip}}
		if tt.family == IPv6 {
			targets = append(targets, Target{VIP: vip6B})
		}
		for _, call := range []func([]Target) (int, error){c.Sync, c.Update} {
			changed, err := call(targets)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || changed != 0 {
				t.Errorf("%s chain, vip %v: Sync/Update = %d, %v; want 0 and an error containing %q", tt.family, tt.vip, changed, err, tt.wantErr)
			}
		}
		if len(f.writes) != 0 {
			t.Errorf("%s chain, vip %v: writes %q, want none", tt.family, tt.vip, f.writes)
		}
	}
	f := newFakeIPTablesFamily(t, IPv6)
	if _, err := newTestChain6(t, f, testParams).Sync(targetsOf(vip6A, vip6B, vip6A)); err == nil || !strings.Contains(err.Error(), "2001:db8:96::10 appears more than once") {
		t.Errorf("Sync with a repeated IPv6 tunnel IP = %v, want an error naming it", err)
	}
}

// TestSyncRefusesSetsOfTheOtherFamily: a set under a chain's name that is
// of the other family (the IPv4 chain's, when the IPv6 chain is named
// like it) is not the chain's: an error naming both families, and no
// write.
func TestSyncRefusesSetsOfTheOtherFamily(t *testing.T) {
	for _, tt := range []struct {
		family       Family
		setAF        uint8
		vip          netip.Addr
		found, wants string
	}{
		{IPv6, unix.AF_INET, vip6A, "family inet,", "(inet6,"},
		{IPv4, unix.AF_INET6, vipA, "family inet6,", "(inet,"},
	} {
		f := newFakeIPTablesFamily(t, tt.family)
		c, err := NewChainFamily(tt.family, f, f, DefaultChainName, testParams, f)
		if err != nil {
			t.Fatal(err)
		}
		f.sets[DefaultChainName] = &fakeSet{typ: SetType, family: tt.setAF, counters: true, members: map[netip.Addr]Counter{}}
		_, err = c.Sync(targetsOf(tt.vip))
		if err == nil || !strings.Contains(err.Error(), "set "+DefaultChainName+" is hash:ip ("+tt.found) || !strings.Contains(err.Error(), tt.wants) {
			t.Errorf("%s chain over a set of the other family: Sync = %v; want an error naming the set, %q and %q", tt.family, err, tt.found, tt.wants)
		}
		if _, err := c.Counters(); err == nil {
			t.Errorf("%s chain over a set of the other family: Counters read it", tt.family)
		}
		if len(f.writes) != 0 {
			t.Errorf("%s chain: writes %q, want none", tt.family, f.writes)
		}
	}
}

// TestUpdate6: Update writes only the changed IPv6 tunnel IPs' set
// elements, and the result is what Sync leaves.
func TestUpdate6(t *testing.T) {
	f := newFakeIPTablesFamily(t, IPv6, othersLines6...)
	c := newTestChain6(t, f, testParams)
	gen1 := testParams.Offset + testParams.Buckets
	if _, err := c.Update([]Target{{VIP: vip6A}, {VIP: vip6B}, {VIP: vip6C, Offset: gen1}}); err != nil {
		t.Fatalf("first Update (a Sync): %v", err)
	}
	f.writes = nil
	vip6D := netip.MustParseAddr("2001:db8:96::40")
	targets := []Target{{VIP: vip6A}, {VIP: vip6C}, {VIP: vip6D, Offset: gen1}}
	changed, err := c.Update(targets)
	if err != nil || changed != 6 {
		t.Fatalf("Update = %d, %v; want 6, nil", changed, err)
	}
	checkWrites(t, "update", f, []string{
		"ipset add KST-HMARK6 2001:db8:96::40",
		"ipset add KST-HMARK6-1 2001:db8:96::40", "ipset add KST-HMARK6-0 2001:db8:96::30",
		"ipset del KST-HMARK6-1 2001:db8:96::30", "ipset del KST-HMARK6-0 2001:db8:96::20",
		"ipset del KST-HMARK6 2001:db8:96::20",
	})
	if n, err := c.Sync(targets); err != nil || n != 0 {
		t.Errorf("Sync after Update = %d, %v; want 0, nil", n, err)
	}
	offsets, err := newTestChain6(t, f, testParams).Offsets()
	if want := map[netip.Addr]uint32{vip6A: 256, vip6C: 256, vip6D: gen1}; err != nil || !maps.Equal(offsets, want) {
		t.Errorf("Offsets of a new Chain = %v, %v; want %v", offsets, err, want)
	}
}

// TestRules6DoNotGrowWithVIPs: the IPv6 chain's rules are the same for one
// tunnel IP and for a thousand; only set elements are written.
func TestRules6DoNotGrowWithVIPs(t *testing.T) {
	f := newFakeIPTablesFamily(t, IPv6)
	c := newTestChain6(t, f, testParams)
	if _, err := c.Sync(targetsOf(vip6A)); err != nil {
		t.Fatal(err)
	}
	one := f.dump()
	var many []netip.Addr
	for i := range 1000 {
		b := vip6A.As16()
		b[14], b[15] = byte(i>>8), byte(i)
		many = append(many, netip.AddrFrom16(b))
	}
	f.writes = nil
	if changed, err := c.Sync(targetsOf(many...)); err != nil || changed != 2*(len(many)-1) {
		t.Fatalf("Sync of %d tunnel IPs = %d, %v; want %d set elements", len(many), changed, err, 2*(len(many)-1))
	}
	if got := f.dump(); got != one {
		t.Errorf("the rules changed between 1 and %d tunnel IPs:\n%s\nwant:\n%s", len(many), got, one)
	}
	if slices.ContainsFunc(f.writes, func(w string) bool { return !strings.HasPrefix(w, "ipset add ") }) {
		t.Errorf("writes other than set elements: %q", f.writes)
	}
}

// TestVIPRuleFamilies: the per-tunnel-IP rule of an older version is
// read with its family's prefix only.
func TestVIPRuleFamilies(t *testing.T) {
	tests := []struct {
		line, chain string
		family      Family
		vip         netip.Addr
	}{
		{printed6RuleA, "KST-HMARK6", IPv6, vip6A},
		{printed6RuleA, "KST-HMARK6", IPv4, netip.Addr{}},
		{printedRuleA, "KST-HMARK", IPv4, vipA},
		{printedRuleA, "KST-HMARK", IPv6, netip.Addr{}},
		// /128 for the address but the IPv4 prefixes in HMARK: not ours.
		{strings.ReplaceAll(printed6RuleA, "prefix 128", "prefix 32"), "KST-HMARK6", IPv6, netip.Addr{}},
		// An IPv6 /32 network: not a tunnel IP.
		{strings.Replace(printed6RuleA, "2001:db8:96::10/128", "2001:db8::/32", 1), "KST-HMARK6", IPv6, netip.Addr{}},
	}
	for _, tt := range tests {
		r, ok, err := parseRule(tt.line, tt.chain)
		if err != nil || !ok {
			t.Fatalf("parseRule(%q) = %v, %v", tt.line, ok, err)
		}
		vip, params, ok := r.vipRule(tt.family)
		if ok != tt.vip.IsValid() || vip != tt.vip || (ok && params != testParams) {
			t.Errorf("%s vipRule(%q) = %v, %v, %t; want %v", tt.family, tt.line, vip, params, ok, tt.vip)
		}
	}
	// The old rules are read by Offsets, then replaced by Sync.
	f := newFakeIPTablesFamily(t, IPv6, slices.Concat(othersLines6, []string{printed6ChainN, printed6Jump, printed6RuleA})...)
	c := newTestChain6(t, f, testParams)
	if offsets, err := c.Offsets(); err != nil || !maps.Equal(offsets, map[netip.Addr]uint32{vip6A: 256}) {
		t.Errorf("Offsets = %v, %v; want %s at 256", offsets, err, vip6A)
	}
}

// TestSameRuleComparesPrefixes: an IPv6 HMARK rule is not the IPv4 one,
// and ip6tables' "0x0000" masks are the "0x0" Chain writes.
func TestSameRuleComparesPrefixes(t *testing.T) {
	f := newFakeIPTablesFamily(t, IPv6)
	c6 := newTestChain6(t, f, testParams)
	c4, err := NewChain(f, f, "KST-HMARK6", testParams, f)
	if err != nil {
		t.Fatal(err)
	}
	printed, _, _ := parseRule(printed6Affinity1, "KST-HMARK6")
	want6, want4 := c6.classRuleSpec(classOf(1, true)), c4.classRuleSpec(classOf(1, true))
	if !sameRule(printed.spec, want6) {
		t.Errorf("ip6tables' affinity rule\n%q\nis not the IPv6 chain's\n%q", printed.spec, want6)
	}
	if sameRule(printed.spec, want4) || sameRule(want4, want6) {
		t.Errorf("an IPv6 rule (/128 prefixes) compares equal to the IPv4 one (/32)")
	}
}

// TestCleanup6 removes every IPv6 rule, chain and set of the chain, and
// nothing else: neither others' rules nor the IPv4 chain's sets, which
// share the namespace's set names.
func TestCleanup6(t *testing.T) {
	sticky := []string{printed6RawChainN, printed6SynChainN, printed6RawJump, printed6RawRule, printed6RawSynAck, printed6SynRule,
		"-S KST-HMARK6-1 2001:db8:96::20", "-S KST-HMARK6-c3"}
	f := newFakeIPTablesFamily(t, IPv6, slices.Concat(othersLines6, synced6Lines, sticky)...)
	ipv4Sets := map[string]*fakeSet{}
	for _, name := range []string{"KST-HMARK", "KST-HMARK-0", "OTHERS"} {
		ipv4Sets[name] = &fakeSet{typ: SetType, family: unix.AF_INET, members: map[netip.Addr]Counter{vipA: {}}}
		f.sets[name] = ipv4Sets[name]
	}
	if err := newTestChain6(t, f, testParams).Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	want := newFakeIPTablesFamily(t, IPv6, othersLines6...)
	want.sets = ipv4Sets
	if got, want := stateOf(f), stateOf(want); got != want {
		t.Errorf("state after Cleanup:\n%s\nwant:\n%s", got, want)
	}
	if err := newTestChain6(t, f, testParams).Cleanup(); err != nil {
		t.Errorf("second Cleanup: %v", err)
	}
}

// TestSync6ErrorsRedactSeed: a failing ip6tables-restore (NewExecRestorer
// derives it from the ip6tables binary) quotes the IPv6 chain's rules, and
// the error shows the seed's fingerprint, not the seed.
func TestSync6ErrorsRedactSeed(t *testing.T) {
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("needs /bin/sh")
	}
	dir := t.TempDir()
	writeScript(t, filepath.Join(dir, "ip6tables-restore"), "cat >&2; exit 2\n")
	writeSaveScript(t, dir, "ip6tables")
	f := newFakeIPTablesFamily(t, IPv6, othersLines6...)
	writeSaved(t, dir, f)
	c, err := NewChainFamily(IPv6, f, f, "", testParams, NewExecRestorer(filepath.Join(dir, "ip6tables")))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Sync(targetsOf(vip6A))
	for _, want := range []string{"ip6tables-restore", "exit status 2", "--hmark-dst-prefix 128", "<seed " + SeedFingerprint(testParams.Seed) + ">"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Sync err = %v, want %q in it", err, want)
		}
	}
	if err != nil && strings.Contains(err.Error(), "c0ffee") {
		t.Errorf("Sync err = %q shows the seed", err)
	}

	// A failing set write of an IPv6 Cleanup is wrapped, naming the set.
	f = newFakeIPTablesFamily(t, IPv6, slices.Concat(othersLines6, synced6Lines)...)
	f.failWrite = "ipset destroy KST-HMARK6"
	if err := newTestChain6(t, f, testParams).Cleanup(); !errors.Is(err, errFake) || !strings.Contains(err.Error(), "KST-HMARK6") {
		t.Errorf("Cleanup with a failing set destroy = %v, want it wrapped, naming the set", err)
	}
}

// handshakeLines6 is handshakeLines for the IPv6 chain: its name, its
// sets' and 128-bit prefixes, as ip6tables prints them.
func handshakeLines6(record ...string) []string { return to6(handshakeLines(record...)) }

// to6 turns lines of the IPv4 chain KST-HMARK into the IPv6 chain's.
func to6(lines []string) []string {
	r := strings.NewReplacer("-A KST-HMARK ", "-A KST-HMARK6 ", "KST-HMARK-", "KST-HMARK6-",
		"--hmark-src-prefix 32 --hmark-dst-prefix 32", "--hmark-src-prefix 128 --hmark-dst-prefix 128")
	var out []string
	for _, l := range lines {
		out = append(out, r.Replace(l))
	}
	return out
}
