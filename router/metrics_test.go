package router

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
)

// withVIP keeps the series of one tunnel IP.
func withVIP(s map[string]float64, vip string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range s {
		if strings.Contains(k, "vip="+vip) {
			out[k] = v
		}
	}
	return out
}

// bucketShares counts, from what the datapath was asked to program, the
// buckets of each present endpoint of a tunnel IP, as bucket-gauge series.
func bucketShares(tn Tunnel) map[string]float64 {
	out := map[string]float64{}
	for _, ep := range tn.Present {
		out[fmt.Sprintf("endpoint=%s,vip=%s", ep.Addr, tn.VIP)] = 0
	}
	for _, ep := range tn.Table {
		out[fmt.Sprintf("endpoint=%s,vip=%s", ep.Addr, tn.VIP)]++
	}
	return out
}

func newMeteredController(t *testing.T, pools string) (*testController, *prometheus.Registry) {
	t.Helper()
	tc := newTestController(t, pools)
	reg := prometheus.NewRegistry()
	tc.SetMetrics(NewMetrics(reg))
	return tc, reg
}

func endpointsSlice(ns, svc string, ready []string, draining ...string) *discoveryv1.EndpointSlice {
	es := oneEndpoint(ns, svc, ready[0])
	for _, a := range ready[1:] {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
	}
	no, yes := false, true
	for _, a := range draining {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{a},
			Conditions: discoveryv1.EndpointConditions{Ready: &no, Serving: &yes, Terminating: &yes}})
	}
	return es
}

func TestControllerMetricsFollowClaimsAndEndpoints(t *testing.T) {
	tc, reg := newMeteredController(t, "192.0.2.0/24")
	tc.add(t,
		tunnelSvc("web", "a", "192.0.2.10", 2*time.Hour),
		endpointsSlice("web", "a", []string{"10.244.1.5", "10.244.2.6", "10.244.3.7"}, "10.244.4.8"),
		tunnelSvc("web", "loser", "192.0.2.10", time.Hour), oneEndpoint("web", "loser", "10.244.9.9"),
		tunnelSvc("web", "e", "192.0.2.20", time.Hour), oneEndpoint("web", "e", "10.244.1.50"),
		tunnelSvc("web", "bad", "not-an-ip", time.Hour),
		tunnelSvc("web", "outside", "198.51.100.7", time.Hour),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	claims := func(step string, served float64, invalid, refused, conflict float64) {
		t.Helper()
		if got := promtest.Series(t, reg, "kube_service_tunnel_router_served_tunnel_ips")[""]; got != served {
			t.Errorf("%s: served tunnel IPs %v, want %v", step, got, served)
		}
		want := map[string]float64{"reason=invalid": invalid, "reason=refused": refused, "reason=conflict": conflict}
		if got := promtest.Series(t, reg, "kube_service_tunnel_router_refused_claims"); !maps.Equal(got, want) {
			t.Errorf("%s: refused claims %v, want %v", step, got, want)
		}
	}
	// endpointsOf checks the endpoint and bucket gauges of vip against what
	// the datapath was asked to program.
	endpointsOf := func(step, vip string, ready, draining float64) {
		t.Helper()
		wantEps := map[string]float64{"state=ready,vip=" + vip: ready, "state=draining,vip=" + vip: draining}
		if got := withVIP(promtest.Series(t, reg, "kube_service_tunnel_router_tunnel_endpoints"), vip); !maps.Equal(got, wantEps) {
			t.Errorf("%s: endpoints of %s %v, want %v", step, vip, got, wantEps)
		}
		programmed := tc.dp.tunnels[netip.MustParseAddr(vip)]
		want := bucketShares(programmed)
		got := withVIP(promtest.Series(t, reg, "kube_service_tunnel_router_endpoint_buckets"), vip)
		if !maps.Equal(got, want) {
			t.Errorf("%s: buckets of %s %v, want what was programmed: %v", step, vip, got, want)
		}
		total := 0.0
		for _, n := range got {
			total += n
		}
		if total != float64(tc.cfg.Buckets) {
			t.Errorf("%s: buckets of %s add up to %v, want %d", step, vip, total, tc.cfg.Buckets)
		}
	}
	claims("resync", 2, 1, 1, 1)
	endpointsOf("resync", "192.0.2.10", 3, 1)
	endpointsOf("resync", "192.0.2.20", 1, 0)
	if got := promtest.Series(t, reg, "kube_service_tunnel_router_endpoint_buckets")["endpoint=10.244.4.8,vip=192.0.2.10"]; got != 0 {
		t.Errorf("draining endpoint has %v buckets, want 0", got)
	}

	// An endpoint goes: its bucket gauge goes with it.
	tc.add(t, endpointsSlice("web", "a", []string{"10.244.1.5", "10.244.2.6"}, "10.244.4.8"))
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	endpointsOf("endpoint removed", "192.0.2.10", 2, 1)
	if _, ok := promtest.Series(t, reg, "kube_service_tunnel_router_endpoint_buckets")["endpoint=10.244.3.7,vip=192.0.2.10"]; ok {
		t.Error("the removed endpoint 10.244.3.7 still has a bucket gauge")
	}

	// A tunnel IP goes (syncService): all its label values go.
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(tunnelSvc("web", "e", "192.0.2.20", time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tc.syncService("web/e"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"kube_service_tunnel_router_tunnel_endpoints", "kube_service_tunnel_router_endpoint_buckets"} {
		if got := withVIP(promtest.Series(t, reg, name), "192.0.2.20"); len(got) != 0 {
			t.Errorf("removed tunnel IP 192.0.2.20 still in %s: %v", name, got)
		}
	}
	claims("tunnel removed", 1, 1, 1, 1)

	// The conflict winner goes: the loser takes the tunnel IP over.
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(tunnelSvc("web", "a", "192.0.2.10", 2*time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	claims("winner removed", 1, 1, 1, 0)
	endpointsOf("winner removed", "192.0.2.10", 1, 0)

	// The bad annotation is fixed, the refused Service is deleted.
	fixed := tunnelSvc("web", "bad", "192.0.2.30", time.Hour)
	tc.add(t, fixed, oneEndpoint("web", "bad", "10.244.7.7"))
	if err := tc.syncService("web/bad"); err != nil {
		t.Fatal(err)
	}
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(tunnelSvc("web", "outside", "198.51.100.7", time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tc.syncService("web/outside"); err != nil {
		t.Fatal(err)
	}
	claims("fixed and deleted", 2, 0, 0, 0)
	endpointsOf("fixed", "192.0.2.30", 1, 0)

	// A resync drops the label values of a tunnel IP gone meanwhile.
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(fixed); err != nil {
		t.Fatal(err)
	}
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	claims("resync after delete", 1, 0, 0, 0)
	for _, name := range []string{"kube_service_tunnel_router_tunnel_endpoints", "kube_service_tunnel_router_endpoint_buckets"} {
		if got := withVIP(promtest.Series(t, reg, name), "192.0.2.30"); len(got) != 0 {
			t.Errorf("resync kept the removed tunnel IP 192.0.2.30 in %s: %v", name, got)
		}
	}
	endpointsOf("resync after delete", "192.0.2.10", 1, 0)
}

func TestControllerMetricsCountReconcilesAndErrors(t *testing.T) {
	tc, reg := newMeteredController(t, "192.0.2.0/24")
	tc.add(t, tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"))
	process := func(key string) {
		t.Helper()
		tc.queue.Add(key)
		if !tc.processNext() {
			t.Fatal("queue shut down")
		}
	}
	process(resyncKey)
	process("web/a")
	tc.dp.fail = errors.New("kernel says no")
	process("web/a")
	process(networksKey) // nothing changed: no resync, no error
	tc.dp.fail = nil

	wantCount := map[string]float64{"kind=resync": 1, "kind=service": 2, "kind=networks": 1}
	if got := promtest.Series(t, reg, "kube_service_tunnel_router_reconcile_duration_seconds"); !maps.Equal(got, wantCount) {
		t.Errorf("reconcile durations observed %v, want %v", got, wantCount)
	}
	wantErrors := map[string]float64{"kind=resync": 0, "kind=service": 1, "kind=networks": 0}
	if got := promtest.Series(t, reg, "kube_service_tunnel_router_reconcile_errors_total"); !maps.Equal(got, wantErrors) {
		t.Errorf("reconcile errors %v, want %v", got, wantErrors)
	}
}

// Without SetMetrics (and with a nil *Metrics) nothing is recorded and
// nothing breaks.
func TestNilMetricsRecordNothing(t *testing.T) {
	var m *Metrics
	m.reconciled(reconcileService, time.Second, errors.New("x"))
	m.setClaims(1, map[string]int{refusedInvalid: 1})
	m.setTunnel(Tunnel{VIP: netip.MustParseAddr("192.0.2.1")})
	m.setTunnels(nil)
	m.removeTunnel(netip.MustParseAddr("192.0.2.1"))
	m.wrote(objectRoute, "replace", 1)
	m.CollectVIPTraffic(fakeCounters{}, quietLog())
	if err := (countedRoutes{newFakeKernel(), m}).Apply([]rtnl.Op{{Kind: rtnl.Replace}}); err != nil {
		t.Fatal(err)
	}
	// NewMetrics(nil) records without exporting.
	NewMetrics(nil).setTunnel(Tunnel{VIP: netip.MustParseAddr("192.0.2.1")})
}

// kernelWrites counts, by "object/operation", the writes the fake kernel
// accepted.
type kernelWrites map[string]float64

// writeCountingKernel is the fake kernel, counting each write it accepts.
type writeCountingKernel struct {
	*fakeKernel
	saw kernelWrites
}

func (k *writeCountingKernel) Apply(ops []rtnl.Op) error {
	for _, op := range ops {
		k.saw["route/"+op.Kind.String()]++
	}
	return k.fakeKernel.Apply(ops)
}

func (k *writeCountingKernel) RuleAdd(r *netlink.Rule) error {
	k.saw["rule/add"]++
	return k.fakeKernel.RuleAdd(r)
}

func (k *writeCountingKernel) RuleDel(r *netlink.Rule) error {
	if err := k.fakeKernel.RuleDel(r); err != nil {
		return err
	}
	k.saw["rule/delete"]++
	return nil
}

// kernelOps returns kube_service_tunnel_router_kernel_operations_total by
// "object/operation".
func kernelOps(t *testing.T, reg *prometheus.Registry) kernelWrites {
	t.Helper()
	out := kernelWrites{}
	for labels, v := range promtest.Series(t, reg, "kube_service_tunnel_router_kernel_operations_total") {
		var object, op string
		for _, kv := range strings.Split(labels, ",") {
			k, val, _ := strings.Cut(kv, "=")
			switch k {
			case "object":
				object = val
			case "operation":
				op = val
			}
		}
		out[object+"/"+op] = v
	}
	return out
}

func TestDatapathKernelOperationsCountedAtTheSeam(t *testing.T) {
	cfg := testConfig()
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	k := &writeCountingKernel{fakeKernel: newFakeKernel(), saw: kernelWrites{}}
	// A stale rule of an earlier run in the router's range: Resync deletes it.
	stale := cfg.bucketRule(0)
	stale.Table = 9999
	k.rules = append(k.rules, stale)
	d := NewDatapath(cfg, countedRoutes{k, m}, countedRules{k, m}, fakeChain{k.fakeKernel}, fakeDevice{k.fakeKernel},
		func(netip.Addr) (int, error) { return 7, nil }, quietLog())

	steps := []struct {
		name string
		do   func() error
	}{
		{"resync", func() error {
			return d.Resync([]Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6"), tunnel(cfg, "192.0.2.2")})
		}},
		{"set", func() error { return d.SetTunnel(tunnel(cfg, "192.0.2.3", "10.244.3.7")) }},
		{"change", func() error { return d.SetTunnel(tunnel(cfg, "192.0.2.1", "10.244.1.5")) }},
		{"remove", func() error { return d.RemoveTunnel(netip.MustParseAddr("192.0.2.2")) }},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if got := kernelOps(t, reg); !maps.Equal(got, k.saw) {
			t.Errorf("after %s: kernel operations %v, want what the kernel saw: %v", s.name, got, k.saw)
		}
	}
	for _, want := range []string{"route/replace", "route/delete", "rule/add", "rule/delete"} {
		if k.saw[want] == 0 {
			t.Errorf("the steps made no %s: the test proves nothing about it (saw %v)", want, k.saw)
		}
	}
}

// partlyFailingRoutes fails the operations at the given indexes of every
// Apply, as rtnl.Client reports them.
type partlyFailingRoutes struct {
	routeOps
	failAt []int
}

func (p partlyFailingRoutes) Apply(ops []rtnl.Op) error {
	ae := &rtnl.ApplyError{}
	for _, i := range p.failAt {
		ae.Failed = append(ae.Failed, &rtnl.OpError{Index: i, Op: ops[i], Err: syscall.ENODEV})
	}
	return ae
}

func TestCountedRoutesLeaveOutFailedOperations(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	ops := []rtnl.Op{{Kind: rtnl.Replace}, {Kind: rtnl.Replace}, {Kind: rtnl.Delete}, {Kind: rtnl.Delete}, {Kind: rtnl.Replace}}
	err := countedRoutes{partlyFailingRoutes{newFakeKernel(), []int{1, 2}}, m}.Apply(ops)
	if err == nil {
		t.Fatal("the failure was swallowed")
	}
	if got, want := kernelOps(t, reg), (kernelWrites{"route/replace": 2, "route/delete": 1}); !maps.Equal(got, want) {
		t.Errorf("kernel operations %v, want %v", got, want)
	}
	// An error that does not say what failed counts nothing.
	other := countedRoutes{failingRoutes{newFakeKernel()}, m}
	if err := other.Apply(ops); err == nil {
		t.Fatal("the failure was swallowed")
	}
	if got, want := kernelOps(t, reg), (kernelWrites{"route/replace": 2, "route/delete": 1}); !maps.Equal(got, want) {
		t.Errorf("after an unknown failure: kernel operations %v, want %v", got, want)
	}
}

type failingRoutes struct{ routeOps }

func (failingRoutes) Apply([]rtnl.Op) error { return errors.New("netlink socket closed") }

// fakeCounters is an HMARK chain's counters, or the error reading them.
type fakeCounters struct {
	counters map[netip.Addr]hmark.Counter
	err      error
}

func (f fakeCounters) Counters() (map[netip.Addr]hmark.Counter, error) {
	return maps.Clone(f.counters), f.err
}

func TestVIPTrafficReadAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	chain := &fakeCounters{counters: map[netip.Addr]hmark.Counter{
		netip.MustParseAddr("192.0.2.1"): {Packets: 3, Bytes: 180},
		netip.MustParseAddr("192.0.2.2"): {Packets: 0, Bytes: 0},
	}}
	m.CollectVIPTraffic(chain, quietLog())
	packets := promtest.Series(t, reg, "kube_service_tunnel_router_vip_packets_total")
	bytes := promtest.Series(t, reg, "kube_service_tunnel_router_vip_bytes_total")
	if want := map[string]float64{"vip=192.0.2.1": 3, "vip=192.0.2.2": 0}; !maps.Equal(packets, want) {
		t.Errorf("packets %v, want %v", packets, want)
	}
	if want := map[string]float64{"vip=192.0.2.1": 180, "vip=192.0.2.2": 0}; !maps.Equal(bytes, want) {
		t.Errorf("bytes %v, want %v", bytes, want)
	}

	// Read again at the next scrape: a tunnel IP gone is gone from it.
	chain.counters = map[netip.Addr]hmark.Counter{netip.MustParseAddr("192.0.2.1"): {Packets: 5, Bytes: 300}}
	if got, want := promtest.Series(t, reg, "kube_service_tunnel_router_vip_packets_total"), map[string]float64{"vip=192.0.2.1": 5}; !maps.Equal(got, want) {
		t.Errorf("next scrape: packets %v, want %v", got, want)
	}

	if got := promtest.Series(t, reg, "kube_service_tunnel_router_vip_counter_read_errors_total")[""]; got != 0 {
		t.Errorf("read errors %v after good reads, want 0", got)
	}

	// A failed read fails nothing but these counters, and is counted.
	chain.err = errors.New("iptables: exit status 4")
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("a failed read failed the scrape: %v", err)
	}
	names := []string{}
	for _, f := range families {
		names = append(names, f.GetName())
	}
	if slices.Contains(names, "kube_service_tunnel_router_vip_packets_total") {
		t.Errorf("counters exported although reading them failed: %v", names)
	}
	if got := promtest.Series(t, reg, "kube_service_tunnel_router_vip_counter_read_errors_total")[""]; got != 2 {
		// Two scrapes with the error: the Gather above and this one.
		t.Errorf("read errors %v, want 2", got)
	}
}

// payloadRestorer accepts every payload, or fails them all with err.
type payloadRestorer struct{ err error }

func (r payloadRestorer) Restore(string, []byte) error { return r.err }

// TestCountedRestorerCountsRulesWithCounters: the rules of a restore are
// counted whether or not they carry "[PACKETS:BYTES]" counters (hmark
// writes a surviving rule with its counters); a failed restore counts
// nothing.
func TestCountedRestorerCountsRulesWithCounters(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	payload := []byte("*raw\n:KST-HMARK - [0:0]\n[5:700] -A KST-HMARK -d 192.0.2.1/32 -j KST-HMARK-SYN\n-A KST-HMARK -d 192.0.2.2/32 -j KST-HMARK-SYN\nCOMMIT\n")
	if err := (countedRestorer{payloadRestorer{}, m}).Restore("raw", payload); err != nil {
		t.Fatal(err)
	}
	if err := (countedRestorer{payloadRestorer{errors.New("exit status 2")}, m}).Restore("raw", payload); err == nil {
		t.Fatal("a failed restore returned no error")
	}
	want := kernelWrites{"iptables_chain/restore": 1, "iptables_rule/restore": 2}
	if got := kernelOps(t, reg); !maps.Equal(got, want) {
		t.Errorf("kernel operations %v, want %v", got, want)
	}
}
