// Package cluster is the user's install path run by real Kubernetes
// components (issue 16): two lab VMs, each a node with Debian's containerd,
// runc and CNI plugins, a real kubelet and kube-proxy, and Flannel (or the
// bridge plugin alone: KST_CLUSTER_CNI), joined by a virtual link, and a
// real kube-apiserver, kube-controller-manager and kube-scheduler on the
// host. make image's images are imported into each node's containerd and
// make manifest's tunnel-router.yaml is applied unchanged; then
// examples/echo.yaml, a client outside the cluster, a router pod's
// deletion, a rolling restart and the uninstall DaemonSet, in gre and mpls
// mode.
//
//	client 198.51.100.10 ── lab-router 172.20.0.11 ═══ lab-worker 172.20.0.21 ── cni0 10.244.2.1 ── echo pods
//	                        node=tunnel, cordoned          (eth1: the nodes' link)
//	                        tunnel-router, tunnel-endpoint tunnel-endpoint
//
// TestCluster runs on the host and boots both VMs. In lab-router the test
// binary runs TestInCluster, which drives the cluster through the API server
// and sends the client's traffic; in lab-worker it runs TestNodeHelper, a
// small HTTP service on the link through which TestInCluster reads the
// worker's kernel state and its pods' sockets.
package cluster

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/support/testimages"
)

// node is one lab VM.
type node struct {
	name string
	// linkAddr is the node's address on eth1, the nodes' link, and its
	// Kubernetes InternalIP.
	linkAddr string
	podCIDR  string
	mac      string
	// role selects the guest test: TestInCluster or TestNodeHelper.
	role string
}

var (
	routerNode = node{name: "lab-router", linkAddr: "172.20.0.11", podCIDR: "10.244.1.0/24", mac: "52:54:00:20:00:11", role: "router"}
	workerNode = node{name: "lab-worker", linkAddr: "172.20.0.21", podCIDR: "10.244.2.0/24", mac: "52:54:00:20:00:21", role: "worker"}
)

// Where the host puts things in the VMs.
const (
	roleEnv = "KST_CLUSTER_ROLE"
	// demoEnv set (to anything) runs make demo-cluster's steps only.
	demoEnv = "KST_CLUSTER_DEMO"
	// cniEnv names the nodes' network plugin (make cluster CNI=...):
	// cniFlannel, cniCalico or cniBridge; unset: clusterPlan's pairing.
	cniEnv     = "KST_CLUSTER_CNI"
	cniFlannel = "flannel"
	cniCalico  = "calico"
	cniBridge  = "bridge"
	// modesEnv tells TestInCluster the tunnel modes to run, in order
	// (comma-separated).
	modesEnv          = "KST_CLUSTER_MODES"
	vmDir             = "/lab/cluster"
	manifestFile      = vmDir + "/tunnel-router.yaml"
	uninstallFile     = vmDir + "/tunnel-uninstall.yaml"
	exampleFile       = vmDir + "/echo.yaml"
	policyFile        = vmDir + "/allow-tunnel-routers.yaml"
	adminKubeconfig   = "/lab/kubelet/kubeconfig"
	clientNS          = "client"
	clientAddr        = "198.51.100.10"
	clientGatewayAddr = "198.51.100.1"
	helperPort        = 9700
	// nodeNS names each node's root network namespace ("ip netns attach"),
	// for kstate's snapshots.
	nodeNS = "node"
	// knpDir holds what kube-network-policies, the NetworkPolicy engine
	// of the worker, needs to run as if in a pod: its ServiceAccount's
	// token and the API server's CA, copied at boot to where client-go's
	// in-cluster configuration reads them.
	knpDir = "/lab/knp"
	// knpLog is the engine's log on the worker.
	knpLog = "/tmp/kube-network-policies.log"
	// knpMetrics is the engine's metrics address on the worker.
	knpMetrics = "127.0.0.1:9080"
	// clusterCIDR holds both nodes' pod ranges (kube-proxy's clusterCIDR).
	clusterCIDR = "10.244.0.0/16"
)

// knpVersion is the kube-network-policies that test/tools/kube-assets.sh
// builds (KNP_VERSION).
const knpVersion = "v0.8.0"

// knpModules are the kernel modules kube-network-policies needs beyond a
// kubelet node's: nftables' conntrack and queue expressions, and nfqueue.
var knpModules = []string{"nft_ct", "nft_queue", "nfnetlink_queue"}

// guestTimeout bounds the VM run: about twice what it takes on the
// slowest machine of CI's kind known (docs/testing.md, "Time budget").
const guestTimeout = 40 * time.Minute

// clusterVMCPUs is each lab cluster VM's number of virtual CPUs. The two
// VMs share the host's two cores: with two virtual CPUs each, four TCG
// threads took turns on two cores, and a virtual CPU descheduled while it
// held a kernel lock left the other spinning (the guests spent more time
// in the kernel than in user space).
const clusterVMCPUs = 1

func TestCluster(t *testing.T) {
	if lab.IsGuest() {
		t.Skip("TestCluster boots the VMs; it does not run inside them")
	}
	if testing.Short() {
		t.Skip("-short: the lab cluster takes minutes")
	}
	assets := lab.Require(t)
	plan, err := clusterPlan()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	version := fmt.Sprintf("lab-%d", time.Now().Unix())
	built := testimages.Build(t, dir, image.DefaultRegistry, version)
	example := filepath.Join(dir, "example-image.tar")
	if err := lab.WriteBusyboxImage(example, lab.ExampleImage, nil); err != nil {
		t.Fatal(err)
	}
	program := filepath.Join(dir, "cluster.test")
	if err := lab.BuildStaticTest("./test/cluster", program); err != nil {
		t.Fatal(err)
	}
	var audit []kubeenv.AuditEvent
	var durations []string
	for _, p := range plan {
		ok := t.Run(p.name(), func(t *testing.T) {
			events, report := runCluster(t, assets, p, built, example, program, version)
			audit = append(audit, events...)
			durations = append(durations, report)
		})
		if !ok {
			break
		}
	}
	if err := os.WriteFile(durationsFile, []byte(strings.Join(durations, "\n")), 0o644); err != nil {
		t.Logf("writing %s: %v", durationsFile, err)
	}
	if !t.Failed() && !demo() {
		checkGrantsUsed(t, audit)
	}
}

// pairing is one lab cluster run: its nodes' network plugin and the tunnel
// modes run on it, one after the other.
type pairing struct {
	cni   string
	modes []string
}

func (p pairing) name() string { return p.cni + "_" + strings.Join(p.modes, "_") }

// clusterPlan is what TestCluster runs: by default (make cluster) gre mode
// on Flannel and mpls mode on Calico, each on a cluster of its own (issue
// 32: each mode under a real plugin; make test runs the first alone, with
// KST_CLUSTER_CNI=flannel KST_CLUSTER_MODES=gre); make cluster CNI=X runs
// both modes on X (or those of $KST_CLUSTER_MODES); make demo-cluster runs
// gre mode on Flannel (or X).
func clusterPlan() ([]pairing, error) {
	cni := os.Getenv(cniEnv)
	if cni != "" && !slices.Contains([]string{cniFlannel, cniCalico, cniBridge}, cni) {
		return nil, fmt.Errorf("%s=%q: want %s, %s or %s", cniEnv, cni, cniFlannel, cniCalico, cniBridge)
	}
	switch {
	case demo():
		if cni == "" {
			cni = cniFlannel
		}
		return []pairing{{cni, []string{"gre"}}}, nil
	case cni != "":
		modes := []string{"gre", "mpls"}
		if m := os.Getenv(modesEnv); m != "" {
			modes = strings.Split(m, ",")
		}
		return []pairing{{cni, modes}}, nil
	}
	return []pairing{{cniFlannel, []string{"gre"}}, {cniCalico, []string{"mpls"}}}, nil
}

// durationsFile is the lab cluster's slowest steps, every pairing's
// (make test shows it after the cluster phase).
var durationsFile = filepath.Join(os.TempDir(), "kst-cluster-lab-router.durations.txt")

// runCluster boots the two nodes with p's plugin against an API server of
// their own, runs TestInCluster there for p's modes, and returns the API
// server's audit of the daemons' requests and the run's duration report.
func runCluster(t *testing.T, assets lab.Assets, p pairing, built map[string]image.Result, example, program, version string) ([]kubeenv.AuditEvent, string) {
	cni := p.cni
	// The daemons' requests are audited: checkGrantsUsed.
	env := kubeenv.StartWithOptions(t, kubeenv.Options{ServiceAccountAdmission: true, AuditServiceAccountsOf: daemonNamespace})
	if err := env.StartControllers(); err != nil {
		if lab.IntegrationRequired() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	dir := t.TempDir()
	var archives []string
	for _, r := range built {
		archives = append(archives, r.Archive)
	}
	vmFiles := map[string]string{
		exampleFile:      filepath.Join(lab.RepoRoot(), "examples", "echo.yaml"),
		policyFile:       filepath.Join(lab.RepoRoot(), "examples", "allow-tunnel-routers.yaml"),
		lab.GuestProgram: program,
	}
	for vmPath, src := range map[string][]byte{manifestFile: repoFile(t, "tunnel-router.yaml"), uninstallFile: image.Uninstall} {
		rendered, err := image.RenderManifest(src, image.DefaultRegistry, version)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.Base(vmPath))
		if err := os.WriteFile(p, rendered, 0o644); err != nil {
			t.Fatal(err)
		}
		vmFiles[vmPath] = p
	}
	var workerFiles map[string]string
	if cni != cniCalico {
		// Calico is its own NetworkPolicy engine.
		var err error
		if workerFiles, err = networkPolicyEngine(t, env, dir); err != nil {
			t.Fatal(err)
		}
	}
	apiPort := env.Port()
	if err := lab.ServeKubernetesService(context.Background(), env.AdminConfig(), apiPort); err != nil {
		t.Fatal(err)
	}
	switch cni {
	case cniFlannel:
		// flannel's kube subnet manager takes each node's subnet from
		// its spec.podCIDR.
		for _, n := range []node{routerNode, workerNode} {
			if err := lab.CreateNode(context.Background(), env.AdminConfig(), n.name, n.podCIDR); err != nil {
				t.Fatal(err)
			}
		}
	case cniCalico:
		crds, err := lab.CalicoCRDs()
		if err != nil {
			t.Fatal(err)
		}
		if err := kubeenv.Apply(context.Background(), env.AdminConfig(), crds, false); err != nil {
			t.Fatalf("applying Calico's CRDs: %v", err)
		}
	}
	linkPorts := freeUDPPorts(t, 2)

	ctx, cancel := context.WithTimeout(context.Background(), guestTimeout)
	defer cancel()
	// The worker's helper runs until the router's test is over; its VM is
	// stopped a little after the router's VM ends.
	workerCtx, stopWorker := context.WithCancel(ctx)
	defer stopWorker()
	type result struct {
		out string
		rc  int
		err error
	}
	results := make([]result, 2)
	var wg sync.WaitGroup
	for i, n := range []node{routerNode, workerNode} {
		nodeDir := filepath.Join(dir, n.name)
		if err := os.Mkdir(nodeDir, 0o755); err != nil {
			t.Fatal(err)
		}
		images, late := archives, []string(nil)
		if n.role == "worker" {
			// lab-router is cordoned: the example runs on lab-worker only.
			// No router runs there; the uninstall's router-cleanup does,
			// minutes later.
			images = []string{built[image.Endpoint.Name].Archive, example}
			late = []string{built[image.Router.Name].Archive}
		}
		kubelet := lab.KubeletOptions{NodeName: n.name, NodeIP: n.linkAddr,
			PodCIDR: n.podCIDR, Admin: env.AdminConfig(), Images: images, LateImages: late}
		hostBinaries := slices.Concat(lab.KubeletHostBinaries, lab.KubeProxyHostBinaries)
		modules := append(slices.Clone(lab.KubeletModules), lab.KubeProxyModules...)
		switch cni {
		case cniFlannel:
			kubelet.CNIConfig = lab.FlannelCNIConfig
			hostBinaries = append(hostBinaries, lab.FlannelHostBinaries...)
			modules = append(modules, lab.FlannelModules...)
		case cniCalico:
			kubelet.CNIConfig = lab.CalicoCNIConfig
			hostBinaries = append(hostBinaries, lab.CalicoHostBinaries...)
			modules = append(modules, lab.CalicoModules...)
		}
		files, err := lab.KubeletFiles(nodeDir, kubelet)
		if err != nil {
			t.Fatal(err)
		}
		var plugin map[string]string
		switch cni {
		case cniFlannel:
			plugin, err = lab.FlannelFiles(nodeDir, clusterCIDR)
		case cniCalico:
			plugin, err = lab.CalicoFiles()
		}
		if err != nil {
			t.Fatal(err)
		}
		maps.Copy(files, plugin)
		maps.Copy(files, vmFiles)
		proxyFiles, err := lab.KubeProxyFiles(nodeDir, n.name, clusterCIDR)
		if err != nil {
			t.Fatal(err)
		}
		maps.Copy(files, proxyFiles)
		if n.role == "worker" && workerFiles != nil {
			maps.Copy(files, workerFiles)
			modules = append(modules, knpModules...)
		}
		ir, err := lab.BuildInitramfs(lab.InitramfsOptions{Assets: assets, Output: filepath.Join(nodeDir, "initrd.cpio"),
			Script: nodeScript(n, apiPort, p), Files: files, Modules: modules, HostBinaries: hostBinaries})
		if err != nil {
			t.Fatal(err)
		}
		local, remote := linkPorts[i], linkPorts[1-i]
		console, err := os.Create(consoleFile(cni, n))
		if err != nil {
			t.Fatal(err)
		}
		var output io.Writer = console
		if n.role == "router" {
			watch := lab.WatchBound(t, console, guestTimeout)
			defer watch.Stop()
			timed, err := os.Create(lab.TimedFile(console.Name()))
			if err != nil {
				t.Fatal(err)
			}
			defer timed.Close()
			watch.TimeLinesTo(timed)
			output = watch
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer console.Close()
			bootCtx := ctx
			if n.role == "worker" {
				bootCtx = workerCtx
			}
			out, rc, err := lab.Boot(bootCtx, ir, lab.BootOptions{Kernel: assets.Kernel, MemoryMB: 3072, CPUs: clusterVMCPUs,
				ForwardHostPorts: []int{apiPort}, Output: output, ExtraArgs: linkArgs(n, local, remote)})
			results[i] = result{out, rc, err}
			if n.role == "router" {
				time.AfterFunc(30*time.Second, stopWorker)
			}
		}()
	}
	start := time.Now()
	wg.Wait()
	took := time.Since(start)
	t.Logf("the VMs ran for %v; consoles: %s, %s", took.Round(time.Second), consoleFile(cni, routerNode), consoleFile(cni, workerNode))
	lab.ReportGuestTests(t, results[0].out, results[0].rc, results[0].err)
	report := lab.DurationReport("./test/cluster "+p.name(), results[0].out, took, 10)
	t.Log("\n" + report)
	if t.Failed() {
		t.Logf("lab-worker's console tail:\n%s", lab.LastLines(results[1].out, 60))
		t.Logf("controller-manager and scheduler logs: %v", env.ControllerLogs())
	}
	events, err := kubeenv.ReadAuditLog(env.AuditLog())
	if err != nil {
		t.Error(err)
	}
	return events, report
}

// consoleFile is where a node's console goes while it runs plugin cni.
func consoleFile(cni string, n node) string {
	return filepath.Join(os.TempDir(), "kst-cluster-"+cni+"-"+n.name+".log")
}

// networkPolicyEngine returns the worker's files for kube-network-policies
// (SIG Network's NetworkPolicy engine: nftables in the node's namespace,
// the first packets of each connection to a pod that a policy selects
// judged in user space through nfqueue): its binary from the assets, and
// a token of its ServiceAccount kube-system/kube-network-policies, bound
// to the RBAC of its own install.yaml.
func networkPolicyEngine(t *testing.T, env *kubeenv.Env, dir string) (map[string]string, error) {
	t.Helper()
	ctx := context.Background()
	bin := filepath.Join(kubeenv.AssetsDir(), "kube-network-policies-"+knpVersion)
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("no kube-network-policies %s in the assets (make assets): %w", knpVersion, err)
	}
	admin, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		return nil, err
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "kube-network-policies"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods", "namespaces"}, Verbs: []string{"list", "watch"}},
		{APIGroups: []string{"networking.k8s.io"}, Resources: []string{"networkpolicies"}, Verbs: []string{"list", "watch"}},
	}}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "kube-network-policies"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: "kube-system", Name: "kube-network-policies"}}}
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	sa, err := env.ServiceAccountConfig(ctx, "kube-system", "kube-network-policies")
	if err != nil {
		return nil, err
	}
	files := map[string]string{knpDir + "/kube-network-policies": bin}
	for name, data := range map[string][]byte{"token": []byte(sa.BearerToken), "ca.crt": sa.TLSClientConfig.CAData} {
		p := filepath.Join(dir, "knp-"+name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			return nil, err
		}
		files[knpDir+"/"+name] = p
	}
	return files, nil
}

// nodeScript is a node's /lab/run.sh: the nodes' link, routes to the other
// node's pods and the client's network, the kubelet node
// (lab.KubeletScript), then the node's guest test.
func nodeScript(n node, apiPort int, p pairing) string {
	cni := p.cni
	other := workerNode
	if n.role == "worker" {
		other = routerNode
	}
	var b strings.Builder
	// The link first: the kubelet's --node-ip must be there when it starts.
	fmt.Fprintf(&b, `/sbin/ip link set eth1 up && /sbin/ip addr add %s/24 dev eth1 || echo "FAIL eth1"
echo 1 > /proc/sys/net/ipv4/ip_forward
/sbin/ip netns attach %s 1
`, n.linkAddr, nodeNS)
	if cni == cniBridge {
		// The other node's pods; flannel routes them through its VXLAN
		// device itself.
		fmt.Fprintf(&b, "/sbin/ip route add %s via %s\n", other.podCIDR, other.linkAddr)
	}
	if n.role == "router" {
		// The client: outside the cluster, routed through lab-router (the
		// datacenter's router and the tunnel node in one).
		fmt.Fprintf(&b, `/sbin/ip netns add %[1]s
/sbin/ip link add lab-client type veth peer name eth0 netns %[1]s
/sbin/ip addr add %[2]s/24 dev lab-client && /sbin/ip link set lab-client up
/sbin/ip -n %[1]s addr add %[3]s/24 dev eth0 && /sbin/ip -n %[1]s link set eth0 up && /sbin/ip -n %[1]s link set lo up
/sbin/ip -n %[1]s route add default via %[2]s
`, clientNS, clientGatewayAddr, clientAddr)
	} else if cni == cniCalico {
		// A default route through lab-router (the datacenter's router in
		// this lab, which has none itself): Calico's pods reach their
		// gateway, 169.254.1.1, by the node's proxy ARP, which answers
		// only for an address the node routes elsewhere.
		fmt.Fprintf(&b, "/sbin/ip route add default via %s\n", other.linkAddr)
	} else {
		fmt.Fprintf(&b, "/sbin/ip route add 198.51.100.0/24 via %s\n", other.linkAddr)
	}
	b.WriteString(lab.KubeletScript + lab.KubernetesServiceDNAT(apiPort))
	switch cni {
	case cniFlannel:
		b.WriteString(lab.FlannelScript("eth1"))
	case cniCalico:
		b.WriteString(lab.CalicoScript("eth1", clusterCIDR))
	}
	// kube-proxy as its DaemonSet would run it, in the first mode's
	// pairing (kubeProxyMode); TestInCluster switches it.
	fmt.Fprintf(&b, "%s %s || echo \"FAIL kube-proxy\"\n", lab.KubeProxyStart, kubeProxyMode[p.modes[0]])
	if n.role == "worker" && cni != cniCalico {
		// kube-network-policies, as its DaemonSet would run it: in-cluster
		// configuration through the kubernetes Service, no NRI.
		fmt.Fprintf(&b, `mkdir -p /var/run/secrets/kubernetes.io/serviceaccount && cp %[1]s/token %[1]s/ca.crt /var/run/secrets/kubernetes.io/serviceaccount/
KUBERNETES_SERVICE_HOST=10.96.0.1 KUBERNETES_SERVICE_PORT=443 %[1]s/kube-network-policies --hostname-override=%[2]s --disable-nri --metrics-bind-address=%[3]s --v=2 >%[4]s 2>&1 &
`, knpDir, n.name, knpMetrics, knpLog)
	}
	// One P: on two emulated cores, Go's idle Ms spinning for work cost
	// the test program more CPU than its own work.
	fmt.Fprintf(&b, "cd /tmp && GOMAXPROCS=1 %s=1 %s=%s %s=%q %s=%s %s=%s %s -test.run '^(TestInCluster|TestNodeHelper)$' -test.v -test.count=1 -test.timeout %s\n",
		lab.EnvGuest, roleEnv, n.role, demoEnv, os.Getenv(demoEnv), cniEnv, cni, modesEnv, strings.Join(p.modes, ","), lab.GuestProgram, guestTimeout)
	return b.String()
}

// linkArgs give a VM eth1, a NIC whose frames qemu carries over UDP on the
// host's loopback to the other VM's eth1.
func linkArgs(n node, localPort, remotePort int) []string {
	return []string{
		"-netdev", fmt.Sprintf("dgram,id=n1,local.type=inet,local.host=127.0.0.1,local.port=%d,remote.type=inet,remote.host=127.0.0.1,remote.port=%d", localPort, remotePort),
		"-device", "virtio-net-pci,netdev=n1,mac=" + n.mac + ",romfile=",
	}
}

// freeUDPPorts returns n UDP ports on the loopback that were free a moment
// ago.
func freeUDPPorts(t *testing.T, n int) []int {
	var ports []int
	var conns []net.PacketConn
	for range n {
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		ports = append(ports, c.LocalAddr().(*net.UDPAddr).Port)
	}
	for _, c := range conns {
		c.Close()
	}
	return ports
}

func repoFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(lab.RepoRoot(), name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// usedOutsideTheLab are the router's grants that a code path uses but the
// lab cluster's run does not reach, each with the reason.
var usedOutsideTheLab = map[string]string{
	"patch events": "client-go's event recorder patches an event that repeats within its window (the count); the router de-duplicates its own events, so the lab's run repeats none",
}

// checkGrantsUsed reads the API server's audit log of the daemons'
// ServiceAccounts after the whole run (both modes, install to uninstall):
// every verb of every rule the manifest grants them was used by a
// successful request, and none of their requests was forbidden. A grant
// that nothing uses fails the test: it is power an attacker gets for free.
func checkGrantsUsed(t *testing.T, events []kubeenv.AuditEvent) {
	t.Helper()
	grants, err := kubeenv.ManifestGrants(repoFile(t, "tunnel-router.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	users := map[string]bool{}
	for _, g := range grants {
		users[g.User] = true
	}
	for _, ev := range kubeenv.Forbidden(events, slices.Collect(maps.Keys(users))...) {
		t.Errorf("forbidden: %s %s by %s", ev.Verb, ev.RequestURI, ev.User.Username)
	}
	unused := kubeenv.UnusedGrants(grants, events)
	for _, g := range unused {
		if why, ok := usedOutsideTheLab[g.Verb+" "+g.Resource]; ok && strings.HasSuffix(g.User, ":tunnel-router") {
			t.Logf("granted, not used in the lab cluster, kept: %v: %s", g, why)
			continue
		}
		t.Errorf("granted but never used in the lab cluster: %v", g)
	}
	t.Logf("grants: %d of %d (verb, API group, resource) the manifest grants used by the daemons' %d audited requests", len(grants)-len(unused), len(grants), len(events))
}

// clusterCNI is, in the VMs, the nodes' network plugin.
func clusterCNI() string { return os.Getenv(cniEnv) }

// clusterModes is, in the VMs, the tunnel modes TestInCluster runs.
func clusterModes() []string { return strings.Split(os.Getenv(modesEnv), ",") }
