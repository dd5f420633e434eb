package endpoint

import (
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/cmdnu/kube-service-tunnel/endpoint/guard"
	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

// PodTunnels is the desired state of one local pod: the tunnel IPs it serves.
type PodTunnels struct {
	Pod runtime.Pod
	// TunnelIPs is sorted (IPv4 first) and free of duplicates; empty means
	// the pod must hold nothing of the agent's. An IPv4 tunnel IP is
	// decapsulated towards Pod.IP, an IPv6 one towards Pod.IPv6.
	TunnelIPs []netip.Addr
	// Policy and Policy6 are the pod's tunneled ingress policy rules
	// (WithPolicies) for its IPv4 tunnel IPs (iptables) and its IPv6 ones
	// (ip6tables); each is nil when the pod has no tunnel IP of its
	// family, and both are nil when network policy is off. When no
	// NetworkPolicy isolates the pod (Isolated false) a family's rules
	// accept everything and only turn on connection tracking in its
	// namespace.
	Policy, Policy6 *netpol.Rules
	// Guard and Guard6 are the pod's carrier guard (WithGuards) for its
	// IPv4 and IPv6 raw tables: each is nil when the pod has no address of
	// its family.
	Guard, Guard6 *guard.Rules
}

// Equal reports whether two desired states are the same.
func (p PodTunnels) Equal(o PodTunnels) bool {
	return p.Pod == o.Pod && slices.Equal(p.TunnelIPs, o.TunnelIPs) && p.Policy.Equal(o.Policy) && p.Policy6.Equal(o.Policy6) &&
		p.Guard.Equal(o.Guard) && p.Guard6.Equal(o.Guard6)
}

// GuardOf returns the pod's IPv6 carrier guard (ipv6) or its IPv4 one.
func (p PodTunnels) GuardOf(ipv6 bool) *guard.Rules {
	if ipv6 {
		return p.Guard6
	}
	return p.Guard
}

// WithGuards sets the carrier guard of every pod of desired: the carrier is
// accepted only from carriers (the router nodes' addresses), a decapsulated
// packet only to one of the pod's tunnel IPs of its family, and a tunnel IP
// only through the decapsulation path. A family of which the pod has no
// address gets none (its table is not read).
func WithGuards(desired map[string]PodTunnels, cfg Config, carriers []netip.Addr) {
	for key, pt := range desired {
		for _, ipv6 := range []bool{false, true} {
			podIP := pt.Pod.Addr(ipv6)
			if !podIP.IsValid() {
				continue
			}
			p := guard.Params{MPLS: cfg.Mode == encap.MPLS, PodIP: podIP, TunnelIPs: pt.TunnelIPsOf(ipv6)}
			for _, a := range carriers {
				if a.Is6() == ipv6 {
					p.Routers = append(p.Routers, a)
				}
			}
			if !p.MPLS {
				p.Device, p.Other = cfg.Device, cfg.IPv6Device()
				if ipv6 {
					p.Device, p.Other = p.Other, p.Device
				}
			}
			if ipv6 {
				pt.Guard6 = guard.Render(p)
			} else {
				pt.Guard = guard.Render(p)
			}
		}
		desired[key] = pt
	}
}

// CarrierSources returns the addresses the carrier is accepted from: every
// InternalIP and ExternalIP of the Nodes that routers selects, and extra,
// sorted and without duplicates.
func CarrierSources(nodes []*corev1.Node, routers labels.Selector, extra []netip.Addr) []netip.Addr {
	out := slices.Clone(extra)
	for _, n := range nodes {
		if !routers.Matches(labels.Set(n.Labels)) {
			continue
		}
		for _, a := range n.Status.Addresses {
			if a.Type != corev1.NodeInternalIP && a.Type != corev1.NodeExternalIP {
				continue
			}
			if ip, err := netip.ParseAddr(a.Address); err == nil && ip.Zone() == "" {
				out = append(out, ip.Unmap())
			}
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// Isolated reports whether a NetworkPolicy restricts the pod's tunneled
// traffic.
func (p PodTunnels) Isolated() bool {
	return p.Policy != nil && p.Policy.Isolated || p.Policy6 != nil && p.Policy6.Isolated
}

// TunnelIPsOf returns the pod's IPv6 tunnel IPs (ipv6) or its IPv4 ones.
func (p PodTunnels) TunnelIPsOf(ipv6 bool) []netip.Addr {
	return tunnelIPsOf(p.TunnelIPs, ipv6)
}

// PolicyOf returns the rules of the pod's IPv6 tunnel IPs (ipv6) or of its
// IPv4 ones.
func (p PodTunnels) PolicyOf(ipv6 bool) *netpol.Rules {
	if ipv6 {
		return p.Policy6
	}
	return p.Policy
}

func tunnelIPsOf(ips []netip.Addr, ipv6 bool) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.Is6() == ipv6 {
			out = append(out, ip)
		}
	}
	return out
}

// WithPolicies sets the Policy and Policy6 of every pod in desired from the
// ingress NetworkPolicies that select it (netpol.ForPod, resolved against
// cluster); localPods are the node's pods by "namespace/name". problems
// name each policy field that could not be used, once.
func WithPolicies(desired map[string]PodTunnels, localPods map[string]*corev1.Pod, policies []*networkingv1.NetworkPolicy, cluster netpol.Cluster) (problems []string) {
	seen := map[string]bool{}
	for key, pt := range desired {
		pod := localPods[key]
		if pod == nil {
			continue
		}
		in, p := netpol.ForPod(pod, policies, cluster)
		for _, msg := range p {
			if !seen[msg] {
				seen[msg] = true
				problems = append(problems, msg)
			}
		}
		pt.Policy = netpol.Render(in, pt.TunnelIPsOf(false))
		pt.Policy6 = netpol.Render(in, pt.TunnelIPsOf(true))
		desired[key] = pt
	}
	slices.Sort(problems)
	return problems
}

// podAddrs returns a pod's IPv4 and IPv6 addresses from status.podIPs (and
// status.podIP, its first): the first of each family, the zero Addr when
// it has none of that family.
func podAddrs(pod *corev1.Pod) (v4, v6 netip.Addr) {
	ips := []string{pod.Status.PodIP}
	for _, ip := range pod.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	for _, s := range ips {
		a, err := netip.ParseAddr(s)
		switch {
		case err != nil || a.Is4In6() || a.Zone() != "":
		case a.Is4() && !v4.IsValid():
			v4 = a
		case a.Is6() && !v6.IsValid():
			v6 = a
		}
	}
	return v4, v6
}

// runtimePod identifies pod for the runtime (its namespace's search) and
// for the desired state.
func runtimePod(pod *corev1.Pod) runtime.Pod {
	v4, v6 := podAddrs(pod)
	return runtime.Pod{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), IP: v4, IPv6: v6}
}

// family names an address family as the EndpointSlice API does.
func family(ipv6 bool) string {
	if ipv6 {
		return "IPv6"
	}
	return "IPv4"
}

// Desired computes, for every pod of this node that backs a tunnel Service,
// the tunnel IPs it must hold, keyed by "namespace/name". It is a pure
// function of the objects, so every run over the same objects gives the same
// answer.
//
// A Service's tunnel IP goes to the endpoints of its EndpointSlices of the
// same address family (an IPv4 tunnel IP to the IPv4 slices, an IPv6 one to
// the IPv6 slices) whose pod runs on node, whatever their
// ready/serving/terminating conditions: the routers decide who gets new
// flows, and a pod that is not ready or is draining must still accept the
// flows it already has. Of several Services claiming one tunnel IP, only
// the winner (tunnelclaim.Decide) counts, as on the routers; only pods of
// the Service's own namespace are served (a slice naming another
// namespace's pod, by targetRef or by address, is a problem); a Service
// whose tunnel IP the address pools refuse (Pools.Admit, given the
// cluster's known networks) claims nothing and is listed in refused.
// Entries that cannot be used are skipped and described in problems, one
// line each naming the object and field. A Service with no endpoints of a
// family is the routers' to report.
func Desired(node string, pools tunnelclaim.Pools, known tunnelclaim.Networks, services []*corev1.Service, endpointSlices []*kubeobj.EndpointSlice, pods []*corev1.Pod) (desired map[string]PodTunnels, problems []string, refused []tunnelclaim.Claim) {
	decision := tunnelclaim.Decide(services, pools, known)
	desired, problems = desiredOf(node, decision.Winners, endpointSlices, pods)
	return desired, problems, decision.With(tunnelclaim.Refused)
}

// Unlisted returns, for each local pod that lists the readiness gate
// ReadinessGate, the tunnel IPs it will serve but is not served yet: those
// of the tunnel Services whose selector matches its labels, of a family it
// has an address of, that desired (Desired's result) does not give it.
// The EndpointSlice controller lists a pod that is not ready yet; until it
// has, the agent cannot know the pod's tunnel IPs from the slices alone,
// and must not open the gate of a pod it is about to serve.
func Unlisted(node string, pools tunnelclaim.Pools, known tunnelclaim.Networks, services []*corev1.Service, pods []*corev1.Pod, desired map[string]PodTunnels) map[string][]netip.Addr {
	gated := localGatedPods(node, pods)
	if len(gated) == 0 {
		return nil
	}
	// Decide again over the annotated Services only: the winners are the
	// same (only those claim), and only a node with gated pods pays it.
	var tunnelServices []*corev1.Service
	for _, svc := range services {
		if _, ok := svc.Annotations[tunnelclaim.Annotation]; ok {
			tunnelServices = append(tunnelServices, svc)
		}
	}
	if len(tunnelServices) == 0 {
		return nil
	}
	winners := tunnelclaim.Decide(tunnelServices, pools, known).Winners
	out := map[string][]netip.Addr{}
	for _, pod := range gated {
		key := pod.Namespace + "/" + pod.Name
		v4, v6 := podAddrs(pod)
		for vip, svc := range winners {
			if svc.Namespace != pod.Namespace || len(svc.Spec.Selector) == 0 ||
				!labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(pod.Labels)) {
				continue
			}
			if (vip.Is4() && !v4.IsValid()) || (vip.Is6() && !v6.IsValid()) {
				continue
			}
			if !slices.Contains(desired[key].TunnelIPs, vip) {
				out[key] = append(out[key], vip)
			}
		}
		slices.SortFunc(out[key], netip.Addr.Compare)
	}
	return out
}

// desiredOf is Desired given the claim decision's winners: every served
// tunnel IP, of either family, and the Service that has it.
func desiredOf(node string, winnerOf map[netip.Addr]*corev1.Service, endpointSlices []*kubeobj.EndpointSlice, pods []*corev1.Pod) (desired map[string]PodTunnels, problems []string) {
	// The tunnel IPs each Service won, at most one per family.
	type won struct{ v4, v6 netip.Addr }
	winners := make(map[string]won, len(winnerOf))
	for vip, svc := range winnerOf {
		key := tunnelclaim.ServiceKey(svc)
		w := winners[key]
		if vip.Is4() {
			w.v4 = vip
		} else {
			w.v6 = vip
		}
		winners[key] = w
	}

	localPods := map[string]*corev1.Pod{}
	podByIP := map[netip.Addr]*corev1.Pod{}
	for _, pod := range pods {
		if pod.Spec.NodeName != node || pod.Spec.HostNetwork {
			continue
		}
		if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		localPods[pod.Namespace+"/"+pod.Name] = pod
		for _, ip := range runtimePod(pod).Addrs() {
			podByIP[ip] = pod
		}
	}

	sets := map[string]map[netip.Addr]bool{}
	for _, es := range endpointSlices {
		w, ok := winners[es.Namespace+"/"+es.Service]
		if !ok {
			continue
		}
		var ipv6 bool
		vip := w.v4
		switch es.AddressType {
		case discoveryv1.AddressTypeIPv4:
		case discoveryv1.AddressTypeIPv6:
			ipv6, vip = true, w.v6
		default:
			continue // FQDN: the router reports this once per Service
		}
		if !vip.IsValid() {
			continue // no tunnel IP of the slice's family
		}
		name := "EndpointSlice " + es.Namespace + "/" + es.Name
		for i, ep := range es.Endpoints {
			if ep.NodeName != "" && ep.NodeName != node {
				continue
			}
			addr, err := netip.ParseAddr(ep.Address)
			if err != nil || addr.Is6() != ipv6 || addr.Is4In6() {
				continue // not of the slice's family: the API refuses it
			}
			pod := podOf(ep, localPods, podByIP)
			if pod == nil {
				if ep.NodeName != "" {
					problems = append(problems, fmt.Sprintf("%s: endpoints[%d] (%v) names node %s but no running pod of this node matches its targetRef or address", name, i, addr, node))
				}
				continue
			}
			if pod.Namespace != es.Namespace {
				// The CVE-2021-25740 class: a selector-less Service and a
				// hand-written slice must not put a tunnel IP into a pod
				// its author could not otherwise reach.
				problems = append(problems, fmt.Sprintf("%s: endpoints[%d] (%v) is pod %s/%s of another namespace: a tunnel IP is carried only to pods of its Service's namespace %s; skipped", name, i, addr, pod.Namespace, pod.Name, es.Namespace))
				continue
			}
			podIP := runtimePod(pod).Addr(ipv6)
			if !podIP.IsValid() {
				problems = append(problems, fmt.Sprintf("%s: endpoints[%d]: pod %s/%s has no %s address in status.podIPs yet", name, i, pod.Namespace, pod.Name, family(ipv6)))
				continue
			}
			if podIP != addr {
				problems = append(problems, fmt.Sprintf("%s: endpoints[%d].addresses[0] %v is not the %s address %v of pod %s/%s in status.podIPs (stale slice?)", name, i, addr, family(ipv6), podIP, pod.Namespace, pod.Name))
				continue
			}
			key := pod.Namespace + "/" + pod.Name
			if sets[key] == nil {
				sets[key] = map[netip.Addr]bool{}
			}
			sets[key][vip] = true
		}
	}

	desired = make(map[string]PodTunnels, len(sets))
	for key, set := range sets {
		pt := PodTunnels{Pod: runtimePod(localPods[key])}
		for vip := range set {
			pt.TunnelIPs = append(pt.TunnelIPs, vip)
		}
		slices.SortFunc(pt.TunnelIPs, netip.Addr.Compare)
		desired[key] = pt
	}
	return desired, problems
}

// podOf finds the local pod behind an endpoint: by its targetRef when it names
// a Pod, else by its address.
func podOf(ep kubeobj.Endpoint, localPods map[string]*corev1.Pod, podByIP map[netip.Addr]*corev1.Pod) *corev1.Pod {
	if ref := ep.Pod; !ref.IsZero() {
		pod := localPods[ref.Key()]
		if pod != nil && ref.UID != "" && string(pod.UID) != ref.UID {
			return nil // a different pod of the same name
		}
		return pod
	}
	addr, err := netip.ParseAddr(ep.Address)
	if err != nil {
		return nil
	}
	return podByIP[addr]
}
