package lab

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// TestLabKubelet boots the VM as one real node: containerd and a real
// kubelet register with the API server on the host, and pods created
// through the API run in containerd with addresses from the CNI bridge. It
// logs the figures that decide how the lab cluster is built (start-up and
// pod start times under TCG).
func TestLabKubelet(t *testing.T) {
	assets := Require(t)
	env := kubeenv.Start(t)
	dir := t.TempDir()
	const node, podCIDR = "lab-node", "10.244.1.0/24"
	files, err := KubeletFiles(dir, KubeletOptions{NodeName: node, NodeIP: strings.Split(GuestAddr, "/")[0], PodCIDR: podCIDR, Admin: env.AdminConfig()})
	if err != nil {
		if IntegrationRequired() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	script := KubeletScript + `
# Until the three pods' sandboxes and containers run, then long enough for
# the kubelet to report them.
i=0
while [ $i -lt 240 ] && [ "$(ctr -n k8s.io tasks ls | grep -c RUNNING)" -lt 6 ]; do sleep 2; i=$((i+2)); done
sleep 8
echo "T done $(up)"
echo ==== kubelet errors; grep '^E' /tmp/kubelet.log | tail -n 20
`
	forward := env.Port()
	ir, err := BuildInitramfs(InitramfsOptions{
		Assets: assets, Output: filepath.Join(dir, "initrd.cpio"), Script: script, Files: files,
		HostBinaries: KubeletHostBinaries, Modules: KubeletModules,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	type boot struct {
		out string
		err error
	}
	booted := make(chan boot, 1)
	start := time.Now()
	go func() {
		out, _, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel, MemoryMB: 2048, CPUs: 2, ForwardHostPorts: []int{forward}})
		booted <- boot{out, err}
	}()
	cs, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	waitFor := func(what string, cond func() bool) time.Duration {
		t.Helper()
		for !cond() {
			select {
			case b := <-booted:
				t.Fatalf("the VM ended (%v) before %s; console:\n%s", b.err, what, LastLines(b.out, 60))
			case <-time.After(500 * time.Millisecond):
			}
		}
		return time.Since(start)
	}
	registered := waitFor("the node registered", func() bool {
		_, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err == nil
	})
	ready := waitFor("the node was Ready", func() bool {
		n, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err == nil && nodeReady(n.Status.Conditions)
	})
	t.Logf("qemu start to Node registered %v, to Ready %v", registered.Round(100*time.Millisecond), ready.Round(100*time.Millisecond))
	pods := netip.MustParsePrefix(podCIDR)
	for i := 1; i <= 3; i++ {
		name := fmt.Sprintf("sleeper-%d", i)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
			Spec: corev1.PodSpec{NodeName: node, AutomountServiceAccountToken: new(bool),
				Containers: []corev1.Container{{Name: "sleep", Image: SandboxImage, ImagePullPolicy: corev1.PullNever}}}}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		created := time.Now()
		var p *corev1.Pod
		waitFor(name+" Running", func() bool {
			p, err = cs.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
			return err == nil && p.Status.Phase == corev1.PodRunning
		})
		ip, err := netip.ParseAddr(p.Status.PodIP)
		if err != nil || !pods.Contains(ip) {
			t.Errorf("%s: pod IP %q, want one of the CNI bridge's %s", name, p.Status.PodIP, pods)
		}
		t.Logf("%s: created to Running %v, pod IP %s", name, time.Since(created).Round(100*time.Millisecond), ip)
	}
	b := <-booted
	console := b.out
	if b.err != nil {
		t.Fatalf("VM: %v; console:\n%s", b.err, LastLines(console, 60))
	}
	marks := regexp.MustCompile(`(?m)^T (\S+) (\S+)$`).FindAllStringSubmatch(console, -1)
	var figures []string
	for _, m := range marks {
		figures = append(figures, m[1]+" "+m[2]+"s")
	}
	t.Logf("in the VM, seconds since its kernel started: %s", strings.Join(figures, ", "))
	if os.Getenv("KST_LAB_VERBOSE") != "" {
		t.Logf("console:\n%s", console)
	}
}

func nodeReady(conds []corev1.NodeCondition) bool {
	for _, c := range conds {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}
