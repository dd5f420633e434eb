package integration

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// apiserverOutage is how long the API server stays down: several of the
// controllers' resync periods (1 s here).
const apiserverOutage = 8 * time.Second

// TestAPIServerLossKeepsDatapathAndRecovers stops the kube-apiserver under a
// running router (real datapath in a test namespace) and endpoint agent
// (real pod namespaces): while it is down, through several resyncs, the
// router's kernel state and the pods stay exactly as they were and both
// controllers keep running (the router goes on resyncing from its caches).
// Once the API server is back on the same address, a new Service and a
// moved annotation are programmed on both without restarting anything: the
// informers recover by themselves.
//
// It stops the API server the whole package shares: it must not run in
// parallel with other tests (it does not call t.Parallel), and it restarts
// the API server whatever happens.
func TestAPIServerLossKeepsDatapathAndRecovers(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	ns := freshNamespace(t, cs)
	// Runs after the restart below (cleanups run last first): later tests
	// must not see these Services (refused by their pools, they would log
	// warnings there).
	t.Cleanup(func() { deleteAllServices(t, ns) })
	pools, err := tunnelclaim.ParsePools("10.210.0.0/24=" + ns)
	if err != nil {
		t.Fatal(err)
	}
	policy := tunnelclaim.Policy{Pools: pools}
	cfg := robustRouterCfg(policy)
	cfg.ResyncPeriod = time.Second

	node := testnetns.New(t)
	nodeName := "loss-" + ns
	ip := netip.MustParseAddr("198.18.41.1")
	podNS := newPodNetns(t, node, ip, "veth-loss")
	pod := createPod(t, cs, ns, "pod-0", nodeName, ip)
	kr := newKernelRouter(t, cfg)
	rtr := runRouter(t, cfg, routerConfig(t), kr.dp)
	agentCfg := endpoint.Config{Mode: encap.GRE, NodeName: nodeName, Device: endpoint.DefaultDevice,
		RouteProtocol: encap.DefaultRouteProtocol, ResyncPeriod: time.Second, Workers: 2, Policy: policy}
	agent := runAgent(t, agentCfg, serviceAccountConfig(t, "tunnel-endpoint"), node)

	// A handful of Services, each backed by the local pod and a remote one.
	for i := range 5 {
		name := fmt.Sprintf("svc-%d", i)
		createService(t, cs, ns, name, fmt.Sprintf("10.210.0.%d", i+1))
		applySlice(t, cs, ns, name, name+"-1",
			ep{addr: ip.String(), node: nodeName, pod: pod, ready: ptr(true)},
			ep{addr: fmt.Sprintf("10.244.41.%d", i+1), node: "elsewhere", ready: ptr(true)})
	}
	waitConverged(t, cs, ns, cfg, nodeName, kr, podNS, "before the outage")
	kernelBefore, podBefore := kr.state(), podNS.tunnelIPs(t)
	resyncsBefore := rtr.dp.resyncs.Load()

	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	restarted := false
	restart := func() {
		if restarted {
			return
		}
		restarted = true
		if err := env.StartAPIServer(); err != nil {
			t.Fatalf("restarting the API server: %v", err)
		}
	}
	t.Cleanup(restart) // the other tests need it, whatever happens here
	if _, err := cs.CoreV1().Namespaces().Get(context.Background(), ns, metav1.GetOptions{}); err == nil {
		t.Fatal("the API server still answers after StopAPIServer")
	}
	checks := 0
	for time.Since(down) < apiserverOutage {
		time.Sleep(250 * time.Millisecond)
		checks++
		if got := kr.state(); got != kernelBefore {
			t.Fatalf("router kernel state changed while the API server was down:\n%s", lineDiff(kernelBefore, got))
		}
		if got := podNS.tunnelIPs(t); got != podBefore {
			t.Fatalf("pod tunnel IPs changed while the API server was down: %q, was %q", got, podBefore)
		}
		select {
		case <-rtr.done:
			t.Fatalf("router controller returned while the API server was down: %v", rtr.err)
		case <-agent.done:
			t.Fatalf("endpoint controller returned while the API server was down: %v", agent.err)
		default:
		}
	}
	resyncsDuringOutage := rtr.dp.resyncs.Load() - resyncsBefore
	if resyncsDuringOutage == 0 {
		t.Errorf("the router did not resync while the API server was down (resync period %v): is its worker stuck?", cfg.ResyncPeriod)
	}
	t.Logf("API server down for %v: kernel and pod unchanged in %d checks, the router resynced %d times from its caches",
		time.Since(down).Round(time.Millisecond), checks, resyncsDuringOutage)

	restart()
	up := time.Now()
	t.Logf("API server back on %s in %v", env.Host(), up.Sub(down).Round(time.Millisecond))

	// A new Service, and an existing one moved to another tunnel IP.
	createService(t, cs, ns, "svc-new", "10.210.0.100")
	applySlice(t, cs, ns, "svc-new", "svc-new-1", ep{addr: ip.String(), node: nodeName, pod: pod, ready: ptr(true)})
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, tunnelclaim.Annotation, strconv.Quote("10.210.0.200"))
	if _, err := cs.CoreV1().Services(ns).Patch(context.Background(), "svc-0", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	want := waitConverged(t, cs, ns, cfg, nodeName, kr, podNS, "after the API server came back")
	if _, ok := want.tunnels[netip.MustParseAddr("10.210.0.100")]; !ok {
		t.Fatalf("the new Service's tunnel IP is not in the desired state: %v", want.tunnels)
	}
	t.Logf("changes made after the restart programmed in %v (router and pod)", time.Since(up).Round(time.Millisecond))
}

// waitConverged waits until the router's kernel state and the pod's tunnel
// IPs are what the objects of ns ask for, and returns that desired state.
// The informers of a controller that lost the API server retry with a
// back-off of up to 30 s, hence the long timeout.
func waitConverged(t *testing.T, cs kubernetes.Interface, ns string, cfg router.Config, nodeName string, kr *kernelRouter, pod *podNetns, when string) desiredState {
	t.Helper()
	var want desiredState
	eventually(t, 2*time.Minute, "router kernel state and pod tunnel IPs as the objects ask "+when, func() error {
		want = finalState(t, cs, ns, cfg, nodeName)
		if d := kr.read(t, cfg).diff(want.tunnels, cfg.Buckets); d != "" {
			return fmt.Errorf("router:\n%s", d)
		}
		if got, want := pod.tunnelIPs(t), joinAddrs(want.pods["pod-0"]); got != want {
			return fmt.Errorf("pod holds %q, want %q", got, want)
		}
		return nil
	})
	return want
}
