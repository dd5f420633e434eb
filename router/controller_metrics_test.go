package router

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/router/metrics"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
	"github.com/prometheus/client_golang/prometheus"
	discoveryv1 "k8s.io/api/discovery/v1"
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
func bucketShares(tn datapath.Tunnel) map[string]float64 {
	out := map[string]float64{}
	for _, ep := range tn.Present {
		out[fmt.Sprintf("endpoint=%s,vip=%s", ep.Addr, tn.VIP)] = 0
	}
	for _, ep := range tn.Table {
		out[fmt.Sprintf("endpoint=%s,vip=%s", ep.Addr, tn.VIP)]++
	}
	return out
}

// newMeteredController returns a controller with metrics, and what its
// /metrics would serve.
func newMeteredController(t *testing.T, pools string) (*testController, prometheus.Gatherer) {
	t.Helper()
	tc := newTestController(t, pools)
	reg := prometheus.NewRegistry()
	m := metrics.NewMetrics(reg)
	tc.SetMetrics(m)
	return tc, promtest.WithText(reg, m.WriteText)
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
	process := func(key daemon.QueueKey) {
		t.Helper()
		tc.queue.Add(key)
		if !tc.processNext() {
			t.Fatal("queue shut down")
		}
	}
	process(resyncKey)
	process(daemon.ObjectKey("web/a"))
	tc.dp.fail = errors.New("kernel says no")
	process(daemon.ObjectKey("web/a"))
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

// Start-up syncs every Service once, in the initial resync: the informers'
// initial events, already in the caches it lists, queue nothing more. A
// change after it is synced on its own.
func TestControllerStartSyncsEachServiceOnce(t *testing.T) {
	tc, reg := newMeteredController(t, "192.0.2.0/24")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	for i := range 3 {
		name := fmt.Sprintf("web-%d", i)
		if _, err := tc.client.CoreV1().Services("a").Create(ctx, tunnelSvc("a", name, fmt.Sprintf("192.0.2.%d", 10+i), time.Hour), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := tc.client.DiscoveryV1().EndpointSlices("a").Create(ctx, oneEndpoint("a", name, fmt.Sprintf("10.244.1.%d", 5+i)), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	tc.inf.Start(ctx.Done())
	done := make(chan struct{})
	go func() { defer close(done); _ = tc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; tc.inf.Shutdown() })
	reconciles := func() map[string]float64 {
		return promtest.Series(t, reg, "kube_service_tunnel_router_reconcile_duration_seconds")
	}
	waitUntil(t, "the initial resync", func() bool { return tc.Ready() })
	// A Service created now: the queue is first in, first out, so had the
	// initial events queued the three Services, they would be synced
	// before this one.
	if _, err := tc.client.CoreV1().Services("a").Create(ctx, tunnelSvc("a", "late", "192.0.2.20", time.Hour), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the late Service synced", func() bool { return reconciles()["kind=service"] >= 1 })
	if got := reconciles(); got["kind=service"] != 1 || got["kind=resync"] != 1 {
		t.Errorf("reconciles after start-up and one new Service: %v, want 1 resync and 1 service", got)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
