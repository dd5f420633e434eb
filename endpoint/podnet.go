package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/cmdnu/kube-service-tunnel/endpoint/guard"
	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// DecapDevice creates and recognises the decapsulation devices. It is a seam
// so that tests on a host kernel without GRE can use a stand-in; the agent
// always uses GRE.
type DecapDevice interface {
	// NewLink describes a new device named name with local address local,
	// of local's family.
	NewLink(name string, local netip.Addr) netlink.Link
	// Local returns the device's local address, of the device's family; ok
	// is false when the link is not of this kind.
	Local(l netlink.Link) (addr netip.Addr, ok bool)
}

// GRE is the decapsulation device of gre mode: a GRE device with the pod's
// IPv4 address as local address, any remote and no key, so it accepts GRE
// from every router; for IPv6 tunnel IPs, an ip6gre device with the pod's
// IPv6 address as local address, likewise. The kernel hands a GRE packet
// to a device whose local address is the packet's destination whatever its
// source when no device names that source as its remote
// (ip6gre_tunnel_lookup, ip_tunnel_lookup): the carrier guard
// (endpoint/guard), written before the device, drops GRE from any source
// but the routers.
type GRE struct{}

// NewLink implements DecapDevice: an ip6gre device for an IPv6 local
// address (netlink.Gretun's kind follows its local address).
func (GRE) NewLink(name string, local netip.Addr) netlink.Link {
	return &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: name, Alias: DeviceAlias}, Local: local.AsSlice()}
}

// Local implements DecapDevice.
func (GRE) Local(l netlink.Link) (netip.Addr, bool) {
	gre, ok := l.(*netlink.Gretun)
	if !ok || gre.FlowBased {
		return netip.Addr{}, false
	}
	if gre.Type() == "ip6gre" {
		addr, _ := netip.AddrFromSlice(gre.Local.To16())
		return addr, true
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

// deviceName is the name of the IPv6 decapsulation device (ipv6) or of the
// IPv4 one.
func (p *PodNetwork) deviceName(ipv6 bool) string {
	if ipv6 {
		return p.cfg.IPv6Device()
	}
	return p.cfg.Device
}

// podConn is what one sync of a pod's namespace goes through: a netlink
// handle bound to it, and the socket of address protocols (IPv6 tunnel IPs
// on lo), opened when first needed.
type podConn struct {
	ns    netns.NsHandle
	nl    *netlink.Handle
	addrs *addrConn
}

func openPodConn(ns netns.NsHandle) (*podConn, error) {
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle in pod namespace: %w", err)
	}
	return &podConn{ns: ns, nl: nl}, nil
}

// addrConn returns the socket of address protocols, opening it once.
func (c *podConn) addrConn() (*addrConn, error) {
	if c.addrs == nil {
		a, err := dialAddrs(c.ns)
		if err != nil {
			return nil, err
		}
		c.addrs = a
	}
	return c.addrs, nil
}

func (c *podConn) Close() {
	c.nl.Close()
	if c.addrs != nil {
		c.addrs.Close()
	}
}

// Sync makes the namespace ns of a pod hold exactly want, and returns the
// changes it made (none when the namespace was already right). It first
// checks that every address of the pod is on an interface of ns, so that a
// namespace handed out by mistake is never changed.
func (p *PodNetwork) Sync(ns netns.NsHandle, want PodTunnels) ([]PodChange, error) {
	if p.node.IsOpen() && p.node.Equal(ns) {
		return nil, errors.New("refusing to configure the node's own network namespace as a pod's (a host-network sandbox?)")
	}
	if len(want.Pod.Addrs()) == 0 {
		return nil, fmt.Errorf("pod %s has no address to check its namespace by", want.Pod)
	}
	c, err := openPodConn(ns)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	have, err := p.observe(c, want.Pod, false)
	if err != nil {
		return nil, err
	}
	return p.planAndApply(c, want, have, want.Pod.IPv6.IsValid())
}

// planAndApply plans the changes from have to want and makes them, returning
// those made; read6 says whether the pod's IPv6 tables are read (a pod
// without an IPv6 address has none of the agent's rules there).
//
// The tables (carrier guard and network policy) are read by iptables-save
// run in the pod, much slower than netlink, but first: a served pod's
// guard must be in place before its decapsulation device and tunnel IPs
// (a device without it decapsulates GRE from anyone), and removed rules go
// after them.
func (p *PodNetwork) planAndApply(c *podConn, want PodTunnels, have podState, read6 bool) ([]PodChange, error) {
	p.readTables(c.ns, &have, read6)
	acts, err := planPod(p.cfg, want, have)
	if err != nil {
		return nil, err
	}
	for i, a := range acts {
		if err := p.apply(c, a); err != nil {
			return acts[:i], fmt.Errorf("%s: %w", a, err)
		}
	}
	return acts, nil
}

// readTables reads the pod's filter tables into st (nothing without
// tables): the IPv4 one, and the IPv6 one when read6.
func (p *PodNetwork) readTables(ns netns.NsHandle, st *podState, read6 bool) {
	if p.tables == nil {
		return
	}
	st.TablesRead = true
	if save, err := p.tables.Save(ns, false); err != nil {
		st.PolicyErr = err
	} else {
		st.Policy, st.Guard = netpol.ParseSave(save), guard.ParseSave(save)
	}
	if !read6 {
		return
	}
	st.Tables6Read = true
	if save, err := p.tables.Save(ns, true); err != nil {
		st.PolicyErr6 = err
	} else {
		st.Policy6, st.Guard6 = netpol.ParseSave(save), guard.ParseSave(save)
	}
}

// observe reads what the pod's namespace holds of the agent's, and checks
// that it holds every address of pod outside lo. cleanup (which does not
// know the pods) skips that check and reads the IPv6 side whatever the
// pod's addresses, tolerating a kernel without IPv6.
func (p *PodNetwork) observe(c *podConn, pod runtime.Pod, cleanup bool) (podState, error) {
	var st podState
	nl := c.nl
	addrs, err := nl.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return st, fmt.Errorf("listing addresses: %w", err)
	}
	lo, err := nl.LinkByName("lo")
	if err != nil {
		return st, fmt.Errorf("finding lo: %w", err)
	}
	loIndex := lo.Attrs().Index
	linkName := func(index int) (string, error) {
		link, err := nl.LinkByIndex(index)
		if err != nil {
			return "", fmt.Errorf("finding the interface of the pod IP: %w", err)
		}
		return link.Attrs().Name, nil
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		switch {
		case a.LinkIndex == loIndex && a.Label == LoopbackLabel:
			st.LoopbackIPs = append(st.LoopbackIPs, ip)
		case ip == pod.IP && a.LinkIndex != loIndex:
			if st.PodLink, err = linkName(a.LinkIndex); err != nil {
				return st, err
			}
		}
	}
	if st.PodLink == "" && pod.IP.IsValid() {
		return st, fmt.Errorf("the pod IP %v is on no interface of this network namespace: not the pod's, or not set up yet", pod.IP)
	}

	read6 := pod.IPv6.IsValid() || cleanup
	var addrs6 []ifAddr
	if read6 {
		ac, err := c.addrConn()
		if err == nil {
			addrs6, err = ac.list(unix.AF_INET6)
		}
		switch {
		case err != nil && cleanup:
			read6 = false // a kernel without IPv6 holds nothing of it
		case err != nil:
			return st, err
		}
	}
	for _, a := range addrs6 {
		ip := a.Prefix.Addr()
		switch {
		case a.LinkIndex == loIndex && a.Proto == p.cfg.RouteProtocol:
			st.LoopbackIPs6 = append(st.LoopbackIPs6, ip)
		case a.LinkIndex == loIndex:
			st.OtherLoopbackIPs6 = append(st.OtherLoopbackIPs6, ip)
		case ip == pod.IPv6:
			if st.PodLink6, err = linkName(a.LinkIndex); err != nil {
				return st, err
			}
		}
	}
	if st.PodLink6 == "" && pod.IPv6.IsValid() {
		return st, fmt.Errorf("the pod IP %v is on no interface of this network namespace: not the pod's, or not set up yet", pod.IPv6)
	}

	for _, ipv6 := range []bool{false, true} {
		if ipv6 && !read6 {
			continue
		}
		if err := p.observeDevice(nl, pod, ipv6, addrs6, &st); err != nil {
			return st, err
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
		if r, ok, err := defaultRoute(nl, false); err != nil {
			return st, err
		} else if ok {
			st.DefaultRoute, st.AdvMSS = true, r.AdvMSS
		}
		if read6 {
			if r, ok, err := defaultRoute(nl, true); err != nil {
				return st, err
			} else if ok {
				st.DefaultRoute6, st.AdvMSS6 = true, r.AdvMSS
			}
		}
	}

	st.Sysctls, err = p.sysctl.Read(c.ns, podSysctls(p.cfg, st, read6))
	if err != nil {
		return st, err
	}
	for _, ips := range [][]netip.Addr{st.DeviceIPs, st.Device6IPs, st.LoopbackIPs, st.LoopbackIPs6, st.OtherLoopbackIPs6} {
		slices.SortFunc(ips, netip.Addr.Compare)
	}
	return st, nil
}

// observeDevice reads the agent's IPv6 (ipv6) or IPv4 decapsulation device
// into st; addrs6 are the namespace's IPv6 addresses.
func (p *PodNetwork) observeDevice(nl *netlink.Handle, pod runtime.Pod, ipv6 bool, addrs6 []ifAddr, st *podState) error {
	name := p.deviceName(ipv6)
	link, err := nl.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		return nil
	case err != nil:
		return fmt.Errorf("looking up device %s: %w", name, err)
	}
	local, ok := p.kind.Local(link)
	ok = ok && local.Is6() == ipv6
	alias := link.Attrs().Alias
	// The alias marks the agent's device (one of another kind gets an
	// invalid local address, so it is replaced). A device without the
	// alias is the agent's only when it is exactly what the agent creates
	// in this pod (see deviceState.Unmarked).
	if !(alias == DeviceAlias || ok && alias == "" && local == pod.Addr(ipv6)) {
		if ipv6 {
			st.ForeignDevice6 = true
		} else {
			st.ForeignDevice = true
		}
		return nil
	}
	if !ok {
		local = netip.Addr{}
	}
	dev := &deviceState{Local: local, Up: link.Attrs().Flags&net.FlagUp != 0, Unmarked: alias == ""}
	if ipv6 {
		st.Device6 = dev
		for _, a := range addrs6 {
			// The kernel gives the device a link-local address of its own.
			if a.LinkIndex == link.Attrs().Index && !a.Prefix.Addr().IsLinkLocalUnicast() {
				st.Device6IPs = append(st.Device6IPs, a.Prefix.Addr())
			}
		}
		return nil
	}
	st.Device = dev
	devAddrs, err := nl.AddrList(link, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("listing addresses of %s: %w", name, err)
	}
	for _, a := range devAddrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		st.DeviceIPs = append(st.DeviceIPs, ip)
	}
	return nil
}

// Cleanup removes everything the agent owns from the namespace ns, whichever
// pod it belongs to: its devices (by name and alias), lo addresses labelled
// LoopbackLabel and lo IPv6 addresses with its address protocol, its MPLS
// pop route, an advmss it sets on either default route, and its network
// policy rules of both families.
func (p *PodNetwork) Cleanup(ns netns.NsHandle) ([]PodChange, error) {
	if p.node.IsOpen() && p.node.Equal(ns) {
		return nil, nil
	}
	c, err := openPodConn(ns)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	cfg := *p
	cfg.cfg.Mode = encap.GRE // tolerate kernels without MPLS while reading
	have, err := cfg.observe(c, runtime.Pod{}, true)
	if err != nil {
		return nil, err
	}
	return p.planAndApply(c, PodTunnels{}, have, true)
}

// DecapCounters reads the receive counters of the agent's IPv6 (ipv6) or
// IPv4 decapsulation device in the pod namespace ns (the kernel's link
// statistics): one count for all the pod's tunnel IPs of that family, as
// they share the device. A device of that name the agent did not create is
// not read.
func (p *PodNetwork) DecapCounters(ns netns.NsHandle, ipv6 bool) (DecapCounters, error) {
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return DecapCounters{}, fmt.Errorf("netlink handle in pod namespace: %w", err)
	}
	defer nl.Close()
	name := p.deviceName(ipv6)
	link, err := nl.LinkByName(name)
	if err != nil {
		return DecapCounters{}, fmt.Errorf("looking up device %s: %w", name, err)
	}
	if link.Attrs().Alias != DeviceAlias {
		return DecapCounters{}, fmt.Errorf("device %s was not created by kube-service-tunnel", name)
	}
	stats := link.Attrs().Statistics
	if stats == nil {
		return DecapCounters{}, fmt.Errorf("device %s: the kernel gave no statistics", name)
	}
	return DecapCounters{Packets: stats.RxPackets, Bytes: stats.RxBytes}, nil
}

// PolicyDrops reads, in the pod namespace ns, the counters of the packets
// each tunnel IP's network policy dropped, from the IPv6 filter table
// (ipv6) or the IPv4 one.
func (p *PodNetwork) PolicyDrops(ns netns.NsHandle, ipv6 bool) (map[netip.Addr]netpol.Counter, error) {
	if p.tables == nil {
		return nil, errors.New("network policy is off")
	}
	save, err := p.tables.Save(ns, ipv6)
	if err != nil {
		return nil, err
	}
	return netpol.ParseSave(save).Dropped, nil
}

// RuleDrops reads, in the pod namespace ns, the counters of what the
// agent's rules dropped, from the IPv6 tables (ipv6) or the IPv4 ones: one
// iptables-save for the network policy's and the carrier guard's.
func (p *PodNetwork) RuleDrops(ns netns.NsHandle, ipv6 bool) (RuleDrops, error) {
	if p.tables == nil {
		return RuleDrops{}, errors.New("no iptables to read the agent's rules with")
	}
	save, err := p.tables.Save(ns, ipv6)
	if err != nil {
		return RuleDrops{}, err
	}
	return RuleDrops{Policy: netpol.ParseSave(save).Dropped, Guard: guard.ParseSave(save).Dropped}, nil
}

// defaultRoute returns the IPv6 (ipv6) or IPv4 default route of the main
// table.
func defaultRoute(nl *netlink.Handle, ipv6 bool) (netlink.Route, bool, error) {
	family := netlink.FAMILY_V4
	if ipv6 {
		family = netlink.FAMILY_V6
	}
	routes, err := nl.RouteListFiltered(family, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
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

// tunnelIPFlags are the flags of the IPv6 tunnel IPs the agent adds: usable
// at once (no duplicate address detection, which a tunnel IP that many pods
// hold would fail anyway), and without a prefix route, as an IPv4 /32 has
// none.
const tunnelIPFlags = unix.IFA_F_NODAD | unix.IFA_F_NOPREFIXROUTE

// apply makes one change in the pod's namespace.
func (p *PodNetwork) apply(c *podConn, a PodChange) error {
	nl := c.nl
	name := p.deviceName(a.IPv6)
	switch a.Kind {
	case actCreateDevice:
		if err := nl.LinkAdd(p.kind.NewLink(name, a.Addr)); err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) {
				if a.IPv6 {
					return fmt.Errorf("the kernel has no ip6gre support (CONFIG_IPV6_GRE, module ip6_gre): %w", err)
				}
				return fmt.Errorf("the kernel has no GRE support (CONFIG_NET_IPGRE, module ip_gre): %w", err)
			}
			return err
		}
		return nil
	case actMarkDevice:
		link, err := nl.LinkByName(name)
		if err != nil {
			return err
		}
		return nl.LinkSetAlias(link, DeviceAlias)
	case actDeleteDevice:
		link, err := p.ownDevice(nl, a.IPv6)
		if err != nil || link == nil {
			return err
		}
		return nl.LinkDel(link)
	case actSetDeviceUp:
		link, err := p.ownDevice(nl, a.IPv6)
		if err != nil {
			return err
		}
		if link == nil {
			return fmt.Errorf("device %s vanished", name)
		}
		return nl.LinkSetUp(link)
	case actAddTunnelIP, actDelTunnelIP:
		if a.Loopback && a.Addr.Is6() {
			return p.applyLoopback6(c, a)
		}
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
		return p.sysctl.Write(c.ns, a.Sysctl, a.Value)
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
	case actSyncPolicy, actSyncGuard:
		if p.tables == nil {
			return errors.New("no iptables to write the agent's rules with")
		}
		return p.tables.Restore(c.ns, a.IPv6, a.Payload)
	case actSetAdvMSS:
		r, ok, err := defaultRoute(nl, a.IPv6)
		if err != nil || !ok {
			return err
		}
		r.AdvMSS = a.MSS
		return nl.RouteReplace(&r)
	}
	return fmt.Errorf("unknown action %d", a.Kind)
}

// applyLoopback6 adds or removes an IPv6 tunnel IP on lo, marked with the
// agent's address protocol. An address already there is someone else's
// (observe reads the agent's own): adding fails rather than take it over.
func (p *PodNetwork) applyLoopback6(c *podConn, a PodChange) error {
	lo, err := c.nl.LinkByName("lo")
	if err != nil {
		return err
	}
	ac, err := c.addrConn()
	if err != nil {
		return err
	}
	addr := ifAddr{LinkIndex: lo.Attrs().Index, Prefix: netip.PrefixFrom(a.Addr, 128), Flags: tunnelIPFlags, Proto: p.cfg.RouteProtocol}
	if a.Kind == actAddTunnelIP {
		return ac.add(addr)
	}
	if err := ac.del(addr); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return err
	}
	return nil
}

// ownDevice returns the agent's IPv6 (ipv6) or IPv4 device, or nil when
// there is none. A device of that name without the agent's alias is an
// error: it is never touched.
func (p *PodNetwork) ownDevice(nl *netlink.Handle, ipv6 bool) (netlink.Link, error) {
	name := p.deviceName(ipv6)
	link, err := nl.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if link.Attrs().Alias != DeviceAlias {
		return nil, fmt.Errorf("device %s was not created by kube-service-tunnel", name)
	}
	return link, nil
}

// addrOf returns the link and address an address action works on: an IPv4
// tunnel IP on lo (labelled), or a tunnel IP of either family on the
// device of its family.
func (p *PodNetwork) addrOf(nl *netlink.Handle, a PodChange) (netlink.Link, *netlink.Addr, error) {
	ipv6 := a.Addr.Is6()
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.Addr.AsSlice(), Mask: net.CIDRMask(a.Addr.BitLen(), a.Addr.BitLen())}}
	if ipv6 {
		addr.Flags = tunnelIPFlags
	}
	if a.Loopback {
		lo, err := nl.LinkByName("lo")
		if err != nil {
			return nil, nil, err
		}
		addr.Label = LoopbackLabel
		return lo, addr, nil
	}
	link, err := p.ownDevice(nl, ipv6)
	if err != nil {
		return nil, nil, err
	}
	if link == nil {
		return nil, nil, fmt.Errorf("device %s is missing", p.deviceName(ipv6))
	}
	return link, addr, nil
}
