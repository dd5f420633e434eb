package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// countingPods wraps the real PodNetwork and counts, per pod, the syncs and
// the kernel changes they made.
type countingPods struct {
	inner   endpoint.PodSyncer
	mu      sync.Mutex
	syncs   map[string]int
	changes map[string]int
}

func (c *countingPods) Sync(ns netns.NsHandle, want endpoint.PodTunnels) ([]endpoint.PodChange, error) {
	acts, err := c.inner.Sync(ns, want)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.syncs[want.Pod.String()]++
	c.changes[want.Pod.String()] += len(acts)
	return acts, err
}

func (c *countingPods) counts(pod string) (syncs, changes int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.syncs[pod], c.changes[pod]
}

// syncBuffer is a log sink safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type agent struct {
	pods *countingPods
	log  *syncBuffer
	ctrl *endpoint.Controller
	stop func()
}

// startAgent runs the endpoint agent's controller as the tunnel-endpoint
// ServiceAccount, with the runtime-free search by pod IP, the real pod and
// node kernel code (a VXLAN device stands in for GRE: this host has none),
// and node as the node's namespace.
func startAgent(t *testing.T, nodeName string, node *testnetns.NS) *agent {
	t.Helper()
	return startAgentWithPolicy(t, nodeName, node, testPolicy)
}

// startAgentWithPolicy is startAgent with the given address pools.
func startAgentWithPolicy(t *testing.T, nodeName string, node *testnetns.NS, policy tunnelclaim.Policy) *agent {
	t.Helper()
	restCfg := serviceAccountConfig(t, "tunnel-endpoint")
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	// Network policy on, as the agent defaults to: its informers run
	// under the manifest's RBAC, and pods' filter tables are real.
	cfg := endpoint.Config{Mode: encap.GRE, NodeName: nodeName, Device: endpoint.DefaultDevice,
		RouteProtocol: encap.DefaultRouteProtocol, ResyncPeriod: time.Minute, Workers: 2, Policy: policy, NetworkPolicy: true}
	podNet := endpoint.NewPodNetwork(cfg, node.Handle).WithDevice(testnetns.VXLANDecap{}).
		WithPolicyTables(endpoint.NamespaceIPTables{Binary: "iptables"})
	a := &agent{
		pods: &countingPods{inner: podNet,
			syncs: map[string]int{}, changes: map[string]int{}},
		log: &syncBuffer{},
	}
	log := logrus.New()
	log.Out = a.log
	inf := endpoint.NewInformers(client, nodeName)
	ctrl, err := endpoint.NewController(cfg, inf, runtime.NewByIP(), a.pods, endpoint.NewNodeNetwork(cfg, node.Handle), log)
	if err != nil {
		t.Fatal(err)
	}
	a.ctrl = ctrl
	ctx, cancel := context.WithCancel(context.Background())
	inf.Start(ctx.Done())
	done := make(chan error, 1)
	go func() { done <- ctrl.Run(ctx) }()
	var once sync.Once
	a.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("endpoint controller: %v", err)
			}
			inf.Shutdown()
		})
	}
	t.Cleanup(a.stop)
	eventually(t, 20*time.Second, "endpoint agent ready (informers synced as the tunnel-endpoint ServiceAccount)", func() error {
		if !ctrl.Ready() {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	return a
}

// podNetns is a pod's network namespace as a CNI plugin leaves it: named
// (bind-mounted under /run/netns, where the search by pod IP finds it), the
// pod IP on eth1, a veth to the node namespace, which routes the pod IP.
type podNetns struct {
	name   string
	handle netns.NsHandle
}

func newPodNetns(t *testing.T, node *testnetns.NS, ip netip.Addr, hostVeth string) *podNetns {
	t.Helper()
	name := fmt.Sprintf("kst-it-%d", time.Now().UnixNano()%1e9)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	p := &podNetns{name: name}
	t.Cleanup(p.remove)
	h, err := netns.GetFromName(name)
	if err != nil {
		t.Fatal(err)
	}
	p.handle = h
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth1"}, PeerName: hostVeth}); err != nil {
		t.Fatal(err)
	}
	peer, err := nl.LinkByName(hostVeth)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetNsFd(peer, int(node.Handle)); err != nil {
		t.Fatal(err)
	}
	p.run(t, "ip", "link", "set", "eth1", "up")
	p.run(t, "ip", "link", "set", "lo", "up")
	p.run(t, "ip", "addr", "add", ip.String()+"/32", "dev", "eth1")
	node.Run("ip", "link", "set", hostVeth, "up")
	node.Run("ip", "route", "replace", ip.String()+"/32", "dev", hostVeth)
	return p
}

func (p *podNetns) run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"-n", p.name}, args[1:]...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip -n %s %s: %v: %s", p.name, strings.Join(args[1:], " "), err, out)
	}
	return string(out)
}

func (p *podNetns) remove() {
	if p.handle.IsOpen() {
		p.handle.Close()
	}
	_ = exec.Command("ip", "netns", "del", p.name).Run()
}

// tunnelIPs lists the addresses on the agent's device in the pod ("" when
// the device does not exist).
func (p *podNetns) tunnelIPs(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("ip", "-n", p.name, "-4", "-o", "addr", "show", "dev", endpoint.DefaultDevice).CombinedOutput()
	if err != nil {
		return ""
	}
	var ips []string
	for _, f := range strings.Fields(string(out)) {
		if strings.HasSuffix(f, "/32") {
			ips = append(ips, strings.TrimSuffix(f, "/32"))
		}
	}
	slices.Sort(ips)
	return strings.Join(ips, ",")
}

func waitTunnelIPs(t *testing.T, p *podNetns, want, why string) {
	t.Helper()
	eventually(t, 20*time.Second, why, func() error {
		if got := p.tunnelIPs(t); got != want {
			return fmt.Errorf("tunnel IPs in pod %q, want %q", got, want)
		}
		return nil
	})
}

// createPod creates a running pod on node with podIP, as kubelet reports it.
func createPod(t *testing.T, cs kubernetes.Interface, ns, name, node string, ip netip.Addr) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	pod, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name}},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "lab/echo:1"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip.String(), PodIPs: []corev1.PodIP{{IP: ip.String()}}}
	pod, err = cs.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// applyPodSlice writes the EndpointSlice of a Service whose endpoints are pods.
func applyPodSlice(t *testing.T, cs kubernetes.Interface, svc string, pods ...*corev1.Pod) {
	t.Helper()
	var eps []ep
	for _, p := range pods {
		eps = append(eps, ep{addr: p.Status.PodIP, node: p.Spec.NodeName, pod: p})
	}
	applySlice(t, cs, pods[0].Namespace, svc, svc+"-1", eps...)
}

func setAnnotation(t *testing.T, cs kubernetes.Interface, ns, svc string, value *string) {
	t.Helper()
	v := "null"
	if value != nil {
		v = fmt.Sprintf("%q", *value)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, tunnelclaim.Annotation, v)
	if _, err := cs.CoreV1().Services(ns).Patch(context.Background(), svc, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// restartAdopts stops agent a, starts another on node and checks that it
// synced pod (namespace/name) without a single change; it returns the new
// agent.
func restartAdopts(t *testing.T, a *agent, nodeName string, node *testnetns.NS, pod string) *agent {
	t.Helper()
	a.stop()
	b := startAgent(t, nodeName, node)
	eventually(t, 20*time.Second, "restarted agent checked the pod", func() error {
		if syncs, _ := b.pods.counts(pod); syncs == 0 {
			return fmt.Errorf("not synced yet")
		}
		return nil
	})
	if _, changes := b.pods.counts(pod); changes != 0 {
		t.Fatalf("restarted agent made %d changes to pod %s, which was already right; log:\n%s", changes, pod, b.log.String())
	}
	return b
}

// TestEndpointAgentLifecycle follows one pod through the life of its tunnel
// Services, with the agent authenticated as its ServiceAccount, finding the
// pod's namespace by its IP, and changing real namespaces.
func TestEndpointAgentLifecycle(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	ns := freshNamespace(t, cs)
	node := testnetns.New(t)
	nodeName := "node-" + ns
	ip := netip.MustParseAddr("198.18.30.11")
	podNS := newPodNetns(t, node, ip, "veth-web")
	pod := createPod(t, cs, ns, "web-1", nodeName, ip)
	// A pod of another node: never entered, even though it backs the Service.
	other := createPod(t, cs, ns, "web-2", "elsewhere", netip.MustParseAddr("198.18.30.12"))

	a := startAgent(t, nodeName, node)

	createService(t, cs, ns, "web", "192.0.2.31")
	applyPodSlice(t, cs, "web", pod, other)
	waitTunnelIPs(t, podNS, "192.0.2.31", "tunnel IP added in the pod")

	createService(t, cs, ns, "web-alt", "192.0.2.32")
	applyPodSlice(t, cs, "web-alt", pod)
	waitTunnelIPs(t, podNS, "192.0.2.31,192.0.2.32", "second tunnel IP added on its own")

	setAnnotation(t, cs, ns, "web", nil)
	waitTunnelIPs(t, podNS, "192.0.2.32", "annotation removed: its tunnel IP goes, the other stays")
	if v := node.Run("sysctl", "-n", "net.ipv4.ip_forward"); strings.TrimSpace(v) != "1" {
		t.Errorf("node ip_forward = %q, want 1", v)
	}

	// A restarted agent adopts the pod's state without a single change.
	b := restartAdopts(t, a, nodeName, node, ns+"/web-1")
	waitTunnelIPs(t, podNS, "192.0.2.32", "state kept across the restart")

	// The pod's sandbox restarts: a new namespace with the same IP.
	podNS.remove()
	podNS2 := newPodNetns(t, node, ip, "veth-web2")
	pod, err := cs.CoreV1().Pods(ns).Get(context.Background(), "web-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status.Conditions = append(pod.Status.Conditions, corev1.PodCondition{Type: "PodReadyToStartContainers", Status: corev1.ConditionTrue})
	if _, err := cs.CoreV1().Pods(ns).UpdateStatus(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTunnelIPs(t, podNS2, "192.0.2.32", "new sandbox configured again")

	if err := cs.CoreV1().Services(ns).Delete(context.Background(), "web-alt", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTunnelIPs(t, podNS2, "", "last tunnel Service deleted: device removed from the pod")
	if out := podNS2.run(t, "ip", "-4", "-o", "addr", "show", "dev", "eth1"); !strings.Contains(out, ip.String()) {
		t.Fatalf("pod interface lost its address: %s", out)
	}

	// A pod that no longer exists needs nothing and causes no error.
	if err := cs.CoreV1().Pods(ns).Delete(context.Background(), "web-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	podNS2.remove()
	time.Sleep(time.Second)
	for line := range strings.Lines(b.log.String()) {
		if strings.Contains(line, "web-1") && strings.Contains(line, "level=warning") {
			t.Fatalf("deleted pod caused a warning:\n%s", b.log.String())
		}
	}
}

// TestEndpointAgentMissingNamespaceHoldsUpNothing: a pod whose namespace
// cannot be found is retried with back-off and logged by name, while another
// pod is configured; once its namespace appears, it is configured too.
func TestEndpointAgentMissingNamespaceHoldsUpNothing(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	ns := freshNamespace(t, cs)
	node := testnetns.New(t)
	nodeName := "node-" + ns
	ipLate, ipOK := netip.MustParseAddr("198.18.31.11"), netip.MustParseAddr("198.18.31.12")
	late := createPod(t, cs, ns, "late", nodeName, ipLate)
	ok := createPod(t, cs, ns, "ok", nodeName, ipOK)
	okNS := newPodNetns(t, node, ipOK, "veth-ok")
	a := startAgent(t, nodeName, node)
	createService(t, cs, ns, "svc", "192.0.2.41")
	applyPodSlice(t, cs, "svc", late, ok)
	waitTunnelIPs(t, okNS, "192.0.2.41", "the pod whose namespace exists is configured")
	eventually(t, 10*time.Second, "a log line naming the pod without a namespace", func() error {
		if log := a.log.String(); !strings.Contains(log, ns+"/late") || !strings.Contains(log, "finding its network namespace") {
			return fmt.Errorf("not logged yet:\n%s", log)
		}
		return nil
	})
	lateNS := newPodNetns(t, node, ipLate, "veth-late")
	waitTunnelIPs(t, lateNS, "192.0.2.41", "configured once its namespace appears (retry with back-off)")
}

// TestEndpointAgentNetworkPolicy: the agent, as its ServiceAccount, writes
// a served pod's ingress NetworkPolicies into the pod's filter table (an
// ipBlock, and a pod peer of another namespace by its IP), adopts them
// after a restart without a write, and removes them when the policies go,
// keeping the tunnel IP.
func TestEndpointAgentNetworkPolicy(t *testing.T) {
	testnetns.RequireRoot(t)
	if _, err := exec.LookPath("iptables-save"); err != nil {
		t.Skip("no iptables-save")
	}
	cs := adminClient(t)
	ns := freshNamespace(t, cs)
	clients := freshNamespace(t, cs)
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, clients, types.MergePatchType, []byte(`{"metadata":{"labels":{"role":"clients"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	node := testnetns.New(t)
	nodeName := "node-" + ns
	ip := netip.MustParseAddr("198.18.31.11")
	podNS := newPodNetns(t, node, ip, "veth-np")
	pod := createPod(t, cs, ns, "web-1", nodeName, ip)
	createPod(t, cs, clients, "client", "elsewhere", netip.MustParseAddr("198.18.31.99"))
	a := startAgent(t, nodeName, node)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent log:\n%s", a.log.String())
		}
	})
	createService(t, cs, ns, "web", "192.0.2.157")
	applyPodSlice(t, cs, "web", pod)
	waitTunnelIPs(t, podNS, "192.0.2.157", "tunnel IP added in the pod")
	filter := func() string {
		out, err := exec.Command("ip", "netns", "exec", podNS.name, "iptables-save", "-t", "filter").CombinedOutput()
		if err != nil {
			t.Fatalf("iptables-save in the pod: %v: %s", err, out)
		}
		return string(out)
	}
	// Not isolated: the connection tracking rule alone, no jump to it.
	trackingOnly := func() error {
		got := filter()
		if strings.Contains(got, "-j KST-POLICY") || strings.Count(got, "-A KST-POLICY") != 1 ||
			!strings.Contains(got, "-m conntrack --ctstate RELATED,ESTABLISHED") {
			return fmt.Errorf("want the connection tracking rule alone:\n%s", got)
		}
		return nil
	}
	eventually(t, 20*time.Second, "the tracking rule in a pod that no policy isolates", trackingOnly)

	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(80)
	policies := cs.NetworkingV1().NetworkPolicies(ns)
	for _, np := range []*networkingv1.NetworkPolicy{
		{ObjectMeta: metav1.ObjectMeta{Name: "office"}, Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web-1"}},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/24", Except: []string{"203.0.113.128/25"}}}},
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
			}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "clients"}, Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
				NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"role": "clients"}},
			}}}}}},
	} {
		if _, err := policies.Create(ctx, np, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{
		"-A INPUT -d 192.0.2.157/32 -m comment --comment kube-service-tunnel -j KST-POLICY",
		"-A KST-POLICY -s 203.0.113.0/24 -m comment --comment kube-service-tunnel -j KST-POLICY-0",
		"-A KST-POLICY-0 -s 203.0.113.128/25 -m comment --comment kube-service-tunnel -j RETURN",
		"-A KST-POLICY-0 -p tcp -m tcp --dport 80 -m comment --comment kube-service-tunnel -j ACCEPT",
		"-A KST-POLICY -s 198.18.31.99/32 -m comment --comment kube-service-tunnel -j ACCEPT",
		"-A KST-POLICY -d 192.0.2.157/32 -m comment --comment kube-service-tunnel -j DROP",
	}
	eventually(t, 20*time.Second, "the pod's policies in its filter table", func() error {
		got := filter()
		for _, w := range want {
			if !strings.Contains(got, w) {
				return fmt.Errorf("lacks %q:\n%s", w, got)
			}
		}
		return nil
	})

	// A restarted agent adopts the rules without a write.
	restartAdopts(t, a, nodeName, node, ns+"/web-1")

	// The client's namespace loses its label: the pod peer goes.
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, clients, types.MergePatchType, []byte(`{"metadata":{"labels":{"role":null}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the client pod no longer admitted", func() error {
		if got := filter(); strings.Contains(got, "198.18.31.99") || !strings.Contains(got, want[0]) {
			return fmt.Errorf("filter table:\n%s", got)
		}
		return nil
	})

	for _, name := range []string{"office", "clients"} {
		if err := policies.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 20*time.Second, "the policies' rules removed with the policies", trackingOnly)
	waitTunnelIPs(t, podNS, "192.0.2.157", "the tunnel IP stays")

	// No longer served: nothing of the agent's is left.
	if err := cs.CoreV1().Services(ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTunnelIPs(t, podNS, "", "the Service deleted")
	eventually(t, 20*time.Second, "every rule removed with the last tunnel IP", func() error {
		if got := filter(); strings.Contains(got, "KST-POLICY") {
			return fmt.Errorf("filter table:\n%s", got)
		}
		return nil
	})
}

// TestEndpointAgentServesOnlyTheServicesNamespace: a Service's hand-written
// EndpointSlice names a pod of another namespace on this node, by targetRef
// and, in a second slice, by its address alone (the CVE-2021-25740 class:
// a selector-less Service reaching into kube-system). The agent, as its
// ServiceAccount against the real API server, never adds the tunnel IP to
// that pod's real namespace and logs the slice; the Service's own pod is
// served.
func TestEndpointAgentServesOnlyTheServicesNamespace(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	ns, victimNS := freshNamespace(t, cs), freshNamespace(t, cs)
	node := testnetns.New(t)
	nodeName := "node-" + ns
	ownIP, victimIP := netip.MustParseAddr("198.18.32.11"), netip.MustParseAddr("198.18.32.12")
	ownNS := newPodNetns(t, node, ownIP, "veth-own")
	victimNetns := newPodNetns(t, node, victimIP, "veth-victim")
	own := createPod(t, cs, ns, "own", nodeName, ownIP)
	victim := createPod(t, cs, victimNS, "coredns", nodeName, victimIP)
	a := startAgent(t, nodeName, node)
	createService(t, cs, ns, "grab", "192.0.2.47")
	applySlice(t, cs, ns, "grab", "grab-1", ep{addr: ownIP.String(), node: nodeName, pod: own}, ep{addr: victimIP.String(), node: nodeName, pod: victim})
	applySlice(t, cs, ns, "grab", "grab-2", ep{addr: victimIP.String(), node: nodeName})
	waitTunnelIPs(t, ownNS, "192.0.2.47", "the Service's own pod is served")
	// Both pods are in the same slice: by now a pod the agent wanted
	// would be configured too.
	time.Sleep(time.Second)
	if got := victimNetns.run(t, "ip", "-o", "addr"); victimNetns.tunnelIPs(t) != "" || strings.Contains(got, "192.0.2.47") {
		t.Fatalf("the other namespace's pod holds the tunnel IP:\n%s", got)
	}
	for _, slice := range []string{"grab-1: endpoints[1]", "grab-2: endpoints[0]"} {
		eventually(t, 10*time.Second, "a log line naming "+slice, func() error {
			if log := a.log.String(); !strings.Contains(log, "EndpointSlice "+ns+"/"+slice+" ("+victimIP.String()+") is pod "+victimNS+"/coredns of another namespace") {
				return fmt.Errorf("not logged yet:\n%s", log)
			}
			return nil
		})
	}
	if syncs, changes := a.pods.counts(victimNS + "/coredns"); changes != 0 {
		t.Fatalf("the agent changed the other namespace's pod %d times (%d syncs)", changes, syncs)
	}
}
