package ctsync

import (
	"net/netip"
	"strings"
	"testing"
)

func testConfig(dir string) Config {
	return Config{
		Interface: "sync0", Address: netip.MustParseAddr("10.99.0.1"), Group: DefaultGroup,
		Prefixes: []netip.Prefix{netip.MustParsePrefix("2001:db8:7::/64"), netip.MustParsePrefix("203.0.113.0/24")},
		Dir:      dir,
	}
}

func TestRenderSharesOnlyThePools(t *testing.T) {
	conf, err := Render(testConfig("/run/kst"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"DisableExternalCache On", "StartupResync On",
		"IPv4_address 225.0.0.50", "Group 3780", "IPv4_interface 10.99.0.1", "Interface sync0",
		"LockFile /run/kst/conntrackd.lock", "Path /run/kst/conntrackd.ctl",
		"Filter From Userspace", "Protocol Accept {\n\t\t\tTCP\n\t\t}", "NetlinkOverrunResync Off",
		"Address Accept {\n\t\t\tIPv4_address 203.0.113.0/24\n\t\t\tIPv6_address 2001:db8:7::/64\n\t\t}",
	} {
		if !strings.Contains(conf, want) {
			t.Errorf("configuration lacks %q:\n%s", want, conf)
		}
	}
	if strings.Contains(conf, "UDP") {
		t.Errorf("UDP entries are shared; their copies would lapse between bulk sends:\n%s", conf)
	}
	if strings.Count(conf, "{") != strings.Count(conf, "}") {
		t.Errorf("unbalanced braces:\n%s", conf)
	}
}

func TestRenderRefuses(t *testing.T) {
	for name, tc := range map[string]struct {
		change func(*Config)
		want   string
	}{
		"no pool":         {func(c *Config) { c.Prefixes = nil }, "no address pool"},
		"no interface":    {func(c *Config) { c.Interface = "" }, "--conntrack-sync-interface is empty"},
		"IPv6 address":    {func(c *Config) { c.Address = netip.MustParseAddr("2001:db8::1") }, "no IPv4 address"},
		"no address":      {func(c *Config) { c.Address = netip.Addr{} }, "no IPv4 address"},
		"group":           {func(c *Config) { c.Group = 70000 }, "--conntrack-sync-group 70000"},
		"relative dir":    {func(c *Config) { c.Dir = "run" }, "absolute path"},
		"brace in a name": {func(c *Config) { c.Interface = "eth0}" }, "not an interface name"},
		"blank in dir":    {func(c *Config) { c.Dir = "/run/a b" }, "blanks"},
	} {
		t.Run(name, func(t *testing.T) {
			c := testConfig("/run/kst")
			tc.change(&c)
			if _, err := Render(c); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Render: got %v, want an error with %q", err, tc.want)
			}
		})
	}
}
