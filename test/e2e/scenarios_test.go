package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// The scenarios of issues 4 and 7, in order; each uses its own tunnel IP
// (192.0.2.N) and Service, and removes them when it ends.
var scenarios = []scenario{
	{"1_reach_pod_with_client_address", reachPod},
	{"2_routers_agree_on_every_flow", routersAgree},
	{"3_router_failover_keeps_connection", routerFailover},
	{"4_endpoint_change_moves_only_its_flows", endpointChurn},
	{"5_service_removal_restores_kernel_state", removalRestoresState},
	{"6_daemon_restarts_keep_connection", restartsKeepConnection},
	{"7_bad_annotation_warns_others_work", badAnnotation},
	{"8_megabyte_upload_and_download", bulkTransfer},
	{"9_draining_endpoint_keeps_its_flows", drainingEndpoint},
	{"10_bgp_routes_tunnel_ip_to_routers", bgpRouting},
	{"11_kubectl_tunnel_explain_names_answering_pod", explainNamesAnsweringPod},
	{"12_client_affinity_keeps_a_client_on_one_pod", clientAffinity},
	{"13_network_policy_holds_for_tunneled_traffic", networkPolicy},
}

const (
	tcpPort = topology.TCPPort
	udpPort = topology.UDPPort
)

// deploy creates Service name on vip backed by pods, waits until every
// router and pod is programmed, and deletes it (waiting for the routers and
// pods to forget vip) when the test ends. It returns the bucket table.
func (e *env) deploy(t *testing.T, name string, vip netip.Addr, pods ...*topology.Pod) []netip.Addr {
	t.Helper()
	ctx := context.Background()
	if err := e.ApplyService(ctx, e.service(topology.Service{Name: name, Annotation: vip.String(), Endpoints: topology.Ready(pods...)})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.DeleteService(ctx, name); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		start := time.Now()
		if err := e.WaitNoTunnel(ctx, vip); err != nil {
			t.Errorf("cleanup of %s: %v", vip, err)
		}
		t.Logf("Service %s deleted: %s gone from routers and pods in %v", name, vip, time.Since(start).Round(time.Millisecond))
	})
	start := time.Now()
	table, err := e.WaitTunnel(ctx, vip, pods...)
	if err != nil {
		t.Fatalf("tunnel %s: %v", vip, err)
	}
	t.Logf("Service %s on %s programmed on both routers and %d pods in %v", name, vip, len(pods), time.Since(start).Round(time.Millisecond))
	return table
}

// who asks the tunnel IP who answers, from the client, over network with
// the given source port (0: any).
func (e *env) who(t *testing.T, network string, vip netip.Addr, srcPort uint16) workload.Identity {
	t.Helper()
	port := uint16(tcpPort)
	if network == "udp" {
		port = udpPort
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := workload.Who(ctx, e.client, network, netip.AddrPortFrom(vip, port), srcPort)
	if err != nil {
		t.Fatalf("%s to %s:%d from source port %d: %v", network, vip, port, srcPort, err)
	}
	return id
}

// flows opens one TCP connection from each source port and returns the pod
// (address) that answered each.
func (e *env) flows(t *testing.T, vip netip.Addr, ports []uint16) map[uint16]netip.Addr {
	t.Helper()
	out := make(map[uint16]netip.Addr, len(ports))
	for _, port := range ports {
		id := e.who(t, "tcp", vip, port)
		pod := e.PodByName(id.Pod)
		if pod == nil {
			t.Fatalf("answer from unknown pod %q", id.Pod)
		}
		out[port] = e.podAddr(pod)
	}
	return out
}

// predicted is the pod the bucket table gives the client's TCP flow from
// port: HMARK's bucket for the 5-tuple, computed as the kernel does.
func (e *env) predicted(table []netip.Addr, vip netip.Addr, port uint16) netip.Addr {
	b := e.HMARK().Bucket(hmark.Flow{Src: topology.ClientAddrFor(vip), Dst: vip, SrcPort: port, DstPort: tcpPort, Proto: 6})
	return table[b]
}

func portRange(first uint16, n int) []uint16 {
	ports := make([]uint16, n)
	for i := range ports {
		ports[i] = first + uint16(i)
	}
	return ports
}

// 1. TCP and UDP reach a pod on well-known ports; the pod sees the client's
// address; the reply comes from the tunnel IP and never crosses a router.
func reachPod(t *testing.T, e *env) {
	ctx := context.Background()
	vip := e.tunnelIP(1)
	e.deploy(t, "reach", vip, e.Pods...)

	// Count packets from the tunnel IP (the pods' replies) on every node.
	nodes := e.Nodes()
	for _, n := range nodes {
		if _, err := topology.InNS(ctx, n.Name, iptablesFor(vip), "-t", "mangle", "-A", "PREROUTING", "-s", topology.HostPrefix(vip)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = topology.InNS(ctx, n.Name, iptablesFor(vip), "-t", "mangle", "-D", "PREROUTING", "-s", topology.HostPrefix(vip))
		})
	}
	answered := map[string]bool{}
	for _, network := range []string{"tcp", "udp"} {
		id := e.who(t, network, vip, 0)
		wantPort := uint16(tcpPort)
		if network == "udp" {
			wantPort = udpPort
		}
		if id.Peer.Addr() != topology.ClientAddrFor(vip) {
			t.Errorf("%s: the pod saw the client as %v, want its real address %v", network, id.Peer, topology.ClientAddrFor(vip))
		}
		if id.Local != netip.AddrPortFrom(vip, wantPort) {
			t.Errorf("%s: the request arrived on %v, want the tunnel IP %v:%d", network, id.Local, vip, wantPort)
		}
		t.Logf("%s %s:%d answered by %s, which saw the client as %v", network, vip, wantPort, id.Pod, id.Peer)
		answered[e.PodByName(id.Pod).Node.Name] = true
	}
	for _, n := range nodes {
		packets := countPackets(t, n.Name, vip)
		switch {
		case n.Tunnel && packets != 0:
			t.Errorf("%d reply packets from %s crossed router %s", packets, vip, n.Name)
		case answered[n.Name] && packets == 0:
			t.Errorf("no reply packet from %s counted on %s, whose pod answered (the counter is broken)", vip, n.Name)
		}
		t.Logf("packets from %s seen by %s: %d", vip, n.Name, packets)
	}
	nextHopObjects(t, e, vip)
}

// nextHopObjects checks the shape of every router's bucket routes for vip,
// served by every pod: in gre mode each names a nexthop object, and the
// router holds one object per pod; in mpls mode each carries its next hop
// inline and the router holds no object. It logs router-a's objects and
// bucket 0's route, as ip shows them.
func nextHopObjects(t *testing.T, e *env, vip netip.Addr) {
	ctx := context.Background()
	objectsWanted, shape := len(e.Pods), "nhid"
	if encap.Mode(e.Opts.Mode) == encap.MPLS {
		objectsWanted, shape = 0, "encap"
	}
	for _, r := range e.Routers {
		objects, err := topology.IP(ctx, append(append([]string{"-n", r.Name}, topology.FamilyArgs(vip)...), "nexthop", "show", "proto", "245")...)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(objects, "\n"); n != objectsWanted {
			t.Errorf("%s holds %d nexthop objects, want %d:\n%s", r.Name, n, objectsWanted, objects)
		}
		routes, err := topology.IP(ctx, append(append([]string{"-n", r.Name}, topology.FamilyArgs(vip)...), "route", "show", "table", "all", "proto", "245")...)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(routes, "\n") {
			if f := strings.Fields(l); len(f) > 1 && f[0] == vip.String() && f[1] != shape {
				t.Errorf("%s: route %q, want %q after the tunnel IP", r.Name, l, shape)
			}
		}
		if r == e.Routers[0] {
			bucket0, err := topology.IP(ctx, append(append([]string{"-n", r.Name}, topology.FamilyArgs(vip)...), "route", "show", "table", strconv.Itoa(datapath.DefaultTableBase), vip.String())...)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: ip nexthop show proto 245:\n%sip route show table %d %s:\n%s", r.Name, objects, datapath.DefaultTableBase, vip, bucket0)
		}
	}
}

// countPackets reads the counter of the "-s VIP" rule reachPod appended to
// the node's mangle PREROUTING.
func countPackets(t *testing.T, ns string, vip netip.Addr) int {
	t.Helper()
	out, err := topology.InNS(context.Background(), ns, iptablesFor(vip), "-t", "mangle", "-L", "PREROUTING", "-v", "-x", "-n")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) > 2 && slices.Contains(f, vip.String()) {
			if n, err := strconv.Atoi(f[0]); err == nil {
				return n
			}
		}
	}
	t.Fatalf("%s: no counter rule for %s in:\n%s", ns, vip, out)
	return 0
}

// 2. Both routers send the same flow to the same pod, and it is the pod the
// bucket table names.
func routersAgree(t *testing.T, e *env) {
	ctx := context.Background()
	vip := e.tunnelIP(2)
	table := e.deploy(t, "agree", vip, e.Pods...)
	ports := portRange(41000, 50)
	t.Cleanup(func() { _ = e.RouteTunnelsVia(ctx, e.Routers...) })
	var got []map[uint16]netip.Addr
	for _, r := range e.Routers {
		if err := e.RouteTunnelsVia(ctx, r); err != nil {
			t.Fatal(err)
		}
		got = append(got, e.flows(t, vip, ports))
	}
	pods := map[netip.Addr]int{}
	for _, port := range ports {
		want := e.predicted(table, vip, port)
		for i, r := range e.Routers {
			if got[i][port] != want {
				t.Errorf("flow from port %d through %s reached %v, the bucket table says %v", port, r.Name, got[i][port], want)
			}
		}
		pods[got[0][port]]++
	}
	if len(pods) < 2 {
		t.Errorf("50 flows all reached one pod: %v", pods)
	}
	t.Logf("%d flows, each sent to the same pod by %s and %s, as the bucket table predicts; pods used: %v", len(ports), e.Routers[0].Name, e.Routers[1].Name, pods)
}

// 3. A long-lived connection through router-a survives router-a's death
// once the gateway's route moves to router-b.
func routerFailover(t *testing.T, e *env) {
	ctx := context.Background()
	vip := e.tunnelIP(3)
	e.deploy(t, "failover", vip, e.Pods...)
	dead, survivor := e.Routers[0], e.Routers[1]
	if err := e.RouteTunnelsVia(ctx, dead); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.SetNodeLink(ctx, dead, true)
		if !dead.Router.Running() {
			if err := dead.Router.Start(); err != nil {
				t.Error(err)
			}
		}
		_ = e.RouteTunnelsVia(ctx, e.Routers...)
	})
	// One busy connection, and 200 light ones to measure the share of
	// disrupted flows (each spread over the pods by its own bucket).
	stream := startStream(t, e, vip, 42000)
	flows := startLightFlows(t, e, vip, 42001, 200)
	waitVerified(t, stream, 64<<10, "before the failure")

	// router-a dies: its process and its link are gone, and the route moves.
	e.failRouter(t, dead, survivor)
	failedAt := time.Now()
	atFailure := stream.Stats().Verified
	before := progress(flows)
	waitVerified(t, stream, atFailure+128<<10, "after the route moved to "+survivor.Name)
	t.Logf("the busy connection went on through %s %v after %s died", survivor.Name, stream.Stats().LastVerified.Sub(failedAt).Round(time.Millisecond), dead.Name)
	stopStream(t, stream)

	disrupted, slowest := disruptedFlows(t, flows, before, failedAt)
	t.Logf("%d of %d light flows disrupted (%.1f%%) when %s died; the last one resumed %v after the failure", disrupted, len(flows), 100*float64(disrupted)/float64(len(flows)), dead.Name, slowest.Round(10*time.Millisecond))
}

// lightChunk is what each light flow sends every 100 ms.
const lightChunk = 64

// startLightFlows opens n light echo flows from consecutive source ports
// (spread over the pods by their buckets) and waits until each has echoed.
func startLightFlows(t *testing.T, e *env, vip netip.Addr, firstPort uint16, n int) []*workload.Stream {
	t.Helper()
	light := workload.StreamOptions{ChunkSize: lightChunk, Interval: 100 * time.Millisecond}
	flows := make([]*workload.Stream, n)
	for i := range flows {
		s, err := workload.StartStream(e.client, netip.AddrPortFrom(vip, tcpPort), firstPort+uint16(i), light)
		if err != nil {
			t.Fatalf("flow from port %d: %v", firstPort+uint16(i), err)
		}
		t.Cleanup(func() { _, _ = s.Stop(context.Background()) })
		flows[i] = s
	}
	for _, f := range flows {
		waitVerified(t, f, 2*lightChunk, "before the event")
	}
	return flows
}

// progress returns each flow's verified bytes.
func progress(flows []*workload.Stream) []int64 {
	out := make([]int64, len(flows))
	for i, f := range flows {
		out[i] = f.Stats().Verified
	}
	return out
}

// disruptedFlows stops the flows and counts those the event at `since`
// disrupted: broken, a byte lost, or not 3 more chunks echoed within 30 s.
// It also returns how long the slowest flow took to echo again.
func disruptedFlows(t *testing.T, flows []*workload.Stream, before []int64, since time.Time) (int, time.Duration) {
	t.Helper()
	resumed := make([]time.Duration, len(flows))
	for pending := len(flows); pending > 0 && time.Since(since) < 30*time.Second; {
		pending = 0
		for i, f := range flows {
			st := f.Stats()
			if resumed[i] == 0 && st.Verified > before[i] {
				resumed[i] = time.Since(since)
			}
			if st.Verified < before[i]+3*lightChunk && st.Err == nil {
				pending++
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	disrupted, slowest := 0, time.Duration(0)
	for i, f := range flows {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		stats, err := f.Stop(ctx)
		cancel()
		if err != nil || stats.Verified < before[i]+3*lightChunk || stats.Verified != stats.Sent {
			disrupted++
			t.Errorf("flow %d disrupted: %v (sent %d, echoed %d)", i, err, stats.Sent, stats.Verified)
		}
		slowest = max(slowest, resumed[i])
	}
	return disrupted, slowest
}

// 4. Removing one endpoint of N moves only the flows of its buckets; adding
// one moves about 1/(N+1) of the flows, all to the newcomer.
func endpointChurn(t *testing.T, e *env) {
	vip := e.tunnelIP(4)
	table := e.deploy(t, "churn", vip, e.Pods...)
	ports := portRange(43000, 200)
	before := e.flows(t, vip, ports)
	for _, port := range ports {
		if want := e.predicted(table, vip, port); before[port] != want {
			t.Fatalf("flow from port %d reached %v, the bucket table says %v", port, before[port], want)
		}
	}

	gone, rest := e.Pods[0], e.Pods[1:]
	if err := e.ApplyService(context.Background(), e.service(topology.Service{Name: "churn", Annotation: vip.String(), Endpoints: topology.Ready(rest...)})); err != nil {
		t.Fatal(err)
	}
	smaller, err := e.WaitTunnel(context.Background(), vip, rest...)
	if err != nil {
		t.Fatal(err)
	}
	after := e.flows(t, vip, ports)
	owned, moved := 0, 0
	for _, port := range ports {
		if want := e.predicted(smaller, vip, port); after[port] != want {
			t.Errorf("after the removal, flow from port %d reached %v, the bucket table says %v", port, after[port], want)
		}
		if before[port] == e.podAddr(gone) {
			owned++
			if after[port] == e.podAddr(gone) {
				t.Errorf("flow from port %d still reaches the removed pod", port)
			}
			continue
		}
		if after[port] != before[port] {
			moved++
			t.Errorf("flow from port %d moved from %v to %v although its pod stayed", port, before[port], after[port])
		}
	}
	t.Logf("removing %s (1 of %d endpoints) moved %d of %d flows: the %d it served; %d other flows moved", gone.Name, len(e.Pods), owned, len(ports), owned, moved)

	if err := e.ApplyService(context.Background(), e.service(topology.Service{Name: "churn", Annotation: vip.String(), Endpoints: topology.Ready(e.Pods...)})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitTunnel(context.Background(), vip, e.Pods...); err != nil {
		t.Fatal(err)
	}
	again := e.flows(t, vip, ports)
	movedToNew := 0
	for _, port := range ports {
		if again[port] == after[port] {
			continue
		}
		if again[port] != e.podAddr(gone) {
			t.Errorf("adding %s moved flow from port %d from %v to %v", gone.Name, port, after[port], again[port])
		}
		movedToNew++
	}
	share := float64(movedToNew) / float64(len(ports))
	n := len(rest)
	// "About 1/(N+1)": the newcomer's share of 64 buckets is binomial; half
	// again as much would be a broken assignment.
	if limit := 1.5 / float64(n+1); share > limit {
		t.Errorf("adding one endpoint to %d moved %.0f%% of the flows, more than %.0f%%", n, 100*share, 100*limit)
	}
	t.Logf("adding %s back (N=%d -> %d) moved %d of %d flows (%.1f%%, 1/(N+1) = %.1f%%), all to it", gone.Name, n, n+1, movedToNew, len(ports), 100*share, 100/float64(n+1))
}

// 5. Deleting the Service, or removing its annotation, leaves every router,
// node and pod namespace exactly as it was before the Service existed.
func removalRestoresState(t *testing.T, e *env) {
	for i, how := range []string{"delete the Service", "remove the annotation"} {
		t.Run(strings.ReplaceAll(how, " ", "_"), func(t *testing.T) {
			ctx := context.Background()
			vip := e.tunnelIP(5 + 100*i)
			before := snapshotAll(t, e)
			name := fmt.Sprintf("removal-%d", i)
			if err := e.ApplyService(ctx, e.service(topology.Service{Name: name, Annotation: vip.String(), Endpoints: topology.Ready(e.Pods...)})); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = e.DeleteService(ctx, name) })
			if _, err := e.WaitTunnel(ctx, vip, e.Pods...); err != nil {
				t.Fatal(err)
			}
			e.who(t, "tcp", vip, 0)
			during := snapshotAll(t, e)
			if diffAll(before, during) == "" {
				t.Fatal("the tunnel changed no kernel state (the snapshot is blind)")
			}
			var err error
			if i == 0 {
				err = e.DeleteService(ctx, name)
			} else {
				err = e.ApplyService(ctx, e.service(topology.Service{Name: name, Endpoints: topology.Ready(e.Pods...)}))
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := e.WaitNoTunnel(ctx, vip); err != nil {
				t.Fatal(err)
			}
			// The last pieces (e.g. a pod's advmss) may follow the address.
			var diff string
			start := time.Now()
			for first := true; ; first = false {
				diff = diffAll(before, snapshotAll(t, e))
				if diff == "" || time.Since(start) > 15*time.Second {
					break
				}
				if first {
					t.Logf("right after the tunnel IP went, still left:\n%s", diff)
				}
				time.Sleep(300 * time.Millisecond)
			}
			if diff != "" {
				t.Errorf("after %s, the kernel state differs from before the Service existed:\n%s", how, diff)
			}
			t.Logf("after %s: routers, nodes and pods are exactly as before (%d namespaces compared)", how, len(before))
		})
	}
}

// snapshotAll reads the kernel state of every router, node and pod.
func snapshotAll(t *testing.T, e *env) map[string]kstate.State {
	t.Helper()
	out := map[string]kstate.State{}
	names := []string{}
	for _, n := range e.Nodes() {
		names = append(names, n.Name)
	}
	for _, p := range e.Pods {
		names = append(names, p.Name)
	}
	for _, name := range names {
		s, err := kstate.Snapshot(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = s
	}
	return out
}

func diffAll(a, b map[string]kstate.State) string {
	var out strings.Builder
	for name, s := range a {
		if d := kstate.Diff(s, b[name]); d != "" {
			fmt.Fprintf(&out, "== %s\n%s\n", name, d)
		}
	}
	return out.String()
}

// 6. Restarting the endpoint agents and the routers while a connection is
// open loses no byte, keeps the connection and changes no kernel state.
func restartsKeepConnection(t *testing.T, e *env) {
	vip := e.tunnelIP(6)
	e.deploy(t, "restarts", vip, e.Pods...)
	stream := startStream(t, e, vip, 44000)
	flows := startLightFlows(t, e, vip, 44001, 200)
	waitVerified(t, stream, 64<<10, "before the restarts")
	before := snapshotAll(t, e)
	restartedAt, echoed := time.Now(), progress(flows)
	for _, n := range e.Nodes() {
		for _, d := range []*topology.Daemon{n.Agent, n.Router} {
			if d == nil {
				continue
			}
			if err := d.Restart(); err != nil {
				t.Fatal(err)
			}
			t.Logf("restarted %s", d.Name)
		}
	}
	// Give the restarted daemons time to sync (and to do harm, if they would).
	if _, err := e.WaitTunnel(context.Background(), vip, e.Pods...); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	if diff := diffAll(before, snapshotAll(t, e)); diff != "" {
		t.Errorf("restarting the daemons changed the kernel state:\n%s", diff)
	}
	waitVerified(t, stream, stream.Stats().Verified+64<<10, "after the restarts")
	stats := stopStream(t, stream)
	t.Logf("the busy connection stayed up across %d daemon restarts: %d bytes sent, %d echoed back intact", len(e.Nodes()), stats.Sent, stats.Verified)
	disrupted, _ := disruptedFlows(t, flows, echoed, restartedAt)
	t.Logf("%d of %d light flows disrupted (%.1f%%) by the restarts", disrupted, len(flows), 100*float64(disrupted)/float64(len(flows)))
}

// 7. A bad annotation gets a Warning event; the other tunnel IPs keep working.
func badAnnotation(t *testing.T, e *env) {
	ctx := context.Background()
	vip := e.tunnelIP(7)
	e.deploy(t, "good", vip, e.Pods...)
	bad := "not-an-ip"
	if e.ipv6 {
		bad = e.tunnelIP(70).String() + ", " + e.tunnelIP(71).String() // two IPv6 addresses
	}
	if err := e.ApplyService(ctx, e.service(topology.Service{Name: "bad", Annotation: bad, Endpoints: topology.Ready(e.Pods...)})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.DeleteService(ctx, "bad") })
	var warning *corev1.Event
	deadline := time.Now().Add(30 * time.Second)
	for warning == nil && time.Now().Before(deadline) {
		evs, err := e.Events(ctx, "bad")
		if err != nil {
			t.Fatal(err)
		}
		for i, ev := range evs {
			if ev.Type == corev1.EventTypeWarning && ev.Reason == router.ReasonInvalidTunnelIP && strings.Contains(ev.Message, bad) {
				warning = &evs[i]
			}
		}
		time.Sleep(300 * time.Millisecond)
	}
	if warning == nil {
		t.Fatalf("no %s Warning event naming %q on Service bad", router.ReasonInvalidTunnelIP, bad)
	}
	t.Logf("Service bad: %s %s from %s: %s", warning.Type, warning.Reason, warning.Source.Component, warning.Message)
	for _, network := range []string{"tcp", "udp"} {
		id := e.who(t, network, vip, 0)
		t.Logf("%s to the good tunnel IP %s still answered by %s", network, vip, id.Pod)
	}
	if _, err := e.WaitTunnel(ctx, vip, e.Pods...); err != nil {
		t.Errorf("the good tunnel IP lost its programming: %v", err)
	}
}

// 8. A 1 MB upload and a 1 MB download through the tunnel complete intact.
func bulkTransfer(t *testing.T, e *env) {
	vip := e.tunnelIP(8)
	e.deploy(t, "bulk", vip, e.Pods...)
	const size = 1 << 20
	dst := netip.AddrPortFrom(vip, tcpPort)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	id, err := workload.Upload(ctx, e.client, dst, size)
	if err != nil {
		t.Fatalf("1 MiB upload: %v", err)
	}
	t.Logf("1 MiB upload to %s took %v", id.Pod, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	if err := workload.Download(ctx, e.client, dst, size); err != nil {
		t.Fatalf("1 MiB download: %v", err)
	}
	t.Logf("1 MiB download took %v", time.Since(start).Round(time.Millisecond))
}

// startStream opens a long-lived echo connection from the client.
func startStream(t *testing.T, e *env, vip netip.Addr, srcPort uint16) *workload.Stream {
	t.Helper()
	s, err := workload.StartStream(e.client, netip.AddrPortFrom(vip, tcpPort), srcPort, workload.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = s.Stop(context.Background()) })
	return s
}

// waitVerified waits until the stream has verified at least n echoed bytes.
func waitVerified(t *testing.T, s *workload.Stream, n int64, when string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := s.Stats()
		if st.Err != nil {
			t.Fatalf("%s: the connection broke: %v", when, st.Err)
		}
		if st.Verified >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: only %d of %d bytes echoed within 30 s", when, st.Verified, n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stopStream ends the stream; every byte sent must have come back intact.
func stopStream(t *testing.T, s *workload.Stream) workload.StreamStats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stats, err := s.Stop(ctx)
	if err != nil {
		t.Fatalf("stream: %v (sent %d, verified %d)", err, stats.Sent, stats.Verified)
	}
	if stats.Verified != stats.Sent {
		t.Fatalf("stream: sent %d bytes, %d came back", stats.Sent, stats.Verified)
	}
	return stats
}

// failRouter makes dead fail as a node does: its process is killed, its link
// cut, and the gateway routes the tunnel IPs via survivor only.
func (e *env) failRouter(t *testing.T, dead, survivor *topology.Node) {
	t.Helper()
	ctx := context.Background()
	if err := dead.Router.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := e.SetNodeLink(ctx, dead, false); err != nil {
		t.Fatal(err)
	}
	if err := e.RouteTunnelsVia(ctx, survivor); err != nil {
		t.Fatal(err)
	}
}

// iptablesFor is the iptables command of vip's family.
func iptablesFor(vip netip.Addr) string {
	if vip.Is4() {
		return "iptables"
	}
	return "ip6tables"
}
