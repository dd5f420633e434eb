package status

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
)

func inPool(ip netip.Addr) bool {
	return netip.MustParsePrefix("192.0.2.0/24").Contains(ip) || netip.MustParsePrefix("2001:db8::/64").Contains(ip)
}

func lbService(class *string, ingress ...string) *corev1.Service {
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, LoadBalancerClass: class},
	}
	for _, ip := range ingress {
		svc.Status.LoadBalancer.Ingress = append(svc.Status.LoadBalancer.Ingress, corev1.LoadBalancerIngress{IP: ip})
	}
	return svc
}

func ips(in []corev1.LoadBalancerIngress) []string {
	var out []string
	for _, i := range in {
		mode := ""
		if i.IPMode != nil {
			mode = "/" + string(*i.IPMode)
		}
		out = append(out, i.IP+mode)
	}
	return out
}

func TestDesiredIngress(t *testing.T) {
	ours, other := LoadBalancerClass, "example.com/other-lb"
	vip := []netip.Addr{netip.MustParseAddr("192.0.2.10")}
	dual := []netip.Addr{netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")}
	cluster := lbService(nil)
	cluster.Spec.Type = corev1.ServiceTypeClusterIP
	for _, tc := range []struct {
		name   string
		svc    *corev1.Service
		vips   []netip.Addr
		want   []string
		manage bool
	}{
		{"served, no class", lbService(nil), vip, []string{"192.0.2.10/Proxy"}, true},
		{"served, our class", lbService(&ours), vip, []string{"192.0.2.10/Proxy"}, true},
		{"another class is never touched", lbService(&other, "192.0.2.99"), vip, nil, false},
		{"not a LoadBalancer", cluster, vip, nil, false},
		{"a stale own entry is replaced, others kept", lbService(nil, "198.51.100.7", "192.0.2.99"), vip, []string{"192.0.2.10/Proxy", "198.51.100.7"}, true},
		{"not served: own entries removed, others kept", lbService(nil, "192.0.2.10", "198.51.100.7"), nil, []string{"198.51.100.7"}, true},
		{"not served, nothing of ours", lbService(nil), nil, nil, true},
		{"dual-stack: both tunnel IPs, IPv4 first", lbService(nil, "198.51.100.7"), dual, []string{"192.0.2.10/Proxy", "2001:db8::10/Proxy", "198.51.100.7"}, true},
		{"a family no longer served is removed", lbService(nil, "192.0.2.10", "2001:db8::10"), vip, []string{"192.0.2.10/Proxy"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, manage := DesiredIngress(tc.svc, tc.vips, inPool)
			if manage != tc.manage || !slices.Equal(ips(got), tc.want) {
				t.Errorf("DesiredIngress = %v, %v; want %v, %v", ips(got), manage, tc.want, tc.manage)
			}
		})
	}
}

// TestStatusWriterWritesOnlyChanges checks the writer against a fake API:
// it patches when the status differs and not again when it already matches.
func TestStatusWriterWritesOnlyChanges(t *testing.T) {
	svc := lbService(nil, "198.51.100.7")
	client := fake.NewClientset(svc)
	factory := informers.NewSharedInformerFactory(client, 0)
	lister := factory.Core().V1().Services().Lister()
	informer := factory.Core().V1().Services().Informer()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	factory.Start(ctx.Done())
	cache.WaitForCacheSync(ctx.Done(), informer.HasSynced)
	w := NewWriter(client, lister, inPool, seamtest.QuietLog())

	patches := func() int {
		n := 0
		for _, a := range client.Actions() {
			if a.GetVerb() == "patch" && a.GetSubresource() == "status" {
				n++
			}
		}
		return n
	}
	step := func(vips ...netip.Addr) {
		t.Helper()
		w.Set("default/web", vips)
		if !w.processNext(ctx) {
			t.Fatal("queue shut down")
		}
	}
	waitFor := func(want []string) {
		t.Helper()
		for range 200 {
			got, _ := lister.Services("default").Get("web")
			if slices.Equal(ips(got.Status.LoadBalancer.Ingress), want) {
				return
			}
			time.Sleep(10 * time.Millisecond) // the informer delivers the patched object
		}
		got, _ := lister.Services("default").Get("web")
		t.Fatalf("status.loadBalancer.ingress = %v, want %v", ips(got.Status.LoadBalancer.Ingress), want)
	}

	step(netip.MustParseAddr("192.0.2.10"))
	waitFor([]string{"192.0.2.10/Proxy", "198.51.100.7"})
	if n := patches(); n != 1 {
		t.Fatalf("%d status patches, want 1", n)
	}
	step(netip.MustParseAddr("192.0.2.10")) // already as wanted
	if n := patches(); n != 1 {
		t.Errorf("%d status patches after an unchanged Set, want still 1", n)
	}
	step() // no longer served
	waitFor([]string{"198.51.100.7"})
	if n := patches(); n != 2 {
		t.Errorf("%d status patches, want 2", n)
	}
}
