package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// 14. A dual-stack Service annotated with one tunnel IP of each family is
// served on both: each is carried to the pods' addresses of its family, and
// the pods see the client's address of that family. Dropping the IPv6
// address from the annotation withdraws it alone.
func dualStack(t *testing.T, e *env) {
	ctx := context.Background()
	vip4, vip6 := topology.TunnelIP(14), topology.TunnelIP6(14)
	svc := topology.Service{Name: "dual", Annotation: vip4.String() + ", " + vip6.String(), Endpoints: topology.Ready(e.Pods...), Families: topology.DualStack}
	if err := e.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.DeleteService(ctx, svc.Name); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		for _, vip := range []netip.Addr{vip4, vip6} {
			if err := e.WaitNoTunnel(ctx, vip); err != nil {
				t.Errorf("cleanup of %s: %v", vip, err)
			}
		}
	})
	start := time.Now()
	for _, vip := range []netip.Addr{vip4, vip6} {
		if _, err := e.WaitTunnel(ctx, vip, e.Pods...); err != nil {
			t.Fatalf("tunnel %s: %v", vip, err)
		}
	}
	t.Logf("Service dual on %s and %s programmed on both routers and %d pods in %v", vip4, vip6, len(e.Pods), time.Since(start).Round(time.Millisecond))
	for _, vip := range []netip.Addr{vip4, vip6} {
		for _, network := range []string{"tcp", "udp"} {
			id := e.who(t, network, vip, 0)
			if want := topology.ClientAddrFor(vip); id.Peer.Addr() != want {
				t.Errorf("%s to %s: the pod saw the client as %v, want %v", network, vip, id.Peer, want)
			}
			if id.Local.Addr() != vip {
				t.Errorf("%s to %s: the request arrived on %v", network, vip, id.Local)
			}
			t.Logf("%s to %s answered by %s, which saw the client as %v", network, vip, id.Pod, id.Peer)
		}
	}

	svc.Annotation = vip4.String()
	if err := e.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	droppedAt := time.Now()
	if err := e.WaitNoTunnel(ctx, vip6); err != nil {
		t.Fatalf("after dropping %s from the annotation: %v", vip6, err)
	}
	t.Logf("%s dropped from the annotation: gone from both routers and every pod %v later", vip6, time.Since(droppedAt).Round(time.Millisecond))
	if _, err := e.WaitTunnel(ctx, vip4, e.Pods...); err != nil {
		t.Errorf("%s lost its programming when %s was dropped: %v", vip4, vip6, err)
	}
	for _, network := range []string{"tcp", "udp"} {
		e.who(t, network, vip4, 0)
	}
}

// 15. An IPv6 tunnel IP on a Service without IPv6 endpoints (an IPv4-only
// Service) is not carried to the pods' IPv4 addresses: the Service gets a
// NoReadyEndpoints Warning naming the missing addressType, every bucket of
// both routers is an IPv6 blackhole, and the client gets no answer.
func ipv6WithoutIPv6Endpoints(t *testing.T, e *env) {
	ctx := context.Background()
	vip := topology.TunnelIP6(15)
	svc := topology.Service{Name: "v4only", Annotation: vip.String(), Endpoints: topology.Ready(e.Pods...)}
	if err := e.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.DeleteService(ctx, svc.Name); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		if err := e.WaitNoTunnel(ctx, vip); err != nil {
			t.Errorf("cleanup of %s: %v", vip, err)
		}
	})
	const why = "has no EndpointSlice of addressType IPv6"
	var warning string
	if err := e.poll(30*time.Second, func() (bool, string) {
		evs, err := e.Events(ctx, svc.Name)
		if err != nil {
			return false, err.Error()
		}
		for _, ev := range evs {
			if ev.Type == corev1.EventTypeWarning && ev.Reason == router.ReasonNoReadyEndpoints && strings.Contains(ev.Message, why) {
				warning = ev.Message
				return true, ""
			}
		}
		return false, fmt.Sprintf("no %s Warning saying %q among %d events", router.ReasonNoReadyEndpoints, why, len(evs))
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("Service v4only: Warning %s: %s", router.ReasonNoReadyEndpoints, warning)
	for _, r := range e.Routers {
		if err := e.poll(30*time.Second, func() (bool, string) {
			routes, err := topology.IP(ctx, "-n", r.Name, "-6", "route", "show", "table", "all", "proto", "245")
			if err != nil {
				return false, err.Error()
			}
			n := 0
			for _, l := range strings.Split(routes, "\n") {
				if f := strings.Fields(l); len(f) > 1 && f[0] == "blackhole" && (f[1] == vip.String() || f[1] == topology.HostPrefix(vip)) {
					n++
				}
			}
			return n == e.Opts.Buckets, fmt.Sprintf("%s holds %d blackhole routes for %s, want one per bucket (%d)", r.Name, n, vip, e.Opts.Buckets)
		}); err != nil {
			t.Error(err)
		}
	}
	for _, p := range e.Pods {
		if ok, err := topology.PodHasAddr(ctx, p, vip); err != nil || ok {
			t.Errorf("%s holds %s (err %v), though its Service has no IPv6 endpoint", p.Name, vip, err)
		}
	}
	dialCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if id, err := workload.Who(dialCtx, e.client, "tcp", netip.AddrPortFrom(vip, tcpPort), 0); err == nil {
		t.Errorf("a connection to %s was answered by %s", vip, id.Pod)
	}
	t.Logf("%s: every bucket of both routers is a blackhole, no pod holds it, a connection gets no answer", vip)
}
