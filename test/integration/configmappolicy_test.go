package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
)

// TestRouterConfigMapPolicyExample runs
// examples/tunnel-router-configmap-policy.yaml on a real API server of its
// own (the binding is cluster-wide). The manifest's RBAC lets the router
// write no ConfigMap of kube-service-tunnel (tunnel-config stays the
// admin's) and every ConfigMap of the status namespace; with the policy the
// router's ServiceAccount may write only status ConfigMaps there, and with
// a token bound to a router pod only its own node's.
func TestRouterConfigMapPolicyExample(t *testing.T) {
	ctx := context.Background()
	srv := startPolicyServer(t, "examples/tunnel-router-configmap-policy.yaml")
	admin, unbound := srv.admin, srv.router
	// A token bound to a router pod on node router-1, as the kubelet
	// mounts it.
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "router-1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bound := srv.podBoundClient(t, "tunnel-router", "tunnel-router-abcde", "router-1")
	review, err := bound.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := review.Status.UserInfo.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != "router-1" {
		t.Fatalf("the pod-bound token names node %v, want [router-1]", got)
	}

	cms := func(cs kubernetes.Interface) func(ns, name string) error {
		return func(ns, name string) error {
			cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string]string{"written": "yes"}}
			_, err := cs.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				_, err = cs.CoreV1().ConfigMaps(ns).Update(ctx, cm, metav1.UpdateOptions{})
			}
			return err
		}
	}
	write, writeBound, writeAdmin := cms(unbound), cms(bound), cms(admin)
	status := routerstatus.DefaultNamespace
	// The policy is in force once the API server has loaded it.
	eventually(t, 20*time.Second, "the policy denies the router a ConfigMap of the status namespace", func() error {
		if err := write(status, "not-a-status"); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "status ConfigMap") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	const byRBAC, byPolicy = "RBAC", "policy"
	for _, tc := range []struct {
		who      string
		write    func(ns, name string) error
		ns, name string
		deniedBy string // "" when admitted
	}{
		{"router (unbound token)", write, status, routerstatus.NamePrefix + "router-9", ""},
		{"router (unbound token)", write, status, routerstatus.NamePrefix + "router-9", ""}, // an update
		{"router (unbound token)", write, status, "tunnel-bgp", byPolicy},
		{"router (unbound token)", write, manifestNamespace, "tunnel-config", byRBAC},
		{"router (unbound token)", write, manifestNamespace, routerstatus.NamePrefix + "router-9", byRBAC},
		{"router on router-1", writeBound, status, routerstatus.NamePrefix + "router-1", ""},
		{"router on router-1", writeBound, status, routerstatus.NamePrefix + "router-1", ""},
		{"router on router-1", writeBound, status, routerstatus.NamePrefix + "router-2", byPolicy},
		{"router on router-1", writeBound, manifestNamespace, "tunnel-config", byRBAC},
		{"admin", writeAdmin, manifestNamespace, "tunnel-config", ""},
		{"admin", writeAdmin, status, "not-a-status", ""},
	} {
		err := tc.write(tc.ns, tc.name)
		switch {
		case tc.deniedBy == "" && err != nil:
			t.Errorf("%s writing ConfigMap %s/%s: %v, want admitted", tc.who, tc.ns, tc.name, err)
		case tc.deniedBy != "" && err == nil:
			t.Errorf("%s writing ConfigMap %s/%s: admitted, want denied", tc.who, tc.ns, tc.name)
		case tc.deniedBy != "" && !apierrors.IsForbidden(err):
			t.Errorf("%s writing ConfigMap %s/%s: %v, want forbidden by %s", tc.who, tc.ns, tc.name, err, tc.deniedBy)
		case tc.deniedBy == byPolicy && !strings.Contains(err.Error(), "status ConfigMap"):
			t.Errorf("%s writing ConfigMap %s/%s: %v, want the policy's message", tc.who, tc.ns, tc.name, err)
		case tc.deniedBy == byRBAC && strings.Contains(err.Error(), "status ConfigMap"):
			t.Errorf("%s writing ConfigMap %s/%s: %v, want denied by RBAC before any policy", tc.who, tc.ns, tc.name, err)
		}
	}
	cm, err := admin.CoreV1().ConfigMaps(manifestNamespace).Get(ctx, "tunnel-config", metav1.GetOptions{})
	if err != nil || cm.Data["written"] != "yes" {
		t.Errorf("tunnel-config after the admin's write: %v, %v", cm, err)
	}
}
