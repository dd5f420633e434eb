package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
)

// kubectlTunnel runs kubectl tunnel's code, as the plugin binary does, with
// the lab's admin kubeconfig, and decodes its JSON answer into out.
func (e *env) kubectlTunnel(t testing.TB, out any, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stdout, err := tunnelctl.Output(ctx, append([]string{"--kubeconfig", filepath.Join(e.Opts.KubeDir, "admin.kubeconfig"), "-o", "json"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(stdout), out); err != nil {
		t.Fatalf("kubectl tunnel %v: %v\n%s", args, err, stdout)
	}
}

// 11. kubectl tunnel explain names, for 50 client flows with fixed ports
// per family, the pod that answers them, through either router; status
// shows each tunnel IP programmed with the current table on both routers,
// as they publish it.
func explainNamesAnsweringPod(t *testing.T, e *env) {
	ctx := context.Background()
	vips := tunnelIPs(11)
	e.deploy(t, "explain", vips, e.Pods...)
	ports := portRange(43000, 50)
	named := make([]map[uint16]string, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		// The routers publish their status at most once a second.
		var status tunnelctl.StatusReport
		if err := e.poll(30*time.Second, func() (bool, string) {
			e.kubectlTunnel(t, &status, "status", vip.String())
			if len(status.Tunnels) != 1 {
				return false, fmt.Sprintf("status shows %d tunnel IPs", len(status.Tunnels))
			}
			st := status.Tunnels[0]
			if len(st.Routers) != len(e.Routers) {
				return false, fmt.Sprintf("status shows %d routers, the lab has %d", len(st.Routers), len(e.Routers))
			}
			for _, r := range st.Routers {
				if !r.Current() {
					return false, fmt.Sprintf("router %s: programmed=%t table=%s", r.Router, r.Programmed, r.Table)
				}
			}
			return true, ""
		}); err != nil {
			t.Fatalf("kubectl tunnel status %s: %v\n%+v", vip, err, status)
		}
		st := status.Tunnels[0]
		if st.Service != e.Opts.Namespace+"/explain" || len(st.Endpoints) != len(e.Pods) {
			t.Errorf("status: service %s with %d endpoints, want %s/explain with %d", st.Service, len(st.Endpoints), e.Opts.Namespace, len(e.Pods))
		}
		buckets := 0
		for _, ep := range st.Endpoints {
			buckets += ep.Buckets
		}
		if buckets != e.Opts.Buckets {
			t.Errorf("status: the endpoints own %d buckets in all, want %d", buckets, e.Opts.Buckets)
		}
		// Each explain is a new kubectl tunnel run with its own connections
		// to the API server: a few at a time.
		explanations := make([]tunnelctl.Explanation, len(ports))
		lab.InParallel(explainsAtOnce, len(ports), func(j int) {
			e.kubectlTunnel(t, &explanations[j], "explain", netip.AddrPortFrom(vip, tcpPort).String(), "--from", netip.AddrPortFrom(topology.ClientAddrFor(vip), ports[j]).String(), "--proto", "tcp")
		})
		named[i] = map[uint16]string{}
		pods := map[string]int{}
		for j, port := range ports {
			ex := explanations[j]
			pod := ex.Endpoint.Pod
			if p := e.PodByName(podName(pod)); p == nil || topology.PodAddr(p, vip).String() != ex.Endpoint.Address {
				t.Fatalf("explain of port %d names pod %q at %s, not a lab pod", port, pod, ex.Endpoint.Address)
			}
			switch e.Opts.Mode {
			case "gre":
				if ex.Encapsulation.GREDestination != ex.Endpoint.Address {
					t.Errorf("explain of port %d: GRE destination %s, want the pod %s", port, ex.Encapsulation.GREDestination, ex.Endpoint.Address)
				}
			case "mpls":
				if ex.Encapsulation.MPLSLabel == 0 || ex.Encapsulation.NextHop != ex.Endpoint.NodeAddress {
					t.Errorf("explain of port %d: MPLS label %d via %s, want a label via the pod's node %s", port, ex.Encapsulation.MPLSLabel, ex.Encapsulation.NextHop, ex.Endpoint.NodeAddress)
				}
			}
			carriers := 0
			for _, r := range ex.Routers {
				if r.Carries {
					carriers++
				}
			}
			if carriers != len(e.Routers) {
				t.Errorf("explain of port %d: %d routers carry it, want %d: %+v", port, carriers, len(e.Routers), ex.Routers)
			}
			named[i][port] = podName(pod)
			pods[podName(pod)]++
		}
		if len(pods) < 2 {
			t.Errorf("explain sends all 50 flows to one pod: %v", pods)
		}
		t.Logf("pods named by explain for %s: %v", vip, pods)
	})
	t.Cleanup(func() { _ = e.RouteTunnelsVia(ctx, e.Routers...) })
	for _, r := range e.Routers {
		if err := e.RouteTunnelsVia(ctx, r); err != nil {
			t.Fatal(err)
		}
		inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
			wrong := 0
			for _, port := range ports {
				if got := e.who(t, "tcp", vip, port).Pod; got != named[i][port] {
					wrong++
					t.Errorf("flow from port %d through %s reached %s; kubectl tunnel explain named %s", port, r.Name, got, named[i][port])
				}
			}
			t.Logf("through %s: %d of %d flows to %s reached the pod kubectl tunnel explain named", r.Name, len(ports)-wrong, len(ports), vip)
		})
	}
}

// explainsAtOnce is how many kubectl tunnel explain runs a family has at
// once.
const explainsAtOnce = 4

// podName is the name part of "namespace/name".
func podName(key string) string {
	if _, name, ok := strings.Cut(key, "/"); ok {
		return name
	}
	return key
}
