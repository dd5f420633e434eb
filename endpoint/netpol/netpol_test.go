package netpol

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The cluster of the cases, after the upstream NetworkPolicy e2e suite's
// model (namespaces x, y, z with pods a, b, c): here namespaces web (the
// served pod's, labelled team=web) and ops (team=ops), each with pods
// labelled app=api and app=db.
var (
	served = pod("web", "api", "10.244.1.10", corev1.ContainerPort{Name: "http", ContainerPort: 8080}, corev1.ContainerPort{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP})
	webDB  = pod("web", "db", "10.244.1.11")
	opsAPI = pod("ops", "api", "10.244.2.10")
	opsDB  = pod("ops", "db", "10.244.2.11")
	hostNS = func() *corev1.Pod {
		p := pod("ops", "agent", "172.20.0.21")
		p.Spec.HostNetwork = true
		return p
	}()
	cluster = Cluster{
		Namespaces: map[string]*corev1.Namespace{
			"web": {ObjectMeta: metav1.ObjectMeta{Name: "web", Labels: map[string]string{"team": "web"}}},
			"ops": {ObjectMeta: metav1.ObjectMeta{Name: "ops", Labels: map[string]string{"team": "ops"}}},
		},
		Pods: []*corev1.Pod{served, webDB, opsAPI, opsDB, hostNS},
	}
	outside = netip.MustParseAddr("198.51.100.10")
	office  = netip.MustParseAddr("203.0.113.7")
)

func pod(ns, app, ip string, ports ...corev1.ContainerPort) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: app, Labels: map[string]string{"app": app}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Ports: ports}}},
		Status:     corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: ip}}},
	}
}

func policy(name string, sel map[string]string, types []networkingv1.PolicyType, rules ...networkingv1.NetworkPolicyIngressRule) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "web", Name: name},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: sel}, PolicyTypes: types, Ingress: rules},
	}
}

func ptr[T any](v T) *T { return &v }

func tcp(port int32) networkingv1.NetworkPolicyPort {
	return networkingv1.NetworkPolicyPort{Port: ptr(intstr.FromInt32(port))}
}

func from(peers ...networkingv1.NetworkPolicyPeer) networkingv1.NetworkPolicyIngressRule {
	return networkingv1.NetworkPolicyIngressRule{From: peers}
}

func block(cidr string, except ...string) networkingv1.NetworkPolicyPeer {
	return networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: cidr, Except: except}}
}

// probe is one packet to the served pod: source, protocol, port, and
// whether the policies must admit it.
type probe struct {
	src   netip.Addr
	proto corev1.Protocol
	port  uint16
	want  bool
}

func TestForPod(t *testing.T) {
	web, ops := netip.MustParseAddr("10.244.1.11"), netip.MustParseAddr("10.244.2.10")
	opsDBAddr := netip.MustParseAddr("10.244.2.11")
	for _, c := range []struct {
		name     string
		policies []*networkingv1.NetworkPolicy
		probes   []probe
	}{
		{"no policy: all admitted", nil, []probe{{outside, "TCP", 80, true}, {office, "UDP", 53, true}}},
		{"a policy of another pod: not isolated", []*networkingv1.NetworkPolicy{policy("db-only", map[string]string{"app": "db"}, nil)},
			[]probe{{outside, "TCP", 80, true}}},
		{"egress-only policy: not isolated", []*networkingv1.NetworkPolicy{policy("egress", nil, []networkingv1.PolicyType{networkingv1.PolicyTypeEgress})},
			[]probe{{outside, "TCP", 80, true}}},
		{"default deny (no rule)", []*networkingv1.NetworkPolicy{policy("deny", nil, nil)},
			[]probe{{outside, "TCP", 80, false}, {web, "TCP", 8080, false}}},
		{"allow all (one empty rule)", []*networkingv1.NetworkPolicy{policy("all", nil, nil, networkingv1.NetworkPolicyIngressRule{})},
			[]probe{{outside, "TCP", 80, true}, {office, "SCTP", 9, true}}},
		{"ipBlock with except", []*networkingv1.NetworkPolicy{policy("office", map[string]string{"app": "api"}, nil,
			from(block("203.0.113.0/24", "203.0.113.0/29")))},
			[]probe{{office, "TCP", 80, false}, {netip.MustParseAddr("203.0.113.8"), "TCP", 80, true}, {outside, "TCP", 80, false}}},
		{"port only: any source, that port", []*networkingv1.NetworkPolicy{policy("p", nil, nil, networkingv1.NetworkPolicyIngressRule{Ports: []networkingv1.NetworkPolicyPort{tcp(80)}})},
			[]probe{{outside, "TCP", 80, true}, {outside, "TCP", 81, false}, {outside, "UDP", 80, false}}},
		{"endPort range", []*networkingv1.NetworkPolicy{policy("range", nil, nil, networkingv1.NetworkPolicyIngressRule{
			Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromInt32(8000)), EndPort: ptr(int32(8010))}}})},
			[]probe{{outside, "TCP", 8000, true}, {outside, "TCP", 8010, true}, {outside, "TCP", 8011, false}, {outside, "TCP", 7999, false}}},
		{"named ports from the pod's containers, with their protocol", []*networkingv1.NetworkPolicy{policy("named", nil, nil, networkingv1.NetworkPolicyIngressRule{
			Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromString("http"))}, {Protocol: ptr(corev1.ProtocolUDP), Port: ptr(intstr.FromString("dns"))}, {Port: ptr(intstr.FromString("missing"))}}})},
			[]probe{{outside, "TCP", 8080, true}, {outside, "UDP", 53, true}, {outside, "TCP", 53, false}, {outside, "UDP", 8080, false}}},
		{"protocol without a port: all its ports", []*networkingv1.NetworkPolicy{policy("udp", nil, nil, networkingv1.NetworkPolicyIngressRule{
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: ptr(corev1.ProtocolUDP)}}})},
			[]probe{{outside, "UDP", 5353, true}, {outside, "TCP", 5353, false}}},
		{"podSelector peer: pods of the policy's namespace, never an outside address", []*networkingv1.NetworkPolicy{policy("pods", nil, nil,
			from(networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}}))},
			[]probe{{web, "TCP", 80, true}, {opsDBAddr, "TCP", 80, false}, {outside, "TCP", 80, false}}},
		{"namespaceSelector peer: every pod of those namespaces, not host-network pods", []*networkingv1.NetworkPolicy{policy("ns", nil, nil,
			from(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "ops"}}}))},
			[]probe{{ops, "TCP", 80, true}, {opsDBAddr, "TCP", 80, true}, {web, "TCP", 80, false}, {netip.MustParseAddr("172.20.0.21"), "TCP", 80, false}}},
		{"both selectors in one peer: their intersection", []*networkingv1.NetworkPolicy{policy("and", nil, nil,
			from(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{}, PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "api"}}}))},
			[]probe{{ops, "TCP", 80, true}, {opsDBAddr, "TCP", 80, false}, {web, "TCP", 80, false}}},
		{"two policies: their union", []*networkingv1.NetworkPolicy{
			policy("office", nil, nil, networkingv1.NetworkPolicyIngressRule{From: []networkingv1.NetworkPolicyPeer{block("203.0.113.0/24")}, Ports: []networkingv1.NetworkPolicyPort{tcp(443)}}),
			policy("ops", nil, nil, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "ops"}}}))},
			[]probe{{office, "TCP", 443, true}, {office, "TCP", 80, false}, {ops, "TCP", 80, true}, {outside, "TCP", 443, false}}},
		{"a policy in another namespace selects nothing here", []*networkingv1.NetworkPolicy{func() *networkingv1.NetworkPolicy {
			p := policy("elsewhere", nil, nil)
			p.Namespace = "ops"
			return p
		}()}, []probe{{outside, "TCP", 80, true}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			in, problems := ForPod(served, c.policies, cluster)
			if len(problems) > 0 {
				t.Errorf("problems: %q", problems)
			}
			for _, p := range c.probes {
				if got := in.Allows(p.src, p.proto, p.port); got != p.want {
					t.Errorf("%v %s/%d: admitted %t, want %t (%+v)", p.src, p.proto, p.port, got, p.want, in)
				}
			}
		})
	}
}

// Bad input admits less, never more, and names the policy and field.
func TestForPodProblems(t *testing.T) {
	bad := policy("bad", nil, nil,
		networkingv1.NetworkPolicyIngressRule{From: []networkingv1.NetworkPolicyPeer{block("203.0.113.0/33")}},
		networkingv1.NetworkPolicyIngressRule{Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromInt32(90)), EndPort: ptr(int32(80))}}},
	)
	in, problems := ForPod(served, []*networkingv1.NetworkPolicy{bad}, cluster)
	if len(problems) != 2 || !strings.Contains(problems[0], "NetworkPolicy web/bad: spec.ingress[0].from[0].ipBlock") || !strings.Contains(problems[1], "spec.ingress[1].ports[0]: endPort 80") {
		t.Errorf("problems %q", problems)
	}
	if !in.Isolated || in.Allows(office, "TCP", 85) || in.Allows(outside, "TCP", 90) {
		t.Errorf("a policy with bad parts admits %+v: it must isolate and admit nothing through them", in)
	}
}

func TestForPodIgnoresPolicyOrder(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "web"}}
	var policies []*networkingv1.NetworkPolicy
	for i, cidr := range []string{"203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24"} {
		policies = append(policies, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: fmt.Sprint("p", i)},
			Spec: networkingv1.NetworkPolicySpec{Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: cidr}}}}}}})
	}
	vips := []netip.Addr{netip.MustParseAddr("192.0.2.10")}
	in, _ := ForPod(pod, policies, Cluster{})
	want := Render(in, vips).Digest
	slices.Reverse(policies)
	if in, _ := ForPod(pod, policies, Cluster{}); Render(in, vips).Digest != want {
		t.Error("the same policies in another order render other rules: a restarted agent would rewrite them")
	}
}
