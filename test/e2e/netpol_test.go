package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// policyName is the lab's NetworkPolicy.
const policyName = "tunnel-ingress"

// 13. The pods' ingress NetworkPolicy holds for tunneled traffic, in both
// families at once: a policy admitting only the client's addresses on the
// TCP port lets the client in, and drops (and counts) a second client
// address of each family and the client's UDP; a policy change during an
// open connection does not cut it but refuses new ones; without a policy
// every address connects again.
func networkPolicy(t *testing.T, e *env) {
	ctx := context.Background()
	vips := tunnelIPs(13)
	e.deploy(t, "policy", vips, e.Pods...)
	strangers := make([]netip.Addr, len(vips))
	for i, vip := range vips {
		others, err := e.AddClientAddrs(ctx, topology.ClientAddrFor(vip), 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := e.RemoveClientAddrs(ctx, others); err != nil {
				t.Error(err)
			}
		})
		strangers[i] = others[0]
	}
	policies := e.Kube.NetworkingV1().NetworkPolicies(e.Opts.Namespace)
	t.Cleanup(func() {
		if err := policies.Delete(ctx, policyName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting the policy: %v", err)
		}
	})
	var rules []networkingv1.NetworkPolicyIngressRule
	for _, vip := range vips {
		rules = append(rules, ipBlockRule(topology.ClientAddrFor(vip), corev1.ProtocolTCP, tcpPort))
	}
	onlyClient := policy(rules...)

	// The policy latency with nothing reading /metrics, timed from the
	// agents' logs: the steps below poll the agents' /metrics every 20 ms,
	// and each scrape reads every isolated pod's counters.
	start := time.Now()
	if _, err := policies.Create(ctx, onlyClient, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	quietCreated := e.loggedRules(t, start)
	start = time.Now()
	if err := policies.Delete(ctx, policyName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	quietDeleted := e.loggedRules(t, start)
	t.Logf("without a scraper (timed from the agents' logs): policy created: the rules were in the %d pods' kernels %v after the write; deleted: gone %v after the delete",
		len(e.Pods), quietCreated.Round(time.Millisecond), quietDeleted.Round(time.Millisecond))

	// Both reach the pods before any policy. A connection of the second
	// address, opened before any policy: the policy will refuse that
	// address, but not this connection.
	early := make([]*workload.Stream, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		for _, src := range []netip.Addr{topology.ClientAddrFor(vip), strangers[i]} {
			// A precondition, not the property under test: three tries
			// of 2 s each, from ports of their own (on the slowest
			// machine one first IPv6 connection right after the quiet
			// policy's deletion got no answer in 2 s: issue 35).
			reached := false
			for try, port := range []uint16{41000, 41021, 41022} {
				if reached = e.connects(src, vip, port); reached {
					break
				}
				t.Logf("%v got no answer from %v before any policy (try %d of 3)", src, vip, try+1)
			}
			if !reached {
				t.Fatalf("%v cannot reach %v before any policy", src, vip)
			}
		}
		s, err := workload.StartStreamFrom(e.client, netip.AddrPortFrom(vip, tcpPort), netip.AddrPortFrom(strangers[i], 41050), workload.StreamOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { stopAtCleanup(s) })
		early[i] = s
		waitVerified(t, s, 1000, "before any policy")
	})

	writes := e.policyWrites(t)
	start = time.Now()
	if _, err := policies.Create(ctx, onlyClient, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.logPolicyLatency(t, "policy created", writes, start)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		client, stranger := topology.ClientAddrFor(vip), strangers[i]
		if err := e.poll(30*time.Second, func() (bool, string) {
			return !e.connects(stranger, vip, 41001), "the second client address still connects"
		}); err != nil {
			t.Fatal(err)
		}

		// kubectl tunnel explain judges the flows as the agents do.
		for src, want := range map[netip.Addr]string{client: tunnelctl.PolicyAdmitted, stranger: tunnelctl.PolicyRefused} {
			var ex tunnelctl.Explanation
			e.kubectlTunnel(t, &ex, "explain", netip.AddrPortFrom(vip, tcpPort).String(), "--from", netip.AddrPortFrom(src, 41099).String())
			if ex.Policy == nil || ex.Policy.Verdict != want || len(ex.Policy.Policies) != 1 {
				t.Errorf("kubectl tunnel explain from %v: policy %+v, want %q by the lab's policy", src, ex.Policy, want)
			}
		}
		// The client reaches every pod (the buckets spread its flows); the
		// stranger reaches none; UDP is not in the policy.
		reached := map[string]int{}
		for _, port := range portRange(41100, 20) {
			reached[e.whoFrom(t, netip.AddrPortFrom(client, port), vip).Pod]++
		}
		if len(reached) < 2 {
			t.Errorf("20 flows of the admitted client reached %v: the test should cover several pods", reached)
		}
		// Each refused connection waits out connects' timeout: all at once.
		refused := e.refusedOf(stranger, vip, portRange(41200, 10))
		if refused != 10 {
			t.Errorf("%d of 10 connections from %v refused, want 10", refused, stranger)
		}
		udpCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, udpErr := workload.Who(udpCtx, e.client, "udp", netip.AddrPortFrom(vip, udpPort), 41300)
		cancel()
		if udpErr == nil {
			t.Error("UDP from the admitted client was answered, but the policy admits TCP only")
		}
		waitVerified(t, early[i], early[i].Stats().Verified+1000, "after the policy refusing its address")
		earlyStats := stopStream(t, early[i])
		t.Logf("a connection from %v opened before the policy kept echoing after it: %d bytes verified", stranger, earlyStats.Verified)
		t.Logf("admitted client: 20 of 20 TCP flows answered by %d pods %v; %v: 0 of 10 answered; UDP from the client: refused", len(reached), reached, stranger)

		// What the agents counted as dropped, per pod.
		var drops int
		var lines []string
		if err := e.poll(20*time.Second, func() (bool, string) {
			drops, lines = e.policyDrops(t, vip)
			return drops >= 10, fmt.Sprintf("%d dropped packets counted: %v", drops, lines)
		}); err != nil {
			t.Error(err)
		}
		t.Logf("agents count %d dropped packets for %v: %s", drops, vip, strings.Join(lines, "; "))
	})

	// A change to deny-all keeps the open connections and refuses new ones.
	streams := make([]*workload.Stream, len(vips))
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		streams[i] = startStream(t, e, vip, 41400)
		waitVerified(t, streams[i], 1000, "before the policy change")
	})
	denyAll := policy()
	current, err := policies.Get(ctx, policyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	denyAll.ResourceVersion = current.ResourceVersion
	writes = e.policyWrites(t)
	start = time.Now()
	if _, err := policies.Update(ctx, denyAll, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.logPolicyLatency(t, "policy changed", writes, start)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		if err := e.poll(30*time.Second, func() (bool, string) {
			return !e.connects(topology.ClientAddrFor(vip), vip, 41401), "the client still opens new connections"
		}); err != nil {
			t.Fatal(err)
		}
		before := streams[i].Stats().Verified
		waitVerified(t, streams[i], before+1000, "after the change to deny all")
		stats := stopStream(t, streams[i])
		t.Logf("the connection to %s open across the change kept echoing: %d bytes verified", vip, stats.Verified)
	})

	// No policy: every address connects again.
	writes = e.policyWrites(t)
	start = time.Now()
	if err := policies.Delete(ctx, policyName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	e.logPolicyLatency(t, "policy deleted", writes, start)
	inFamilies(t, vips, func(t testing.TB, i int, vip netip.Addr) {
		if err := e.poll(30*time.Second, func() (bool, string) {
			return e.connects(strangers[i], vip, 41500) && e.connects(topology.ClientAddrFor(vip), vip, 41501), "a client is still refused"
		}); err != nil {
			t.Fatal(err)
		}
	})
}

// refusedOf tries a TCP connection from src to vip from each port, all at
// once, and returns how many were not answered (connects).
func (e *env) refusedOf(src, vip netip.Addr, ports []uint16) int {
	var refused atomic.Int32
	lab.InParallel(len(ports), len(ports), func(i int) {
		if !e.connects(src, vip, ports[i]) {
			refused.Add(1)
		}
	})
	return int(refused.Load())
}

// connects reports whether a TCP connection from src:port to vip is
// answered within 2 s.
func (e *env) connects(src, vip netip.Addr, port uint16) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := workload.WhoFrom(ctx, e.client, "tcp", netip.AddrPortFrom(vip, tcpPort), netip.AddrPortFrom(src, port))
	return err == nil
}

// policyDrops sums the agents' policy drop counters of vip over the pods.
func (e *env) policyDrops(t testing.TB, vip netip.Addr) (int, []string) {
	t.Helper()
	return e.agentSum(t, "kube_service_tunnel_endpoint_policy_dropped_packets_total{", `vip="`+vip.String()+`"`)
}

// policyWrites counts the pods' filter table writes the agents made.
func (e *env) policyWrites(t testing.TB) int {
	t.Helper()
	n, _ := e.agentSum(t, "kube_service_tunnel_endpoint_kernel_operations_total{", `object="policy_rules"`)
	return n
}

// agentSum sums, over the agents of the pods' nodes, the metric lines
// starting with prefix that contain label.
func (e *env) agentSum(t testing.TB, prefix, label string) (int, []string) {
	t.Helper()
	seen := map[*topology.Node]bool{}
	var nodes []*topology.Node
	for _, p := range e.Pods {
		if !seen[p.Node] {
			seen[p.Node] = true
			nodes = append(nodes, p.Node)
		}
	}
	return metricSum(t, nodes, e.AgentMetrics, prefix, label)
}

// routerSum is agentSum over the routers' metrics.
func (e *env) routerSum(t testing.TB, prefix, label string) (int, []string) {
	t.Helper()
	return metricSum(t, e.Routers, e.RouterMetrics, prefix, label)
}

// metricSum sums, over nodes, the metric lines read (by read) that start
// with prefix and contain label, and returns them.
func metricSum(t testing.TB, nodes []*topology.Node, read func(context.Context, *topology.Node, ...string) ([]string, error), prefix, label string) (int, []string) {
	t.Helper()
	total, lines, err := metricLines(nodes, read, prefix, label)
	if err != nil {
		t.Fatal(err)
	}
	return total, lines
}

// metricSumErr is metricSum's total, for a failure report (an error is
// returned, not fatal).
func metricSumErr(nodes []*topology.Node, read func(context.Context, *topology.Node, ...string) ([]string, error), prefix, label string) (int, error) {
	total, _, err := metricLines(nodes, read, prefix, label)
	return total, err
}

func metricLines(nodes []*topology.Node, read func(context.Context, *topology.Node, ...string) ([]string, error), prefix, label string) (int, []string, error) {
	total := 0
	var lines []string
	for _, n := range nodes {
		ms, err := read(context.Background(), n, prefix)
		if err != nil {
			return 0, nil, fmt.Errorf("metrics of %s: %w", n.Name, err)
		}
		for _, m := range ms {
			if !strings.Contains(m, label) {
				continue
			}
			fields := strings.Fields(m)
			v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
			if err != nil {
				return 0, nil, fmt.Errorf("metric line %q: %w", m, err)
			}
			total += int(v)
			lines = append(lines, m)
		}
	}
	return total, lines, nil
}

// timeToRules waits until the agents have written every pod's filter
// table once more than writes, and returns how long that took from start.
func (e *env) timeToRules(t *testing.T, writes int, start time.Time) time.Duration {
	t.Helper()
	for e.policyWrites(t) < writes+len(e.Pods) {
		if time.Since(start) > 30*time.Second {
			t.Fatalf("the agents did not write the %d pods' rules within 30 s", len(e.Pods))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// logPolicyLatency waits for a policy step's rules as the busy scraper
// sees them (timeToRules) and logs that with the latency the agents'
// logs give for the same step: the scraper's figure adds the time it
// takes to see the change.
func (e *env) logPolicyLatency(t *testing.T, step string, writes int, start time.Time) {
	t.Helper()
	seen := e.timeToRules(t, writes, start)
	logged := e.loggedRules(t, start)
	t.Logf("%s under a busy scraper: the rules were in the %d pods' kernels %v after the API write (the agents' logs), seen by the scraper after %v",
		step, len(e.Pods), logged.Round(time.Millisecond), seen.Round(time.Millisecond))
}

// loggedRules waits, reading only the agents' logs, until they have logged
// as many changes of the pods' network policy rules since start as there
// are pods (one per pod and family counts, as timeToRules counts kernel
// operations; a deleted policy is a write of the pod's rules without it),
// and returns how long after start the last of them was logged.
func (e *env) loggedRules(t *testing.T, start time.Time) time.Duration {
	t.Helper()
	seen := map[*topology.Node]bool{}
	for {
		var times []time.Time
		clear(seen)
		for _, p := range e.Pods {
			if seen[p.Node] {
				continue
			}
			seen[p.Node] = true
			ts, err := p.Node.Agent.LoggedSince(start, "pod namespace changed", "network policy rules")
			if err != nil {
				t.Fatal(err)
			}
			times = append(times, ts...)
		}
		if len(times) >= len(e.Pods) {
			slices.SortFunc(times, time.Time.Compare)
			return times[len(e.Pods)-1].Sub(start)
		}
		if time.Since(start) > 30*time.Second {
			var all []time.Time
			for node := range seen {
				ts, _ := node.Agent.LoggedSince(time.Time{}, "network policy rules")
				all = append(all, ts...)
			}
			slices.SortFunc(all, time.Time.Compare)
			t.Fatalf("the agents logged %d of the %d pods' rules within 30 s of %s; the agents' rule changes logged at any time: %v",
				len(times), len(e.Pods), start.UTC().Format(time.RFC3339Nano), all)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// policy is the lab's NetworkPolicy selecting every lab pod, with rules
// (none: deny all ingress).
func policy(rules ...networkingv1.NetworkPolicyIngressRule) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: policyName},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress:     rules,
		},
	}
}

// ipBlockRule admits src alone (/32 or /128) on one port.
func ipBlockRule(src netip.Addr, proto corev1.Protocol, port int) networkingv1.NetworkPolicyIngressRule {
	p := intstr.FromInt32(int32(port))
	return networkingv1.NetworkPolicyIngressRule{
		From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: topology.HostPrefix(src)}}},
		Ports: []networkingv1.NetworkPolicyPort{{Protocol: &proto, Port: &p}},
	}
}
