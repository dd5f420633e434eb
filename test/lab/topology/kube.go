package topology

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// Ports every lab Service exposes and every lab pod serves: well-known ports
// that NodePort services could not offer.
const (
	TCPPort = 80
	UDPPort = 53
)

func (l *Lab) connectKube(ctx context.Context) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(l.Opts.KubeDir, "admin.kubeconfig"))
	if err != nil {
		return fmt.Errorf("admin kubeconfig: %w", err)
	}
	cfg.QPS, cfg.Burst = 100, 200
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	l.Kube = cs
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := cs.Discovery().ServerVersion()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("API server at %s (relayed to %s) not reachable: %w", l.Opts.APIAddr, l.Opts.Upstream, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// createClusterObjects creates the namespace, the Nodes (tunnel ones
// labelled node=tunnel) with their IPv4 and IPv6 InternalIPs, and a
// running, ready Pod with nodeName and both pod IPs for every pod
// namespace, as a dual-stack cluster has them.
func (l *Lab) createClusterObjects(ctx context.Context) error {
	// The pods' namespace and the routers' status namespace (the
	// manifest creates it in a cluster).
	for _, name := range []string{l.Opts.Namespace, routerstatus.DefaultNamespace} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if _, err := l.Kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create namespace %s: %w", name, err)
		}
	}
	// The routers read their seed from its Secret, as in a cluster.
	if err := l.writeSeedSecret(ctx); err != nil {
		return err
	}
	for _, n := range l.Nodes() {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: map[string]string{}}}
		if n.Tunnel {
			node.Labels["node"] = "tunnel"
		}
		if n.PodCIDR.IsValid() {
			node.Spec.PodCIDR = n.PodCIDR.String()
			node.Spec.PodCIDRs = []string{n.PodCIDR.String(), n.PodCIDR6.String()}
		}
		_ = l.Kube.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{})
		created, err := l.Kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create node %s: %w", n.Name, err)
		}
		created.Status.Addresses = []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: n.Addr.String()},
			{Type: corev1.NodeInternalIP, Address: n.Addr6.String()},
			{Type: corev1.NodeHostName, Address: n.Name},
		}
		created.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
		if _, err := l.Kube.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("node %s status: %w", n.Name, err)
		}
	}
	for _, p := range l.Pods {
		if err := l.createPod(ctx, p); err != nil {
			return err
		}
	}
	return nil
}

func (l *Lab) createPod(ctx context.Context, p *Pod) error {
	pods := l.Kube.CoreV1().Pods(l.Opts.Namespace)
	_ = pods.Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Labels: l.Opts.PodLabels},
		Spec: corev1.PodSpec{NodeName: p.Node.Name, Containers: []corev1.Container{{
			Name: "server", Image: "lab/server:1",
			Ports: []corev1.ContainerPort{{ContainerPort: TCPPort, Protocol: corev1.ProtocolTCP}, {ContainerPort: UDPPort, Protocol: corev1.ProtocolUDP}},
		}}},
	}
	created, err := pods.Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create pod %s: %w", p.Name, err)
	}
	created.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: p.Addr.String(), PodIPs: []corev1.PodIP{{IP: p.Addr.String()}, {IP: p.Addr6.String()}},
		HostIP: p.Node.Addr.String(), HostIPs: []corev1.HostIP{{IP: p.Node.Addr.String()}, {IP: p.Node.Addr6.String()}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
	}
	updated, err := pods.UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("pod %s status: %w", p.Name, err)
	}
	p.UID = updated.UID
	return nil
}

// AnnotatePod sets the annotation key of the pod's Pod object to value, or
// removes it when value is "" (e.g. cmd.nu/tunnel-drain, which the routers
// watch on Pods).
func (l *Lab) AnnotatePod(ctx context.Context, p *Pod, key, value string) error {
	var v any = value
	if value == "" {
		v = nil // a JSON merge patch removes a key set to null
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{key: v}}})
	if err != nil {
		return err
	}
	if _, err := l.Kube.CoreV1().Pods(l.Opts.Namespace).Patch(ctx, p.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("annotate pod %s %s=%q: %w", p.Name, key, value, err)
	}
	return nil
}

// deleteClusterObjects deletes the lab's Pods and Services (the namespace
// stays: without a controller-manager it would never finish terminating).
func (l *Lab) deleteClusterObjects(ctx context.Context) error {
	now := metav1.DeleteOptions{GracePeriodSeconds: new(int64)}
	if err := l.Kube.CoreV1().Pods(l.Opts.Namespace).DeleteCollection(ctx, now, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete lab pods: %w", err)
	}
	svcs, err := l.Kube.CoreV1().Services(l.Opts.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list lab services: %w", err)
	}
	for _, s := range svcs.Items {
		if err := l.DeleteService(ctx, s.Name); err != nil {
			return err
		}
	}
	return nil
}

// Service is a lab Service: TCPPort and UDPPort, backed by lab pods.
type Service struct {
	Name string
	// Annotation is the raw value of cmd.nu/tunnel ("" removes it): a
	// tunnel IP, or anything else to test bad input.
	Annotation string
	Endpoints  []Endpoint
	// ClientAffinity sets spec.sessionAffinity to ClientIP.
	ClientAffinity bool
	// Families are the Service's spec.ipFamilies, fixed when it is
	// created. Empty (or IPv4 alone) is an IPv4 ClusterIP Service with a
	// selector and one EndpointSlice of the pods' IPv4 addresses, NAME-lab.
	// Anything else ([IPv4, IPv6] for dual-stack, [IPv6] for IPv6 only) is
	// headless and without a selector (clusterIP None: the lab's API server
	// has an IPv4 service range only, and a headless Service without a
	// selector is the one kind it lets have any families), with ipFamilyPolicy
	// RequireDualStack or SingleStack, and gets one EndpointSlice per family
	// as the endpoint slice controller would write them: NAME-lab (addressType
	// IPv4) and NAME-lab6 (addressType IPv6, the pods' IPv6 addresses).
	Families []corev1.IPFamily
}

// DualStack are the families of a dual-stack Service.
var DualStack = []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol}

// ipv4Only reports whether families describe the lab's classic IPv4
// Service.
func ipv4Only(families []corev1.IPFamily) bool {
	return len(families) == 0 || len(families) == 1 && families[0] == corev1.IPv4Protocol
}

// Endpoint is one pod of a Service's EndpointSlice with its conditions.
type Endpoint struct {
	Pod *Pod
	// Terminating marks the endpoint serving but not ready (draining).
	Terminating bool
}

// Ready returns ready endpoints for pods.
func Ready(pods ...*Pod) []Endpoint {
	eps := make([]Endpoint, 0, len(pods))
	for _, p := range pods {
		eps = append(eps, Endpoint{Pod: p})
	}
	return eps
}

// ApplyService creates or updates the Service and its one EndpointSlice
// (named NAME-lab), as the endpoint slice controller would.
func (l *Lab) ApplyService(ctx context.Context, s Service) error {
	svcs := l.Kube.CoreV1().Services(l.Opts.Namespace)
	svc, err := svcs.Get(ctx, s.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		svc = &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: s.Name},
			Spec: corev1.ServiceSpec{Selector: l.Opts.PodLabels, Ports: []corev1.ServicePort{
				{Name: "tcp", Protocol: corev1.ProtocolTCP, Port: TCPPort, TargetPort: intstr.FromInt32(TCPPort)},
				{Name: "udp", Protocol: corev1.ProtocolUDP, Port: UDPPort, TargetPort: intstr.FromInt32(UDPPort)},
			}},
		}
		if !ipv4Only(s.Families) {
			policy := corev1.IPFamilyPolicySingleStack
			if len(s.Families) > 1 {
				policy = corev1.IPFamilyPolicyRequireDualStack
			}
			svc.Spec.Selector = nil
			svc.Spec.ClusterIP = corev1.ClusterIPNone
			svc.Spec.IPFamilies, svc.Spec.IPFamilyPolicy = s.Families, &policy
		}
	} else if err != nil {
		return fmt.Errorf("get service %s: %w", s.Name, err)
	}
	if s.Annotation != "" {
		if svc.Annotations == nil {
			svc.Annotations = map[string]string{}
		}
		svc.Annotations[tunnelclaim.Annotation] = s.Annotation
	} else {
		delete(svc.Annotations, tunnelclaim.Annotation)
	}
	svc.Spec.SessionAffinity = corev1.ServiceAffinityNone
	if s.ClientAffinity {
		svc.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
	}
	if svc.ResourceVersion == "" {
		_, err = svcs.Create(ctx, svc, metav1.CreateOptions{})
	} else {
		_, err = svcs.Update(ctx, svc, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("write service %s: %w", s.Name, err)
	}
	if ipv4Only(s.Families) {
		return l.ApplyEndpoints(ctx, s.Name, s.Endpoints)
	}
	return l.ApplyEndpointSlices(ctx, s.Name, s.Families, s.Endpoints)
}

// ApplyEndpoints creates or updates the one EndpointSlice (NAME-lab) of
// Service name, as the endpoint slice controller would; for Services
// created otherwise, e.g. from a manifest.
func (l *Lab) ApplyEndpoints(ctx context.Context, service string, endpoints []Endpoint) error {
	return l.applySlice(ctx, service, discoveryv1.AddressTypeIPv4, endpoints)
}

// ApplyEndpointSlices creates or updates the EndpointSlice of each of the
// families of Service name (NAME-lab for IPv4, NAME-lab6 for IPv6) with
// the endpoints' addresses of that family, and deletes the lab slice of
// the other family if there is one.
func (l *Lab) ApplyEndpointSlices(ctx context.Context, service string, families []corev1.IPFamily, endpoints []Endpoint) error {
	want := map[discoveryv1.AddressType]bool{}
	for _, f := range families {
		switch f {
		case corev1.IPv4Protocol:
			want[discoveryv1.AddressTypeIPv4] = true
		case corev1.IPv6Protocol:
			want[discoveryv1.AddressTypeIPv6] = true
		default:
			return fmt.Errorf("endpoint slices of %s: unknown IP family %q", service, f)
		}
	}
	slices := l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace)
	for _, at := range []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6} {
		if want[at] {
			if err := l.applySlice(ctx, service, at, endpoints); err != nil {
				return err
			}
			continue
		}
		name := sliceName(service, at)
		if err := slices.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete endpoint slice %s: %w", name, err)
		}
	}
	return nil
}

// sliceName is the name of the lab's EndpointSlice of a Service for one
// address type: NAME-lab (IPv4), NAME-lab6 (IPv6).
func sliceName(service string, at discoveryv1.AddressType) string {
	if at == discoveryv1.AddressTypeIPv6 {
		return service + "-lab6"
	}
	return service + "-lab"
}

// applySlice creates or updates the Service's EndpointSlice of address type
// at, with each endpoint's pod address of that family.
func (l *Lab) applySlice(ctx context.Context, service string, at discoveryv1.AddressType, endpoints []Endpoint) error {
	slices := l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace)
	tcp, udp := corev1.ProtocolTCP, corev1.ProtocolUDP
	tcpName, udpName := "tcp", "udp"
	tcpPort, udpPort := int32(TCPPort), int32(UDPPort)
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: sliceName(service, at), Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: at,
		Ports: []discoveryv1.EndpointPort{
			{Name: &tcpName, Protocol: &tcp, Port: &tcpPort},
			{Name: &udpName, Protocol: &udp, Port: &udpPort},
		},
	}
	for _, e := range endpoints {
		addr := e.Pod.Addr
		if at == discoveryv1.AddressTypeIPv6 {
			addr = e.Pod.Addr6
		}
		node := e.Pod.Node.Name
		ready, serving, terminating := !e.Terminating, true, e.Terminating
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
			Addresses: []string{addr.String()},
			NodeName:  &node,
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: l.Opts.Namespace, Name: e.Pod.Name, UID: e.Pod.UID},
			Conditions: discoveryv1.EndpointConditions{
				Ready: &ready, Serving: &serving, Terminating: &terminating,
			},
		})
	}
	existing, err := slices.Get(ctx, es.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = slices.Create(ctx, es, metav1.CreateOptions{})
	case err == nil:
		es.ResourceVersion = existing.ResourceVersion
		_, err = slices.Update(ctx, es, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("write endpoint slice %s: %w", es.Name, err)
	}
	return nil
}

// DeleteService deletes the Service and its EndpointSlice.
func (l *Lab) DeleteService(ctx context.Context, name string) error {
	err := l.Kube.CoreV1().Services(l.Opts.Namespace).Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete service %s: %w", name, err)
	}
	err = l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace).DeleteCollection(ctx, metav1.DeleteOptions{},
		metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + name})
	if err != nil {
		return fmt.Errorf("delete endpoint slices of %s: %w", name, err)
	}
	return nil
}

// Events returns the events recorded on the Service.
func (l *Lab) Events(ctx context.Context, service string) ([]corev1.Event, error) {
	evs, err := l.Kube.CoreV1().Events(l.Opts.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Service,involvedObject.name=" + service,
	})
	if err != nil {
		return nil, fmt.Errorf("events of service %s: %w", service, err)
	}
	return evs.Items, nil
}

// writeSeedSecret stores Opts.Seed in the Secret the routers read it from
// (the manifest's seedsecret.DefaultNamespace/DefaultName), replacing the
// one a previous lab left.
func (l *Lab) writeSeedSecret(ctx context.Context) error {
	ref := seedsecret.Ref{Namespace: seedsecret.DefaultNamespace, Name: seedsecret.DefaultName}
	secrets := l.Kube.CoreV1().Secrets(ref.Namespace)
	if err := secrets.Delete(ctx, ref.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting secret %s: %w", ref, err)
	}
	if _, err := secrets.Create(ctx, seedsecret.New(ref, l.Opts.Seed), metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating secret %s: %w", ref, err)
	}
	return nil
}
