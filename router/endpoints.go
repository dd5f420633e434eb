package router

import (
	"fmt"
	"net/netip"
	"slices"

	discoveryv1 "k8s.io/api/discovery/v1"
)

// Endpoint is one ready backend of a tunnel IP, as every router sees it in the
// Service's EndpointSlices.
type Endpoint struct {
	// Addr is the pod IP: the GRE outer destination, and the source of the MPLS label.
	Addr netip.Addr
	// NodeName is the node the pod runs on; MPLS mode sends the packet there.
	NodeName string
	// NodeIP is the node's address (MPLS mode), filled in from the Node object.
	NodeIP netip.Addr
}

// ReadyEndpoints extracts the ready IPv4 endpoints of a Service from its
// EndpointSlices, deduplicated by address and sorted. Entries it cannot use are
// skipped and described in problems (one line each, naming the slice and the
// field) so that one bad entry never hides the others.
//
// An endpoint counts as ready when conditions.ready is true or unset (the API
// says consumers should treat unset as ready). Terminating endpoints are not
// ready and get no buckets.
func ReadyEndpoints(endpointSlices []*discoveryv1.EndpointSlice, needNode bool) (eps []Endpoint, problems []string) {
	byAddr := map[netip.Addr]Endpoint{}
	for _, es := range endpointSlices {
		if es == nil {
			continue
		}
		name := es.Namespace + "/" + es.Name
		if es.AddressType != discoveryv1.AddressTypeIPv4 {
			problems = append(problems, fmt.Sprintf("EndpointSlice %s: addressType %s is not supported, only IPv4", name, es.AddressType))
			continue
		}
		for i, ep := range es.Endpoints {
			if ep.Conditions.Ready != nil && !*ep.Conditions.Ready {
				continue
			}
			if len(ep.Addresses) == 0 {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d].addresses is empty", name, i))
				continue
			}
			addr, err := netip.ParseAddr(ep.Addresses[0])
			if err != nil || !addr.Is4() {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d].addresses[0] %q is not an IPv4 address", name, i, ep.Addresses[0]))
				continue
			}
			node := ""
			if ep.NodeName != nil {
				node = *ep.NodeName
			}
			if needNode && node == "" {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d] (%s) has no nodeName, which mpls mode needs", name, i, addr))
				continue
			}
			if prev, dup := byAddr[addr]; dup && prev.NodeName != node {
				problems = append(problems, fmt.Sprintf("EndpointSlice %s: endpoints[%d] (%s) is also listed on node %q; using %q", name, i, addr, prev.NodeName, min(prev.NodeName, node)))
				node = min(prev.NodeName, node)
			}
			byAddr[addr] = Endpoint{Addr: addr, NodeName: node}
		}
	}
	for _, ep := range byAddr {
		eps = append(eps, ep)
	}
	slices.SortFunc(eps, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	return eps, problems
}
