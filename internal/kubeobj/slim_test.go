package kubeobj

import (
	"strings"
	"testing"
	"time"
	"unsafe"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/cache"
)

func ptr[T any](v T) *T { return &v }

var fullMeta = metav1.ObjectMeta{
	Name: "web", Namespace: "shop", UID: "u-1", ResourceVersion: "42", Generation: 3,
	CreationTimestamp: metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)),
	Labels:            map[string]string{discoveryv1.LabelServiceName: "web"},
	Annotations: map[string]string{
		"cmd.nu/tunnel": "192.0.2.10", "cmd.nu/tunnel-drain": "true",
		"kubectl.kubernetes.io/last-applied-configuration": `{"a huge":"copy"}`,
	},
	ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:spec":{}}`)}}},
}

var wantMeta = metav1.ObjectMeta{
	Name: "web", Namespace: "shop", UID: "u-1", ResourceVersion: "42",
	CreationTimestamp: fullMeta.CreationTimestamp,
	Annotations:       map[string]string{"cmd.nu/tunnel": "192.0.2.10", "cmd.nu/tunnel-drain": "true"},
}

func TestSlimServiceKeepsWhatTheDaemonsRead(t *testing.T) {
	full := &corev1.Service{
		ObjectMeta: fullMeta,
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, LoadBalancerClass: ptr("cmd.nu/tunnel"),
			Selector:        map[string]string{"app": "web"},
			Ports:           []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080), NodePort: 30080, AppProtocol: ptr("http")}},
			SessionAffinity: corev1.ServiceAffinityClientIP, SessionAffinityConfig: &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(60))}}},
		Status: corev1.ServiceStatus{
			LoadBalancer: corev1.LoadBalancerStatus{Ingress: []corev1.LoadBalancerIngress{{IP: "192.0.2.10"}}},
			Conditions:   []metav1.Condition{{Type: "Other"}},
		},
	}
	got, err := SlimService(full)
	if err != nil {
		t.Fatal(err)
	}
	want := &corev1.Service{ObjectMeta: wantMeta, Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, LoadBalancerClass: ptr("cmd.nu/tunnel"), SessionAffinity: corev1.ServiceAffinityClientIP,
		Selector: map[string]string{"app": "web"},
		Ports:    []corev1.ServicePort{{Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
	want.Labels = nil
	want.Status.LoadBalancer = full.Status.LoadBalancer
	if !equality.Semantic.DeepEqual(got, want) {
		t.Errorf("SlimService:\n got %+v\nwant %+v", got, want)
	}
	// A Service without the daemons' annotations is never a tunnel
	// Service: its selector is not kept.
	plain := full.DeepCopy()
	plain.Annotations = nil
	got, err = SlimService(plain)
	if err != nil {
		t.Fatal(err)
	}
	if sel := got.(*corev1.Service).Spec.Selector; sel != nil {
		t.Errorf("SlimService kept the selector %v of a Service without the daemons' annotations", sel)
	}
}

func TestSlimEndpointSliceKeepsWhatTheDaemonsRead(t *testing.T) {
	node := "node-1"
	full := &discoveryv1.EndpointSlice{
		ObjectMeta:  fullMeta,
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			{
				Addresses:  []string{"10.244.1.5"},
				Conditions: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)},
				NodeName:   &node, Zone: ptr("a"), Hostname: ptr("web-0"),
				TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: "web-0", UID: "p-1", ResourceVersion: "7"},
				Hints:     &discoveryv1.EndpointHints{ForZones: []discoveryv1.ForZone{{Name: "a"}}},
			},
			{Addresses: []string{"10.244.1.6"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}},
		},
		Ports: []discoveryv1.EndpointPort{{Port: ptr[int32](8080)}},
	}
	got, err := SlimEndpointSlice(full)
	if err != nil {
		t.Fatal(err)
	}
	want := &EndpointSlice{ObjectMeta: wantMeta, Service: "web", AddressType: discoveryv1.AddressTypeIPv4, Endpoints: []Endpoint{
		{
			Address:    "10.244.1.5",
			Conditions: readySet | servingSet | serving,
			NodeName:   node,
			Pod:        PodRef{Namespace: "shop", Name: "web-0", UID: "p-1"},
		},
		{Address: "10.244.1.6", Conditions: readySet | ready},
	}}
	if !equality.Semantic.DeepEqual(got, want) {
		t.Errorf("SlimEndpointSlice:\n got %+v\nwant %+v", got, want)
	}
}

// Ready and serving are each true, false or unset, as in the API; the
// terminating condition, which the daemons do not read, changes neither.
func TestConditions(t *testing.T) {
	for _, tc := range []struct {
		in                   discoveryv1.EndpointConditions
		ready, serving       bool
		readySet, servingSet bool
	}{
		{in: discoveryv1.EndpointConditions{}},
		{in: discoveryv1.EndpointConditions{Ready: ptr(true)}, ready: true, readySet: true},
		{in: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true)}, readySet: true, serving: true, servingSet: true},
		{in: discoveryv1.EndpointConditions{Serving: ptr(false), Terminating: ptr(true)}, servingSet: true},
		{in: discoveryv1.EndpointConditions{Terminating: ptr(false)}},
	} {
		c := NewConditions(tc.in)
		r, rs := c.Ready()
		s, ss := c.Serving()
		if r != tc.ready || rs != tc.readySet || s != tc.serving || ss != tc.servingSet {
			t.Errorf("%+v: ready %v/%v serving %v/%v", tc.in, r, rs, s, ss)
		}
	}
}

// A targetRef names a Pod only with kind Pod; without a namespace it means
// the slice's.
func TestEndpointSlicePod(t *testing.T) {
	for _, tc := range []struct {
		name string
		ref  *corev1.ObjectReference
		want string // Key, "" when none
	}{
		{"no targetRef", nil, ""},
		{"not a Pod", &corev1.ObjectReference{Kind: "Node", Name: "n1"}, ""},
		{"namespace defaults to the slice's", &corev1.ObjectReference{Kind: "Pod", Name: "p"}, "web/p"},
		{"explicit namespace", &corev1.ObjectReference{Kind: "Pod", Namespace: "other", Name: "p"}, "other/p"},
	} {
		es := NewEndpointSlice(&discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "web", Name: "s"},
			Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"10.1.0.1"}, TargetRef: tc.ref}}})
		pod := es.Endpoints[0].Pod
		if got := map[bool]string{false: pod.Key(), true: ""}[pod.IsZero()]; got != tc.want {
			t.Errorf("%s: pod = %q, want %q", tc.name, got, tc.want)
		}
	}
}

// The informer's store holds the cached type: it must be a runtime.Object
// whose copy shares nothing a writer could change.
func TestEndpointSliceDeepCopy(t *testing.T) {
	es := NewEndpointSlice(&discoveryv1.EndpointSlice{ObjectMeta: fullMeta, Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"10.1.0.1"}}}})
	cp := es.DeepCopyObject().(*EndpointSlice)
	if !equality.Semantic.DeepEqual(es, cp) {
		t.Fatalf("copy %+v differs from %+v", cp, es)
	}
	cp.Endpoints[0].Address = "10.1.0.2"
	cp.Annotations["cmd.nu/x"] = "changed"
	if es.Endpoints[0].Address != "10.1.0.1" || es.Annotations["cmd.nu/x"] == "changed" {
		t.Fatal("writing the copy changed the original")
	}
}

func TestSlimNodeAndPod(t *testing.T) {
	full := &corev1.Node{ObjectMeta: fullMeta,
		Spec: corev1.NodeSpec{PodCIDR: "10.244.1.0/24", PodCIDRs: []string{"10.244.1.0/24"}, ProviderID: "metal://1"},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "172.20.0.11"}},
			Images: []corev1.ContainerImage{{Names: []string{"a big image list"}}}},
	}
	got, err := SlimNode(full)
	if err != nil {
		t.Fatal(err)
	}
	want := &corev1.Node{ObjectMeta: wantMeta, Spec: corev1.NodeSpec{PodCIDR: "10.244.1.0/24", PodCIDRs: []string{"10.244.1.0/24"}},
		Status: corev1.NodeStatus{Addresses: full.Status.Addresses}}
	want.Labels = fullMeta.Labels
	if !equality.Semantic.DeepEqual(got, want) {
		t.Errorf("SlimNode:\n got %+v\nwant %+v", got, want)
	}
	pod, err := SlimPod(&corev1.Pod{ObjectMeta: fullMeta, Spec: corev1.PodSpec{NodeName: "node-1"}})
	if err != nil {
		t.Fatal(err)
	}
	wantPod := &corev1.Pod{ObjectMeta: wantMeta}
	if !equality.Semantic.DeepEqual(pod, wantPod) {
		t.Errorf("SlimPod:\n got %+v\nwant %+v", pod, wantPod)
	}
}

// A tombstone (or anything else) passes through unchanged.
func TestSlimPassesOtherTypesThrough(t *testing.T) {
	tomb := cache.DeletedFinalStateUnknown{Key: "shop/web"}
	for name, slim := range map[string]cache.TransformFunc{"service": SlimService, "slice": SlimEndpointSlice, "node": SlimNode, "pod": SlimPod, "any": Slim} {
		got, err := slim(tomb)
		if err != nil || got != tomb {
			t.Errorf("%s: a tombstone became %v, %v", name, got, err)
		}
	}
}

// Slim slims each type with its own transform.
func TestSlimDispatchesByType(t *testing.T) {
	for _, tc := range []struct {
		obj  any
		slim cache.TransformFunc
	}{
		{&corev1.Service{ObjectMeta: fullMeta}, SlimService},
		{&discoveryv1.EndpointSlice{ObjectMeta: fullMeta}, SlimEndpointSlice},
		{&corev1.Node{ObjectMeta: fullMeta}, SlimNode},
		{&corev1.Pod{ObjectMeta: fullMeta}, SlimPod},
	} {
		got, err := Slim(tc.obj)
		want, _ := tc.slim(tc.obj)
		if err != nil || !equality.Semantic.DeepEqual(got, want) {
			t.Errorf("Slim(%T) = %+v, %v; want %+v", tc.obj, got, err, want)
		}
	}
}

// The endpoints of one node, in any slice, share one node name's bytes.
func TestSlimEndpointSliceSharesNodeNames(t *testing.T) {
	slice := func(node string) *EndpointSlice {
		es, _ := SlimEndpointSlice(&discoveryv1.EndpointSlice{Endpoints: []discoveryv1.Endpoint{{NodeName: ptr(node)}, {NodeName: ptr(node)}}})
		return es.(*EndpointSlice)
	}
	ea, eb, eo := slice("node-1").Endpoints, slice("node-1").Endpoints, slice("node-2").Endpoints
	if unsafe.StringData(ea[0].NodeName) != unsafe.StringData(ea[1].NodeName) || unsafe.StringData(ea[0].NodeName) != unsafe.StringData(eb[0].NodeName) {
		t.Error("endpoints of one node do not share its name")
	}
	if eo[0].NodeName != "node-2" || ea[0].NodeName != "node-1" {
		t.Errorf("node names %q and %q, want node-1 and node-2", ea[0].NodeName, eo[0].NodeName)
	}
}

// Past its limit the interner starts afresh; what it handed out stays right.
func TestInternerLimit(t *testing.T) {
	in := &interner{limit: 2}
	first := in.intern(strings.Clone("a"))
	in.intern("b")
	if unsafe.StringData(in.intern(strings.Clone("a"))) != unsafe.StringData(first) {
		t.Fatal("a second intern of a is not shared")
	}
	in.intern("c") // the third distinct string: afresh
	if len(in.strings) != 1 {
		t.Fatalf("after the limit the interner holds %d strings, want 1", len(in.strings))
	}
	if first != "a" || in.intern("") != "" {
		t.Fatal("an interned string changed, or the empty string was interned")
	}
}
