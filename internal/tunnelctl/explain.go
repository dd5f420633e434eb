package tunnelctl

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
)

// Flow is the flow explain is asked about.
type Flow struct {
	Proto  uint8
	Client netip.AddrPort
	// TunnelIP's port is 0 when not given (protocols without ports).
	TunnelIP netip.AddrPort
}

// Protocols explain knows by name; any other is given by number.
var Protocols = map[string]uint8{"icmp": 1, "tcp": 6, "udp": 17, "dccp": 33, "esp": 50, "ah": 51, "sctp": 132, "udplite": 136}

// ParseFlow reads explain's arguments: TUNNEL-IP[:PORT], --from
// CLIENT-IP[:PORT] and --proto (a name of Protocols or a number). Ports are
// required for the protocols whose ports HMARK hashes.
func ParseFlow(tunnelIP, from, proto string) (Flow, error) {
	var f Flow
	p, ok := Protocols[strings.ToLower(proto)]
	if !ok {
		n, err := strconv.ParseUint(proto, 10, 8)
		if err != nil {
			return f, fmt.Errorf("--proto %q: want tcp, udp, sctp, icmp, ... or a protocol number", proto)
		}
		p = uint8(n)
	}
	f.Proto = p
	var err error
	if f.TunnelIP, err = parseAddrPort(tunnelIP); err != nil {
		return f, fmt.Errorf("tunnel IP %q: %w", tunnelIP, err)
	}
	if from == "" {
		return f, fmt.Errorf("--from CLIENT-IP[:PORT] is required: the bucket depends on the client's address")
	}
	if f.Client, err = parseAddrPort(from); err != nil {
		return f, fmt.Errorf("--from %q: %w", from, err)
	}
	if f.Client.Addr().Is4() != f.TunnelIP.Addr().Is4() {
		return f, fmt.Errorf("--from %s and tunnel IP %s are of different address families: a flow has one", f.Client.Addr(), f.TunnelIP.Addr())
	}
	if hashesPorts(p) && (f.Client.Port() == 0 || f.TunnelIP.Port() == 0) {
		return f, fmt.Errorf("%s flows are hashed with both ports: give TUNNEL-IP:PORT and --from CLIENT-IP:PORT", protoName(p))
	}
	return f, nil
}

// parseAddrPort reads IP or IP:PORT ([IPv6]:PORT). An IPv4-mapped IPv6
// address is its IPv4 address: that is the packet such a peer sends.
func parseAddrPort(s string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("want IP or IP:PORT")
	}
	return netip.AddrPortFrom(a.Unmap(), 0), nil
}

func hashesPorts(p uint8) bool {
	switch p {
	case 6, 17, 33, 132, 136:
		return true
	}
	return false
}

func protoName(p uint8) string {
	for name, n := range Protocols {
		if n == p {
			return name
		}
	}
	return strconv.Itoa(int(p))
}

// portDropped says why the routers' port filter drops flow f to svc's
// tunnel IP, or "" when it carries it (router.PortFilter): ICMP always
// passes, and every other protocol only on a port of spec.ports.
func portDropped(svc *corev1.Service, f Flow) string {
	filter, ports, _ := router.PortFilter(svc)
	if !filter || f.Proto == unix.IPPROTO_ICMP || f.Proto == unix.IPPROTO_ICMPV6 {
		return ""
	}
	for _, p := range ports {
		if p.Protocol == f.Proto && p.Number == f.TunnelIP.Port() {
			return ""
		}
	}
	return fmt.Sprintf("the Service %s lists no %s port %d in spec.ports (%s: %s opts it into every port)",
		tunnelclaim.ServiceKey(svc), protoName(f.Proto), f.TunnelIP.Port(), router.PortsAnnotation, router.AllPorts)
}

// Explanation is kubectl tunnel explain's answer: where a new flow goes.
type Explanation struct {
	Flow    string `json:"flow"`
	Service string `json:"service"`
	// Bucket is the flow's HMARK bucket, of Buckets.
	Bucket int `json:"bucket"`
	// ClientAffinity: the bucket comes from the client's address alone
	// (sessionAffinity: ClientIP), so every flow of the client shares it.
	ClientAffinity  bool           `json:"clientAffinity"`
	Buckets         int            `json:"buckets"`
	SeedFingerprint string         `json:"seedFingerprint"`
	SeedFrom        string         `json:"seedFrom"`
	Endpoint        EndpointStatus `json:"endpoint"`
	Encapsulation   Encapsulation  `json:"encapsulation"`
	// Policy is what the endpoint pod's NetworkPolicies do with the flow.
	Policy  *PolicyVerdict `json:"policy,omitempty"`
	Routers []RouterPath   `json:"routers"`
	Notes   []string       `json:"notes,omitempty"`
}

// Encapsulation is how a router carries the flow to its pod.
type Encapsulation struct {
	Mode string `json:"mode"`
	// GREDestination is the outer destination (gre mode): the pod.
	GREDestination string `json:"greDestination,omitempty"`
	// MPLSLabel is pushed towards NextHop, the pod's node (mpls mode).
	MPLSLabel uint32 `json:"mplsLabel,omitempty"`
	NextHop   string `json:"nextHop,omitempty"`
}

// RouterPath is what one router does with the flow.
type RouterPath struct {
	Router string `json:"router"`
	// Carries is true when the router would send a new flow of this kind to
	// Endpoint: it programmed the current table.
	Carries    bool   `json:"carries"`
	Generation int    `json:"generation"`
	Mark       string `json:"mark,omitempty"`
	Table      int    `json:"table,omitempty"`
	Announced  bool   `json:"announced"`
	Why        string `json:"why,omitempty"`
}

// Seed is the HMARK seed explain uses, and where it comes from.
type Seed struct {
	Value uint32
	From  string
}

// Explain tells where a new flow f goes.
func (inv *Inventory) Explain(ctx context.Context, f Flow, seed Seed) (*Explanation, error) {
	vip := f.TunnelIP.Addr()
	svc := inv.Decision.Winners[vip]
	if svc == nil {
		why := "no Service claims it"
		for _, c := range inv.Decision.With(tunnelclaim.Refused) {
			if c.VIP == vip {
				why = fmt.Sprintf("Service %s claims it, %s: %v", c.Key(), c.Verdict, c.Err)
				break
			}
		}
		return nil, fmt.Errorf("tunnel IP %v is not served: %s", vip, why)
	}
	s, err := inv.Served(ctx, vip)
	if err != nil {
		return nil, err
	}
	params := hmark.Params{Buckets: uint32(inv.Buckets), Seed: seed.Value}
	flow := hmark.Flow{Src: f.Client.Addr(), Dst: vip, SrcPort: f.Client.Port(), DstPort: f.TunnelIP.Port(), Proto: f.Proto}
	if s.Tunnel.ClientAffinity {
		flow = hmark.ClientFlow(flow)
	}
	b := int(params.Bucket(flow))
	ex := &Explanation{
		Flow:    fmt.Sprintf("%s %s -> %s", protoName(f.Proto), f.Client, f.TunnelIP),
		Service: tunnelclaim.ServiceKey(svc), Bucket: b, Buckets: inv.Buckets, ClientAffinity: s.Tunnel.ClientAffinity,
		SeedFingerprint: hmark.SeedFingerprint(seed.Value), SeedFrom: seed.From,
		Notes: append([]string(nil), s.Problems...),
	}
	if !hashesPorts(f.Proto) || s.Tunnel.ClientAffinity {
		ex.Flow = fmt.Sprintf("%s %s -> %s", protoName(f.Proto), f.Client.Addr(), vip)
	}
	for _, r := range inv.Routers {
		if r.SeedFingerprint != ex.SeedFingerprint {
			ex.Notes = append(ex.Notes, fmt.Sprintf("router %s runs with seed %s, not %s (from %s): its bucket differs from this one", r.Node, r.SeedFingerprint, ex.SeedFingerprint, seed.From))
		}
	}
	if len(s.Tunnel.Table) == 0 {
		ex.Notes = append(ex.Notes, "the tunnel IP has no endpoint: the routers drop its traffic")
	} else {
		ep := s.Tunnel.Table[b]
		for _, e := range s.Endpoints {
			if e.Addr == ep.Addr {
				ex.Endpoint = endpointStatus(e)
			}
		}
		ex.Encapsulation = Encapsulation{Mode: string(inv.Mode)}
		switch inv.Mode {
		case encap.GRE:
			ex.Encapsulation.GREDestination = ep.Addr.String()
		case encap.MPLS:
			label, err := mplslabel.ForEndpoint(ep.Addr)
			if err != nil {
				return nil, err
			}
			ex.Encapsulation.MPLSLabel, ex.Encapsulation.NextHop = label, ep.NodeIP.String()
		}
		if ex.Endpoint.Pod != "" {
			ex.Policy = inv.policyVerdict(ctx, ex.Endpoint.Pod, f.Client.Addr(), f.Proto, f.TunnelIP.Port())
		}
		if ex.Endpoint.State == "draining" {
			ex.Notes = append(ex.Notes, "every endpoint drains: new flows go to draining endpoints")
		}
	}
	dropped := portDropped(svc, f)
	if dropped != "" {
		ex.Notes = append(ex.Notes, "the routers drop this flow: "+dropped)
	}
	for _, r := range inv.Routers {
		rt := inv.routerTunnel(r, s)
		p := RouterPath{Router: r.Node, Generation: rt.Generation, Announced: rt.Announced}
		switch {
		case dropped != "":
			p.Why = "drops it: its protocol and port are not among the Service's spec.ports"
		case !rt.Programmed:
			p.Why = "has not programmed this tunnel IP"
		case rt.Table == "outdated":
			p.Why = "programmed another table than the API's state gives now (catching up, or failing: see its log)"
		case rt.Table == "none":
			p.Why = "holds no table (no endpoint): drops the flow"
		default:
			p.Carries = true
			slot := r.Slot(rt.Generation, b)
			p.Mark, p.Table = fmt.Sprintf("%#x", r.MarkOffset+uint32(slot)), r.TableBase+slot
		}
		if p.Carries && r.BGP && !rt.Announced {
			p.Why = "programmed but not announced: reached only if the network routes the tunnel IP here anyway"
		}
		ex.Routers = append(ex.Routers, p)
	}
	if len(inv.Routers) == 0 {
		ex.Notes = append(ex.Notes, "no router has published its status: which routers carry the flow is unknown")
	}
	ex.Notes = append(ex.Notes, "this is where a NEW flow goes: a flow established before the table last changed keeps its endpoint while that endpoint drains")
	return ex, nil
}
