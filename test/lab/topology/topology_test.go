package topology

import (
	"net/netip"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

func TestIPv6AddressesMirrorTheIPv4Ones(t *testing.T) {
	for _, tc := range []struct {
		got  netip.Addr
		want string
	}{
		{TunnelIP6(10), "2001:db8:2::10"},
		{TunnelIP6(1), "2001:db8:2::1"},
		{TunnelIP6(9999), "2001:db8:2::9999"},
		{fabricAddr6(11), "fd00:172:20::11"},
		{fabricAddr6(1), GatewayAddr6.String()},
		{mirror6(netip.MustParsePrefix("fd00:10:244:2::/64"), 12), "fd00:10:244:2::12"},
		{mirror6(clientNet6, 10), ClientAddr6.String()},
	} {
		if tc.got != netip.MustParseAddr(tc.want) {
			t.Errorf("got %v, want %s", tc.got, tc.want)
		}
	}
	for _, p := range []netip.Prefix{TunnelNet6, clientNet6, fabricNet6} {
		if !p.Contains(mirror6(p, 42)) {
			t.Errorf("mirror6(%v, 42) = %v is outside it", p, mirror6(p, 42))
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("TunnelIP6(10000) did not panic")
		}
	}()
	TunnelIP6(10000)
}

func TestServiceFamilies(t *testing.T) {
	for _, tc := range []struct {
		families []corev1.IPFamily
		classic  bool
	}{
		{nil, true},
		{[]corev1.IPFamily{corev1.IPv4Protocol}, true},
		{DualStack, false},
		{[]corev1.IPFamily{corev1.IPv6Protocol}, false},
	} {
		if got := ipv4Only(tc.families); got != tc.classic {
			t.Errorf("ipv4Only(%v) = %v", tc.families, got)
		}
	}
	if got := sliceName("web", discoveryv1.AddressTypeIPv4); got != "web-lab" {
		t.Errorf("IPv4 slice name %q", got)
	}
	if got := sliceName("web", discoveryv1.AddressTypeIPv6); got != "web-lab6" {
		t.Errorf("IPv6 slice name %q", got)
	}
}

// Each router takes conntrackd's messages from the other routers' sync
// addresses alone.
func TestSyncPeersAreTheOtherRouters(t *testing.T) {
	l := testLab()
	l.Routers = append(l.Routers, &Node{Host: Host{Name: "router-c"}, Tunnel: true})
	for i, want := range []string{"172.21.0.2,172.21.0.3", "172.21.0.1,172.21.0.3", "172.21.0.1,172.21.0.2"} {
		if got := l.syncPeers(l.Routers[i]); got != want {
			t.Errorf("%s: --conntrack-sync-peers %q, want %q", l.Routers[i].Name, got, want)
		}
	}
}
