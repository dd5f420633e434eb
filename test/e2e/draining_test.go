package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/lab/attack"
	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// drainAnnotation on a Pod drains it by hand: its endpoints get no new
// flow, as if they were terminating.
const drainAnnotation = "cmd.nu/tunnel-drain"

// 9. A draining endpoint (terminating in its EndpointSlice, or its Pod
// annotated cmd.nu/tunnel-drain) gets no new flow, while the flows it
// already serves keep reaching it through the routing generation they
// started in, also across a router restart and across a router failover
// (the routers share their conntrack entries: router/ctsync); an old
// generation is deleted once no flow uses it. The pod drains in both
// families' slices at once, and each family's flows are checked.
func drainingEndpoint(t *testing.T, e *env) {
	vips := tunnelIPs(9)
	full := e.deploy(t, "draining", vips, e.Pods...)
	for i, vip := range vips {
		if want := bucket.Assign(e.Opts.Buckets, podAddrs(e.Pods, vip)); !slices.Equal(full[i], want) {
			t.Fatalf("the routers' table for %s is not the assignment of the %d pods:\n got %v\nwant %v", vip, len(e.Pods), full[i], want)
		}
	}
	x, y := e.Pods[0], e.Pods[len(e.Pods)-1]
	if !t.Run("terminating", func(t *testing.T) { drainTerminating(t, e, vips, full, x) }) {
		return
	}
	if !t.Run("annotated", func(t *testing.T) { drainAnnotated(t, e, vips, y) }) {
		return
	}
	t.Run("router_failover", func(t *testing.T) { drainFailover(t, e, vips, x) })
}

// drainingFlows are one family's flows through a drain: lightFlows, the
// busy stream's source port, the light flows' ports, which of them reach
// the draining pod, and the table without it.
type drainingFlows struct {
	lightFlows
	streamPort uint16
	ports      []uint16
	onX        []bool
	drained    []netip.Addr
}

// drainTerminating: x turns terminating while, in each family, a busy
// stream and 200 light flows run (steps a-e), then leaves the slices and
// its old generation is collected (step g).
func drainTerminating(t *testing.T, e *env, vips []netip.Addr, full [][]netip.Addr, x *topology.Pod) {
	ctx := context.Background()
	fs := make([]drainingFlows, len(vips))
	// a. A busy stream to x, and 200 light flows over the 4 pods.
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		f.streamPort = e.portTo(t, full[i], vip, 46500, x)
		f.stream = startStream(t, e, vip, f.streamPort)
		f.ports = portRange(46001, 200)
		f.flows = startLightFlows(t, e, vip, f.ports[0], len(f.ports))
		waitVerified(t, f.stream, 64<<10, "before the drain")
		if got := e.reachedPods(t, vip, []uint16{f.streamPort})[f.streamPort]; got != x {
			t.Fatalf("the busy stream from port %d reached %s, the bucket table says %s", f.streamPort, got.Name, x.Name)
		}
		f.onX = e.flowsOn(t, full[i], vip, f.ports, x)
		t.Logf("a busy stream from port %d and %d of %d light flows to %s reach %s", f.streamPort, count(f.onX), len(f.flows), vip, x.Name)
	})

	// b. x terminates: serving but not ready.
	rest := others(e.Pods, x)
	drainedAt := time.Now()
	for i := range fs {
		fs[i].mark()
	}
	if err := e.applyEndpoints(ctx, "draining", append(topology.Ready(rest...), topology.Endpoint{Pod: x, Terminating: true})); err != nil {
		t.Fatal(err)
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		drained, err := e.WaitTunnel(ctx, vip, rest...)
		if err != nil {
			t.Fatalf("after %s turned terminating: %v", x.Name, err)
		}
		f.drained = drained
		t.Logf("%s terminating: both routers' current tables for %s left it out %v later", x.Name, vip, time.Since(drainedAt).Round(time.Millisecond))
		if want := bucket.Assign(e.Opts.Buckets, podAddrs(rest, vip)); !slices.Equal(drained, want) {
			t.Errorf("the current table is not the assignment without %s:\n got %v\nwant %v", x.Name, drained, want)
		}
		if ok, err := topology.PodHasAddr(ctx, x, vip); err != nil || !ok {
			t.Errorf("the draining %s no longer holds %s (err %v)", x.Name, vip, err)
		}
		e.checkOldGeneration(t, vip, full[i])

		// c. New flows avoid x and go where the new table says.
		newPorts := portRange(47000, 200)
		toX := e.newFlows(t, drained, vip, newPorts, x)

		// d. The established flows, those to x included, keep echoing.
		broken := brokenFlows(f.flows, f.echoed, drainedAt)
		brokenOnX := 0
		errs := firstErrors(t)
		for _, j := range broken {
			if f.onX[j] {
				brokenOnX++
			}
			errs.Errorf("established flow from port %d (on %s) disrupted by the drain: %v", f.ports[j], e.PodByAddr(e.predicted(full[i], vip, f.ports[j])).Name, f.flows[j].Stats().Err)
		}
		errs.Done("flows disrupted")
		waitVerified(t, f.stream, f.streamAt+128<<10, "after the drain")
		t.Logf("draining: %d of %d established flows to %s disrupted (%d of the %d on the draining %s); %d of %d new flows reached it; the busy stream to it went on",
			len(broken), len(f.flows), vip, brokenOnX, count(f.onX), x.Name, toX, len(newPorts))
	})

	// d2. A spoofed flood during the drain: TCP ACKs (no SYN: conntrack
	// picks each up as a new entry) from random client addresses and
	// ports to the tunnel IP. Each lands in the current generation, which
	// the routers' periodic check no longer lists: their memory stays as
	// it was, and the draining flows go on.
	floodDuringDrain(t, e, vips, func(since time.Time) {
		inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
			f := &fs[i]
			if broken := brokenFlows(f.flows, f.echoed, since); len(broken) > 0 {
				t.Errorf("%d of %d established flows to %s disrupted during the flood", len(broken), len(f.flows), vip)
			}
			if err := f.stream.Stats().Err; err != nil {
				t.Errorf("the busy stream to the draining %s broke during the flood: %v", x.Name, err)
			}
		})
	}, func() {
		for i := range fs {
			fs[i].mark()
		}
	})

	// e. router-a restarts while the old generations are in use: it adopts
	// them as they are.
	ra := e.Routers[0]
	before, err := kstate.Snapshot(ctx, ra.Name)
	if err != nil {
		t.Fatal(err)
	}
	restartedAt := time.Now()
	for i := range fs {
		fs[i].mark()
	}
	if err := ra.Router.Restart(); err != nil {
		t.Fatal(err)
	}
	// Its first full sync (where it would do harm, if it did) is done;
	// a second more for what follows it.
	if err := ra.Router.WaitReady(); err != nil {
		t.Fatal(err)
	}
	e.waitTunnels(t, vips, rest...)
	time.Sleep(time.Second)
	after, err := kstate.Snapshot(ctx, ra.Name)
	if err != nil {
		t.Fatal(err)
	}
	if diff := kstate.Diff(before, after); diff != "" {
		t.Errorf("restarting %s while %s drains changed its kernel state:\n%s", ra.Name, x.Name, diff)
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		broken := brokenFlows(f.flows, f.echoed, restartedAt)
		errs := firstErrors(t)
		for _, j := range broken {
			errs.Errorf("flow from port %d (on %s) disrupted by %s's restart: %v", f.ports[j], e.PodByAddr(e.predicted(full[i], vip, f.ports[j])).Name, ra.Name, f.flows[j].Stats().Err)
		}
		errs.Done("flows disrupted")
		if err := f.stream.Stats().Err; err != nil {
			t.Errorf("the busy stream to the draining %s broke when %s restarted: %v", x.Name, ra.Name, err)
		}
		t.Logf("%s restarted while the old generation of %s served %d flows: kernel state unchanged, %d of %d light flows disrupted",
			ra.Name, vip, len(f.flows)+1, len(broken), len(f.flows))
	})
	if os.Getenv("KST_E2E_DRAIN_FULL") == "" {
		// The old generation outlives its last flow by up to the TCP
		// conntrack timeouts (minutes); make demo shows it collected.
		t.Log("step g (the old generation collected once unused, up to 4 minutes) runs with KST_E2E_DRAIN_FULL=1")
		return
	}

	// g. x leaves the slices. Its flows end first (each with a RST, which
	// removes the routers' conntrack entry at once); the others keep the
	// old generation in use a little longer, to see its buckets of x
	// re-pointed to their current owners.
	rests := make([]lightFlows, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, _ netip.Addr) {
		errs := firstErrors(t)
		for j, f := range fs[i].flows {
			if !fs[i].onX[j] {
				rests[i].flows = append(rests[i].flows, f)
				continue
			}
			stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			if st, err := f.Stop(stopCtx); err != nil {
				errs.Errorf("a flow to the draining %s: %v (sent %d, echoed %d)", x.Name, err, st.Sent, st.Verified)
			}
			cancel()
		}
		errs.Done("flows failed")
		rests[i].mark()
	})
	removedAt := time.Now()
	if err := e.applyEndpoints(ctx, "draining", topology.Ready(rest...)); err != nil {
		t.Fatal(err)
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		if err := e.poll(30*time.Second, func() (bool, string) {
			for _, r := range e.Routers {
				for _, gen := range e.oldGenerations(t, r, vip) {
					table, err := e.GenerationTable(ctx, r, vip, gen)
					if err != nil {
						return false, err.Error()
					}
					if !slices.Equal(table, fs[i].drained) {
						return false, fmt.Sprintf("%s's generation %d still sends %d buckets to %s", r.Name, gen, countAddr(table, topology.PodAddr(x, vip)), x.Name)
					}
				}
			}
			ok, err := topology.PodHasAddr(ctx, x, vip)
			return err == nil && !ok, fmt.Sprintf("%s still holds %s (err %v)", x.Name, vip, err)
		}); err != nil {
			t.Errorf("after %s left the slice: %v", x.Name, err)
		} else {
			t.Logf("%s left the slice: in the old generation of %s its buckets went to their current owners, and it gave up %s, %v later", x.Name, vip, vip, time.Since(removedAt).Round(time.Millisecond))
		}
		disrupted, _ := disruptedFlows(t, rests[i].flows, rests[i].echoed, removedAt)
		t.Logf("%d of the %d flows to %s on the other pods disrupted when %s left the slice", disrupted, len(rests[i].flows), vip, x.Name)

		// The routers count a TCP entry as a flow until the client's FIN
		// or RST; an entry neither ended (one that broke, say) lasts 300 s
		// after its last packet: up to 5 minutes then.
		lastFlowAt := time.Now()
		err := e.poll(6*time.Minute, func() (bool, string) {
			for _, r := range e.Routers {
				if old := e.oldGenerations(t, r, vip); len(old) > 0 {
					return false, fmt.Sprintf("%s still holds generations %v of %s", r.Name, old, vip)
				}
			}
			return true, ""
		})
		if err != nil {
			for _, r := range e.Routers {
				t.Logf("%s's conntrack entries for %s:\n%s", r.Name, vip, conntrackOf(r, vip))
			}
			t.Errorf("the old generation outlived its last flow: %v", err)
			return
		}
		t.Logf("the last flow of the old generation ended; %v later both routers held routes for one generation of %s only", time.Since(lastFlowAt).Round(time.Millisecond), vip)
	})
}

// drainAnnotated: the annotation cmd.nu/tunnel-drain=true drains y like a
// terminating endpoint in both families, and removing it gives y its
// buckets back (step h).
func drainAnnotated(t *testing.T, e *env, vips []netip.Addr, y *topology.Pod) {
	ctx := context.Background()
	if err := e.applyEndpoints(ctx, "draining", topology.Ready(e.Pods...)); err != nil {
		t.Fatal(err)
	}
	full := e.waitTunnels(t, vips, e.Pods...)
	streams := make([]*workload.Stream, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		if want := bucket.Assign(e.Opts.Buckets, podAddrs(e.Pods, vip)); !slices.Equal(full[i], want) {
			t.Fatalf("with every pod ready again, the table is not their assignment:\n got %v\nwant %v", full[i], want)
		}
		port := e.portTo(t, full[i], vip, 48500, y)
		streams[i] = startStream(t, e, vip, port)
		waitVerified(t, streams[i], 64<<10, "before the annotation")
		if got := e.reachedPods(t, vip, []uint16{port})[port]; got != y {
			t.Fatalf("the stream from port %d reached %s, the bucket table says %s", port, got.Name, y.Name)
		}
	})

	t.Cleanup(func() { _ = e.AnnotatePod(context.Background(), y, drainAnnotation, "") })
	annotatedAt := time.Now()
	streamAt := make([]int64, len(vips))
	for i, s := range streams {
		streamAt[i] = s.Stats().Verified
	}
	if err := e.AnnotatePod(ctx, y, drainAnnotation, "true"); err != nil {
		t.Fatal(err)
	}
	rest := others(e.Pods, y)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		drained, err := e.WaitTunnel(ctx, vip, rest...)
		if err != nil {
			t.Fatalf("after annotating %s %s=true: %v", y.Name, drainAnnotation, err)
		}
		t.Logf("%s annotated %s=true: both routers' current tables for %s left it out %v later", y.Name, drainAnnotation, vip, time.Since(annotatedAt).Round(time.Millisecond))
		if want := bucket.Assign(e.Opts.Buckets, podAddrs(rest, vip)); !slices.Equal(drained, want) {
			t.Errorf("the current table is not the assignment without %s:\n got %v\nwant %v", y.Name, drained, want)
		}
		if ok, err := topology.PodHasAddr(ctx, y, vip); err != nil || !ok {
			t.Errorf("the draining %s no longer holds %s (err %v)", y.Name, vip, err)
		}
		toY := e.newFlows(t, drained, vip, portRange(47200, 200), y)
		waitVerified(t, streams[i], streamAt[i]+128<<10, "while "+y.Name+" drains")
		t.Logf("annotation drain: %d of 200 new flows to %s reached %s; the stream to it went on", toY, vip, y.Name)
	})

	if err := e.AnnotatePod(ctx, y, drainAnnotation, ""); err != nil {
		t.Fatal(err)
	}
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		again, err := e.WaitTunnel(ctx, vip, e.Pods...)
		if err != nil {
			t.Fatalf("after removing the annotation from %s: %v", y.Name, err)
		}
		if !slices.Equal(again, full[i]) {
			t.Errorf("with the annotation removed, the table is not the assignment of every pod:\n got %v\nwant %v", again, full[i])
		}
		newPorts := portRange(47400, 50)
		e.newFlows(t, again, vip, newPorts, nil)
		yAddr := topology.PodAddr(y, vip)
		backOnY := 0
		for _, p := range newPorts {
			if e.predicted(again, vip, p) == yAddr {
				backOnY++ // newFlows checked that each went where the table says
			}
		}
		if backOnY == 0 || countAddr(again, yAddr) == 0 {
			t.Errorf("with the annotation removed, %s owns %d buckets and got %d of %d new flows", y.Name, countAddr(again, yAddr), backOnY, len(newPorts))
		}
		stats := stopStream(t, streams[i])
		t.Logf("annotation removed: %s owns %d of %d buckets of %s again and got %d of %d new flows; the stream to it echoed %d bytes intact throughout",
			y.Name, countAddr(again, yAddr), len(again), vip, backOnY, len(newPorts), stats.Sent)
	})
}

// drainFailover: router-a dies while x drains (step f). router-b holds a
// copy of the conntrack entry of each flow that crossed router-a (conntrackd),
// mark included, so it sends each by the generation it started in: none
// breaks, those to x included. Without the sharing (the lab's default
// since the open defect in docs/draining.md's limits; KST_E2E_CTSYNC=1
// turns it on) those to x break, which is measured, not asserted; the
// others must not. A broken flow is reported with what both
// routers held of it just before the failover and what router-b holds
// after.
func drainFailover(t *testing.T, e *env, vips []netip.Addr, x *topology.Pod) {
	ctx := context.Background()
	full := e.waitTunnels(t, vips, e.Pods...)
	fs := make([]drainingFlows, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		f.ports = portRange(49001, 200)
		f.flows = startLightFlows(t, e, vip, f.ports[0], len(f.ports))
		f.onX = e.flowsOn(t, full[i], vip, f.ports, x)
	})
	rest := others(e.Pods, x)
	if err := e.applyEndpoints(ctx, "draining", append(topology.Ready(rest...), topology.Endpoint{Pod: x, Terminating: true})); err != nil {
		t.Fatal(err)
	}
	for i, table := range e.waitTunnels(t, vips, rest...) {
		fs[i].drained = table
	}

	dead, survivor := e.Routers[0], e.Routers[1]
	t.Cleanup(func() {
		_ = e.SetNodeLink(ctx, dead, true)
		if !dead.Router.Running() {
			if err := dead.Router.Start(); err != nil {
				t.Error(err)
			}
		}
		_ = e.RouteTunnelsVia(ctx, e.Routers...)
	})
	// What each router holds just before the failover: a broken flow is
	// then explained by its entries and its generation's tables on both.
	before := make([][2]routerSnapshot, len(vips))
	for i, vip := range vips {
		for k, r := range []*topology.Node{dead, survivor} {
			before[i][k] = e.snapshotRouter(ctx, r, vip)
		}
		t.Logf("before the failover, %s: %s", vip, generationAgreement(before[i][0], before[i][1]))
	}
	for i := range fs {
		fs[i].mark()
	}
	e.failRouter(t, dead, survivor)
	failedAt := time.Now()
	isBroken := make([][]bool, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		broken := brokenFlows(f.flows, f.echoed, failedAt)
		brokenOnX, brokenMoved, brokenKept, moved := 0, 0, 0, 0
		errs := firstErrors(t)
		isBroken[i] = make([]bool, len(f.flows))
		for _, j := range broken {
			isBroken[i][j] = true
		}
		for j, port := range f.ports {
			b := e.HMARK().Bucket(hmark.Flow{Src: topology.ClientAddrFor(vip), Dst: vip, SrcPort: port, DstPort: tcpPort, Proto: 6})
			bucketMoved := full[i][b] != f.drained[b]
			if bucketMoved && !f.onX[j] {
				moved++
			}
			switch {
			case !isBroken[i][j]:
			case f.onX[j]:
				brokenOnX++
				if e.Opts.ConntrackSync {
					errs.Errorf("flow from port %d to the draining %s broke in the failover: %v", port, x.Name, f.flows[j].Stats().Err)
				}
			case bucketMoved:
				brokenMoved++
				errs.Errorf("flow from port %d to %s, whose bucket %d moved to %s, broke in the failover: %v", port, e.PodByAddr(full[i][b]).Name, b, e.PodByAddr(f.drained[b]).Name, f.flows[j].Stats().Err)
			default:
				brokenKept++
				errs.Errorf("flow from port %d to %s, whose bucket %d did not move, broke in the failover: %v", port, e.PodByAddr(full[i][b]).Name, b, f.flows[j].Stats().Err)
			}
		}
		nX := count(f.onX)
		how := "those that crossed " + dead.Name + " reached " + survivor.Name + " through the survivor's copy of their conntrack entry"
		if !e.Opts.ConntrackSync {
			how = "KNOWN LIMIT without conntrack sync (KST_E2E_CTSYNC unset): the survivor has no entry for those that crossed " + dead.Name + " and hashes them into its current table"
		}
		t.Logf("router failover while %s drains: %d of the %d flows to %s on %s broke (%s); of the %d other flows, %d broke (%d of the %d whose bucket moved)",
			x.Name, brokenOnX, nX, vip, x.Name, how, len(f.flows)-nX, brokenKept+brokenMoved, brokenMoved, moved)
		if len(broken) > 0 && (e.Opts.ConntrackSync || brokenKept+brokenMoved > 0) {
			after := e.snapshotRouter(ctx, survivor, vip)
			var lines []string
			for _, j := range broken[:min(len(broken), shownErrors)] {
				port := f.ports[j]
				lines = append(lines, fmt.Sprintf("port %d: before: %s; %s. after: %s",
					port, before[i][0].describe(e, port), before[i][1].describe(e, port), after.describe(e, port)))
			}
			t.Logf("the first broken flows to %s, as the routers held them:\n%s", vip, strings.Join(lines, "\n"))
		}
		errs.Done("flows broke")
	})

	// router-a comes back (restarted, its link up, the gateway's route over
	// both routers again), so that later scenarios have both routers. The
	// flows that crossed it go back to it: measured, not asserted (in mpls
	// mode its routes via eth0 died with the link, older generations' too).
	if err := e.SetNodeLink(ctx, dead, true); err != nil {
		t.Fatal(err)
	}
	if err := dead.Router.Start(); err != nil {
		t.Fatal(err)
	}
	backAt := time.Now()
	for i := range fs {
		fs[i].mark()
	}
	if err := e.RouteTunnelsVia(ctx, e.Routers...); err != nil {
		t.Fatal(err)
	}
	e.waitTunnels(t, vips, rest...)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		f := &fs[i]
		backOnX, backOthers := 0, 0
		for _, j := range brokenFlows(f.flows, f.echoed, backAt) {
			switch {
			case isBroken[i][j]:
			case f.onX[j]:
				backOnX++
			default:
				backOthers++
			}
		}
		t.Logf("when %s came back, %d more flows to %s broke: %d to %s, %d others", dead.Name, backOnX+backOthers, vip, backOnX, x.Name, backOthers)
		for _, fl := range f.flows {
			stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, _ = fl.Stop(stopCtx) // broken ones fail, which is measured above
			cancel()
		}
	})
}

// portTo returns the first client source port from `from` whose TCP flow
// the table sends to pod.
func (e *env) portTo(t testing.TB, table []netip.Addr, vip netip.Addr, from uint16, pod *topology.Pod) uint16 {
	t.Helper()
	for port := from; port < from+1000; port++ {
		if e.predicted(table, vip, port) == topology.PodAddr(pod, vip) {
			return port
		}
	}
	t.Fatalf("no source port in [%d, %d) hashes to a bucket of %s", from, from+1000, pod.Name)
	return 0
}

// reachedPods names, for each of the client's open TCP connections to
// vip from ports, the pod whose server holds it.
func (e *env) reachedPods(t testing.TB, vip netip.Addr, ports []uint16) map[uint16]*topology.Pod {
	t.Helper()
	out := map[uint16]*topology.Pod{}
	for _, p := range e.Pods {
		for _, peer := range e.servers[p.Name].Peers() {
			if peer.Addr() != topology.ClientAddrFor(vip) || !slices.Contains(ports, peer.Port()) {
				continue
			}
			if other := out[peer.Port()]; other != nil {
				t.Fatalf("the connection from port %d is open on both %s and %s", peer.Port(), other.Name, p.Name)
			}
			out[peer.Port()] = p
		}
	}
	for _, port := range ports {
		if out[port] == nil {
			t.Fatalf("no pod holds the connection from port %d", port)
		}
	}
	return out
}

// flowsOn checks that each open flow from ports reached the pod the table
// names, and reports which reached pod.
func (e *env) flowsOn(t testing.TB, table []netip.Addr, vip netip.Addr, ports []uint16, pod *topology.Pod) []bool {
	t.Helper()
	reached := e.reachedPods(t, vip, ports)
	on := make([]bool, len(ports))
	errs := firstErrors(t)
	for i, port := range ports {
		if want := e.predicted(table, vip, port); topology.PodAddr(reached[port], vip) != want {
			errs.Errorf("flow from port %d reached %s, the bucket table says %v", port, reached[port].Name, want)
		}
		on[i] = reached[port] == pod
	}
	errs.Done("flows elsewhere")
	return on
}

// newFlows opens one TCP connection from each port: each must reach the
// pod the table names, and none the draining pod (nil: none drains). It
// returns how many reached it.
func (e *env) newFlows(t testing.TB, table []netip.Addr, vip netip.Addr, ports []uint16, draining *topology.Pod) int {
	t.Helper()
	got := e.flows(t, vip, ports)
	toDraining := 0
	errs := firstErrors(t)
	for _, port := range ports {
		if want := e.predicted(table, vip, port); got[port] != want {
			errs.Errorf("new flow from port %d reached %v, the current table says %v", port, got[port], want)
		}
		if draining != nil && got[port] == topology.PodAddr(draining, vip) {
			toDraining++
		}
	}
	errs.Done("flows elsewhere")
	if toDraining > 0 {
		t.Errorf("%d of %d new flows reached the draining %s", toDraining, len(ports), draining.Name)
	}
	return toDraining
}

// checkOldGeneration checks that each router still holds, besides its
// current generation, one with the table the established flows started
// with.
func (e *env) checkOldGeneration(t testing.TB, vip netip.Addr, started []netip.Addr) {
	t.Helper()
	ctx := context.Background()
	for _, r := range e.Routers {
		cur, err := e.CurrentGeneration(ctx, r, vip)
		if err != nil {
			t.Fatal(err)
		}
		var found []int
		for _, gen := range e.oldGenerations(t, r, vip) {
			table, err := e.GenerationTable(ctx, r, vip, gen)
			if err != nil {
				t.Fatal(err)
			}
			if slices.Equal(table, started) {
				found = append(found, gen)
			}
		}
		if len(found) != 1 {
			gens, _ := e.Generations(ctx, r, vip)
			t.Errorf("%s: generations %v (current %d), of which %v hold the table the established flows started with; want one", r.Name, gens, cur, found)
			continue
		}
		t.Logf("%s: new flows get generation %d (HMARK offset %#x); generation %d still holds the table the established flows started with",
			r.Name, cur, datapath.DefaultMarkOffset+cur*e.Opts.Buckets, found[0])
	}
}

// oldGenerations returns the router's generations for vip other than the
// current one.
func (e *env) oldGenerations(t testing.TB, r *topology.Node, vip netip.Addr) []int {
	t.Helper()
	ctx := context.Background()
	cur, err := e.CurrentGeneration(ctx, r, vip)
	if err != nil {
		t.Fatal(err)
	}
	gens, err := e.Generations(ctx, r, vip)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(gens, cur) {
		t.Fatalf("%s marks new flows to %s for generation %d, which has no route (generations with routes: %v)", r.Name, vip, cur, gens)
	}
	return slices.DeleteFunc(gens, func(g int) bool { return g == cur })
}

// poll calls check every 200 ms until it reports done or timeout passes;
// the error then carries check's last reason.
func (e *env) poll(timeout time.Duration, check func() (bool, string)) error {
	start := time.Now()
	for {
		done, reason := check()
		if done {
			return nil
		}
		if time.Since(start) > timeout {
			return fmt.Errorf("timed out after %v: %s", timeout, reason)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// brokenFlows waits until every flow has echoed 3 more chunks than before
// or failed (at most until 30 s after since), stopping none, and returns
// the indexes of those that did not echo.
func brokenFlows(flows []*workload.Stream, before []int64, since time.Time) []int {
	echoing := func(i int) bool {
		st := flows[i].Stats()
		return st.Err == nil && st.Verified >= before[i]+3*lightChunk
	}
	for time.Since(since) < 30*time.Second {
		pending := 0
		for i, f := range flows {
			if !echoing(i) && f.Stats().Err == nil {
				pending++
			}
		}
		if pending == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	var broken []int
	for i := range flows {
		if !echoing(i) {
			broken = append(broken, i)
		}
	}
	return broken
}

// routerSnapshot is what a router held for a tunnel IP at one moment: its
// current generation, the table of each generation it has routes in, and
// its conntrack entries from the client to the tunnel IP by source port.
type routerSnapshot struct {
	name    string
	cur     int
	tables  map[int][]netip.Addr
	entries map[uint16]topology.ConntrackEntry
	err     error
}

func (e *env) snapshotRouter(ctx context.Context, r *topology.Node, vip netip.Addr) routerSnapshot {
	s := routerSnapshot{name: r.Name, tables: map[int][]netip.Addr{}, entries: map[uint16]topology.ConntrackEntry{}}
	var err error
	if s.cur, err = e.CurrentGeneration(ctx, r, vip); err != nil {
		s.err = err
		return s
	}
	gens, err := e.Generations(ctx, r, vip)
	if err != nil {
		s.err = err
		return s
	}
	for _, g := range gens {
		if s.tables[g], err = e.GenerationTable(ctx, r, vip, g); err != nil {
			s.err = err
			return s
		}
	}
	all, err := e.Conntrack(ctx, r)
	if err != nil {
		s.err = err
		return s
	}
	client := topology.ClientAddrFor(vip)
	for _, c := range all {
		if c.Proto == "tcp" && c.Dst == vip && c.Src == client {
			s.entries[c.SrcPort] = c
		}
	}
	return s
}

// describe says what the snapshot holds of the flow from port: its
// conntrack entry, and the pod its mark's generation sends it to.
func (s routerSnapshot) describe(e *env, port uint16) string {
	if s.err != nil {
		return fmt.Sprintf("%s: %v", s.name, s.err)
	}
	c, ok := s.entries[port]
	if !ok {
		return fmt.Sprintf("%s has no entry (current generation %d)", s.name, s.cur)
	}
	counters := ""
	if c.HasCounters {
		counters = fmt.Sprintf(", %d packets", c.Packets)
	}
	g, ok := e.GenerationOfMark(c.Mark)
	if !ok {
		return fmt.Sprintf("%s: %s mark %#x%s (no generation's)", s.name, c.State, c.Mark, counters)
	}
	b := int(c.Mark-datapath.DefaultMarkOffset) % e.Opts.Buckets
	to := "no route"
	if table := s.tables[g]; table != nil && table[b].IsValid() {
		to = table[b].String()
		if p := e.PodByAddr(table[b]); p != nil {
			to = p.Name
		}
	}
	return fmt.Sprintf("%s: %s mark %#x%s, generation %d bucket %d -> %s (current %d)", s.name, c.State, c.Mark, counters, g, b, to, s.cur)
}

// generationAgreement compares two routers' generations: which they both
// hold with the same table, and where they differ (a flow moved between
// them keeps its mark, so a generation whose tables differ sends it to
// another pod).
func generationAgreement(a, b routerSnapshot) string {
	if a.err != nil || b.err != nil {
		return fmt.Sprintf("cannot compare: %v", errors.Join(a.err, b.err))
	}
	var same, differ, onlyOne []int
	for g := range datapath.DefaultGenerations {
		ta, tb := a.tables[g], b.tables[g]
		switch {
		case ta == nil && tb == nil:
		case ta == nil || tb == nil:
			onlyOne = append(onlyOne, g)
		case slices.Equal(ta, tb):
			same = append(same, g)
		default:
			differ = append(differ, g)
		}
	}
	return fmt.Sprintf("current generation %d on %s, %d on %s; generations with the same table on both %v, with different tables %v, on one only %v",
		a.cur, a.name, b.cur, b.name, same, differ, onlyOne)
}

// conntrackOf returns the router's conntrack entries towards vip, for a
// failure report.
func conntrackOf(r *topology.Node, vip netip.Addr) string {
	ns, err := r.NS()
	if err != nil {
		return err.Error()
	}
	defer ns.Close()
	entries, err := topology.ConntrackIn(context.Background(), ns)
	if err != nil {
		return err.Error()
	}
	var lines []string
	for _, e := range entries {
		if e.Dst == vip {
			lines = append(lines, e.String())
		}
	}
	return strings.Join(lines, "\n")
}

// errorLimit reports the first few of many similar failures, then their
// number, so that one broken mechanism does not print 200 lines.
type errorLimit struct {
	t testing.TB
	n int
}

const shownErrors = 5

func firstErrors(t testing.TB) *errorLimit { return &errorLimit{t: t} }

func (l *errorLimit) Errorf(format string, args ...any) {
	l.t.Helper()
	if l.n++; l.n <= shownErrors {
		l.t.Errorf(format, args...)
	}
}

// Done reports how many failures were not shown.
func (l *errorLimit) Done(what string) {
	l.t.Helper()
	if l.n > shownErrors {
		l.t.Errorf("%d %s in all (the first %d shown)", l.n, what, shownErrors)
	}
}

// others returns pods without p.
func others(pods []*topology.Pod, p *topology.Pod) []*topology.Pod {
	return slices.DeleteFunc(slices.Clone(pods), func(q *topology.Pod) bool { return q == p })
}

func count(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

func countAddr(table []netip.Addr, a netip.Addr) int {
	n := 0
	for _, b := range table {
		if b == a {
			n++
		}
	}
	return n
}

func percent(n, of int) float64 {
	if of == 0 {
		return 0
	}
	return 100 * float64(n) / float64(of)
}

// floodPackets is the number of spoofed packets per family of the flood.
const floodPackets = 4000

// floodDuringDrain sends floodPackets spoofed TCP ACKs per family to each
// tunnel IP from the client's namespace (200 addresses of the client's
// subnet, which the gateway's loose reverse-path filter accepts, and
// random ports), waits one generation check of the routers (10 s), then
// calls check with the time the flood began (after mark). It asserts
// that the flood's packets made conntrack entries on the routers (some:
// a burst loses packets in the emulated VM), each in the tunnel IP's
// current generation (which the periodic check does not
// list), and logs each router's RSS before and after and the packets the
// routers counted (kube_service_tunnel_router_vip_packets_total, which
// the light flows add to).
func floodDuringDrain(t *testing.T, e *env, vips []netip.Addr, check func(since time.Time), mark func()) {
	t.Helper()
	rss := func() []int64 {
		out := make([]int64, len(e.Routers))
		for i, r := range e.Routers {
			kib, err := r.Router.RSS()
			if err != nil {
				t.Fatal(err)
			}
			out[i] = kib
		}
		return out
	}
	packets := func(vip netip.Addr) int {
		n, _ := e.routerSum(t, "kube_service_tunnel_router_vip_packets_total{", fmt.Sprintf("vip=%q", vip.String()))
		return n
	}
	before := rss()
	counted := make([]int, len(vips))
	for i, vip := range vips {
		counted[i] = packets(vip)
	}
	clientNS, err := e.Client.NS()
	if err != nil {
		t.Fatal(err)
	}
	defer clientNS.Close()
	mark()
	since := time.Now()
	tuples := make([]map[[2]netip.AddrPort]bool, len(vips))
	for i, vip := range vips {
		tuples[i] = map[[2]netip.AddrPort]bool{}
		client := topology.ClientAddr
		if vip.Is6() {
			client = topology.ClientAddr6
		}
		flood := make([][]byte, floodPackets)
		for k := range flood {
			// 200 addresses (the gateway answers their replies with
			// neighbour lookups), ports at random.
			src := client.As16()
			src[15] = byte(20 + rand.IntN(200))
			from := netip.AddrPortFrom(netip.AddrFrom16(src).Unmap(), uint16(1024+rand.IntN(64000)))
			flood[k] = attack.TCPAck(from, netip.AddrPortFrom(vip, tcpPort), rand.Uint32())
			tuples[i][[2]netip.AddrPort{from, netip.AddrPortFrom(vip, tcpPort)}] = true
		}
		if err := attack.SendRaw(clientNS, flood); err != nil {
			t.Fatalf("flooding %s: %v", vip, err)
		}
	}
	sent := time.Since(since)
	time.Sleep(11 * time.Second) // one generation check (--generation-check-period 10s) of each router
	after := rss()
	cfg := datapath.DefaultConfig()
	cfg.Buckets = e.Opts.Buckets
	for i, vip := range vips {
		// The flood's entries on each router, by generation.
		entries, byGen := 0, map[string]int{}
		for _, r := range e.Routers {
			cur, err := e.CurrentGeneration(context.Background(), r, vip)
			if err != nil {
				t.Fatal(err)
			}
			ns, err := r.Host.NS()
			if err != nil {
				t.Fatal(err)
			}
			family := netlink.InetFamily(unix.AF_INET)
			if vip.Is6() {
				family = unix.AF_INET6
			}
			err = ctmarks.Lister{NetNS: int(ns)}.EachMarked(family, []ctmarks.Range{{First: cfg.MarkOffset, Count: uint32(cfg.Slots())}}, func(f *netlink.ConntrackFlow) {
				src, _ := netip.AddrFromSlice(f.Forward.SrcIP)
				dst, _ := netip.AddrFromSlice(f.Forward.DstIP)
				key := [2]netip.AddrPort{netip.AddrPortFrom(src.Unmap(), f.Forward.SrcPort), netip.AddrPortFrom(dst.Unmap(), f.Forward.DstPort)}
				if !tuples[i][key] {
					return
				}
				entries++
				g := int(f.Mark-cfg.MarkOffset) / cfg.Buckets
				if g == cur {
					byGen[r.Name+" current"]++
				} else {
					byGen[fmt.Sprintf("%s generation %d (current %d)", r.Name, g, cur)]++
				}
			})
			ns.Close()
			if err != nil {
				t.Fatal(err)
			}
		}
		for k, n := range byGen {
			if !strings.HasSuffix(k, " current") {
				t.Errorf("%d of the flood's conntrack entries to %s are in %s: the generation check would list them", n, vip, k)
			}
		}
		// A burst from a raw socket loses packets on the way in the
		// emulated VM (2,473 of 4,000 IPv6 ones once): what must hold is
		// that the flood reached the routers and that none of it is in a
		// generation the check lists.
		if entries == 0 {
			t.Errorf("the routers hold none of the flood's %d connections to %s in conntrack: the flood did not reach them", len(tuples[i]), vip)
		}
		t.Logf("flood during the drain: %d spoofed TCP ACKs to %s in %v: %d conntrack entries on the routers %v; %d packets counted by the routers (light flows included)",
			floodPackets, vip, sent.Round(time.Millisecond), entries, byGen, packets(vip)-counted[i])
	}
	for i, r := range e.Routers {
		t.Logf("flood during the drain: %s RSS %d KiB before, %d KiB after one generation check", r.Name, before[i], after[i])
	}
	check(since)
}
