package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/bridgeguard"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/replyexempt"
)

// swapRoute is one MPLS route on the node: the label of a pod address is
// swapped to PodLabel and sent to the pod, via that address (IPv4 or IPv6:
// a dual-stack pod has one route per address, each with its own label).
type swapRoute struct {
	Label   uint32
	Pod     netip.Addr
	LinkIdx int
}

// viaFamily names the family of the route's next hop as iproute2 does.
func (r swapRoute) viaFamily() string {
	if r.Pod.Is6() {
		return "inet6"
	}
	return "inet"
}

// NodeChange is one change to the node's namespace.
type NodeChange struct {
	Sysctl, Value string           // a sysctl to set, or
	Add           swapRoute        // a swap route to add or replace (Label != 0), or
	Del           uint32           // a swap route to delete (label != 0), or
	BridgeGuard   string           // the bridge guard (bridgeguard): guardAdd, guardReplace or guardRemove, or
	ReplyExempt   string           // the reply exemption (replyexempt): guardAdd, guardReplace or guardRemove,
	Untracked     replyexempt.Want // with what it holds
}

// The changes to the bridge guard and the reply exemption.
const (
	guardAdd     = "add"
	guardReplace = "replace"
	guardRemove  = "remove"
)

func (a NodeChange) String() string {
	switch {
	case a.Sysctl != "":
		return "sysctl " + a.Sysctl + "=" + a.Value
	case a.BridgeGuard == guardRemove:
		return "remove bridge table " + bridgeguard.Table
	case a.BridgeGuard != "":
		return fmt.Sprintf("%s bridge table %s (bridged MPLS with label %d dropped)", a.BridgeGuard, bridgeguard.Table, PodLabel)
	case a.ReplyExempt == guardRemove:
		return "remove inet table " + replyexempt.Table
	case a.ReplyExempt != "":
		// Counted, not listed: a node may serve many tunnel IPs.
		return fmt.Sprintf("%s inet table %s (replies from %d tunnel IPs on %v untracked)", a.ReplyExempt, replyexempt.Table, len(a.Untracked.Sources), a.Untracked.Links)
	case a.Add.Label != 0:
		return fmt.Sprintf("mpls route %d as %d via %s %v dev #%d", a.Add.Label, PodLabel, a.Add.viaFamily(), a.Add.Pod, a.Add.LinkIdx)
	default:
		return fmt.Sprintf("remove mpls route %d", a.Del)
	}
}

// Operation names the kernel object a change acts on and what it does to
// it, for the kernel operations metric.
func (a NodeChange) Operation() (object, operation string) {
	switch {
	case a.Sysctl != "":
		return "sysctl", "set"
	case a.BridgeGuard == guardRemove:
		return "bridge_guard", "delete"
	case a.BridgeGuard != "":
		return "bridge_guard", "add"
	case a.ReplyExempt == guardRemove:
		return "reply_exemption", "delete"
	case a.ReplyExempt != "":
		return "reply_exemption", a.ReplyExempt
	case a.Add.Label != 0:
		return "mpls_route", "add"
	default:
		return "mpls_route", "delete"
	}
}

// nodeState is what the node's namespace holds that the agent looks at.
type nodeState struct {
	// Routes are the agent's swap routes (protocol RouteProtocol) by label.
	Routes map[uint32]swapRoute
	// Sysctls by name relative to /proc/sys; "" when missing.
	Sysctls map[string]string
	// BridgeGuard is the bridge guard's table, for PodLabel.
	BridgeGuard bridgeguard.State
	// ReplyExempt is the reply exemption's table.
	ReplyExempt replyexempt.State
}

// errNoPodRoute: the node has no route to a served pod's address yet. Some
// network plugins add it only after the pod runs (Calico: its CNI plugin
// and Felix), so the controller looks again soon instead of backing off.
var errNoPodRoute = errors.New("the node has no route to its IP")

// nodeWant is the node's desired state, derived from the served pods.
type nodeWant struct {
	Routes map[uint32]swapRoute
	// PodLinks are the interfaces towards the pods served on IPv4 (loose
	// rp_filter; IPv6 has none).
	PodLinks []string
	// MPLSInput are the interfaces where routers' MPLS packets arrive.
	MPLSInput []string
	// IPv6Pods: some served pod has an IPv6 tunnel IP.
	IPv6Pods bool
	// BridgeGuard: the node keeps PodLabel off its bridges (mpls mode,
	// some pod served).
	BridgeGuard bool
	// Untracked are the replies exempted from connection tracking: the
	// served tunnel IPs and the interfaces towards their pods (both
	// families); empty without --untrack-replies or a served pod.
	Untracked replyexempt.Want
}

// sysctlNames lists the sysctls planNode reads.
func (w nodeWant) sysctlNames(mode encap.Mode) []string {
	names := []string{sysctlIPForward}
	if mode == encap.GRE && w.IPv6Pods {
		names = append(names, sysctlIPv6Forwarding)
	}
	for _, l := range w.PodLinks {
		names = append(names, rpFilterSysctl(l))
	}
	if mode == encap.MPLS {
		names = append(names, sysctlPlatformLabels)
		for _, l := range w.MPLSInput {
			names = append(names, mplsInputSysctl(l))
		}
	}
	return names
}

// planNode returns the changes that turn have into want: sysctls first (so a
// route is never added that the node would not forward), then swap routes.
// Sysctls are only raised. It is pure.
//
// IPv6 forwarding is checked, never set: in gre mode the node forwards the
// routers' outer IPv6 packets to its pods, which needs
// net.ipv6.conf.all.forwarding=1, but turning it on makes every interface
// of the node a router, which then ignores router advertisements and may
// lose its own IPv6 default route. A dual-stack cluster has it on already
// (Kubernetes requires it); when it is off, problems say so.
func planNode(mode encap.Mode, want nodeWant, have nodeState) (acts []NodeChange, problems []error) {
	// PodLinks are towards the pods served on IPv4.
	served := len(want.PodLinks) > 0 || want.IPv6Pods
	if len(want.PodLinks) > 0 && have.Sysctls[sysctlIPForward] != "1" {
		acts = append(acts, NodeChange{Sysctl: sysctlIPForward, Value: "1"})
	}
	if mode == encap.GRE && want.IPv6Pods && have.Sysctls[sysctlIPv6Forwarding] != "1" {
		problems = append(problems, fmt.Errorf("sysctl %s is %q, not 1: the node does not forward IPv6, so its pods' IPv6 tunnel IPs are unreachable (Kubernetes dual-stack needs it on; the agent leaves it to the node's configuration)", strings.ReplaceAll(sysctlIPv6Forwarding, "/", "."), have.Sysctls[sysctlIPv6Forwarding]))
	}
	for _, l := range want.PodLinks {
		if have.Sysctls[rpFilterSysctl(l)] == "1" {
			acts = append(acts, NodeChange{Sysctl: rpFilterSysctl(l), Value: "2"})
		}
	}
	if mode == encap.MPLS && served {
		if v, _ := strconv.Atoi(have.Sysctls[sysctlPlatformLabels]); v < mplslabel.PlatformLabels {
			acts = append(acts, NodeChange{Sysctl: sysctlPlatformLabels, Value: strconv.Itoa(mplslabel.PlatformLabels)})
		}
		for _, l := range want.MPLSInput {
			if have.Sysctls[mplsInputSysctl(l)] != "1" {
				acts = append(acts, NodeChange{Sysctl: mplsInputSysctl(l), Value: "1"})
			}
		}
	}
	switch {
	case want.BridgeGuard && !have.BridgeGuard.Present:
		acts = append(acts, NodeChange{BridgeGuard: guardAdd})
	case want.BridgeGuard && !have.BridgeGuard.Current:
		acts = append(acts, NodeChange{BridgeGuard: guardReplace})
	case !want.BridgeGuard && have.BridgeGuard.Present:
		acts = append(acts, NodeChange{BridgeGuard: guardRemove})
	}
	switch untracked := want.Untracked.Normalized(); {
	case !untracked.Empty() && !have.ReplyExempt.Present:
		acts = append(acts, NodeChange{ReplyExempt: guardAdd, Untracked: untracked})
	case !untracked.Empty() && (!have.ReplyExempt.Current || !have.ReplyExempt.Have.Equal(untracked)):
		acts = append(acts, NodeChange{ReplyExempt: guardReplace, Untracked: untracked})
	case untracked.Empty() && have.ReplyExempt.Present:
		acts = append(acts, NodeChange{ReplyExempt: guardRemove})
	}
	var labels []uint32
	for l := range have.Routes {
		labels = append(labels, l)
	}
	for l := range want.Routes {
		if _, ok := have.Routes[l]; !ok {
			labels = append(labels, l)
		}
	}
	slices.Sort(labels)
	for _, l := range labels {
		w, wanted := want.Routes[l]
		h, present := have.Routes[l]
		switch {
		case !wanted:
			acts = append(acts, NodeChange{Del: l})
		case !present || h != w:
			acts = append(acts, NodeChange{Add: w})
		}
	}
	return acts, problems
}

// NodeNetwork configures the node's own namespace for the pods it serves.
type NodeNetwork struct {
	cfg    Config
	ns     netns.NsHandle
	sysctl Sysctls
}

// NewNodeNetwork returns the NodeNetwork of the namespace ns (the agent's own,
// on a hostNetwork pod).
func NewNodeNetwork(cfg Config, ns netns.NsHandle) *NodeNetwork {
	return &NodeNetwork{cfg: cfg, ns: ns, sysctl: ProcSysctls{Dir: cfg.ProcSys}}
}

// Sync makes the node serve exactly the pods in served (those with at least
// one tunnel IP); nodeIP picks the MPLS input interface when none is
// configured. It returns the changes made.
func (n *NodeNetwork) Sync(served []PodTunnels, nodeIP netip.Addr) ([]NodeChange, error) {
	nl, err := netlink.NewHandleAt(n.ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle in node namespace: %w", err)
	}
	defer nl.Close()
	want, problems := n.want(nl, served, nodeIP)
	var have nodeState
	// Listed in gre mode too, so that a change of --mode removes them.
	if have.Routes, err = n.listRoutes(nl); err != nil && n.cfg.Mode == encap.MPLS {
		return nil, err
	}
	if have.Sysctls, err = n.sysctl.Read(n.ns, want.sysctlNames(n.cfg.Mode)); err != nil {
		return nil, err
	}
	// Read in gre mode too (a change of --mode removes it), where a kernel
	// without nf_tables has none.
	if have.BridgeGuard, err = bridgeguard.Read(n.ns, PodLabel); err != nil && want.BridgeGuard {
		return nil, err
	}
	// Read without --untrack-replies too (the table of an earlier run is
	// removed), where a kernel without nf_tables has none.
	if have.ReplyExempt, err = replyexempt.Read(n.ns); err != nil && !want.Untracked.Empty() {
		return nil, err
	}
	acts, planProblems := planNode(n.cfg.Mode, want, have)
	for i, a := range acts {
		if err := n.apply(nl, a); err != nil {
			return acts[:i], fmt.Errorf("%s: %w", a, err)
		}
	}
	return acts, errors.Join(append(problems, planProblems...)...)
}

// want derives the node's desired state: for each served pod, for each
// family of its tunnel IPs, the interface towards its address of that
// family (loose rp_filter for IPv4) and, in mpls mode, the swap route of
// that address's label. A pod address the node has no route to is reported
// and left out; the others are still served.
func (n *NodeNetwork) want(nl *netlink.Handle, served []PodTunnels, nodeIP netip.Addr) (nodeWant, []error) {
	w := nodeWant{Routes: map[uint32]swapRoute{}}
	var problems []error
	links := map[string]bool{}
	for _, pt := range served {
		for _, ipv6 := range []bool{false, true} {
			podIP := pt.Pod.Addr(ipv6)
			if len(pt.TunnelIPsOf(ipv6)) == 0 || !podIP.IsValid() {
				continue
			}
			routes, err := nl.RouteGet(podIP.AsSlice())
			if err != nil || len(routes) == 0 || routes[0].LinkIndex == 0 {
				problems = append(problems, fmt.Errorf("pod %s: %w %v: %v", pt.Pod, errNoPodRoute, podIP, err))
				continue
			}
			link, err := nl.LinkByIndex(routes[0].LinkIndex)
			if err != nil {
				problems = append(problems, fmt.Errorf("pod %s: interface towards %v: %w", pt.Pod, podIP, err))
				continue
			}
			if ipv6 {
				w.IPv6Pods = true
			} else {
				// rp_filter is IPv4's: IPv6 has none.
				links[link.Attrs().Name] = true
			}
			if n.cfg.UntrackReplies {
				w.Untracked.Links = append(w.Untracked.Links, link.Attrs().Name)
				w.Untracked.Sources = append(w.Untracked.Sources, pt.TunnelIPsOf(ipv6)...)
			}
			if n.cfg.Mode == encap.MPLS {
				label, err := mplslabel.ForEndpoint(podIP)
				if err != nil {
					problems = append(problems, fmt.Errorf("pod %s: %w", pt.Pod, err))
					continue
				}
				if other, dup := w.Routes[label]; dup {
					problems = append(problems, fmt.Errorf("pods %v and %v share MPLS label %d: the node's pod CIDR must be a /16 or smaller (IPv4) and its pods' IPv6 addresses must differ in their last 16 bits", other.Pod, podIP, label))
					continue
				}
				w.Routes[label] = swapRoute{Label: label, Pod: podIP, LinkIdx: link.Attrs().Index}
			}
		}
	}
	for l := range links {
		w.PodLinks = append(w.PodLinks, l)
	}
	slices.Sort(w.PodLinks)
	if n.cfg.Mode == encap.MPLS && len(served) > 0 {
		w.BridgeGuard = true
		w.MPLSInput = n.cfg.MPLSInputInterfaces
		if len(w.MPLSInput) == 0 {
			name, err := linkHolding(nl, nodeIP)
			if err != nil {
				problems = append(problems, fmt.Errorf("MPLS input interface (set --mpls-input-interfaces): %w", err))
			} else {
				w.MPLSInput = []string{name}
			}
		}
	}
	return w, problems
}

// linkHolding returns the interface that holds ip.
func linkHolding(nl *netlink.Handle, ip netip.Addr) (string, error) {
	if !ip.IsValid() {
		return "", errors.New("the node's address is not known (Node status.addresses)")
	}
	addrs, err := nl.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return "", fmt.Errorf("listing the node's addresses: %w", err)
	}
	for _, a := range addrs {
		if got, _ := netip.AddrFromSlice(a.IP.To4()); got == ip {
			link, err := nl.LinkByIndex(a.LinkIndex)
			if err != nil {
				return "", err
			}
			return link.Attrs().Name, nil
		}
	}
	return "", fmt.Errorf("no interface holds the node address %v", ip)
}

// listRoutes reads the agent's swap routes.
func (n *NodeNetwork) listRoutes(nl *netlink.Handle) (map[uint32]swapRoute, error) {
	routes, err := nl.RouteListFiltered(netlink.FAMILY_MPLS, &netlink.Route{Protocol: netlink.RouteProtocol(n.cfg.RouteProtocol)}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return nil, fmt.Errorf("listing the node's MPLS routes (does the kernel have MPLS, CONFIG_MPLS_ROUTING?): %w", err)
	}
	out := map[uint32]swapRoute{}
	for _, r := range routes {
		if r.MPLSDst == nil || *r.MPLSDst < mplslabel.Base {
			continue
		}
		sr := swapRoute{Label: uint32(*r.MPLSDst), LinkIdx: r.LinkIndex}
		if via, ok := r.Via.(*netlink.Via); ok {
			switch via.AddrFamily {
			case netlink.FAMILY_V4:
				sr.Pod, _ = netip.AddrFromSlice(via.Addr.To4())
			case netlink.FAMILY_V6:
				sr.Pod, _ = netip.AddrFromSlice(via.Addr.To16())
			}
		}
		if !swapsToPodLabel(r) {
			sr.Pod = netip.Addr{} // not what the agent writes: replaced
		}
		out[sr.Label] = sr
	}
	return out, nil
}

// swapsToPodLabel reports whether r swaps to exactly PodLabel.
func swapsToPodLabel(r netlink.Route) bool {
	d, ok := r.NewDst.(*netlink.MPLSDestination)
	return ok && len(d.Labels) == 1 && d.Labels[0] == PodLabel
}

// apply makes one change in the node's namespace.
func (n *NodeNetwork) apply(nl *netlink.Handle, a NodeChange) error {
	switch {
	case a.Sysctl != "":
		return n.sysctl.Write(n.ns, a.Sysctl, a.Value)
	case a.BridgeGuard == guardRemove:
		return bridgeguard.Remove(n.ns)
	case a.BridgeGuard != "":
		return bridgeguard.Install(n.ns, PodLabel, a.BridgeGuard == guardReplace)
	case a.ReplyExempt == guardRemove:
		return replyexempt.Remove(n.ns)
	case a.ReplyExempt != "":
		return replyexempt.Install(n.ns, a.Untracked, a.ReplyExempt == guardReplace)
	case a.Add.Label != 0:
		label := int(a.Add.Label)
		family := netlink.FAMILY_V4
		if a.Add.Pod.Is6() {
			family = netlink.FAMILY_V6
		}
		return nl.RouteReplace(&netlink.Route{
			MPLSDst:   &label,
			NewDst:    &netlink.MPLSDestination{Labels: []int{PodLabel}},
			Via:       &netlink.Via{AddrFamily: family, Addr: net.IP(a.Add.Pod.AsSlice())},
			LinkIndex: a.Add.LinkIdx,
			Protocol:  netlink.RouteProtocol(n.cfg.RouteProtocol),
		})
	default:
		label := int(a.Del)
		err := nl.RouteDel(&netlink.Route{MPLSDst: &label, Protocol: netlink.RouteProtocol(n.cfg.RouteProtocol)})
		if err != nil && !errors.Is(err, unix.ESRCH) {
			return err
		}
		return nil
	}
}
