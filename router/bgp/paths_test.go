package bgp

import (
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
)

var (
	v4a, v4b = netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	v6a, v6b = netip.MustParseAddr("2001:db8:5::1"), netip.MustParseAddr("2001:db8:5::2")
	nh4, nh6 = netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("2001:db8:100::7")
)

func set(vips ...netip.Addr) map[netip.Addr]bool {
	m := map[netip.Addr]bool{}
	for _, v := range vips {
		m[v] = true
	}
	return m
}

func TestNextHopsFor(t *testing.T) {
	node := Node{Name: "n1", Address: nh4, AddressIPv6: nh6}
	for _, tc := range []struct {
		name string
		cfg  Config
		node Node
		want NextHops
	}{
		{"the node's address of each family", Config{}, node, NextHops{IPv4: nh4, IPv6: nh6}},
		{"configured next hops win", Config{NextHop: "203.0.113.1", NextHopIPv6: "2001:db8:ff::1"}, node,
			NextHops{IPv4: netip.MustParseAddr("203.0.113.1"), IPv6: netip.MustParseAddr("2001:db8:ff::1")}},
		{"IPv4-only node: no IPv6 next hop", Config{}, Node{Name: "n1", Address: nh4}, NextHops{IPv4: nh4}},
		{"IPv4-only node, nextHopIPv6 set", Config{NextHopIPv6: "2001:db8:ff::1"}, Node{Name: "n1", Address: nh4},
			NextHops{IPv4: nh4, IPv6: netip.MustParseAddr("2001:db8:ff::1")}},
		{"IPv6-only node", Config{}, Node{Name: "n1", AddressIPv6: nh6}, NextHops{IPv6: nh6}},
		{"no node (no --node-name)", Config{NextHop: "203.0.113.1"}, Node{}, NextHops{IPv4: netip.MustParseAddr("203.0.113.1")}},
		{"a link-local node address is no next hop", Config{}, Node{Address: nh4, AddressIPv6: netip.MustParseAddr("fe80::1")}, NextHops{IPv4: nh4}},
	} {
		if got := NextHopsFor(tc.cfg, tc.node); got != tc.want {
			t.Errorf("%s: NextHopsFor = %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func TestPlan(t *testing.T) {
	both := NextHops{IPv4: nh4, IPv6: nh6}
	moved6 := netip.MustParseAddr("2001:db8:100::8")
	for _, tc := range []struct {
		name      string
		desired   map[netip.Addr]bool
		hops      NextHops
		announced map[netip.Addr]netip.Addr
		want      PathPlan
	}{
		{name: "dual stack, nothing announced yet: each family with its next hop",
			desired: set(v6a, v4a, v6b, v4b), hops: both,
			want: PathPlan{Announce: []Announcement{{v4a, nh4}, {v4b, nh4}, {v6a, nh6}, {v6b, nh6}}}},
		{name: "no IPv6 next hop: IPv6 left out, IPv4 announced",
			desired: set(v4a, v6a), hops: NextHops{IPv4: nh4},
			want: PathPlan{Announce: []Announcement{{v4a, nh4}}, Unrouted: []netip.Addr{v6a}}},
		{name: "the IPv6 next hop goes: IPv6 withdrawn, IPv4 kept",
			desired: set(v4a, v6a), hops: NextHops{IPv4: nh4}, announced: map[netip.Addr]netip.Addr{v4a: nh4, v6a: nh6},
			want: PathPlan{Withdraw: []netip.Addr{v6a}, Unrouted: []netip.Addr{v6a}}},
		{name: "a new IPv6 next hop re-announces the IPv6 tunnel IPs only",
			desired: set(v4a, v6a, v6b), hops: NextHops{IPv4: nh4, IPv6: moved6},
			announced: map[netip.Addr]netip.Addr{v4a: nh4, v6a: nh6, v6b: nh6},
			want:      PathPlan{Announce: []Announcement{{v6a, moved6}, {v6b, moved6}}}},
		{name: "the IPv6 tunnel IP dropped: withdrawn alone",
			desired: set(v4a), hops: both, announced: map[netip.Addr]netip.Addr{v4a: nh4, v6a: nh6},
			want: PathPlan{Withdraw: []netip.Addr{v6a}}},
		{name: "nothing to change", desired: set(v4a, v6a), hops: both, announced: map[netip.Addr]netip.Addr{v4a: nh4, v6a: nh6}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			announced := tc.announced
			if announced == nil {
				announced = map[netip.Addr]netip.Addr{}
			}
			if got := Plan(tc.desired, tc.hops, announced); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Plan =\n %+v\nwant\n %+v", got, tc.want)
			}
		})
	}
}

func TestPathOfEachFamily(t *testing.T) {
	p, err := path(v6a, nh6)
	if err != nil {
		t.Fatal(err)
	}
	if p.Family != bgp.RF_IPv6_UC || p.Nlri.String() != "2001:db8:5::1/128" {
		t.Errorf("IPv6 path: family %v, NLRI %v", p.Family, p.Nlri)
	}
	var mp *bgp.PathAttributeMpReachNLRI
	for _, a := range p.Attrs {
		switch a := a.(type) {
		case *bgp.PathAttributeMpReachNLRI:
			mp = a
		case *bgp.PathAttributeNextHop:
			t.Errorf("IPv6 path carries an IPv4 NEXT_HOP attribute %v", a.Value)
		}
	}
	if mp == nil || mp.Nexthop != nh6 || len(mp.Value) != 1 || mp.Value[0].NLRI.String() != "2001:db8:5::1/128" {
		t.Errorf("IPv6 path's MP_REACH_NLRI = %+v, want next hop %v for 2001:db8:5::1/128", mp, nh6)
	}

	p, err = path(v4a, nh4)
	if err != nil {
		t.Fatal(err)
	}
	if p.Family != bgp.RF_IPv4_UC || p.Nlri.String() != "192.0.2.1/32" || fmt.Sprint(p.Attrs) == "" {
		t.Errorf("IPv4 path: family %v, NLRI %v", p.Family, p.Nlri)
	}
	found := false
	for _, a := range p.Attrs {
		if nh, ok := a.(*bgp.PathAttributeNextHop); ok && nh.Value == nh4 {
			found = true
		}
	}
	if !found {
		t.Errorf("IPv4 path attributes %v lack NEXT_HOP %v", p.Attrs, nh4)
	}

	for _, c := range [][2]netip.Addr{{v6a, nh4}, {v4a, nh6}} {
		if _, err := path(c[0], c[1]); err == nil || !strings.Contains(err.Error(), "family") {
			t.Errorf("path(%v, %v) = %v, want a family mismatch", c[0], c[1], err)
		}
	}
}

func TestMissingNextHopNamesTheField(t *testing.T) {
	if err := missingNextHop(v6a, "n1"); !strings.Contains(err.Error(), "set nextHopIPv6") || !strings.Contains(err.Error(), "node n1") {
		t.Errorf("IPv6: %v", err)
	}
	if err := missingNextHop(v4a, "n1"); !strings.Contains(err.Error(), "no IPv4 InternalIP") || !strings.Contains(err.Error(), "set nextHop ") {
		t.Errorf("IPv4: %v", err)
	}
	if err := missingNextHop(v6a, ""); !strings.Contains(err.Error(), "--node-name") || !strings.Contains(err.Error(), "set nextHopIPv6") {
		t.Errorf("IPv6 without a node: %v", err)
	}
}
