package hmark

import (
	"fmt"
	"net/netip"
)

// Counter holds the traffic counters of one tunnel IP's rule (see
// Counters).
type Counter struct {
	// Packets is the number of packets the rule matched.
	Packets uint64
	// Bytes is the number of bytes of those packets, IP header included.
	Bytes uint64
}

// Counters returns, by tunnel IP, the packet and byte counters of every
// packet to the tunnel IP that reached this router (went through
// PREROUTING), in either mode; nothing else is counted, so the counters of
// a tunnel IP without traffic are zero, and those of tunnel IPs that are
// not synced are left out. They come from one listing, with counters
// (`iptables -v -S`), of one of c's chains:
//
//   - stateless: the mangle chain's HMARK rules with c's Buckets and Seed
//     (any offset), which hash every packet to their tunnel IP;
//   - sticky (see SetSticky): the raw chain's rules, one per tunnel IP,
//     which every packet to it goes through (the raw table sees each
//     packet once, before conntrack), whereas the mangle chain's HMARK
//     rules see only the packets of flows without a saved decision.
//
// A tunnel IP with several such rules gets their sum. The counters run
// from when the tunnel IP's rule was first written: a Sync that restores a
// chain writes the rules of the tunnel IPs that stay with the counters
// they had (see Sync), so adding, removing or moving other tunnel IPs,
// repairing the chain, or a restarted router adopting it, does not reset
// them. They restart from 0 when the mode changes (the other chain is
// read), when Cleanup removed the chain, or when something else flushed
// it.
func (c *Chain) Counters() (map[netip.Addr]Counter, error) {
	table, match := Table, c.mangleVIPRule
	if c.sticky != nil {
		table, match = RawTable, c.rawVIPRule
	}
	rules, err := c.listRules(table, c.name, true)
	if err != nil {
		return nil, c.redactSeed(fmt.Errorf("hmark: counters of chain %s: %w", c.name, err))
	}
	for _, r := range rules {
		if _, ok := match(r); ok && !r.hasCounters {
			return nil, fmt.Errorf("hmark: counters of chain %s: table %s: no counters in rule %d", c.name, table, r.pos)
		}
	}
	return sumCounters(rules, match), nil
}

// mangleVIPRule recognizes, in the mangle chain, a tunnel IP's HMARK rule
// that hashes like c (any offset): the rules whose counters Counters
// reports in stateless mode.
func (c *Chain) mangleVIPRule(r rule) (netip.Addr, bool) {
	vip, params, ok := r.vipRule()
	return vip, ok && c.sameHash(params)
}

// sumCounters sums, by tunnel IP, the counters of the rules that match
// recognizes (rules listed without counters count zero).
func sumCounters(rules []rule, match func(rule) (netip.Addr, bool)) map[netip.Addr]Counter {
	counters := make(map[netip.Addr]Counter)
	for _, r := range rules {
		vip, ok := match(r)
		if !ok {
			continue
		}
		sum := counters[vip]
		sum.Packets += r.packets
		sum.Bytes += r.bytes
		counters[vip] = sum
	}
	return counters
}
