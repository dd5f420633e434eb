package endpoint

import (
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"

	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

// PodTunnels is the desired state of one local pod: the tunnel IPs it serves.
type PodTunnels struct {
	Pod runtime.Pod
	// TunnelIPs is sorted and free of duplicates; empty means the pod must
	// hold nothing of the agent's.
	TunnelIPs []netip.Addr
	// Policy is the pod's tunneled ingress policy rules (WithPolicies);
	// nil when network policy is off. When no NetworkPolicy isolates the
	// pod (Policy.Isolated false) it accepts everything, and the rules only
	// turn on connection tracking in its namespace.
	Policy *netpol.Rules
}

// Equal reports whether two desired states are the same.
func (p PodTunnels) Equal(o PodTunnels) bool {
	return p.Pod == o.Pod && slices.Equal(p.TunnelIPs, o.TunnelIPs) && p.Policy.Equal(o.Policy)
}

// Isolated reports whether a NetworkPolicy restricts the pod's tunneled
// traffic.
func (p PodTunnels) Isolated() bool { return p.Policy != nil && p.Policy.Isolated }

// WithPolicies sets the Policy of every pod in desired from the ingress
// NetworkPolicies that select it (netpol.ForPod, resolved against
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
		pt.Policy = netpol.Render(in, pt.TunnelIPs)
		desired[key] = pt
	}
	slices.Sort(problems)
	return problems
}

// Desired computes, for every pod of this node that backs a tunnel Service,
// the tunnel IPs it must hold, keyed by "namespace/name". It is a pure
// function of the objects, so every run over the same objects gives the same
// answer.
//
// A Service's tunnel IP goes to the endpoints of its EndpointSlices whose pod
// runs on node, whatever their ready/serving/terminating conditions: the
// routers decide who gets new flows, and a pod that is not ready or is
// draining must still accept the flows it already has. Of several Services
// claiming one tunnel IP, only the winner (tunnelclaim.Decide) counts, as on
// the routers; a Service whose tunnel IP the address pools refuse
// (Pools.Admit, given the cluster's known networks) claims nothing and is
// listed in refused. Entries that cannot be used are skipped and described in
// problems, one line each naming the object and field.
func Desired(node string, pools tunnelclaim.Pools, known tunnelclaim.Networks, services []*corev1.Service, endpointSlices []*kubeobj.EndpointSlice, pods []*corev1.Pod) (desired map[string]PodTunnels, problems []string, refused []tunnelclaim.Claim) {
	decision := tunnelclaim.Decide(services, pools, known)
	refused = decision.With(tunnelclaim.Refused)
	winners := make(map[string]netip.Addr, len(decision.Winners))
	for vip, svc := range decision.Winners {
		winners[tunnelclaim.ServiceKey(svc)] = vip
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
		if ip, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			podByIP[ip] = pod
		}
	}

	sets := map[string]map[netip.Addr]bool{}
	for _, es := range endpointSlices {
		vip, ok := winners[es.Namespace+"/"+es.Service]
		if !ok {
			continue
		}
		name := "EndpointSlice " + es.Namespace + "/" + es.Name
		if es.AddressType != discoveryv1.AddressTypeIPv4 {
			continue // the router reports this once per Service
		}
		for i, ep := range es.Endpoints {
			if ep.NodeName != "" && ep.NodeName != node {
				continue
			}
			addr, err := netip.ParseAddr(ep.Address)
			if err != nil || !addr.Is4() {
				continue
			}
			pod := podOf(ep, localPods, podByIP)
			if pod == nil {
				if ep.NodeName != "" {
					problems = append(problems, fmt.Sprintf("%s: endpoints[%d] (%v) names node %s but no running pod of this node matches its targetRef or address", name, i, addr, node))
				}
				continue
			}
			podIP, err := netip.ParseAddr(pod.Status.PodIP)
			if err != nil || !podIP.Is4() {
				problems = append(problems, fmt.Sprintf("%s: endpoints[%d]: pod %s/%s has no IPv4 status.podIP yet", name, i, pod.Namespace, pod.Name))
				continue
			}
			if podIP != addr {
				problems = append(problems, fmt.Sprintf("%s: endpoints[%d].addresses[0] %v is not the status.podIP %v of pod %s/%s (stale slice?)", name, i, addr, podIP, pod.Namespace, pod.Name))
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
		pod := localPods[key]
		ip, _ := netip.ParseAddr(pod.Status.PodIP)
		pt := PodTunnels{Pod: runtime.Pod{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), IP: ip}}
		for vip := range set {
			pt.TunnelIPs = append(pt.TunnelIPs, vip)
		}
		slices.SortFunc(pt.TunnelIPs, netip.Addr.Compare)
		desired[key] = pt
	}
	return desired, problems, refused
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
