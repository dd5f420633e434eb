package tunnelclaim

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestParsePools(t *testing.T) {
	for _, tc := range []struct {
		value   string
		want    string // Pools.String of the result
		errPart string
	}{
		{value: "", want: ""},
		{value: " ; ", want: ""},
		{value: "192.0.2.0/24", want: "192.0.2.0/24"},
		{value: "192.0.2.0/24;203.0.113.0/28=team-b, team-a", want: "192.0.2.0/24;203.0.113.0/28=team-a,team-b"},
		{value: "192.0.2.0/24\n 203.0.113.0/28 = team-a ;", want: "192.0.2.0/24;203.0.113.0/28=team-a"},
		{value: "203.0.113.7", want: "203.0.113.7/32"},
		{value: "10.0.0.0/8=a,a", want: "10.0.0.0/8=a"},
		{value: "198.51.100.0/24", want: "198.51.100.0/24"}, // documentation ranges are allowed
		{value: "192.0.2.0/33", errPart: `pool "192.0.2.0/33": not a CIDR`},
		{value: "example.com", errPart: `pool "example.com": not a CIDR or an address`},
		{value: "192.0.2.1/24", errPart: "host bits are set: write 192.0.2.0/24"},
		{value: "2001:db8::/64", want: "2001:db8::/64"},
		{value: "2001:db8:5::/64=team-a; 192.0.2.0/24", want: "2001:db8:5::/64=team-a;192.0.2.0/24"},
		{value: "2001:db8::7", want: "2001:db8::7/128"},
		{value: "fd00:5::/48", want: "fd00:5::/48"}, // unique local addresses are allowed
		{value: "2001:db8::1/64", errPart: "host bits are set: write 2001:db8::/64"},
		{value: "::ffff:192.0.2.0/120", errPart: "IPv4-mapped IPv6: write the range as IPv4"},
		{value: "fe80::/64", errPart: "reserved range fe80::/10 (link-local)"},
		{value: "ff00::/12", errPart: "multicast"},
		{value: "::/0", errPart: "reserved range ::/8"},
		{value: "::1", errPart: "reserved range ::/8"},
		{value: "100::/64", errPart: "discard-only"},
		{value: "2001::/32", errPart: "IETF protocol assignments"},
		{value: "fec0::/16", errPart: "site-local"},
		{value: "2001:db8::/32;2001:db8:5::/64", errPart: `pool "2001:db8:5::/64" overlaps pool "2001:db8::/32"`},
		{value: "127.0.0.0/8", errPart: "reserved range 127.0.0.0/8 (loopback)"},
		{value: "0.0.0.0/0", errPart: `pool "0.0.0.0/0": overlaps the reserved range 0.0.0.0/8`},
		{value: "169.254.10.0/24", errPart: "link-local"},
		{value: "224.0.0.0/3", errPart: "multicast"},
		{value: "255.255.255.255", errPart: "240.0.0.0/4"},
		{value: "192.0.0.0/29", errPart: "IETF protocol assignments"},
		{value: "192.0.2.0/24=", errPart: "empty namespace"},
		{value: "192.0.2.0/24=a,,b", errPart: "empty namespace"},
		{value: "192.0.2.0/24=Team_A", errPart: `namespace "Team_A" is not a valid namespace name`},
		{value: "192.0.2.0/24;192.0.2.128/25=a", errPart: `pool "192.0.2.128/25=a" overlaps pool "192.0.2.0/24"`},
		{value: "192.0.2.0/24;192.0.2.0/24", errPart: "overlaps"},
	} {
		got, err := ParsePools(tc.value)
		if tc.errPart != "" {
			if err == nil || !strings.Contains(err.Error(), tc.errPart) {
				t.Errorf("ParsePools(%q) = %v, %v; want error containing %q", tc.value, got, err, tc.errPart)
			}
			continue
		}
		if err != nil || got.String() != tc.want {
			t.Errorf("ParsePools(%q) = %q, %v; want %q", tc.value, got, err, tc.want)
		}
	}
}

// The canonical form reads back to the same pools.
func TestParsePoolsRoundTrip(t *testing.T) {
	pools, err := ParsePools("203.0.113.0/28=team-b,team-a;192.0.2.0/24;10.1.0.0/16=x")
	if err != nil {
		t.Fatal(err)
	}
	again, err := ParsePools(pools.String())
	if err != nil || again.String() != pools.String() {
		t.Fatalf("round trip: %q, %v; want %q", again, err, pools)
	}
}

func TestParseCIDRs(t *testing.T) {
	got, err := ParseCIDRs(" 10.96.0.0/12, fd00::/108 ,10.1.2.3/16")
	want := []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("fd00::/108"), netip.MustParsePrefix("10.1.0.0/16")}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("ParseCIDRs = %v, %v; want %v", got, err, want)
	}
	if _, err := ParseCIDRs("10.96.0.0/12,nope"); err == nil || !strings.Contains(err.Error(), `"nope" is not a CIDR`) {
		t.Fatalf("ParseCIDRs(bad) error = %v", err)
	}
}

func testNode(name string, podCIDRs []string, addrs ...corev1.NodeAddress) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{PodCIDRs: podCIDRs}, Status: corev1.NodeStatus{Addresses: addrs}}
}

func TestAdmit(t *testing.T) {
	pools, err := ParsePools("192.0.2.0/24;203.0.113.0/28=team-a,team-b;10.0.0.0/8;fd00::/8;2001:db8:7::/64=team-a")
	if err != nil {
		t.Fatal(err)
	}
	legacy := testNode("n3", nil, corev1.NodeAddress{Type: corev1.NodeHostName, Address: "10.3.0.9"})
	legacy.Spec.PodCIDR = "10.9.0.0/24"
	known := KnownNetworks([]*corev1.Node{
		testNode("n1", []string{"10.244.1.0/24", "fd00:1::/64"},
			corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "10.0.0.11"},
			corev1.NodeAddress{Type: corev1.NodeExternalIP, Address: "192.0.2.200"}),
		testNode("n2", []string{"10.244.2.0/24"}, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "10.0.0.12"},
			corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "fd00:0:0:5::12"}),
		legacy,
	}, []netip.Prefix{netip.MustParsePrefix("10.128.0.0/12")}, []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("fd00:96::/112")})

	for _, tc := range []struct {
		name, ip, namespace string
		pools               Pools
		errPart             string // empty: admitted
	}{
		{name: "in an open pool", ip: "192.0.2.10", namespace: "any", pools: pools},
		{name: "in a private pool, clear of the cluster's ranges", ip: "10.1.2.3", namespace: "any", pools: pools},
		{name: "namespace-limited pool, allowed namespace", ip: "203.0.113.5", namespace: "team-b", pools: pools},
		{name: "namespace-limited pool, other namespace", ip: "203.0.113.5", namespace: "team-c", pools: pools,
			errPart: "tunnel IP 203.0.113.5 is in address pool 203.0.113.0/28, which only namespaces team-a, team-b may use, not team-c"},
		{name: "in no pool", ip: "198.51.100.1", namespace: "any", pools: pools,
			errPart: "tunnel IP 198.51.100.1 is in no address pool (--pools 192.0.2.0/24;203.0.113.0/28=team-a,team-b;10.0.0.0/8;fd00::/8;2001:db8:7::/64=team-a)"},
		{name: "next to a limited pool", ip: "203.0.113.16", namespace: "team-a", pools: pools, errPart: "in no address pool"},
		{name: "no pool configured", ip: "192.0.2.10", namespace: "any",
			errPart: "tunnel IP 192.0.2.10 is not served: no address pool is configured (--pools)"},
		{name: "a Node's InternalIP", ip: "10.0.0.12", namespace: "any", pools: pools, errPart: "tunnel IP 10.0.0.12 is the address of Node n2"},
		{name: "a Node's ExternalIP inside a pool", ip: "192.0.2.200", namespace: "any", pools: pools, errPart: "the address of Node n1"},
		{name: "a hostname-typed address is not a node address", ip: "10.3.0.9", namespace: "any", pools: pools},
		{name: "inside a Node's spec.podCIDRs", ip: "10.244.2.40", namespace: "any", pools: pools,
			errPart: "tunnel IP 10.244.2.40 is inside the pod network 10.244.2.0/24 (Node n2 spec.podCIDRs)"},
		{name: "inside a Node's legacy spec.podCIDR", ip: "10.9.0.1", namespace: "any", pools: pools, errPart: "pod network 10.9.0.0/24 (Node n3"},
		{name: "inside --pod-cidr", ip: "10.130.0.1", namespace: "any", pools: pools, errPart: "inside the pod network 10.128.0.0/12 (--pod-cidr)"},
		{name: "inside --service-cidr", ip: "10.96.0.1", namespace: "any", pools: pools,
			errPart: "tunnel IP 10.96.0.1 is inside the service network 10.96.0.0/12 (--service-cidr)"},
		{name: "IPv6 in an open pool", ip: "fd00:7::10", namespace: "any", pools: pools},
		{name: "IPv6 in a namespace-limited pool", ip: "2001:db8:7::10", namespace: "team-b", pools: pools,
			errPart: "tunnel IP 2001:db8:7::10 is in address pool 2001:db8:7::/64, which only namespaces team-a may use, not team-b"},
		{name: "IPv6 in no pool", ip: "2001:db8:8::10", namespace: "team-a", pools: pools, errPart: "tunnel IP 2001:db8:8::10 is in no address pool"},
		{name: "a Node's IPv6 InternalIP", ip: "fd00:0:0:5::12", namespace: "any", pools: pools, errPart: "tunnel IP fd00:0:0:5::12 is the address of Node n2"},
		{name: "inside a Node's IPv6 pod range", ip: "fd00:1::40", namespace: "any", pools: pools,
			errPart: "tunnel IP fd00:1::40 is inside the pod network fd00:1::/64 (Node n1 spec.podCIDRs)"},
		{name: "inside an IPv6 --service-cidr", ip: "fd00:96::a", namespace: "any", pools: pools,
			errPart: "inside the service network fd00:96::/112 (--service-cidr)"},
		{name: "IPv4-mapped is never a tunnel IP", ip: "::ffff:192.0.2.10", namespace: "any", pools: pools,
			errPart: "not a plain IPv4 or IPv6 address"},
		{name: "reserved IPv6, whatever the pools", ip: "fe80::1", namespace: "any", pools: Pools{{Prefix: netip.MustParsePrefix("fe80::/64")}},
			errPart: "reserved range fe80::/10 (link-local)"},
		{name: "reserved, whatever the pools", ip: "127.0.0.1", namespace: "any", pools: Pools{{Prefix: netip.MustParsePrefix("127.0.0.0/8")}},
			errPart: "reserved range 127.0.0.0/8 (loopback)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.pools.Admit(netip.MustParseAddr(tc.ip), tc.namespace, known)
			if tc.errPart == "" {
				if err != nil {
					t.Fatalf("Admit(%s, %s) = %v, want admitted", tc.ip, tc.namespace, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.errPart) {
				t.Fatalf("Admit(%s, %s) = %v, want an error containing %q", tc.ip, tc.namespace, err, tc.errPart)
			}
		})
	}
}

// Every daemon lists the Nodes in its own order: the networks, and so the
// refusal messages, must not depend on it.
func TestKnownNetworksOrderIndependent(t *testing.T) {
	a := testNode("a", []string{"10.244.1.0/24"}, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "10.0.0.1"})
	b := testNode("b", []string{"10.244.1.0/24"}, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "10.0.0.1"})
	c := testNode("c", []string{"10.244.0.0/16"})
	one := KnownNetworks([]*corev1.Node{a, b, c}, nil, nil)
	two := KnownNetworks([]*corev1.Node{c, b, a}, nil, nil)
	if !one.Equal(two) {
		t.Fatalf("order changed the networks:\n%+v\n%+v", one, two)
	}
	if one.NodeAddresses[netip.MustParseAddr("10.0.0.1")] != "a" {
		t.Fatalf("shared address credited to %q, want the first name, a", one.NodeAddresses[netip.MustParseAddr("10.0.0.1")])
	}
	if one.Equal(KnownNetworks([]*corev1.Node{a, c}, nil, nil)) {
		t.Fatal("a removed Node changed nothing")
	}
}

// Policy.Equal compares meaning: the pools as --pools renders them and the
// ranges; an empty list equals none.
func TestPolicyEqual(t *testing.T) {
	pools := func(s string) Pools {
		p, err := ParsePools(s)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	base := Policy{Pools: pools("192.0.2.0/24;2001:db8:2::/64=team-a"), PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
	for _, tc := range []struct {
		name string
		q    Policy
		want bool
	}{
		{"the same", Policy{Pools: pools("192.0.2.0/24;2001:db8:2::/64=team-a"), PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}, true},
		{"no Service range either way", Policy{Pools: base.Pools, PodCIDRs: base.PodCIDRs, ServiceCIDRs: []netip.Prefix{}}, true},
		{"another namespace", Policy{Pools: pools("192.0.2.0/24;2001:db8:2::/64=team-b"), PodCIDRs: base.PodCIDRs}, false},
		{"a pool less", Policy{Pools: pools("192.0.2.0/24"), PodCIDRs: base.PodCIDRs}, false},
		{"another pod range", Policy{Pools: base.Pools, PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.245.0.0/16")}}, false},
		{"a Service range", Policy{Pools: base.Pools, PodCIDRs: base.PodCIDRs, ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}}, false},
	} {
		if got := base.Equal(tc.q); got != tc.want {
			t.Errorf("%s: Equal = %t, want %t", tc.name, got, tc.want)
		}
	}
}
