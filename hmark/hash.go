// Package hmark owns the router's flow-to-bucket hashing: a pure Go copy of
// the kernel's HMARK mark computation, for IPv4 (iptables) and IPv6
// (ip6tables) flows, so that the project can predict which bucket, and so
// which routing table, a flow uses; and the router's own mangle chain,
// which finds a packet's tunnel IP by ipset lookups and hashes it with one
// HMARK rule per routing generation in use, each with that generation's
// offset. In sticky mode the chain also keeps every flow on the decision it
// started with (conntrack marks, untracked SYNs in a raw chain: see
// Sticky). A chain is of one address family (see Family): a dual-stack
// router has an IPv4 chain in iptables and an IPv6 one in ip6tables, with
// sets of their own.
package hmark

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
)

// IP protocol numbers that the kernel's HMARK treats specially.
const (
	protoICMP    = 1
	protoICMPv6  = 58
	protoTCP     = 6
	protoUDP     = 17
	protoDCCP    = 33
	protoESP     = 50
	protoAH      = 51
	protoSCTP    = 132
	protoUDPLite = 136
)

// jhashInitval is JHASH_INITVAL from the kernel's include/linux/jhash.h.
const jhashInitval = 0xdeadbeef

// Params are the HMARK target parameters the router installs for every
// tunnel IP. The same Params on every router send the same flow to the same
// bucket, which is what keeps a flow on one endpoint across routers.
type Params struct {
	// Buckets is --hmark-mod: the number of buckets a flow is hashed into.
	Buckets uint32
	// Offset is --hmark-offset: the mark of bucket 0. Bucket i gets mark
	// Offset+i. Note that a policy rule "fwmark 0" matches every packet, so
	// a router that routes by mark wants Offset >= 1.
	Offset uint32
	// Seed is --hmark-rnd: the hash seed. It is a secret of the cluster (it
	// makes the bucket of a flow unpredictable to clients); log
	// SeedFingerprint(Seed), never the seed itself.
	Seed uint32
}

// Validate reports whether p can be installed and yields marks that fit in
// 32 bits: at least one bucket, and Offset+Buckets (the end of the mark
// range, exclusive) must not overflow a uint32.
func (p Params) Validate() error {
	if p.Buckets < 1 {
		return errors.New("hmark: buckets (--hmark-mod) must be at least 1, got 0")
	}
	if uint64(p.Offset)+uint64(p.Buckets) > math.MaxUint32 {
		return fmt.Errorf("hmark: offset %d + buckets %d overflows a 32-bit mark (the sum must be at most %d)",
			p.Offset, p.Buckets, uint32(math.MaxUint32))
	}
	return nil
}

// String describes p for logs and errors without revealing the seed.
func (p Params) String() string {
	return fmt.Sprintf("buckets=%d offset=%d seed=%s", p.Buckets, p.Offset, SeedFingerprint(p.Seed))
}

// Flow is the tuple the kernel's HMARK hashes: the rule's --hmark-tuple
// src,dst,sport,dport,proto with full masks (/32 or /128 addresses, 0xffff
// ports, 0xffff protocol). An IPv4 flow has IPv4 addresses (Is4); an IPv6
// flow IPv6 ones (an IPv4-mapped address in an IPv6 header is IPv6 here,
// as on the wire). For IPv6, Proto is the upper-layer protocol after any
// extension headers (the kernel's ipv6_find_hdr), stopping at AH.
//
// Ports only count for the protocols whose header starts with them (TCP,
// UDP, UDP-Lite, DCCP, SCTP); for ESP and AH the kernel reads the SPI in
// their place, so put its high 16 bits in SrcPort and its low 16 bits in
// DstPort. For any other protocol (ICMP included) the ports are ignored. For
// an ICMP error the kernel hashes the embedded header: describe that flow.
// For an IP fragment the kernel hashes without ports: leave them zero.
type Flow struct {
	Src, Dst         netip.Addr
	SrcPort, DstPort uint16
	Proto            uint8
}

// Mark returns the skb mark the kernel's HMARK target sets for f with these
// parameters (net/netfilter/xt_HMARK.c, hmark_hash): the two addresses as
// host-order words, smaller first; the two ports packed as
// (larger << 16) | smaller; jhash_3words of those with Seed; the protocol
// xored in; then reciprocal scaling ((hash * Buckets) >> 32, not a modulo)
// plus Offset. Both directions of a flow get the same mark.
//
// An IPv6 address is first folded into one word as ip6tables' HMARK does
// (hmark_addr6_mask): the xor of its four 32-bit words. With Buckets 0
// (which Validate rejects, as the kernel does) Mark returns Offset.
func (p Params) Mark(f Flow) uint32 {
	src, dst := addrWord(f.Src), addrWord(f.Dst)
	if dst < src {
		src, dst = dst, src
	}
	var ports uint32
	if hasPorts(f.Proto) {
		lo, hi := uint32(f.SrcPort), uint32(f.DstPort)
		if lo > hi {
			lo, hi = hi, lo
		}
		ports = hi<<16 | lo
	}
	h := jhash3Words(src, dst, ports, p.Seed) ^ uint32(f.Proto)
	return reciprocalScale(h, p.Buckets) + p.Offset
}

// ClientFlow is the flow the kernel hashes for f when the tunnel IP has
// client affinity (Target.ClientAffinity): HMARK's port and protocol masks
// are 0, so only the two addresses count, and every flow of one client to
// one tunnel IP gets one bucket.
func ClientFlow(f Flow) Flow { return Flow{Src: f.Src, Dst: f.Dst} }

// Bucket returns the bucket of f, in [0, Buckets): its Mark minus Offset.
func (p Params) Bucket(f Flow) uint32 {
	return p.Mark(f) - p.Offset
}

// SeedFingerprint returns a short fingerprint of seed for logs and metrics,
// so that operators can tell whether two routers share a seed without the
// seed ever being logged. It is 6 hex digits (24 bits) of a SHA-256 of the
// seed: a 32-bit seed can be brute-forced against any fingerprint, and with
// 24 bits each fingerprint leaves about 256 candidate seeds, while two
// different seeds still collide only once in 16.7 million.
func SeedFingerprint(seed uint32) string {
	var msg [len(fingerprintDomain) + 4]byte
	copy(msg[:], fingerprintDomain)
	binary.BigEndian.PutUint32(msg[len(fingerprintDomain):], seed)
	sum := sha256.Sum256(msg[:])
	return hex.EncodeToString(sum[:3])
}

// fingerprintDomain separates seed fingerprints from any other SHA-256 use.
const fingerprintDomain = "kube-service-tunnel/hmark-seed/v1:"

// addrWord returns the word HMARK hashes for an address: an IPv4 address
// as a host-order word (ntohl of the header field); an IPv6 address as the
// xor of its four words (the kernel xors them in network order, then takes
// ntohl of the result, which is the same); 0 for the zero Addr.
func addrWord(a netip.Addr) uint32 {
	switch {
	case a.Is4():
		b := a.As4()
		return binary.BigEndian.Uint32(b[:])
	case a.Is6():
		b := a.As16()
		return binary.BigEndian.Uint32(b[0:]) ^ binary.BigEndian.Uint32(b[4:]) ^ binary.BigEndian.Uint32(b[8:]) ^ binary.BigEndian.Uint32(b[12:])
	}
	return 0
}

// hasPorts reports whether the kernel reads a ports word for proto
// (proto_ports_offset >= 0 in include/linux/in.h, with ICMP skipped by
// xt_HMARK itself).
func hasPorts(proto uint8) bool {
	switch proto {
	case protoTCP, protoUDP, protoDCCP, protoESP, protoAH, protoSCTP, protoUDPLite:
		return true
	default:
		return false
	}
}

// jhash3Words is the kernel's jhash_3words: the three words plus
// initval + JHASH_INITVAL + 12 each, then the final mix of lookup3.
func jhash3Words(a, b, c, initval uint32) uint32 {
	initval += jhashInitval + 3<<2
	a += initval
	b += initval
	c += initval

	c ^= b
	c -= bits.RotateLeft32(b, 14)
	a ^= c
	a -= bits.RotateLeft32(c, 11)
	b ^= a
	b -= bits.RotateLeft32(a, 25)
	c ^= b
	c -= bits.RotateLeft32(b, 16)
	a ^= c
	a -= bits.RotateLeft32(c, 4)
	b ^= a
	b -= bits.RotateLeft32(a, 14)
	c ^= b
	c -= bits.RotateLeft32(b, 24)
	return c
}

// reciprocalScale maps val to [0, n) as the kernel's reciprocal_scale does.
func reciprocalScale(val, n uint32) uint32 {
	return uint32(uint64(val) * uint64(n) >> 32)
}
