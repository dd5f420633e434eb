package bucket

import (
	"encoding/binary"
	"net/netip"
	"slices"
)

// Assign maps every bucket to one endpoint address. It is the one decision all
// tunnel routers must agree on, so it is a pure function of the bucket count and
// the set of endpoint addresses: their order and duplicates do not matter.
//
// Method: rendezvous (highest-random-weight) hashing. Every (bucket, endpoint)
// pair gets a score from a fixed hash, and each bucket goes to the endpoint
// with the highest score for it. Properties (proved by the unit tests):
//   - Deterministic: the same set gives the same table on every router,
//     whatever the order of their events, restarts or start times.
//   - Removal-stable: removing an endpoint moves exactly its own buckets; every
//     other flow stays where it is.
//   - Addition-minimal: adding an endpoint moves only the buckets the new one
//     wins, buckets/(N+1) on average, all of them to the new endpoint.
//   - Balanced on average only: each endpoint's share is binomial around
//     buckets/N (64 buckets, 4 endpoints: 16 +- 3.5), and an endpoint may get
//     no bucket when there are few buckets per endpoint (see Unassigned).
//     More --buckets give a finer balance.
//
// Exact balance was tried first and given up: no assignment can be both
// exactly balanced and move only the removed endpoint's buckets for every set
// (TestNoAssignmentIsBothBalancedAndRemovalStable shows a small case), and a
// change in the endpoints must move only the flows it has to.
//
// The result has one entry per bucket; it is nil when there are no endpoints.
func Assign(buckets int, endpoints []netip.Addr) []netip.Addr {
	eps := uniqueSorted(endpoints)
	if buckets <= 0 || len(eps) == 0 {
		return nil
	}
	keys := make([][16]byte, len(eps))
	for i, ep := range eps {
		keys[i] = ep.As16()
	}
	table := make([]netip.Addr, buckets)
	for b := range table {
		best, bestScore := 0, pairScore(b, keys[0])
		for e := 1; e < len(eps); e++ {
			// Ties (a 2^-64 chance) go to the lower address: eps is sorted.
			if score := pairScore(b, keys[e]); score > bestScore {
				best, bestScore = e, score
			}
		}
		table[b] = eps[best]
	}
	return table
}

// Unassigned returns the endpoints of the set that own no bucket in table,
// sorted. They get no traffic; this happens only with more endpoints than buckets.
func Unassigned(table []netip.Addr, endpoints []netip.Addr) []netip.Addr {
	owned := make(map[netip.Addr]bool, len(table))
	for _, ep := range table {
		owned[ep] = true
	}
	var out []netip.Addr
	for _, ep := range uniqueSorted(endpoints) {
		if !owned[ep] {
			out = append(out, ep)
		}
	}
	return out
}

func uniqueSorted(addrs []netip.Addr) []netip.Addr {
	out := slices.Clone(addrs)
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// pairScore is a fixed, well-mixed 64-bit hash of a bucket and an endpoint
// address (FNV-1a followed by the SplitMix64/Murmur3 finaliser). It must never
// change between releases: routers of different versions must agree.
func pairScore(bucket int, endpoint [16]byte) uint64 {
	const (
		offset64 = 14695981039346656037
		prime64  = 1099511628211
	)
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(bucket))
	h := uint64(offset64)
	for _, c := range b {
		h ^= uint64(c)
		h *= prime64
	}
	for _, c := range endpoint {
		h ^= uint64(c)
		h *= prime64
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}
