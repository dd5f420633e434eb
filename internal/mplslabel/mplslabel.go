// Package mplslabel derives the MPLS label that identifies an endpoint pod on
// its node. The tunnel router pushes the label towards the pod's node; the
// endpoint agent on that node swaps it to PodLabel towards the pod. Both derive
// it from the pod IP alone, which they already see in the EndpointSlice, so no
// label allocation has to be coordinated.
//
// Scheme: label = Base + the low 16 bits of the pod's IPv4 address. Two pods on
// one node get different labels as long as the node's pod CIDR is a /16 or
// smaller (Kubernetes' default is a /24). Nodes must accept labels below
// PlatformLabels (sysctl net.mpls.platform_labels).
package mplslabel

import (
	"fmt"
	"net/netip"
)

const (
	// Base is the first label of the range; 0-15 are reserved by RFC 3032.
	Base = 1024
	// PlatformLabels is the smallest net.mpls.platform_labels value that holds
	// every label of the scheme.
	PlatformLabels = Base + 1<<16
	// PodLabel is the label a node hands to a pod, which pops it and delivers
	// the inner packet locally.
	PodLabel = 100
)

// ForEndpoint returns the label the router pushes for an endpoint pod.
func ForEndpoint(pod netip.Addr) (uint32, error) {
	if !pod.Is4() {
		return 0, fmt.Errorf("mpls label for %v: only IPv4 pod addresses are supported", pod)
	}
	a := pod.As4()
	return Base + uint32(a[2])<<8 | uint32(a[3]), nil
}
