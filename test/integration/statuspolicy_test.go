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
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// TestStatusPolicyExample runs examples/tunnel-ip-status-policy.yaml on a
// real API server of its own (the binding is cluster-wide): the router's
// ServiceAccount, with the manifest's RBAC, publishes an ingress IP only
// inside the tunnel-config pools admitted for the Service's namespace (the
// CVE-2020-8554 class), while addresses another writer put there and every
// other user are left alone.
func TestStatusPolicyExample(t *testing.T) {
	ctx := context.Background()
	srv := startPolicyServer(t, "examples/tunnel-ip-status-policy.yaml")
	admin, router := srv.admin, srv.router
	cm, err := admin.CoreV1().ConfigMaps(manifestNamespace).Get(ctx, "tunnel-config", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data["KST_POOLS"] = " 192.0.2.0/24 ; 203.0.113.5=team-a, team-c\n2001:db8:2::/64"
	if _, err := admin.CoreV1().ConfigMaps(manifestNamespace).Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{"team-a", "team-b"} {
		if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web"},
			Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, IPFamilyPolicy: ptr(corev1.IPFamilyPolicyPreferDualStack),
				Ports: []corev1.ServicePort{{Port: 80}}}}
		if _, err := admin.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	publish := func(cs kubernetes.Interface, ns string, ips ...string) error {
		var ingress []string
		for _, ip := range ips {
			ingress = append(ingress, fmt.Sprintf(`{"ip":%q}`, ip))
		}
		patch := fmt.Sprintf(`{"status":{"loadBalancer":{"ingress":[%s]}}}`, strings.Join(ingress, ","))
		if len(ips) == 0 {
			patch = `{"status":{"loadBalancer":null}}`
		}
		_, err := cs.CoreV1().Services(ns).Patch(ctx, "web", types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
		return err
	}
	// The policy is in force once the API server has loaded it. Each try
	// starts from an empty status: an address the router got in before
	// would count as already there.
	eventually(t, 20*time.Second, "the policy denies the router an address outside the pools", func() error {
		if err := publish(admin, "team-b"); err != nil {
			return err
		}
		if err := publish(router, "team-b", "198.51.100.1"); !apierrors.IsForbidden(err) {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	// Each case starts from the status the one before left.
	for _, tc := range []struct {
		who   string
		cs    kubernetes.Interface
		ns    string
		ips   []string
		admit bool
	}{
		{"router", router, "team-b", []string{"192.0.2.10"}, true},
		{"router", router, "team-b", []string{"198.51.100.1"}, false},
		{"router", router, "team-b", []string{"192.0.2.10", "2001:db8:2::10"}, true},
		{"router", router, "team-b", []string{"192.0.2.10", "2001:db8:3::1"}, false},
		{"router", router, "team-b", []string{"203.0.113.5"}, false}, // a pool of team-a and team-c only
		{"router", router, "team-a", []string{"203.0.113.5"}, true},
		{"router", router, "team-a", []string{"203.0.113.6"}, false}, // a single address is a /32
		// Anyone else is left alone; an address someone else put there
		// stays beside the router's.
		{"admin", admin, "team-b", []string{"198.51.100.1"}, true},
		{"router", router, "team-b", []string{"198.51.100.1", "192.0.2.11"}, true},
		{"router", router, "team-b", []string{"198.51.100.1", "198.51.100.2"}, false},
	} {
		err := publish(tc.cs, tc.ns, tc.ips...)
		switch {
		case tc.admit && err != nil:
			t.Errorf("%s publishing %v on %s/web: %v, want admitted", tc.who, tc.ips, tc.ns, err)
		case !tc.admit && err == nil:
			t.Errorf("%s publishing %v on %s/web: admitted, want denied", tc.who, tc.ips, tc.ns)
		case !tc.admit && !strings.Contains(err.Error(), "address pools"):
			t.Errorf("%s publishing %v on %s/web: %v, want the policy's message", tc.who, tc.ips, tc.ns, err)
		}
	}
	// Without its ConfigMap the policy denies the router's writes.
	if err := admin.CoreV1().ConfigMaps(manifestNamespace).Delete(ctx, "tunnel-config", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the router denied without the tunnel-config ConfigMap", func() error {
		if err := publish(router, "team-b", "192.0.2.12"); err == nil {
			return fmt.Errorf("admitted")
		}
		return nil
	})
}

// policyServer is a real API server of a test's own (an admission policy's
// binding is cluster-wide) holding tunnel-router.yaml, applied as users
// apply it, and an example admission policy.
type policyServer struct {
	env    *kubeenv.Env
	admin  kubernetes.Interface
	router kubernetes.Interface
	// routerCfg authenticates as the router's ServiceAccount with a token
	// bound to no pod.
	routerCfg *rest.Config
}

func startPolicyServer(t *testing.T, example string) policyServer {
	t.Helper()
	env := kubeenv.Start(t)
	ctx := context.Background()
	admin, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"tunnel-router.yaml", example} {
		if err := env.ApplyYAML(ctx, env.AdminConfig(), repoFile(t, f), false); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	routerCfg, err := env.ServiceAccountConfig(ctx, manifestNamespace, "tunnel-router")
	if err != nil {
		t.Fatal(err)
	}
	router, err := kubernetes.NewForConfig(routerCfg)
	if err != nil {
		t.Fatal(err)
	}
	return policyServer{env: env, admin: admin, router: router, routerCfg: routerCfg}
}

// podBoundClient is a client of ServiceAccount sa with the token the
// kubelet would mount in a pod of sa on node (the API server names the
// node in such a token): it creates that pod, named pod, in the manifest's
// namespace, and returns the client.
func (srv policyServer) podBoundClient(t *testing.T, sa, pod, node string) kubernetes.Interface {
	t.Helper()
	ctx := context.Background()
	p, err := srv.admin.CoreV1().Pods(manifestNamespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, AutomountServiceAccountToken: ptr(false),
			Containers: []corev1.Container{{Name: sa, Image: "kube-service-tunnel/" + sa + ":test"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := srv.admin.CoreV1().ServiceAccounts(manifestNamespace).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The ServiceAccount's own config, with the pod-bound token instead.
	cfg, err := srv.env.ServiceAccountConfig(ctx, manifestNamespace, sa)
	if err != nil {
		t.Fatal(err)
	}
	cfg.BearerToken = tr.Status.Token
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}
