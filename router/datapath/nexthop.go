package datapath

import (
	"fmt"
	"net/netip"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// hopKind says what a bucket does with a tunnel IP's packets.
type hopKind uint8

const (
	hopNone    hopKind = iota // no route
	hopDrop                   // blackhole: the tunnel IP has no ready endpoint
	hopGRE                    // IP encap to the pod through the flow-based GRE device
	hopMPLS                   // MPLS label towards the pod's node
	hopUnknown                // a route in our table that the router did not build
)

// greTTL is the outer TTL of GRE packets.
const greTTL = 64

// nextHop is the compact form, 16 bytes, in which the router keeps each bucket
// of each tunnel IP: 10,000 tunnel IPs x 64 buckets fit in about 10 MB.
type nextHop struct {
	kind  hopKind
	addr  [4]byte // gre: the pod IP; mpls: the node IP
	label uint32  // mpls only
	link  int32   // output device
}

func (h nextHop) String() string {
	switch h.kind {
	case hopDrop:
		return "drop"
	case hopGRE:
		return fmt.Sprintf("gre to %v", netip.AddrFrom4(h.addr))
	case hopMPLS:
		return fmt.Sprintf("mpls %d via %v", h.label, netip.AddrFrom4(h.addr))
	case hopUnknown:
		return "foreign route"
	}
	return "none"
}

// route builds the kernel route for bucket b of vip.
func (c Config) route(vip netip.Addr, b int, h nextHop) rtnl.Route {
	r := rtnl.Route{
		Table:    uint32(c.Table(b)),
		Dst:      netip.PrefixFrom(vip, 32),
		Type:     rtnl.Unicast,
		Protocol: c.RouteProtocol,
	}
	switch h.kind {
	case hopDrop:
		r.Type = rtnl.Blackhole
	case hopGRE:
		r.LinkIndex = int(h.link)
		r.IPEncap = &rtnl.IPEncap{Dst: netip.AddrFrom4(h.addr), TTL: greTTL}
	case hopMPLS:
		r.LinkIndex = int(h.link)
		r.Gateway = netip.AddrFrom4(h.addr)
		r.MPLSLabels = []uint32{h.label}
	}
	return r
}

// hopOf reads a listed kernel route back into (tunnel IP, bucket, next hop).
// ok is false for routes outside the router's tables. A route the router would
// not have built exactly so comes back as hopUnknown, so that it gets replaced.
func (c Config) hopOf(r *rtnl.Route) (vip netip.Addr, bucket int, h nextHop, ok bool) {
	bucket = int(r.Table) - c.TableBase
	if bucket < 0 || bucket >= MaxBuckets || r.Protocol != c.RouteProtocol {
		return netip.Addr{}, 0, nextHop{}, false
	}
	vip = r.Dst.Addr()
	if r.Dst.Bits() != 32 || !vip.Is4() {
		return vip, bucket, nextHop{kind: hopUnknown}, true
	}
	switch {
	case r.Type == rtnl.Blackhole:
		h = nextHop{kind: hopDrop}
	case r.IPEncap != nil && r.IPEncap.Dst.Is4():
		h = nextHop{kind: hopGRE, addr: r.IPEncap.Dst.As4(), link: int32(r.LinkIndex)}
	case len(r.MPLSLabels) == 1 && r.Gateway.Is4():
		h = nextHop{kind: hopMPLS, addr: r.Gateway.As4(), label: r.MPLSLabels[0], link: int32(r.LinkIndex)}
	default:
		return vip, bucket, nextHop{kind: hopUnknown}, true
	}
	if want := c.route(vip, bucket, h); !want.Equal(r) {
		h = nextHop{kind: hopUnknown}
	}
	return vip, bucket, h, true
}

// hopFor is the next hop that sends a bucket to endpoint ep.
func (c Config) hopFor(ep Endpoint, greLink int, nodeLink func(netip.Addr) (int, error)) (nextHop, error) {
	switch c.Mode {
	case encap.GRE:
		return nextHop{kind: hopGRE, addr: ep.Addr.As4(), link: int32(greLink)}, nil
	case encap.MPLS:
		if !ep.NodeIP.Is4() {
			return nextHop{}, fmt.Errorf("endpoint %v: node %q has no known IPv4 address", ep.Addr, ep.NodeName)
		}
		label, err := mplslabel.ForEndpoint(ep.Addr)
		if err != nil {
			return nextHop{}, err
		}
		link, err := nodeLink(ep.NodeIP)
		if err != nil {
			return nextHop{}, fmt.Errorf("endpoint %v: route to node %v: %w", ep.Addr, ep.NodeIP, err)
		}
		return nextHop{kind: hopMPLS, addr: ep.NodeIP.As4(), label: label, link: int32(link)}, nil
	}
	return nextHop{}, fmt.Errorf("unknown mode %q", c.Mode)
}
