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
	if _, err := ForEndpoint(netip.MustParseAddr("fd00::1")); err == nil {
		t.Error("IPv6 pod address accepted")
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
