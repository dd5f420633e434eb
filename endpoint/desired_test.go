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
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

var t0 = time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)

// testPools admits the tunnel IPs the tests use, of both families, in
// every namespace.
var testPools = tunnelclaim.Pools{{Prefix: netip.MustParsePrefix("192.0.2.0/24")}, {Prefix: netip.MustParsePrefix("2001:db8::/64")}}

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
			problem:  "EndpointSlice a/web-x: endpoints[0].addresses[0] 10.1.0.99 is not the IPv4 address 10.1.0.11 of pod a/web-1 in status.podIPs",
		},
		{
			name:     "another namespace's pod named by targetRef is refused (CVE-2021-25740 class)",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
			slices: []*discoveryv1.EndpointSlice{func() *discoveryv1.EndpointSlice {
				es := slice("a", "web", ep{"10.1.0.21", node, "db-1", true}, ep{"10.1.0.11", node, "web-1", true})
				es.Endpoints[0].TargetRef.Namespace = "b"
				return es
			}()},
			want:    "a/web-1=192.0.2.10",
			problem: "EndpointSlice a/web-x: endpoints[0] (10.1.0.21) is pod b/db-1 of another namespace: a tunnel IP is carried only to pods of its Service's namespace a; skipped",
		},
		{
			name:     "another namespace's pod named by its address alone is refused",
			services: []*corev1.Service{tunnelService("a", "web", "192.0.2.10", 0)},
			slices:   []*discoveryv1.EndpointSlice{slice("a", "web", ep{"10.1.0.21", node, "", true})},
			want:     "",
			problem:  "endpoints[0] (10.1.0.21) is pod b/db-1 of another namespace",
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

// dualPod is a pod with the given status.podIPs, the first as status.podIP.
func dualPod(ns, name, node string, ips ...string) *corev1.Pod {
	p := testPod(ns, name, node, ips[0])
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

// slice6 is slice for an IPv6 EndpointSlice (named SVC-6).
func slice6(ns, svc string, eps ...ep) *discoveryv1.EndpointSlice {
	es := slice(ns, svc, eps...)
	es.Name, es.AddressType = svc+"-6", discoveryv1.AddressTypeIPv6
	return es
}

var (
	v6vip1 = netip.MustParseAddr("2001:db8::10")
	v6vip2 = netip.MustParseAddr("2001:db8::11")
)

// TestDesiredDualStack: each tunnel IP goes to the endpoints of its own
// family, whose pod's address of that family (status.podIPs) it is; the
// claim decision is given (desiredOf), so that the test holds whatever the
// annotation parser accepts.
func TestDesiredDualStack(t *testing.T) {
	const node = "n1"
	web := tunnelService("a", "web", "", time.Hour)
	only6 := tunnelService("a", "only6", "", time.Hour)
	only4 := tunnelService("a", "only4", "", time.Hour)
	winners := map[netip.Addr]*corev1.Service{vip1: web, v6vip1: web, v6vip2: only6, vip2: only4}
	pods := []*corev1.Pod{
		dualPod("a", "dual", node, "10.1.0.11", "fd00:10:1::11"),
		dualPod("a", "v4only", node, "10.1.0.12"),
		dualPod("a", "v6only", node, "fd00:10:1::13"),
		dualPod("a", "stale6", node, "10.1.0.14", "fd00:10:1::14"),
		dualPod("a", "byaddr", node, "10.1.0.15", "fd00:10:1::15"),
		dualPod("a", "elsewhere", "n2", "10.1.1.16", "fd00:10:2::16"),
	}
	esl := []*discoveryv1.EndpointSlice{
		slice("a", "web", ep{"10.1.0.11", node, "dual", true}, ep{"10.1.0.12", node, "v4only", true},
			ep{"fd00:10:1::13", node, "v6only", true}, // an IPv6 address in an IPv4 slice: ignored
			ep{"10.1.0.14", node, "stale6", true}, ep{"10.1.1.16", "n2", "elsewhere", true}),
		slice6("a", "web", ep{"fd00:10:1::11", node, "dual", true}, ep{"fd00:10:1::13", node, "v6only", true},
			ep{"10.1.0.12", node, "v4only", true}, // an IPv4 address in an IPv6 slice: ignored
			ep{"fd00:10:1::99", node, "stale6", true},
			ep{"fd00:10:1::15", node, "", true}, // no targetRef: found by its IPv6 address
			ep{"fd00:10:2::16", "n2", "elsewhere", true}),
		// only6 won an IPv6 tunnel IP only: its IPv4 endpoints get nothing.
		slice("a", "only6", ep{"10.1.0.12", node, "v4only", true}),
		slice6("a", "only6", ep{"fd00:10:1::11", node, "dual", true}),
		// only4 won an IPv4 tunnel IP only: its IPv6 endpoints get nothing.
		slice6("a", "only4", ep{"fd00:10:1::13", node, "v6only", true}),
		// An IPv6 endpoint of a pod without an IPv6 address.
		slice6("a", "only6", ep{"fd00:10:1::12", node, "v4only", true}),
	}
	fqdn := slice("a", "web", ep{"web.example", node, "dual", true})
	fqdn.Name, fqdn.AddressType = "web-fqdn", discoveryv1.AddressTypeFQDN
	esl = append(esl, fqdn)

	got, problems := desiredOf(node, winners, cached(esl...), pods)
	// stale6 keeps its IPv4 tunnel IP: the stale IPv6 endpoint costs it the IPv6 one only.
	want := "a/byaddr=2001:db8::10 a/dual=192.0.2.10,2001:db8::10,2001:db8::11 a/stale6=192.0.2.10 a/v4only=192.0.2.10 a/v6only=2001:db8::10"
	if s := summary(got); s != want {
		t.Errorf("desired = %q\n want %q", s, want)
	}
	joined := strings.Join(problems, "\n")
	for _, p := range []string{
		"EndpointSlice a/web-6: endpoints[3].addresses[0] fd00:10:1::99 is not the IPv6 address fd00:10:1::14 of pod a/stale6",
		"EndpointSlice a/only6-6: endpoints[0]: pod a/v4only has no IPv6 address in status.podIPs yet",
	} {
		if !strings.Contains(joined, p) {
			t.Errorf("problems = %q, want one containing %q", joined, p)
		}
	}
	if len(problems) != 2 {
		t.Errorf("problems = %q, want exactly 2 (wrong-family endpoints are ignored silently)", joined)
	}
	// Each pod carries both its addresses, whatever it serves.
	for key, wantPod := range map[string]runtime.Pod{
		"a/dual":   {Namespace: "a", Name: "dual", UID: "uid-dual", IP: netip.MustParseAddr("10.1.0.11"), IPv6: netip.MustParseAddr("fd00:10:1::11")},
		"a/v4only": {Namespace: "a", Name: "v4only", UID: "uid-v4only", IP: netip.MustParseAddr("10.1.0.12")},
		"a/v6only": {Namespace: "a", Name: "v6only", UID: "uid-v6only", IPv6: netip.MustParseAddr("fd00:10:1::13")},
	} {
		if got[key].Pod != wantPod {
			t.Errorf("%s: pod = %+v, want %+v", key, got[key].Pod, wantPod)
		}
	}
	if ips := got["a/dual"].TunnelIPsOf(true); !slices.Equal(ips, []netip.Addr{v6vip1, v6vip2}) {
		t.Errorf("TunnelIPsOf(IPv6) = %v", ips)
	}
}

// TestDesiredDualStackAnnotation: a Service annotated with one tunnel IP
// of each family serves each to its endpoints of that family, through the
// whole claim decision; a pool refusing the IPv6 one leaves the IPv4 one
// served.
func TestDesiredDualStackAnnotation(t *testing.T) {
	if ips, err := tunnelclaim.ParseIPs("192.0.2.10, 2001:db8::10"); err != nil || len(ips) != 2 {
		t.Skipf("the annotation parser does not take two families yet: %v", err)
	}
	const node = "n1"
	pods := []*corev1.Pod{dualPod("a", "web-1", node, "10.1.0.11", "fd00:10:1::11")}
	esl := cached(slice("a", "web", ep{"10.1.0.11", node, "web-1", true}), slice6("a", "web", ep{"fd00:10:1::11", node, "web-1", true}))
	services := []*corev1.Service{tunnelService("a", "web", "192.0.2.10, 2001:db8::10", time.Hour)}
	got, problems, refused := Desired(node, testPools, tunnelclaim.Networks{}, services, esl, pods)
	if s := summary(got); s != "a/web-1=192.0.2.10,2001:db8::10" || len(problems) > 0 || len(refused) > 0 {
		t.Errorf("desired = %q, problems %q, refused %v; want both tunnel IPs served", s, problems, refused)
	}
	only4 := tunnelclaim.Pools{testPools[0]}
	got, _, refused = Desired(node, only4, tunnelclaim.Networks{}, services, esl, pods)
	if s := summary(got); s != "a/web-1=192.0.2.10" || len(refused) != 1 || refused[0].VIP != v6vip1 {
		t.Errorf("with no IPv6 pool: desired = %q, refused %v; want the IPv4 tunnel IP alone served", s, refused)
	}
}

func TestPodAddrs(t *testing.T) {
	for _, tc := range []struct {
		pod    *corev1.Pod
		v4, v6 string
	}{
		{dualPod("a", "p", "n1", "10.1.0.11", "fd00::11"), "10.1.0.11", "fd00::11"},
		{dualPod("a", "p", "n1", "fd00::11", "10.1.0.11"), "10.1.0.11", "fd00::11"}, // IPv6 primary
		{dualPod("a", "p", "n1", "fd00::11"), "invalid IP", "fd00::11"},
		{testPod("a", "p", "n1", "10.1.0.11"), "10.1.0.11", "invalid IP"}, // status.podIP alone
		{testPod("a", "p", "n1", ""), "invalid IP", "invalid IP"},
		{dualPod("a", "p", "n1", "::ffff:10.1.0.11", "fe80::1%eth0"), "invalid IP", "invalid IP"},
	} {
		v4, v6 := podAddrs(tc.pod)
		if v4.String() != tc.v4 || v6.String() != tc.v6 {
			t.Errorf("podAddrs(%v, %v) = %v, %v; want %s, %s", tc.pod.Status.PodIP, tc.pod.Status.PodIPs, v4, v6, tc.v4, tc.v6)
		}
	}
}
