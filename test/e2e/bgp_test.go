package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// bgpTimeout bounds each wait for the gateway's route to change.
const bgpTimeout = 30 * time.Second

// 10. BGP routes the tunnel IPs: the gateway runs BIRD and the routers
// announce the tunnel IPs with their embedded speaker. The gateway learns
// each from both routers (one route, two next hops); the last endpoint
// leaving withdraws them and its return announces them again; a router
// stopped with SIGTERM withdraws before it goes, while 200 light flows per
// family keep working through the other router; a router cut off the
// fabric is dropped when the hold time expires, and comes back when its
// link does. Every duration is logged as "bgp: ... took N ms". The IPv6
// tunnel IP travels over the same IPv4 sessions (an ipv6 channel), with
// the routers' IPv6 addresses as next hops; BGP replaces the gateway's
// static routes of both families.
func bgpRouting(t *testing.T, e *env) {
	ctx := context.Background()
	vips := tunnelIPs(10)
	e.deploy(t, "bgp", vips, e.Pods...)
	ra, rb := e.Routers[0], e.Routers[1]

	t.Cleanup(func() {
		if t.Failed() {
			if out, err := e.Birdc(ctx, "show", "protocols", "all"); err == nil {
				t.Logf("gateway: birdc show protocols all:\n%s", out)
			}
		}
		_ = e.SetNodeLink(ctx, ra, true)
		if !ra.Router.Running() {
			if err := ra.Router.Start(); err != nil {
				t.Error(err)
			}
		}
		if err := e.DisableBGP(ctx); err != nil {
			t.Errorf("disabling BGP: %v", err)
		}
	})
	start := time.Now()
	if err := e.EnableBGP(ctx, vips...); err != nil {
		t.Fatalf("enabling BGP: %v", err)
	}
	t.Logf("bgp: enabling BGP (bird on the gateway, both routers restarted with --bgp-config) until the gateway routed %s via both took %d ms", annotation(vips), time.Since(start).Milliseconds())

	// gatewayRoutes is `ip route show` (-6 for IPv6) on the gateway for
	// exactly p.
	gatewayRoutes := func(t testing.TB, p netip.Prefix) string {
		t.Helper()
		out, err := topology.IP(ctx, append(append([]string{"-n", topology.GatewayNS}, topology.FamilyArgs(p.Addr())...), "route", "show", "exact", p.String())...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	// a. The gateway learnt each tunnel IP from both routers.
	inFamilies(t, vips, func(t testing.TB, _ int, vip netip.Addr) {
		both := []netip.Addr{topology.NodeAddrFor(ra, vip), topology.NodeAddrFor(rb, vip)}
		slices.SortFunc(both, netip.Addr.Compare)
		hops, err := e.GatewayNextHops(vip)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(hops, both) {
			t.Fatalf("the gateway routes %s via %v, want %s and %s", vip, hops, both[0], both[1])
		}
		t.Logf("gateway: ip route show %s:\n%s", vip, gatewayRoutes(t, netip.PrefixFrom(vip, vip.BitLen())))
		static := topology.TunnelNet
		if vip.Is6() {
			static = topology.TunnelNet6
		}
		if routes := gatewayRoutes(t, static); routes != "" {
			t.Errorf("the gateway's static route is still there: %s", routes)
		}
		id := e.who(t, "tcp", vip, 0)
		t.Logf("over the BGP route, %s answered and saw the client as %v", id.Pod, id.Peer)
	})

	// b. The last endpoint leaves: both routers withdraw.
	removedAt := time.Now()
	if err := e.applyEndpoints(ctx, "bgp", nil); err != nil {
		t.Fatal(err)
	}
	inFamilies(t, vips, func(t testing.TB, _ int, vip netip.Addr) {
		took, err := e.WaitGatewayNextHops(ctx, vip, removedAt, bgpTimeout)
		if err != nil {
			t.Fatalf("after the last endpoint left: %v", err)
		}
		t.Logf("bgp: last endpoint removed -> route to %s withdrawn from the gateway took %d ms", vip, took.Milliseconds())
	})
	e.checkSessions(t, ra, rb)

	// c. The endpoints come back: both routers announce again.
	backAt := time.Now()
	if err := e.applyEndpoints(ctx, "bgp", topology.Ready(e.Pods...)); err != nil {
		t.Fatal(err)
	}
	e.waitNextHops(t, vips, backAt, "endpoints back", ra, rb)
	e.waitTunnels(t, vips, e.Pods...)

	// d. router-a stops (SIGTERM) while 200 light flows per family run over
	// both routers: it withdraws first, and its datapath stays until it is
	// gone.
	fs := make([]bgpFlows, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		fs[i].start(t, e, vip, portRange(48001, 200), ra)
	})
	stoppedAt := time.Now()
	for i := range fs {
		fs[i].mark(stoppedAt)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- ra.Router.Stop() }()
	e.waitNextHops(t, vips, stoppedAt, "SIGTERM to "+ra.Name, rb)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	t.Logf("bgp: SIGTERM to %s -> process exited took %d ms (withdraw delay %v)", ra.Name, time.Since(stoppedAt).Milliseconds(), topology.BGPWithdrawDelay)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		fs[i].report(t, "SIGTERM to "+ra.Name, ra, rb)
	})

	restartedAt := time.Now()
	if err := ra.Router.Start(); err != nil {
		t.Fatal(err)
	}
	e.waitNextHops(t, vips, restartedAt, ra.Name+" restarted", ra, rb)

	// e. router-a's link to the fabric is cut: its flows are lost until
	// BIRD drops its route when the hold time expires; the link comes back,
	// and so does the route.
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		fs[i].start(t, e, vip, portRange(48301, 200), ra)
	})
	cutAt := time.Now()
	for i := range fs {
		fs[i].lightFlows.mark()
	}
	if err := e.SetNodeLink(ctx, ra, false); err != nil {
		t.Fatal(err)
	}
	for i := range fs {
		fs[i].recovered = watchRecovery(fs[i].flows, cutAt) // once the link is down
	}
	took := e.waitNextHops(t, vips, cutAt, ra.Name+"'s link cut", rb)
	if took > topology.BGPHoldTime+2*time.Second {
		t.Errorf("a route outlived the hold time (%v) by %v", topology.BGPHoldTime, took-topology.BGPHoldTime)
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		fs[i].since = cutAt
		fs[i].report(t, ra.Name+"'s link cut", ra, rb)
	})

	restoredAt := time.Now()
	if err := e.SetNodeLink(ctx, ra, true); err != nil {
		t.Fatal(err)
	}
	e.waitNextHops(t, vips, restoredAt, ra.Name+"'s link restored", ra, rb)
	e.checkSessions(t, ra, rb)
	// The gateway's neighbour entry for router-a's IPv6 address failed
	// while the link was down; until it is resolved again, a packet the
	// ECMP route hashes to router-a gets "no route to host" back. A
	// connection is tried until one is answered (ten seconds at most).
	inFamilies(t, vips, func(t testing.TB, _ int, vip netip.Addr) {
		var id workload.Identity
		var tries []string
		if err := e.poll(10*time.Second, func() (bool, string) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			var err error
			id, err = workload.Who(ctx, e.client, "tcp", netip.AddrPortFrom(vip, tcpPort), 0)
			if err != nil {
				tries = append(tries, err.Error())
			}
			return err == nil, strings.Join(tries, "; ")
		}); err != nil {
			t.Fatalf("no answer over the restored BGP route: %v", err)
		}
		t.Logf("over the restored BGP route, %s answered on %s after %d failed tries %v", id.Pod, vip, len(tries), tries)
	})
}

// waitNextHops waits until the gateway routes each of vips via exactly
// routers (none: withdrawn), logs how long each took after since, and
// returns the longest.
func (e *env) waitNextHops(t *testing.T, vips []netip.Addr, since time.Time, after string, routers ...*topology.Node) time.Duration {
	t.Helper()
	var names []string
	for _, r := range routers {
		names = append(names, r.Name)
	}
	took := make([]time.Duration, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		d, err := e.WaitGatewayNextHops(context.Background(), vip, since, bgpTimeout, routers...)
		if err != nil {
			t.Fatalf("after %s: %v", after, err)
		}
		took[i] = d
		t.Logf("bgp: %s -> gateway route to %s via %s took %d ms", after, vip, strings.Join(names, " and "), d.Milliseconds())
	})
	return slices.Max(took)
}

// bgpFlows are one family's light flows through a BGP event, which of
// them cross router r, and how each recovered.
type bgpFlows struct {
	lightFlows
	viaA      []bool
	since     time.Time
	recovered <-chan recovery
}

// start opens the light flows from ports and finds those via r.
func (f *bgpFlows) start(t testing.TB, e *env, vip netip.Addr, ports []uint16, r *topology.Node) {
	f.flows = startLightFlows(t, e, vip, ports[0], len(ports))
	f.viaA = e.flowsVia(t, vip, ports, r)
}

// mark records the flows' progress at the event and starts watching how
// they recover.
func (f *bgpFlows) mark(at time.Time) {
	f.lightFlows.mark()
	f.since = at
	f.recovered = watchRecovery(f.flows, at)
}

// report counts the disrupted flows (stopping them) and logs how the flows
// via a and via b recovered.
func (f *bgpFlows) report(t testing.TB, event string, a, b *topology.Node) {
	rec := <-f.recovered
	disrupted, _ := disruptedFlows(t, f.flows, f.echoed, f.since)
	t.Logf("bgp: %s: %d of %d light flows disrupted (%.1f%%); %d of them went via %s", event, disrupted, len(f.flows), percent(disrupted, len(f.flows)), count(f.viaA), a.Name)
	t.Logf("bgp: %s: first chunk sent after it echoed: flows via %s %s; flows via %s %s", event, a.Name, rec.of(f.viaA, true), b.Name, rec.of(f.viaA, false))
}

// flowsVia reports, for each client TCP flow from ports to vip, whether the
// gateway's route sends it via router r. For an IPv4 tunnel IP it asks `ip
// route get`, which computes the ECMP hash as for the flow's packets, and
// fails the test if r's conntrack table holds a flow the hash sends
// elsewhere. (A flow r carries may show up in its table a few seconds
// late, so the converse is not checked.) For an IPv6 one `ip route get`
// does not hash as for the packets (see topology.Lab.GatewayPaths), so the
// routers' conntrack tables tell: see flowsHeldBy.
func (e *env) flowsVia(t testing.TB, vip netip.Addr, ports []uint16, r *topology.Node) []bool {
	t.Helper()
	if vip.Is6() {
		return e.flowsHeldBy(t, vip, ports, r)
	}
	ctx := context.Background()
	paths, err := e.GatewayPaths(ctx, vip, ports, tcpPort)
	if err != nil {
		t.Fatal(err)
	}
	seen, err := e.RouterFlows(ctx, r, vip)
	if err != nil {
		t.Fatal(err)
	}
	via := make([]bool, len(ports))
	var wrong []string
	tracked := 0
	for i, p := range ports {
		via[i] = paths[p] == r.Addr
		switch {
		case seen[p] && !via[i]:
			wrong = append(wrong, fmt.Sprintf("%d (hashed to %v)", p, paths[p]))
		case seen[p]:
			tracked++
		}
	}
	if len(wrong) > 0 {
		t.Errorf("%s's conntrack holds %d flows the gateway's ECMP hash (ip route get) sends elsewhere: %v", r.Name, len(wrong), wrong)
	}
	t.Logf("the gateway hashes %d of %d flows to %s; its conntrack holds %d of them already", count(via), len(ports), r.Name, tracked)
	return via
}

// flowsHeldBy reports, for each client TCP flow from ports to vip, whether
// router r's conntrack table holds it: the flows the gateway's ECMP route
// sends via r. It waits (5 s at most) until every flow is in exactly one
// router's table, as each flow's packets cross one router, and fails the
// test if some never are.
func (e *env) flowsHeldBy(t testing.TB, vip netip.Addr, ports []uint16, r *topology.Node) []bool {
	t.Helper()
	ctx := context.Background()
	var holders map[uint16][]string
	start := time.Now()
	if err := e.poll(5*time.Second, func() (bool, string) {
		holders = map[uint16][]string{}
		for _, router := range e.Routers {
			seen, err := e.RouterFlows(ctx, router, vip)
			if err != nil {
				return false, err.Error()
			}
			for p := range seen {
				holders[p] = append(holders[p], router.Name)
			}
		}
		var odd []string
		for _, p := range ports {
			if len(holders[p]) != 1 {
				odd = append(odd, fmt.Sprintf("%d in %v", p, holders[p]))
			}
		}
		return len(odd) == 0, fmt.Sprintf("%d flows are not in exactly one router's conntrack table: %v", len(odd), odd)
	}); err != nil {
		// Conntrack's per-CPU counters (hex; "invalid" counts packets it
		// could not track) tell a flow it never tracked from one it lost.
		var stats []string
		for _, router := range e.Routers {
			out, serr := topology.InNS(ctx, router.Name, "cat", "/proc/net/stat/nf_conntrack")
			if serr != nil {
				out = serr.Error()
			}
			stats = append(stats, router.Name+":\n"+out)
		}
		t.Errorf("%v\n%s", err, strings.Join(stats, "\n"))
	}
	via := make([]bool, len(ports))
	for i, p := range ports {
		via[i] = slices.Contains(holders[p], r.Name)
	}
	t.Logf("the routers' conntrack tables hold each flow once (after %v); %d of %d flows go via %s", time.Since(start).Round(time.Millisecond), count(via), len(ports), r.Name)
	return via
}

// recovery is, for each flow, how long it took after an event to echo the
// first chunk it sent once the event had happened (0: never, within 30 s):
// about a send interval when nothing happened to it, the outage plus TCP's
// retransmission backoff when its packets were lost.
type recovery []time.Duration

// of summarizes the flows i with in[i] == want.
func (r recovery) of(in []bool, want bool) string {
	var done []time.Duration
	never, slow := 0, 0
	for i, d := range r {
		switch {
		case in[i] != want:
		case d == 0:
			never++
		default:
			done = append(done, d)
			if d > time.Second {
				slow++
			}
		}
	}
	if len(done) == 0 {
		return fmt.Sprintf("(%d): none echoed", never)
	}
	slices.Sort(done)
	return fmt.Sprintf("(%d): median %d ms, slowest %d ms, %d over 1 s, %d never", len(done)+never,
		done[len(done)/2].Milliseconds(), done[len(done)-1].Milliseconds(), slow, never)
}

// watchRecovery measures, relative to since, when each flow echoes the
// first chunk it sends after this call (polling every 10 ms), until every
// flow has, or failed, or 30 s passed.
func watchRecovery(flows []*workload.Stream, since time.Time) <-chan recovery {
	target := make([]int64, len(flows))
	for i, f := range flows {
		target[i] = f.Stats().Sent + lightChunk
	}
	out := make(chan recovery, 1)
	go func() {
		took := make(recovery, len(flows))
		for pending := len(flows); pending > 0 && time.Since(since) < 30*time.Second; time.Sleep(10 * time.Millisecond) {
			pending = 0
			for i, f := range flows {
				if took[i] != 0 {
					continue
				}
				if st := f.Stats(); st.Verified >= target[i] {
					took[i] = time.Since(since)
				} else if st.Err == nil {
					pending++
				}
			}
		}
		out <- took
	}()
	return out
}

// checkSessions fails the test unless the gateway's BGP sessions with the
// routers are established.
func (e *env) checkSessions(t *testing.T, routers ...*topology.Node) {
	t.Helper()
	for _, r := range routers {
		up, state, err := e.BGPSession(context.Background(), r)
		if err != nil || !up {
			t.Errorf("the gateway's session with %s is %q (err %v), not established", r.Name, state, err)
		}
	}
}
