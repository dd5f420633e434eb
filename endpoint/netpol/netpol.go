// Package netpol computes which tunneled packets the ingress
// NetworkPolicies of a pod admit, as pure data, with the semantics of the
// NetworkPolicy API (networking.k8s.io/v1): the first step of enforcing
// them on the decapsulated packets inside the pod. The endpoint agent
// renders the result (Render) into each served pod's filter tables, one per
// address family of its tunnel IPs (iptables for IPv4, ip6tables for
// IPv6), each with the sources of its family.
//
// A pod that no policy with Ingress in its policyTypes selects is not
// isolated: every packet is admitted. Once one selects it, a packet is
// admitted when some ingress rule of one of those policies admits it: its
// source is one of the rule's peers (an ipBlock's CIDR minus its excepts,
// or the IP of a pod the peer's pod and namespace selectors select) and its
// protocol and destination port are one of the rule's ports (a number, a
// range with endPort, or a name resolved from the pod's own container
// ports). An empty list of peers, or of ports, admits all.
package netpol

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Ingress is what a pod's ingress policies admit.
type Ingress struct {
	// Isolated is false when no ingress policy selects the pod: it admits
	// everything, and Rules is empty.
	Isolated bool
	// Policies name ("namespace/name", in name order) the ingress policies
	// that select the pod.
	Policies []string
	// Rules admit a packet when any one of them does.
	Rules []Rule
}

// Rule is one ingress rule, resolved.
type Rule struct {
	// AllSources: the rule had no peers (from: []).
	AllSources bool
	// Sources are the admitted source ranges (pods as single addresses).
	Sources []Source
	// AllPorts: the rule had no ports.
	AllPorts bool
	// Ports are the admitted protocols and destination ports.
	Ports []Port
}

// Source is a range of client addresses: Prefix minus each of Except.
type Source struct {
	Prefix netip.Prefix
	Except []netip.Prefix
}

// Port is a protocol and a range of destination ports; First 0 means
// every port of the protocol.
type Port struct {
	Protocol    corev1.Protocol
	First, Last uint16
}

// Cluster is what the peers' selectors are matched against.
type Cluster struct {
	// Namespaces by name, for their labels.
	Namespaces map[string]*corev1.Namespace
	// Pods of every namespace (their labels and IPs).
	Pods []*corev1.Pod
}

// ForPod resolves the ingress of pod under policies (any namespace: only
// those of the pod's select it). problems name what could not be used
// (an invalid selector or CIDR), each naming the policy and the field; a
// rule with such a part admits less, never more.
func ForPod(pod *corev1.Pod, policies []*networkingv1.NetworkPolicy, cluster Cluster) (in Ingress, problems []string) {
	// In name order: the same policies give the same rules, whatever order
	// a lister returns them in (a restarted agent must find its rules
	// unchanged).
	policies = slices.Clone(policies)
	slices.SortFunc(policies, func(a, b *networkingv1.NetworkPolicy) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	for _, np := range policies {
		if np.Namespace != pod.Namespace || !hasIngress(np) {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil {
			problems = append(problems, fmt.Sprintf("NetworkPolicy %s/%s: spec.podSelector: %v (it selects no pod)", np.Namespace, np.Name, err))
			continue
		}
		if !sel.Matches(labels.Set(pod.Labels)) {
			continue
		}
		in.Isolated = true
		in.Policies = append(in.Policies, np.Namespace+"/"+np.Name)
		for i, r := range np.Spec.Ingress {
			rule, p := resolveRule(pod, np, i, r, cluster)
			problems = append(problems, p...)
			in.Rules = append(in.Rules, rule)
		}
	}
	return in, problems
}

// hasIngress reports whether np is an ingress policy: policyTypes lists
// Ingress, or is empty (then every policy is one).
func hasIngress(np *networkingv1.NetworkPolicy) bool {
	return len(np.Spec.PolicyTypes) == 0 || slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress)
}

func resolveRule(pod *corev1.Pod, np *networkingv1.NetworkPolicy, i int, r networkingv1.NetworkPolicyIngressRule, cluster Cluster) (rule Rule, problems []string) {
	field := func(f string, args ...any) string {
		return fmt.Sprintf("NetworkPolicy %s/%s: spec.ingress[%d].%s", np.Namespace, np.Name, i, fmt.Sprintf(f, args...))
	}
	rule.AllSources = len(r.From) == 0
	for j, peer := range r.From {
		if peer.IPBlock != nil {
			src, err := ipBlock(peer.IPBlock)
			if err != nil {
				problems = append(problems, field("from[%d].ipBlock: %v (admits nothing)", j, err))
				continue
			}
			rule.Sources = append(rule.Sources, src)
			continue
		}
		addrs, err := peerPods(np.Namespace, peer, cluster)
		if err != nil {
			problems = append(problems, field("from[%d]: %v (admits nothing)", j, err))
			continue
		}
		for _, a := range addrs {
			rule.Sources = append(rule.Sources, Source{Prefix: netip.PrefixFrom(a, a.BitLen())})
		}
	}
	rule.AllPorts = len(r.Ports) == 0
	for j, p := range r.Ports {
		port, ok, err := resolvePort(pod, p)
		if err != nil {
			problems = append(problems, field("ports[%d]: %v (admits nothing)", j, err))
			continue
		}
		if ok {
			rule.Ports = append(rule.Ports, port)
		}
	}
	return rule, problems
}

func ipBlock(b *networkingv1.IPBlock) (Source, error) {
	p, err := netip.ParsePrefix(b.CIDR)
	if err != nil {
		return Source{}, fmt.Errorf("cidr %q: %w", b.CIDR, err)
	}
	src := Source{Prefix: p.Masked()}
	for _, e := range b.Except {
		ep, err := netip.ParsePrefix(e)
		if err != nil {
			return Source{}, fmt.Errorf("except %q: %w", e, err)
		}
		src.Except = append(src.Except, ep.Masked())
	}
	return src, nil
}

// peerPods returns the IPs of the pods a pod/namespace selector peer of a
// policy in namespace ns selects: podSelector alone, in ns;
// namespaceSelector alone, every pod of the namespaces it selects; both,
// the pods podSelector selects in those namespaces. Host-network pods are
// left out (their address is their node's).
func peerPods(ns string, peer networkingv1.NetworkPolicyPeer, cluster Cluster) ([]netip.Addr, error) {
	podSel := labels.Everything()
	if peer.PodSelector != nil {
		s, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
		if err != nil {
			return nil, fmt.Errorf("podSelector: %w", err)
		}
		podSel = s
	}
	inNamespace := func(name string) bool { return name == ns }
	if peer.NamespaceSelector != nil {
		nsSel, err := metav1.LabelSelectorAsSelector(peer.NamespaceSelector)
		if err != nil {
			return nil, fmt.Errorf("namespaceSelector: %w", err)
		}
		inNamespace = func(name string) bool {
			n, ok := cluster.Namespaces[name]
			return ok && nsSel.Matches(labels.Set(n.Labels))
		}
	}
	var out []netip.Addr
	for _, p := range cluster.Pods {
		if p.Spec.HostNetwork || !inNamespace(p.Namespace) || !podSel.Matches(labels.Set(p.Labels)) {
			continue
		}
		ips := []string{p.Status.PodIP}
		for _, ip := range p.Status.PodIPs {
			ips = append(ips, ip.IP)
		}
		for _, ip := range ips {
			if a, err := netip.ParseAddr(ip); err == nil {
				out = append(out, a.Unmap())
			}
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out), nil
}

// resolvePort turns a policy port into a range; ok is false for a named
// port the pod does not have (it admits nothing, as the API says).
func resolvePort(pod *corev1.Pod, p networkingv1.NetworkPolicyPort) (port Port, ok bool, err error) {
	port.Protocol = corev1.ProtocolTCP
	if p.Protocol != nil {
		port.Protocol = *p.Protocol
	}
	if p.Port == nil {
		return port, true, nil // every port of the protocol
	}
	if p.Port.Type == intstr.String {
		for _, c := range pod.Spec.Containers {
			for _, cp := range c.Ports {
				proto := cp.Protocol
				if proto == "" {
					proto = corev1.ProtocolTCP
				}
				if cp.Name == p.Port.StrVal && proto == port.Protocol && cp.ContainerPort > 0 && cp.ContainerPort < 1<<16 {
					port.First, port.Last = uint16(cp.ContainerPort), uint16(cp.ContainerPort)
					return port, true, nil
				}
			}
		}
		return port, false, nil
	}
	n := p.Port.IntVal
	if n < 1 || n > 65535 {
		return port, false, fmt.Errorf("port %d is not 1-65535", n)
	}
	port.First, port.Last = uint16(n), uint16(n)
	if p.EndPort != nil {
		if *p.EndPort < n || *p.EndPort > 65535 {
			return port, false, fmt.Errorf("endPort %d is not between port %d and 65535", *p.EndPort, n)
		}
		port.Last = uint16(*p.EndPort)
	}
	return port, true, nil
}

// Allows reports whether in admits a packet from src with protocol and
// destination port (0 for protocols without ports).
func (in Ingress) Allows(src netip.Addr, protocol corev1.Protocol, port uint16) bool {
	if !in.Isolated {
		return true
	}
	src = src.Unmap()
	for _, r := range in.Rules {
		if r.allowsSource(src) && r.allowsPort(protocol, port) {
			return true
		}
	}
	return false
}

func (r Rule) allowsSource(src netip.Addr) bool {
	if r.AllSources {
		return true
	}
	for _, s := range r.Sources {
		if s.Prefix.Contains(src) && !slices.ContainsFunc(s.Except, func(e netip.Prefix) bool { return e.Contains(src) }) {
			return true
		}
	}
	return false
}

func (r Rule) allowsPort(protocol corev1.Protocol, port uint16) bool {
	if r.AllPorts {
		return true
	}
	for _, p := range r.Ports {
		if p.Protocol == protocol && (p.First == 0 || (port >= p.First && port <= p.Last)) {
			return true
		}
	}
	return false
}
