package router

import (
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"net/netip"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func ptr[T any](v T) *T { return &v }

func slice(name string, typ discoveryv1.AddressType, eps ...discoveryv1.Endpoint) *kubeobj.EndpointSlice {
	return kubeobj.NewEndpointSlice(&discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name},
		AddressType: typ,
		Endpoints:   eps,
	})
}

func TestServiceEndpoints(t *testing.T) {
	slices := []*kubeobj.EndpointSlice{
		slice("a", discoveryv1.AddressTypeIPv4,
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.5"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}},
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.6"}, NodeName: ptr("node-1")},                                                                                                             // nil ready: counts as ready
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.7"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}},  // draining
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.8"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(false), Terminating: ptr(true)}}, // gone
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.4"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(false)}},                                              // not ready, not serving
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.3"}, NodeName: ptr("node-1"), TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "annotated"}},                                         // drained by annotation
			discoveryv1.Endpoint{Addresses: nil, NodeName: ptr("node-1")},
			discoveryv1.Endpoint{Addresses: []string{"not-an-ip"}},
			discoveryv1.Endpoint{Addresses: []string{"10.244.2.9"}}, // no nodeName
		),
		slice("b", discoveryv1.AddressTypeIPv6,
			discoveryv1.Endpoint{Addresses: []string{"fd00::1"}, NodeName: ptr("node-1")},
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.9"}, NodeName: ptr("node-1")},        // the wrong family for the slice
			discoveryv1.Endpoint{Addresses: []string{"::ffff:10.244.1.9"}, NodeName: ptr("node-1")}, // IPv4-mapped is not IPv6
			discoveryv1.Endpoint{Addresses: []string{"fd00::1"}, NodeName: ptr("node-2")},           // a duplicate on another node
		),
		slice("d", discoveryv1.AddressTypeFQDN, discoveryv1.Endpoint{Addresses: []string{"example.com"}}),
		slice("c", discoveryv1.AddressTypeIPv4,
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.5"}, NodeName: ptr("node-1")}, // duplicate of slice a
		),
		nil,
	}

	drained := func(ns, name string) bool { return ns == "ns" && name == "annotated" }
	t.Run("gre", func(t *testing.T) {
		eps, problems := ServiceEndpoints(slices, discoveryv1.AddressTypeIPv4, false, drained)
		want := []string{"10.244.1.3", "10.244.1.5", "10.244.1.6", "10.244.1.7", "10.244.2.9"}
		assertAddrs(t, eps, want)
		assertDraining(t, eps, "10.244.1.3", "10.244.1.7")
		assertProblems(t, problems, "endpoints[6].addresses is empty", `"not-an-ip" is not an IPv4 address`)
	})
	t.Run("IPv6 from the IPv6 slices only", func(t *testing.T) {
		eps, problems := ServiceEndpoints(slices, discoveryv1.AddressTypeIPv6, true, drained)
		assertAddrs(t, eps, []string{"fd00::1"})
		if eps[0].NodeName != "node-1" {
			t.Errorf("fd00::1 on node %q, want node-1 (the smaller name of the two)", eps[0].NodeName)
		}
		assertProblems(t, problems, `"10.244.1.9" is not an IPv6 address`, `"::ffff:10.244.1.9" is not an IPv6 address`, `endpoints[3] (fd00::1) is also listed on node "node-1"`)
	})
	t.Run("mpls needs a node", func(t *testing.T) {
		eps, problems := ServiceEndpoints(slices, discoveryv1.AddressTypeIPv4, true, nil)
		assertAddrs(t, eps, []string{"10.244.1.3", "10.244.1.5", "10.244.1.6", "10.244.1.7"})
		assertDraining(t, eps, "10.244.1.7")
		assertProblems(t, problems, "endpoints[8] (10.244.2.9) has no nodeName")
	})
	t.Run("a pod of another namespace is left out", func(t *testing.T) {
		eps, problems := ServiceEndpoints([]*kubeobj.EndpointSlice{
			slice("x", discoveryv1.AddressTypeIPv4,
				discoveryv1.Endpoint{Addresses: []string{"10.0.0.1"}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "kube-system", Name: "coredns-1"}},
				discoveryv1.Endpoint{Addresses: []string{"10.0.0.2"}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "web-1"}}, // the slice's namespace
				discoveryv1.Endpoint{Addresses: []string{"10.0.0.3"}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "web-2"}}),
		}, discoveryv1.AddressTypeIPv4, false, nil)
		assertAddrs(t, eps, []string{"10.0.0.2", "10.0.0.3"})
		assertProblems(t, problems, ForeignEndpointPrefix+"EndpointSlice ns/x: endpoints[0] names pod kube-system/coredns-1 of another namespace: a tunnel IP is carried only to pods of its Service's namespace ns; skipped")
	})
	t.Run("ready in one slice wins over draining in another", func(t *testing.T) {
		eps, _ := ServiceEndpoints([]*kubeobj.EndpointSlice{
			slice("x", discoveryv1.AddressTypeIPv4, discoveryv1.Endpoint{Addresses: []string{"10.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true)}}),
			slice("y", discoveryv1.AddressTypeIPv4, discoveryv1.Endpoint{Addresses: []string{"10.0.0.1"}}),
		}, discoveryv1.AddressTypeIPv4, false, nil)
		assertAddrs(t, eps, []string{"10.0.0.1"})
		assertDraining(t, eps)
	})
}

func assertAddrs(t *testing.T, eps []datapath.Endpoint, want []string) {
	t.Helper()
	if len(eps) != len(want) {
		t.Fatalf("got %v, want %v", eps, want)
	}
	for i := range want {
		if eps[i].Addr != netip.MustParseAddr(want[i]) {
			t.Fatalf("got %v, want %v", eps, want)
		}
	}
}

func assertDraining(t *testing.T, eps []datapath.Endpoint, want ...string) {
	t.Helper()
	var got []string
	for _, ep := range eps {
		if ep.Draining {
			got = append(got, ep.Addr.String())
		}
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("draining endpoints %v, want %v", got, want)
	}
}

func assertProblems(t *testing.T, problems []string, parts ...string) {
	t.Helper()
	all := strings.Join(problems, "\n")
	for _, p := range parts {
		if !strings.Contains(all, p) {
			t.Errorf("problems do not mention %q:\n%s", p, all)
		}
	}
}
