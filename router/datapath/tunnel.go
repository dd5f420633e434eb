package datapath

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cmdnu/kube-service-tunnel/hmark"
)

// Tunnel is the desired state of one tunnel IP: the endpoint of every bucket
// for new flows, or no table at all when it has no endpoint (its traffic is
// dropped), and the endpoints that still exist (ready or draining): older
// generations keep sending their established flows to those.
type Tunnel struct {
	VIP     netip.Addr
	Table   []Endpoint
	Present []Endpoint
	// ClientAffinity hashes new flows on the client's address alone (the
	// Service's sessionAffinity: ClientIP), so that every flow of a client
	// gets the same bucket.
	ClientAffinity bool
	// FilterPorts: the tunnel IP carries only Ports (TCP, UDP and SCTP
	// destination ports) and ICMP; every other packet to it is dropped
	// before it is marked, and counted. Otherwise it carries everything.
	FilterPorts bool
	Ports       []hmark.Port
}

// portKey identifies what the port filter does for t, comparably.
func (t Tunnel) portKey() string {
	if !t.FilterPorts {
		return ""
	}
	ports := slices.Clone(t.Ports)
	slices.SortFunc(ports, hmark.ComparePorts)
	ports = slices.Compact(ports)
	var b strings.Builder
	b.WriteString("filter")
	for _, p := range ports {
		fmt.Fprintf(&b, " %d/%d", p.Protocol, p.Number)
	}
	return b.String()
}

// HasReady reports whether the tunnel has an endpoint that takes new flows
// (present and not draining): only then is it announced to the network.
func (t Tunnel) HasReady() bool {
	for _, ep := range t.Present {
		if !ep.Draining {
			return true
		}
	}
	return false
}

// Endpoint is one backend of a tunnel IP, as every router sees it in the
// Service's EndpointSlices.
type Endpoint struct {
	// Draining endpoints get no new flows; their established flows stay.
	Draining bool
	// Addr is the pod IP: the GRE outer destination, and the source of the MPLS label.
	Addr netip.Addr
	// NodeName is the node the pod runs on; MPLS mode sends the packet there.
	NodeName string
	// NodeIP is the node's address (MPLS mode), filled in from the Node object.
	NodeIP netip.Addr
}
