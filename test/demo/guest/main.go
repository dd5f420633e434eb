// Command guest is the part of `make demo` that runs inside the lab VM: it
// builds the lab's cluster (test/lab/topology), deploys examples/echo.yaml,
// and shows a client reaching the pods through the tunnel IP on a real
// GRE datapath. test/demo boots it; it is not meant to be run by hand.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netns"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
)

// ExampleFile is examples/echo.yaml, placed in the VM by test/demo.
const ExampleFile = "/lab/examples/echo.yaml"

func main() {
	if err := run(context.Background()); err != nil {
		fmt.Println("\ndemo failed:", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) {
	fmt.Printf("\n==> "+format+"\n", args...)
}

func say(format string, args ...any) {
	fmt.Printf("    "+format+"\n", args...)
}

type prefixWriter struct{}

func (prefixWriter) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		say("lab: %s", line)
	}
	return len(p), nil
}

func run(ctx context.Context) (err error) {
	svc, err := exampleService()
	if err != nil {
		return err
	}
	vips, err := tunnelclaim.ParseIPs(svc.Annotations[tunnelclaim.Annotation])
	if err != nil {
		return fmt.Errorf("%s: %w", ExampleFile, err)
	}
	vip := vips[0]
	port := uint16(svc.Spec.Ports[0].Port)
	dst := netip.AddrPortFrom(vip, port)

	step("Building the cluster inside the VM: every machine is a network namespace")
	l, err := topology.Up(ctx, topology.Options{Mode: "gre", Namespace: svc.Namespace, PodLabels: svc.Spec.Selector, Log: prefixWriter{}})
	defer func() {
		step("Cleaning up: stopping the daemons, running their --cleanup, deleting the namespaces")
		if derr := l.Down(context.Background()); derr != nil && err == nil {
			err = derr
		}
	}()
	if err != nil {
		return err
	}
	say("client      %v, outside the cluster", topology.ClientAddr)
	say("gateway     the datacenter router: routes %v to the tunnel routers", topology.TunnelNet)
	for _, r := range l.Routers {
		say("%-11s %v  label node=tunnel, runs tunnel-router (gre mode)", r.Name, r.Addr)
	}
	for _, w := range l.Workers {
		var pods []string
		for _, p := range l.Pods {
			if p.Node == w {
				pods = append(pods, fmt.Sprintf("%s %v", p.Name, p.Addr))
			}
		}
		say("%-11s %v  runs tunnel-endpoint; pods: %s", w.Name, w.Addr, strings.Join(pods, ", "))
	}
	for _, p := range l.Pods {
		ns, err := p.NS()
		if err != nil {
			return err
		}
		srv, err := workload.Serve(ns, p.Name, []int{int(port)}, nil)
		ns.Close()
		if err != nil {
			return err
		}
		defer srv.Close()
	}
	say("each pod runs a small server on port %d that answers with its name and the client address it saw", port)

	step("Deploying examples/echo.yaml: Service %s/%s with annotation %s: %v", svc.Namespace, svc.Name, tunnelclaim.Annotation, vip)
	if err := applyExample(ctx, l); err != nil {
		return err
	}
	say("no kubelet or controller-manager runs here, so the lab plays their part: the four")
	say("pods above are the Deployment's, and the lab writes the Service's EndpointSlice")
	if err := l.ApplyEndpoints(ctx, svc.Name, topology.Ready(l.Pods...)); err != nil {
		return err
	}
	start := time.Now()
	table, err := l.WaitTunnel(ctx, vip, l.Pods...)
	if err != nil {
		return err
	}
	say("both routers and all four pods programmed %v in %v", vip, time.Since(start).Round(time.Millisecond))
	external, err := waitExternalIP(ctx, l, svc)
	if err != nil {
		return err
	}
	say("kubectl get svc -n %s %s shows EXTERNAL-IP %s: the routers published it in status.loadBalancer.ingress", svc.Namespace, svc.Name, external)

	client, err := l.Client.NS()
	if err != nil {
		return err
	}
	defer client.Close()

	step("A client connects to %v from %v", dst, topology.ClientAddr)
	id, err := who(ctx, client, dst, 0)
	if err != nil {
		return err
	}
	say("answered by %s, which saw the client as %v  <- the client's real address", id.Pod, id.Peer)
	say("the pod received the connection on %v: the tunnel IP itself, not a node port", id.Local)
	if id.Peer.Addr() != topology.ClientAddr {
		return fmt.Errorf("the pod saw %v, not the client's address", id.Peer)
	}

	step("How it got there: router-a's kernel state for %v", vip)
	show(ctx, "iptables -t mangle -S KST-HMARK (hashes each flow into one of 64 buckets)", "router-a", "iptables", "-t", "mangle", "-S", "KST-HMARK")
	showFirst(ctx, "ip rule (the guard, then a search tree over the bucket marks: packet mark -> routing table)", 4, "-n", "router-a", "rule", "show")
	gen, err := l.CurrentGeneration(ctx, l.Routers[0], vip)
	if err != nil {
		return err
	}
	t0 := fmt.Sprint(l.TableOf(gen, 0))
	showFirst(ctx, "ip route show table "+t0+" (bucket 0's table: encapsulate to one pod over GRE)", 1, "-n", "router-a", "route", "show", "table", t0)
	showFirst(ctx, fmt.Sprintf("ip -d addr show kst-decap, in %s (the endpoint agent's decapsulation device)", id.Pod), 4, "-n", id.Pod, "-d", "addr", "show", "kst-decap")

	step("The bucket table of %v (bucket -> pod), read from router-a's routes", vip)
	printTable(l, table)

	step("The same flow is chosen by both routers")
	say("the client makes 8 connections with fixed source ports, first through router-a only,")
	say("then through router-b only (the gateway's route moves, as when a router fails):")
	say("%-22s %-7s %-10s %-10s %s", "client", "bucket", "router-a", "router-b", "bucket table")
	ports := []uint16{40001, 40002, 40003, 40004, 40005, 40006, 40007, 40008}
	seen := make([]map[uint16]string, len(l.Routers))
	for i, r := range l.Routers {
		if err := l.RouteTunnelsVia(ctx, r); err != nil {
			return err
		}
		seen[i] = map[uint16]string{}
		for _, p := range ports {
			id, err := who(ctx, client, dst, p)
			if err != nil {
				return err
			}
			seen[i][p] = id.Pod
		}
	}
	if err := l.RouteTunnelsVia(ctx, l.Routers...); err != nil {
		return err
	}
	params := l.HMARK()
	for _, p := range ports {
		b := params.Bucket(hmark.Flow{Src: topology.ClientAddr, Dst: vip, SrcPort: p, DstPort: port, Proto: 6})
		want := l.PodByAddr(table[b]).Name
		say("%-22s %-7d %-10s %-10s %s", fmt.Sprintf("%v:%d", topology.ClientAddr, p), b, seen[0][p], seen[1][p], want)
		if seen[0][p] != seen[1][p] || seen[0][p] != want {
			return errors.New("the routers disagree on a flow")
		}
	}
	say("every flow reached the same pod through either router: a router can fail without moving a flow")

	if err := askTheCluster(ctx, l, client, svc, dst); err != nil {
		return err
	}

	step("Scaling down: %s goes away; only the flows it served move", l.Pods[0].Name)
	flows := make([]uint16, 100)
	for i := range flows {
		flows[i] = 45000 + uint16(i)
	}
	before, err := podPerFlow(ctx, client, dst, flows)
	if err != nil {
		return err
	}
	if err := l.ApplyEndpoints(ctx, svc.Name, topology.Ready(l.Pods[1:]...)); err != nil {
		return err
	}
	table, err = l.WaitTunnel(ctx, vip, l.Pods[1:]...)
	if err != nil {
		return err
	}
	after, err := podPerFlow(ctx, client, dst, flows)
	if err != nil {
		return err
	}
	own, others := 0, 0
	for _, f := range flows {
		switch {
		case before[f] == l.Pods[0].Name:
			own++
		case after[f] != before[f]:
			others++
		}
	}
	say("of 100 client flows, %d were served by %s and moved; %d others moved", own, l.Pods[0].Name, others)
	if others != 0 {
		return errors.New("flows of other pods moved")
	}

	if err := drain(ctx, l, client, svc.Name, dst, table, l.Pods[1:]); err != nil {
		return err
	}

	if err := bgpRoute(ctx, l, client, dst); err != nil {
		return err
	}

	step("Deleting the Service: routers and pods forget %v", vip)
	if err := l.Kube.CoreV1().Services(svc.Namespace).Delete(ctx, svc.Name, metav1.DeleteOptions{}); err != nil {
		return err
	}
	if err := l.WaitNoTunnel(ctx, vip); err != nil {
		return err
	}
	say("no route, rule, HMARK rule, device or address for %v is left on any router or pod", vip)
	if _, err := l.WaitGatewayNextHops(ctx, vip, time.Now(), 30*time.Second); err != nil {
		return err
	}
	say("and both routers withdrew it: the gateway has no route for %v any more", vip)
	evs, err := l.Events(ctx, svc.Name)
	if err != nil {
		return err
	}
	step("Events the routers recorded on Service %s/%s", svc.Namespace, svc.Name)
	for _, e := range evs {
		say("%-7s %-17s %s: %s", e.Type, e.Reason, e.Source.Host, e.Message)
	}
	return nil
}

// conntrackUnackTimeout is the lifetime of a router's TCP conntrack entry
// after its last packet: nf_conntrack_tcp_timeout_unacknowledged, as the
// router never sees a reply.
const conntrackUnackTimeout = 300 * time.Second

// oldGenerationBound is how long after the last packet of an old
// generation's connections the routers may keep it: an open TCP entry (no
// FIN seen) counts as a flow until it expires, and the routers look every
// 10 s; plus slack for a slow VM.
const oldGenerationBound = conntrackUnackTimeout + datapath.DefaultGenerationCheckPeriod + 20*time.Second

// drain shows a terminating pod keeping its open connection while new
// connections avoid it, and the two generations of bucket tables that make
// it possible on router-a.
func drain(ctx context.Context, l *topology.Lab, client netns.NsHandle, service string, dst netip.AddrPort, table []netip.Addr, pods []*topology.Pod) error {
	vip, ra := dst.Addr(), l.Routers[0]
	const longPort = 46000
	bucket := int(l.HMARK().Bucket(hmark.Flow{Src: topology.ClientAddr, Dst: vip, SrcPort: longPort, DstPort: dst.Port(), Proto: 6}))
	pod := l.PodByAddr(table[bucket])
	step("Draining: %s is terminating; its open connection stays, new ones avoid it", pod.Name)
	oldGen, err := l.CurrentGeneration(ctx, ra, vip)
	if err != nil {
		return err
	}
	// 64 bytes every 100 ms: an interactive session, say.
	stream, err := workload.StartStream(client, dst, longPort, workload.StreamOptions{ChunkSize: 64, Interval: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = stream.Stop(stopCtx)
	}()
	if err := waitEcho(stream, 3*64); err != nil {
		return err
	}
	say("a long connection from %v:%d (bucket %d) is echoing with %s", topology.ClientAddr, longPort, bucket, pod.Name)
	var rest []*topology.Pod
	for _, p := range pods {
		if p != pod {
			rest = append(rest, p)
		}
	}
	timing, err := watchChange(ctx, l, service+"-lab", vip)
	if err != nil {
		return err
	}
	requested := time.Now()
	if err := l.ApplyEndpoints(ctx, service, append(topology.Ready(rest...), topology.Endpoint{Pod: pod, Terminating: true})); err != nil {
		return err
	}
	start := time.Now()
	timing.request(requested, start)
	if _, err := l.WaitTunnel(ctx, vip, rest...); err != nil {
		return err
	}
	seen := time.Now()
	say("the EndpointSlice marks %s serving but not ready (terminating), as in a rolling update;", pod.Name)
	say("the lab saw both routers' new bucket table (without it, for new flows) %v after the write returned;", seen.Sub(start).Round(time.Millisecond))
	say("%s", timing.report(seen))
	ports := make([]uint16, 50)
	for i := range ports {
		ports[i] = 46100 + uint16(i)
	}
	reached, err := podPerFlow(ctx, client, dst, ports)
	if err != nil {
		return err
	}
	toPod := 0
	for _, p := range ports {
		if reached[p] == pod.Name {
			toPod++
		}
	}
	echoed := stream.Stats().Verified
	if err := waitEcho(stream, echoed+3*64); err != nil {
		// Known bug, issue 7 open: a few draining flows are reset.
		say("KNOWN BUG (issue 7): the long connection broke while %s drains: %v", pod.Name, err)
	} else {
		say("of 50 new connections, %d reached %s; the long connection still echoes with it", toPod, pod.Name)
	}
	if toPod != 0 {
		return errors.New("new connections reached the terminating pod")
	}

	newGen, err := l.CurrentGeneration(ctx, ra, vip)
	if err != nil {
		return err
	}
	// The tunnel IP is in generation newGen's set, which its HMARK rule
	// matches.
	set := fmt.Sprintf("KST-HMARK-%d", newGen)
	rules, err := ipsetstate.ListRules(func() (string, error) {
		return topology.InNS(ctx, ra.Name, "iptables", "-t", "mangle", "-S", "KST-HMARK")
	})
	var hmarkRule []string
	for _, line := range strings.Split(rules, "\n") {
		if strings.Contains(line, " --match-set "+set+" dst ") {
			hmarkRule = append(hmarkRule, line)
		}
	}
	if members, merr := ipsetstate.MembersInNamespace(ra.Name, set); merr != nil {
		err = merr
	} else {
		hmarkRule = append([]string{fmt.Sprintf("(set %s holds %v)", set, members)}, hmarkRule...)
	}
	printOutput(fmt.Sprintf("iptables -t mangle -S KST-HMARK, on router-a: new flows get generation %d's marks", newGen), strings.Join(hmarkRule, "\n"), err, 0)
	for _, g := range []struct {
		gen  int
		what string
	}{{oldGen, "where the long connection's conntrack mark keeps it"}, {newGen, "for new flows"}} {
		t := fmt.Sprint(l.TableOf(g.gen, bucket))
		showFirst(ctx, fmt.Sprintf("ip route show table %s (bucket %d in generation %d: %s)", t, bucket, g.gen, g.what), 1, "-n", ra.Name, "route", "show", "table", t)
	}

	stats, err := stream.Stop(ctx)
	// No packet of generation oldGen's connections after this: the routers
	// must drop it within oldGenerationBound.
	ended := time.Now()
	if err != nil {
		say("KNOWN BUG (issue 7): the long connection ended with %v", err)
	}
	if err := l.ApplyEndpoints(ctx, service, topology.Ready(rest...)); err != nil {
		return err
	}
	say("the long connection ends (%d bytes echoed, every one intact) and %s leaves the EndpointSlice", stats.Verified, pod.Name)
	start = time.Now()
	explained := false
	for {
		old := 0
		for _, r := range l.Routers {
			gens, err := l.Generations(ctx, r, vip)
			if err != nil {
				return err
			}
			old += len(gens) - 1
		}
		if old == 0 {
			break
		}
		if time.Since(ended) > oldGenerationBound {
			showOldGenerationEntries(ctx, l, vip)
			return fmt.Errorf("the routers still hold %d old generations of %v %v after the last connection of generation %d ended (at most %v: see above)",
				old, vip, time.Since(ended).Round(time.Second), oldGen, oldGenerationBound)
		}
		if !explained && time.Since(start) > 2*datapath.DefaultGenerationCheckPeriod {
			// Rare: a connection's last packets reached a router out of
			// order (README, "Draining and routing generations").
			explained = true
			say("generation %d is still there %v later, although all its connections have ended:", oldGen, time.Since(start).Round(time.Second))
			if lone := showOldGenerationEntries(ctx, l, vip); lone {
				say("each of these entries saw one packet: one that reached the router after its connection's")
				say("RST (packets of one connection can overtake each other, here between the VM's two CPUs), so")
				say("conntrack picked the connection up again, ESTABLISHED for %v. The router cannot tell that", conntrackUnackTimeout)
				say("from a live flow: the generation stays until such an entry expires, at most")
				say("%v after the connection ended", oldGenerationBound)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	say("no connection uses generation %d any more: both routers deleted its routes %v later", oldGen, time.Since(start).Round(100*time.Millisecond))
	return nil
}

// showOldGenerationEntries prints, for each router that still holds an
// older generation of vip, the conntrack entries whose mark belongs to one:
// the entries the router counts as flows keep it. lone reports whether
// there are such entries and each of them saw a single packet.
func showOldGenerationEntries(ctx context.Context, l *topology.Lab, vip netip.Addr) (lone bool) {
	counted, single := 0, 0
	for _, r := range l.Routers {
		gens, err := l.Generations(ctx, r, vip)
		if err != nil {
			say("%s: %v", r.Name, err)
			continue
		}
		if len(gens) <= 1 {
			continue
		}
		cur, err := l.CurrentGeneration(ctx, r, vip)
		if err != nil {
			say("%s: %v", r.Name, err)
			continue
		}
		entries, err := l.OldGenerationEntries(ctx, r, vip, cur)
		if err != nil {
			say("%s: conntrack: %v", r.Name, err)
			continue
		}
		say("%s holds generations %v of %v (%d is current); its conntrack entries with an older generation's mark:", r.Name, gens, vip, cur)
		if len(entries) == 0 {
			say("  none")
		}
		for _, e := range entries {
			// A closing entry's connmark has the closing bit: it is in
			// no generation, so every entry listed is a flow.
			gen, _ := l.GenerationOfMark(e.Mark)
			counted++
			if e.HasCounters && e.Packets == 1 {
				single++
			}
			say("  %v", e)
			say("    keeps generation %d: the router counts it as a flow", gen)
		}
	}
	return counted > 0 && single == counted
}

// waitEcho waits until the stream has echoed n bytes intact.
func waitEcho(s *workload.Stream, n int64) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := s.Stats()
		if st.Err != nil {
			return st.Err
		}
		if st.Verified >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the long connection echoed only %d of %d bytes in 30 s", st.Verified, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitExternalIP waits until the routers published the Service's tunnel IP
// in status.loadBalancer.ingress, and returns the addresses there.
func waitExternalIP(ctx context.Context, l *topology.Lab, svc *corev1.Service) (string, error) {
	want := svc.Annotations[tunnelclaim.Annotation]
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, err := l.Kube.CoreV1().Services(svc.Namespace).Get(ctx, svc.Name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		var ips []string
		for _, in := range got.Status.LoadBalancer.Ingress {
			ips = append(ips, in.IP)
		}
		if slices.Contains(ips, want) {
			return strings.Join(ips, ","), nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("Service %s/%s: status.loadBalancer.ingress is %v after 30 s, want %s", svc.Namespace, svc.Name, ips, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// exampleService reads the Service out of examples/echo.yaml.
func exampleService() (*corev1.Service, error) {
	objs, err := exampleObjects()
	if err != nil {
		return nil, err
	}
	for _, o := range objs {
		if svc, ok := o.(*corev1.Service); ok {
			return svc, nil
		}
	}
	return nil, fmt.Errorf("%s has no Service", ExampleFile)
}

// applyExample creates the example's Deployment (no controller runs it here)
// and its Service; topology.Up created the namespace.
func applyExample(ctx context.Context, l *topology.Lab) error {
	objs, err := exampleObjects()
	if err != nil {
		return err
	}
	for _, o := range objs {
		switch obj := o.(type) {
		case *appsv1.Deployment:
			if _, err := l.Kube.AppsV1().Deployments(obj.Namespace).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("creating Deployment %s/%s: %w", obj.Namespace, obj.Name, err)
			}
			say("created Deployment %s/%s (%d replicas)", obj.Namespace, obj.Name, *obj.Spec.Replicas)
		case *corev1.Service:
			if _, err := l.Kube.CoreV1().Services(obj.Namespace).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("creating Service %s/%s: %w", obj.Namespace, obj.Name, err)
			}
			say("created Service %s/%s, port %d", obj.Namespace, obj.Name, obj.Spec.Ports[0].Port)
		}
	}
	return nil
}

// exampleObjects decodes every document of examples/echo.yaml.
func exampleObjects() ([]k8sruntime.Object, error) {
	raw, err := os.ReadFile(ExampleFile)
	if err != nil {
		return nil, err
	}
	reader := yaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var out []k8sruntime.Object
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", ExampleFile, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", ExampleFile, err)
		}
		out = append(out, obj)
	}
}

// who asks dst who answers, from the client, with a fixed source port (0:
// any).
func who(ctx context.Context, client netns.NsHandle, dst netip.AddrPort, port uint16) (workload.Identity, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return workload.Who(ctx, client, "tcp", dst, port)
}

// podPerFlow connects once from each source port and names the pod that
// answered.
func podPerFlow(ctx context.Context, client netns.NsHandle, dst netip.AddrPort, ports []uint16) (map[uint16]string, error) {
	out := map[uint16]string{}
	for _, p := range ports {
		id, err := who(ctx, client, dst, p)
		if err != nil {
			return nil, err
		}
		out[p] = id.Pod
	}
	return out, nil
}

// show prints a command's output run in a namespace, under a title.
func show(ctx context.Context, title, ns, name string, args ...string) {
	out, err := topology.InNS(ctx, ns, name, args...)
	printOutput(title, out, err, 0)
}

// showFirst prints the first n lines of an ip command's output.
func showFirst(ctx context.Context, title string, n int, args ...string) {
	out, err := topology.IP(ctx, args...)
	printOutput(title, out, err, n)
}

func printOutput(title, out string, err error, n int) {
	say("$ %s", title)
	if err != nil {
		say("  (failed: %v)", err)
		return
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if n > 0 && len(lines) > n {
		lines = append(lines[:n], "...")
	}
	for _, line := range lines {
		say("  %s", strings.TrimSpace(line))
	}
}

func printTable(l *topology.Lab, table []netip.Addr) {
	byPod := map[string][]int{}
	for b, a := range table {
		name := l.PodByAddr(a).Name
		byPod[name] = append(byPod[name], b)
	}
	names := make([]string, 0, len(byPod))
	for n := range byPod {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		say("%-7s %2d buckets: %v", n, len(byPod[n]), byPod[n])
	}
}

// askTheCluster shows kubectl tunnel status and explain (the plugin's code,
// with the lab's admin kubeconfig), then checks explain's answer with the
// next connection.
func askTheCluster(ctx context.Context, l *topology.Lab, client netns.NsHandle, svc *corev1.Service, dst netip.AddrPort) error {
	step("Asking the cluster: kubectl tunnel status, and where one flow goes")
	kubectl := func(args ...string) (string, error) {
		return tunnelctl.Output(ctx, append([]string{"--kubeconfig", filepath.Join(l.Opts.KubeDir, "admin.kubeconfig")}, args...)...)
	}
	// The routers publish their status at most once a second.
	var status string
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		out, err := kubectl("status", "-n", svc.Namespace, "-o", "wide")
		if err != nil {
			return err
		}
		status = out
		if strings.Contains(out, " 2/2 ") || time.Now().After(deadline) {
			break
		}
	}
	printRaw("kubectl tunnel status -n "+svc.Namespace+" -o wide", status, nil)
	const port = 40100
	from := fmt.Sprintf("%v:%d", topology.ClientAddr, port)
	explained, err := kubectl("explain", dst.String(), "--from", from)
	if err != nil {
		return err
	}
	printRaw("kubectl tunnel explain "+dst.String()+" --from "+from, explained, nil)
	var ex tunnelctl.Explanation
	out, err := kubectl("explain", dst.String(), "--from", from, "-o", "json")
	if err != nil {
		return err
	}
	if err := json.Unmarshal([]byte(out), &ex); err != nil {
		return err
	}
	id, err := who(ctx, client, dst, port)
	if err != nil {
		return err
	}
	_, named, _ := strings.Cut(ex.Endpoint.Pod, "/")
	say("the client connects from %s: answered by %s; kubectl tunnel explain said %s", from, id.Pod, named)
	if id.Pod != named {
		return fmt.Errorf("kubectl tunnel explain named %s, %s answered", named, id.Pod)
	}
	return nil
}
