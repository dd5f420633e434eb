package topology

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// kubeLab is a Lab with its hosts named as Up names them and a client of a
// real API server, but no network: what the Kubernetes side needs.
func kubeLab(t *testing.T) *Lab {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: starts an API server")
	}
	env := kubeenv.Start(t)
	cs, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{}
	if err := opts.setDefaults(false); err != nil {
		t.Fatal(err)
	}
	l := &Lab{Opts: opts, Kube: cs}
	w := &Node{
		Host:    Host{Name: "worker-a", Addr: fabricAddr(21), Addr6: fabricAddr6(21)},
		PodCIDR: netip.MustParsePrefix("10.244.1.0/24"), PodCIDR6: netip.MustParsePrefix("fd00:10:244:1::/64"),
	}
	l.Workers = []*Node{w}
	l.Routers = []*Node{{Host: Host{Name: "router-a", Addr: fabricAddr(11), Addr6: fabricAddr6(11)}, Tunnel: true}}
	l.Pods = []*Pod{{Host: Host{Name: "pod-a1", Addr: netip.MustParseAddr("10.244.1.11"), Addr6: mirror6(w.PodCIDR6, 11)}, Node: w}}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: seedsecret.DefaultNamespace}}
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return l
}

// TestDualStackObjects checks against a real API server that the lab's
// Nodes and Pods are dual-stack, and that Services of every family are
// accepted with the EndpointSlices a controller would write.
func TestDualStackObjects(t *testing.T) {
	ctx := context.Background()
	l := kubeLab(t)
	if err := l.createClusterObjects(ctx); err != nil {
		t.Fatal(err)
	}
	node, err := l.Kube.CoreV1().Nodes().Get(ctx, "worker-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var internal []string
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			internal = append(internal, a.Address)
		}
	}
	if want := []string{"172.20.0.21", "fd00:172:20::21"}; !slices.Equal(internal, want) {
		t.Errorf("node InternalIPs %v, want %v", internal, want)
	}
	if want := []string{"10.244.1.0/24", "fd00:10:244:1::/64"}; !slices.Equal(node.Spec.PodCIDRs, want) || node.Spec.PodCIDR != want[0] {
		t.Errorf("node pod CIDRs %q %v, want %v", node.Spec.PodCIDR, node.Spec.PodCIDRs, want)
	}
	pod, err := l.Kube.CoreV1().Pods(l.Opts.Namespace).Get(ctx, "pod-a1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Status.PodIP != "10.244.1.11" || len(pod.Status.PodIPs) != 2 || pod.Status.PodIPs[1].IP != "fd00:10:244:1::11" {
		t.Errorf("pod IPs %q %v", pod.Status.PodIP, pod.Status.PodIPs)
	}

	for _, tc := range []struct {
		name      string
		families  []corev1.IPFamily
		wantTypes []discoveryv1.AddressType
		wantAddrs []string
		headless  bool
	}{
		{"classic", nil, []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4}, []string{"10.244.1.11"}, false},
		{"dual", DualStack, []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6}, []string{"10.244.1.11", "fd00:10:244:1::11"}, true},
		{"six", []corev1.IPFamily{corev1.IPv6Protocol}, []discoveryv1.AddressType{discoveryv1.AddressTypeIPv6}, []string{"fd00:10:244:1::11"}, true},
	} {
		s := Service{Name: tc.name, Annotation: "192.0.2.10", Endpoints: Ready(l.Pods...), Families: tc.families}
		if err := l.ApplyService(ctx, s); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		// Applying again updates in place.
		if err := l.ApplyService(ctx, s); err != nil {
			t.Fatalf("%s again: %v", tc.name, err)
		}
		svc, err := l.Kube.CoreV1().Services(l.Opts.Namespace).Get(ctx, tc.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if headless := svc.Spec.ClusterIP == corev1.ClusterIPNone; headless != tc.headless {
			t.Errorf("%s: clusterIP %q", tc.name, svc.Spec.ClusterIP)
		}
		want := tc.families
		if want == nil {
			want = []corev1.IPFamily{corev1.IPv4Protocol}
		}
		if !slices.Equal(svc.Spec.IPFamilies, want) {
			t.Errorf("%s: ipFamilies %v, want %v", tc.name, svc.Spec.IPFamilies, want)
		}
		list, err := l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + tc.name})
		if err != nil {
			t.Fatal(err)
		}
		var types []discoveryv1.AddressType
		var addrs []string
		for _, es := range list.Items {
			types = append(types, es.AddressType)
			for _, e := range es.Endpoints {
				addrs = append(addrs, e.Addresses...)
			}
		}
		slices.Sort(types)
		slices.Sort(addrs)
		if !slices.Equal(types, tc.wantTypes) || !slices.Equal(addrs, tc.wantAddrs) {
			t.Errorf("%s: slices of types %v with %v, want %v with %v", tc.name, types, addrs, tc.wantTypes, tc.wantAddrs)
		}
	}
	// Dropping a family drops its slice.
	if err := l.ApplyEndpointSlices(ctx, "dual", []corev1.IPFamily{corev1.IPv6Protocol}, Ready(l.Pods...)); err != nil {
		t.Fatal(err)
	}
	list, err := l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=dual"})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 1 || list.Items[0].Name != "dual-lab6" {
		t.Errorf("after dropping IPv4: %d slices", len(list.Items))
	}
}
