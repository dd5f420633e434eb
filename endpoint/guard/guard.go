// Package guard renders and reads the carrier guard: the rules, in the raw
// table of a served pod's network namespace, that let only the tunnel
// routers speak through the tunnel. For one address family of the pod they
// drop, before connection tracking and before any other rule:
//
//   - carrier-source (gre mode): GRE to the pod IP from any address but a
//     router node's. The pod's decapsulation device has no remote address,
//     so without this rule it decapsulates GRE from anyone, and whoever can
//     send GRE to the pod IP delivers packets to the tunnel IP with any
//     client address.
//   - inner-destination: a decapsulated packet (gre mode: received on a
//     decapsulation device; mpls mode: popped to lo, so received on lo from
//     an address the pod does not hold) whose destination is not one of the
//     pod's tunnel IPs of the family: the pod IP, or an address of the
//     other family, would otherwise open every port of the pod to whoever
//     can send the carrier, past its NetworkPolicy.
//   - bypass: a packet to a tunnel IP that did not come through the
//     decapsulation path (a neighbour on the pod's link sending to the
//     tunnel IP directly).
//
// Packets of the other kinds are not looked at (the rules only RETURN or
// DROP). The agent writes the chain whether or not network policy is on.
package guard

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	"github.com/cmdnu/kube-service-tunnel/internal/iptsave"
)

// Chain is the raw table's chain holding the guard; PREROUTING jumps to it
// first.
const Chain = "KST-GUARD"

// Comment marks the guard's rules: the jump carries Comment + ":" + the
// digest of the chain, each DROP rule Comment + ":" + its reason.
const Comment = "kube-service-tunnel"

// The reasons of the guard's DROP rules, as the metrics name them.
const (
	CarrierSource    = "carrier-source"
	InnerDestination = "inner-destination"
	Bypass           = "bypass"
)

// Reasons lists every reason, in rule order.
var Reasons = []string{CarrierSource, InnerDestination, Bypass}

// Params describe one family's guard of one pod.
type Params struct {
	// MPLS: the carrier is MPLS, popped to lo (no carrier-source rule: an
	// MPLS frame has no source address; see docs/security.md); else GRE.
	MPLS bool
	// PodIP is the pod's address of the family: the carrier's destination.
	PodIP netip.Addr
	// Routers are the addresses of the family the carrier may come from:
	// the router nodes'.
	Routers []netip.Addr
	// TunnelIPs are the pod's tunnel IPs of the family (none: every
	// decapsulated packet of the family is dropped).
	TunnelIPs []netip.Addr
	// Device is the decapsulation device of the family (gre mode); Other
	// is the other family's (whose packets of this family are dropped).
	Device, Other string
}

// Rules are one family's guard rendered for the raw table.
type Rules struct {
	// Body is the "-A KST-GUARD ..." lines.
	Body []string
	// Digest identifies Body; the jump from PREROUTING carries it.
	Digest string
}

// Equal reports whether r and o render the same kernel state.
func (r *Rules) Equal(o *Rules) bool {
	if r == nil || o == nil {
		return r == o
	}
	return r.Digest == o.Digest
}

// Render renders p; every address must be of PodIP's family.
func Render(p Params) *Rules {
	r := &Rules{}
	// add appends a rule: matches, then the comment naming its reason,
	// then the target (the last two words), in iptables-save's order.
	add := func(reason string, words ...string) {
		if reason != "" {
			n := len(words) - 2
			words = slices.Concat(words[:n], []string{"-m", "comment", "--comment", Comment + ":" + reason}, words[n:])
		}
		r.Body = append(r.Body, "-A "+Chain+" "+strings.Join(words, " "))
	}
	routers := slices.Clone(p.Routers)
	slices.SortFunc(routers, netip.Addr.Compare)
	routers = slices.Compact(routers)
	vips := slices.Clone(p.TunnelIPs)
	slices.SortFunc(vips, netip.Addr.Compare)
	vips = slices.Compact(vips)
	if !p.MPLS {
		for _, rt := range routers {
			add("", "-s", iptsave.Host(rt), "-d", iptsave.Host(p.PodIP), "-p", "47", "-j", "RETURN")
		}
		add(CarrierSource, "-d", iptsave.Host(p.PodIP), "-p", "47", "-j", "DROP")
		for _, vip := range vips {
			add("", "-d", iptsave.Host(vip), "-i", p.Device, "-j", "RETURN")
		}
		for _, dev := range []string{p.Device, p.Other} {
			if dev != "" {
				add(InnerDestination, "-i", dev, "-j", "DROP")
			}
		}
	} else {
		// On lo, a packet from an address of the pod is the pod's own; any
		// other was popped from an MPLS frame.
		local := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
		if p.PodIP.Is6() {
			local = []netip.Prefix{netip.PrefixFrom(netip.IPv6Loopback(), 128)}
		}
		for _, a := range slices.Concat([]netip.Addr{p.PodIP}, vips) {
			local = append(local, netip.PrefixFrom(a, a.BitLen()))
		}
		for _, l := range local {
			add("", "-s", l.String(), "-i", "lo", "-j", "RETURN")
		}
		for _, vip := range vips {
			add("", "-d", iptsave.Host(vip), "-i", "lo", "-j", "RETURN")
		}
		add(InnerDestination, "-i", "lo", "-j", "DROP")
	}
	// What reaches a tunnel IP must have come through the path above.
	if !p.MPLS {
		add("", "-i", "lo", "-j", "RETURN")
	}
	for _, vip := range vips {
		add(Bypass, "-d", iptsave.Host(vip), "-j", "DROP")
	}
	sum := sha256.Sum256([]byte(strings.Join(r.Body, "\n")))
	r.Digest = hex.EncodeToString(sum[:4])
	return r
}

// Jump is the PREROUTING rule sending every packet to Chain, carrying
// digest.
func Jump(digest string) []string {
	return []string{"-m", "comment", "--comment", Comment + ":" + digest, "-j", Chain}
}

// Counter is a rule's packet and byte counters.
type Counter = iptsave.Counter

// Observed is what a pod's raw table holds of the guard (ParseSave).
type Observed struct {
	// Chain: the chain exists, with Rules rules.
	Chain bool
	Rules int
	// Jumps are the PREROUTING rules jumping to Chain, as saved (without
	// "-A PREROUTING"), and the digest each carries.
	Jumps   []string
	Digests []string
	// Dropped sums the counters of the DROP rules of each reason (when
	// saved with -c).
	Dropped map[string]Counter
}

// Empty reports whether the table holds nothing of the guard's.
func (o Observed) Empty() bool { return !o.Chain && len(o.Jumps) == 0 }

var tagComment = regexp.MustCompile(`--comment "?` + regexp.QuoteMeta(Comment) + `:([0-9a-z-]+)"?`)

// ParseSave reads the raw table of iptables-save's output (with or without
// -c; other tables are skipped).
func ParseSave(save string) Observed {
	o := Observed{Dropped: map[string]Counter{}}
	for l := range iptsave.Table(save, "raw") {
		if l.Declared != "" {
			o.Chain = o.Chain || l.Declared == Chain
			continue
		}
		tag := ""
		if m := tagComment.FindStringSubmatch(l.Spec); m != nil {
			tag = m[1]
		}
		t := iptsave.Target(l.Spec)
		switch {
		case l.Chain == "PREROUTING" && t == Chain:
			o.Jumps = append(o.Jumps, l.Spec)
			o.Digests = append(o.Digests, tag)
		case l.Chain == Chain:
			o.Rules++
			if t == "DROP" && slices.Contains(Reasons, tag) {
				d := o.Dropped[tag]
				d.Packets += l.Counter.Packets
				d.Bytes += l.Counter.Bytes
				o.Dropped[tag] = d
			}
		}
	}
	return o
}

// Update returns the iptables-restore --noflush payload that turns have
// into want (nil want: remove the guard), or nil when the table already
// holds exactly want. The chain is rewritten whole and its jump replaced
// in one transaction, so that no packet finds it half written.
func Update(want *Rules, have Observed) []byte {
	if want == nil && have.Empty() {
		return nil
	}
	if want != nil && have.Chain && have.Rules == len(want.Body) && len(have.Jumps) == 1 && have.Digests[0] == want.Digest {
		return nil
	}
	var b strings.Builder
	b.WriteString("*raw\n")
	if want != nil || have.Chain {
		// Declaring a chain flushes it (or creates it).
		fmt.Fprintf(&b, ":%s - [0:0]\n", Chain)
	}
	for _, spec := range have.Jumps {
		b.WriteString("-D PREROUTING " + spec + "\n")
	}
	if want != nil {
		for _, line := range want.Body {
			b.WriteString(line + "\n")
		}
		b.WriteString("-I PREROUTING 1 " + strings.Join(Jump(want.Digest), " ") + "\n")
	} else {
		b.WriteString("-X " + Chain + "\n")
	}
	b.WriteString("COMMIT\n")
	return []byte(b.String())
}
