package endpoint

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// flakyNode fails every node sync while failing is set.
type flakyNode struct{ failing atomic.Bool }

func (f *flakyNode) Sync([]PodTunnels, netip.Addr) ([]NodeChange, error) {
	if f.failing.Load() {
		return nil, errors.New("the node's namespace cannot be written")
	}
	return nil, nil
}

// gatedPod is a pod of the Service web (app=web) that lists the gate.
func gatedPod(name, ip string, app string) *corev1.Pod {
	p := testPod("a", name, "n1", ip)
	p.Labels = map[string]string{"app": app}
	p.Spec.ReadinessGates = []corev1.PodReadinessGate{{ConditionType: ReadinessGate}}
	return p
}

// condition returns the pod's gate condition as the API has it (nil: none).
func condition(t *testing.T, client *fake.Clientset, name string) *corev1.PodCondition {
	t.Helper()
	p, err := client.CoreV1().Pods("a").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range p.Status.Conditions {
		if c.Type == ReadinessGate {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// A pod that lists the readiness gate becomes ready only once its tunnel
// IPs are in place: not while no EndpointSlice lists it for a tunnel
// Service that selects it, not while its namespace cannot be found, not
// while the node's namespace fails; a gated pod that no tunnel Service
// selects opens at once, and a pod without the gate is never written.
func TestReadinessGateOpensOnceTheTunnelIPsAreInPlace(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	svc.Spec.Selector = map[string]string{"app": "web"}
	fresh := gatedPod("fresh", "10.1.0.11", "web")
	other := gatedPod("other", "10.1.0.12", "other")
	plain := testPod("a", "plain", "n1", "10.1.0.13")
	plain.Labels = map[string]string{"app": "web"}
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.12"): true, netip.MustParseAddr("10.1.0.13"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	node := &flakyNode{}
	node.failing.Store(true)
	client := fake.NewClientset(svc, fresh, other, plain)
	startGated(t, client, loc, pods, node)
	ctx := context.Background()

	// other: no tunnel Service selects it, so nothing waits.
	waitFor(t, "the gate of a pod no tunnel Service selects", func() bool { return condition(t, client, "other") != nil })
	if c := condition(t, client, "other"); c.Status != corev1.ConditionTrue || c.Reason != reasonTunnelIPsInPlace {
		t.Fatalf("other's condition: %+v", c)
	}

	// fresh: selected by web, not listed by any slice yet.
	waitFor(t, "fresh looked up", func() bool { return loc.count("fresh") > 0 || len(pods.history("fresh")) > 0 })
	time.Sleep(300 * time.Millisecond)
	if c := condition(t, client, "fresh"); c != nil {
		t.Fatalf("fresh's gate opened before any EndpointSlice listed it: %+v", c)
	}
	// Listed, but its namespace is not found yet.
	es := slice("a", "web", ep{"10.1.0.11", "n1", "fresh", false})
	if _, err := client.DiscoveryV1().EndpointSlices("a").Create(ctx, es, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "fresh retried", func() bool { return loc.count("fresh") >= 2 })
	if c := condition(t, client, "fresh"); c != nil {
		t.Fatalf("fresh's gate opened before its namespace held the tunnel IP: %+v", c)
	}
	// Its namespace appears; the node's still fails.
	loc.setFound(netip.MustParseAddr("10.1.0.11"))
	waitFor(t, "fresh configured", func() bool {
		h := pods.history("fresh")
		return len(h) > 0 && len(h[len(h)-1].TunnelIPs) == 1
	})
	time.Sleep(300 * time.Millisecond)
	if c := condition(t, client, "fresh"); c != nil {
		t.Fatalf("fresh's gate opened while the node's namespace was not converged: %+v", c)
	}
	node.failing.Store(false)
	waitFor(t, "fresh's gate", func() bool { return condition(t, client, "fresh") != nil })
	c := condition(t, client, "fresh")
	if c.Status != corev1.ConditionTrue || !strings.Contains(c.Message, "192.0.2.10") {
		t.Fatalf("fresh's condition: %+v", c)
	}
	// The pod without the gate is served but never written.
	if c := condition(t, client, "plain"); c != nil {
		t.Fatalf("a pod without the gate got the condition %+v", c)
	}
	// Each gate is written once, whatever syncs the pod again.
	for i := range 3 {
		p, err := client.CoreV1().Pods("a").Get(ctx, "other", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Annotations = map[string]string{"touched": fmt.Sprint(i)}
		if _, err := client.CoreV1().Pods("a").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(300 * time.Millisecond)
	patches := map[string]int{}
	for _, a := range client.Actions() {
		if p, ok := a.(k8stesting.PatchAction); ok && a.GetSubresource() == "status" {
			patches[p.GetName()]++
		}
	}
	if patches["other"] != 1 || patches["fresh"] != 1 || patches["plain"] != 0 {
		t.Errorf("status patches by pod %v, want one each of other and fresh, none of plain", patches)
	}
}

// Unlisted names the tunnel IPs a gated pod waits for: only of Services
// that select it, in its namespace, of a family it has an address of.
func TestUnlisted(t *testing.T) {
	web := tunnelService("a", "web", "192.0.2.10", time.Hour)
	web.Spec.Selector = map[string]string{"app": "web"}
	web6 := tunnelService("a", "web6", "2001:db8::10", time.Hour)
	web6.Spec.Selector = map[string]string{"app": "web"}
	elsewhere := tunnelService("b", "web", "192.0.2.11", time.Hour)
	elsewhere.Spec.Selector = map[string]string{"app": "web"}
	pod := gatedPod("fresh", "10.1.0.11", "web")
	remote := gatedPod("remote", "10.1.0.12", "web")
	remote.Spec.NodeName = "n2"
	services := []*corev1.Service{web, web6, elsewhere}
	pods := []*corev1.Pod{pod, remote}

	got := Unlisted("n1", testPools, tunnelclaim.Networks{}, services, pods, nil)
	if want := []netip.Addr{vip1}; len(got) != 1 || !slices.Equal(got["a/fresh"], want) {
		t.Fatalf("Unlisted with nothing served = %v, want a/fresh: %v (no IPv6 address: not web6's)", got, want)
	}
	served := map[string]PodTunnels{"a/fresh": {Pod: runtimePod(pod), TunnelIPs: []netip.Addr{vip1}}}
	if got := Unlisted("n1", testPools, tunnelclaim.Networks{}, services, pods, served); len(got["a/fresh"]) != 0 {
		t.Fatalf("Unlisted once served = %v, want nothing", got)
	}
	pod.Spec.ReadinessGates = nil
	if got := Unlisted("n1", testPools, tunnelclaim.Networks{}, services, pods, nil); len(got) != 0 {
		t.Fatalf("Unlisted without the gate = %v, want nothing", got)
	}
}

// startGated runs a controller that writes the readiness gates through
// client.
func startGated(t *testing.T, client *fake.Clientset, loc *fakeLocator, pods PodSyncer, node NodeSyncer) *Controller {
	t.Helper()
	return runController(t, client, testConfig(encap.GRE), loc, pods, node, func(c *Controller) {
		c.SetConditionWriter(APIConditionWriter{Client: client})
	})
}

// A gated pod's address may come after the agent last computed the
// desired state: that computation saw no address, so no tunnel Service
// seemed to select it. The gate stays closed until a computation has seen
// the pod as it is now (found in the lab cluster: gates opened 7-8 s
// before the pods' tunnel IPs were in place, and SYNs were lost).
func TestReadinessGateWaitsForTheComputationThatSawThePodsAddress(t *testing.T) {
	noAddress := gatedPod("late", "", "web")
	addressed := gatedPod("late", "10.1.0.11", "web")
	key := "a/late"
	c := &Controller{
		gateViews: map[string]string{key: gateView(noAddress)},
		podDone:   map[string]PodTunnels{key: {Pod: runtimePod(addressed)}},
		nodeDone:  map[string]PodTunnels{},
		desired:   map[string]PodTunnels{},
	}
	if why := c.gateBlocker(addressed, PodTunnels{Pod: runtimePod(addressed)}); !strings.Contains(why, "current addresses") {
		t.Fatalf("gate blocker for a pod the computation saw without an address = %q, want it to wait", why)
	}
	// The next computation sees the address and a Service selecting it.
	c.gateViews[key] = gateView(addressed)
	c.unlisted = map[string][]netip.Addr{key: {vip1}}
	if why := c.gateBlocker(addressed, PodTunnels{Pod: runtimePod(addressed)}); !strings.Contains(why, "EndpointSlices") {
		t.Fatalf("gate blocker once seen = %q, want it to wait for the slices", why)
	}
	c.unlisted = nil
	if why := c.gateBlocker(addressed, PodTunnels{Pod: runtimePod(addressed)}); why != "" {
		t.Fatalf("gate blocker with nothing left to wait for = %q", why)
	}
	// A pod of the same name but another UID is another pod.
	recreated := addressed.DeepCopy()
	recreated.UID = "uid-late-2"
	if why := c.gateBlocker(recreated, PodTunnels{Pod: runtimePod(recreated)}); why == "" {
		t.Fatal("the gate of a recreated pod opened on what the computation saw of its predecessor")
	}
}

// The same through the controller: a gated pod created before its address,
// selected by a tunnel Service, keeps its gate closed once the address
// arrives, until an EndpointSlice lists it.
func TestReadinessGateOfAPodAddressedLate(t *testing.T) {
	svc := tunnelService("a", "web", "192.0.2.10", time.Hour)
	svc.Spec.Selector = map[string]string{"app": "web"}
	late := gatedPod("late", "", "web")
	late.Status.Phase = corev1.PodPending
	loc := &fakeLocator{found: map[netip.Addr]bool{netip.MustParseAddr("10.1.0.11"): true}, lookups: map[string]int{}}
	pods := &fakePods{wants: map[string][]PodTunnels{}}
	client := fake.NewClientset(svc, late)
	startGated(t, client, loc, pods, &flakyNode{})
	ctx := context.Background()
	time.Sleep(200 * time.Millisecond)
	for i := range 5 {
		p, err := client.CoreV1().Pods("a").Get(ctx, "late", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status.Phase = corev1.PodRunning
		p.Status.PodIP = "10.1.0.11"
		p.Annotations = map[string]string{"touched": fmt.Sprint(i)}
		if _, err := client.CoreV1().Pods("a").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	if c := condition(t, client, "late"); c != nil {
		t.Fatalf("late's gate opened before any EndpointSlice listed it: %+v", c)
	}
	es := slice("a", "web", ep{"10.1.0.11", "n1", "late", false})
	if _, err := client.DiscoveryV1().EndpointSlices("a").Create(ctx, es, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "late's gate", func() bool { return condition(t, client, "late") != nil })
	if c := condition(t, client, "late"); c.Status != corev1.ConditionTrue || !strings.Contains(c.Message, "192.0.2.10") {
		t.Fatalf("late's condition: %+v", c)
	}
}
