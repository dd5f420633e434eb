package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// 12. A Service with sessionAffinity ClientIP: in each family, 50 flows of
// one client from different ports all reach one pod, through either
// router, the pod kubectl tunnel explain names; other clients still spread
// over the pods.
func clientAffinity(t *testing.T, e *env) {
	ctx := context.Background()
	vips := tunnelIPs(12)
	e.deploy(t, "affinity", vips, e.Pods...)
	if err := e.ApplyService(ctx, e.service(topology.Service{Name: "affinity", Annotation: annotation(vips), Endpoints: topology.Ready(e.Pods...), ClientAffinity: true})); err != nil {
		t.Fatal(err)
	}
	others := make([][]netip.Addr, len(vips))
	named := make([]string, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		var status tunnelctl.StatusReport
		if err := e.poll(30*time.Second, func() (bool, string) {
			e.kubectlTunnel(t, &status, "status", vip.String())
			if len(status.Tunnels) != 1 || !status.Tunnels[0].ClientAffinity {
				return false, fmt.Sprintf("status %+v", status.Tunnels)
			}
			for _, r := range status.Tunnels[0].Routers {
				if !r.Current() {
					return false, fmt.Sprintf("router %s not current: %+v", r.Router, r)
				}
			}
			return true, ""
		}); err != nil {
			t.Fatalf("both routers hashing %s on the client's address: %v", vip, err)
		}
		client := topology.ClientAddrFor(vip)
		added, err := e.AddClientAddrs(ctx, client, 8)
		if err != nil {
			t.Fatal(err)
		}
		others[i] = added
		t.Cleanup(func() {
			if err := e.RemoveClientAddrs(ctx, added); err != nil {
				t.Error(err)
			}
		})
		var ex tunnelctl.Explanation
		e.kubectlTunnel(t, &ex, "explain", netip.AddrPortFrom(vip, tcpPort).String(), "--from", netip.AddrPortFrom(client, 44000).String())
		if !ex.ClientAffinity {
			t.Errorf("explain does not account for the client affinity: %+v", ex)
		}
		named[i] = podName(ex.Endpoint.Pod)
	})
	t.Cleanup(func() { _ = e.RouteTunnelsVia(ctx, e.Routers...) })
	podOfClient := make([]map[netip.Addr]string, len(vips))
	for i := range podOfClient {
		podOfClient[i] = map[netip.Addr]string{}
	}
	for _, r := range e.Routers {
		if err := e.RouteTunnelsVia(ctx, r); err != nil {
			t.Fatal(err)
		}
		inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
			client := topology.ClientAddrFor(vip)
			reached := map[string]int{}
			for _, port := range portRange(44000, 50) {
				reached[e.whoFrom(t, netip.AddrPortFrom(client, port), vip).Pod]++
			}
			if len(reached) != 1 || reached[named[i]] != 50 {
				t.Errorf("through %s, 50 flows of %v reached %v; want all on %s, the pod kubectl tunnel explain names", r.Name, client, reached, named[i])
			}
			for _, c := range others[i] {
				for _, port := range portRange(45000, 5) {
					pod := e.whoFrom(t, netip.AddrPortFrom(c, port), vip).Pod
					if prev, ok := podOfClient[i][c]; ok && prev != pod {
						t.Errorf("client %v reached %s and %s (through %s)", c, prev, pod, r.Name)
					}
					podOfClient[i][c] = pod
				}
			}
			t.Logf("through %s: 50 flows of %v, from 50 ports, all reached %s", r.Name, client, named[i])
		})
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		spread := map[string]int{named[i]: 1}
		for _, pod := range podOfClient[i] {
			spread[pod]++
		}
		if len(spread) < 2 {
			t.Errorf("9 clients all reached one pod: %v", spread)
		}
		t.Logf("9 clients of %s (5 flows each from the 8 others) through both routers: each stayed on one pod; clients per pod %v", vip, spread)
	})
}

// whoFrom asks the tunnel IP who answers a TCP connection from src (an
// address of the client's namespace).
func (e *env) whoFrom(t testing.TB, src netip.AddrPort, vip netip.Addr) workload.Identity {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := workload.WhoFrom(ctx, e.client, "tcp", netip.AddrPortFrom(vip, tcpPort), src)
	if err != nil {
		t.Fatal(err)
	}
	if id.Peer != src {
		t.Fatalf("the pod saw %v, the client connected from %v", id.Peer, src)
	}
	return id
}
