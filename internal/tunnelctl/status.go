package tunnelctl

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// StatusReport is kubectl tunnel status's answer.
type StatusReport struct {
	Tunnels []TunnelStatus `json:"tunnels"`
	// Claims are the annotated Services that are not served: conflicts'
	// losers, refused and invalid claims.
	Claims  []ClaimStatus   `json:"unservedClaims,omitempty"`
	Routers []RouterSummary `json:"routers"`
	Notes   []string        `json:"notes,omitempty"`
}

// TunnelStatus is one served tunnel IP.
type TunnelStatus struct {
	TunnelIP string `json:"tunnelIP"`
	Service  string `json:"service"`
	Pool     string `json:"pool,omitempty"`
	Mode     string `json:"mode"`
	Buckets  int    `json:"buckets"`
	// ClientAffinity: flows are hashed on the client's address alone
	// (sessionAffinity: ClientIP).
	ClientAffinity bool             `json:"clientAffinity"`
	Table          string           `json:"table,omitempty"`
	Endpoints      []EndpointStatus `json:"endpoints"`
	Routers        []RouterTunnel   `json:"routers"`
	Problems       []string         `json:"problems,omitempty"`
}

// EndpointStatus is one endpoint of a served tunnel IP.
type EndpointStatus struct {
	Pod         string `json:"pod,omitempty"`
	Address     string `json:"address"`
	Node        string `json:"node,omitempty"`
	NodeAddress string `json:"nodeAddress,omitempty"`
	// Buckets is the number of buckets of the table for new flows it owns.
	Buckets int `json:"buckets"`
	// State is "ready" (takes new flows) or "draining" (keeps established
	// flows only).
	State string `json:"state"`
}

// RouterTunnel is what one router published about one tunnel IP.
type RouterTunnel struct {
	Router string `json:"router"`
	// Programmed: the router holds the tunnel IP.
	Programmed bool `json:"programmed"`
	// Table is "current" when the router's table for new flows is the one
	// the API's state gives now, "outdated" when it is another, "none" when
	// it has no table (no endpoint).
	Table      string `json:"table,omitempty"`
	Generation int    `json:"generation"`
	Announced  bool   `json:"announced"`
	// BGP is false when the router announces nothing (routed by other means).
	BGP     bool      `json:"bgp"`
	Updated time.Time `json:"updated"`
}

// ClaimStatus is an annotated Service that is not served its tunnel IP.
type ClaimStatus struct {
	Service  string `json:"service"`
	TunnelIP string `json:"tunnelIP,omitempty"`
	Verdict  string `json:"verdict"`
	Reason   string `json:"reason"`
}

// RouterSummary is one router's published settings.
type RouterSummary struct {
	Node            string    `json:"node"`
	Pod             string    `json:"pod,omitempty"`
	Version         string    `json:"version"`
	Mode            string    `json:"mode"`
	Buckets         int       `json:"buckets"`
	Generations     int       `json:"generations"`
	SeedFingerprint string    `json:"seedFingerprint"`
	BGP             bool      `json:"bgp"`
	TunnelIPs       int       `json:"tunnelIPs"`
	Updated         time.Time `json:"updated"`
}

// StatusFilter selects what status shows: Target is a tunnel IP or a
// Service name (in Namespace); without Target, the tunnel IPs of the
// Services of Namespace ("" for all).
type StatusFilter struct {
	Namespace string
	Target    string
}

// Status builds the report for filter.
func (inv *Inventory) Status(ctx context.Context, filter StatusFilter) (*StatusReport, error) {
	rep := &StatusReport{Notes: slices.Clone(inv.Notes)}
	for _, r := range inv.Routers {
		rep.Routers = append(rep.Routers, RouterSummary{Node: r.Node, Pod: r.Pod, Version: r.Version, Mode: string(r.Mode), Buckets: r.Buckets,
			Generations: r.Generations, SeedFingerprint: r.SeedFingerprint, BGP: r.BGP, TunnelIPs: len(r.Tunnels), Updated: r.Updated})
	}
	if len(inv.Routers) == 0 {
		rep.Notes = append(rep.Notes, "no router has published its status: nothing is known to be programmed (are the routers running, on nodes labelled node=tunnel?)")
	}
	match, err := filter.matcher()
	if err != nil {
		return nil, err
	}
	found := false
	for _, vip := range inv.VIPs() {
		svc := inv.Decision.Winners[vip]
		if !match(vip, svc.Namespace, svc.Name) {
			continue
		}
		found = true
		s, err := inv.Served(ctx, vip)
		if err != nil {
			return nil, err
		}
		rep.Tunnels = append(rep.Tunnels, inv.tunnelStatus(s))
	}
	for _, verdict := range []tunnelclaim.Verdict{tunnelclaim.Lost, tunnelclaim.Refused, tunnelclaim.Invalid} {
		for _, c := range inv.Decision.With(verdict) {
			if !match(c.VIP, c.Service.Namespace, c.Service.Name) {
				continue
			}
			found = true
			cs := ClaimStatus{Service: c.Key(), Verdict: verdict.String()}
			if c.VIP.IsValid() {
				cs.TunnelIP = c.VIP.String()
			}
			switch {
			case c.Err != nil:
				cs.Reason = c.Err.Error()
			case c.Winner != nil:
				cs.Reason = "tunnel IP already served for the older Service " + tunnelclaim.ServiceKey(c.Winner)
			}
			rep.Claims = append(rep.Claims, cs)
		}
	}
	if filter.Target != "" && !found {
		return nil, fmt.Errorf("%s: no Service claims it (annotation %s)", filter.describe(), tunnelclaim.Annotation)
	}
	return rep, nil
}

func (f StatusFilter) describe() string {
	if _, err := netip.ParseAddr(f.Target); err == nil {
		return "tunnel IP " + f.Target
	}
	ns := f.Namespace
	if ns == "" {
		ns = "(all namespaces)"
	}
	return "Service " + ns + "/" + f.Target
}

func (f StatusFilter) matcher() (func(vip netip.Addr, ns, name string) bool, error) {
	if f.Target == "" {
		return func(_ netip.Addr, ns, _ string) bool { return f.Namespace == "" || ns == f.Namespace }, nil
	}
	if vip, err := netip.ParseAddr(f.Target); err == nil {
		return func(v netip.Addr, _, _ string) bool { return v == vip }, nil
	}
	if strings.ContainsAny(f.Target, "/:") {
		return nil, fmt.Errorf("%q is neither a tunnel IP nor a Service name", f.Target)
	}
	return func(_ netip.Addr, ns, name string) bool {
		return name == f.Target && (f.Namespace == "" || ns == f.Namespace)
	}, nil
}

func (inv *Inventory) tunnelStatus(s *Served) TunnelStatus {
	ts := TunnelStatus{TunnelIP: s.VIP.String(), Service: tunnelclaim.ServiceKey(s.Service), Pool: s.Pool, Mode: string(inv.Mode),
		Buckets: inv.Buckets, ClientAffinity: s.Tunnel.ClientAffinity, Table: s.Table, Problems: s.Problems}
	for _, ep := range s.Endpoints {
		ts.Endpoints = append(ts.Endpoints, endpointStatus(ep))
	}
	for _, r := range inv.Routers {
		ts.Routers = append(ts.Routers, inv.routerTunnel(r, s))
	}
	return ts
}

func endpointStatus(ep Endpoint) EndpointStatus {
	es := EndpointStatus{Pod: ep.Pod, Address: ep.Addr.String(), Node: ep.NodeName, Buckets: ep.Buckets, State: "ready"}
	if ep.NodeIP.IsValid() {
		es.NodeAddress = ep.NodeIP.String()
	}
	if ep.Draining {
		es.State = "draining"
	}
	return es
}

func (inv *Inventory) routerTunnel(r routerstatus.Router, s *Served) RouterTunnel {
	rt := RouterTunnel{Router: r.Node, BGP: r.BGP, Updated: r.Updated}
	t, ok := r.Tunnel(s.VIP)
	if !ok {
		return rt
	}
	rt.Programmed, rt.Generation, rt.Announced = true, t.Generation, t.Announced
	switch {
	case t.Table == "":
		rt.Table = "none"
	case t.Table == s.TableFor(r.Buckets, r.Mode, inv.Mode) && t.ClientAffinity == s.Tunnel.ClientAffinity:
		rt.Table = "current"
	default:
		rt.Table = "outdated"
	}
	return rt
}

// Current reports whether the router programmed the table the API gives now.
func (rt RouterTunnel) Current() bool { return rt.Programmed && rt.Table == "current" }
