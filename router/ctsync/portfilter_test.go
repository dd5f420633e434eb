package ctsync

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables/expr"
)

func prefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func ruleStrings(f PortFilter) []string {
	var out []string
	for _, r := range f.Rules() {
		out = append(out, r.String())
	}
	return out
}

func TestPortFilterRules(t *testing.T) {
	for name, tc := range map[string]struct {
		f    PortFilter
		want []string
	}{
		"peers, sorted, once each": {
			PortFilter{Interface: "sync0", Group: 3780, Peers: prefixes("172.21.0.2/32", "10.0.0.0/24", "172.21.0.2/32")},
			[]string{
				`iifname "sync0" ip saddr 10.0.0.0/24 udp dport 3780 counter accept`,
				`iifname "sync0" ip saddr 172.21.0.2 udp dport 3780 counter accept`,
				`udp dport 3780 counter drop`,
			},
		},
		"no peers: the interface alone": {
			PortFilter{Interface: "eth1", Group: 3781},
			[]string{`iifname "eth1" udp dport 3781 counter accept`, `udp dport 3781 counter drop`},
		},
	} {
		t.Run(name, func(t *testing.T) {
			if got := ruleStrings(tc.f); !slices.Equal(got, tc.want) {
				t.Errorf("rules:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestPortRuleExprs checks the expressions against the rule they write:
// the source masked for a CIDR, compared whole for an address; the port
// in network order; the interface name padded as the kernel compares it.
func TestPortRuleExprs(t *testing.T) {
	rules := PortFilter{Interface: "sync0", Group: 3780, Peers: prefixes("10.0.0.0/24", "172.21.0.2/32")}.Rules()
	var cmps [][]byte
	var masks [][]byte
	var verdicts []expr.VerdictKind
	for _, r := range rules {
		for _, e := range r.exprs() {
			switch e := e.(type) {
			case *expr.Cmp:
				cmps = append(cmps, e.Data)
			case *expr.Bitwise:
				masks = append(masks, e.Mask)
			case *expr.Verdict:
				verdicts = append(verdicts, e.Kind)
			}
		}
	}
	udp, port := []byte{17}, []byte{0x0e, 0xc4}
	ifname := append([]byte("sync0"), make([]byte, 11)...)
	want := [][]byte{
		udp, ifname, {10, 0, 0, 0}, port,
		udp, ifname, {172, 21, 0, 2}, port,
		udp, port,
	}
	if !slices.EqualFunc(cmps, want, slices.Equal) {
		t.Errorf("compared %v, want %v", cmps, want)
	}
	if len(masks) != 1 || !slices.Equal(masks[0], []byte{255, 255, 255, 0}) {
		t.Errorf("masks %v, want one /24 mask", masks)
	}
	if !slices.Equal(verdicts, []expr.VerdictKind{expr.VerdictAccept, expr.VerdictAccept, expr.VerdictDrop}) {
		t.Errorf("verdicts %v", verdicts)
	}
}

// TestPortFilterCommentsFit: the kernel keeps 256 bytes of a rule's
// comment (NFT_USERDATA_MAXLEN), which must name the whole rule.
func TestPortFilterCommentsFit(t *testing.T) {
	f := PortFilter{Interface: "interface-15chr", Group: 65535, Peers: prefixes("255.255.255.255/32", "192.168.100.0/24")}
	for _, c := range f.comments() {
		if len(c)+1 > 256 {
			t.Errorf("comment of %d bytes: %s", len(c), c)
		}
	}
}

func TestParsePeers(t *testing.T) {
	got, err := ParsePeers(" 172.21.0.2, 10.0.0.0/24,172.21.0.2 ,172.21.0.3/32")
	if err != nil {
		t.Fatal(err)
	}
	if want := prefixes("10.0.0.0/24", "172.21.0.2/32", "172.21.0.3/32"); !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if got, err := ParsePeers(""); err != nil || got != nil {
		t.Errorf("empty: %v, %v; want no peer", got, err)
	}
	for in, want := range map[string]string{
		"10.0.0.1/24":           `"10.0.0.1/24": host bits set (the network is 10.0.0.0/24)`,
		"2001:db8::1":           `"2001:db8::1": not IPv4`,
		"2001:db8::/64":         `"2001:db8::/64": not IPv4`,
		"::ffff:10.0.0.1":       `"::ffff:10.0.0.1": not IPv4`,
		"10.0.0.1,,10.0.0.2":    "an empty element",
		"10.0.0.1,":             "an empty element",
		"router-b":              `"router-b": not an IPv4 address or CIDR`,
		"10.0.0.0/33":           `"10.0.0.0/33": not an IPv4 address or CIDR`,
		"10.0.0.1 10.0.0.2":     `"10.0.0.1 10.0.0.2": not an IPv4 address or CIDR`,
		"10.0.0.1;10.0.0.2/32,": "not an IPv4 address or CIDR",
	} {
		if _, err := ParsePeers(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParsePeers(%q) = %v, want an error with %q", in, err, want)
		}
	}
}

func TestPortFilterValidate(t *testing.T) {
	ok := PortFilter{Interface: "sync0", Group: 3780, Peers: prefixes("10.0.0.2/32")}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		change func(*PortFilter)
		want   string
	}{
		"no interface":   {func(f *PortFilter) { f.Interface = "" }, "--conntrack-sync-interface is empty"},
		"long interface": {func(f *PortFilter) { f.Interface = "interface-16char" }, "longer than 15 characters"},
		"group":          {func(f *PortFilter) { f.Group = 0 }, "--conntrack-sync-group 0"},
		"IPv6 peer":      {func(f *PortFilter) { f.Peers = prefixes("2001:db8::/64") }, "--conntrack-sync-peers 2001:db8::/64: not an IPv4 address or CIDR"},
	} {
		t.Run(name, func(t *testing.T) {
			f := ok
			tc.change(&f)
			if err := f.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate: %v, want an error with %q", err, tc.want)
			}
			c := testConfig("/run/kst")
			c.Interface, c.Group, c.Peers = f.Interface, f.Group, f.Peers
			if err := c.Validate(); err == nil {
				t.Error("Config.Validate accepts it")
			}
		})
	}
}
