package netpol

// The cases of the upstream NetworkPolicy e2e suite
// (test/e2e/network/netpol in kubernetes/kubernetes), restated for the
// agent: its model of namespaces x, y, z (labelled
// kubernetes.io/metadata.name) and pods a, b, c (labelled pod=NAME) in
// each, and, for each case, which pods may open a TCP connection to port
// 80 (or 81) of x/a: the truth table's column of x/a, written out here
// from the API's semantics rather than copied.

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

const nsLabel = "kubernetes.io/metadata.name"

// model is namespaces x, y, z and pods x/a ... z/c with addresses 10.0.N.M.
func model() (Cluster, map[string]*corev1.Pod) {
	c := Cluster{Namespaces: map[string]*corev1.Namespace{}}
	pods := map[string]*corev1.Pod{}
	for i, ns := range []string{"x", "y", "z"} {
		c.Namespaces[ns] = &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{nsLabel: ns}}}
		for j, name := range []string{"a", "b", "c"} {
			p := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"pod": name}},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Ports: []corev1.ContainerPort{
					{Name: "serve-80-tcp", ContainerPort: 80}, {Name: "serve-81-tcp", ContainerPort: 81}}}}},
				Status: corev1.PodStatus{PodIP: fmt.Sprintf("10.0.%d.%d", i+1, j+1)},
			}
			c.Pods = append(c.Pods, p)
			pods[ns+"/"+name] = p
		}
	}
	return c, pods
}

func inX(name string, podLabels map[string]string, rules ...networkingv1.NetworkPolicyIngressRule) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "x", Name: name},
		Spec: networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: podLabels},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}, Ingress: rules},
	}
}

func expr(key string, op metav1.LabelSelectorOperator, values ...string) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: key, Operator: op, Values: values}}}
}

func TestUpstreamTruthTables(t *testing.T) {
	cluster, pods := model()
	all := []string{"x/a", "x/b", "x/c", "y/a", "y/b", "y/c", "z/a", "z/b", "z/c"}
	podB := &metav1.LabelSelector{MatchLabels: map[string]string{"pod": "b"}}
	port81 := intstr.FromInt32(81)
	named81 := intstr.FromString("serve-81-tcp")
	for _, c := range []struct {
		name     string
		target   string
		port     uint16
		policies []*networkingv1.NetworkPolicy
		allowed  []string // sources that reach target
	}{
		{"default-deny-ingress", "x/a", 80, []*networkingv1.NetworkPolicy{inX("deny", nil)}, nil},
		{"allow from pods within the server namespace by podSelector", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("x-a-allows-x-b", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{PodSelector: podB}))},
			[]string{"x/b"}},
		{"podSelector with matchExpressions", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("expr", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{PodSelector: expr("pod", metav1.LabelSelectorOpIn, "b")}))},
			[]string{"x/b"}},
		{"a target allowed under a namespace's default deny", "x/a", 80, []*networkingv1.NetworkPolicy{inX("deny", nil),
			inX("allow-all-to-a", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{}, NamespaceSelector: &metav1.LabelSelector{}}))},
			all},
		{"... and the other pod stays denied", "x/b", 80, []*networkingv1.NetworkPolicy{inX("deny", nil),
			inX("allow-all-to-a", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{}, NamespaceSelector: &metav1.LabelSelector{}}))},
			nil},
		{"from pods in all namespaces", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("all-ns", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{}}}))},
			all},
		{"only from another namespace by namespaceSelector", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("ns-y", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{nsLabel: "y"}}}))},
			[]string{"y/a", "y/b", "y/c"}},
		{"namespaceSelector with matchExpressions", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("ns-y-expr", map[string]string{"pod": "a"}, from(networkingv1.NetworkPolicyPeer{NamespaceSelector: expr(nsLabel, metav1.LabelSelectorOpIn, "y")}))},
			[]string{"y/a", "y/b", "y/c"}},
		{"podSelector or namespaceSelector (two peers)", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("or", map[string]string{"pod": "a"}, from(
				networkingv1.NetworkPolicyPeer{NamespaceSelector: expr(nsLabel, metav1.LabelSelectorOpNotIn, "x")},
				networkingv1.NetworkPolicyPeer{PodSelector: podB}))},
			[]string{"x/b", "y/a", "y/b", "y/c", "z/a", "z/b", "z/c"}},
		{"podSelector and namespaceSelector (one peer)", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("and", map[string]string{"pod": "a"}, from(
				networkingv1.NetworkPolicyPeer{NamespaceSelector: expr(nsLabel, metav1.LabelSelectorOpNotIn, "x"), PodSelector: podB}))},
			[]string{"y/b", "z/b"}},
		{"multiple podSelectors and namespaceSelectors", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("multi", map[string]string{"pod": "a"}, from(
				networkingv1.NetworkPolicyPeer{NamespaceSelector: expr(nsLabel, metav1.LabelSelectorOpNotIn, "x"), PodSelector: expr("pod", metav1.LabelSelectorOpIn, "b", "c")}))},
			[]string{"y/b", "y/c", "z/b", "z/c"}},
		{"any podSelectors", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("any", map[string]string{"pod": "a"}, from(
				networkingv1.NetworkPolicyPeer{PodSelector: podB},
				networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"pod": "c"}}}))},
			[]string{"x/b", "x/c"}},
		{"only from a pod of another namespace", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("y-a", map[string]string{"pod": "a"}, from(
				networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{nsLabel: "y"}}, PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"pod": "a"}}}))},
			[]string{"y/a"}},
		{"ports: 81 admitted from namespace y ...", "x/a", 81,
			[]*networkingv1.NetworkPolicy{inX("port-81", map[string]string{"pod": "a"}, networkingv1.NetworkPolicyIngressRule{
				From:  []networkingv1.NetworkPolicyPeer{{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{nsLabel: "y"}}}},
				Ports: []networkingv1.NetworkPolicyPort{{Port: &port81}}})},
			[]string{"y/a", "y/b", "y/c"}},
		{"... and 80 from no one", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("port-81", map[string]string{"pod": "a"}, networkingv1.NetworkPolicyIngressRule{
				From:  []networkingv1.NetworkPolicyPeer{{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{nsLabel: "y"}}}},
				Ports: []networkingv1.NetworkPolicyPort{{Port: &port81}}})},
			nil},
		{"one named port", "x/a", 81,
			[]*networkingv1.NetworkPolicy{inX("named", map[string]string{"pod": "a"}, networkingv1.NetworkPolicyIngressRule{Ports: []networkingv1.NetworkPolicyPort{{Port: &named81}}})},
			all},
		{"one named port: the other port denied", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("named", map[string]string{"pod": "a"}, networkingv1.NetworkPolicyIngressRule{Ports: []networkingv1.NetworkPolicyPort{{Port: &named81}}})},
			nil},
		{"stacked policies with overlapping podSelectors: the union", "x/a", 80,
			[]*networkingv1.NetworkPolicy{
				inX("allow-81", nil, networkingv1.NetworkPolicyIngressRule{Ports: []networkingv1.NetworkPolicyPort{{Port: &port81}}}),
				inX("allow-80-from-b", map[string]string{"pod": "a"}, networkingv1.NetworkPolicyIngressRule{
					From: []networkingv1.NetworkPolicyPeer{{PodSelector: podB, NamespaceSelector: &metav1.LabelSelector{}}}, Ports: []networkingv1.NetworkPolicyPort{tcp(80)}})},
			[]string{"x/b", "y/b", "z/b"}},
		{"allow-all (one empty rule)", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("deny", nil), inX("allow-all", nil, networkingv1.NetworkPolicyIngressRule{})},
			all},
		{"a policy matching no pod isolates nothing", "x/a", 80,
			[]*networkingv1.NetworkPolicy{inX("nobody", map[string]string{"pod": "d"})},
			all},
	} {
		t.Run(c.name, func(t *testing.T) {
			in, problems := ForPod(pods[c.target], c.policies, cluster)
			if len(problems) > 0 {
				t.Fatal(problems)
			}
			var got []string
			for _, src := range all {
				addr := netip.MustParseAddr(pods[src].Status.PodIP)
				if in.Allows(addr, corev1.ProtocolTCP, c.port) {
					got = append(got, src)
				}
			}
			if !slices.Equal(got, c.allowed) {
				t.Errorf("to %s:%d admitted %s, want %s", c.target, c.port, strings.Join(got, " "), strings.Join(c.allowed, " "))
			}
		})
	}
}
