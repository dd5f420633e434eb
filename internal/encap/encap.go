// Package encap names what tunnel routers and endpoint agents must agree on
// about the encapsulation between them: the mode, and the route protocol
// number that marks the routes both of them own.
package encap

import "fmt"

// Mode is how a tunnel router carries a packet to an endpoint pod, and so
// how the endpoint agent decapsulates it. Every router and agent of a
// cluster must use the same one.
type Mode string

const (
	// GRE encapsulates in GRE through one flow-based GRE device on the
	// router, with the pod IP as the outer destination; the pod holds a GRE
	// device with the tunnel IP.
	GRE Mode = "gre"
	// MPLS pushes a per-endpoint label (internal/mplslabel) and sends the
	// packet to the endpoint's node, which swaps it towards the pod; the pod
	// pops it and holds the tunnel IP on lo.
	MPLS Mode = "mpls"
)

// Validate reports a mode that is neither GRE nor MPLS.
func (m Mode) Validate() error {
	if m != GRE && m != MPLS {
		return fmt.Errorf("mode %q: must be %q or %q", string(m), GRE, MPLS)
	}
	return nil
}

// DefaultRouteProtocol is the rtm_protocol number (shown as "proto 245" by
// iproute2) that marks the routes and rules the router and the agent create;
// routes of any other protocol are never touched.
const DefaultRouteProtocol = 245
