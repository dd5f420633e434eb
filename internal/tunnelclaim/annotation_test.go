package tunnelclaim

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestParseIPs(t *testing.T) {
	for _, tc := range []struct {
		value   string
		want    string // the addresses, comma-separated, as returned
		errPart string
	}{
		{value: "192.0.2.10", want: "192.0.2.10"},
		{value: "10.0.0.1", want: "10.0.0.1"},
		{value: "2001:db8::10", want: "2001:db8::10"},
		{value: "2001:DB8:0::10", want: "2001:db8::10"},
		{value: "fd00:5::1", want: "fd00:5::1"},
		{value: "192.0.2.10, 2001:db8::10", want: "192.0.2.10,2001:db8::10"},
		{value: "2001:db8::10,192.0.2.10", want: "192.0.2.10,2001:db8::10"},
		{value: " 192.0.2.10 ,\t2001:db8::10 ", want: "192.0.2.10,2001:db8::10"},
		{value: " 192.0.2.10", want: "192.0.2.10"},
		{value: "", errPart: "empty"},
		{value: "  ", errPart: "empty"},
		{value: "192.0.2.10,", errPart: "an empty value"},
		{value: ",2001:db8::10", errPart: "an empty value"},
		{value: "192.0.2.10\n2001:db8::10", errPart: "separate the addresses with a comma"},
		{value: "192.0.2.10;2001:db8::10", errPart: "separate the addresses with a comma"},
		{value: "192.0.2.10 192.0.2.11", errPart: `"192.0.2.10 192.0.2.11" is not an IP address`},
		{value: "192.0.2.10,192.0.2.11", errPart: "lists two IPv4 addresses"},
		{value: "2001:db8::1,2001:db8::2", errPart: "lists two IPv6 addresses"},
		{value: "192.0.2.10,2001:db8::10,192.0.2.11", errPart: "lists 3 values"},
		{value: "example.com", errPart: "not an IP"},
		{value: "192.0.2.0/24", errPart: "not an IP"},
		{value: "2001:db8::/64", errPart: "not an IP"},
		{value: "192.0.2.256", errPart: "not an IP"},
		{value: "::ffff:192.0.2.1", errPart: "IPv4-mapped"},
		{value: "192.0.2.10, ::ffff:192.0.2.1", errPart: "::ffff:192.0.2.1 is an IPv4-mapped"},
		{value: "fe80::1%eth0", errPart: "zone"},
		{value: "0.0.0.0", errPart: "unspecified"},
		{value: "::", errPart: "unspecified"},
		{value: "127.0.0.1", errPart: "loopback"},
		{value: "127.1.2.3", errPart: "loopback"},
		{value: "::1", errPart: "loopback"},
		{value: "169.254.1.1", errPart: "link-local"},
		{value: "fe80::1", errPart: "link-local"},
		{value: "192.0.2.10, fe80::1", errPart: "fe80::1 is link-local"},
		{value: "224.0.0.1", errPart: "multicast"},
		{value: "239.1.1.1", errPart: "multicast"},
		{value: "ff02::1", errPart: "multicast"},
		{value: "ff05::2", errPart: "multicast"},
		{value: "255.255.255.255", errPart: "broadcast"},
		{value: "240.0.0.1", errPart: "reserved"},
		{value: "0.1.2.3", errPart: "0.0.0.0/8"},
	} {
		got, err := ParseIPs(tc.value)
		if tc.errPart != "" {
			if err == nil || !strings.Contains(err.Error(), tc.errPart) || !strings.Contains(err.Error(), Annotation) {
				t.Errorf("ParseIPs(%q) = %v, %v; want an error naming %s and containing %q", tc.value, got, err, Annotation, tc.errPart)
			}
			continue
		}
		var want []netip.Addr
		for _, s := range strings.Split(tc.want, ",") {
			want = append(want, netip.MustParseAddr(s))
		}
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParseIPs(%q) = %v, %v; want %v", tc.value, got, err, want)
		}
	}
}

func FuzzParseIPs(f *testing.F) {
	for _, s := range []string{"192.0.2.10", " 1.2.3.4", "1.2.3.4,5.6.7.8", "::1", "127.0.0.1", "", "1.2.3.4/32", "0x7f.1",
		"192.0.2.10, 2001:db8::10", "2001:db8::10,192.0.2.10", "::ffff:1.2.3.4", "fe80::1%lo", "2001:db8::1,,", "ff02::1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, value string) {
		ips, err := ParseIPs(value)
		if err != nil {
			if ips != nil {
				t.Fatalf("error %v but addresses %v returned", err, ips)
			}
			if !strings.Contains(err.Error(), Annotation) {
				t.Fatalf("error %q does not name the annotation", err)
			}
			return
		}
		if len(ips) < 1 || len(ips) > 2 {
			t.Fatalf("%q gave %d addresses", value, len(ips))
		}
		if len(ips) == 2 && !(ips[0].Is4() && ips[1].Is6()) {
			t.Fatalf("%q gave %v: want one IPv4 address, then one IPv6 address", value, ips)
		}
		entries := strings.Split(value, ",")
		if len(entries) != len(ips) {
			t.Fatalf("%q has %d entries but gave %d addresses", value, len(entries), len(ips))
		}
		for _, ip := range ips {
			if ip.Zone() != "" || ip.Is4In6() || ip.IsLoopback() || ip.IsMulticast() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
				t.Fatalf("accepted unroutable %v from %q", ip, value)
			}
			found := false
			for _, e := range entries {
				if a, err := netip.ParseAddr(strings.TrimSpace(e)); err == nil && a == ip {
					found = true
				}
			}
			if !found {
				t.Fatalf("%v is not one of the entries of %q", ip, value)
			}
		}
	})
}
