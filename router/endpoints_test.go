package router

import (
	"net/netip"
	"strings"
	"testing"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func ptr[T any](v T) *T { return &v }

func slice(name string, typ discoveryv1.AddressType, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name},
		AddressType: typ,
		Endpoints:   eps,
	}
}

func TestReadyEndpoints(t *testing.T) {
	slices := []*discoveryv1.EndpointSlice{
		slice("a", discoveryv1.AddressTypeIPv4,
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.5"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}},
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.6"}, NodeName: ptr("node-1")}, // nil ready: counts as ready
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.7"}, NodeName: ptr("node-1"), Conditions: discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}},
			discoveryv1.Endpoint{Addresses: nil, NodeName: ptr("node-1")},
			discoveryv1.Endpoint{Addresses: []string{"not-an-ip"}},
			discoveryv1.Endpoint{Addresses: []string{"10.244.2.9"}}, // no nodeName
		),
		slice("b", discoveryv1.AddressTypeIPv6, discoveryv1.Endpoint{Addresses: []string{"fd00::1"}}),
		slice("c", discoveryv1.AddressTypeIPv4,
			discoveryv1.Endpoint{Addresses: []string{"10.244.1.5"}, NodeName: ptr("node-1")}, // duplicate of slice a
		),
		nil,
	}

	t.Run("gre", func(t *testing.T) {
		eps, problems := ReadyEndpoints(slices, false)
		want := []string{"10.244.1.5", "10.244.1.6", "10.244.2.9"}
		assertAddrs(t, eps, want)
		assertProblems(t, problems, "endpoints[3].addresses is empty", "not-an-ip", "addressType IPv6")
	})
	t.Run("mpls needs a node", func(t *testing.T) {
		eps, problems := ReadyEndpoints(slices, true)
		assertAddrs(t, eps, []string{"10.244.1.5", "10.244.1.6"})
		assertProblems(t, problems, "endpoints[5] (10.244.2.9) has no nodeName")
	})
}

func assertAddrs(t *testing.T, eps []Endpoint, want []string) {
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

func assertProblems(t *testing.T, problems []string, parts ...string) {
	t.Helper()
	all := strings.Join(problems, "\n")
	for _, p := range parts {
		if !strings.Contains(all, p) {
			t.Errorf("problems do not mention %q:\n%s", p, all)
		}
	}
}
