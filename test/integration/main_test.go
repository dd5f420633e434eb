// Package integration runs the daemons' controllers against a real
// kube-apiserver and etcd (see test/kubeenv), authenticated as their own
// ServiceAccounts under the RBAC of tunnel-router.yaml.
package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

var env *kubeenv.Env

func TestMain(m *testing.M) { kubeenv.Main(m, &env) }

// repoFile reads a file from the repository root.
func repoFile(t *testing.T, name string) []byte {
	t.Helper()
	_, here, _, _ := runtime.Caller(0)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(here), "..", "..", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// routerConfig applies tunnel-router.yaml as admin and returns a client
// configuration that authenticates as the router's ServiceAccount.
func routerConfig(t *testing.T) *rest.Config {
	t.Helper()
	return serviceAccountConfig(t, "tunnel-router")
}

// serviceAccountConfig applies tunnel-router.yaml as admin and returns a
// client configuration that authenticates as one of its ServiceAccounts.
func serviceAccountConfig(t *testing.T, name string) *rest.Config {
	t.Helper()
	kubeenv.SkipIfUnavailable(t, env)
	ctx := context.Background()
	if err := env.ApplyYAML(ctx, env.AdminConfig(), repoFile(t, "tunnel-router.yaml"), false); err != nil {
		t.Fatalf("applying tunnel-router.yaml: %v", err)
	}
	cfg, err := env.ServiceAccountConfig(ctx, "kube-service-tunnel", name)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func adminClient(t *testing.T) kubernetes.Interface {
	t.Helper()
	kubeenv.SkipIfUnavailable(t, env)
	cs, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

var nsCounter atomic.Int64

// freshNamespace creates a namespace for one test (deleted namespaces stay
// Terminating without a controller-manager, so names are never reused).
func freshNamespace(t *testing.T, cs kubernetes.Interface) string {
	t.Helper()
	name := fmt.Sprintf("it-%d-%d", time.Now().UnixNano()%1e6, nsCounter.Add(1))
	_, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return name
}

// eventually polls f until it returns nil or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s: %v", what, err)
}
