package tunnelclaim

import (
	"net/netip"
	"strings"
	"testing"
)

func TestParseIP(t *testing.T) {
	for _, tc := range []struct {
		value   string
		want    string
		errPart string
	}{
		{value: "192.0.2.10", want: "192.0.2.10"},
		{value: "10.0.0.1", want: "10.0.0.1"},
		{value: "", errPart: "empty"},
		{value: " 192.0.2.10", errPart: "whitespace"},
		{value: "192.0.2.10\n", errPart: "whitespace"},
		{value: "192.0.2.10 192.0.2.11", errPart: "whitespace"},
		{value: "192.0.2.10,192.0.2.11", errPart: "several"},
		{value: "192.0.2.10;192.0.2.11", errPart: "several"},
		{value: "example.com", errPart: "not an IP"},
		{value: "192.0.2.0/24", errPart: "not an IP"},
		{value: "192.0.2.256", errPart: "not an IP"},
		{value: "2001:db8::1", errPart: "IPv6"},
		{value: "::ffff:192.0.2.1", errPart: "IPv4-mapped"},
		{value: "fe80::1%eth0", errPart: "zone"},
		{value: "0.0.0.0", errPart: "unspecified"},
		{value: "127.0.0.1", errPart: "loopback"},
		{value: "127.1.2.3", errPart: "loopback"},
		{value: "169.254.1.1", errPart: "link-local"},
		{value: "224.0.0.1", errPart: "multicast"},
		{value: "239.1.1.1", errPart: "multicast"},
		{value: "255.255.255.255", errPart: "broadcast"},
		{value: "240.0.0.1", errPart: "reserved"},
		{value: "0.1.2.3", errPart: "0.0.0.0/8"},
	} {
		got, err := ParseIP(tc.value)
		if tc.errPart != "" {
			if err == nil || !strings.Contains(err.Error(), tc.errPart) {
				t.Errorf("ParseIP(%q) = %v, %v; want error containing %q", tc.value, got, err, tc.errPart)
			}
			continue
		}
		if err != nil || got != netip.MustParseAddr(tc.want) {
			t.Errorf("ParseIP(%q) = %v, %v; want %s", tc.value, got, err, tc.want)
		}
	}
}

func FuzzParseIP(f *testing.F) {
	for _, s := range []string{"192.0.2.10", " 1.2.3.4", "1.2.3.4,5.6.7.8", "::1", "127.0.0.1", "", "1.2.3.4/32", "0x7f.1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, value string) {
		ip, err := ParseIP(value)
		if err != nil {
			if ip.IsValid() {
				t.Fatalf("error %v but address %v returned", err, ip)
			}
			if !strings.Contains(err.Error(), Annotation) {
				t.Fatalf("error %q does not name the annotation", err)
			}
			return
		}
		if !ip.Is4() || ip.IsLoopback() || ip.IsMulticast() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
			t.Fatalf("accepted unroutable %v from %q", ip, value)
		}
		if ip.String() != value {
			t.Fatalf("accepted %q, which is not the canonical form %q", value, ip)
		}
	})
}
