package cluster

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// networkPolicy: the agent of the real image, under the manifest's RBAC,
// holds the echo pods to their NetworkPolicies. A policy admitting only
// another range refuses the client's new connection while one opened
// before keeps echoing; examples/allow-tunnel-routers.yaml, applied
// unchanged, admits the client (198.51.100.0/24) again; with the policies
// deleted the pods hold no rule.
func (c *cluster) networkPolicy(t *testing.T) {
	ctx := context.Background()
	open := startStreamOrFail(t, c)
	policies := c.kube.NetworkingV1().NetworkPolicies(exampleNamespace)
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(int32(service.Port()))
	elsewhere := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "only-elsewhere"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": exampleName}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/24"}}},
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
			}},
		},
	}
	if _, err := policies.Create(ctx, elsewhere, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	took := c.waitFor(t, "the client refused by a policy admitting only 203.0.113.0/24", time.Minute, func() (bool, error) {
		return !c.connects(), nil
	})
	t.Logf("policy admitting only 203.0.113.0/24: the client's new connections refused %v after the write (a try that is refused waits 2 s)", took.Round(100*time.Millisecond))
	before := open.Stats().Verified
	c.waitFor(t, "the connection opened before the policy still echoing", 30*time.Second, func() (bool, error) {
		st := open.Stats()
		return st.Verified > before+256, st.Err
	})

	if err := policies.Delete(ctx, elsewhere.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := kubeenv.Apply(ctx, c.cfg, vmFile(t, policyFile), false); err != nil {
		t.Fatal(err)
	}
	took = c.waitFor(t, "the client admitted by examples/allow-tunnel-routers.yaml", time.Minute, func() (bool, error) {
		return c.connects(), nil
	})
	t.Logf("examples/allow-tunnel-routers.yaml applied: the client (in 198.51.100.0/24) connects again after %v", took.Round(100*time.Millisecond))
	if _, errs := stopAll([]*workload.Stream{open}); len(errs) > 0 {
		t.Errorf("the connection open across the policy changes: %v", errs)
	}

	list, err := policies.List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range list.Items {
		if err := policies.Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c.waitFor(t, "the client connects with no policy", time.Minute, func() (bool, error) { return c.connects(), nil })
}

// startStreamOrFail opens one greeted echo stream from the client.
func startStreamOrFail(t *testing.T, c *cluster) *workload.Stream {
	t.Helper()
	s, err := workload.StartStream(c.client, service, c.clientPort(), streamOpt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = s.Stop(context.Background()) })
	return s
}

// connects reports whether a new connection from the client is greeted
// within 2 s.
func (c *cluster) connects() bool {
	opts := streamOpt
	opts.DialTimeout = 2 * time.Second
	s, err := workload.StartStream(c.client, service, c.clientPort(), opts)
	if err != nil {
		return false
	}
	_, err = s.Stop(context.Background())
	return err == nil
}
