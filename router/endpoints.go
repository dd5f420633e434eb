package router

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// DrainAnnotation on a Pod, set to "true", drains the pod's endpoints: they
// get no new flows, while their established flows keep reaching them.
const DrainAnnotation = "cmd.nu/tunnel-drain"

// ServiceEndpoints extracts the endpoints of one address family of a
// Service from its EndpointSlices of that addressType (a dual-stack Service
// has one set of slices per family; slices of the other family, and FQDN
// ones, are skipped), deduplicated by address and sorted. Entries it cannot use
// are skipped and described in problems (one line each, naming the slice and
// the field) so that one bad entry never hides the others.
//
// An endpoint is ready when conditions.ready is true or unset (the API says
// consumers should treat unset as ready). It is draining when it is serving
// but not ready (terminating), or when drained(pod) says its Pod is marked
// with DrainAnnotation; drained may be nil. Endpoints neither ready nor
// serving are left out, and so are those whose targetRef names a Pod of
// another namespace (ForeignEndpointProblem).
func ServiceEndpoints(endpointSlices []*kubeobj.EndpointSlice, family discoveryv1.AddressType, needNode bool, drained func(namespace, name string) bool) (eps []datapath.Endpoint, problems []string) {
	byAddr := map[netip.Addr]datapath.Endpoint{}
	for _, es := range endpointSlices {
		if es == nil || es.AddressType != family {
			continue
		}
		name := es.Namespace + "/" + es.Name
		for i, ep := range es.Endpoints {
			draining := false
			if ready, set := ep.Conditions.Ready(); set && !ready {
				if serving, _ := ep.Conditions.Serving(); !serving {
					continue
				}
				draining = true
			}
			if !draining && drained != nil && !ep.Pod.IsZero() {
				draining = drained(ep.Pod.Namespace, ep.Pod.Name)
			}
			if !ep.Pod.IsZero() && ep.Pod.Namespace != es.Namespace {
				problems = append(problems, ForeignEndpointProblem(name, i, ep.Pod.Key(), es.Namespace))
				continue
			}
			if ep.Address == "" {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d].addresses is empty", name, i))
				continue
			}
			addr, err := netip.ParseAddr(ep.Address)
			if err != nil || AddressType(addr) != family || addr.Is4In6() || addr.Zone() != "" {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d].addresses[0] %q is not an %s address", name, i, ep.Address, family))
				continue
			}
			node := ep.NodeName
			if needNode && node == "" {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d] (%s) has no nodeName, which mpls mode needs", name, i, addr))
				continue
			}
			if prev, dup := byAddr[addr]; dup {
				if prev.NodeName != node {
					problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d] (%s) is also listed on node %q; using %q", name, i, addr, prev.NodeName, min(prev.NodeName, node)))
					node = min(prev.NodeName, node)
				}
				draining = draining && prev.Draining // ready in one slice is ready
			}
			byAddr[addr] = datapath.Endpoint{Addr: addr, NodeName: node, Draining: draining}
		}
	}
	for _, ep := range byAddr {
		eps = append(eps, ep)
	}
	slices.SortFunc(eps, func(a, b datapath.Endpoint) int { return a.Addr.Compare(b.Addr) })
	return eps, problems
}

// ForeignEndpointPrefix starts the problem of a slice's endpoint whose
// targetRef names a Pod of another namespace than the slice's.
const ForeignEndpointPrefix = "foreign pod: "

// ForeignEndpointProblem describes endpoints[i] of slice (namespace/name),
// which names pod (namespace/name) outside namespace: left out, as the
// endpoint agent leaves it out (the CVE-2021-25740 class: a selector-less
// Service with a hand-written slice must not reach into another namespace).
func ForeignEndpointProblem(slice string, i int, pod, namespace string) string {
	return fmt.Sprintf("%sEndpointSlice %s: endpoints[%d] names pod %s of another namespace: a tunnel IP is carried only to pods of its Service's namespace %s; skipped", ForeignEndpointPrefix, slice, i, pod, namespace)
}

// AddressType is the EndpointSlice addressType of an address's family.
func AddressType(a netip.Addr) discoveryv1.AddressType {
	if a.Is4() {
		return discoveryv1.AddressTypeIPv4
	}
	return discoveryv1.AddressTypeIPv6
}

// hasAddressType reports whether one of the slices is of addressType family.
func hasAddressType(endpointSlices []*kubeobj.EndpointSlice, family discoveryv1.AddressType) bool {
	for _, es := range endpointSlices {
		if es != nil && es.AddressType == family {
			return true
		}
	}
	return false
}
