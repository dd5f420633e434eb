package tunnelclaim

import (
	"cmp"
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

// Claim is the decision on one tunnel IP a Service claims, or on the
// Service's annotation as a whole when it is Invalid. A Service claims one
// tunnel IP per address family; each is admitted, refused, won and lost on
// its own, so that a conflict on the IPv6 address leaves the IPv4 one
// served.
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

// Judge decides what can be decided of one Service's claims alone: one
// Invalid claim when the annotation is not usable (ParseIPs), else one claim
// per tunnel IP it names, IPv4 first, each Refused or admitted (Verdict Won,
// until Decide compares it with the other claimants of its tunnel IP). ok
// is false when the Service carries no annotation, and so claims nothing.
func Judge(svc *corev1.Service, pools Pools, known Networks) (claims []Claim, ok bool) {
	value, annotated := svc.Annotations[Annotation]
	if !annotated {
		return nil, false
	}
	vips, err := ParseIPs(value)
	if err != nil {
		return []Claim{{Service: svc, Verdict: Invalid, Err: err}}, true
	}
	claims = make([]Claim, len(vips))
	for i, vip := range vips {
		claims[i] = Claim{Service: svc, VIP: vip}
		if err := pools.Admit(vip, svc.Namespace, known); err != nil {
			claims[i].Verdict, claims[i].Err = Refused, err
		}
	}
	return claims, true
}

// Decision is which Service wins each tunnel IP, and what became of every
// other claim.
type Decision struct {
	// Claims holds the claims of every annotated Service (Judge), by
	// ServiceKey.
	Claims map[string][]Claim
	// Winners maps every served tunnel IP, of either family, to the Service
	// that has it.
	Winners map[netip.Addr]*corev1.Service
}

// Decide is the one decision every tunnel router and endpoint agent makes
// alike, so that they agree by construction: each annotated Service's
// claims are judged alone (Judge); of the admitted claimants of one tunnel
// IP the oldest wins, by creationTimestamp then namespace/name (Compare),
// and the others lose. It is a pure function of its arguments: the order of
// services does not matter.
func Decide(services []*corev1.Service, pools Pools, known Networks) Decision {
	d := Decision{Claims: map[string][]Claim{}, Winners: map[netip.Addr]*corev1.Service{}}
	claimants := map[netip.Addr][]*corev1.Service{}
	for _, svc := range services {
		claims, ok := Judge(svc, pools, known)
		if !ok {
			continue
		}
		d.Claims[ServiceKey(svc)] = claims
		for _, c := range claims {
			if c.Verdict == Won {
				claimants[c.VIP] = append(claimants[c.VIP], svc)
			}
		}
	}
	for vip, svcs := range claimants {
		Sort(svcs)
		d.Winners[vip] = svcs[0]
		for _, loser := range svcs[1:] {
			claims := d.Claims[ServiceKey(loser)]
			for i := range claims {
				if claims[i].VIP == vip {
					claims[i].Verdict, claims[i].Winner = Lost, svcs[0]
				}
			}
		}
	}
	return d
}

// Won returns the tunnel IPs the Service key wins, IPv4 first.
func (d Decision) Won(key string) []netip.Addr {
	var vips []netip.Addr
	for _, c := range d.Claims[key] {
		if c.Verdict == Won {
			vips = append(vips, c.VIP)
		}
	}
	return vips
}

// With returns the claims of the given verdict, sorted by Service key then
// tunnel IP (IPv4 first).
func (d Decision) With(v Verdict) []Claim {
	var out []Claim
	for _, claims := range d.Claims {
		for _, c := range claims {
			if c.Verdict == v {
				out = append(out, c)
			}
		}
	}
	slices.SortFunc(out, func(a, b Claim) int {
		return cmp.Or(strings.Compare(a.Key(), b.Key()), a.VIP.Compare(b.VIP))
	})
	return out
}
