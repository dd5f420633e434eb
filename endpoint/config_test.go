package endpoint

import (
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// TestConfigValidateIPv6Limits: the IPv6 device's name (the device's with
// "6") must fit the kernel's 15 characters, and a route protocol below 5
// would make the kernel's lo addresses (::1 has address protocol 1) and
// ip's routes look like the agent's.
func TestConfigValidateIPv6Limits(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
		err  string
	}{
		{"defaults", func(*Config) {}, ""},
		{"14-character device", func(c *Config) { c.Device = strings.Repeat("d", 14) }, ""},
		{"15-character device", func(c *Config) { c.Device = strings.Repeat("d", 15) }, "must be 1-14 characters"},
		{"route protocol 5", func(c *Config) { c.RouteProtocol = 5 }, ""},
		{"route protocol 4 (ip's static)", func(c *Config) { c.RouteProtocol = 4 }, "--route-protocol 4: must be 5-255"},
		{"route protocol 1 (the kernel's lo)", func(c *Config) { c.RouteProtocol = 1 }, "--route-protocol 1: must be 5-255"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(encap.GRE)
			tc.edit(&cfg)
			err := cfg.Validate()
			if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("Validate() = %v, want %q", err, tc.err)
			}
		})
	}
	if d := testConfig(encap.GRE).IPv6Device(); d != "kst-decap6" {
		t.Errorf("IPv6Device() = %q, want kst-decap6", d)
	}
}

// TestPodAdvMSS6: the IPv6 advmss keeps an IPv6 segment within what an
// IPv4 segment of --pod-advmss fits: 20 bytes less for the inner IPv6
// header in mpls mode, 40 in gre mode, whose outer header is IPv6 too.
func TestPodAdvMSS6(t *testing.T) {
	for _, tc := range []struct {
		mode        encap.Mode
		advmss, mss int
	}{{encap.GRE, 1400, 1360}, {encap.MPLS, 1400, 1380}, {encap.GRE, 0, 0}, {encap.MPLS, 0, 0}} {
		cfg := testConfig(tc.mode)
		cfg.PodAdvMSS = tc.advmss
		if got := cfg.PodAdvMSS6(); got != tc.mss {
			t.Errorf("%s, --pod-advmss %d: PodAdvMSS6() = %d, want %d", tc.mode, tc.advmss, got, tc.mss)
		}
	}
}
