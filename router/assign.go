package router

import (
	"cmp"
	"encoding/binary"
	"net/netip"
	"slices"
)

// Assign maps every bucket to one endpoint address. It is the one decision all
// tunnel routers must agree on, so it is a pure function of the bucket count and
// the set of endpoint addresses: their order and duplicates do not matter.
//
// Properties (proved by the unit tests on many random endpoint sets):
//   - Deterministic: the same set gives the same table on every router.
//   - Balanced: every endpoint gets floor or ceil of buckets/endpoints buckets
//     (when there are more endpoints than buckets, some get none).
//   - Low disruption: removing an endpoint moves all of its buckets and, because
//     exact balance must be kept, a few others (0-6 of 64 on average); adding one
//     moves roughly buckets/(N+1) buckets plus a few. No assignment can be both
//     exactly balanced and move only the removed endpoint's buckets for every
//     set; TestNoAssignmentIsBothBalancedAndRemovalStable shows a small case.
//
// Method: every (bucket, endpoint) pair gets a score from a fixed hash (the
// rendezvous, or highest-random-weight, score). Pairs are taken from the highest
// score down; a pair is accepted when its bucket is still free and its endpoint
// still has room: at most floor(B/N) buckets, and at most B mod N endpoints may
// take one more. Without the capacity limit this is plain rendezvous hashing,
// whose only moves on removal are the removed endpoint's buckets.
//
// The result has one entry per bucket; it is nil when there are no endpoints.
func Assign(buckets int, endpoints []netip.Addr) []netip.Addr {
	eps := uniqueSorted(endpoints)
	if buckets <= 0 || len(eps) == 0 {
		return nil
	}
	type pair struct {
		score    uint64
		bucket   int
		endpoint int
	}
	pairs := make([]pair, 0, buckets*len(eps))
	keys := make([][16]byte, len(eps))
	for i, ep := range eps {
		keys[i] = ep.As16()
	}
	for b := 0; b < buckets; b++ {
		for e := range eps {
			pairs = append(pairs, pair{score: pairScore(b, keys[e]), bucket: b, endpoint: e})
		}
	}
	slices.SortFunc(pairs, func(x, y pair) int {
		if c := cmp.Compare(y.score, x.score); c != 0 {
			return c
		}
		if c := cmp.Compare(x.bucket, y.bucket); c != 0 {
			return c
		}
		return cmp.Compare(x.endpoint, y.endpoint)
	})

	floor, extra := buckets/len(eps), buckets%len(eps)
	owner := make([]int, buckets)
	for i := range owner {
		owner[i] = -1
	}
	load := make([]int, len(eps))
	free := buckets
	for _, p := range pairs {
		if free == 0 {
			break
		}
		if owner[p.bucket] >= 0 {
			continue
		}
		switch {
		case load[p.endpoint] < floor:
		case load[p.endpoint] == floor && extra > 0:
			extra--
		default:
			continue
		}
		owner[p.bucket] = p.endpoint
		load[p.endpoint]++
		free--
	}
	table := make([]netip.Addr, buckets)
	for b, e := range owner {
		table[b] = eps[e]
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
