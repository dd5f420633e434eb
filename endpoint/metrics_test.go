package endpoint

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"

	"github.com/cmdnu/kube-service-tunnel/endpoint/guard"
	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
)

// scriptedPods stands in for PodNetwork: it remembers the tunnel IPs each pod
// holds and returns, for each sync, the changes that turn them into the
// wanted ones (a device created with the first, deleted with the last, one
// address change per tunnel IP). It records every change it returned.
type scriptedPods struct {
	mu   sync.Mutex
	held map[string][]netip.Addr
	made []PodChange
}

func (s *scriptedPods) Sync(_ netns.NsHandle, want PodTunnels) ([]PodChange, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := want.Pod.Namespace + "/" + want.Pod.Name
	have := s.held[key]
	add, del := diffAddrs(want.TunnelIPs, have)
	var acts []PodChange
	for _, ip := range del {
		acts = append(acts, PodChange{Kind: actDelTunnelIP, Addr: ip})
	}
	if len(have) > 0 && len(want.TunnelIPs) == 0 {
		acts = append(acts, PodChange{Kind: actDeleteDevice})
	}
	if len(have) == 0 && len(want.TunnelIPs) > 0 {
		acts = append(acts, PodChange{Kind: actCreateDevice, Addr: want.Pod.IP})
	}
	for _, ip := range add {
		acts = append(acts, PodChange{Kind: actAddTunnelIP, Addr: ip})
	}
	s.held[key] = slices.Clone(want.TunnelIPs)
	s.made = append(s.made, acts...)
	return acts, nil
}

// count returns how many of the changes returned so far were of kind.
func (s *scriptedPods) count(kind podActionKind) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, a := range s.made {
		if a.Kind == kind {
			n++
		}
	}
	return n
}

func (s *scriptedPods) holds(pod string) []netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held[pod]
}

// scriptedNode raises ip_forward on its first sync and counts its syncs.
type scriptedNode struct {
	mu    sync.Mutex
	syncs int
}

func (n *scriptedNode) Sync([]PodTunnels, netip.Addr) ([]NodeChange, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.syncs++
	if n.syncs == 1 {
		return []NodeChange{{Sysctl: sysctlIPForward, Value: "1"}}, nil
	}
	return nil, nil
}

func (n *scriptedNode) count() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.syncs
}

// fixedCounters reads the same counters in every namespace, or fails.
type fixedCounters struct {
	mu   sync.Mutex
	c    DecapCounters
	fail bool
}

func (f *fixedCounters) DecapCounters(netns.NsHandle, bool) (DecapCounters, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return DecapCounters{}, errors.New("device gone")
	}
	return f.c, nil
}

func (f *fixedCounters) setFail(v bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = v
}

// TestControllerMetrics runs the controller on two local pods (one serving
// two tunnel IPs, one serving one of them) and a refused Service, and checks
// every metric against what the syncs did; then one Service goes and its
// series with it.
func TestControllerMetrics(t *testing.T) {
	objects := []k8sruntime.Object{
		tunnelService("a", "web", "192.0.2.10", time.Hour),
		tunnelService("a", "api", "192.0.2.11", time.Hour),
		tunnelService("a", "outside", "198.51.100.7", time.Hour), // outside the pools
		testPod("a", "both", "n1", "10.1.0.11"),
		testPod("a", "webonly", "n1", "10.1.0.12"),
		slice("a", "web", ep{"10.1.0.11", "n1", "both", true}, ep{"10.1.0.12", "n1", "webonly", true}),
		slice("a", "api", ep{"10.1.0.11", "n1", "both", true}),
		slice("a", "outside", ep{"10.1.0.12", "n1", "webonly", true}),
	}
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true, netip.MustParseAddr("10.1.0.12"): true}, lookups: map[string]int{}}
	pods := &scriptedPods{held: map[string][]netip.Addr{}}
	node := &scriptedNode{}
	counters := &fixedCounters{c: DecapCounters{Packets: 42, Bytes: 4200}}
	reg := prometheus.NewRegistry()
	client, ctrl := startControllerWith(t, loc, pods, node, NewMetrics(reg, counters, nil, false), objects...)

	waitFor(t, "first full sync", ctrl.Ready)
	if got := promtest.Series(t, reg, "kube_service_tunnel_endpoint_tunnel_ips")[""]; got != 2 {
		t.Errorf("tunnel_ips = %v, want 2", got)
	}
	if got := promtest.Series(t, reg, "kube_service_tunnel_endpoint_refused_tunnel_ips")[""]; got != 1 {
		t.Errorf("refused_tunnel_ips = %v, want 1", got)
	}
	endpoints := promtest.Series(t, reg, "kube_service_tunnel_endpoint_local_endpoints")
	if endpoints["vip=192.0.2.10"] != 2 || endpoints["vip=192.0.2.11"] != 1 || len(endpoints) != 2 {
		t.Errorf("local_endpoints = %v, want 192.0.2.10: 2, 192.0.2.11: 1", endpoints)
	}
	ops := promtest.Series(t, reg, "kube_service_tunnel_endpoint_kernel_operations_total")
	wantOps := map[string]float64{
		"netns=pod,object=decap_device,operation=create": float64(pods.count(actCreateDevice)),
		"netns=pod,object=tunnel_ip,operation=add":       float64(pods.count(actAddTunnelIP)),
		"netns=node,object=sysctl,operation=set":         1,
	}
	if wantOps["netns=pod,object=tunnel_ip,operation=add"] != 3 {
		t.Fatalf("the pods were given %v tunnel IP additions, want 3; the test proves nothing", wantOps)
	}
	if !mapsEqual(ops, wantOps) {
		t.Errorf("kernel_operations_total = %v, want %v", ops, wantOps)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_sync_duration_seconds")["kind=pod"]; n < 2 {
		t.Errorf("pod syncs observed = %v, want at least 2", n)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_sync_errors_total")["kind=pod"]; n != 0 {
		t.Errorf("pod sync errors = %v, want 0", n)
	}
	decap := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total")
	wantDecap := map[string]float64{"pod=a/both,vip=192.0.2.10,192.0.2.11": 42, "pod=a/webonly,vip=192.0.2.10": 42}
	if !mapsEqual(decap, wantDecap) {
		t.Errorf("decap_received_packets_total = %v, want %v", decap, wantDecap)
	}
	if b := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_bytes_total")["pod=a/webonly,vip=192.0.2.10"]; b != 4200 {
		t.Errorf("decap_received_bytes_total = %v, want 4200", b)
	}

	// A scrape whose counters cannot be read counts the failures and still succeeds.
	counters.setFail(true)
	if decap := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total"); len(decap) != 0 {
		t.Errorf("series of unreadable counters exported: %v", decap)
	}
	counters.setFail(false) // so that the next scrape adds no failure
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_counter_errors_total")[""]; n != 2 {
		t.Errorf("decap_counter_errors_total = %v, want 2 (one per pod)", n)
	}

	// The api Service goes: its tunnel IP leaves pod "both", and its series go.
	if err := client.CoreV1().Services("a").Delete(context.Background(), "api", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "192.0.2.11 removed from pod both", func() bool { return len(pods.holds("a/both")) == 1 })
	waitFor(t, "its counters relabelled", func() bool {
		_, ok := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total")["pod=a/both,vip=192.0.2.10"]
		return ok
	})
	if got := promtest.Series(t, reg, "kube_service_tunnel_endpoint_tunnel_ips")[""]; got != 1 {
		t.Errorf("tunnel_ips = %v after the Service went, want 1", got)
	}
	if endpoints := promtest.Series(t, reg, "kube_service_tunnel_endpoint_local_endpoints"); !mapsEqual(endpoints, map[string]float64{"vip=192.0.2.10": 2}) {
		t.Errorf("local_endpoints = %v after the Service went, want only 192.0.2.10: 2", endpoints)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_kernel_operations_total")["netns=pod,object=tunnel_ip,operation=delete"]; n != 1 || pods.count(actDelTunnelIP) != 1 {
		t.Errorf("tunnel_ip deletions counted %v, made %d; want 1", n, pods.count(actDelTunnelIP))
	}

	// The web Service goes too: nothing is served, the devices go, and no
	// pod's counters are read anymore.
	if err := client.CoreV1().Services("a").Delete(context.Background(), "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both pods emptied", func() bool { return len(pods.holds("a/both")) == 0 && len(pods.holds("a/webonly")) == 0 })
	if decap := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total"); len(decap) != 0 {
		t.Errorf("counters of pods serving nothing still exported: %v", decap)
	}
	if endpoints := promtest.Series(t, reg, "kube_service_tunnel_endpoint_local_endpoints"); len(endpoints) != 0 {
		t.Errorf("local_endpoints = %v with nothing served", endpoints)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_kernel_operations_total")["netns=pod,object=decap_device,operation=delete"]; n != 2 {
		t.Errorf("device deletions counted %v, want 2", n)
	}
}

// TestReadyAfterFirstFullSync: /readyz answers 503 while a pod served at the
// first computation has not been converged (its namespace cannot be found),
// although the node is, and 200 once it is; /healthz answers 200 throughout.
func TestReadyAfterFirstFullSync(t *testing.T) {
	objects := []k8sruntime.Object{
		tunnelService("a", "web", "192.0.2.10", time.Hour),
		testPod("a", "late", "n1", "10.1.0.12"),
		slice("a", "web", ep{"10.1.0.12", "n1", "late", true}),
	}
	loc := &fakeLocator{found: map[netip.Addr]bool{}, lookups: map[string]int{}}
	pods := &scriptedPods{held: map[string][]netip.Addr{}}
	node := &scriptedNode{}
	reg := daemon.NewRegistry()
	_, ctrl := startControllerWith(t, loc, pods, node, NewMetrics(reg, nil, nil, false), objects...)

	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	log := logrus.New()
	log.Out = io.Discard
	addr, err := daemon.Serve(ctx, "127.0.0.1:0", reg, nil, ctrl.Ready, ctrl.Healthy, log)
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + addr.String()

	waitFor(t, "node synced and the pod retried", func() bool { return node.count() >= 1 && loc.count("late") >= 2 })
	if code := status(t, base+"/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d while a served pod is not converged, want 503", code)
	}
	if code := status(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d, want 200", code)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_sync_errors_total")["kind=pod"]; n < 1 {
		t.Errorf("pod sync errors = %v while its namespace is missing, want at least 1", n)
	}

	loc.setFound(netip.MustParseAddr("10.1.0.12"))
	waitFor(t, "/readyz 200", func() bool { return status(t, base+"/readyz") == http.StatusOK })
	if got := pods.holds("a/late"); !slices.Equal(got, []netip.Addr{vip1}) {
		t.Fatalf("ready while the pod holds %v, want [%v]", got, vip1)
	}
	if body := get(t, base+"/metrics"); !strings.Contains(body, "kube_service_tunnel_endpoint_tunnel_ips 1") {
		t.Errorf("/metrics lacks kube_service_tunnel_endpoint_tunnel_ips 1:\n%s", body)
	}
}

func status(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func mapsEqual(a, b map[string]float64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// familyCounters reads different counters on each family's device and
// filter table, so that a series taken from the wrong one shows.
type familyCounters struct{}

func (familyCounters) DecapCounters(_ netns.NsHandle, ipv6 bool) (DecapCounters, error) {
	if ipv6 {
		return DecapCounters{Packets: 6, Bytes: 600}, nil
	}
	return DecapCounters{Packets: 4, Bytes: 400}, nil
}

func (familyCounters) RuleDrops(_ netns.NsHandle, ipv6 bool) (RuleDrops, error) {
	if ipv6 {
		return RuleDrops{Policy: map[netip.Addr]netpol.Counter{v6vip1: {Packets: 2, Bytes: 160}}, Guard: map[string]guard.Counter{guard.CarrierSource: {Packets: 7}}}, nil
	}
	return RuleDrops{Policy: map[netip.Addr]netpol.Counter{vip1: {Packets: 1, Bytes: 60}}, Guard: map[string]guard.Counter{guard.Bypass: {Packets: 3}}}, nil
}

// TestMetricsDualStack: a dual-stack pod's decapsulation counters are
// exported per device, each labelled with its family's tunnel IPs, and
// its drops are read from each family's table; IPv6 tunnel IPs are
// label values like IPv4 ones.
func TestMetricsDualStack(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg, familyCounters{}, familyCounters{}, true)
	w := isolated(want6(vip1, v6vip1, v6vip2))
	guarded := map[string]PodTunnels{"a/web-1": w}
	WithGuards(guarded, testConfig(encap.GRE), nil)
	w = guarded["a/web-1"]
	m.desiredState(map[string]PodTunnels{"a/web-1": w}, nil)
	if !m.keepNamespace("a/web-1", w, netns.None()) {
		t.Fatal("the namespace of a served pod was not kept")
	}
	defer m.release()
	for name, want := range map[string]map[string]float64{
		"kube_service_tunnel_endpoint_decap_received_packets_total": {"pod=a/web-1,vip=192.0.2.10": 4, "pod=a/web-1,vip=2001:db8::10,2001:db8::11": 6},
		"kube_service_tunnel_endpoint_policy_dropped_packets_total": {"pod=a/web-1,vip=192.0.2.10": 1, "pod=a/web-1,vip=2001:db8::10": 2},
		"kube_service_tunnel_endpoint_local_endpoints":              {"vip=192.0.2.10": 1, "vip=2001:db8::10": 1, "vip=2001:db8::11": 1},
		"kube_service_tunnel_endpoint_guard_dropped_packets_total": {
			"family=IPv4,pod=a/web-1,reason=bypass": 3, "family=IPv4,pod=a/web-1,reason=carrier-source": 0, "family=IPv4,pod=a/web-1,reason=inner-destination": 0,
			"family=IPv6,pod=a/web-1,reason=bypass": 0, "family=IPv6,pod=a/web-1,reason=carrier-source": 7, "family=IPv6,pod=a/web-1,reason=inner-destination": 0,
		},
	} {
		if got := promtest.Series(t, reg, name); !mapsEqual(got, want) {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	// An IPv6-only pod: nothing is read from an IPv4 device it has not.
	w = wantOnly6(v6vip1)
	m.keepNamespace("a/web-1", w, netns.None())
	if got := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total"); !mapsEqual(got, map[string]float64{"pod=a/web-1,vip=2001:db8::10": 6}) {
		t.Errorf("IPv6-only pod: %v", got)
	}
}
