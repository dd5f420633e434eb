package kubeenv_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// panicHelperEnv makes the test binary start an Env, print its PIDs and
// panic (see TestPanicLeavesNoProcess).
const panicHelperEnv = "KUBEENV_TEST_PANIC_HELPER"

var env *kubeenv.Env

func TestMain(m *testing.M) {
	if os.Getenv(panicHelperEnv) == "1" {
		panicHelper()
	}
	kubeenv.Main(m, &env)
}

func TestAdminCreatesNamespaceAndService(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	ctx := t.Context()
	cs := kubernetes.NewForConfigOrDie(env.AdminConfig())
	ns := createNamespace(t, cs, "admin")

	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80}},
		},
	}
	created, err := cs.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service: %v", err)
	}
	ip, err := netip.ParseAddr(created.Spec.ClusterIP)
	if err != nil || !netip.MustParsePrefix(kubeenv.ServiceClusterIPRange).Contains(ip) {
		t.Fatalf("cluster IP %q not in %s (%v)", created.Spec.ClusterIP, kubeenv.ServiceClusterIPRange, err)
	}
	t.Logf("service %s/web got cluster IP %s", ns, ip)
}

func TestWriteKubeconfig(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := env.WriteKubeconfig(path, nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatalf("load kubeconfig: %v", err)
	}
	if cfg.Insecure || len(cfg.CAData) == 0 {
		t.Fatalf("kubeconfig should verify TLS with the API server CA")
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	if _, err := cs.CoreV1().Namespaces().Get(t.Context(), "default", metav1.GetOptions{}); err != nil {
		t.Fatalf("get namespace default through kubeconfig: %v", err)
	}
}

func TestServiceAccountIsSubjectToRBAC(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	ctx := t.Context()
	admin := kubernetes.NewForConfigOrDie(env.AdminConfig())
	ns := uniqueName("rbac")

	saCfg, err := env.ServiceAccountConfig(ctx, ns, "reader")
	if err != nil {
		t.Fatal(err)
	}
	sa := kubernetes.NewForConfigOrDie(saCfg)
	_, err = sa.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
	if !apierrors.IsForbidden(err) {
		t.Fatalf("list services without RBAC: got %v, want Forbidden", err)
	}
	t.Logf("without RBAC: %v", err)

	grantListServices(t, admin, ns, "reader")
	if err := pollUntil(ctx, 10*time.Second, func() error {
		_, err := sa.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
		return err
	}); err != nil {
		t.Fatalf("list services after RoleBinding: %v", err)
	}
	if _, err := sa.CoreV1().Services("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("list services in another namespace: got %v, want Forbidden", err)
	}
}

const applyManifest = `
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
  namespace: NS
data:
  mode: gre
---
# an empty document and a comment
---
apiVersion: v1
kind: Service
metadata:
  name: tunnel
  namespace: NS
spec:
  ports:
  - port: 8080
    targetPort: 8080
---
apiVersion: v1
kind: Namespace
metadata:
  name: NS
`

func TestApplyYAML(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	ctx := t.Context()
	cs := kubernetes.NewForConfigOrDie(env.AdminConfig())
	ns := uniqueName("apply")
	manifest := []byte(strings.ReplaceAll(applyManifest, "NS", ns))

	// The Namespace comes last in the manifest but is applied first.
	if err := env.ApplyYAML(ctx, nil, manifest, false); err != nil {
		t.Fatalf("apply: %v", err)
	}
	cm, err := cs.CoreV1().ConfigMaps(ns).Get(ctx, "settings", metav1.GetOptions{})
	if err != nil || cm.Data["mode"] != "gre" {
		t.Fatalf("configmap after apply: %v %v", cm.Data, err)
	}
	if _, err := cs.CoreV1().Services(ns).Get(ctx, "tunnel", metav1.GetOptions{}); err != nil {
		t.Fatalf("service after apply: %v", err)
	}

	// A dry run changes nothing.
	changed := []byte(strings.ReplaceAll(string(manifest), "mode: gre", "mode: mpls"))
	if err := env.ApplyYAML(ctx, nil, changed, true); err != nil {
		t.Fatalf("dry-run apply: %v", err)
	}
	cm, err = cs.CoreV1().ConfigMaps(ns).Get(ctx, "settings", metav1.GetOptions{})
	if err != nil || cm.Data["mode"] != "gre" {
		t.Fatalf("configmap after dry run: %v %v", cm.Data, err)
	}

	// Applying again updates in place.
	if err := env.ApplyYAML(ctx, nil, changed, false); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	cm, err = cs.CoreV1().ConfigMaps(ns).Get(ctx, "settings", metav1.GetOptions{})
	if err != nil || cm.Data["mode"] != "mpls" {
		t.Fatalf("configmap after second apply: %v %v", cm.Data, err)
	}
}

func TestApplyYAMLAsServiceAccountIsForbidden(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	ctx := t.Context()
	ns := uniqueName("apply-sa")
	saCfg, err := env.ServiceAccountConfig(ctx, ns, "nobody")
	if err != nil {
		t.Fatal(err)
	}
	manifest := []byte("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n  namespace: " + ns + "\n")
	err = env.ApplyYAML(ctx, saCfg, manifest, true)
	if !apierrors.IsForbidden(err) {
		t.Fatalf("dry-run apply as service account without RBAC: got %v, want Forbidden", err)
	}
}

func TestStopLeavesNoProcess(t *testing.T) {
	e := kubeenv.Start(t)
	t.Logf("second env ready in %v", e.StartupDuration())
	pids := e.PIDs()
	if len(pids) != 2 {
		t.Fatalf("PIDs() = %v, want etcd and kube-apiserver", pids)
	}
	for _, pid := range pids {
		if !processAlive(pid) {
			t.Fatalf("pid %d not running before Stop", pid)
		}
	}
	if err := e.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := e.Stop(); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	for _, pid := range pids {
		if processAlive(pid) {
			t.Errorf("pid %d still running after Stop", pid)
		}
	}
	if _, err := os.Stat(e.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temp dir %s not removed: %v", e.Dir(), err)
	}
}

// TestPanicLeavesNoProcess runs this test binary as a helper that starts an
// Env and panics without calling Stop; Pdeathsig must kill both servers.
func TestPanicLeavesNoProcess(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), panicHelperEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("helper did not panic:\n%s", out)
	}
	pids, dir := parseHelperOutput(t, out)
	defer os.RemoveAll(dir)
	if err := pollUntil(t.Context(), 5*time.Second, func() error {
		for _, pid := range pids {
			if processAlive(pid) {
				return fmt.Errorf("pid %d still running", pid)
			}
		}
		return nil
	}); err != nil {
		t.Fatalf("after the helper panicked: %v", err)
	}
}

// panicHelper is the helper process of TestPanicLeavesNoProcess.
func panicHelper() {
	e, err := kubeenv.New()
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(3)
	}
	fmt.Println("PIDS", strings.Trim(fmt.Sprint(e.PIDs()), "[]"))
	fmt.Println("DIR", e.Dir())
	panic("kubeenv test helper: panicking without Stop")
}

func parseHelperOutput(t *testing.T, out []byte) (pids []int, dir string) {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		switch fields[0] {
		case "PIDS":
			for _, f := range fields[1:] {
				pid, err := strconv.Atoi(f)
				if err != nil {
					t.Fatalf("bad helper output %q", sc.Text())
				}
				pids = append(pids, pid)
			}
		case "DIR":
			dir = fields[1]
		}
	}
	if len(pids) != 2 {
		t.Fatalf("helper printed no PIDs:\n%s", out)
	}
	return pids, dir
}

// processAlive reports whether pid exists and is not a zombie.
func processAlive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses.
	i := strings.LastIndexByte(string(stat), ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}

func createNamespace(t *testing.T, cs kubernetes.Interface, prefix string) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: uniqueName(prefix)}}
	if _, err := cs.CoreV1().Namespaces().Create(t.Context(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	return ns.Name
}

func grantListServices(t *testing.T, cs kubernetes.Interface, ns, serviceAccount string) {
	t.Helper()
	ctx := t.Context()
	role := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "list-services", Namespace: ns},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"list"},
		}},
	}
	if _, err := cs.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role: %v", err)
	}
	binding := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "list-services", Namespace: ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: serviceAccount, Namespace: ns}},
	}
	if _, err := cs.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role binding: %v", err)
	}
}

// uniqueName returns prefix plus a nanosecond suffix (namespaces cannot be
// reused: without a controller-manager they stay Terminating).
func uniqueName(prefix string) string {
	return fmt.Sprintf("%s-%d", prefix, time.Now().UnixNano())
}

func pollUntil(ctx context.Context, timeout time.Duration, f func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestRestartAPIServer stops kube-apiserver and starts it again (on an Env of
// its own, so the shared one is not disturbed): the address, the objects in
// etcd, the admin config and a service account token issued before all
// still work afterwards, and the process is a new one.
func TestRestartAPIServer(t *testing.T) {
	e := kubeenv.Start(t)
	ctx := t.Context()
	admin := kubernetes.NewForConfigOrDie(e.AdminConfig())
	ns := createNamespace(t, admin, "restart")
	saCfg, err := e.ServiceAccountConfig(ctx, ns, "reader")
	if err != nil {
		t.Fatal(err)
	}
	grantListServices(t, admin, ns, "reader")
	host, pidsBefore := e.Host(), e.PIDs()

	if err := e.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err == nil {
		t.Fatal("API server still answers after StopAPIServer")
	}
	// Another socket holds the port (as a client's outgoing connection
	// could) until a restart has failed on it: StartAPIServer tries again.
	holder, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(e.Port())))
	if err != nil {
		t.Fatalf("hold the API server's port: %v", err)
	}
	released := make(chan bool, 1)
	go func() {
		defer holder.Close()
		firstLog := filepath.Join(e.Dir(), "kube-apiserver-1.log")
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if data, _ := os.ReadFile(firstLog); strings.Contains(string(data), "address already in use") {
				released <- true
				return
			}
		}
		released <- false
	}()
	if err := e.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	if !<-released {
		t.Error("the first restart did not report the held port in kube-apiserver-1.log")
	}
	if err := e.StartAPIServer(); err == nil {
		t.Error("StartAPIServer on a running API server succeeded")
	}

	if e.Host() != host {
		t.Errorf("host %s after restart, want %s", e.Host(), host)
	}
	pidsAfter := e.PIDs()
	if len(pidsAfter) != 2 || pidsAfter[0] != pidsBefore[0] || pidsAfter[1] == pidsBefore[1] {
		t.Errorf("PIDs %v after restart, %v before: want the same etcd and a new kube-apiserver", pidsAfter, pidsBefore)
	}
	if processAlive(pidsBefore[1]) {
		t.Errorf("old kube-apiserver pid %d still running", pidsBefore[1])
	}
	if _, err := admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err != nil {
		t.Errorf("namespace created before the restart, through the old admin client: %v", err)
	}
	sa := kubernetes.NewForConfigOrDie(saCfg)
	if _, err := sa.CoreV1().Services(ns).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("service account token issued before the restart: %v", err)
	}
}

// TestFreePortOutsideEphemeralRange: the ports kubeenv chooses lie below
// net.ipv4.ip_local_port_range, so no outgoing connection can hold one while
// the API server restarts.
func TestFreePortOutsideEphemeralRange(t *testing.T) {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skipf("no ip_local_port_range: %v", err)
	}
	var low, high int
	if _, err := fmt.Sscan(string(data), &low, &high); err != nil {
		t.Fatalf("parse ip_local_port_range %q: %v", data, err)
	}
	if low < 10240+1024 {
		t.Skipf("ephemeral range starts at %d: too low to choose below it", low)
	}
	e := kubeenv.Start(t)
	if port := e.Port(); port >= low || port < 10240 {
		t.Errorf("API server port %d: want one in [10240, %d), below the ephemeral range %d-%d", port, low, low, high)
	}
}
