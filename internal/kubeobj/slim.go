package kubeobj

import (
	"fmt"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// AnnotationPrefix starts every annotation the daemons read (the tunnel IP,
// draining): SlimService and SlimPod keep those and drop the others.
const AnnotationPrefix = "cmd.nu/"

// The informers' transforms: both daemons watch every Service and
// EndpointSlice (and Node) of the cluster, so what their caches hold of
// each object is most of their memory in a large cluster. Each transform
// keeps the fields the daemons read, and what an event on the object needs
// (name, namespace, UID, resourceVersion), and drops the rest: managedFields,
// other tools' annotations (kubectl's last-applied-configuration is a copy
// of the whole object), topology hints. Services, Nodes and Pods keep their
// types, so listers work unchanged; EndpointSlices become the daemons' own
// *EndpointSlice. A transform returns an object of another type as it is (a
// tombstone, for example).

// SlimService keeps a Service's identity, creation time, the daemons'
// annotations, the fields of its spec they read (type and
// loadBalancerClass, for the status they publish; sessionAffinity, for the
// hash; each port's protocol, port and targetPort, for the router's port
// filter), the selector of a Service that carries one of the daemons'
// annotations (the agent's readiness gate: which tunnel Services a new pod
// will be listed for), and its status.loadBalancer. A daemon that starts
// reading another field of the spec adds it here
// (TestSlimServiceKeepsWhatTheDaemonsRead lists them).
func SlimService(obj any) (any, error) {
	svc, ok := obj.(*corev1.Service)
	if !ok {
		return obj, nil
	}
	slim := &corev1.Service{ObjectMeta: slimMeta(svc.ObjectMeta)}
	slim.Spec.Type = corev1.ServiceType(sharedStrings.intern(string(svc.Spec.Type)))
	slim.Spec.LoadBalancerClass = svc.Spec.LoadBalancerClass
	slim.Spec.SessionAffinity = corev1.ServiceAffinity(sharedStrings.intern(string(svc.Spec.SessionAffinity)))
	for _, p := range svc.Spec.Ports {
		slim.Spec.Ports = append(slim.Spec.Ports, corev1.ServicePort{Protocol: p.Protocol, Port: p.Port, TargetPort: p.TargetPort})
	}
	if len(slim.Annotations) > 0 {
		slim.Spec.Selector = svc.Spec.Selector
	}
	slim.Status.LoadBalancer = svc.Status.LoadBalancer
	return slim, nil
}

// SlimEndpointSlice turns a discovery/v1 EndpointSlice into the daemons'
// own *EndpointSlice (NewEndpointSlice): its listers and handlers see that
// type.
func SlimEndpointSlice(obj any) (any, error) {
	es, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	return NewEndpointSlice(es), nil
}

// SlimPod keeps a Pod's identity and the daemons' annotations (the router
// reads nothing else of a Pod).
func SlimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return &corev1.Pod{ObjectMeta: slimMeta(pod.ObjectMeta)}, nil
}

// SlimPeerPod keeps what a NetworkPolicy peer is matched by: a Pod's
// identity, labels, host-network flag, phase and addresses (the endpoint
// agent's cache of every pod of the cluster, with network policy on).
func SlimPeerPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	slim := &corev1.Pod{ObjectMeta: slimMeta(pod.ObjectMeta)}
	slim.Labels = pod.Labels
	slim.Spec.HostNetwork = pod.Spec.HostNetwork
	slim.Status.Phase = pod.Status.Phase
	slim.Status.PodIP, slim.Status.PodIPs = pod.Status.PodIP, pod.Status.PodIPs
	return slim, nil
}

// SlimNode keeps a Node's identity, labels (BGP peer selectors), pod ranges
// and addresses: not its images, conditions or capacity.
func SlimNode(obj any) (any, error) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	slim := &corev1.Node{ObjectMeta: slimMeta(node.ObjectMeta)}
	slim.Labels = node.Labels
	slim.Spec.PodCIDR, slim.Spec.PodCIDRs = node.Spec.PodCIDR, node.Spec.PodCIDRs
	slim.Status.Addresses = node.Status.Addresses
	return slim, nil
}

// slimMeta keeps an object's identity, creation and deletion times, and
// the annotations under AnnotationPrefix. Objects of one namespace share
// its name's bytes.
func slimMeta(m metav1.ObjectMeta) metav1.ObjectMeta {
	slim := metav1.ObjectMeta{
		Name: m.Name, Namespace: sharedStrings.intern(m.Namespace), UID: m.UID, ResourceVersion: m.ResourceVersion,
		CreationTimestamp: m.CreationTimestamp, DeletionTimestamp: m.DeletionTimestamp,
	}
	for k, v := range m.Annotations {
		if strings.HasPrefix(k, AnnotationPrefix) {
			if slim.Annotations == nil {
				slim.Annotations = map[string]string{}
			}
			slim.Annotations[k] = v
		}
	}
	return slim
}

// sharedStrings interns the strings that repeat across the cached objects
// (namespaces, node names, Service types): 100,000 endpoints on 100 nodes
// point at 100 node names, not at 100,000 copies. unique.Make would not do:
// its table forgets a string once no Handle is left, so Value()'s bytes
// stop being shared after the next garbage collection.
var sharedStrings = &interner{limit: 1 << 16}

// interner shares equal strings. Past limit distinct strings (the node
// names of a cluster that renamed its nodes many times over) it starts
// afresh: the strings handed out stay valid, later ones are merely not
// shared with them.
type interner struct {
	mu      sync.Mutex
	limit   int
	strings map[string]string
}

func (in *interner) intern(s string) string {
	if s == "" {
		return ""
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if shared, ok := in.strings[s]; ok {
		return shared
	}
	if in.strings == nil || len(in.strings) >= in.limit {
		in.strings = map[string]string{}
	}
	shared := strings.Clone(s)
	in.strings[shared] = shared
	return shared
}

// Slim is the transform of every informer of both daemons: SlimService,
// SlimEndpointSlice, SlimNode or SlimPod by the object's type; anything
// else (a tombstone, for example) as it is.
func Slim(obj any) (any, error) {
	switch obj.(type) {
	case *corev1.Service:
		return SlimService(obj)
	case *discoveryv1.EndpointSlice:
		return SlimEndpointSlice(obj)
	case *corev1.Node:
		return SlimNode(obj)
	case *corev1.Pod:
		return SlimPod(obj)
	}
	return obj, nil
}

// SetTransforms gives each informer the Slim transform. Call it before the
// informers start.
func SetTransforms(informers ...cache.SharedIndexInformer) error {
	for _, informer := range informers {
		if err := informer.SetTransform(Slim); err != nil {
			return fmt.Errorf("slimming an informer's cache: %w", err)
		}
	}
	return nil
}
