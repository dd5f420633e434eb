package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// recorder is a Programmer that keeps the desired state the controller hands
// to the datapath.
type recorder struct {
	mu      sync.Mutex
	tunnels map[netip.Addr]datapath.Tunnel
	removed map[netip.Addr]int
}

func newRecorder() *recorder {
	return &recorder{tunnels: map[netip.Addr]datapath.Tunnel{}, removed: map[netip.Addr]int{}}
}

func (r *recorder) Resync(ts []datapath.Tunnel) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tunnels = map[netip.Addr]datapath.Tunnel{}
	for _, t := range ts {
		r.tunnels[t.VIP] = t
	}
	return nil
}

func (r *recorder) SetTunnel(t datapath.Tunnel) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tunnels[t.VIP] = t
	return nil
}

func (r *recorder) RemoveTunnel(vip netip.Addr) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.tunnels, vip)
	r.removed[vip]++
	return nil
}

func (r *recorder) get(vip string) (datapath.Tunnel, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.tunnels[netip.MustParseAddr(vip)]
	return t, ok
}

// startRouter runs the router's controller as its ServiceAccount until the
// test ends.
func startRouter(t *testing.T, cfg router.Config) *recorder {
	t.Helper()
	client, err := kubernetes.NewForConfig(routerConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	ctrl, _ := startController(t, client, cfg, "test-node", rec, nil, nil)
	eventually(t, 20*time.Second, "router ready (informers synced as the tunnel-router ServiceAccount)", func() error {
		if !ctrl.Ready() {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	return rec
}

// startController runs a router controller through client, recording its
// events as node (through wrap, when not nil), until the test ends or stop
// is called. setup, when not nil, wires the controller before its
// informers start and returns what runs beside it (a status publisher, an
// event gate, a ConfigMap watch); stop cancels them all and returns once
// every one of them and the controller have ended.
func startController(t *testing.T, client kubernetes.Interface, cfg router.Config, node string, dp router.Programmer,
	wrap func(record.EventRecorder) record.EventRecorder, setup func(*router.Controller) []func(context.Context)) (ctrl *router.Controller, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	factory := informers.NewSharedInformerFactory(client, 0)
	recorder := router.NewEventRecorder(ctx, client, "tunnel-router", node)
	if wrap != nil {
		recorder = wrap(recorder)
	}
	ctrl, err := router.NewController(cfg, client, factory, dp, recorder, quietLogger())
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	var beside []func(context.Context)
	if setup != nil {
		beside = setup(ctrl)
	}
	factory.Start(ctx.Done())
	var wg sync.WaitGroup
	for _, run := range beside {
		wg.Go(func() { run(ctx) })
	}
	done := make(chan error, 1)
	go func() { done <- ctrl.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			if err := <-done; err != nil {
				t.Errorf("controller of %s: %v", node, err)
			}
			factory.Shutdown()
		})
	}
	t.Cleanup(stop)
	return ctrl, stop
}

func routerCfg(mode encap.Mode, buckets int) router.Config {
	return router.Config{
		Config: datapath.Config{
			Mode: mode, Buckets: buckets, MarkOffset: datapath.DefaultMarkOffset, Seed: 7,
			RulePriority: datapath.DefaultRulePriority, TableBase: datapath.DefaultTableBase,
			RouteProtocol: encap.DefaultRouteProtocol, GREDevice: datapath.DefaultGREDevice, Chain: "KST-HMARK",
		},
		ResyncPeriod: time.Minute, Policy: testPolicy,
	}
}

// testPolicy admits the tunnel IPs the tests use (192.0.2.0/24), as the
// examples' and the lab's pool does.
var testPolicy = tunnelclaim.Policy{Pools: tunnelclaim.Pools{{Prefix: netip.MustParsePrefix("192.0.2.0/24")}}}

func createService(t *testing.T, cs kubernetes.Interface, ns, name, tunnelIP string) *corev1.Service {
	t.Helper()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Annotations: map[string]string{tunnelclaim.Annotation: tunnelIP}},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	out, err := cs.CoreV1().Services(ns).Create(context.Background(), svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

type ep struct {
	addr    string
	node    string
	ready   *bool
	serving *bool
	pod     *corev1.Pod // targetRef, as the EndpointSlice controller sets it
}

func applySlice(t *testing.T, cs kubernetes.Interface, ns, svc, name string, eps ...ep) {
	t.Helper()
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
	}
	for _, e := range eps {
		d := discoveryv1.Endpoint{Addresses: []string{e.addr}, Conditions: discoveryv1.EndpointConditions{Ready: e.ready, Serving: e.serving}}
		if e.node != "" {
			d.NodeName = ptr(e.node)
		}
		if e.pod != nil {
			d.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: e.pod.Namespace, Name: e.pod.Name, UID: e.pod.UID}
		}
		es.Endpoints = append(es.Endpoints, d)
	}
	ctx := context.Background()
	existing, err := cs.DiscoveryV1().EndpointSlices(ns).Get(ctx, name, metav1.GetOptions{})
	if err == nil {
		es.ResourceVersion = existing.ResourceVersion
		_, err = cs.DiscoveryV1().EndpointSlices(ns).Update(ctx, es, metav1.UpdateOptions{})
	} else {
		_, err = cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, es, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
}

func ptr[T any](v T) *T { return &v }

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func tableAddrs(t datapath.Tunnel) []netip.Addr {
	var out []netip.Addr
	for _, e := range t.Table {
		out = append(out, e.Addr)
	}
	return out
}

// waitTable waits until the tunnel of vip has exactly the table Assign gives
// for endpoints (nil endpoints: a tunnel that drops).
func waitTable(t *testing.T, rec *recorder, vip string, buckets int, endpoints []netip.Addr) datapath.Tunnel {
	t.Helper()
	want := bucket.Assign(buckets, endpoints)
	var got datapath.Tunnel
	eventually(t, 15*time.Second, "tunnel "+vip+" programmed with the expected table", func() error {
		tun, ok := rec.get(vip)
		if !ok {
			return fmt.Errorf("not programmed")
		}
		if !slices.Equal(tableAddrs(tun), want) {
			return fmt.Errorf("table %v, want %v", tableAddrs(tun), want)
		}
		got = tun
		return nil
	})
	return got
}

// waitRemoved waits until the tunnel of vip is no longer programmed.
func waitRemoved(t *testing.T, rec *recorder, vip, why string) {
	t.Helper()
	eventually(t, 15*time.Second, "tunnel "+vip+" removed "+why, func() error {
		if _, ok := rec.get(vip); ok {
			return fmt.Errorf("still programmed")
		}
		return nil
	})
}

// waitEvent waits for an event with reason on the Service whose message
// contains part.
func waitEvent(t *testing.T, cs kubernetes.Interface, svc *corev1.Service, eventType, reason, part string) {
	t.Helper()
	eventually(t, 15*time.Second, fmt.Sprintf("%s event %s on %s/%s", eventType, reason, svc.Namespace, svc.Name), func() error {
		evs, err := cs.CoreV1().Events(svc.Namespace).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + svc.Name})
		if err != nil {
			return err
		}
		var seen []string
		for _, e := range evs.Items {
			if e.Type == eventType && e.Reason == reason && strings.Contains(e.Message, part) && e.InvolvedObject.UID == svc.UID {
				return nil
			}
			seen = append(seen, e.Type+"/"+e.Reason+": "+e.Message)
		}
		return fmt.Errorf("seen %q", seen)
	})
}

func TestRouterProgramsAnnotatedServices(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 64))
	ns := freshNamespace(t, cs)

	svc := createService(t, cs, ns, "web", "192.0.2.10")
	waitEvent(t, cs, svc, corev1.EventTypeWarning, router.ReasonNoReadyEndpoints, "192.0.2.10")
	if tun := waitTable(t, rec, "192.0.2.10", 64, nil); tun.Table != nil {
		t.Fatalf("tunnel without endpoints has a table: %v", tun.Table)
	}

	applySlice(t, cs, ns, "web", "web-a",
		ep{addr: "10.244.1.5", node: "node-1", ready: ptr(true)},
		ep{addr: "10.244.1.6", node: "node-1"}, // nil ready counts as ready
		ep{addr: "10.244.2.7", node: "node-2", ready: ptr(false)},
	)
	applySlice(t, cs, ns, "web", "web-b", ep{addr: "10.244.2.8", node: "node-2", ready: ptr(true)})
	before := waitTable(t, rec, "192.0.2.10", 64, addrs("10.244.1.5", "10.244.1.6", "10.244.2.8"))
	waitEvent(t, cs, svc, corev1.EventTypeNormal, router.ReasonProgrammed, "3 endpoints over 64 buckets")

	// One endpoint goes away: its buckets move, the table matches Assign.
	applySlice(t, cs, ns, "web", "web-b")
	after := waitTable(t, rec, "192.0.2.10", 64, addrs("10.244.1.5", "10.244.1.6"))
	for b := range before.Table {
		if before.Table[b].Addr.String() != "10.244.2.8" && after.Table[b] != before.Table[b] {
			t.Logf("bucket %d moved from %v to %v (balance move)", b, before.Table[b].Addr, after.Table[b].Addr)
		}
	}

	// Removing the annotation removes the tunnel.
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:null}}}`, tunnelclaim.Annotation)
	if _, err := cs.CoreV1().Services(ns).Patch(context.Background(), "web", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRemoved(t, rec, "192.0.2.10", "with its annotation")
}

func TestRouterBadInputKeepsOtherServicesWorking(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 64))
	ns := freshNamespace(t, cs)

	good := createService(t, cs, ns, "good", "192.0.2.20")
	applySlice(t, cs, ns, "good", "good-a", ep{addr: "10.244.1.9", node: "node-1"})
	for name, value := range map[string]string{
		"not-ip":    "not-an-ip",
		"several":   "192.0.2.21,192.0.2.22",
		"space":     "192.0.2.23 192.0.2.24",
		"loopback":  "127.0.0.1",
		"linklocal": "169.254.0.1",
		"multicast": "224.0.0.5",
		"zero":      "0.0.0.0",
		"two-v6":    "2001:db8::1, 2001:db8::2",
		"mapped":    "::ffff:192.0.2.25",
		"v6-ll":     "192.0.2.26, fe80::1",
	} {
		svc := createService(t, cs, ns, name, value)
		waitEvent(t, cs, svc, corev1.EventTypeWarning, router.ReasonInvalidTunnelIP, tunnelclaim.Annotation)
	}
	// A slice with broken entries: the good ones still count.
	applySlice(t, cs, ns, "good", "good-b", ep{addr: "10.244.1.10"}, ep{addr: "10.244.1.11", node: "node-1", ready: ptr(false)})
	waitTable(t, rec, "192.0.2.20", 64, addrs("10.244.1.9", "10.244.1.10"))
	waitEvent(t, cs, good, corev1.EventTypeNormal, router.ReasonProgrammed, "2 endpoints")
	rec.mu.Lock()
	for vip := range rec.tunnels {
		if vip.String() != "192.0.2.20" && strings.HasPrefix(vip.String(), "192.0.2.2") {
			t.Errorf("a bad annotation produced tunnel %v", vip)
		}
	}
	rec.mu.Unlock()
}

func TestRouterConflictOldestWins(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 64))
	ns := freshNamespace(t, cs)

	older := createService(t, cs, ns, "older", "192.0.2.30")
	applySlice(t, cs, ns, "older", "older-a", ep{addr: "10.244.3.1", node: "node-1"})
	waitTable(t, rec, "192.0.2.30", 64, addrs("10.244.3.1"))
	time.Sleep(1100 * time.Millisecond) // creationTimestamp has one-second resolution
	newer := createService(t, cs, ns, "newer", "192.0.2.30")
	applySlice(t, cs, ns, "newer", "newer-a", ep{addr: "10.244.3.2", node: "node-2"})
	waitEvent(t, cs, newer, corev1.EventTypeWarning, router.ReasonConflict, ns+"/older")
	waitTable(t, rec, "192.0.2.30", 64, addrs("10.244.3.1"))

	if err := cs.CoreV1().Services(ns).Delete(context.Background(), older.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTable(t, rec, "192.0.2.30", 64, addrs("10.244.3.2"))
	waitEvent(t, cs, newer, corev1.EventTypeNormal, router.ReasonProgrammed, "192.0.2.30")

	// Deleting the last Service that claims the IP removes the tunnel.
	if err := cs.CoreV1().Services(ns).Delete(context.Background(), newer.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRemoved(t, rec, "192.0.2.30", "with its last Service")
}

func TestRouterMoreEndpointsThanBuckets(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 4))
	ns := freshNamespace(t, cs)
	svc := createService(t, cs, ns, "wide", "192.0.2.40")
	var eps []ep
	var all []netip.Addr
	for i := 1; i <= 6; i++ {
		a := fmt.Sprintf("10.244.4.%d", i)
		eps = append(eps, ep{addr: a, node: "node-1"})
		all = append(all, netip.MustParseAddr(a))
	}
	applySlice(t, cs, ns, "wide", "wide-a", eps...)
	tun := waitTable(t, rec, "192.0.2.40", 4, all)
	idle := bucket.Unassigned(tableAddrs(tun), all)
	// 6 endpoints over 4 buckets: at least 2 own none.
	if len(idle) < 2 {
		t.Fatalf("idle endpoints %v, want at least 2", idle)
	}
	waitEvent(t, cs, svc, corev1.EventTypeWarning, router.ReasonIdleEndpoints, idle[0].String())
}

func TestRouterMPLSUsesNodeAddresses(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.MPLS, 16))
	ns := freshNamespace(t, cs)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "mpls-node-" + ns}}
	node, err := cs.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "172.16.0.11"}}
	if _, err := cs.CoreV1().Nodes().UpdateStatus(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	createService(t, cs, ns, "mpls", "192.0.2.50")
	applySlice(t, cs, ns, "mpls", "mpls-a",
		ep{addr: "10.244.5.1", node: node.Name},
		ep{addr: "10.244.5.2"}, // no nodeName: unusable in mpls mode
	)
	tun := waitTable(t, rec, "192.0.2.50", 16, addrs("10.244.5.1"))
	for b, e := range tun.Table {
		if e.NodeIP != netip.MustParseAddr("172.16.0.11") {
			t.Fatalf("bucket %d: node address %v, want 172.16.0.11", b, e.NodeIP)
		}
	}
}

// presentAddrs lists the endpoints a tunnel keeps for established flows,
// and which of them drain.
func presentAddrs(t datapath.Tunnel) (present, draining []string) {
	for _, ep := range t.Present {
		present = append(present, ep.Addr.String())
		if ep.Draining {
			draining = append(draining, ep.Addr.String())
		}
	}
	return present, draining
}

// A terminating endpoint (serving, not ready) and a Pod annotated
// cmd.nu/tunnel-drain=true get no bucket but stay present for their
// established flows; removing the annotation gives the pod buckets again.
// The router watches Pods as its own ServiceAccount (RBAC: pods list/watch).
func TestRouterDrainsTerminatingAndAnnotatedEndpoints(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 64))
	ns := freshNamespace(t, cs)
	svc := createService(t, cs, ns, "web", "192.0.2.77")
	a := createPod(t, cs, ns, "web-a", "node-1", netip.MustParseAddr("10.244.1.5"))
	b := createPod(t, cs, ns, "web-b", "node-1", netip.MustParseAddr("10.244.1.6"))
	c := createPod(t, cs, ns, "web-c", "node-2", netip.MustParseAddr("10.244.2.7"))
	slice := func(cReady bool) {
		cEP := ep{addr: "10.244.2.7", node: "node-2", ready: ptr(true), pod: c}
		if !cReady {
			cEP.ready, cEP.serving = ptr(false), ptr(true)
		}
		applySlice(t, cs, ns, "web", "web-1",
			ep{addr: "10.244.1.5", node: "node-1", ready: ptr(true), pod: a},
			ep{addr: "10.244.1.6", node: "node-1", ready: ptr(true), pod: b},
			cEP)
	}
	slice(true)
	waitTable(t, rec, "192.0.2.77", 64, addrs("10.244.1.5", "10.244.1.6", "10.244.2.7"))

	// c terminates: serving, not ready.
	slice(false)
	tun := waitTable(t, rec, "192.0.2.77", 64, addrs("10.244.1.5", "10.244.1.6"))
	present, draining := presentAddrs(tun)
	if !slices.Equal(present, []string{"10.244.1.5", "10.244.1.6", "10.244.2.7"}) || !slices.Equal(draining, []string{"10.244.2.7"}) {
		t.Fatalf("present %v draining %v; want the terminating pod present and draining", present, draining)
	}
	waitEvent(t, cs, svc, corev1.EventTypeNormal, router.ReasonProgrammed, "1 draining")

	// An operator drains b with the annotation, then undrains it.
	annotate := func(value *string) {
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{router.DrainAnnotation: value}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cs.CoreV1().Pods(ns).Patch(context.Background(), "web-b", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	annotate(ptr("true"))
	tun = waitTable(t, rec, "192.0.2.77", 64, addrs("10.244.1.5"))
	if _, draining := presentAddrs(tun); !slices.Equal(draining, []string{"10.244.1.6", "10.244.2.7"}) {
		t.Fatalf("draining %v; want the annotated and the terminating pod", draining)
	}
	annotate(nil)
	waitTable(t, rec, "192.0.2.77", 64, addrs("10.244.1.5", "10.244.1.6"))

	// Every endpoint draining: new flows go to the draining ones.
	annotate(ptr("true"))
	applySlice(t, cs, ns, "web", "web-1",
		ep{addr: "10.244.1.6", node: "node-1", ready: ptr(true), pod: b},
		ep{addr: "10.244.2.7", node: "node-2", ready: ptr(false), serving: ptr(true), pod: c})
	waitTable(t, rec, "192.0.2.77", 64, addrs("10.244.1.6", "10.244.2.7"))
	waitEvent(t, cs, svc, corev1.EventTypeWarning, router.ReasonNoReadyEndpoints, "draining endpoints")
}

// TestRouterLeavesOutAnotherNamespacesPod: a hand-written EndpointSlice
// whose endpoint names a Pod of another namespace (the CVE-2021-25740
// class: a selector-less Service reaching into kube-system) gets no bucket
// and a Warning event naming the slice, while the Service's own pod is
// served.
func TestRouterLeavesOutAnotherNamespacesPod(t *testing.T) {
	cs := adminClient(t)
	rec := startRouter(t, routerCfg(encap.GRE, 8))
	ns, victimNS := freshNamespace(t, cs), freshNamespace(t, cs)
	svc := createService(t, cs, ns, "grab", "192.0.2.45")
	own := createPod(t, cs, ns, "own-1", "node-1", netip.MustParseAddr("10.244.6.1"))
	victim := createPod(t, cs, victimNS, "coredns-1", "node-1", netip.MustParseAddr("10.244.6.2"))
	applySlice(t, cs, ns, "grab", "grab-a",
		ep{addr: "10.244.6.1", node: "node-1", pod: own},
		ep{addr: "10.244.6.2", node: "node-1", pod: victim})
	waitTable(t, rec, "192.0.2.45", 8, addrs("10.244.6.1"))
	waitEvent(t, cs, svc, corev1.EventTypeWarning, router.ReasonForeignEndpoint,
		"EndpointSlice "+ns+"/grab-a: endpoints[1] names pod "+victimNS+"/coredns-1 of another namespace")
}
