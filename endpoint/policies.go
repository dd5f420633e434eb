package endpoint

import (
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	networkinglisters "k8s.io/client-go/listers/networking/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
)

// policyWatch is what the agent reads to enforce NetworkPolicy on tunneled
// traffic: every NetworkPolicy, Namespace and Pod of the cluster (a peer
// selects pods anywhere; their addresses are the sources it admits).
type policyWatch struct {
	policies   networkinglisters.NetworkPolicyLister
	namespaces corelisters.NamespaceLister
	pods       corelisters.PodLister
}

// watchPolicies adds the informers and handlers of network policy to c:
// any change to a policy, to a namespace's labels, or to a pod's labels,
// addresses or phase while some policy exists recomputes the desired
// state (only the pods whose rules change are written).
func (c *Controller) watchPolicies(inf Informers) error {
	npInformer := inf.Cluster.Networking().V1().NetworkPolicies()
	nsInformer := inf.Cluster.Core().V1().Namespaces()
	podInformer := inf.Cluster.Core().V1().Pods()
	if err := podInformer.Informer().SetTransform(kubeobj.SlimPeerPod); err != nil {
		return fmt.Errorf("slimming the pods' cache: %w", err)
	}
	c.policy = &policyWatch{policies: npInformer.Lister(), namespaces: nsInformer.Lister(), pods: podInformer.Lister()}
	recompute := func(any) { c.queue.Add(desiredKey) }
	anyPolicy := func() bool {
		l, err := c.policy.policies.List(labels.Everything())
		return err != nil || len(l) > 0
	}
	handlers := map[string]struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		"networkpolicies": {npInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: recompute, UpdateFunc: func(_, obj any) { recompute(obj) }, DeleteFunc: recompute,
		}},
		"namespaces": {nsInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: recompute,
			UpdateFunc: func(old, obj any) {
				if !maps.Equal(old.(*corev1.Namespace).Labels, obj.(*corev1.Namespace).Labels) {
					recompute(obj)
				}
			},
			DeleteFunc: recompute,
		}},
		"all-pods": {podInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: func(obj any) {
				if anyPolicy() {
					recompute(obj)
				}
			},
			UpdateFunc: func(old, obj any) {
				o, n := old.(*corev1.Pod), obj.(*corev1.Pod)
				if anyPolicy() && (!maps.Equal(o.Labels, n.Labels) || o.Status.PodIP != n.Status.PodIP || !slices.Equal(o.Status.PodIPs, n.Status.PodIPs) || o.Status.Phase != n.Status.Phase) {
					recompute(obj)
				}
			},
			DeleteFunc: func(obj any) {
				if anyPolicy() {
					recompute(obj)
				}
			},
		}},
	}
	for name, h := range handlers {
		if _, err := h.inf.AddEventHandler(h.h); err != nil {
			return fmt.Errorf("adding event handler: %w", err)
		}
		c.liveness.Watch(name, h.inf)
		c.synced = append(c.synced, h.inf.HasSynced)
	}
	return nil
}

// withPolicies sets the policy rules of every pod of desired; localPods
// are the node's pods. It returns the problems to log.
func (w *policyWatch) withPolicies(desired map[string]PodTunnels, localPods []*corev1.Pod) ([]string, error) {
	policies, err := w.policies.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("listing networkpolicies: %w", err)
	}
	byKey := make(map[string]*corev1.Pod, len(localPods))
	for _, p := range localPods {
		byKey[p.Namespace+"/"+p.Name] = p
	}
	if len(policies) == 0 {
		// Nothing isolates any pod: each served pod gets its connection
		// tracking rule only.
		return WithPolicies(desired, byKey, nil, netpol.Cluster{}), nil
	}
	namespaces, err := w.namespaces.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("listing namespaces: %w", err)
	}
	pods, err := w.pods.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("listing pods: %w", err)
	}
	cluster := netpol.Cluster{Namespaces: make(map[string]*corev1.Namespace, len(namespaces)), Pods: pods}
	for _, ns := range namespaces {
		cluster.Namespaces[ns.Name] = ns
	}
	return WithPolicies(desired, byKey, policies, cluster), nil
}
