package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// DecapDevice creates and recognises the decapsulation device. It is a seam
// so that tests on a host kernel without GRE can use a stand-in; the agent
// always uses GRE.
type DecapDevice interface {
	// NewLink describes a new device named name with local address local.
	NewLink(name string, local netip.Addr) netlink.Link
	// Local returns the device's local address; ok is false when the link is
	// not of this kind.
	Local(l netlink.Link) (addr netip.Addr, ok bool)
}

// GRE is the decapsulation device of gre mode: a GRE device with the pod IP
// as local address, any remote and no key, so it accepts GRE from every
// router.
type GRE struct{}

// NewLink implements DecapDevice.
func (GRE) NewLink(name string, local netip.Addr) netlink.Link {
	return &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: name, Alias: DeviceAlias}, Local: local.AsSlice()}
}

// Local implements DecapDevice.
func (GRE) Local(l netlink.Link) (netip.Addr, bool) {
	gre, ok := l.(*netlink.Gretun)
	if !ok || gre.FlowBased {
		return netip.Addr{}, false
	}
	addr, _ := netip.AddrFromSlice(gre.Local.To4())
	return addr, true
}

// Netlink handles are opened for NETLINK_ROUTE only: a handle for every
// family fails with "protocol not supported" on kernels without xfrm_user
// (found in the lab VM).

// PodNetwork configures pods' network namespaces: it reads what a namespace
// holds, plans the difference to the desired state and applies it.
type PodNetwork struct {
	cfg    Config
	kind   DecapDevice
	sysctl Sysctls
	// tables reads and writes pods' filter tables (network policy); nil:
	// the agent never looks at them.
	tables PolicyTables
	// node is the node's own namespace, which is never treated as a pod's.
	node netns.NsHandle
}

// NewPodNetwork returns the PodNetwork of the agent running in the node's
// namespace node.
func NewPodNetwork(cfg Config, node netns.NsHandle) *PodNetwork {
	return &PodNetwork{cfg: cfg, kind: GRE{}, sysctl: ProcSysctls{Dir: cfg.ProcSys}, node: node}
}

// WithPolicyTables returns a copy of p that enforces pods' network
// policy through tables (nil: never reads nor writes a filter table).
func (p *PodNetwork) WithPolicyTables(tables PolicyTables) *PodNetwork {
	c := *p
	c.tables = tables
	return &c
}

// WithDevice returns a copy of p that creates device instead of GRE.
func (p *PodNetwork) WithDevice(device DecapDevice) *PodNetwork {
	c := *p
	c.kind = device
	return &c
}

// Sync makes the namespace ns of a pod hold exactly want, and returns the
// changes it made (none when the namespace was already right). It first
// checks that the pod IP is on an interface of ns, so that a namespace handed
// out by mistake is never changed.
func (p *PodNetwork) Sync(ns netns.NsHandle, want PodTunnels) ([]PodChange, error) {
	if p.node.IsOpen() && p.node.Equal(ns) {
		return nil, errors.New("refusing to configure the node's own network namespace as a pod's (a host-network sandbox?)")
	}
	if !want.Pod.IP.Is4() {
		return nil, fmt.Errorf("pod %s has no IPv4 address to check its namespace by", want.Pod)
	}
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle in pod namespace: %w", err)
	}
	defer nl.Close()
	have, err := p.observe(nl, ns, want.Pod.IP)
	if err != nil {
		return nil, err
	}
	return p.planAndApply(nl, ns, want, have)
}

// planAndApply plans the changes from have to want and makes them, returning
// those made.
//
// The filter table (network policy) is read and written by iptables
// commands run in the pod, much slower than netlink. An isolated pod's
// rules must be in place before its tunnel IPs, and removed rules go after
// them, so the table is read first and its change planned with the rest.
// A served pod that no policy isolates needs only the connection tracking
// rule: its tunnel IPs come first, and the table after, so that a new pod
// starts answering without waiting for iptables.
func (p *PodNetwork) planAndApply(nl *netlink.Handle, ns netns.NsHandle, want PodTunnels, have podState) ([]PodChange, error) {
	tablesFirst := want.Isolated() || len(want.TunnelIPs) == 0
	if tablesFirst {
		p.readTables(ns, &have)
	}
	acts, err := planPod(p.cfg, want, have)
	if err != nil {
		return nil, err
	}
	for i, a := range acts {
		if err := p.apply(nl, ns, a); err != nil {
			return acts[:i], fmt.Errorf("%s: %w", a, err)
		}
	}
	if tablesFirst || p.tables == nil {
		return acts, nil
	}
	p.readTables(ns, &have)
	a, err := planPolicy(want, have)
	if err != nil || a == nil {
		return acts, err
	}
	if err := p.apply(nl, ns, *a); err != nil {
		return acts, fmt.Errorf("%s: %w", a, err)
	}
	return append(acts, *a), nil
}

// readTables reads the pod's filter table into st (nothing without tables).
func (p *PodNetwork) readTables(ns netns.NsHandle, st *podState) {
	if p.tables == nil {
		return
	}
	st.TablesRead = true
	if save, err := p.tables.Save(ns); err != nil {
		st.PolicyErr = err
	} else {
		st.Policy = netpol.ParseSave(save)
	}
}

// observe reads what the pod's namespace holds of the agent's. An invalid
// podIP (cleanup, which does not know the pods) skips the check that the
// namespace holds it.
func (p *PodNetwork) observe(nl *netlink.Handle, ns netns.NsHandle, podIP netip.Addr) (podState, error) {
	var st podState
	addrs, err := nl.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return st, fmt.Errorf("listing addresses: %w", err)
	}
	lo, err := nl.LinkByName("lo")
	if err != nil {
		return st, fmt.Errorf("finding lo: %w", err)
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		switch {
		case a.LinkIndex == lo.Attrs().Index && a.Label == LoopbackLabel:
			st.LoopbackIPs = append(st.LoopbackIPs, ip)
		case ip == podIP && a.LinkIndex != lo.Attrs().Index:
			link, err := nl.LinkByIndex(a.LinkIndex)
			if err != nil {
				return st, fmt.Errorf("finding the interface of the pod IP: %w", err)
			}
			st.PodLink = link.Attrs().Name
		}
	}
	if st.PodLink == "" && podIP.IsValid() {
		return st, fmt.Errorf("the pod IP %v is on no interface of this network namespace: not the pod's, or not set up yet", podIP)
	}

	link, err := nl.LinkByName(p.cfg.Device)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
	case err != nil:
		return st, fmt.Errorf("looking up device %s: %w", p.cfg.Device, err)
	default:
		local, ok := p.kind.Local(link)
		alias := link.Attrs().Alias
		// The alias marks the agent's device (one of another kind gets an
		// invalid local address, so it is replaced). A device without the
		// alias is the agent's only when it is exactly what the agent creates
		// in this pod (see deviceState.Unmarked).
		if !(alias == DeviceAlias || ok && alias == "" && local == podIP) {
			st.ForeignDevice = true
			break
		}
		st.Device = &deviceState{Local: local, Up: link.Attrs().Flags&net.FlagUp != 0, Unmarked: alias == ""}
		devAddrs, err := nl.AddrList(link, netlink.FAMILY_V4)
		if err != nil {
			return st, fmt.Errorf("listing addresses of %s: %w", p.cfg.Device, err)
		}
		for _, a := range devAddrs {
			ip, _ := netip.AddrFromSlice(a.IP.To4())
			st.DeviceIPs = append(st.DeviceIPs, ip)
		}
	}

	routes, err := nl.RouteListFiltered(netlink.FAMILY_MPLS, &netlink.Route{Protocol: netlink.RouteProtocol(p.cfg.RouteProtocol)}, netlink.RT_FILTER_PROTOCOL)
	switch {
	case err != nil && p.cfg.Mode == encap.MPLS:
		return st, fmt.Errorf("listing MPLS routes (does the kernel have MPLS, CONFIG_MPLS_ROUTING?): %w", err)
	case err == nil:
		for _, r := range routes {
			if r.MPLSDst != nil && *r.MPLSDst == PodLabel {
				st.PopRoute = true
			}
		}
	}

	if p.cfg.PodAdvMSS != 0 {
		if r, ok, err := defaultRoute(nl); err != nil {
			return st, err
		} else if ok {
			st.DefaultRoute, st.AdvMSS = true, r.AdvMSS
		}
	}

	st.Sysctls, err = p.sysctl.Read(ns, podSysctls(p.cfg, st.PodLink))
	if err != nil {
		return st, err
	}
	slices.SortFunc(st.DeviceIPs, netip.Addr.Compare)
	slices.SortFunc(st.LoopbackIPs, netip.Addr.Compare)
	return st, nil
}

// Cleanup removes everything the agent owns from the namespace ns, whichever
// pod it belongs to: its device (by name and alias), lo addresses labelled
// LoopbackLabel, its MPLS pop route, and an advmss equal to --pod-advmss.
func (p *PodNetwork) Cleanup(ns netns.NsHandle) ([]PodChange, error) {
	if p.node.IsOpen() && p.node.Equal(ns) {
		return nil, nil
	}
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle: %w", err)
	}
	defer nl.Close()
	cfg := *p
	cfg.cfg.Mode = encap.GRE // tolerate kernels without MPLS while reading
	have, err := cfg.observe(nl, ns, netip.Addr{})
	if err != nil {
		return nil, err
	}
	return p.planAndApply(nl, ns, PodTunnels{}, have)
}

// DecapCounters reads the receive counters of the agent's decapsulation
// device in the pod namespace ns (the kernel's link statistics): one count
// for all the pod's tunnel IPs, as they share the device. A device of that
// name the agent did not create is not read.
func (p *PodNetwork) DecapCounters(ns netns.NsHandle) (DecapCounters, error) {
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return DecapCounters{}, fmt.Errorf("netlink handle in pod namespace: %w", err)
	}
	defer nl.Close()
	link, err := nl.LinkByName(p.cfg.Device)
	if err != nil {
		return DecapCounters{}, fmt.Errorf("looking up device %s: %w", p.cfg.Device, err)
	}
	if link.Attrs().Alias != DeviceAlias {
		return DecapCounters{}, fmt.Errorf("device %s was not created by kube-service-tunnel", p.cfg.Device)
	}
	stats := link.Attrs().Statistics
	if stats == nil {
		return DecapCounters{}, fmt.Errorf("device %s: the kernel gave no statistics", p.cfg.Device)
	}
	return DecapCounters{Packets: stats.RxPackets, Bytes: stats.RxBytes}, nil
}

// PolicyDrops reads, in the pod namespace ns, the counters of the packets
// each tunnel IP's network policy dropped.
func (p *PodNetwork) PolicyDrops(ns netns.NsHandle) (map[netip.Addr]netpol.Counter, error) {
	if p.tables == nil {
		return nil, errors.New("network policy is off")
	}
	save, err := p.tables.Save(ns)
	if err != nil {
		return nil, err
	}
	return netpol.ParseSave(save).Dropped, nil
}

// defaultRoute returns the IPv4 default route of the main table.
func defaultRoute(nl *netlink.Handle) (netlink.Route, bool, error) {
	routes, err := nl.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return netlink.Route{}, false, fmt.Errorf("listing routes: %w", err)
	}
	for _, r := range routes {
		if r.Dst == nil || (r.Dst.IP.IsUnspecified() && isZeroMask(r.Dst.Mask)) {
			return r, true, nil
		}
	}
	return netlink.Route{}, false, nil
}

func isZeroMask(m net.IPMask) bool {
	ones, _ := m.Size()
	return ones == 0
}

// apply makes one change in the pod's namespace.
func (p *PodNetwork) apply(nl *netlink.Handle, ns netns.NsHandle, a PodChange) error {
	switch a.Kind {
	case actCreateDevice:
		if err := nl.LinkAdd(p.kind.NewLink(p.cfg.Device, a.Addr)); err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) {
				return fmt.Errorf("the kernel has no GRE support (CONFIG_NET_IPGRE, module ip_gre): %w", err)
			}
			return err
		}
		return nil
	case actMarkDevice:
		link, err := nl.LinkByName(p.cfg.Device)
		if err != nil {
			return err
		}
		return nl.LinkSetAlias(link, DeviceAlias)
	case actDeleteDevice:
		link, err := p.ownDevice(nl)
		if err != nil || link == nil {
			return err
		}
		return nl.LinkDel(link)
	case actSetDeviceUp:
		link, err := p.ownDevice(nl)
		if err != nil {
			return err
		}
		if link == nil {
			return fmt.Errorf("device %s vanished", p.cfg.Device)
		}
		return nl.LinkSetUp(link)
	case actAddTunnelIP, actDelTunnelIP:
		link, addr, err := p.addrOf(nl, a)
		if err != nil {
			return err
		}
		if a.Kind == actAddTunnelIP {
			if err := nl.AddrAdd(link, addr); err != nil && !errors.Is(err, unix.EEXIST) {
				return err
			}
			return nil
		}
		if err := nl.AddrDel(link, addr); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return err
		}
		return nil
	case actSetSysctl:
		return p.sysctl.Write(ns, a.Sysctl, a.Value)
	case actAddPopRoute, actDelPopRoute:
		lo, err := nl.LinkByName("lo")
		if err != nil {
			return err
		}
		label := PodLabel
		r := &netlink.Route{MPLSDst: &label, LinkIndex: lo.Attrs().Index, Protocol: netlink.RouteProtocol(p.cfg.RouteProtocol)}
		if a.Kind == actAddPopRoute {
			return nl.RouteReplace(r)
		}
		if err := nl.RouteDel(r); err != nil && !errors.Is(err, unix.ESRCH) {
			return err
		}
		return nil
	case actSyncPolicy:
		if p.tables == nil {
			return errors.New("no iptables to write the network policy rules with")
		}
		return p.tables.Restore(ns, a.Payload)
	case actSetAdvMSS:
		r, ok, err := defaultRoute(nl)
		if err != nil || !ok {
			return err
		}
		r.AdvMSS = a.MSS
		return nl.RouteReplace(&r)
	}
	return fmt.Errorf("unknown action %d", a.Kind)
}

// ownDevice returns the agent's device, or nil when there is none. A device
// of that name without the agent's alias is an error: it is never touched.
func (p *PodNetwork) ownDevice(nl *netlink.Handle) (netlink.Link, error) {
	link, err := nl.LinkByName(p.cfg.Device)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if link.Attrs().Alias != DeviceAlias {
		return nil, fmt.Errorf("device %s was not created by kube-service-tunnel", p.cfg.Device)
	}
	return link, nil
}

// addrOf returns the link and address an address action works on.
func (p *PodNetwork) addrOf(nl *netlink.Handle, a PodChange) (netlink.Link, *netlink.Addr, error) {
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.Addr.AsSlice(), Mask: net.CIDRMask(32, 32)}}
	if a.Loopback {
		lo, err := nl.LinkByName("lo")
		if err != nil {
			return nil, nil, err
		}
		addr.Label = LoopbackLabel
		return lo, addr, nil
	}
	link, err := p.ownDevice(nl)
	if err != nil {
		return nil, nil, err
	}
	if link == nil {
		return nil, nil, fmt.Errorf("device %s is missing", p.cfg.Device)
	}
	return link, addr, nil
}
