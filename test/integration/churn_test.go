package integration

import (
	"context"
	"fmt"
	"math/rand"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// Churn sizes: 1,000 Services, changed by churnWorkers goroutines at once,
// churnStepsPerService writes each on average; churnPods local pods of the
// endpoint agent's node back many of them.
const (
	churnServices        = 1000
	churnWorkers         = 6
	churnStepsPerService = 4
	churnPods            = 10
)

// TestChurnConvergesToFreshState creates, changes and deletes 1,000 tunnel
// Services and their EndpointSlices in random order from several goroutines
// at once (annotations moved to other tunnel IPs, to IPs other Services hold,
// to refused and invalid ones; endpoints added, removed and made not ready;
// Services deleted and created again) while the real router controller
// programs the real kernel of a test namespace and the real endpoint agent
// configures 10 pod namespaces. Once it settles:
//   - every tunnel IP's routes, rules and HMARK rule are exactly what the
//     final API objects ask for, computed here from them, and nothing refers
//     to a tunnel IP no surviving admitted Service claims;
//   - the kernel state is byte for byte the one a fresh router (a second
//     controller and datapath, into a second namespace) programs from the
//     final objects, but for the ids of the nexthop objects (each route's
//     object has the same content, and there is no other);
//   - each pod holds exactly the tunnel IPs it serves, and a fresh agent's
//     pod code finds nothing to change in any pod (no leftover device or
//     address);
//   - once stopped, the controllers leave no goroutine behind.
//
// The seed is logged; KST_CHURN_SEED replays a run.
func TestChurnConvergesToFreshState(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	ns := freshNamespace(t, cs)
	seed := time.Now().UnixNano()
	if s := os.Getenv("KST_CHURN_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseInt(s, 10, 64); err != nil {
			t.Fatalf("KST_CHURN_SEED=%q: %v", s, err)
		}
	}
	t.Logf("seed %d (KST_CHURN_SEED=%d replays this run)", seed, seed)

	pools, err := tunnelclaim.ParsePools("10.200.0.0/22=" + ns + ";10.201.0.0/24=" + ns)
	if err != nil {
		t.Fatal(err)
	}
	policy := tunnelclaim.Policy{Pools: pools}
	cfg := robustRouterCfg(policy)
	routerRest, agentRest := routerConfig(t), serviceAccountConfig(t, "tunnel-endpoint")

	// The endpoint agent's node and its pods, each in a named namespace.
	node := testnetns.New(t)
	nodeName := "churn-" + ns
	var pods []*corev1.Pod
	podNS := map[string]*podNetns{}
	for i := range churnPods {
		ip := netip.AddrFrom4([4]byte{198, 18, 40, byte(i + 1)})
		name := fmt.Sprintf("pod-%d", i)
		podNS[name] = newPodNetns(t, node, ip, fmt.Sprintf("veth-churn%d", i))
		pods = append(pods, createPod(t, cs, ns, name, nodeName, ip))
	}
	kr := newKernelRouter(t, cfg)
	t.Cleanup(func() { deleteAllServices(t, ns) })

	// Everything started from here on must be gone once stopped.
	leakBaseline := goleak.IgnoreCurrent()
	var tracker connTracker
	var routerWrites, agentWrites, churnWrites writeCounter
	rtr := runRouter(t, cfg, accounted(routerRest, &tracker, &routerWrites), kr.dp)
	agentCfg := endpoint.Config{Mode: encap.GRE, NodeName: nodeName, Device: endpoint.DefaultDevice,
		RouteProtocol: encap.DefaultRouteProtocol, ResyncPeriod: 2 * time.Second, Workers: 2, Policy: policy}
	agent := runAgent(t, agentCfg, accounted(agentRest, &tracker, &agentWrites), node)

	churnClient := kubernetes.NewForConfigOrDie(accounted(env.AdminConfig(), &tracker, &churnWrites))
	ch := &churn{t: t, cs: churnClient, ns: ns, nodeName: nodeName, pods: pods, holders: map[string]string{}}
	begin := time.Now()
	var wg sync.WaitGroup
	for w := range churnWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ch.run(rand.New(rand.NewSource(seed+int64(w))), w)
		}()
	}
	wg.Wait()
	churned := time.Now()
	t.Logf("churn: %d steps by %d goroutines in %v (%d Services created, %d deleted, %d annotation changes, %d slice changes, %d conflicts set up)",
		ch.steps.Load(), churnWorkers, churned.Sub(begin).Round(time.Millisecond), ch.created.Load(), ch.deleted.Load(),
		ch.annotated.Load(), ch.sliced.Load(), ch.collided.Load())
	if t.Failed() {
		t.FailNow()
	}

	// The desired state, computed here from the final objects, read through
	// a tracked connection too: the admin client's own connection may have
	// been closed as idle during a long churn, and the one it would dial now
	// would outlive the leak check.
	observer := kubernetes.NewForConfigOrDie(accounted(env.AdminConfig(), &tracker, nil))
	want := finalState(t, observer, ns, cfg, nodeName)
	t.Logf("final objects: %d tunnel IPs served (%d with a ready endpoint), %d Services whose claim lost a conflict, %d Services refused or invalid, %d of %d pods serving",
		len(want.tunnels), want.withReady, want.losers, want.unclaimed, len(want.pods), churnPods)
	if want.losers == 0 {
		t.Error("the churn produced no conflict: the test would not show how conflicts resolve")
	}

	var got programmed
	eventually(t, 10*time.Minute, "router kernel state equals the final desired state", func() error {
		got = kr.read(t, cfg)
		if d := got.diff(want.tunnels, cfg.Buckets); d != "" {
			return fmt.Errorf("\n%s", d)
		}
		return nil
	})
	routerConverged := time.Since(churned)
	eventually(t, 5*time.Minute, "every pod holds exactly the tunnel IPs it serves", func() error {
		for name, p := range podNS {
			if got, want := p.tunnelIPs(t), joinAddrs(want.pods[name]); got != want {
				return fmt.Errorf("pod %s holds %q, want %q", name, got, want)
			}
		}
		return nil
	})
	agentConverged := time.Since(churned)
	t.Logf("converged after the churn: router in %v, endpoint agent in %v", routerConverged.Round(time.Millisecond), agentConverged.Round(time.Millisecond))
	t.Logf("kernel: %d routes in %d bucket tables, %d bucket rules, %d HMARK rules; %d kernel writes by the router",
		got.routeCount, cfg.Buckets, got.rules, len(got.hmark), kr.dp.Ops())

	// A fresh router, from the same final objects, into a second namespace:
	// the same routes, through nexthop objects of the same content (their
	// ids depend on the order they were made in), and no other object.
	churnedState := withoutNextHopIDs(kr.state())
	fresh := newKernelRouter(t, cfg)
	freshRouter := runRouter(t, cfg, accounted(routerRest, &tracker, nil), fresh.dp)
	freshRouter.stop(t)
	if freshState := withoutNextHopIDs(fresh.state()); freshState != churnedState {
		t.Errorf("kernel state after the churn differs from a fresh router's:\n%s", lineDiff(churnedState, freshState))
	}

	// A fresh agent's pod code finds nothing to change in any pod.
	freshPods := endpoint.NewPodNetwork(agentCfg, node.Handle).WithDevice(testnetns.VXLANDecap{})
	for _, pod := range pods {
		ip := netip.MustParseAddr(pod.Status.PodIP)
		desired := endpoint.PodTunnels{Pod: runtime.Pod{Namespace: ns, Name: pod.Name, UID: string(pod.UID), IP: ip}, TunnelIPs: want.pods[pod.Name]}
		changes, err := freshPods.Sync(podNS[pod.Name].handle, desired)
		if err != nil || len(changes) != 0 {
			t.Errorf("pod %s after the churn: a fresh agent makes changes %v (%v): leftovers or missing state", pod.Name, changes, err)
		}
	}

	t.Logf("API writes: %d by the churn, %d by the router (Events), %d by the endpoint agent",
		churnWrites.n.Load(), routerWrites.n.Load(), agentWrites.n.Load())

	rtr.stop(t)
	agent.stop(t)
	closed := tracker.closeAll()
	leaks := findLeaks(leakBaseline)
	if leaks != nil {
		t.Errorf("goroutines left after stopping the controllers (and closing their %d API connections):\n%v", closed, leaks)
	}
	// The fresh router was stopped as soon as it was ready, with the keys
	// of every Service still queued (its informers' initial adds); see
	// TestChurnRouterIdleOnceRunReturns.
	t.Logf("datapath calls after router.Controller.Run returned: %d (churned router), %d (fresh router)", rtr.dp.calls.Load(), freshRouter.dp.calls.Load())
}

// gatedProgrammer is a recorder whose first SetTunnel or RemoveTunnel
// (the first change after the initial full sync) waits until release is
// closed, with entered closed meanwhile.
type gatedProgrammer struct {
	*recorder
	once             sync.Once
	entered, release chan struct{}
}

func (g *gatedProgrammer) wait() {
	g.once.Do(func() {
		close(g.entered)
		<-g.release
	})
}

func (g *gatedProgrammer) SetTunnel(t datapath.Tunnel) error {
	g.wait()
	return g.recorder.SetTunnel(t)
}

func (g *gatedProgrammer) RemoveTunnel(vip netip.Addr) error {
	g.wait()
	return g.recorder.RemoveTunnel(vip)
}

// TestChurnRouterIdleOnceRunReturns stops the router's controller while its
// worker is inside a datapath call, with the keys of its other Services
// (changed after its start) still queued: Run must not return before
// that call is over, and once it has returned the controller must not touch
// the datapath any more (a caller may then clean it up, or hand it to a new
// controller).
func TestChurnRouterIdleOnceRunReturns(t *testing.T) {
	cs := kubernetes.NewForConfigOrDie(accounted(env.AdminConfig(), &connTracker{}, nil))
	ns := freshNamespace(t, adminClient(t))
	t.Cleanup(func() { deleteAllServices(t, ns) })
	pools, err := tunnelclaim.ParsePools("10.220.0.0/24=" + ns)
	if err != nil {
		t.Fatal(err)
	}
	cfg := robustRouterCfg(tunnelclaim.Policy{Pools: pools})
	for i := range 50 {
		name := fmt.Sprintf("svc-%02d", i)
		createService(t, cs, ns, name, fmt.Sprintf("10.220.0.%d", i+1))
		applySlice(t, cs, ns, name, name+"-1", ep{addr: fmt.Sprintf("10.244.20.%d", i+1), node: "elsewhere"})
	}
	gate := &gatedProgrammer{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	r := runRouter(t, cfg, routerConfig(t), gate)
	// The informers' initial adds queue nothing (the initial resync covers
	// them): change the slices until the worker syncs one Service (the
	// gate holds it inside that datapath call), then once more, so that
	// the other Services' keys are queued behind it.
	touch := func(round int) {
		for i := range 50 {
			name := fmt.Sprintf("svc-%02d", i)
			applySlice(t, cs, ns, name, name+"-1", ep{addr: fmt.Sprintf("10.244.%d.%d", 20+round%200, i+1), node: "elsewhere"})
		}
	}
	deadline := time.After(time.Minute)
	round := 1
	for entered := false; !entered; round++ {
		touch(round)
		select {
		case <-gate.entered: // the worker is inside a datapath call
			entered = true
		case <-time.After(200 * time.Millisecond):
		case <-deadline:
			t.Fatal("the router synced no Service in a minute of changes")
		}
	}
	touch(round)
	r.cancel()
	select {
	case <-r.done:
		t.Errorf("router.Controller.Run returned while its worker was inside a datapath call (router.Controller.Run does not wait for the worker it starts)")
	case <-time.After(2 * time.Second): // Run is waiting for its worker
	}
	close(gate.release)
	r.stop(t)
	// The worker drains the queued keys after the call it was in.
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if n := r.dp.calls.Load(); n > 0 {
			t.Fatalf("%d datapath calls after router.Controller.Run returned: its worker goes on draining the queue after Run has returned", n)
		}
	}
}

// findLeaks retries goleak.Find for up to 30 s: goroutines of stopped
// informers and closed connections take a moment to return. Nothing is
// whitelisted: the baseline taken before the controllers started covers
// klog's flush daemon and the other process-wide goroutines.
func findLeaks(baseline goleak.Option) error {
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		if err = goleak.Find(baseline); err == nil {
			return nil
		}
	}
	return err
}

// churn is the shared state of the churn goroutines. Worker w owns the
// Services whose index is w modulo churnWorkers: no two goroutines write the
// same object (no write is lost to a conflict), while their tunnel IPs
// collide across goroutines.
type churn struct {
	t        *testing.T
	cs       kubernetes.Interface
	ns       string
	nodeName string
	pods     []*corev1.Pod

	mu      sync.Mutex
	holders map[string]string // Service name -> the tunnel IP it claims now, for deliberate conflicts

	steps, created, deleted, annotated, sliced, collided atomic.Int64
}

// churnService is what a worker knows of one of its Services.
type churnService struct {
	name   string
	exists bool
}

func (c *churn) run(rng *rand.Rand, w int) {
	var mine []*churnService
	for i := w; i < churnServices; i += churnWorkers {
		mine = append(mine, &churnService{name: fmt.Sprintf("svc-%04d", i)})
	}
	// Every Service is created once, in random order, interleaved with
	// changes to those that exist.
	toCreate := slices.Clone(mine)
	rng.Shuffle(len(toCreate), func(i, j int) { toCreate[i], toCreate[j] = toCreate[j], toCreate[i] })
	steps := len(mine) * churnStepsPerService
	for step := 0; step < steps && !c.t.Failed(); step++ {
		c.steps.Add(1)
		for len(toCreate) > 0 && toCreate[0].exists {
			toCreate = toCreate[1:] // created already, by a random pick below
		}
		if len(toCreate) > 0 && (rng.Intn(2) == 0 || step >= steps-len(toCreate)) {
			c.create(rng, toCreate[0])
			toCreate = toCreate[1:]
			continue
		}
		s := mine[rng.Intn(len(mine))]
		if !s.exists {
			c.create(rng, s)
			continue
		}
		switch r := rng.Intn(100); {
		case r < 30:
			c.writeSlice(rng, s.name)
		case r < 45:
			c.flipReadiness(rng, s.name)
		case r < 75:
			c.reannotate(rng, s.name)
		default:
			c.delete(rng, s)
		}
	}
}

func (c *churn) fail(format string, args ...any) {
	c.t.Errorf(format, args...)
}

// randomTunnelIP draws an annotation value: mostly from the two pools,
// sometimes an address held by another Service (a conflict), an address no
// pool admits, or no address at all.
func (c *churn) randomTunnelIP(rng *rand.Rand, self string) string {
	switch r := rng.Intn(100); {
	case r < 15:
		c.mu.Lock()
		defer c.mu.Unlock()
		for name, ip := range c.holders { // map order is random enough
			if name != self {
				c.collided.Add(1)
				return ip
			}
		}
		return "10.200.0.1"
	case r < 19:
		return fmt.Sprintf("10.202.0.%d", rng.Intn(250)+1) // in no pool: refused
	case r < 20:
		return "not-an-ip"
	case r < 35:
		return fmt.Sprintf("10.201.0.%d", rng.Intn(256))
	default:
		return fmt.Sprintf("10.200.%d.%d", rng.Intn(4), rng.Intn(256))
	}
}

func (c *churn) hold(name, ip string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ip == "" {
		delete(c.holders, name)
	} else {
		c.holders[name] = ip
	}
}

func (c *churn) create(rng *rand.Rand, s *churnService) {
	ip := c.randomTunnelIP(rng, s.name)
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: s.name, Annotations: map[string]string{tunnelclaim.Annotation: ip}},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": s.name},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	if _, err := c.cs.CoreV1().Services(c.ns).Create(context.Background(), svc, metav1.CreateOptions{}); err != nil {
		c.fail("create service %s: %v", s.name, err)
		return
	}
	s.exists = true
	c.created.Add(1)
	c.hold(s.name, ip)
	c.writeSlice(rng, s.name)
}

// randomEndpoints draws 0-4 endpoints: pods of the agent's node (by
// targetRef) or pods elsewhere, most of them ready, the others neither ready
// nor serving.
func (c *churn) randomEndpoints(rng *rand.Rand) []discoveryv1.Endpoint {
	var eps []discoveryv1.Endpoint
	for range rng.Intn(5) {
		ready := rng.Intn(5) != 0
		e := discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready), Serving: ptr(ready)}}
		if rng.Intn(10) < 3 {
			pod := c.pods[rng.Intn(len(c.pods))]
			e.Addresses = []string{pod.Status.PodIP}
			e.NodeName = ptr(c.nodeName)
			e.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID}
		} else {
			e.Addresses = []string{fmt.Sprintf("10.244.%d.%d", rng.Intn(16), rng.Intn(250)+1)}
			e.NodeName = ptr("elsewhere")
		}
		eps = append(eps, e)
	}
	return eps
}

// writeSlice gives the Service's EndpointSlice new random endpoints
// (creating it when missing).
func (c *churn) writeSlice(rng *rand.Rand, svc string) {
	ctx := context.Background()
	slices := c.cs.DiscoveryV1().EndpointSlices(c.ns)
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: c.ns, Name: svc + "-1", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
		Endpoints:   c.randomEndpoints(rng),
	}
	existing, err := slices.Get(ctx, es.Name, metav1.GetOptions{})
	switch {
	case err == nil:
		es.ResourceVersion = existing.ResourceVersion
		_, err = slices.Update(ctx, es, metav1.UpdateOptions{})
	case apierrors.IsNotFound(err):
		_, err = slices.Create(ctx, es, metav1.CreateOptions{})
	}
	if err != nil {
		c.fail("write endpointslice of %s: %v", svc, err)
		return
	}
	c.sliced.Add(1)
}

// flipReadiness makes one endpoint of the Service ready or not ready.
func (c *churn) flipReadiness(rng *rand.Rand, svc string) {
	ctx := context.Background()
	slices := c.cs.DiscoveryV1().EndpointSlices(c.ns)
	es, err := slices.Get(ctx, svc+"-1", metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		c.writeSlice(rng, svc)
		return
	}
	if err != nil {
		c.fail("get endpointslice of %s: %v", svc, err)
		return
	}
	if len(es.Endpoints) == 0 {
		c.writeSlice(rng, svc)
		return
	}
	e := &es.Endpoints[rng.Intn(len(es.Endpoints))]
	ready := e.Conditions.Ready == nil || !*e.Conditions.Ready
	e.Conditions.Ready, e.Conditions.Serving = ptr(ready), ptr(ready)
	if _, err := slices.Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		c.fail("update endpointslice of %s: %v", svc, err)
		return
	}
	c.sliced.Add(1)
}

// reannotate moves the Service to another tunnel IP, or drops its annotation.
func (c *churn) reannotate(rng *rand.Rand, svc string) {
	value, ip := "null", ""
	if rng.Intn(20) != 0 {
		ip = c.randomTunnelIP(rng, svc)
		value = strconv.Quote(ip)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, tunnelclaim.Annotation, value)
	if _, err := c.cs.CoreV1().Services(c.ns).Patch(context.Background(), svc, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		c.fail("annotate service %s: %v", svc, err)
		return
	}
	c.annotated.Add(1)
	c.hold(svc, ip)
}

// delete deletes the Service, and half the time its EndpointSlice too (an
// orphan slice must change nothing).
func (c *churn) delete(rng *rand.Rand, s *churnService) {
	ctx := context.Background()
	if err := c.cs.CoreV1().Services(c.ns).Delete(ctx, s.name, metav1.DeleteOptions{}); err != nil {
		c.fail("delete service %s: %v", s.name, err)
		return
	}
	s.exists = false
	c.deleted.Add(1)
	c.hold(s.name, "")
	if rng.Intn(2) == 0 {
		err := c.cs.DiscoveryV1().EndpointSlices(c.ns).Delete(ctx, s.name+"-1", metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			c.fail("delete endpointslice of %s: %v", s.name, err)
		}
	}
}

// desiredState is what the final objects ask of the router and the agent.
type desiredState struct {
	tunnels   map[netip.Addr][]string // tunnel IP -> next hop of each bucket
	pods      map[string][]netip.Addr // local pod name -> tunnel IPs, sorted
	withReady int                     // tunnel IPs with a ready endpoint
	losers    int                     // Services whose admitted claim lost to an older one
	unclaimed int                     // annotated Services refused by the pools or invalid
}

// finalState computes, from the API objects in ns, the tunnel IPs the router
// must serve and how (the oldest admitted claimant wins its tunnel IP; its
// ready endpoints share the buckets as bucket.Assign decides), and the
// tunnel IPs each pod of nodeName must hold (those of the winning Services
// it backs, whatever its readiness).
func finalState(t *testing.T, cs kubernetes.Interface, ns string, cfg router.Config, nodeName string) desiredState {
	t.Helper()
	ctx := context.Background()
	svcList, err := cs.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sliceList, err := cs.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nodeList, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var nodes []*corev1.Node
	for i := range nodeList.Items {
		nodes = append(nodes, &nodeList.Items[i])
	}
	known := cfg.Policy.Networks(nodes)
	d := desiredState{tunnels: map[netip.Addr][]string{}, pods: map[string][]netip.Addr{}}
	claimants := map[netip.Addr][]*corev1.Service{}
	for i := range svcList.Items {
		svc := &svcList.Items[i]
		value, ok := svc.Annotations[tunnelclaim.Annotation]
		if !ok {
			continue
		}
		vip, err := netip.ParseAddr(value)
		if err != nil || cfg.Policy.Pools.Admit(vip, ns, known) != nil {
			d.unclaimed++
			continue
		}
		claimants[vip] = append(claimants[vip], svc)
	}
	slicesOf := map[string][]discoveryv1.EndpointSlice{}
	for _, es := range sliceList.Items {
		svc := es.Labels[discoveryv1.LabelServiceName]
		slicesOf[svc] = append(slicesOf[svc], es)
	}
	podVIPs := map[string]map[netip.Addr]bool{}
	for vip, svcs := range claimants {
		tunnelclaim.Sort(svcs)
		d.losers += len(svcs) - 1
		winner := svcs[0]
		var ready []netip.Addr
		for _, es := range slicesOf[winner.Name] {
			for _, e := range es.Endpoints {
				addr := netip.MustParseAddr(e.Addresses[0])
				if (e.Conditions.Ready == nil || *e.Conditions.Ready) && !slices.Contains(ready, addr) {
					ready = append(ready, addr)
				}
				if e.NodeName != nil && *e.NodeName == nodeName && e.TargetRef != nil {
					if podVIPs[e.TargetRef.Name] == nil {
						podVIPs[e.TargetRef.Name] = map[netip.Addr]bool{}
					}
					podVIPs[e.TargetRef.Name][vip] = true
				}
			}
		}
		hops := make([]string, cfg.Buckets)
		if len(ready) == 0 {
			for b := range hops {
				hops[b] = "drop"
			}
		} else {
			d.withReady++
			for b, a := range bucket.Assign(cfg.Buckets, ready) {
				hops[b] = a.String()
			}
		}
		d.tunnels[vip] = hops
	}
	for pod, set := range podVIPs {
		for vip := range set {
			d.pods[pod] = append(d.pods[pod], vip)
		}
		slices.SortFunc(d.pods[pod], netip.Addr.Compare)
	}
	return d
}

// joinAddrs renders addresses as podNetns.tunnelIPs does: sorted as text.
func joinAddrs(addrs []netip.Addr) string {
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	slices.Sort(s)
	return strings.Join(s, ",")
}

// lineDiff lists the lines only one of two dumps has (at most 20 of each).
func lineDiff(a, b string) string {
	count := map[string]int{}
	for _, l := range strings.Split(a, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(b, "\n") {
		count[l]--
	}
	var onlyA, onlyB []string
	for l, n := range count {
		for ; n > 0 && len(onlyA) < 20; n-- {
			onlyA = append(onlyA, "- "+l)
		}
		for ; n < 0 && len(onlyB) < 20; n++ {
			onlyB = append(onlyB, "+ "+l)
		}
	}
	slices.Sort(onlyA)
	slices.Sort(onlyB)
	if len(onlyA)+len(onlyB) == 0 {
		return "(same lines, in another order)"
	}
	return strings.Join(append(onlyA, onlyB...), "\n")
}

// deleteAllServices deletes the test's Services and EndpointSlices, so that
// the package's later tests (whose routers list every Service) do not carry
// them.
func deleteAllServices(t *testing.T, ns string) {
	var tracker connTracker
	defer tracker.closeAll()
	cs := kubernetes.NewForConfigOrDie(accounted(env.AdminConfig(), &tracker, nil))
	ctx := context.Background()
	list, err := cs.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Errorf("cleanup: list services: %v", err)
		return
	}
	for _, svc := range list.Items {
		if err := cs.CoreV1().Services(ns).Delete(ctx, svc.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("cleanup: delete service %s: %v", svc.Name, err)
			return
		}
	}
	if err := cs.DiscoveryV1().EndpointSlices(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: labels.Everything().String()}); err != nil {
		t.Errorf("cleanup: delete endpointslices: %v", err)
	}
}
