package datapath

import (
	"net/netip"
	"strings"
	"testing"
)

// TestChainNameLimit: with generations, hmark's sticky mode adds a raw
// subchain named after the chain plus "-SYN", which must fit iptables' 28
// characters; the router refuses a longer --chain at start, not later.
func TestChainNameLimit(t *testing.T) {
	for _, tc := range []struct {
		generations, length int
		ok                  bool
	}{
		{1, 28, true}, {1, 29, false},
		{4, 24, true}, {4, 25, false},
	} {
		cfg := testConfig()
		cfg.Generations = tc.generations
		cfg.Chain = strings.Repeat("K", tc.length)
		err := cfg.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("generations %d, chain of %d characters: Validate() = %v, want ok=%v", tc.generations, tc.length, err, tc.ok)
		}
	}
}

// TestValidateIPv6Names: the IPv6 datapath needs its own device and chain,
// named apart from IPv4's (both families' ipsets share one namespace);
// an IPv4 configuration without them stays valid.
func TestValidateIPv6Names(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*Config)
		bad    string // a word of the error; "" for valid
	}{
		{"defaults, IPv6", func(c *Config) { c.Family = IPv6 }, ""},
		{"IPv4 without IPv6 names", func(c *Config) { c.GRE6Device, c.Chain6 = "", "" }, ""},
		{"IPv6 without a device", func(c *Config) { c.Family, c.GRE6Device = IPv6, "" }, "gre6 device"},
		{"IPv6 in mpls mode needs no device", func(c *Config) { c.Family, c.Mode, c.GRE6Device = IPv6, "mpls", "" }, ""},
		// A device the operator made may carry both families; startup
		// refuses one name for two devices it would create.
		{"device named as IPv4's", func(c *Config) { c.GRE6Device = c.GREDevice }, ""},
		{"fallback device", func(c *Config) { c.GRE6Device = "ip6gre0" }, "fallback"},
		{"long device", func(c *Config) { c.GRE6Device = strings.Repeat("g", 16) }, "gre6 device"},
		{"IPv6 without a chain", func(c *Config) { c.Family, c.Chain6 = IPv6, "" }, "chain6"},
		{"chain named as IPv4's", func(c *Config) { c.Chain6 = c.Chain }, "chain6"},
		{"long chain", func(c *Config) { c.Chain6 = strings.Repeat("K", 25) }, "chain6"},
		{"no such family", func(c *Config) { c.Family = 3 }, "family"},
	} {
		cfg := testConfig()
		tc.change(&cfg)
		err := cfg.Validate()
		if tc.bad == "" && err != nil || tc.bad != "" && (err == nil || !strings.Contains(err.Error(), tc.bad)) {
			t.Errorf("%s: Validate() = %v, want an error naming %q", tc.name, err, tc.bad)
		}
	}
	cfg := testConfig().ForFamily(IPv6)
	if cfg.GREDeviceName() != DefaultGRE6Device || cfg.ChainName() != DefaultChain6 ||
		testConfig().GREDeviceName() != DefaultGREDevice || testConfig().ChainName() != DefaultChain {
		t.Errorf("per-family names: %q %q", cfg.GREDeviceName(), cfg.ChainName())
	}
}

func TestFamilyOf(t *testing.T) {
	for addr, want := range map[string]Family{"192.0.2.1": IPv4, "2001:db8::1": IPv6, "::1": IPv6} {
		if f, ok := FamilyOf(netip.MustParseAddr(addr)); !ok || f != want {
			t.Errorf("FamilyOf(%s) = %v, %v; want %v", addr, f, ok, want)
		}
	}
	for _, a := range []netip.Addr{{}, netip.MustParseAddr("::ffff:192.0.2.1")} {
		if f, ok := FamilyOf(a); ok {
			t.Errorf("FamilyOf(%v) = %v, want none", a, f)
		}
	}
}
