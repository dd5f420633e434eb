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
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
)

// TestRouterConfigMapPolicyExample runs
// examples/tunnel-router-configmap-policy.yaml on a real API server of its
// own (the binding is cluster-wide): with the manifest's RBAC, which lets
// the router create and update every ConfigMap of its namespace, the
// router's ServiceAccount may write only status ConfigMaps, and with a
// token bound to a router pod only its own node's; tunnel-config stays the
// admin's.
func TestRouterConfigMapPolicyExample(t *testing.T) {
	ctx := context.Background()
	srv := startPolicyServer(t, "examples/tunnel-router-configmap-policy.yaml")
	admin, unbound := srv.admin, srv.router
	// A token bound to a router pod on node router-1, as the kubelet
	// mounts it.
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "router-1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := admin.CoreV1().Pods(manifestNamespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "tunnel-router-abcde"},
		Spec: corev1.PodSpec{NodeName: "router-1", ServiceAccountName: "tunnel-router", AutomountServiceAccountToken: ptr(false),
			Containers: []corev1.Container{{Name: "tunnel-router", Image: "kube-service-tunnel/tunnel-router:test"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := admin.CoreV1().ServiceAccounts(manifestNamespace).CreateToken(ctx, "tunnel-router", &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	boundCfg := rest.CopyConfig(srv.routerCfg)
	boundCfg.BearerToken = tr.Status.Token
	bound, err := kubernetes.NewForConfig(boundCfg)
	if err != nil {
		t.Fatal(err)
	}
	review, err := bound.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := review.Status.UserInfo.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != "router-1" {
		t.Fatalf("the pod-bound token names node %v, want [router-1]", got)
	}

	cms := func(cs kubernetes.Interface) func(name string) error {
		return func(name string) error {
			cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string]string{"written": "yes"}}
			_, err := cs.CoreV1().ConfigMaps(manifestNamespace).Create(ctx, cm, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				_, err = cs.CoreV1().ConfigMaps(manifestNamespace).Update(ctx, cm, metav1.UpdateOptions{})
			}
			return err
		}
	}
	write, writeBound, writeAdmin := cms(unbound), cms(bound), cms(admin)
	// The policy is in force once the API server has loaded it.
	eventually(t, 20*time.Second, "the policy denies the router tunnel-config", func() error {
		if err := write("tunnel-config"); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "status ConfigMap") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	for _, tc := range []struct {
		who   string
		write func(string) error
		name  string
		admit bool
	}{
		{"router (unbound token)", write, routerstatus.NamePrefix + "router-9", true},
		{"router (unbound token)", write, routerstatus.NamePrefix + "router-9", true}, // an update
		{"router (unbound token)", write, "tunnel-config", false},
		{"router (unbound token)", write, "tunnel-bgp", false},
		{"router on router-1", writeBound, routerstatus.NamePrefix + "router-1", true},
		{"router on router-1", writeBound, routerstatus.NamePrefix + "router-1", true},
		{"router on router-1", writeBound, routerstatus.NamePrefix + "router-2", false},
		{"router on router-1", writeBound, "tunnel-config", false},
		{"admin", writeAdmin, "tunnel-config", true},
	} {
		err := tc.write(tc.name)
		switch {
		case tc.admit && err != nil:
			t.Errorf("%s writing ConfigMap %s: %v, want admitted", tc.who, tc.name, err)
		case !tc.admit && err == nil:
			t.Errorf("%s writing ConfigMap %s: admitted, want denied", tc.who, tc.name)
		case !tc.admit && !apierrors.IsForbidden(err):
			t.Errorf("%s writing ConfigMap %s: %v, want forbidden by the policy", tc.who, tc.name, err)
		}
	}
	cm, err := admin.CoreV1().ConfigMaps(manifestNamespace).Get(ctx, "tunnel-config", metav1.GetOptions{})
	if err != nil || cm.Data["written"] != "yes" {
		t.Errorf("tunnel-config after the admin's write: %v, %v", cm, err)
	}
}
