package topology

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// ipPath is iproute2's ip: /sbin/ip in the VM, where busybox's sh would
// otherwise run its own ip applet.
func ipPath() string {
	if _, err := os.Stat("/sbin/ip"); err == nil {
		return "/sbin/ip"
	}
	return "ip"
}

// IP runs iproute2's ip with args and returns its output.
func IP(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, ipPath(), args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// InNS runs a command inside the named namespace, as ip netns exec would,
// and returns its combined output. The command is started from a thread in
// the namespace, whose namespace it inherits: no ip process in between,
// which halves what the lab's polls cost the emulated VM.
func InNS(ctx context.Context, ns, name string, args ...string) (string, error) {
	h, err := netns.GetFromName(ns)
	if err != nil {
		return "", fmt.Errorf("%s %s in netns %s: %w", name, strings.Join(args, " "), ns, err)
	}
	defer h.Close()
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := nsexec.Do(h, cmd.Run); err != nil {
		return out.String(), fmt.Errorf("%s %s in netns %s: %w: %s", name, strings.Join(args, " "), ns, err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// Sysctl sets a sysctl (dotted name, e.g. net.ipv4.ip_forward) inside the
// named namespace.
func Sysctl(ctx context.Context, ns, name, value string) error {
	h, err := netns.GetFromName(ns)
	if err != nil {
		return fmt.Errorf("sysctl %s in %s: %w", name, ns, err)
	}
	defer h.Close()
	path := "/proc/sys/" + strings.ReplaceAll(name, ".", "/")
	err = nsexec.Do(h, func() error { return os.WriteFile(path, []byte(value), 0o644) })
	if err != nil {
		return fmt.Errorf("sysctl %s=%s in %s: %w", name, value, ns, err)
	}
	return nil
}

// script runs ip commands, one per line, failing on the first error.
func script(ctx context.Context, lines ...string) error {
	for _, line := range lines {
		if _, err := IP(ctx, strings.Fields(line)...); err != nil {
			return err
		}
	}
	return nil
}

func (l *Lab) allNamespaces() []string {
	names := []string{ClientNS, GatewayNS}
	for _, n := range l.Nodes() {
		names = append(names, n.Name)
	}
	for _, p := range l.Pods {
		names = append(names, p.Name)
	}
	return names
}

// ipv6HostSysctls make IPv6 in a lab namespace behave like its IPv4: set
// before any link is created there ("default" is what new links start
// with), so that addresses are usable at once (no duplicate address
// detection, which would hold every address tentative for a second or more
// and drop packets to it meanwhile), and no router advertisement, which
// nothing in the lab sends, is solicited or obeyed.
var ipv6HostSysctls = []struct{ name, value string }{
	{"net.ipv6.conf.all.accept_dad", "0"},
	{"net.ipv6.conf.default.accept_dad", "0"},
	{"net.ipv6.conf.all.accept_ra", "0"},
	{"net.ipv6.conf.default.accept_ra", "0"},
	{"net.ipv6.conf.all.router_solicitations", "0"},
	{"net.ipv6.conf.default.router_solicitations", "0"},
}

// buildNetwork creates every namespace, link, address and route, in both
// address families.
func (l *Lab) buildNetwork(ctx context.Context) error {
	_ = l.deleteNamespaces() // leftovers of an interrupted run
	for _, name := range l.allNamespaces() {
		if err := script(ctx, "netns add "+name); err != nil {
			return err
		}
		for _, s := range ipv6HostSysctls {
			if err := Sysctl(ctx, name, s.name, s.value); err != nil {
				return err
			}
		}
		if err := script(ctx, "-n "+name+" link set lo up"); err != nil {
			return err
		}
	}
	gw, fabric, fabric6, client6 := GatewayNS, fabricNet.Bits(), fabricNet6.Bits(), clientNet6.Bits()
	gwClient6 := mirror6(clientNet6, 1)
	// The gateway: a bridge for the node network, a link to the client,
	// routes to the pod CIDRs; tunnel IPs are routed by RouteTunnelsVia.
	// Bridges do not snoop multicast: with no MLD querier in the lab, a
	// snooping bridge could stop flooding a neighbour solicitation to the
	// port of the address it asks for.
	if err := script(ctx,
		fmt.Sprintf("-n %s link add %s type bridge mcast_snooping 0", gw, FabricBridge),
		fmt.Sprintf("-n %s addr add %s/%d dev %s", gw, GatewayAddr, fabric, FabricBridge),
		fmt.Sprintf("-n %s addr add %s/%d dev %s nodad", gw, GatewayAddr6, fabric6, FabricBridge),
		fmt.Sprintf("-n %s link set %s up", gw, FabricBridge),
		fmt.Sprintf("-n %s link add eth0 type veth peer name client netns %s", ClientNS, gw),
		fmt.Sprintf("-n %s addr add %s/%d dev eth0", ClientNS, ClientAddr, clientNet.Bits()),
		fmt.Sprintf("-n %s addr add %s/%d dev eth0 nodad", ClientNS, ClientAddr6, client6),
		fmt.Sprintf("-n %s link set eth0 up", ClientNS),
		fmt.Sprintf("-n %s route add default via %s", ClientNS, clientNet.Addr().Next()),
		fmt.Sprintf("-n %s -6 route add default via %s", ClientNS, gwClient6),
		fmt.Sprintf("-n %s addr add %s/%d dev client", gw, clientNet.Addr().Next(), clientNet.Bits()),
		fmt.Sprintf("-n %s addr add %s/%d dev client nodad", gw, gwClient6, client6),
		fmt.Sprintf("-n %s link set client up", gw),
	); err != nil {
		return err
	}
	for _, n := range l.Nodes() {
		if err := script(ctx,
			fmt.Sprintf("-n %s link add eth0 type veth peer name %s netns %s", n.Name, n.Name, gw),
			fmt.Sprintf("-n %s link set %s master %s up", gw, n.Name, FabricBridge),
			fmt.Sprintf("-n %s addr add %s/%d dev eth0", n.Name, n.Addr, fabric),
			fmt.Sprintf("-n %s addr add %s/%d dev eth0 nodad", n.Name, n.Addr6, fabric6),
			fmt.Sprintf("-n %s link set eth0 up", n.Name),
			fmt.Sprintf("-n %s route add default via %s", n.Name, GatewayAddr),
			fmt.Sprintf("-n %s -6 route add default via %s", n.Name, GatewayAddr6),
		); err != nil {
			return err
		}
	}
	if l.Opts.ConntrackSync {
		if err := l.buildSyncLink(ctx); err != nil {
			return err
		}
	}
	// Pod CIDRs are routed to their workers, as a CNI in host-gateway mode
	// (or BGP) would do, on the gateway and on the routers.
	for _, w := range l.Workers {
		for _, ns := range append([]string{gw}, names(l.Routers)...) {
			if err := script(ctx,
				fmt.Sprintf("-n %s route add %s via %s", ns, w.PodCIDR, w.Addr),
				fmt.Sprintf("-n %s -6 route add %s via %s", ns, w.PodCIDR6, w.Addr6),
			); err != nil {
				return err
			}
		}
		if err := script(ctx,
			fmt.Sprintf("-n %s link add %s type bridge mcast_snooping 0", w.Name, PodBridge),
			fmt.Sprintf("-n %s addr add %s/%d dev %s", w.Name, w.PodCIDR.Addr().Next(), w.PodCIDR.Bits(), PodBridge),
			fmt.Sprintf("-n %s addr add %s/%d dev %s nodad", w.Name, mirror6(w.PodCIDR6, 1), w.PodCIDR6.Bits(), PodBridge),
			fmt.Sprintf("-n %s link set %s up", w.Name, PodBridge),
		); err != nil {
			return err
		}
	}
	for _, p := range l.Pods {
		w := p.Node
		if err := script(ctx,
			fmt.Sprintf("-n %s link add eth0 type veth peer name veth-%s netns %s", p.Name, p.Name, w.Name),
			fmt.Sprintf("-n %s link set veth-%s master %s up", w.Name, p.Name, PodBridge),
			fmt.Sprintf("-n %s addr add %s/%d dev eth0", p.Name, p.Addr, w.PodCIDR.Bits()),
			fmt.Sprintf("-n %s addr add %s/%d dev eth0 nodad", p.Name, p.Addr6, w.PodCIDR6.Bits()),
			fmt.Sprintf("-n %s link set eth0 up", p.Name),
			fmt.Sprintf("-n %s route add default via %s", p.Name, w.PodCIDR.Addr().Next()),
			fmt.Sprintf("-n %s -6 route add default via %s", p.Name, mirror6(w.PodCIDR6, 1)),
		); err != nil {
			return err
		}
	}
	// Forwarding: the gateway and every node (the CNI sets it on workers; the
	// router only warns when it is off), in both families. The gateway's
	// reverse-path filter is loose, as replies from tunnel IPs come from
	// workers (IPv6 has no such filter).
	for _, ns := range append([]string{gw}, names(l.Nodes())...) {
		for _, name := range []string{"net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"} {
			if err := Sysctl(ctx, ns, name, "1"); err != nil {
				return err
			}
		}
	}
	// Conntrack counts each entry's packets on the routers, for failure
	// reports: an entry one late packet created tells itself from a flow.
	for _, r := range l.Routers {
		if err := Sysctl(ctx, r.Name, "net.netfilter.nf_conntrack_acct", "1"); err != nil {
			return err
		}
	}
	if err := Sysctl(ctx, gw, "net.ipv4.conf.all.rp_filter", "2"); err != nil {
		return err
	}
	// Hash ECMP routes to the routers on the whole 5-tuple, as datacenter
	// routers do. Not with policy 1 (L4): it reuses the hash the client's
	// socket gave its packets, which cross veths within one kernel; that
	// hash is random per connection and TCP changes it on every
	// retransmission timeout, so a flow stuck behind a lost router would
	// move to another one by itself. Policy 3 hashes the fields below
	// (source and destination address, protocol, ports: 0x37; for IPv6
	// not the flow label) from the headers, as `ip route get ... sport ...
	// dport ...` computes it too.
	for _, family := range []string{"ipv4", "ipv6"} {
		for name, value := range map[string]string{"fib_multipath_hash_policy": "3", "fib_multipath_hash_fields": "55"} {
			if err := Sysctl(ctx, gw, "net."+family+"."+name, value); err != nil {
				return err
			}
		}
	}
	return l.RouteTunnelsVia(ctx, l.Routers...)
}

// buildSyncLink joins the routers on a bridge of their own, each on
// SyncLink with an address of syncNet (conntrackd's multicast needs one
// segment). The bridge does not snoop multicast: nothing in the lab
// queries IGMP.
func (l *Lab) buildSyncLink(ctx context.Context) error {
	gw := GatewayNS
	if err := script(ctx,
		fmt.Sprintf("-n %s link add %s type bridge mcast_snooping 0", gw, SyncBridge),
		fmt.Sprintf("-n %s link set %s up", gw, SyncBridge),
	); err != nil {
		return err
	}
	for i, r := range l.Routers {
		if err := script(ctx,
			fmt.Sprintf("-n %s link add %s type veth peer name %s netns %s", r.Name, SyncLink, syncPort(r), gw),
			fmt.Sprintf("-n %s link set %s master %s up", gw, syncPort(r), SyncBridge),
			fmt.Sprintf("-n %s addr add %s/%d dev %s", r.Name, syncAddr(i), syncNet.Bits(), SyncLink),
			fmt.Sprintf("-n %s link set %s up", r.Name, SyncLink),
		); err != nil {
			return err
		}
	}
	return nil
}

// syncAddr is the address of the i-th router (of Lab.Routers) on SyncLink:
// 172.21.0.1, .2, ...
func syncAddr(i int) netip.Addr {
	addr := syncNet.Addr().As4()
	addr[3] = byte(i + 1)
	return netip.AddrFrom4(addr)
}

// syncPeers is --conntrack-sync-peers for router n: the other routers'
// SyncLink addresses, comma-separated.
func (l *Lab) syncPeers(n *Node) string {
	var peers []string
	for i, r := range l.Routers {
		if r != n {
			peers = append(peers, syncAddr(i).String())
		}
	}
	return strings.Join(peers, ",")
}

// syncPort is the gateway's end of a router's SyncLink.
func syncPort(n *Node) string { return "sync-" + n.Name }

// RouteTunnelsVia points the gateway's routes for TunnelNet and TunnelNet6
// at the given routers: one is a plain route, several an ECMP route hashed
// per flow. It is what BGP would do when routers come and go.
func (l *Lab) RouteTunnelsVia(ctx context.Context, routers ...*Node) error {
	if len(routers) == 0 {
		return errors.New("topology: RouteTunnelsVia needs a router")
	}
	if _, err := IP(ctx, tunnelRouteArgs(TunnelNet, routers, func(n *Node) netip.Addr { return n.Addr })...); err != nil {
		return err
	}
	return l.RouteTunnels6Via(ctx, routers...)
}

// RouteTunnels6Via is RouteTunnelsVia for TunnelNet6 alone.
func (l *Lab) RouteTunnels6Via(ctx context.Context, routers ...*Node) error {
	if len(routers) == 0 {
		return errors.New("topology: RouteTunnels6Via needs a router")
	}
	_, err := IP(ctx, tunnelRouteArgs(TunnelNet6, routers, func(n *Node) netip.Addr { return n.Addr6 })...)
	return err
}

// tunnelRouteArgs are ip's arguments for the gateway's route for network
// through routers (at the address addr gives).
func tunnelRouteArgs(network netip.Prefix, routers []*Node, addr func(*Node) netip.Addr) []string {
	args := []string{"-n", GatewayNS, "route", "replace", network.String()}
	if len(routers) == 1 {
		return append(args, "via", addr(routers[0]).String())
	}
	for _, r := range routers {
		args = append(args, "nexthop", "via", addr(r).String())
	}
	return args
}

// SetNodeLink sets the node's fabric link (and a router's sync link) up or
// down from the gateway side, which is what a node losing power looks like
// to the rest of the network.
func (l *Lab) SetNodeLink(ctx context.Context, n *Node, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	if _, err := IP(ctx, "-n", GatewayNS, "link", "set", n.Name, state); err != nil {
		return err
	}
	if l.Opts.ConntrackSync && n.Tunnel {
		if _, err := IP(ctx, "-n", GatewayNS, "link", "set", syncPort(n), state); err != nil {
			return err
		}
	}
	return nil
}

// deleteNamespaces deletes the lab's namespaces that exist.
func (l *Lab) deleteNamespaces() error {
	var errs []error
	for _, name := range l.allNamespaces() {
		if _, err := os.Stat("/run/netns/" + name); err != nil {
			continue
		}
		if _, err := IP(context.Background(), "netns", "del", name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func names(nodes []*Node) []string {
	var out []string
	for _, n := range nodes {
		out = append(out, n.Name)
	}
	return out
}

// addrs returns the pods' addresses.
func addrs(pods []*Pod) []netip.Addr {
	var out []netip.Addr
	for _, p := range pods {
		out = append(out, p.Addr)
	}
	return out
}

// AddClientAddrs gives the client n more addresses after first (ClientAddr,
// 198.51.100.11, ...; or ClientAddr6, 2001:db8:100::11, ...), each a host
// prefix on its link to the gateway, which reaches them on the client
// network it is on. IPv6 ones skip duplicate address detection, so they are
// usable at once, and are deprecated (preferred_lft 0), so that the kernel
// never picks one as the source of a connection that does not bind it: as
// with IPv4, the client's own address stays the default source. Remove
// them with RemoveClientAddrs.
func (l *Lab) AddClientAddrs(ctx context.Context, first netip.Addr, n int) ([]netip.Addr, error) {
	var addrs []netip.Addr
	var cmds []string
	a := first
	for range n {
		a = a.Next()
		addrs = append(addrs, a)
		cmds = append(cmds, fmt.Sprintf("-n %s addr add %s dev eth0%s", ClientNS, HostPrefix(a), extraAddrFlags(a)))
	}
	return addrs, script(ctx, cmds...)
}

// extraAddrFlags are the flags of an added IPv6 client address: no
// duplicate address detection, and never a default source address.
func extraAddrFlags(a netip.Addr) string {
	if a.Is6() {
		return " nodad preferred_lft 0"
	}
	return ""
}

// RemoveClientAddrs removes addresses AddClientAddrs added.
func (l *Lab) RemoveClientAddrs(ctx context.Context, addrs []netip.Addr) error {
	var cmds []string
	for _, a := range addrs {
		cmds = append(cmds, fmt.Sprintf("-n %s addr del %s dev eth0", ClientNS, HostPrefix(a)))
	}
	return script(ctx, cmds...)
}
