package rtnl

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func encapRoute() Route {
	return Route{
		Table: 7600, Dst: netip.MustParsePrefix("10.96.0.1/32"), Type: Unicast, Protocol: 200,
		LinkIndex: 5, IPEncap: &IPEncap{Dst: netip.MustParseAddr("10.244.0.9"), TTL: 64},
	}
}

func TestRouteEqual(t *testing.T) {
	base := encapRoute()
	for _, tc := range []struct {
		name   string
		change func(*Route)
		want   bool
	}{
		{"identical copy", func(r *Route) { r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("10.244.0.9"), TTL: 64} }, true},
		{"table", func(r *Route) { r.Table++ }, false},
		{"dst", func(r *Route) { r.Dst = netip.MustParsePrefix("10.96.0.2/32") }, false},
		{"type", func(r *Route) { r.Type = Blackhole }, false},
		{"protocol", func(r *Route) { r.Protocol = 201 }, false},
		{"link", func(r *Route) { r.LinkIndex = 6 }, false},
		{"gateway", func(r *Route) { r.Gateway = netip.MustParseAddr("10.0.0.1") }, false},
		{"encap dst", func(r *Route) { r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("10.244.0.8"), TTL: 64} }, false},
		{"no encap", func(r *Route) { r.IPEncap = nil }, false},
		{"mpls instead", func(r *Route) { r.IPEncap, r.MPLSLabels = nil, []uint32{100} }, false},
		{"unknown encap", func(r *Route) { r.otherEncap = 7 }, false},
		{"multipath", func(r *Route) { r.multipath = true }, false},
		{"ipv6 encap dst", func(r *Route) { r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("::ffff:10.244.0.9"), TTL: 64} }, false},
		{"ipv6 dst", func(r *Route) { r.Dst = netip.MustParsePrefix("::a60:1/128") }, false},
	} {
		r := base
		tc.change(&r)
		if got := base.Equal(&r); got != tc.want {
			t.Errorf("%s: Equal = %v, want %v", tc.name, got, tc.want)
		}
		if got := r.Equal(&base); got != tc.want {
			t.Errorf("%s (swapped): Equal = %v, want %v", tc.name, got, tc.want)
		}
	}
	a := Route{Table: 1, Dst: netip.MustParsePrefix("10.0.0.0/8"), Type: Unicast, MPLSLabels: []uint32{1, 2}}
	b := a
	b.MPLSLabels = []uint32{1, 3}
	if a.Equal(&b) {
		t.Error("different label stacks compare equal")
	}
}

func TestRouteKey(t *testing.T) {
	r := encapRoute()
	blackhole := Route{Table: r.Table, Dst: r.Dst, Type: Blackhole}
	if r.Key() != blackhole.Key() {
		t.Errorf("keys differ: %v, %v", r.Key(), blackhole.Key())
	}
	if got := r.Key().String(); got != "table 7600 10.96.0.1/32" {
		t.Errorf("Key().String() = %q", got)
	}
}

func TestRouteString(t *testing.T) {
	r := encapRoute()
	for _, tc := range []struct {
		r    Route
		want string
	}{
		{r, "10.96.0.1/32 encap ip id 0 dst 10.244.0.9 ttl 64 oif 5 table 7600 proto 200"},
		{Route{Table: 7601, Dst: r.Dst, Type: Blackhole, Protocol: 200}, "blackhole 10.96.0.1/32 table 7601 proto 200"},
		{Route{Table: 7, Dst: r.Dst, Type: Unicast, Gateway: netip.MustParseAddr("10.0.0.1"), MPLSLabels: []uint32{1, 2}},
			"10.96.0.1/32 encap mpls 1/2 via 10.0.0.1 table 7 proto 0"},
		{Route{Table: 7600, Dst: netip.MustParsePrefix("2001:db8::1/128"), Type: Unicast, Protocol: 200, LinkIndex: 5,
			IPEncap: &IPEncap{Dst: netip.MustParseAddr("fd00::9"), TTL: 64}},
			"2001:db8::1/128 encap ip6 id 0 dst fd00::9 hoplimit 64 oif 5 table 7600 proto 200"},
	} {
		if got := tc.r.String(); got != tc.want {
			t.Errorf("String = %q, want %q", got, tc.want)
		}
	}
}

func TestOpValidate(t *testing.T) {
	valid := encapRoute()
	for _, tc := range []struct {
		name   string
		kind   OpKind
		change func(*Route)
		ok     bool
	}{
		{"valid replace", Replace, func(*Route) {}, true},
		{"valid blackhole", Replace, func(r *Route) { *r = Route{Table: 1, Dst: r.Dst, Type: Blackhole} }, true},
		{"delete needs only the key", Delete, func(r *Route) { *r = Route{Table: 1, Dst: r.Dst} }, true},
		{"no kind", 0, func(*Route) {}, false},
		{"table 0", Replace, func(r *Route) { r.Table = 0 }, false},
		{"delete table 0", Delete, func(r *Route) { r.Table = 0 }, false},
		{"no dst", Replace, func(r *Route) { r.Dst = netip.Prefix{} }, false},
		{"ipv6 delete", Delete, func(r *Route) { *r = Route{Table: 1, Dst: netip.MustParsePrefix("2001:db8::1/128")} }, true},
		{"ipv6 encap route", Replace, func(r *Route) {
			r.Dst, r.IPEncap = netip.MustParsePrefix("2001:db8::1/128"), &IPEncap{Dst: netip.MustParseAddr("fd00::1"), TTL: 64}
		}, true},
		{"ipv6 blackhole", Replace, func(r *Route) { *r = Route{Table: 1, Dst: netip.MustParsePrefix("2001:db8::/64"), Type: Blackhole} }, true},
		{"ipv6 mpls via ipv6", Replace, func(r *Route) {
			r.Dst, r.IPEncap, r.MPLSLabels = netip.MustParsePrefix("2001:db8::1/128"), nil, []uint32{70000}
			r.Gateway = netip.MustParseAddr("fd00:1::7")
		}, true},
		{"ipv6 route via ipv4", Replace, func(r *Route) {
			r.Dst, r.IPEncap, r.MPLSLabels = netip.MustParsePrefix("2001:db8::1/128"), nil, []uint32{70000}
			r.Gateway = netip.MustParseAddr("192.168.1.7")
		}, false},
		{"ipv4 route via ipv4-mapped", Replace, func(r *Route) {
			r.IPEncap, r.MPLSLabels, r.Gateway = nil, []uint32{7}, netip.MustParseAddr("::ffff:192.168.1.7")
		}, false},
		{"ipv4-mapped dst", Delete, func(r *Route) { r.Dst = netip.MustParsePrefix("::ffff:10.96.0.1/128") }, false},
		{"ipv6 host bits", Delete, func(r *Route) { r.Dst = netip.MustParsePrefix("2001:db8::1/64") }, false},
		{"host bits", Delete, func(r *Route) { r.Dst = netip.MustParsePrefix("10.96.0.1/24") }, false},
		{"no type", Replace, func(r *Route) { r.Type = 0 }, false},
		{"two encaps", Replace, func(r *Route) { r.MPLSLabels = []uint32{1} }, false},
		{"encap on blackhole", Replace, func(r *Route) { r.Type, r.LinkIndex = Blackhole, 0 }, false},
		{"link on blackhole", Replace, func(r *Route) { r.Type, r.IPEncap = Blackhole, nil }, false},
		{"ipv6 outer header on an ipv4 route", Replace, func(r *Route) { r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("fd00::1")} }, true},
		{"mixed encap families", Replace, func(r *Route) {
			r.IPEncap = &IPEncap{Dst: netip.MustParseAddr("fd00::1"), Src: netip.MustParseAddr("10.0.0.1")}
		}, false},
		{"empty label stack", Replace, func(r *Route) { r.IPEncap, r.MPLSLabels = nil, []uint32{} }, false},
		{"label too big", Replace, func(r *Route) { r.IPEncap, r.MPLSLabels = nil, []uint32{MaxMPLSLabel + 1} }, false},
		{"31 labels", Replace, func(r *Route) { r.IPEncap, r.MPLSLabels = nil, make([]uint32, 31) }, false},
	} {
		op := Op{Kind: tc.kind, Route: valid}
		tc.change(&op.Route)
		err := op.validate()
		if tc.ok && err != nil {
			t.Errorf("%s: unexpected error %v", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, ErrInvalidRoute) {
			t.Errorf("%s: error %v, want ErrInvalidRoute", tc.name, err)
		}
	}
}

func TestApplyErrorMessage(t *testing.T) {
	var failed []*OpError
	for i := range 7 {
		r := encapRoute()
		r.Table += uint32(i)
		failed = append(failed, &OpError{Index: i, Op: Op{Kind: Replace, Route: r}, Err: &nlError{errno: unix.ENODEV}})
	}
	err := error(&ApplyError{Failed: failed})
	msg := err.Error()
	if !strings.HasPrefix(msg, "7 route operation(s) failed: replace route 10.96.0.1/32 ") ||
		!strings.Contains(msg, "table 7604") || strings.Contains(msg, "table 7605") ||
		!strings.HasSuffix(msg, "; and 2 more") {
		t.Errorf("message %q", msg)
	}
	if !errors.Is(err, unix.ENODEV) {
		t.Error("errors.Is does not reach the errno")
	}
	var opErr *OpError
	if !errors.As(err, &opErr) || opErr.Index != 0 {
		t.Errorf("errors.As gave %v", opErr)
	}
	withMsg := &OpError{Op: Op{Kind: Delete, Route: encapRoute()}, Err: &nlError{errno: unix.EINVAL, msg: "Invalid prefix"}}
	if got := withMsg.Error(); !strings.HasSuffix(got, fmt.Sprintf(": %s (Invalid prefix)", unix.EINVAL)) {
		t.Errorf("OpError = %q", got)
	}
}
