package metrics

import (
	"errors"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// Without SetMetrics (and with a nil *Metrics) nothing is recorded and
// nothing breaks.
func TestNilMetricsRecordNothing(t *testing.T) {
	var m *Metrics
	m.Reconciled(ReconcileService, time.Second, errors.New("x"))
	m.SetClaims(1, map[string]int{RefusedInvalid: 1})
	m.SetTunnel(datapath.Tunnel{VIP: netip.MustParseAddr("192.0.2.1")})
	m.SetTunnels(nil)
	m.RemoveTunnel(netip.MustParseAddr("192.0.2.1"))
	m.wrote(objectRoute, "replace", 1)
	m.CollectVIPTraffic(fakeCounters{}, seamtest.QuietLog())
	if err := m.WriteText(io.Discard); err != nil {
		t.Fatal(err)
	}
	if err := (countedRoutes{seamtest.NewKernel(), m}).Apply([]rtnl.Op{{Kind: rtnl.Replace}}); err != nil {
		t.Fatal(err)
	}
	// NewMetrics(nil) records without exporting.
	NewMetrics(nil).SetTunnel(datapath.Tunnel{VIP: netip.MustParseAddr("192.0.2.1")})
}

// kernelWrites counts, by "object/operation", the writes the fake kernel
// accepted.
type kernelWrites map[string]float64

// writeCountingKernel is the fake kernel, counting each write it accepts.
type writeCountingKernel struct {
	*seamtest.Kernel
	saw kernelWrites
}

// seamNames names the fake kernel's operations independently of the
// metrics' opLabel.
var seamNames = map[rtnl.OpKind]string{
	rtnl.Replace: "route/replace", rtnl.Delete: "route/delete",
	rtnl.AddNextHop: "nexthop/add", rtnl.ReplaceNextHop: "nexthop/replace", rtnl.DeleteNextHop: "nexthop/delete",
}

func (k *writeCountingKernel) Apply(ops []rtnl.Op) error {
	for _, op := range ops {
		k.saw[seamNames[op.Kind]]++
	}
	return k.Kernel.Apply(ops)
}

func (k *writeCountingKernel) RuleAdd(r *netlink.Rule) error {
	k.saw["rule/add"]++
	return k.Kernel.RuleAdd(r)
}

func (k *writeCountingKernel) RuleDel(r *netlink.Rule) error {
	if err := k.Kernel.RuleDel(r); err != nil {
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
	k := &writeCountingKernel{Kernel: seamtest.NewKernel(), saw: kernelWrites{}}
	// A stale rule of an earlier run in the router's range: Resync deletes it.
	stale := cfg.SlotRule(0)
	stale.Table = 9999
	k.Rules = append(k.Rules, stale)
	d := datapath.NewDatapath(cfg, countedRoutes{k, m}, countedRules{k, m}, k.Kernel.Chain(), k.Kernel.Device(),
		func(netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())

	steps := []struct {
		name string
		do   func() error
	}{
		{"resync", func() error {
			return d.Resync([]datapath.Tunnel{tunnel(cfg, "192.0.2.1", "10.244.1.5", "10.244.2.6"), tunnel(cfg, "192.0.2.2")})
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
	for _, want := range []string{"route/replace", "route/delete", "nexthop/add", "nexthop/delete", "rule/add", "rule/delete"} {
		if k.saw[want] == 0 {
			t.Errorf("the steps made no %s: the test proves nothing about it (saw %v)", want, k.saw)
		}
	}
}

// partlyFailingRoutes fails the operations at the given indexes of every
// Apply, as rtnl.Client reports them.
type partlyFailingRoutes struct {
	datapath.RouteOps
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
	ops := []rtnl.Op{{Kind: rtnl.Replace}, {Kind: rtnl.Replace}, {Kind: rtnl.Delete}, {Kind: rtnl.Delete}, {Kind: rtnl.Replace},
		{Kind: rtnl.AddNextHop}, {Kind: rtnl.AddNextHop}, {Kind: rtnl.ReplaceNextHop}, {Kind: rtnl.DeleteNextHop}}
	err := countedRoutes{partlyFailingRoutes{seamtest.NewKernel(), []int{1, 2, 6}}, m}.Apply(ops)
	if err == nil {
		t.Fatal("the failure was swallowed")
	}
	want := kernelWrites{"route/replace": 2, "route/delete": 1, "nexthop/add": 1, "nexthop/replace": 1, "nexthop/delete": 1}
	if got := kernelOps(t, reg); !maps.Equal(got, want) {
		t.Errorf("kernel operations %v, want %v", got, want)
	}
	// An error that does not say what failed counts nothing.
	other := countedRoutes{failingRoutes{seamtest.NewKernel()}, m}
	if err := other.Apply(ops); err == nil {
		t.Fatal("the failure was swallowed")
	}
	if got := kernelOps(t, reg); !maps.Equal(got, want) {
		t.Errorf("after an unknown failure: kernel operations %v, want %v", got, want)
	}
}

type failingRoutes struct{ datapath.RouteOps }

func (failingRoutes) Apply([]rtnl.Op) error { return errors.New("netlink socket closed") }

// fakeCounters is an HMARK chain's counters, or the error reading them.
type fakeCounters struct {
	counters map[netip.Addr]hmark.Counter
	err      error
}

func (f fakeCounters) Counters() (map[netip.Addr]hmark.Counter, error) {
	return maps.Clone(f.counters), f.err
}

// PortDrops: the port filter dropped half of each tunnel IP's packets.
func (f fakeCounters) PortDrops() (map[netip.Addr]hmark.Counter, error) {
	drops := make(map[netip.Addr]hmark.Counter, len(f.counters))
	for vip, c := range f.counters {
		drops[vip] = hmark.Counter{Packets: c.Packets / 2, Bytes: c.Bytes / 2}
	}
	return drops, f.err
}

func TestVIPTrafficReadAtScrape(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	chain := &fakeCounters{counters: map[netip.Addr]hmark.Counter{
		netip.MustParseAddr("192.0.2.1"): {Packets: 3, Bytes: 180},
		netip.MustParseAddr("192.0.2.2"): {Packets: 0, Bytes: 0},
	}}
	m.CollectVIPTraffic(chain, seamtest.QuietLog())
	g := promtest.WithText(reg, m.WriteText)
	packets := promtest.Series(t, g, "kube_service_tunnel_router_vip_packets_total")
	bytes := promtest.Series(t, g, "kube_service_tunnel_router_vip_bytes_total")
	if want := map[string]float64{"vip=192.0.2.1": 3, "vip=192.0.2.2": 0}; !maps.Equal(packets, want) {
		t.Errorf("packets %v, want %v", packets, want)
	}
	if want := map[string]float64{"vip=192.0.2.1": 180, "vip=192.0.2.2": 0}; !maps.Equal(bytes, want) {
		t.Errorf("bytes %v, want %v", bytes, want)
	}

	// Read again at the next scrape: a tunnel IP gone is gone from it.
	chain.counters = map[netip.Addr]hmark.Counter{netip.MustParseAddr("192.0.2.1"): {Packets: 5, Bytes: 300}}
	if got, want := promtest.Series(t, g, "kube_service_tunnel_router_vip_packets_total"), map[string]float64{"vip=192.0.2.1": 5}; !maps.Equal(got, want) {
		t.Errorf("next scrape: packets %v, want %v", got, want)
	}

	if got := promtest.Series(t, g, "kube_service_tunnel_router_vip_counter_read_errors_total")[""]; got != 0 {
		t.Errorf("read errors %v after good reads, want 0", got)
	}

	// A failed read fails nothing but these counters, and is counted.
	chain.err = errors.New("iptables: exit status 4")
	families, err := g.Gather()
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
	if got := promtest.Series(t, g, "kube_service_tunnel_router_vip_counter_read_errors_total")[""]; got != 2 {
		// Two scrapes with the error: the Gather above and this one.
		t.Errorf("read errors %v, want 2", got)
	}
}

// payloadRestorer accepts every payload, or fails them all with err; it
// saves nothing.
type payloadRestorer struct{ err error }

func (r payloadRestorer) Restore(string, []byte) error { return r.err }

func (r payloadRestorer) Save(string) ([]byte, error) { return nil, r.err }

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

func testConfig() datapath.Config {
	cfg := datapath.DefaultConfig()
	cfg.Buckets, cfg.Seed = 8, 1
	return cfg
}

// tunnel is a tunnel IP whose buckets are spread over pods.
func tunnel(cfg datapath.Config, vip string, pods ...string) datapath.Tunnel {
	var eps []netip.Addr
	for _, p := range pods {
		eps = append(eps, netip.MustParseAddr(p))
	}
	t := datapath.Tunnel{VIP: netip.MustParseAddr(vip)}
	for _, a := range bucket.Assign(cfg.Buckets, eps) {
		t.Table = append(t.Table, datapath.Endpoint{Addr: a, NodeName: "node-" + a.String(), NodeIP: netip.MustParseAddr("192.168.0.1")})
	}
	return t
}
