package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
)

// createLoadBalancer creates a Service of type LoadBalancer claiming
// tunnelIP (none when empty), of the given spec.loadBalancerClass (nil: unset).
func createLoadBalancer(t *testing.T, cs kubernetes.Interface, ns, name, tunnelIP string, class *string) *corev1.Service {
	t.Helper()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{
			Type:                          corev1.ServiceTypeLoadBalancer,
			LoadBalancerClass:             class,
			AllocateLoadBalancerNodePorts: ptr(false),
			Selector:                      map[string]string{"app": name},
			Ports:                         []corev1.ServicePort{{Name: "http", Port: 80}},
		},
	}
	if tunnelIP != "" {
		svc.Annotations = map[string]string{tunnelclaim.Annotation: tunnelIP}
	}
	out, err := cs.CoreV1().Services(ns).Create(context.Background(), svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// ingressOf renders a Service's status.loadBalancer.ingress as "IP/ipMode"
// strings, as kubectl get svc -o wide would show the addresses.
func ingressOf(t *testing.T, cs kubernetes.Interface, ns, name string) ([]string, error) {
	svc, err := cs.CoreV1().Services(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	var out []string
	for _, in := range svc.Status.LoadBalancer.Ingress {
		s := in.IP
		if in.IPMode != nil {
			s += "/" + string(*in.IPMode)
		}
		out = append(out, s)
	}
	return out, nil
}

func waitIngress(t *testing.T, cs kubernetes.Interface, ns, name, why string, want ...string) {
	t.Helper()
	eventually(t, 15*time.Second, fmt.Sprintf("status.loadBalancer.ingress of %s/%s %s", ns, name, why), func() error {
		got, err := ingressOf(t, cs, ns, name)
		if err != nil {
			return err
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("got %q, want %q", got, want)
		}
		return nil
	})
}

// setIngress writes a Service's status as another load-balancer controller
// would.
func setIngress(t *testing.T, cs kubernetes.Interface, ns, name string, ips ...string) {
	t.Helper()
	svc, err := cs.CoreV1().Services(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	svc.Status.LoadBalancer.Ingress = nil
	for _, ip := range ips {
		svc.Status.LoadBalancer.Ingress = append(svc.Status.LoadBalancer.Ingress, corev1.LoadBalancerIngress{IP: ip})
	}
	if _, err := cs.CoreV1().Services(ns).UpdateStatus(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestRouterPublishesLoadBalancerIngress runs the router as its own
// ServiceAccount (so the manifest's services/status RBAC is exercised) and
// checks the tunnel IP appears in, and leaves, status.loadBalancer.ingress.
func TestRouterPublishesLoadBalancerIngress(t *testing.T) {
	cs := adminClient(t)
	startRouter(t, routerCfg(encap.GRE, 8))
	ns := freshNamespace(t, cs)
	// Namespaces are never deleted here (no controller-manager): remove the
	// Services so that their tunnel IPs do not outlive the test.
	t.Cleanup(func() {
		for _, name := range []string{"web", "newer", "refused", "other-class", "witness"} {
			_ = cs.CoreV1().Services(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
		}
	})
	const vip = "192.0.2.161"

	web := createLoadBalancer(t, cs, ns, "web", vip, nil)
	waitIngress(t, cs, ns, "web", "once served", vip+"/Proxy")

	// Another implementation's address (outside the pools) is kept (the
	// API server defaults its ipMode to VIP).
	setIngress(t, cs, ns, "web", "198.51.100.7")
	waitIngress(t, cs, ns, "web", "beside another controller's address", vip+"/Proxy", "198.51.100.7/VIP")

	// The loser of a conflict shows no address; it takes over the IP and
	// the status once the winner is gone.
	time.Sleep(1100 * time.Millisecond) // creationTimestamp has one-second resolution
	newer := createLoadBalancer(t, cs, ns, "newer", vip, nil)
	waitEvent(t, cs, newer, corev1.EventTypeWarning, router.ReasonConflict, ns+"/web")
	if got, err := ingressOf(t, cs, ns, "newer"); err != nil || len(got) != 0 {
		t.Errorf("the conflict's loser has status.loadBalancer.ingress %q (%v), want none", got, err)
	}
	if err := cs.CoreV1().Services(ns).Delete(context.Background(), web.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitIngress(t, cs, ns, "newer", "after the winner was deleted", vip+"/Proxy")

	// A refused tunnel IP (in no pool) is not published.
	refused := createLoadBalancer(t, cs, ns, "refused", "198.51.100.9", nil)
	waitEvent(t, cs, refused, corev1.EventTypeWarning, router.ReasonRefused, "no address pool")
	if got, err := ingressOf(t, cs, ns, "refused"); err != nil || len(got) != 0 {
		t.Errorf("a refused Service has status.loadBalancer.ingress %q (%v), want none", got, err)
	}

	// Removing the annotation withdraws the address.
	svc, err := cs.CoreV1().Services(ns).Get(context.Background(), "newer", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	delete(svc.Annotations, tunnelclaim.Annotation)
	if _, err := cs.CoreV1().Services(ns).Update(context.Background(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitIngress(t, cs, ns, "newer", "after its annotation was removed")

	// A Service of another load-balancer class is never touched, even with
	// the annotation and an address from the pool in its status.
	other := "example.com/other-lb"
	createLoadBalancer(t, cs, ns, "other-class", "192.0.2.162", &other)
	setIngress(t, cs, ns, "other-class", "192.0.2.99")
	ours := createLoadBalancer(t, cs, ns, "witness", "192.0.2.163", nil)
	// Once a later Service is published, the router has seen both.
	waitIngress(t, cs, ns, ours.Name, "of a Service created after the other-class one", "192.0.2.163/Proxy")
	if got, err := ingressOf(t, cs, ns, "other-class"); err != nil || !slices.Equal(got, []string{"192.0.2.99/VIP"}) {
		t.Errorf("another class's status.loadBalancer.ingress became %q (%v), want it untouched", got, err)
	}
}
