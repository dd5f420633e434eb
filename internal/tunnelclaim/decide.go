package tunnelclaim

import (
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Verdict is what the decision says of one Service's claim.
type Verdict int

const (
	// Won: the Service is served its tunnel IP.
	Won Verdict = iota
	// Lost: an older admitted Service claims the same tunnel IP (a
	// conflict); the Service gets it when that one releases it.
	Lost
	// Invalid: the annotation is not a usable tunnel IP.
	Invalid
	// Refused: the address pools or the cluster's networks refuse the tunnel
	// IP to this Service. A refused Service never takes part in a conflict.
	Refused
)

// String is the verdict's name, as logs show it.
func (v Verdict) String() string {
	switch v {
	case Won:
		return "won"
	case Lost:
		return "lost"
	case Invalid:
		return "invalid"
	case Refused:
		return "refused"
	}
	return "unknown"
}

// Claim is the decision on one Service that carries the annotation.
type Claim struct {
	Service *corev1.Service
	// VIP is the tunnel IP claimed; the zero Addr when Invalid.
	VIP     netip.Addr
	Verdict Verdict
	// Err says why the claim is Invalid or Refused, naming the annotation,
	// the pool or the network; nil otherwise.
	Err error
	// Winner is the Service that holds VIP when the claim Lost.
	Winner *corev1.Service
}

// Key is the claiming Service's "namespace/name".
func (c Claim) Key() string { return ServiceKey(c.Service) }

// ServiceKey is a Service's "namespace/name".
func ServiceKey(svc *corev1.Service) string { return svc.Namespace + "/" + svc.Name }

// Judge decides what can be decided of one Service's claim alone: Invalid,
// Refused, or admitted (Verdict Won, until Decide compares it with the
// other claimants of its tunnel IP). ok is false when the Service carries
// no annotation, and so claims nothing.
func Judge(svc *corev1.Service, pools Pools, known Networks) (claim Claim, ok bool) {
	value, annotated := svc.Annotations[Annotation]
	if !annotated {
		return Claim{}, false
	}
	claim = Claim{Service: svc}
	vip, err := ParseIP(value)
	if err != nil {
		claim.Verdict, claim.Err = Invalid, err
		return claim, true
	}
	claim.VIP = vip
	if err := pools.Admit(vip, svc.Namespace, known); err != nil {
		claim.Verdict, claim.Err = Refused, err
	}
	return claim, true
}

// Decision is which Service wins each tunnel IP, and what became of every
// other claim.
type Decision struct {
	// Claims holds one entry per annotated Service, by ServiceKey.
	Claims map[string]Claim
	// Winners maps every served tunnel IP to the Service that has it.
	Winners map[netip.Addr]*corev1.Service
}

// Decide is the one decision every tunnel router and endpoint agent makes
// alike, so that they agree by construction: each annotated Service's claim
// is judged alone (Judge); of the admitted claimants of one tunnel IP the
// oldest wins, by creationTimestamp then namespace/name (Compare), and the
// others lose. It is a pure function of its arguments: the order of
// services does not matter.
func Decide(services []*corev1.Service, pools Pools, known Networks) Decision {
	d := Decision{Claims: map[string]Claim{}, Winners: map[netip.Addr]*corev1.Service{}}
	claimants := map[netip.Addr][]*corev1.Service{}
	for _, svc := range services {
		claim, ok := Judge(svc, pools, known)
		if !ok {
			continue
		}
		d.Claims[claim.Key()] = claim
		if claim.Verdict == Won {
			claimants[claim.VIP] = append(claimants[claim.VIP], svc)
		}
	}
	for vip, svcs := range claimants {
		Sort(svcs)
		d.Winners[vip] = svcs[0]
		for _, loser := range svcs[1:] {
			claim := d.Claims[ServiceKey(loser)]
			claim.Verdict, claim.Winner = Lost, svcs[0]
			d.Claims[ServiceKey(loser)] = claim
		}
	}
	return d
}

// With returns the claims of the given verdict, sorted by Service key.
func (d Decision) With(v Verdict) []Claim {
	var out []Claim
	for _, c := range d.Claims {
		if c.Verdict == v {
			out = append(out, c)
		}
	}
	slices.SortFunc(out, func(a, b Claim) int { return strings.Compare(a.Key(), b.Key()) })
	return out
}
