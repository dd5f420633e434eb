package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// dualKernel is a dual-stack router's fake kernel: one route and nexthop
// table for both families (like the kernel's, the listing and ids are
// shared; the fake's Walk ignores the family, which makes each Datapath
// prove it skips the other family's routes), and per family a rule table,
// HMARK chain and device.
type dualKernel struct {
	routes     *seamtest.Kernel
	fam4, fam6 *seamtest.Kernel
}

func newDual(t *testing.T, cfg Config, withIPv6 bool) (*Families, *dualKernel) {
	t.Helper()
	k := &dualKernel{routes: seamtest.NewKernel(), fam4: seamtest.NewKernel(), fam6: seamtest.NewKernel()}
	nodeLink := func(netip.Addr) (int, error) { return 7, nil }
	v4 := NewDatapath(cfg.ForFamily(IPv4), k.routes, k.fam4, k.fam4.Chain(), k.fam4.Device(), nodeLink, seamtest.QuietLog())
	var v6 *Datapath
	if withIPv6 {
		v6 = NewDatapath(cfg.ForFamily(IPv6), k.routes, k.fam6, k.fam6.Chain(), k.fam6.Device(), nodeLink, seamtest.QuietLog())
	}
	fs, err := NewFamilies(v4, v6)
	if err != nil {
		t.Fatal(err)
	}
	return fs, k
}

// state is one family's part of the kernel: its routes, nexthop objects,
// rules and marks.
func (k *dualKernel) state(f Family) string {
	var lines []string
	for _, r := range k.routes.Routes {
		if r.Dst.Addr().Is6() == (f == IPv6) {
			line := r.String()
			if n, ok := k.routes.NextHops[r.NextHopID]; ok {
				line += " via " + n.String()
			}
			lines = append(lines, line)
		}
	}
	for _, n := range k.routes.NextHops {
		if n.IPv6 == (f == IPv6) {
			lines = append(lines, n.String())
		}
	}
	fk := k.fam4
	if f == IPv6 {
		fk = k.fam6
	}
	for _, r := range fk.Rules {
		lines = append(lines, fmt.Sprintf("rule %d/%d %d %d", r.Family, r.Priority, r.Mark, r.Table))
	}
	for vip, off := range fk.Marked {
		lines = append(lines, fmt.Sprintf("mark %v %#x", vip, off))
	}
	return sortedLines(lines)
}

func sortedLines(lines []string) string {
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// TestFamiliesSplitTunnelsByFamily: each tunnel goes to its family's
// Datapath; a change of one family's tunnels writes nothing of the other's;
// both share the route table and nexthop ids without taking the other's.
func TestFamiliesSplitTunnelsByFamily(t *testing.T) {
	cfg := testConfig()
	fs, k := newDual(t, cfg, true)
	t4 := tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6")
	t6 := tunnel6(cfg, "2001:db8::1", "fd00:244::5", "fd00:244:1::6")
	empty6 := tunnel6(cfg, "2001:db8::2")
	if err := fs.Resync([]Tunnel{t4, t6, empty6}); err != nil {
		t.Fatal(err)
	}
	if len(k.routes.Routes) != 3*cfg.Buckets || len(k.routes.NextHops) != 4 {
		t.Fatalf("%d routes, %d nexthop objects; want %d and 4", len(k.routes.Routes), len(k.routes.NextHops), 3*cfg.Buckets)
	}
	if _, ok := k.fam4.Marked[t4.VIP]; !ok || len(k.fam4.Marked) != 1 || len(k.fam6.Marked) != 2 {
		t.Fatalf("marks: IPv4 chain %v, IPv6 chain %v", k.fam4.Marked, k.fam6.Marked)
	}
	first6, last6 := cfg.ForFamily(IPv6).NextHopIDs()
	for id, n := range k.routes.NextHops {
		if in6 := id >= first6 && id <= last6; in6 != n.IPv6 {
			t.Errorf("nexthop %v: id outside its family's range", n.String())
		}
	}
	for _, rk := range []*seamtest.Kernel{k.fam4, k.fam6} {
		if len(rk.Rules) != len(cfg.SlotRules())+2 || !rk.DevUp {
			t.Fatalf("%d rules, device up %v; want each family's own", len(rk.Rules), rk.DevUp)
		}
	}
	if fs.Ops() != uint64(k.routes.Writes+k.fam4.Writes+k.fam6.Writes) {
		t.Errorf("Ops() = %d, want the writes of both families (%d)", fs.Ops(), k.routes.Writes+k.fam4.Writes+k.fam6.Writes)
	}

	// A restart of both adopts everything.
	writes := k.routes.Writes + k.fam4.Writes + k.fam6.Writes
	again, _ := newDualOver(t, cfg, k)
	if err := again.Resync([]Tunnel{t6, t4, empty6}); err != nil || k.routes.Writes+k.fam4.Writes+k.fam6.Writes != writes {
		t.Fatalf("restart: %v, %d writes; want none", err, k.routes.Writes+k.fam4.Writes+k.fam6.Writes-writes)
	}

	// Changing the IPv4 tunnel, or removing it, leaves IPv6 as it is.
	v6state, v6writes := k.state(IPv6), k.fam6.Writes
	if err := fs.SetTunnel(tunnel(cfg, "192.0.2.1", "10.244.3.7")); err != nil {
		t.Fatal(err)
	}
	if err := fs.Resync([]Tunnel{t6, empty6}); err != nil {
		t.Fatal(err)
	}
	if k.state(IPv6) != v6state || k.fam6.Writes != v6writes {
		t.Errorf("IPv4 changes touched IPv6:\n%s\nwas:\n%s", k.state(IPv6), v6state)
	}
	if len(k.fam4.Marked) != 0 || strings.Contains(k.state(IPv4), "192.0.2.1") {
		t.Errorf("the removed IPv4 tunnel remains:\n%s", k.state(IPv4))
	}
	if g := fs.CurrentGeneration(t6.VIP); g != 0 {
		t.Errorf("CurrentGeneration(%v) = %d", t6.VIP, g)
	}
	v4state := k.state(IPv4)
	if err := fs.RemoveTunnel(t6.VIP); err != nil {
		t.Fatal(err)
	}
	if _, ok := route6(cfg, k.routes, "2001:db8::1", 0); ok || k.state(IPv4) != v4state {
		t.Errorf("RemoveTunnel(%v): routes %v", t6.VIP, k.routes.Routes)
	}
	if n, err := fs.CollectGenerations(); n != 0 || err != nil {
		t.Errorf("CollectGenerations = %d, %v", n, err)
	}

	// Cleanup of the IPv6 datapath alone leaves IPv4's state; both leave
	// nothing.
	if err := fs.SetTunnel(t4); err != nil {
		t.Fatal(err)
	}
	v4state = k.state(IPv4)
	if err := fs.Datapath(IPv6).Cleanup(); err != nil {
		t.Fatal(err)
	}
	if k.state(IPv4) != v4state || k.state(IPv6) != "" {
		t.Errorf("after the IPv6 cleanup:\nIPv4:\n%s\nwas:\n%s\nIPv6:\n%s", k.state(IPv4), v4state, k.state(IPv6))
	}
	if err := fs.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if len(k.routes.Routes) != 0 || len(k.routes.NextHops) != 0 || len(k.fam4.Rules) != 0 || len(k.fam6.Rules) != 0 {
		t.Errorf("after cleanup: %v %v %v %v", k.routes.Routes, k.routes.NextHops, k.fam4.Rules, k.fam6.Rules)
	}
}

// newDualOver is newDual over an existing dual kernel (a restart).
func newDualOver(t *testing.T, cfg Config, k *dualKernel) (*Families, *dualKernel) {
	t.Helper()
	v4 := NewDatapath(cfg.ForFamily(IPv4), k.routes, k.fam4, k.fam4.Chain(), k.fam4.Device(), nil, seamtest.QuietLog())
	v6 := NewDatapath(cfg.ForFamily(IPv6), k.routes, k.fam6, k.fam6.Chain(), k.fam6.Device(), nil, seamtest.QuietLog())
	fs, err := NewFamilies(v4, v6)
	if err != nil {
		t.Fatal(err)
	}
	return fs, k
}

// TestFamiliesWithoutIPv6: with no IPv6 datapath, IPv6 tunnel IPs are
// refused with an error that says so, and IPv4 ones work as before.
func TestFamiliesWithoutIPv6(t *testing.T) {
	cfg := testConfig()
	fs, k := newDual(t, cfg, false)
	t4 := tunnel(cfg, "192.0.2.1", "10.244.1.5")
	t6 := tunnel6(cfg, "2001:db8::1", "fd00:244::5")
	err := fs.SetTunnel(t6)
	if !errors.Is(err, ErrWrongFamily) || !strings.Contains(err.Error(), "no IPv6 datapath") {
		t.Fatalf("SetTunnel(IPv6) = %v, want a refusal saying there is no IPv6 datapath", err)
	}
	err = fs.Resync([]Tunnel{t4, t6, tunnel6(cfg, "2001:db8::2")})
	if !errors.Is(err, ErrWrongFamily) || !strings.Contains(err.Error(), "2001:db8::1, 2001:db8::2") {
		t.Fatalf("Resync = %v, want the two IPv6 tunnels refused", err)
	}
	if _, ok := k.routes.Routes[rtnl.RouteKey{Table: uint32(cfg.Table(0)), Dst: netip.MustParsePrefix("192.0.2.1/32")}]; !ok || len(k.routes.Routes) != cfg.Buckets {
		t.Fatalf("the IPv4 tunnel was not programmed alone: %d routes", len(k.routes.Routes))
	}
	if err := fs.RemoveTunnel(t6.VIP); err != nil {
		t.Errorf("RemoveTunnel(IPv6) = %v, want nothing to do", err)
	}
	if g := fs.CurrentGeneration(t6.VIP); g != 0 {
		t.Errorf("CurrentGeneration(IPv6) = %d", g)
	}
	if err := fs.SetTunnel(Tunnel{}); !errors.Is(err, ErrWrongFamily) {
		t.Errorf("SetTunnel without a tunnel IP = %v", err)
	}
	if fs.Datapath(IPv6) != nil || fs.Cleanup() != nil || len(k.routes.Routes) != 0 {
		t.Errorf("cleanup left %v", k.routes.Routes)
	}
}

func TestNewFamiliesChecksFamilies(t *testing.T) {
	k := seamtest.NewKernel()
	v4 := newTestDatapath(testConfig(), k)
	v6 := newTestDatapath(testConfig().ForFamily(IPv6), k)
	for name, pair := range map[string][2]*Datapath{"none": {nil, nil}, "swapped": {v6, v4}, "two IPv4": {v4, v4}} {
		if _, err := NewFamilies(pair[0], pair[1]); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if fs, err := NewFamilies(nil, v6); err != nil || fs.Datapath(IPv6) != v6 {
		t.Errorf("IPv6 only: %v", err)
	}
}

// TestFamiliesOnOneRuleTable: were the rule listing to return both
// families (the fake's does), each Datapath still keeps to its own rules:
// it adds its family's and deletes none of the other's.
func TestFamiliesOnOneRuleTable(t *testing.T) {
	cfg := testConfig()
	k := seamtest.NewKernel()
	v4 := NewDatapath(cfg, k, k, seamtest.NewKernel().Chain(), NoDevice{}, nil, seamtest.QuietLog())
	if err := v4.Resync(nil); err != nil {
		t.Fatal(err)
	}
	v4rules := len(k.Rules)
	v6 := NewDatapath(cfg.ForFamily(IPv6), k, k, seamtest.NewKernel().Chain(), NoDevice{}, nil, seamtest.QuietLog())
	if err := v6.Resync(nil); err != nil {
		t.Fatal(err)
	}
	count := func(af int) int {
		n := 0
		for _, r := range k.Rules {
			if r.Family == af {
				n++
			}
		}
		return n
	}
	if count(unix.AF_INET) != v4rules || count(unix.AF_INET6) != v4rules {
		t.Fatalf("%d IPv4 and %d IPv6 rules, want %d each", count(unix.AF_INET), count(unix.AF_INET6), v4rules)
	}
	writes := k.Writes
	if err := v4.Resync(nil); err != nil || k.Writes != writes {
		t.Fatalf("IPv4 resync: %v, %d writes; want none", err, k.Writes-writes)
	}
	// An IPv4 rule at a priority of IPv6's: only IPv4 may delete it.
	stale := netlink.Rule{Family: unix.AF_INET, Priority: cfg.RulePriority + 1, Table: 999, Protocol: cfg.RouteProtocol}
	k.Rules = append(k.Rules, stale)
	if err := v6.Resync(nil); err != nil || k.Writes != writes {
		t.Fatalf("IPv6 resync: %v, %d writes; want none", err, k.Writes-writes)
	}
}
