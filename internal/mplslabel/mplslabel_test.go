package mplslabel

import (
	"net/netip"
	"testing"
)

func TestForEndpoint(t *testing.T) {
	for _, tc := range []struct {
		pod  string
		want uint32
	}{
		{"10.244.0.0", 1024},
		{"10.244.1.5", 1024 + 256 + 5},
		{"10.9.255.255", 1024 + 65535},
	} {
		got, err := ForEndpoint(netip.MustParseAddr(tc.pod))
		if err != nil || got != tc.want {
			t.Errorf("ForEndpoint(%s) = %d, %v; want %d", tc.pod, got, err, tc.want)
		}
		if got >= PlatformLabels || got < 16 || got == PodLabel {
			t.Errorf("label %d for %s is outside the usable range", got, tc.pod)
		}
	}
	v4, _ := ForEndpoint(netip.MustParseAddr("10.244.1.5"))
	for _, tc := range []struct {
		pod  string
		want uint32
	}{
		{"fd00:10:244:1::", Base6},
		{"fd00:10:244:1::105", Base6 + 256 + 5},
		{"fd00:10:244:1::ffff", Base6 + 65535},
	} {
		got, err := ForEndpoint(netip.MustParseAddr(tc.pod))
		if err != nil || got != tc.want {
			t.Errorf("ForEndpoint(%s) = %d, %v; want %d", tc.pod, got, err, tc.want)
		}
		if got >= PlatformLabels || got == v4 {
			t.Errorf("label %d for %s is outside the IPv6 range or equals an IPv4 pod's", got, tc.pod)
		}
	}
	for _, bad := range []netip.Addr{netip.MustParseAddr("::ffff:10.244.1.5"), {}} {
		if l, err := ForEndpoint(bad); err == nil {
			t.Errorf("ForEndpoint(%v) = %d, want an error", bad, l)
		}
	}
}

func TestDistinctWithinASlash16(t *testing.T) {
	seen := map[uint32]netip.Addr{}
	for i := 0; i < 1<<16; i++ {
		pod := netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})
		l, err := ForEndpoint(pod)
		if err != nil {
			t.Fatal(err)
		}
		if prev, ok := seen[l]; ok {
			t.Fatalf("%v and %v share label %d", prev, pod, l)
		}
		seen[l] = pod
	}
}
