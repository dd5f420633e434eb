package hmark

import (
	"fmt"
	"net/netip"
)

// Counter holds the traffic counters of one tunnel IP (see Counters).
type Counter struct {
	// Packets is the number of packets to the tunnel IP.
	Packets uint64
	// Bytes is the number of bytes of those packets, IP header (IPv4 or
	// IPv6, extension headers too) included.
	Bytes uint64
}

// Counters returns, by tunnel IP, the packet and byte counters of every
// packet to the tunnel IP that reached this router (went through
// PREROUTING), in either mode; nothing else is counted, so the counters of
// a tunnel IP without traffic are zero, and those of tunnel IPs that are
// not synced are left out. They are the counters of the tunnel IP's
// element in the set of all tunnel IPs (one netlink dump), which one rule
// updates for every packet: the mangle chain's first rule, in either mode
// (in sticky mode the raw chain's rule matches the set without counting:
// see SetSticky).
//
// The counters run from when the tunnel IP was added to the set: moving
// it to another generation, adding or removing other tunnel IPs, rewriting
// the chains, changing the mode, or a restarted router adopting the set
// does not reset them. They restart from 0 when the tunnel IP leaves the
// set (it is no longer synced), when Cleanup destroyed the set, and once on
// the upgrade from a version that counted in its rules. A missing set gives
// an empty map.
func (c *Chain) Counters() (map[netip.Addr]Counter, error) {
	s, err := c.readSet(c.allSetName(), true)
	if err != nil {
		return nil, fmt.Errorf("hmark: counters of chain %s: %w", c.name, err)
	}
	return s.members, nil
}
