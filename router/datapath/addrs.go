package datapath

import "net/netip"

// Interned addresses.
//
// The router keeps one nextHop per slot per tunnel IP (640,000 at 10,000
// tunnel IPs x 64 buckets, and most of them twice, desired and observed),
// so a nextHop must stay small: it names its address (the pod's in gre
// mode, the node's in mpls mode) by a 4-byte index into the Datapath's
// addrTable instead of holding it, which an IPv6 address would make 16
// bytes longer. One address has one index while any next hop holds it, so
// next hops still compare with ==. Indexes no next hop holds any more are
// freed by a sweep once the table has doubled since the last one (an
// endpoint's address is gone after its pod is), and reused.

// addrTable interns the addresses of next hops.
type addrTable struct {
	// addrs holds each index's address; index 0 is no address, and a freed
	// index holds the zero Addr.
	addrs []netip.Addr
	index map[netip.Addr]uint32
	free  []uint32
	// kept is the number of addresses the last sweep kept.
	kept int
}

func newAddrTable() *addrTable {
	return &addrTable{addrs: []netip.Addr{{}}, index: map[netip.Addr]uint32{}}
}

// intern returns the index of a, adding it if needed. The zero Addr is 0.
func (t *addrTable) intern(a netip.Addr) uint32 {
	if !a.IsValid() {
		return 0
	}
	if i, ok := t.index[a]; ok {
		return i
	}
	var i uint32
	if n := len(t.free); n > 0 {
		i, t.free = t.free[n-1], t.free[:n-1]
		t.addrs[i] = a
	} else {
		i = uint32(len(t.addrs))
		t.addrs = append(t.addrs, a)
	}
	t.index[a] = i
	return i
}

// addr returns the address of index i (the zero Addr for 0).
func (t *addrTable) addr(i uint32) netip.Addr { return t.addrs[i] }

// sweepDue reports whether the table holds twice the addresses the last
// sweep kept (and more than a few): then sweeping costs less than the
// addresses it may free.
func (t *addrTable) sweepDue() bool { return len(t.index) > 2*t.kept+64 }

// sweep frees the index of every address that no next hop in use holds;
// each calls its argument for every next hop in use.
func (t *addrTable) sweep(each func(mark func(nextHop))) {
	held := make([]bool, len(t.addrs))
	each(func(h nextHop) { held[h.addr] = true })
	for a, i := range t.index {
		if !held[i] {
			delete(t.index, a)
			t.addrs[i] = netip.Addr{}
			t.free = append(t.free, i)
		}
	}
	t.kept = len(t.index)
}
