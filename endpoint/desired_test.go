package endpoint

import (
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
	"k8s.io/apimachinery/pkg/types"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

var t0 = time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)

// testPools admits the tunnel IPs the tests use, in every namespace.
var testPools = tunnelclaim.Pools{{Prefix: netip.MustParsePrefix("192.0.2.0/24")}}

func tunnelService(ns, name, vip string, age time.Duration) *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{
		Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(t0.Add(-age)),
		Annotations: map[string]string{tunnelclaim.Annotation: vip},
	}}
}

func testPod(ns, name, node, ip string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name)},
		Spec:       corev1.PodSpec{NodeName: node},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip},
	}
}

type ep struct {
	ip, node, pod string
	ready         bool
}

func slice(ns, svc string, eps ...ep) *discoveryv1.EndpointSlice {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: svc + "-x", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, e := range eps {
		d := discoveryv1.Endpoint{Addresses: []string{e.ip}, Conditions: discoveryv1.EndpointConditions{Ready: &e.ready}}
		if e.node != "" {
			d.NodeName = &e.node
		}
		if e.pod != "" {
			d.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: e.pod, UID: types.UID("uid-" + e.pod)}
		}
		es.Endpoints = append(es.Endpoints, d)
	}
	return es
}

// cached is what the agent's informer keeps of slices.
func cached(slices ...*discoveryv1.EndpointSlice) []*kubeobj.EndpointSlice {
	out := make([]*kubeobj.EndpointSlice, len(slices))
	for i, es := range slices {
		out[i] = kubeobj.NewEndpointSlice(es)
	}
	return out
}

// summary renders the desired state as "pod=vip,vip pod=vip" for comparison.
func summary(d map[string]PodTunnels) string {
	var parts []string
	for key, pt := range d {
		var ips []string
		for _, ip := range pt.TunnelIPs {
			ips = append(ips, ip.String())
		}
		parts = append(parts, key+"="+strings.Join(ips, ","))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

func TestDesired(t *testing.T) {
	const node = "n1"
	pods := []*corev1.Pod{
		testPod("a", "web-1", node, "10.1.0.11"),
		testPod("a", "web-2", node, "10.1.0.12"),
		testPod("a", "web-3", "n2", "10.1.1.13"),
		testPod("b", "db-1", node, "10.1.0.21"),
	}
	hostNet := testPod("a", "hostnet", node, "192.0.2.99")
	hostNet.Spec.HostNetwork = true
	pods = append(pods, hostNet)

	for _, tc := range []struct {
		name     string
		services []*corev1.Service
		slices   []*discoveryv1.EndpointSlice
		want     string
		problem  string
	}{
		{
			name:     "only this node's endpoints, ready or not",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", time.Hour)},
			slices: []*discoveryv1.EndpointSlice{slice("a", "web",
				ep{"10.1.0.11", node, "web-1", true}, ep{"10.1.0.12", node, "web-2", false}, ep{"10.1.1.13", "n2", "web-3", true})},
			want: "a/web-1=192.0.2.10 a/web-2=192.0.2.10",
		},
		{
			name: "one pod backs two tunnel services",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", time.Hour),
				tunnelService("a", "web-alt", "192.0.2.11", time.Hour)},
			slices: []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.11", node, "web-1", true}),
				slice("a", "web-alt", ep{"10.1.0.11", node, "web-1", true})},
			want: "a/web-1=192.0.2.10,192.0.2.11",
		},
		{
			name:     "service without the annotation or with a bad one serves nothing",
			services: []*corev1.Service{{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "web"}}, tunnelService("b", "db", "not-an-ip", 0)},
			slices:   []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.11", node, "web-1", true}), slice("b", "db", ep{"10.1.0.21", node, "db-1", true})},
			want:     "",
		},
		{
			name: "conflict: the oldest service wins the tunnel IP",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", time.Minute),
				tunnelService("b", "db", "192.0.2.10", time.Hour)},
			slices: []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.11", node, "web-1", true}),
				slice("b", "db", ep{"10.1.0.21", node, "db-1", true})},
			want: "b/db-1=192.0.2.10",
		},
		{
			name:     "endpoint without targetRef is matched by address",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
			slices:   []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.12", node, "", true})},
			want:     "a/web-2=192.0.2.10",
		},
		{
			name:     "stale address is refused with a problem naming the slice",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
			slices:   []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.99", node, "web-1", true})},
			want:     "",
			problem:  "EndpointSlice a/web-x: endpoints[0].addresses[0] 10.1.0.99 is not the status.podIP",
		},
		{
			name:     "host-network pod is never entered",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
			slices:   []*discoveryv1.EndpointSlice{slice("a", "web", ep{"192.0.2.99", node, "hostnet", true})},
			want:     "",
			problem:  "no running pod of this node",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, problems, _ := Desired(node, testPools, tunnelclaim.Networks{}, tc.services, cached(tc.slices...), pods)
			if s := summary(got); s != tc.want {
				t.Errorf("desired = %q, want %q", s, tc.want)
			}
			joined := strings.Join(problems, "\n")
			if tc.problem == "" && joined != "" || !strings.Contains(joined, tc.problem) {
				t.Errorf("problems = %q, want one containing %q", joined, tc.problem)
			}
		})
	}
}

func TestDesiredCarriesPodIdentity(t *testing.T) {
	got, _, _ := Desired("n1", testPools, tunnelclaim.Networks{}, []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
		cached(slice("a", "web", ep{"10.1.0.11", "n1", "web-1", true})),
		[]*corev1.Pod{testPod("a", "web-1", "n1", "10.1.0.11")})
	pt := got["a/web-1"]
	if pt.Pod.UID != "uid-web-1" || pt.Pod.IP != netip.MustParseAddr("10.1.0.11") || pt.Pod.Namespace != "a" || pt.Pod.Name != "web-1" {
		t.Fatalf("pod = %+v", pt.Pod)
	}
}

// TestDesiredIsOrderIndependent checks that the input order does not change
// the answer, since every node computes it from informer lists in any order.
func TestDesiredIsOrderIndependent(t *testing.T) {
	var svcs []*corev1.Service
	var esl []*discoveryv1.EndpointSlice
	var pods []*corev1.Pod
	for i := range 20 {
		name := fmt.Sprintf("s%d", i)
		svcs = append(svcs, tunnelService("a", name, fmt.Sprintf("192.0.2.%d", 1+i%7), time.Duration(i%3)*time.Hour))
		pod := fmt.Sprintf("p%d", i%5)
		esl = append(esl, slice("a", name, ep{fmt.Sprintf("10.1.0.%d", 1+i%5), "n1", pod, true}))
	}
	for i := range 5 {
		pods = append(pods, testPod("a", fmt.Sprintf("p%d", i), "n1", fmt.Sprintf("10.1.0.%d", 1+i)))
	}
	want, _, _ := Desired("n1", testPools, tunnelclaim.Networks{}, svcs, cached(esl...), pods)
	slices.Reverse(svcs)
	slices.Reverse(esl)
	slices.Reverse(pods)
	got, _, _ := Desired("n1", testPools, tunnelclaim.Networks{}, svcs, cached(esl...), pods)
	if summary(got) != summary(want) || summary(want) == "" {
		t.Fatalf("order changed the answer:\n%s\n%s", summary(want), summary(got))
	}
}

// TestDesiredAdmission: the claim decision itself is tested in
// internal/tunnelclaim (TestDecide); here, that Desired serves only its
// winners and hands back its refusals.
func TestDesiredAdmission(t *testing.T) {
	const node = "n1"
	pods := []*corev1.Pod{testPod("a", "web-1", node, "10.1.0.11"), testPod("b", "db-1", node, "10.1.0.21")}
	esl := []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.11", node, "web-1", true}), slice("b", "db", ep{"10.1.0.21", node, "db-1", true})}
	limited := tunnelclaim.Pools{{Prefix: netip.MustParsePrefix("192.0.2.0/24"), Namespaces: []string{"a"}}}
	services := []*corev1.Service{tunnelService("b", "db", "192.0.2.10", time.Hour), tunnelService("a", "web", "192.0.2.10", time.Minute)}
	got, _, refused := Desired(node, limited, tunnelclaim.Networks{}, services, cached(esl...), pods)
	if s, want := summary(got), "a/web-1=192.0.2.10"; s != want {
		t.Errorf("desired = %q, want %q", s, want)
	}
	var lines []string
	for _, r := range refused {
		lines = append(lines, r.Key()+": "+r.Err.Error())
	}
	want := "b/db: tunnel IP 192.0.2.10 is in address pool 192.0.2.0/24, which only namespaces a may use, not b"
	if joined := strings.Join(lines, "\n"); joined != want {
		t.Errorf("refused = %q, want %q", joined, want)
	}
}
