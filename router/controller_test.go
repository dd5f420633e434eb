package router

import (
	"context"
	"errors"
	"fmt"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// fakeProgrammer keeps the tunnels the controller asks for; while fail is
// set, every call fails with it and changes nothing.
type fakeProgrammer struct {
	tunnels     map[netip.Addr]datapath.Tunnel
	fail        error
	collections int  // CollectGenerations calls
	ipv4Only    bool // the datapath serves IPv4 tunnel IPs only (--ipv6=false)
}

func (f *fakeProgrammer) Serves(vip netip.Addr) bool { return vip.Is4() || !f.ipv4Only }

func (f *fakeProgrammer) CollectGenerations() (int, error) {
	f.collections++
	return 0, f.fail
}

func (f *fakeProgrammer) Resync(ts []datapath.Tunnel) error {
	if f.fail != nil {
		return f.fail
	}
	f.tunnels = map[netip.Addr]datapath.Tunnel{}
	for _, t := range ts {
		if !f.Serves(t.VIP) {
			return fmt.Errorf("tunnel %v: no IPv6 datapath", t.VIP)
		}
		f.tunnels[t.VIP] = t
	}
	return nil
}

func (f *fakeProgrammer) SetTunnel(t datapath.Tunnel) error {
	if f.fail != nil {
		return f.fail
	}
	if !f.Serves(t.VIP) {
		return fmt.Errorf("tunnel %v: no IPv6 datapath", t.VIP)
	}
	f.tunnels[t.VIP] = t
	return nil
}

func (f *fakeProgrammer) RemoveTunnel(vip netip.Addr) error {
	if f.fail != nil {
		return f.fail
	}
	delete(f.tunnels, vip)
	return nil
}

// served lists the programmed tunnel IPs and the endpoint each one's bucket
// 0 goes to, "vip>endpoint", sorted.
func (f *fakeProgrammer) served() string {
	var out []string
	for vip, t := range f.tunnels {
		ep := "-"
		if len(t.Table) > 0 {
			ep = t.Table[0].Addr.String()
		}
		out = append(out, vip.String()+">"+ep)
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// testController builds a controller on a fake clientset whose informer
// indexers the test seeds by hand; nothing runs in the background.
type testController struct {
	*Controller
	dp     *fakeProgrammer
	events *record.FakeRecorder
	inf    informers.SharedInformerFactory
	client *fake.Clientset
}

func newTestController(t *testing.T, pools string) *testController {
	t.Helper()
	cfg := Config{Config: datapath.DefaultConfig()}
	cfg.Buckets, cfg.Seed = 8, 1
	p, err := tunnelclaim.ParsePools(pools)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Policy = tunnelclaim.Policy{Pools: p, ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}}
	client := fake.NewClientset()
	inf := informers.NewSharedInformerFactory(client, 0)
	dp := &fakeProgrammer{tunnels: map[netip.Addr]datapath.Tunnel{}}
	events := record.NewFakeRecorder(100)
	c, err := NewController(cfg, client, inf, dp, events, seamtest.QuietLog())
	if err != nil {
		t.Fatal(err)
	}
	return &testController{Controller: c, dp: dp, events: events, inf: inf, client: client}
}

func (tc *testController) add(t *testing.T, objs ...any) {
	t.Helper()
	for _, obj := range objs {
		var err error
		switch o := obj.(type) {
		case *corev1.Service:
			err = tc.inf.Core().V1().Services().Informer().GetIndexer().Add(o)
		case *discoveryv1.EndpointSlice:
			err = tc.inf.Discovery().V1().EndpointSlices().Informer().GetIndexer().Add(kubeobj.NewEndpointSlice(o)) // as the informer's transform stores it
		case *corev1.Node:
			err = tc.inf.Core().V1().Nodes().Informer().GetIndexer().Add(o)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// drain returns the events recorded so far.
func (tc *testController) drain() []string {
	var out []string
	for {
		select {
		case e := <-tc.events.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

var created = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func tunnelSvc(ns, name, vip string, age time.Duration) *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(created.Add(-age)),
		Annotations: map[string]string{tunnelclaim.Annotation: vip}}}
}

func oneEndpoint(ns, svc, addr string) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: svc + "-1", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{addr}}},
	}
}

func hasEvent(events []string, part string) bool {
	return slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, part) })
}

func TestControllerRefusesTunnelIPsOutsideThePools(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24;203.0.113.0/28=team-a")
	tc.add(t,
		tunnelSvc("web", "inside", "192.0.2.10", time.Hour), oneEndpoint("web", "inside", "10.244.1.5"),
		tunnelSvc("web", "outside", "198.51.100.7", time.Hour), oneEndpoint("web", "outside", "10.244.1.6"),
		tunnelSvc("web", "services", "10.96.0.10", time.Hour),
		tunnelSvc("team-b", "limited", "203.0.113.5", time.Hour), oneEndpoint("team-b", "limited", "10.244.1.7"),
		tunnelSvc("team-a", "allowed", "203.0.113.6", time.Hour), oneEndpoint("team-a", "allowed", "10.244.1.8"),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5 203.0.113.6>10.244.1.8"; got != want {
		t.Fatalf("served %q, want %q", got, want)
	}
	events := tc.drain()
	for _, want := range []string{
		"Warning TunnelIPRefused tunnel IP 198.51.100.7 is in no address pool (--pools 192.0.2.0/24;203.0.113.0/28=team-a)",
		"Warning TunnelIPRefused tunnel IP 10.96.0.10 is inside the service network 10.96.0.0/12 (--service-cidr)",
		"Warning TunnelIPRefused tunnel IP 203.0.113.5 is in address pool 203.0.113.0/28, which only namespaces team-a may use, not team-b",
		"Normal TunnelProgrammed tunnel IP 192.0.2.10 programmed",
	} {
		if !hasEvent(events, want) {
			t.Errorf("no event %q in %q", want, events)
		}
	}
	// A resync repeats no event.
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if again := tc.drain(); len(again) != 0 {
		t.Errorf("resync recorded %q again", again)
	}
}

// An older Service whose tunnel IP is refused must not win the IP from a
// newer admitted one, nor make it a conflict loser.
func TestControllerRefusedServiceTakesNoPartInConflicts(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24=team-a")
	tc.add(t,
		tunnelSvc("team-b", "older", "192.0.2.10", 2*time.Hour), oneEndpoint("team-b", "older", "10.244.1.5"),
		tunnelSvc("team-a", "newer", "192.0.2.10", time.Hour), oneEndpoint("team-a", "newer", "10.244.1.6"),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.6"; got != want {
		t.Fatalf("served %q, want %q (the admitted Service)", got, want)
	}
	events := tc.drain()
	if hasEvent(events, ReasonConflict) {
		t.Errorf("a refused Service caused a conflict: %q", events)
	}
	if !hasEvent(events, "Warning TunnelIPRefused tunnel IP 192.0.2.10 is in address pool 192.0.2.0/24, which only namespaces team-a may use, not team-b") {
		t.Errorf("no refusal event in %q", events)
	}
	// Its later updates are refused the same way.
	if err := tc.syncService("team-b/older"); err != nil {
		t.Fatal(err)
	}
	if got := tc.dp.served(); got != "192.0.2.10>10.244.1.6" {
		t.Fatalf("after syncing the refused Service: served %q", got)
	}
}

// A Node that appears holding a tunnel IP, or a pod range around it, takes
// the tunnel IP away; when it goes, the Service is served again.
func TestControllerReevaluatesWhenNodesChange(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	tc.add(t, tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"),
		tunnelSvc("web", "b", "192.0.2.20", time.Hour), oneEndpoint("web", "b", "10.244.1.6"))
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	tc.drain()
	if err := tc.networksChanged(); err != nil { // nothing changed
		t.Fatal(err)
	}
	if events := tc.drain(); len(events) != 0 {
		t.Fatalf("unchanged networks recorded %q", events)
	}

	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n9"},
		Spec:   corev1.NodeSpec{PodCIDRs: []string{"192.0.2.16/28"}},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "192.0.2.10"}}}}
	tc.add(t, node)
	if err := tc.networksChanged(); err != nil {
		t.Fatal(err)
	}
	if got := tc.dp.served(); got != "" {
		t.Fatalf("served %q after Node n9 took both tunnel IPs", got)
	}
	events := tc.drain()
	for _, want := range []string{"tunnel IP 192.0.2.10 is the address of Node n9", "tunnel IP 192.0.2.20 is inside the pod network 192.0.2.16/28 (Node n9 spec.podCIDRs)"} {
		if !hasEvent(events, want) {
			t.Errorf("no event %q in %q", want, events)
		}
	}

	if err := tc.inf.Core().V1().Nodes().Informer().GetIndexer().Delete(node); err != nil {
		t.Fatal(err)
	}
	if err := tc.networksChanged(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5 192.0.2.20>10.244.1.6"; got != want {
		t.Fatalf("served %q after Node n9 left, want %q", got, want)
	}
}

func TestControllerWithoutPoolsServesNothing(t *testing.T) {
	tc := newTestController(t, "")
	tc.add(t, tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"))
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got := tc.dp.served(); got != "" {
		t.Fatalf("served %q with no pool", got)
	}
	if events := tc.drain(); !hasEvent(events, "Warning TunnelIPRefused tunnel IP 192.0.2.10 is not served: no address pool is configured (--pools)") {
		t.Fatalf("events %q", events)
	}
}

// A success event is recorded only after the kernel write it reports: a
// failed write is followed by TunnelProgramFailed alone, and the retry that
// succeeds reports TunnelProgrammed.
func TestControllerReportsProgrammedOnlyAfterTheWrite(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	tc.add(t, tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"))
	tc.dp.fail = errors.New("kernel says no")
	if err := tc.syncService("web/a"); err == nil {
		t.Fatal("sync succeeded while the datapath failed")
	}
	events := tc.drain()
	if hasEvent(events, ReasonProgrammed) || !hasEvent(events, "Warning TunnelProgramFailed programming tunnel IP 192.0.2.10 failed: kernel says no") {
		t.Errorf("events of a failed write: %q, want TunnelProgramFailed alone", events)
	}
	tc.dp.fail = nil
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	if events := tc.drain(); !hasEvent(events, "Normal TunnelProgrammed tunnel IP 192.0.2.10 programmed") {
		t.Errorf("events of the successful retry: %q, want TunnelProgrammed", events)
	}
}

// Unused routing generations are collected by the worker, from the queue,
// so that it alone writes to the kernel.
func TestControllerCollectsGenerationsFromTheQueue(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	tc.queue.Add(generationsKey)
	if !tc.processNext() {
		t.Fatal("queue shut down")
	}
	if tc.dp.collections != 1 {
		t.Fatalf("CollectGenerations called %d times, want 1", tc.dp.collections)
	}
	if n := tc.queue.Len(); n != 0 {
		t.Fatalf("%d items left in the queue", n)
	}
}

// /healthz fails once an informer stops.
func TestControllerUnhealthyWhenAnInformerStops(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	ctx, cancel := context.WithCancel(context.Background())
	tc.inf.Start(ctx.Done())
	tc.inf.WaitForCacheSync(ctx.Done())
	if err := tc.Healthy(); err != nil {
		t.Fatalf("running informers: %v", err)
	}
	cancel()
	tc.inf.Shutdown()
	if err := tc.Healthy(); err == nil || !strings.Contains(err.Error(), "informer has stopped") {
		t.Fatalf("stopped informers: Healthy() = %v", err)
	}
}

// A Service's endpoints are the slices labelled with its name in its own
// namespace (found through the informer's index): not those of a Service
// of the same name in another namespace, nor another Service's.
func TestControllerFindsEachServicesOwnSlices(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	tc.add(t,
		tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"),
		tunnelSvc("shop", "a", "192.0.2.11", time.Hour), oneEndpoint("shop", "a", "10.244.2.5"),
		tunnelSvc("web", "b", "192.0.2.12", time.Hour), oneEndpoint("web", "b", "10.244.3.5"),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5 192.0.2.11>10.244.2.5 192.0.2.12>10.244.3.5"; got != want {
		t.Fatalf("served %q, want %q", got, want)
	}
	// A second slice of web/a adds its endpoint to web/a only.
	second := oneEndpoint("web", "a", "10.244.1.6")
	second.Name = "a-2"
	tc.add(t, second)
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, ep := range tc.dp.tunnels[netip.MustParseAddr("192.0.2.10")].Table {
		got[ep.Addr.String()] = true
	}
	if len(got) != 2 || !got["10.244.1.5"] || !got["10.244.1.6"] {
		t.Errorf("web/a's buckets go to %v, want 10.244.1.5 and 10.244.1.6", got)
	}
}

// The hook SetAfterResync gives runs after every full resync, failed or
// not (the daemon returns the resync's garbage to the OS there).
func TestControllerCallsAfterResyncHook(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	calls := 0
	tc.SetAfterResync(func() { calls++ })
	tc.add(t, tunnelSvc("web", "a", "192.0.2.10", time.Hour), oneEndpoint("web", "a", "10.244.1.5"))
	if err := tc.resyncAndRelease(); err != nil {
		t.Fatal(err)
	}
	tc.dp.fail = errors.New("kernel says no")
	if err := tc.resyncAndRelease(); err == nil {
		t.Fatal("resync succeeded while the datapath failed")
	}
	if calls != 2 {
		t.Errorf("hook ran %d times after 2 resyncs, want 2", calls)
	}
}

// A Pod's drain annotation queues the Services whose slices list the Pod,
// wherever the slice is (a targetRef may name another namespace), and no
// other.
func TestControllerQueuesTheServicesOfAnAnnotatedPod(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	withPod := func(ns, svc, podNS, pod string) *discoveryv1.EndpointSlice {
		es := oneEndpoint(ns, svc, "10.244.1.5")
		es.Endpoints[0].TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: podNS, Name: pod}
		return es
	}
	tc.add(t, withPod("a", "web", "", "p1"), withPod("b", "other", "a", "p1"), withPod("a", "shop", "", "p2"))
	tc.listing.Store(true) // as after the initial resync began
	tc.enqueuePodServices(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "p1"}})
	var got []string
	for tc.queue.Len() > 0 {
		key, _ := tc.queue.Get()
		got = append(got, key.Object)
		tc.queue.Done(key)
	}
	slices.Sort(got)
	if want := []string{"a/web", "b/other"}; !slices.Equal(got, want) {
		t.Errorf("queued %v for pod a/p1, want %v", got, want)
	}
}

// statusRecorder keeps what the controller publishes.
type statusRecorder struct {
	tunnels map[netip.Addr]routerstatus.Tunnel
	policy  *tunnelclaim.Policy
}

func (s *statusRecorder) SetPolicy(p tunnelclaim.Policy) { s.policy = &p }

func (s *statusRecorder) Set(t routerstatus.Tunnel) { s.tunnels[t.VIP] = t }
func (s *statusRecorder) Remove(vip netip.Addr)     { delete(s.tunnels, vip) }
func (s *statusRecorder) Replace(ts []routerstatus.Tunnel) {
	s.tunnels = map[netip.Addr]routerstatus.Tunnel{}
	for _, t := range ts {
		s.tunnels[t.VIP] = t
	}
}

// The status publishes only what the datapath accepted, with the digest
// of the table it was given.
func TestControllerPublishesWhatItProgrammed(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	pub := &statusRecorder{tunnels: map[netip.Addr]routerstatus.Tunnel{}}
	tc.SetStatusPublisher(pub)
	vip := netip.MustParseAddr("192.0.2.10")
	tc.add(t, tunnelSvc("web", "a", vip.String(), time.Hour), oneEndpoint("web", "a", "10.244.1.5"))
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	got, ok := pub.tunnels[vip]
	want := routerstatus.TableDigest(TableAddrs(tc.dp.tunnels[vip]))
	if !ok || got.Table != want || got.Endpoints != 1 || want == "" {
		t.Fatalf("after resync: published %+v (%t), want table %s with 1 endpoint", got, ok, want)
	}
	if p := pub.policy; p == nil || p.Pools.String() != "192.0.2.0/24" || len(p.ServiceCIDRs) != 1 {
		t.Errorf("after resync: published policy %+v, want the pools 192.0.2.0/24 and the Service range the router admits claims with", p)
	}
	next := tc.Policy().Get()
	next.Pools = append(next.Pools, tunnelclaim.Pool{Prefix: netip.MustParsePrefix("2001:db8:2::/64")})
	tc.Policy().Set(next)
	tc.queue.Add(resyncKey) // what PolicyChanged queues
	if !tc.processNext() {
		t.Fatal("queue shut down")
	}
	if p := pub.policy; p == nil || p.Pools.String() != "192.0.2.0/24;2001:db8:2::/64" {
		t.Errorf("after a pool change and a resync: published policy %+v, want the new pools", p)
	}
	tc.add(t, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "web", Name: "a-1", Labels: map[string]string{discoveryv1.LabelServiceName: "a"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.244.1.5"}}, {Addresses: []string{"10.244.2.5"}}},
	})
	tc.dp.fail = errors.New("kernel says no")
	if err := tc.syncService("web/a"); err == nil {
		t.Fatal("sync succeeded while the datapath failed")
	}
	if pub.tunnels[vip].Table != want {
		t.Errorf("a failed write changed the published table to %s", pub.tunnels[vip].Table)
	}
	tc.dp.fail = nil
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	if got := pub.tunnels[vip]; got.Endpoints != 2 || got.Table == want || got.Table != routerstatus.TableDigest(TableAddrs(tc.dp.tunnels[vip])) {
		t.Errorf("after the second endpoint: published %+v", got)
	}
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(tunnelSvc("web", "a", vip.String(), time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tc.syncService("web/a"); err != nil {
		t.Fatal(err)
	}
	if _, ok := pub.tunnels[vip]; ok {
		t.Error("a removed tunnel IP is still published")
	}
}
