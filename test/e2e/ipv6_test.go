package e2e

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
)

// ipv6Scenarios run, after the IPv4 ones, on the same lab with IPv6 tunnel
// IPs (2001:db8:2::N) of dual-stack Services, carried to the pods' IPv6
// addresses: the family-generic scenarios with env.ipv6 set, and a
// dual-stack Service served on both its addresses.
var ipv6Scenarios = []scenario{
	{"1_reach_pod_with_client_address", reachPod},
	{"2_routers_agree_on_every_flow", routersAgree},
	{"3_router_failover_keeps_connection", routerFailover},
	{"4_endpoint_change_moves_only_its_flows", endpointChurn},
	{"5_service_removal_restores_kernel_state", removalRestoresState},
	{"9_draining_endpoint_keeps_its_flows", drainingEndpoint},
	{"14_dual_stack_service_answers_on_both_addresses", dualStack},
}

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
