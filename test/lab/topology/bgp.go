package topology

// BGP in the lab: the gateway, standing for the datacenter router, runs a
// real BGP daemon (BIRD 2, Debian's bird2, which test/lab puts in the VM) and
// the tunnel routers announce the tunnel IPs they serve to it with their
// embedded GoBGP speaker (--bgp-config). BIRD merges the routers' equal
// routes into one multipath route in the gateway's kernel, which replaces
// the static route RouteTunnelsVia sets. One IPv4 session per router carries
// both families: IPv6 tunnel IPs go over it as multiprotocol IPv6 unicast,
// with the router's IPv6 address (its Node's IPv6 InternalIP) as next hop.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/router/bgp"
	"github.com/cmdnu/kube-service-tunnel/router/startup"
	"github.com/cmdnu/kube-service-tunnel/test/bgppeer/birdconf"
)

// The lab's autonomous systems and BGP timers, short so that a lost router
// is noticed within seconds.
const (
	// GatewayASN is the gateway's AS, RouterASN every tunnel router's.
	GatewayASN = 64500
	RouterASN  = 64512
	// BGPHoldTime and BGPKeepalive are both sides' timers.
	BGPHoldTime  = 3 * time.Second
	BGPKeepalive = time.Second
	// BGPWithdrawDelay is how long a router waits on SIGTERM between
	// withdrawing its routes and closing its sessions.
	BGPWithdrawDelay = time.Second
	// BGPPollInterval is how often the Wait functions look at the gateway;
	// it bounds the resolution of the durations they measure.
	BGPPollInterval = 20 * time.Millisecond
)

// bgpConfigFlag is the routers' flag for their BGP configuration.
const bgpConfigFlag = "--bgp-config"

// EnableBGP makes BGP route the tunnel IPs to the routers: it starts BIRD in
// the gateway's namespace (one passive session per router, as the routers
// only connect out, carrying IPv4 and IPv6 routes), restarts every router
// with a --bgp-config naming the gateway as its peer, waits until every
// session is established and the gateway's kernel routes each of vips
// through every router (at its address of the tunnel IP's family), and only
// then deletes the gateway's static routes of the families of vips
// (TunnelNet, TunnelNet6 or both). A served tunnel IP keeps working
// throughout, and the static route of a family not in vips stays (BGP's
// host routes win over it where they exist). DisableBGP undoes it; Down
// stops BIRD too.
func (l *Lab) EnableBGP(ctx context.Context, vips ...netip.Addr) error {
	if l.Bird != nil {
		return errors.New("topology: BGP is already enabled")
	}
	if len(vips) == 0 {
		return errors.New("topology: EnableBGP needs a tunnel IP, to know which static routes BGP replaces")
	}
	birdPath, err := exec.LookPath("bird")
	if err != nil {
		return fmt.Errorf("topology: %w (test/lab puts Debian's bird2 into the VM: is it installed on the host?)", err)
	}
	dir := filepath.Join(l.Opts.WorkDir, "bgp")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	conf, err := l.birdConfig()
	if err != nil {
		return err
	}
	confPath := filepath.Join(dir, "bird.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		return err
	}
	l.birdSocket = filepath.Join(dir, "bird.ctl")
	bird := &Daemon{
		Name: "bird@" + GatewayNS, NS: GatewayNS, Path: birdPath,
		Args:    []string{"-f", "-c", confPath, "-s", l.birdSocket},
		LogPath: filepath.Join(l.Opts.WorkDir, "bird@"+GatewayNS+".log"),
	}
	if err := bird.Start(); err != nil {
		return err
	}
	l.Bird = bird
	if err := l.poll(ctx, 10*time.Second, func() (bool, string, error) {
		out, err := l.Birdc(ctx, "show", "status")
		if !bird.Running() {
			return false, "", fmt.Errorf("bird exited at start:\n%s", bird.LogTail(20))
		}
		return err == nil && strings.Contains(out, "Daemon is up and running"), fmt.Sprintf("birdc: %v %s", err, out), nil
	}); err != nil {
		return fmt.Errorf("starting bird in %s: %w", GatewayNS, err)
	}
	l.logf("bird %s: AS %d, a passive session for each router (AS %d), hold time %v", GatewayNS, GatewayASN, RouterASN, BGPHoldTime)

	routerConf, err := l.routerBGPConfig()
	if err != nil {
		return err
	}
	routerConfPath := filepath.Join(dir, "tunnel-router-bgp.yaml")
	if err := os.WriteFile(routerConfPath, routerConf, 0o644); err != nil {
		return err
	}
	if err := l.restartRoutersWithFlag(bgpConfigFlag, routerConfPath); err != nil {
		return err
	}
	l.logf("restarted the routers with %s %s", bgpConfigFlag, routerConfPath)
	if err := l.poll(ctx, time.Minute, func() (bool, string, error) {
		for _, r := range l.Routers {
			up, state, err := l.BGPSession(ctx, r)
			if err != nil || !up {
				return false, fmt.Sprintf("session with %s: %s %v", r.Name, state, err), nil
			}
		}
		return true, "", nil
	}); err != nil {
		return fmt.Errorf("BGP sessions: %w", err)
	}
	for _, vip := range vips {
		if _, err := l.WaitGatewayNextHops(ctx, vip, time.Now(), 30*time.Second, l.Routers...); err != nil {
			return err
		}
	}
	for _, network := range []netip.Prefix{TunnelNet, TunnelNet6} {
		if !slices.ContainsFunc(vips, func(vip netip.Addr) bool { return network.Contains(vip) }) {
			continue
		}
		if _, err := IP(ctx, "-n", GatewayNS, "route", "del", network.String()); err != nil {
			return fmt.Errorf("deleting the gateway's static route for %v: %w", network, err)
		}
		l.logf("deleted the gateway's static route for %v: BGP routes its tunnel IPs", network)
	}
	return nil
}

// DisableBGP puts the static routes for TunnelNet and TunnelNet6 back on
// the gateway (RouteTunnelsVia: both, whichever EnableBGP deleted),
// restarts the routers without --bgp-config and stops BIRD (which removes
// its routes from the gateway's kernel). It does nothing when BGP is off.
func (l *Lab) DisableBGP(ctx context.Context) error {
	if l.Bird == nil {
		return nil
	}
	var errs []error
	errs = append(errs, l.RouteTunnelsVia(ctx, l.Routers...))
	errs = append(errs, l.restartRoutersWithFlag(bgpConfigFlag, ""))
	errs = append(errs, l.Bird.Stop())
	l.Bird = nil
	return errors.Join(errs...)
}

// restartRoutersWithFlag restarts every router at once with its flag name
// set to value ("" removes it). Their datapaths stay in the kernel while
// they restart, so traffic goes on.
func (l *Lab) restartRoutersWithFlag(name, value string) error {
	errs := make([]error, len(l.Routers))
	var wg sync.WaitGroup
	for i, r := range l.Routers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.Router.restartWithFlag(name, value)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// birdProtocol is the name of the gateway's BGP session with router n in
// BIRD ("router_a"): BIRD symbols hold no dash.
func birdProtocol(n *Node) string { return strings.ReplaceAll(n.Name, "-", "_") }

// birdConfig renders the gateway's BIRD configuration. Each router's
// session is an IPv4 one that carries IPv6 routes too (an ipv6 channel
// beside the ipv4 one), so one session, one hold timer and one state
// (BGPSession) stand for both families. The gateway accepts only /32s of
// TunnelNet and /128s of TunnelNet6 from the routers, announces nothing,
// and installs the BGP routes in its kernel, merging equal ones into one
// multipath route per family. BGP errors (a hold timer that expired) keep a
// session idle for 1 to 5 s rather than BIRD's default minute or more.
func (l *Lab) birdConfig() (string, error) {
	cfg := birdconf.Config{RouterID: GatewayAddr, ASN: GatewayASN, ImportHostRoutesIn: TunnelNet, ImportHostRoutesIn6: TunnelNet6}
	for _, r := range l.Routers {
		cfg.Neighbors = append(cfg.Neighbors, birdconf.Neighbor{
			Name: birdProtocol(r), Address: r.Addr, LocalAddress: GatewayAddr, ASN: RouterASN,
			HoldTime: BGPHoldTime, KeepaliveTime: BGPKeepalive, Passive: true, CarryIPv6: true,
		})
	}
	conf, err := birdconf.Render(cfg)
	if err != nil {
		return "", fmt.Errorf("topology: the gateway's BIRD configuration: %w", err)
	}
	return conf, nil
}

// routerBGPConfig is the routers' --bgp-config: the gateway as their one
// peer, an IPv4 one, to which a router offers IPv6 unicast too. Router ID
// and IPv4 next hop are each router's Node IPv4 address, the IPv6 next hop
// its Node's IPv6 address (Addr6): the defaults, so the file names neither.
func (l *Lab) routerBGPConfig() ([]byte, error) {
	cfg := bgp.Config{
		ASN:           RouterASN,
		WithdrawDelay: &metav1.Duration{Duration: BGPWithdrawDelay},
		Peers: []bgp.Peer{{
			Address:       GatewayAddr.String(),
			ASN:           GatewayASN,
			HoldTime:      &metav1.Duration{Duration: BGPHoldTime},
			KeepaliveTime: &metav1.Duration{Duration: BGPKeepalive},
			ConnectRetry:  &metav1.Duration{Duration: time.Second},
		}},
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	if _, err := bgp.Parse(data); err != nil {
		return nil, fmt.Errorf("topology: the routers' BGP configuration: %w\n%s", err, data)
	}
	return data, nil
}

// Birdc runs birdc against the gateway's BIRD and returns its answer
// without the greeting line; BIRD's error replies are errors.
func (l *Lab) Birdc(ctx context.Context, args ...string) (string, error) {
	if l.birdSocket == "" {
		return "", errors.New("topology: BGP is not enabled")
	}
	return birdconf.Birdc(ctx, l.birdSocket, args...)
}

// BGPSession reports whether the gateway's session with router r is
// established, with BIRD's state and info ("up Established", "start
// Passive", ...).
func (l *Lab) BGPSession(ctx context.Context, r *Node) (bool, string, error) {
	name := birdProtocol(r)
	out, err := l.Birdc(ctx, "show", "protocols", name)
	if err != nil {
		return false, "", err
	}
	return birdconf.ParseProtocol(out, name)
}

// GatewayNextHops returns, sorted, the next hops of the gateway's kernel
// route for exactly vip/32 (or /128) in its main table (one per path of a
// multipath route); none when there is no such route. The static routes for
// TunnelNet and TunnelNet6 are not one.
func (l *Lab) GatewayNextHops(vip netip.Addr) ([]netip.Addr, error) {
	ns, err := l.Gateway.NS()
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle in %s: %w", GatewayNS, err)
	}
	defer h.Close()
	hops, err := birdconf.KernelNextHops(h, netip.PrefixFrom(vip, vip.BitLen()))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", GatewayNS, err)
	}
	return hops, nil
}

// WaitGatewayNextHops waits until the gateway's kernel route for vip goes
// through exactly the given routers, at their addresses of vip's family
// (none: no route), looking every
// BGPPollInterval, and returns the time from since to the moment it saw
// it: how long a change made at since took to reach the gateway's kernel.
func (l *Lab) WaitGatewayNextHops(ctx context.Context, vip netip.Addr, since time.Time, timeout time.Duration, routers ...*Node) (time.Duration, error) {
	want := make([]netip.Addr, 0, len(routers))
	for _, r := range routers {
		want = append(want, NodeAddrFor(r, vip))
	}
	slices.SortFunc(want, netip.Addr.Compare)
	deadline := since.Add(timeout)
	for {
		hops, err := l.GatewayNextHops(vip)
		if err != nil {
			return 0, err
		}
		if slices.Equal(hops, want) {
			return time.Since(since), nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("the gateway's route for %s goes via %v, not %v, %v after the change", vip, hops, want, time.Since(since).Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(BGPPollInterval):
		}
	}
}

// RouterMetrics returns the lines of router r's /metrics (served on
// startup.DefaultMetricsAddress in its namespace) that start with one of
// prefixes, e.g. "kube_service_tunnel_bgp_".
func (l *Lab) RouterMetrics(ctx context.Context, r *Node, prefixes ...string) ([]string, error) {
	return nodeMetrics(ctx, r, startup.DefaultMetricsAddress, prefixes)
}

// AgentMetrics returns the lines of node n's endpoint agent's /metrics
// (endpoint.DefaultMetricsAddress) that start with one of prefixes.
func (l *Lab) AgentMetrics(ctx context.Context, n *Node, prefixes ...string) ([]string, error) {
	return nodeMetrics(ctx, n, endpoint.DefaultMetricsAddress, prefixes)
}

func nodeMetrics(ctx context.Context, n *Node, address string, prefixes []string) ([]string, error) {
	_, port, _ := strings.Cut(address, ":")
	out, err := InNS(ctx, n.Name, "wget", "-q", "-O", "-", "http://127.0.0.1:"+port+"/metrics")
	if err != nil {
		return nil, err
	}
	var lines []string
	for _, line := range strings.Split(out, "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(line, p) {
				lines = append(lines, line)
				break
			}
		}
	}
	return lines, nil
}

// GatewayPaths asks the gateway's kernel (ip route get, one batch) which
// next hop its route for vip sends each client TCP flow from the given
// source ports to dstPort: with an ECMP route, the router the flow's
// 5-tuple hashes to. It fails when the gateway has no route for vip, and
// for an IPv6 vip: there `ip route get` hashes the flow without a packet,
// which the custom multipath hash (policy 3) of a forwarded IPv6 packet
// does not match (net/ipv6/route.c: rt6_multipath_custom_hash_skb mixes
// in the inner-header hash with jhash_2words, rt6_multipath_custom_hash_fl6
// does not), so its answer is the path of about half the flows only. (For
// IPv4, `ip route get ... iif` builds a packet, and its answer is the
// packet's path.) The routers' conntrack tables (RouterFlows) tell an IPv6
// flow's path instead.
func (l *Lab) GatewayPaths(ctx context.Context, vip netip.Addr, srcPorts []uint16, dstPort uint16) (map[uint16]netip.Addr, error) {
	if !vip.Is4() {
		return nil, fmt.Errorf("topology: ip route get cannot tell the ECMP path of a flow to an IPv6 tunnel IP (%s): read the routers' conntrack tables", vip)
	}
	var batch strings.Builder
	for _, p := range srcPorts {
		// /etc/protocols is missing in the VM: TCP by number.
		fmt.Fprintf(&batch, "route get %s from %s iif %s ipproto 6 sport %d dport %d\n", vip, ClientAddrFor(vip), ClientNS, p, dstPort)
	}
	file := filepath.Join(l.Opts.WorkDir, "gateway-paths.batch")
	if err := os.WriteFile(file, []byte(batch.String()), 0o644); err != nil {
		return nil, err
	}
	out, err := IP(ctx, "-n", GatewayNS, "-batch", file)
	if err != nil {
		return nil, err
	}
	return parseRouteGets(out, vip, srcPorts)
}

// parseRouteGets reads the answers of a batch of `ip route get vip ...`,
// one per source port in order, each starting with vip at the start of a
// line ("192.0.2.10 from 198.51.100.10 via 172.20.0.11 dev fabric"). An
// answer without "via" (a local route) maps to the zero Addr.
func parseRouteGets(out string, vip netip.Addr, srcPorts []uint16) (map[uint16]netip.Addr, error) {
	paths := map[uint16]netip.Addr{}
	i := 0
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(line, " ") || strings.HasPrefix(line, "\t") {
			continue // "    cache iif client"
		}
		if i >= len(srcPorts) {
			return nil, fmt.Errorf("more answers than the %d flows asked about: %q", len(srcPorts), line)
		}
		if f[0] == vip.String() {
			if j := slices.Index(f, "via"); j >= 0 && j+1 < len(f) {
				a, err := netip.ParseAddr(f[j+1])
				if err != nil {
					return nil, fmt.Errorf("ip route get: %q: %w", line, err)
				}
				paths[srcPorts[i]] = a
			}
		}
		i++
	}
	if i != len(srcPorts) {
		return nil, fmt.Errorf("%d answers for %d flows:\n%s", i, len(srcPorts), out)
	}
	return paths, nil
}

// RouterFlows returns the source ports of the client's TCP flows to vip
// that router r's conntrack table holds: the flows whose packets it has
// forwarded (in the last 5 minutes, the lifetime of an established entry).
// A copy of another router's entry (Options.ConntrackSync), which no
// packet has used, is not one of them.
func (l *Lab) RouterFlows(ctx context.Context, r *Node, vip netip.Addr) (map[uint16]bool, error) {
	entries, err := l.Conntrack(ctx, r)
	if err != nil {
		return nil, err
	}
	return flowsFrom(entries, ClientAddrFor(vip), vip), nil
}

// flowsFrom returns the source ports of the TCP entries from client to vip
// (their original direction) that counted a packet, when they count.
func flowsFrom(entries []ConntrackEntry, client, vip netip.Addr) map[uint16]bool {
	ports := map[uint16]bool{}
	for _, e := range entries {
		if e.HasCounters && e.Packets == 0 {
			continue // conntrackd's copy: the flow crosses another router
		}
		if e.Proto == "tcp" && e.Src == client && e.Dst == vip {
			ports[e.SrcPort] = true
		}
	}
	return ports
}
