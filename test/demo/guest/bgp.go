package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// bgpRoute replaces the gateway's static route by BGP: BIRD on the gateway
// learns the tunnel IP from both routers' embedded speakers and installs one
// route with both as next hops. router-a then stops (SIGTERM) while
// connections are open, and comes back; every time is measured.
func bgpRoute(ctx context.Context, l *topology.Lab, client netns.NsHandle, dst netip.AddrPort) error {
	vip := dst.Addr()
	ra, rb := l.Routers[0], l.Routers[1]
	step("BGP: the gateway learns %v from the routers instead of a static route", vip)
	say("the gateway starts BIRD 2 (AS %d); each router restarts with --bgp-config: AS %d,", topology.GatewayASN, topology.RouterASN)
	say("peer %v, hold time %v, keepalive %v; it announces each tunnel IP it serves as a /32", topology.GatewayAddr, topology.BGPHoldTime, topology.BGPKeepalive)
	say("with its own node address as the next hop, and the gateway's static route is deleted")
	start := time.Now()
	if err := l.EnableBGP(ctx, vip); err != nil {
		return fmt.Errorf("the gateway did not learn %v over BGP: %w\n%s", vip, err, l.Logs(20))
	}
	say("both sessions established and the route in the gateway's kernel %v after the start", time.Since(start).Round(time.Millisecond))
	birdc(ctx, l, "birdc show protocols (on the gateway)", func(line string) bool { return strings.Contains(line, " BGP ") }, "show", "protocols")
	birdc(ctx, l, "birdc show route "+vip.String()+"/32", func(line string) bool { return !strings.HasPrefix(line, "Table ") }, "show", "route", vip.String()+"/32")
	if err := gatewayRoute(ctx, l, vip, ra, rb); err != nil {
		return err
	}
	metrics, err := l.RouterMetrics(ctx, ra, "kube_service_tunnel_bgp_session_up", "kube_service_tunnel_bgp_announced_prefixes")
	printOutput("wget -O - http://127.0.0.1:9641/metrics, on router-a (its BGP metrics)", strings.Join(metrics, "\n"), err, 0)

	ports := make([]uint16, 40)
	for i := range ports {
		ports[i] = 47000 + uint16(i)
	}
	paths, err := l.GatewayPaths(ctx, vip, ports, dst.Port())
	if err != nil {
		return err
	}
	reached, err := podPerFlow(ctx, client, dst, ports)
	if err != nil {
		return err
	}
	var via []string
	for _, r := range l.Routers {
		n := 0
		for _, p := range ports {
			if paths[p] == r.Addr {
				n++
			}
		}
		via = append(via, fmt.Sprintf("%d via %s", n, r.Name))
	}
	say("%d client connections over the BGP route (the gateway hashes each flow to a next hop:", len(ports))
	say("%s, says ip route get), answered by %s", strings.Join(via, ", "), countPods(reached))

	// 20 light connections stay open across router-a's SIGTERM.
	var flows []*workload.Stream
	defer func() {
		for _, f := range flows {
			stopCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, _ = f.Stop(stopCtx)
			cancel()
		}
	}()
	flowPorts := make([]uint16, 20)
	for i := range flowPorts {
		flowPorts[i] = 47100 + uint16(i)
		f, err := workload.StartStream(client, dst, flowPorts[i], workload.StreamOptions{ChunkSize: 64, Interval: 100 * time.Millisecond})
		if err != nil {
			return err
		}
		flows = append(flows, f)
	}
	if paths, err = l.GatewayPaths(ctx, vip, flowPorts, dst.Port()); err != nil {
		return err
	}
	viaA := 0
	for _, p := range flowPorts {
		if paths[p] == ra.Addr {
			viaA++
		}
	}
	echoed := make([]int64, len(flows))
	for i, f := range flows {
		if err := waitEcho(f, 3*64); err != nil {
			return err
		}
		echoed[i] = f.Stats().Verified
	}

	step("router-a stops (SIGTERM) with %d connections open, %d of them through it: it withdraws %v first", len(flows), viaA, vip)
	stoppedAt := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- ra.Router.Stop() }()
	took, err := l.WaitGatewayNextHops(ctx, vip, stoppedAt, 30*time.Second, rb)
	if err != nil {
		return err
	}
	say("SIGTERM -> the gateway's kernel routes %v via %s only: %v", vip, rb.Name, took.Round(time.Millisecond))
	if err := gatewayRoute(ctx, l, vip, rb); err != nil {
		return err
	}
	if err := <-stopped; err != nil {
		return err
	}
	say("router-a exited %v after SIGTERM (withdraw, wait %v, close the session)", time.Since(stoppedAt).Round(time.Millisecond), topology.BGPWithdrawDelay)
	kept := 0
	for i, f := range flows {
		if waitEcho(f, echoed[i]+3*64) == nil {
			kept++
		}
	}
	say("%d of %d open connections kept echoing through %s, to the same pods", kept, len(flows), rb.Name)
	if kept != len(flows) {
		return fmt.Errorf("%d connections broke when router-a stopped", len(flows)-kept)
	}
	if reached, err = podPerFlow(ctx, client, dst, ports[:10]); err != nil {
		return err
	}
	say("10 new connections through %s alone answered by %s", rb.Name, countPods(reached))

	step("router-a starts again: it announces %v once it has synced", vip)
	restartedAt := time.Now()
	if err := ra.Router.Start(); err != nil {
		return err
	}
	if took, err = l.WaitGatewayNextHops(ctx, vip, restartedAt, 30*time.Second, ra, rb); err != nil {
		return err
	}
	say("start -> the gateway routes %v via both routers again: %v", vip, took.Round(time.Millisecond))
	return gatewayRoute(ctx, l, vip, ra, rb)
}

// gatewayRoute prints the gateway's kernel route for vip and checks its next
// hops are exactly the routers'.
func gatewayRoute(ctx context.Context, l *topology.Lab, vip netip.Addr, routers ...*topology.Node) error {
	out, err := topology.IP(ctx, "-n", topology.GatewayNS, "route", "show", vip.String())
	printRaw("ip route show "+vip.String()+" (on the gateway: installed by BIRD, proto bird)", out, err)
	hops, err := l.GatewayNextHops(vip)
	if err != nil {
		return err
	}
	var want []netip.Addr
	for _, r := range routers {
		want = append(want, r.Addr)
	}
	slices.SortFunc(want, netip.Addr.Compare)
	if !slices.Equal(hops, want) {
		return fmt.Errorf("the gateway routes %v via %v, want %v", vip, hops, want)
	}
	return nil
}

// birdc prints the lines of a birdc command's answer that keep selects.
func birdc(ctx context.Context, l *topology.Lab, title string, keep func(string) bool, args ...string) {
	out, err := l.Birdc(ctx, args...)
	var lines []string
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		if keep(line) {
			lines = append(lines, line)
		}
	}
	printRaw(title, strings.Join(lines, "\n"), err)
}

// printRaw prints a command's output under a title, keeping its
// indentation (tabs as four spaces).
func printRaw(title, out string, err error) {
	say("$ %s", title)
	if err != nil {
		say("  (failed: %v)", err)
		return
	}
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		say("  %s", strings.TrimRight(strings.ReplaceAll(line, "\t", "    "), " "))
	}
}

// countPods summarizes which pods answered: "pod-a2 (13), pod-b1 (14)".
func countPods(reached map[uint16]string) string {
	n := map[string]int{}
	for _, pod := range reached {
		n[pod]++
	}
	names := make([]string, 0, len(n))
	for name := range n {
		names = append(names, name)
	}
	slices.Sort(names)
	for i, name := range names {
		names[i] = fmt.Sprintf("%s (%d)", name, n[name])
	}
	return strings.Join(names, ", ")
}
