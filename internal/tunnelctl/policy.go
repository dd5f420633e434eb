package tunnelctl

import (
	"context"
	"fmt"
	"net/netip"
	"strings"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
)

// Policy verdicts of explain.
const (
	PolicyAdmitted    = "admitted"
	PolicyRefused     = "refused"
	PolicyNotIsolated = "not isolated"
	PolicyUnknown     = "unknown"
)

// PolicyVerdict is what the endpoint pod's ingress NetworkPolicies do with
// a new flow, as the endpoint agent enforces them in the pod
// (--network-policy, its default).
type PolicyVerdict struct {
	// Verdict is PolicyAdmitted, PolicyRefused, PolicyNotIsolated (no
	// ingress policy selects the pod: everything is admitted) or
	// PolicyUnknown (Why says what could not be read).
	Verdict string `json:"verdict"`
	// Policies are the ingress policies that select the pod.
	Policies []string `json:"policies,omitempty"`
	Why      string   `json:"why,omitempty"`
	// Problems are parts of those policies that admit nothing (bad input).
	Problems []string `json:"problems,omitempty"`
}

// policyVerdict judges the flow from src to port (protocol proto) against
// the ingress policies of pod "namespace/name", with the API semantics the
// agent uses (netpol.ForPod).
func (inv *Inventory) policyVerdict(ctx context.Context, pod string, src netip.Addr, proto uint8, port uint16) *PolicyVerdict {
	ns, name, ok := strings.Cut(pod, "/")
	if !ok {
		return &PolicyVerdict{Verdict: PolicyUnknown, Why: "the endpoint names no pod"}
	}
	unknown := func(what string, err error) *PolicyVerdict {
		return &PolicyVerdict{Verdict: PolicyUnknown, Why: fmt.Sprintf("cannot read %s: %v", what, err)}
	}
	p, err := inv.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return unknown("pod "+pod, err)
	}
	list, err := inv.client.NetworkingV1().NetworkPolicies(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return unknown("the NetworkPolicies of namespace "+ns, err)
	}
	policies := make([]*networkingv1.NetworkPolicy, len(list.Items))
	for i := range list.Items {
		policies[i] = &list.Items[i]
	}
	// Namespaces and Pods only when a peer selects pods: they can be many.
	var cluster netpol.Cluster
	if selectsPods(policies) {
		nss, err := inv.client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
		if err != nil {
			return unknown("namespaces (a policy's peers select them)", err)
		}
		cluster.Namespaces = map[string]*corev1.Namespace{}
		for i := range nss.Items {
			cluster.Namespaces[nss.Items[i].Name] = &nss.Items[i]
		}
		pods, err := inv.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return unknown("pods (a policy's peers select them)", err)
		}
		for i := range pods.Items {
			cluster.Pods = append(cluster.Pods, &pods.Items[i])
		}
	}
	in, problems := netpol.ForPod(p, policies, cluster)
	v := &PolicyVerdict{Problems: problems, Policies: in.Policies}
	switch {
	case !in.Isolated:
		v.Verdict = PolicyNotIsolated
	case in.Allows(src, protocolOf(proto), port):
		v.Verdict = PolicyAdmitted
	default:
		v.Verdict = PolicyRefused
	}
	return v
}

// selectsPods reports whether an ingress peer of policies selects pods or
// namespaces.
func selectsPods(policies []*networkingv1.NetworkPolicy) bool {
	for _, np := range policies {
		for _, r := range np.Spec.Ingress {
			for _, peer := range r.From {
				if peer.PodSelector != nil || peer.NamespaceSelector != nil {
					return true
				}
			}
		}
	}
	return false
}

// protocolOf is the NetworkPolicy protocol of an IP protocol number ("" for
// those a policy cannot name: only rules without ports admit them).
func protocolOf(p uint8) corev1.Protocol {
	switch p {
	case 6:
		return corev1.ProtocolTCP
	case 17:
		return corev1.ProtocolUDP
	case 132:
		return corev1.ProtocolSCTP
	}
	return ""
}
