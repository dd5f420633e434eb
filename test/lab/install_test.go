package lab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/support/testimages"
)

// TestLabInstall is the user's install path on a real node run by a real
// kubelet: both images (make image) imported into the node's containerd,
// make manifest's tunnel-router.yaml applied unchanged, the node labelled
// node=tunnel. A real kube-controller-manager and kube-scheduler beside the
// API server create and place the DaemonSets' pods, with ServiceAccount
// tokens; the kubelet runs them with the manifest's capabilities, mounts and
// probes until both are Ready. The router runs only once the node is
// labelled, and writes its rules with the backend of kubelet's chains.
func TestLabInstall(t *testing.T) {
	assets := Require(t)
	env := kubeenv.StartWithOptions(t, kubeenv.Options{ServiceAccountAdmission: true})
	if err := env.StartControllers(); err != nil {
		if IntegrationRequired() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	dir := t.TempDir()
	version := fmt.Sprintf("lab-%d", time.Now().Unix())
	var archives []string
	for _, r := range testimages.Build(t, dir, image.DefaultRegistry, version) {
		archives = append(archives, r.Archive)
	}
	const node = "lab-node"
	files, err := KubeletFiles(dir, KubeletOptions{NodeName: node, NodeIP: strings.Split(GuestAddr, "/")[0],
		PodCIDR: "10.244.1.0/24", Admin: env.AdminConfig(), Images: archives})
	if err != nil {
		t.Fatal(err)
	}
	var apiPort int
	fmt.Sscan(env.Host()[strings.LastIndex(env.Host(), ":")+1:], &apiPort)
	script := KubeletScript + KubernetesServiceDNAT(apiPort) + `
(while sleep 30; do for f in /var/log/pods/*/*/*.log; do echo "== $f"; tail -n 3 "$f"; done; done) &
i=0
until wget -q -O - http://127.0.0.1:9641/readyz >/dev/null 2>&1 && wget -q -O - http://127.0.0.1:9642/readyz >/dev/null 2>&1; do
	sleep 3; i=$((i+3)); [ $i -gt 300 ] && break
done
echo "T daemons-ready $(up)"
sleep 10
echo "==== router's backend: $(grep -h 'iptables backend chosen' /var/log/pods/kube-service-tunnel_tunnel-router-*/*/*.log)"
echo "==== kubelet errors"; grep '^E' /tmp/kubelet.log | tail -n 20
`
	ir, err := BuildInitramfs(InitramfsOptions{Assets: assets, Output: filepath.Join(dir, "initrd.gz"), Script: script, Files: files,
		Modules: KubeletModules, HostBinaries: KubeletHostBinaries})
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := image.RenderManifest(readRepoFile(t, "tunnel-router.yaml"), image.DefaultRegistry, version)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	consolePath := filepath.Join(dir, "console.log")
	consoleFile, err := os.Create(consolePath)
	if err != nil {
		t.Fatal(err)
	}
	type boot struct {
		out string
		err error
	}
	booted := make(chan boot, 1)
	go func() {
		defer consoleFile.Close()
		out, _, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel, MemoryMB: 3072, CPUs: 2, ForwardHostPorts: []int{apiPort}, Output: consoleFile})
		booted <- boot{out, err}
	}()
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(consolePath)
			t.Logf("console so far:\n%s", lastLines(string(b), 80))
			dumpCluster(t, cs)
		}
	}()
	waitFor := func(what string, limit time.Duration, cond func() bool) time.Duration {
		t.Helper()
		start := time.Now()
		for !cond() {
			select {
			case b := <-booted:
				booted <- b
				t.Fatalf("the VM ended (%v) before %s", b.err, what)
			case <-time.After(time.Second):
			}
			if time.Since(start) > limit {
				t.Fatalf("no %s after %v", what, limit)
			}
		}
		return time.Since(start)
	}
	t.Logf("qemu start to Node Ready: %v", waitFor("Node Ready", 3*time.Minute, func() bool {
		n, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err == nil && nodeReady(n.Status.Conditions)
	}).Round(100*time.Millisecond))

	applied := time.Now()
	if err := env.ApplyYAML(ctx, env.AdminConfig(), manifest, false); err != nil {
		t.Fatal(err)
	}
	scheduled := func(name string, want int32) func() bool {
		return func() bool {
			ds, err := cs.AppsV1().DaemonSets(ManifestNamespace).Get(ctx, name, metav1.GetOptions{})
			return err == nil && ds.Status.ObservedGeneration == ds.Generation && ds.Status.DesiredNumberScheduled == want
		}
	}
	ready := func(name string) func() bool {
		return func() bool {
			ds, err := cs.AppsV1().DaemonSets(ManifestNamespace).Get(ctx, name, metav1.GetOptions{})
			return err == nil && ds.Status.DesiredNumberScheduled == 1 && ds.Status.NumberReady == 1
		}
	}
	// The agent runs on every node; the router only on node=tunnel nodes.
	waitFor("tunnel-endpoint scheduled", time.Minute, scheduled("tunnel-endpoint", 1))
	waitFor("tunnel-router counted", time.Minute, scheduled("tunnel-router", 0))
	if _, err := cs.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, []byte(`{"metadata":{"labels":{"node":"tunnel"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor("tunnel-endpoint Ready", 5*time.Minute, ready("tunnel-endpoint"))
	t.Logf("kubectl apply to tunnel-endpoint Ready: %v", time.Since(applied).Round(100*time.Millisecond))
	waitFor("tunnel-router Ready", 5*time.Minute, ready("tunnel-router"))
	t.Logf("kubectl apply to tunnel-router Ready: %v", time.Since(applied).Round(100*time.Millisecond))

	b := <-booted
	if b.err != nil {
		t.Fatalf("VM: %v", b.err)
	}
	// kubelet writes its KUBE-IPTABLES-HINT chain with the VM's iptables
	// (nft); the containerised router must have followed it.
	if !strings.Contains(b.out, `backend=nft`) || !strings.Contains(b.out, `why="kubelet's chains are in nft"`) {
		t.Errorf("the router's backend line: %q, want nft because of kubelet's chains", grepLine(b.out, "router's backend"))
	}
}

func grepLine(s, sub string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			return l
		}
	}
	return ""
}

// dumpCluster logs every pod and event, for a failed install.
func dumpCluster(t *testing.T, cs kubernetes.Interface) {
	ctx := context.Background()
	pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Log(err)
		return
	}
	for _, p := range pods.Items {
		t.Logf("pod %s/%s on %q: %s %v", p.Namespace, p.Name, p.Spec.NodeName, p.Status.Phase, p.Status.ContainerStatuses)
	}
	events, _ := cs.CoreV1().Events("").List(ctx, metav1.ListOptions{})
	for _, e := range events.Items {
		t.Logf("event %s %s/%s %s: %s", e.Type, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
	}
}

// readRepoFile reads a file from the repository root.
func readRepoFile(t *testing.T, name string) []byte {
	t.Helper()
	_, here, _, _ := runtime.Caller(0)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(here), "..", "..", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
