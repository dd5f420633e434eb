package endpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

// fakeLocator hands out the namespace of a pod with an address listed in
// found and counts lookups; other pods have no sandbox.
type fakeLocator struct {
	mu      sync.Mutex
	found   map[netip.Addr]bool
	lookups map[string]int
}

func (f *fakeLocator) Name() string { return "fake" }
func (f *fakeLocator) Close() error { return nil }
func (f *fakeLocator) Locate(_ context.Context, pod runtime.Pod) (runtime.Netns, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lookups[pod.Name]++
	if !slices.ContainsFunc(pod.Addrs(), func(ip netip.Addr) bool { return f.found[ip] }) {
		return runtime.Netns{}, runtime.NotFoundf("pod %s", pod)
	}
	return runtime.Netns{Handle: netns.None(), Path: "fake/" + pod.Name, Via: "fake"}, nil
}

func (f *fakeLocator) setFound(ip netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.found[ip] = true
}

func (f *fakeLocator) count(pod string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lookups[pod]
}

// fakePods records every desired state handed to the kernel seam.
type fakePods struct {
	mu    sync.Mutex
	wants map[string][]PodTunnels
}

func (f *fakePods) Sync(_ netns.NsHandle, want PodTunnels) ([]PodChange, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.wants[want.Pod.Name] = append(f.wants[want.Pod.Name], want)
	return nil, nil
}

func (f *fakePods) history(pod string) []PodTunnels {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]PodTunnels(nil), f.wants[pod]...)
}

type fakeNode struct{}

func (fakeNode) Sync([]PodTunnels, netip.Addr) ([]NodeChange, error) { return nil, nil }

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func startController(t *testing.T, loc *fakeLocator, pods *fakePods, objects ...k8sruntime.Object) *fake.Clientset {
	t.Helper()
	client, _ := startControllerWith(t, loc, pods, fakeNode{}, nil, objects...)
	return client
}

// startControllerWith runs a controller on the fakes, recording on metrics
// (nil: none), and returns it with its client.
func startControllerWith(t *testing.T, loc *fakeLocator, pods PodSyncer, node NodeSyncer, metrics *Metrics, objects ...k8sruntime.Object) (*fake.Clientset, *Controller) {
	t.Helper()
	return startControllerConfig(t, testConfig(encap.GRE), loc, pods, node, metrics, objects...)
}

// startControllerConfig is startControllerWith with the configuration cfg.
func startControllerConfig(t *testing.T, cfg Config, loc *fakeLocator, pods PodSyncer, node NodeSyncer, metrics *Metrics, objects ...k8sruntime.Object) (*fake.Clientset, *Controller) {
	t.Helper()
	client := fake.NewClientset(objects...)
	return client, runController(t, client, cfg, loc, pods, node, func(c *Controller) { c.SetMetrics(metrics) })
}

// runController builds a controller on client's informers, lets setup
// configure it, and runs it until the test ends.
func runController(t *testing.T, client *fake.Clientset, cfg Config, loc *fakeLocator, pods PodSyncer, node NodeSyncer, setup func(*Controller)) *Controller {
	t.Helper()
	inf := NewInformers(client, "n1")
	log := logrus.New()
	log.Out = io.Discard
	c, err := NewController(cfg, inf, loc, pods, node, log)
	if err != nil {
		t.Fatal(err)
	}
	setup(c)
	ctx, cancel := context.WithCancel(context.Background())
	inf.Start(ctx.Done())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		inf.Shutdown()
	})
	return c
}

func TestControllerPodStates(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	served := testPod("a", "served", "n1", "10.1.0.11")
	late := testPod("a", "late", "n1", "10.1.0.12")
	idle := testPod("a", "idle", "n1", "10.1.0.13")
	hostNet := testPod("a", "hostnet", "n1", "10.1.0.14")
	hostNet.Spec.HostNetwork = true
	es := slice("a", "web", ep{"10.1.0.11", "n1", "served", true}, ep{"10.1.0.12", "n1", "late", true})
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true, netip.MustParseAddr("10.1.0.13"): true, netip.MustParseAddr("10.1.0.14"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	startController(t, loc, pods, svc, served, late, idle, hostNet, es)

	waitFor(t, "served pod synced", func() bool { return len(pods.history("served")) > 0 })
	// The very first sync of a served pod already carries its tunnel IP:
	// the desired state exists before any pod is touched.
	if first := pods.history("served")[0]; len(first.TunnelIPs) != 1 || first.TunnelIPs[0] != vip1 {
		t.Fatalf("first sync of the served pod wanted %v, want [%v]", first.TunnelIPs, vip1)
	}
	// A pod without a namespace is retried with back-off while the others go on.
	waitFor(t, "late pod retried", func() bool { return loc.count("late") >= 2 })
	// An idle pod is checked once (it may hold leftovers) and then left alone.
	waitFor(t, "idle pod checked", func() bool { return len(pods.history("idle")) == 1 })
	if h := pods.history("idle"); len(h[0].TunnelIPs) != 0 {
		t.Fatalf("idle pod wanted %v", h[0].TunnelIPs)
	}
	if n := loc.count("hostnet"); n != 0 {
		t.Fatalf("host-network pod looked up %d times", n)
	}

	// Its namespace appears: it is configured on the next retry.
	loc.setFound(netip.MustParseAddr("10.1.0.12"))
	waitFor(t, "late pod configured", func() bool {
		h := pods.history("late")
		return len(h) > 0 && len(h[len(h)-1].TunnelIPs) == 1
	})
	time.Sleep(200 * time.Millisecond)
	if n := len(pods.history("idle")); n != 1 {
		t.Fatalf("idle pod synced %d times, want once", n)
	}
}

// A pod that was clean (no tunnel IP), then served, then no longer served
// must lose its tunnel IP at once: the lab found the agent waiting for the
// next resync because the pod was still remembered as clean.
func TestControllerRemovesTunnelIPFromPodThatWasCleanBefore(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	pod := testPod("a", "p", "n1", "10.1.0.11")
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	client := startController(t, loc, pods, svc, pod)
	last := func() []netip.Addr {
		h := pods.history("p")
		if len(h) == 0 {
			return nil
		}
		return h[len(h)-1].TunnelIPs
	}
	waitFor(t, "idle pod checked", func() bool { return len(pods.history("p")) == 1 })

	es := slice("a", "web", ep{"10.1.0.11", "n1", "p", true})
	ctx := context.Background()
	if _, err := client.DiscoveryV1().EndpointSlices("a").Create(ctx, es, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "pod served", func() bool { return len(last()) == 1 })
	if err := client.DiscoveryV1().EndpointSlices("a").Delete(ctx, es.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "tunnel IP removed from the pod", func() bool { return len(pods.history("p")) >= 3 && len(last()) == 0 })
}

// A Node that appears with the tunnel IP as its address makes the agent
// refuse that tunnel IP and remove it from the pod; the Node's removal gives
// it back. Every Node is watched, not only this one.
func TestControllerReevaluatesWhenNodesChange(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	pod := testPod("a", "p", "n1", "10.1.0.11")
	es := slice("a", "web", ep{"10.1.0.11", "n1", "p", true})
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	client := startController(t, loc, pods, svc, pod, es)
	last := func() []netip.Addr {
		h := pods.history("p")
		if len(h) == 0 {
			return nil
		}
		return h[len(h)-1].TunnelIPs
	}
	waitFor(t, "pod served", func() bool { return len(last()) == 1 })

	ctx := context.Background()
	other := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n2"},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "192.0.2.10"}}}}
	if _, err := client.CoreV1().Nodes().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "tunnel IP refused once a Node has it", func() bool { return len(pods.history("p")) >= 2 && len(last()) == 0 })
	if err := client.CoreV1().Nodes().Delete(ctx, "n2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "tunnel IP served again once the Node is gone", func() bool { return len(pods.history("p")) >= 3 && len(last()) == 1 })
}

func TestControllerFollowsNetworkPolicies(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	pod := testPod("a", "p", "n1", "10.1.0.11")
	pod.Labels = map[string]string{"app": "web"}
	client := testPod("b", "c", "n2", "10.2.0.5") // on another node
	client.Labels = map[string]string{"role": "client"}
	es := slice("a", "web", ep{"10.1.0.11", "n1", "p", true})
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "b", Labels: map[string]string{"team": "b"}}}
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	cfg := testConfig(encap.GRE)
	cfg.NetworkPolicy = true
	cs, _ := startControllerConfig(t, cfg, loc, pods, fakeNode{}, nil, svc, pod, client, es, ns)
	last := func() PodTunnels {
		h := pods.history("p")
		if len(h) == 0 {
			return PodTunnels{}
		}
		return h[len(h)-1]
	}
	waitFor(t, "pod served, not isolated", func() bool { return len(last().TunnelIPs) == 1 && last().Policy != nil && !last().Isolated() })

	ctx := context.Background()
	np := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "from-team-b"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
				NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "b"}},
				PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"role": "client"}},
			}}}},
		}}
	if _, err := cs.NetworkingV1().NetworkPolicies("a").Create(ctx, np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	admits := func(src string) bool {
		p := last().Policy
		return last().Isolated() && slices.ContainsFunc(p.Body, func(l string) bool { return strings.Contains(l, "-s "+src+"/32 ") })
	}
	waitFor(t, "the client pod of team b admitted", func() bool { return admits("10.2.0.5") })

	// The namespace loses its label: the client is no longer a peer.
	ns.Labels = nil
	if _, err := cs.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "isolated, admitting no one", func() bool { return last().Isolated() && !admits("10.2.0.5") })

	if err := cs.NetworkingV1().NetworkPolicies("a").Delete(ctx, np.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "not isolated once the policy is gone", func() bool { return !last().Isolated() && len(last().TunnelIPs) == 1 })
}

// recordingNode records what each node sync was asked to serve.
type recordingNode struct {
	mu     sync.Mutex
	served [][]PodTunnels
}

func (n *recordingNode) Sync(served []PodTunnels, _ netip.Addr) ([]NodeChange, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.served = append(n.served, served)
	return nil, nil
}

func (n *recordingNode) last() []PodTunnels {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.served) == 0 {
		return nil
	}
	return n.served[len(n.served)-1]
}

// TestControllerDualStack: a Service with a tunnel IP of each family is
// served to each local endpoint of that family: a dual-stack pod gets both,
// an IPv6-only pod (found by its IPv6 address) the IPv6 one; the node is
// handed both. When the IPv6 EndpointSlice goes, so does the IPv6 tunnel IP,
// and the IPv4 one stays.
func TestControllerDualStack(t *testing.T) {
	if _, err := tunnelclaim.ParseIPs("192.0.2.10, 2001:db8::10"); err != nil {
		t.Skipf("the annotation parser does not take two families yet: %v", err)
	}
	svc := tunnelService("a", "web", "192.0.2.10, 2001:db8::10", time.Hour)
	dual := dualPod("a", "dual", "n1", "10.1.0.11", "fd00:10:1::11")
	only6 := dualPod("a", "only6", "n1", "fd00:10:1::12")
	es4 := slice("a", "web", ep{"10.1.0.11", "n1", "dual", true})
	es6 := slice6("a", "web", ep{"fd00:10:1::11", "n1", "dual", true}, ep{"fd00:10:1::12", "n1", "only6", true})
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true, netip.MustParseAddr("fd00:10:1::12"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	node := &recordingNode{}
	client, _ := startControllerWith(t, loc, pods, node, nil, svc, dual, only6, es4, es6)
	last := func(pod string) PodTunnels {
		h := pods.history(pod)
		if len(h) == 0 {
			return PodTunnels{}
		}
		return h[len(h)-1]
	}
	waitFor(t, "both pods served", func() bool { return len(last("dual").TunnelIPs) == 2 && len(last("only6").TunnelIPs) == 1 })
	if got := last("dual"); !slices.Equal(got.TunnelIPs, []netip.Addr{vip1, v6vip1}) || got.Pod.IP != netip.MustParseAddr("10.1.0.11") || got.Pod.IPv6 != netip.MustParseAddr("fd00:10:1::11") {
		t.Fatalf("dual-stack pod: %+v", got)
	}
	if got := last("only6"); !slices.Equal(got.TunnelIPs, []netip.Addr{v6vip1}) || got.Pod.IP.IsValid() || got.Pod.IPv6 != netip.MustParseAddr("fd00:10:1::12") {
		t.Fatalf("IPv6-only pod: %+v", got)
	}
	waitFor(t, "the node handed both pods", func() bool { return len(node.last()) == 2 })

	if err := client.DiscoveryV1().EndpointSlices("a").Delete(context.Background(), es6.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the IPv6 tunnel IP removed", func() bool {
		return slices.Equal(last("dual").TunnelIPs, []netip.Addr{vip1}) && len(pods.history("only6")) >= 2 && len(last("only6").TunnelIPs) == 0
	})
}

// TestControllerFollowsPodIPs: a pod whose status.podIPs gain an IPv6
// address (its status.podIP unchanged) is served its IPv6 tunnel IP.
func TestControllerFollowsPodIPs(t *testing.T) {
	if _, err := tunnelclaim.ParseIPs("192.0.2.10, 2001:db8::10"); err != nil {
		t.Skipf("the annotation parser does not take two families yet: %v", err)
	}
	svc := tunnelService("a", "web", "192.0.2.10, 2001:db8::10", time.Hour)
	pod := dualPod("a", "p", "n1", "10.1.0.11")
	es4 := slice("a", "web", ep{"10.1.0.11", "n1", "p", true})
	es6 := slice6("a", "web", ep{"fd00:10:1::11", "n1", "p", true})
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	client := startController(t, loc, pods, svc, pod, es4, es6)
	last := func() PodTunnels {
		h := pods.history("p")
		if len(h) == 0 {
			return PodTunnels{}
		}
		return h[len(h)-1]
	}
	waitFor(t, "the IPv4 tunnel IP served", func() bool { return slices.Equal(last().TunnelIPs, []netip.Addr{vip1}) })
	pod = pod.DeepCopy()
	pod.Status.PodIPs = append(pod.Status.PodIPs, corev1.PodIP{IP: "fd00:10:1::11"})
	pod.ResourceVersion = "2"
	if _, err := client.CoreV1().Pods("a").UpdateStatus(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both tunnel IPs served", func() bool {
		return slices.Equal(last().TunnelIPs, []netip.Addr{vip1, v6vip1}) && last().Pod.IPv6 == netip.MustParseAddr("fd00:10:1::11")
	})
}

// TestRequeueWaitsBrieflyForAPodRoute: a sync that found no route to a
// served pod (Calico adds it after the pod runs) is retried on the short
// route wait, without growing the failure back-off (up to 2 minutes) that
// delayed a new pod's service by half a minute in the lab cluster; other
// failures back off; a success resets both.
func TestRequeueWaitsBrieflyForAPodRoute(t *testing.T) {
	client := fake.NewClientset()
	log := logrus.New()
	log.Out = io.Discard
	c, err := NewController(testConfig(encap.MPLS), NewInformers(client, "n1"), &fakeLocator{}, &fakePods{wants: map[string][]PodTunnels{}}, fakeNode{}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.queue.ShutDown()
	noRoute := errors.Join(fmt.Errorf("pod demo/echo-1: %w 10.244.120.133: <nil>", errNoPodRoute))
	for range 3 {
		c.requeue(nodeKey, noRoute)
	}
	if n := c.queue.NumRequeues(nodeKey); n != 0 {
		t.Errorf("after 3 syncs without the pod's route, the failure back-off counts %d requeues, want 0", n)
	}
	if n := c.routeWait.NumRequeues(nodeKey); n != 3 {
		t.Errorf("the route wait counts %d requeues, want 3", n)
	}
	c.requeue(nodeKey, errors.New("netlink: permission denied"))
	if n := c.queue.NumRequeues(nodeKey); n != 1 {
		t.Errorf("after another failure the back-off counts %d requeues, want 1", n)
	}
	c.requeue(nodeKey, nil)
	if a, b := c.queue.NumRequeues(nodeKey), c.routeWait.NumRequeues(nodeKey); a != 0 || b != 0 {
		t.Errorf("after a success: back-off %d, route wait %d requeues, want 0 and 0", a, b)
	}
}
