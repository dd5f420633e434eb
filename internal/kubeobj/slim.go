package kubeobj

import (
	"fmt"
	"strings"
	"sync"
	"unique"

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
// of the whole object), topology hints. The objects keep their types, so
// listers and event handlers work unchanged. A transform returns an object
// of another type as it is (a tombstone, for example).

// SlimService keeps a Service's identity, creation time, the daemons'
// annotations, the three fields of its spec they read (type and
// loadBalancerClass, for the status they publish; sessionAffinity, for the
// hash) and its status.loadBalancer. A daemon that starts reading another field of the
// spec adds it here (TestSlimServiceKeepsWhatTheDaemonsRead lists them).
func SlimService(obj any) (any, error) {
	svc, ok := obj.(*corev1.Service)
	if !ok {
		return obj, nil
	}
	slim := &corev1.Service{ObjectMeta: slimMeta(svc.ObjectMeta)}
	slim.Spec.Type = corev1.ServiceType(unique.Make(string(svc.Spec.Type)).Value())
	slim.Spec.LoadBalancerClass = svc.Spec.LoadBalancerClass
	slim.Spec.SessionAffinity = corev1.ServiceAffinity(unique.Make(string(svc.Spec.SessionAffinity)).Value())
	slim.Status.LoadBalancer = svc.Status.LoadBalancer
	return slim, nil
}

// SlimEndpointSlice keeps a slice's identity, labels (the Service it
// belongs to), address type, and of each endpoint its addresses,
// conditions, node and target Pod. The endpoints are copied into exactly
// sized memory, the conditions of all endpoints share three booleans, and
// the endpoints of one node share one node name (see internNodeName).
func SlimEndpointSlice(obj any) (any, error) {
	es, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	slim := &discoveryv1.EndpointSlice{ObjectMeta: slimMeta(es.ObjectMeta), AddressType: es.AddressType}
	slim.Labels = es.Labels
	slim.Endpoints = make([]discoveryv1.Endpoint, len(es.Endpoints))
	for i, ep := range es.Endpoints {
		out := &slim.Endpoints[i]
		out.Addresses = ep.Addresses[:len(ep.Addresses):len(ep.Addresses)]
		out.Conditions = discoveryv1.EndpointConditions{
			Ready: sharedBool(ep.Conditions.Ready), Serving: sharedBool(ep.Conditions.Serving), Terminating: sharedBool(ep.Conditions.Terminating),
		}
		out.NodeName = nodeNames.intern(ep.NodeName)
		if ref := ep.TargetRef; ref != nil {
			out.TargetRef = &corev1.ObjectReference{
				Kind: unique.Make(ref.Kind).Value(), Namespace: unique.Make(ref.Namespace).Value(), Name: ref.Name, UID: ref.UID,
			}
		}
	}
	return slim, nil
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
		Name: m.Name, Namespace: unique.Make(m.Namespace).Value(), UID: m.UID, ResourceVersion: m.ResourceVersion,
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

// nodeNames are the node names of the endpoints in the daemons' caches:
// 100,000 endpoints on 100 nodes point at 100 strings, not at 100,000
// copies (3 MB at 10,000 Services of 10 endpoints).
var nodeNames = &stringPointers{limit: 1 << 16}

// stringPointers interns pointers to strings: every pointer to an equal
// string is replaced by one shared pointer. No one writes through a cached
// object's pointers. Past limit distinct strings (node names of a cluster
// that renamed its nodes many times over) it starts afresh: the pointers
// handed out stay valid, later ones are merely not shared with them.
type stringPointers struct {
	mu    sync.Mutex
	limit int
	ptrs  map[string]*string
}

func (s *stringPointers) intern(p *string) *string {
	if p == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if shared, ok := s.ptrs[*p]; ok {
		return shared
	}
	if s.ptrs == nil || len(s.ptrs) >= s.limit {
		s.ptrs = map[string]*string{}
	}
	shared := new(string)
	*shared = unique.Make(*p).Value()
	s.ptrs[*shared] = shared
	return shared
}

var (
	sharedTrue  = true
	sharedFalse = false
)

// sharedBool points at one of two package-level booleans with b's value
// (nil stays nil). No one writes through a cached object's pointers.
func sharedBool(b *bool) *bool {
	switch {
	case b == nil:
		return nil
	case *b:
		return &sharedTrue
	default:
		return &sharedFalse
	}
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
