// Package kubeobj reads Kubernetes objects the way both daemons must read
// them alike: the address a tunnel router sends a node's packets to, and the
// Pod an EndpointSlice endpoint stands for.
package kubeobj

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
)

// NodeAddress returns a node's first IPv4 InternalIP, else its first IPv4
// ExternalIP: where routers send a node's MPLS packets, and so the address
// whose interface the node's endpoint agent opens to MPLS.
func NodeAddress(n *corev1.Node) netip.Addr { return NodeAddressOf(n, true) }

// NodeAddressOf returns a node's first InternalIP of one family (IPv4 when
// ipv4, else IPv6), else its first ExternalIP of that family: where routers
// send the MPLS packets of a tunnel IP of that family. IPv4-mapped and
// zoned addresses are not IPv6 node addresses.
func NodeAddressOf(n *corev1.Node, ipv4 bool) netip.Addr {
	for _, typ := range []corev1.NodeAddressType{corev1.NodeInternalIP, corev1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			if a.Type != typ {
				continue
			}
			ip, err := netip.ParseAddr(a.Address)
			if err != nil || ip.Zone() != "" || ip.Is4In6() {
				continue
			}
			if ip.Is4() == ipv4 {
				return ip
			}
		}
	}
	return netip.Addr{}
}

// PodRef is the Pod an endpoint's targetRef names.
type PodRef struct {
	Namespace, Name string
	// UID is the Pod's UID when the targetRef gives it.
	UID string
}

// IsZero reports whether r names no Pod.
func (r PodRef) IsZero() bool { return r == PodRef{} }

// Key is the Pod's "namespace/name".
func (r PodRef) Key() string { return r.Namespace + "/" + r.Name }
