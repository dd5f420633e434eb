package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
)

// TestEndpointPodStatusPolicyExample runs
// examples/tunnel-endpoint-pod-status-policy.yaml on a real API server of
// its own (the binding is cluster-wide). The manifest's RBAC lets the
// endpoint agent's ServiceAccount patch the status of any pod; with the
// policy, a token bound to an agent pod on node-1 opens the readiness gate
// of node-1's pods exactly as the agent does (endpoint.APIConditionWriter),
// and every other write of that ServiceAccount is denied: another node's
// pod, a pod's IP (which the EndpointSlice controller would publish),
// another condition, the gate set to False, any write with a token bound
// to no pod. The admin is not checked. Without the policy, the same
// ServiceAccount rewrites another node's pod's IP.
func TestEndpointPodStatusPolicyExample(t *testing.T) {
	ctx := context.Background()
	srv := startPolicyServer(t, "examples/tunnel-endpoint-pod-status-policy.yaml")
	admin := srv.admin
	for _, n := range []string{"node-1", "node-2"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "demo"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The served pods, with the status the kubelet would have written.
	served := map[string]*corev1.Pod{}
	for i, node := range []string{"node-1", "node-2"} {
		pod, err := admin.CoreV1().Pods("demo").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "echo-" + node},
			Spec: corev1.PodSpec{NodeName: node, ReadinessGates: []corev1.PodReadinessGate{{ConditionType: endpoint.ReadinessGate}},
				Containers: []corev1.Container{{Name: "echo", Image: "busybox:1.36"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: fmt.Sprintf("10.244.%d.10", i+1),
			PodIPs:     []corev1.PodIP{{IP: fmt.Sprintf("10.244.%d.10", i+1)}},
			Conditions: []corev1.PodCondition{{Type: corev1.ContainersReady, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: corev1.ConditionFalse}}}
		if pod, err = admin.CoreV1().Pods("demo").UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		served[node] = pod
	}
	// The agent's pod on node-1, and the token the kubelet would mount in it;
	// and the agent's ServiceAccount with a token bound to no pod.
	bound := srv.podBoundClient(t, "tunnel-endpoint", "tunnel-endpoint-abcde", "node-1")
	unboundCfg, err := srv.env.ServiceAccountConfig(ctx, manifestNamespace, "tunnel-endpoint")
	if err != nil {
		t.Fatal(err)
	}
	unbound, err := kubernetes.NewForConfig(unboundCfg)
	if err != nil {
		t.Fatal(err)
	}

	gate := func(status corev1.ConditionStatus) corev1.PodCondition {
		return corev1.PodCondition{Type: endpoint.ReadinessGate, Status: status, Reason: "TunnelIPsInPlace", LastTransitionTime: metav1.Now()}
	}
	openGate := func(cs kubernetes.Interface, node string, status corev1.ConditionStatus) error {
		return endpoint.APIConditionWriter{Client: cs}.SetPodCondition(ctx, served[node], gate(status))
	}
	// A JSON merge patch: lists (the pod's IPs) are replaced whole.
	patchStatus := func(cs kubernetes.Interface, node, patch string) error {
		_, err := cs.CoreV1().Pods("demo").Patch(ctx, served[node].Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
		return err
	}
	// The policy is in force once the API server has loaded it.
	eventually(t, 20*time.Second, "the policy denies the agent another node's pod", func() error {
		if err := openGate(bound, "node-2", corev1.ConditionTrue); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "own node") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	for _, tc := range []struct {
		what  string
		write func() error
		admit bool
	}{
		{"the agent opens its node's pod's gate", func() error { return openGate(bound, "node-1", corev1.ConditionTrue) }, true},
		{"the agent opens it again (unchanged)", func() error { return openGate(bound, "node-1", corev1.ConditionTrue) }, true},
		{"the agent closes the gate", func() error { return openGate(bound, "node-1", corev1.ConditionFalse) }, false},
		{"the agent sets Ready", func() error {
			_, err := bound.CoreV1().Pods("demo").Patch(ctx, served["node-1"].Name, types.StrategicMergePatchType,
				[]byte(`{"status":{"conditions":[{"type":"Ready","status":"True"}]}}`), metav1.PatchOptions{}, "status")
			return err
		}, false},
		{"the agent rewrites the pod's IP", func() error {
			return patchStatus(bound, "node-1", `{"status":{"podIP":"198.51.100.66","podIPs":[{"ip":"198.51.100.66"}]}}`)
		}, false},
		{"the agent changes the phase", func() error { return patchStatus(bound, "node-1", `{"status":{"phase":"Failed"}}`) }, false},
		{"the agent opens another node's pod's gate", func() error { return openGate(bound, "node-2", corev1.ConditionTrue) }, false},
		{"a token bound to no pod opens a gate", func() error { return openGate(unbound, "node-1", corev1.ConditionTrue) }, false},
		{"the admin rewrites a pod's IP", func() error {
			return patchStatus(admin, "node-2", `{"status":{"podIP":"10.244.2.11","podIPs":[{"ip":"10.244.2.11"}]}}`)
		}, true},
	} {
		err := tc.write()
		switch {
		case tc.admit && err != nil:
			t.Errorf("%s: %v, want admitted", tc.what, err)
		case !tc.admit && err == nil:
			t.Errorf("%s: admitted, want denied", tc.what)
		case !tc.admit && (!apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "the endpoint agent may")):
			t.Errorf("%s: %v, want the policy's denial", tc.what, err)
		}
	}
	pod, err := admin.CoreV1().Pods("demo").Get(ctx, "echo-node-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Status.PodIP != "10.244.1.10" || pod.Status.Phase != corev1.PodRunning {
		t.Errorf("node-1's pod after the agent's denied writes: %s %s, want 10.244.1.10 Running", pod.Status.PodIP, pod.Status.Phase)
	}
	for _, c := range pod.Status.Conditions {
		if (c.Type == endpoint.ReadinessGate && c.Status != corev1.ConditionTrue) || (c.Type == corev1.PodReady && c.Status != corev1.ConditionFalse) {
			t.Errorf("node-1's pod's condition %s is %s after the agent's writes", c.Type, c.Status)
		}
	}

	// The hole the policy closes: without it, the agent's ServiceAccount
	// rewrites any pod's IP (RBAC grants pods/status whole).
	if err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, "kube-service-tunnel-endpoint-pod-status", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the agent rewrites another node's pod's IP without the policy", func() error {
		return patchStatus(unbound, "node-2", `{"status":{"podIP":"198.51.100.66","podIPs":[{"ip":"198.51.100.66"}]}}`)
	})
}
