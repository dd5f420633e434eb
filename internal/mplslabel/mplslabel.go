// Package mplslabel derives the MPLS label that identifies an endpoint pod on
// its node. The tunnel router pushes the label towards the pod's node; the
// endpoint agent on that node swaps it to PodLabel towards the pod. Both derive
// it from the pod IP alone, which they already see in the EndpointSlice, so no
// label allocation has to be coordinated.
//
// Scheme: label = Base + the low 16 bits of the pod's IPv4 address, or
// Base6 + the low 16 bits of its IPv6 address. Two pods on one node get
// different labels as long as their IPv4 addresses differ in the low 16
// bits (the node's pod CIDR is a /16 or smaller; Kubernetes' default is a
// /24), and their IPv6 addresses too (host-local IPAM numbers a node's pods
// from the start of its /64, so up to 65,536 pods). The two families'
// ranges do not overlap: a dual-stack pod has one label per address. Nodes must accept labels below
// PlatformLabels (sysctl net.mpls.platform_labels).
package mplslabel

import (
	"fmt"
	"net/netip"
)

const (
	// Base is the first label of the range; 0-15 are reserved by RFC 3032.
	Base = 1024
	// Base6 is the first label of the IPv6 range, just above the IPv4 one.
	Base6 = Base + 1<<16
	// PlatformLabels is the smallest net.mpls.platform_labels value that holds
	// every label of the scheme.
	PlatformLabels = Base6 + 1<<16
	// PodLabel is the label a node hands to a pod, which pops it and delivers
	// the inner packet locally.
	PodLabel = 100
)

// ForEndpoint returns the label the router pushes for an endpoint pod.
func ForEndpoint(pod netip.Addr) (uint32, error) {
	switch {
	case pod.Is4():
		a := pod.As4()
		return Base + uint32(a[2])<<8 | uint32(a[3]), nil
	case pod.Is6() && !pod.Is4In6():
		a := pod.As16()
		return Base6 + uint32(a[14])<<8 | uint32(a[15]), nil
	}
	return 0, fmt.Errorf("mpls label for %v: not an IPv4 or IPv6 pod address", pod)
}
