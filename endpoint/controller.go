package endpoint

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

// Queue items that are not one pod.
var (
	desiredKey = daemon.Job("desired") // recompute the desired state of every local pod
	nodeKey    = daemon.Job("node")    // converge the node's own namespace
	resyncKey  = daemon.Job("resync")  // check every local pod and the node again
)

// PodSyncer converges one pod's namespace (*PodNetwork).
type PodSyncer interface {
	Sync(ns netns.NsHandle, want PodTunnels) ([]PodChange, error)
}

// NodeSyncer converges the node's namespace (*NodeNetwork).
type NodeSyncer interface {
	Sync(served []PodTunnels, nodeIP netip.Addr) ([]NodeChange, error)
}

// Informers are the two informer factories the agent reads from: Services,
// EndpointSlices and Nodes cluster-wide (every Node's addresses and pod
// ranges are refused as tunnel IPs, as on the routers), and Pods of this node.
type Informers struct {
	Cluster, Pods informers.SharedInformerFactory
}

// NewInformers builds the factories for node; start them after NewController.
func NewInformers(client kubernetes.Interface, node string) Informers {
	return Informers{
		Cluster: informers.NewSharedInformerFactory(client, 0),
		Pods: informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		})),
	}
}

// Start starts every factory.
func (i Informers) Start(stop <-chan struct{}) {
	i.Cluster.Start(stop)
	i.Pods.Start(stop)
}

// Shutdown stops every factory and waits for their goroutines.
func (i Informers) Shutdown() {
	i.Cluster.Shutdown()
	i.Pods.Shutdown()
}

// nodeNetworksChanged reports whether a Node's addresses or pod ranges
// changed (status heartbeats change neither).
func nodeNetworksChanged(old, obj any) bool {
	o, n := old.(*corev1.Node), obj.(*corev1.Node)
	return o.Spec.PodCIDR != n.Spec.PodCIDR || !slices.Equal(o.Spec.PodCIDRs, n.Spec.PodCIDRs) ||
		!slices.Equal(o.Status.Addresses, n.Status.Addresses) || !maps.Equal(o.Labels, n.Labels)
}

// Controller keeps every local endpoint pod of a tunnel Service configured.
// Event handlers only queue keys; workers re-read the listers and converge
// one pod (or the node) at a time, so a pod whose namespace cannot be found
// is retried with back-off and holds up nothing else.
type Controller struct {
	cfg      Config
	live     *livepolicy.Policy // the address pools and ranges, which may change while running
	services corelisters.ServiceLister
	slices   cache.Store // *kubeobj.EndpointSlice
	pods     corelisters.PodLister
	nodes    corelisters.NodeLister
	synced   []cache.InformerSynced
	queue    workqueue.TypedRateLimitingInterface[daemon.QueueKey]
	// routeWait paces the syncs that wait for a pod's route (requeue).
	routeWait workqueue.TypedRateLimiter[daemon.QueueKey]
	liveness  daemon.Liveness
	locator   runtime.Locator
	podNet    PodSyncer
	nodeNet   NodeSyncer
	log       logrus.FieldLogger

	mu       sync.Mutex
	desired  map[string]PodTunnels
	clean    map[string]string // pod key -> identity found holding nothing of the agent's
	problems map[string]bool   // problems logged, so that each is logged once
	refused  map[string]string // Service key -> refusal logged, so that each is logged once
	// pending are the pods served at the first computation of the desired
	// state that have not been converged yet; nodeSynced reports the node's
	// first successful sync. Ready turns true once both are done.
	pending    map[string]bool
	nodeSynced bool
	ready      atomic.Bool
	metrics    *Metrics
	// Readiness gates (readiness.go): the writer of the pods' condition
	// (nil: gates are left alone); the desired state each pod's namespace
	// and the node's last converged to; the tunnel IPs of matching tunnel
	// Services that no EndpointSlice lists a gated pod for yet.
	conditions PodConditionWriter
	podDone    map[string]PodTunnels
	nodeDone   map[string]PodTunnels
	unlisted   map[string][]netip.Addr
	// gateViews are the local gated pods as the last recompute saw them
	// (gateView): a pod whose addresses came later waits for the next.
	gateViews map[string]string
	// opened are the pods (by UID) whose gate this agent opened: the
	// informer may not show the condition yet, and it is written once.
	opened map[string]types.UID
	// policy reads what network policy needs; nil when it is off.
	policy *policyWatch
}

// errDesiredStale: the pod changed since its desired state was computed; it
// is synced again once the desired state is recomputed.
var errDesiredStale = errors.New("the pod changed since its desired state was computed")

// NewController builds the controller on inf.
func NewController(cfg Config, inf Informers, locator runtime.Locator, podNet PodSyncer, nodeNet NodeSyncer, log logrus.FieldLogger) (*Controller, error) {
	svcInformer := inf.Cluster.Core().V1().Services()
	sliceInformer := inf.Cluster.Discovery().V1().EndpointSlices()
	podInformer := inf.Pods.Core().V1().Pods()
	nodeInformer := inf.Cluster.Core().V1().Nodes()
	// The caches of the cluster-wide informers keep only what the agent
	// reads of each object (see kubeobj.Slim); the local Pods stay
	// whole.
	if err := kubeobj.SetTransforms(svcInformer.Informer(), sliceInformer.Informer(), nodeInformer.Informer()); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg:      cfg,
		services: svcInformer.Lister(),
		slices:   sliceInformer.Informer().GetStore(),
		pods:     podInformer.Lister(),
		nodes:    nodeInformer.Lister(),
		synced: []cache.InformerSynced{svcInformer.Informer().HasSynced, sliceInformer.Informer().HasSynced,
			podInformer.Informer().HasSynced, nodeInformer.Informer().HasSynced},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[daemon.QueueKey](500*time.Millisecond, 2*time.Minute),
			workqueue.TypedRateLimitingQueueConfig[daemon.QueueKey]{Name: "tunnel-endpoint"}),
		routeWait: workqueue.NewTypedItemExponentialFailureRateLimiter[daemon.QueueKey](100*time.Millisecond, 2*time.Second),
		locator:   locator,
		podNet:    podNet,
		nodeNet:   nodeNet,
		log:       log,
		desired:   map[string]PodTunnels{},
		clean:     map[string]string{},
		problems:  map[string]bool{},
		refused:   map[string]string{},
		podDone:   map[string]PodTunnels{},
		nodeDone:  map[string]PodTunnels{},
		opened:    map[string]types.UID{},
		live:      livepolicy.New(cfg.Policy),
	}
	recompute := func(any) { c.queue.Add(desiredKey) }
	handlers := []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{svcInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: func(obj any) {
				if annotated(obj) {
					recompute(obj)
				}
			},
			UpdateFunc: func(old, obj any) {
				if annotated(old) || annotated(obj) {
					recompute(obj)
				}
			},
			DeleteFunc: recompute,
		}},
		{sliceInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    c.onSlice,
			UpdateFunc: func(_, obj any) { c.onSlice(obj) },
			DeleteFunc: recompute,
		}},
		{podInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: func(obj any) { c.enqueuePod(obj); recompute(obj) },
			UpdateFunc: func(old, obj any) {
				o, n := old.(*corev1.Pod), obj.(*corev1.Pod)
				if o.ResourceVersion != n.ResourceVersion {
					c.enqueuePod(obj)
				}
				if o.Status.PodIP != n.Status.PodIP || !slices.Equal(o.Status.PodIPs, n.Status.PodIPs) || o.Status.Phase != n.Status.Phase || o.UID != n.UID {
					recompute(obj)
				}
			},
			DeleteFunc: func(obj any) { c.enqueuePod(obj); recompute(obj) },
		}},
		{nodeInformer.Informer(), cache.ResourceEventHandlerFuncs{
			// Every Node's addresses and pod ranges decide which tunnel IPs
			// are admitted; this node's address also picks the MPLS input
			// interface. Status heartbeats change neither.
			AddFunc: func(obj any) {
				if c.ownNode(obj) {
					c.queue.Add(nodeKey)
				}
				recompute(obj)
			},
			UpdateFunc: func(old, obj any) {
				if c.ownNode(obj) && kubeobj.NodeAddress(old.(*corev1.Node)) != kubeobj.NodeAddress(obj.(*corev1.Node)) {
					c.queue.Add(nodeKey)
				}
				if nodeNetworksChanged(old, obj) {
					recompute(obj)
				}
			},
			DeleteFunc: recompute,
		}},
	}
	for name, informer := range map[string]cache.SharedIndexInformer{"services": svcInformer.Informer(),
		"endpointslices": sliceInformer.Informer(), "pods": podInformer.Informer(), "nodes": nodeInformer.Informer()} {
		c.liveness.Watch(name, informer)
	}
	for _, h := range handlers {
		if _, err := h.inf.AddEventHandler(h.h); err != nil {
			return nil, fmt.Errorf("adding event handler: %w", err)
		}
	}
	if cfg.NetworkPolicy {
		if err := c.watchPolicies(inf); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// ownNode reports whether obj is this node's Node.
func (c *Controller) ownNode(obj any) bool {
	node, ok := obj.(*corev1.Node)
	return ok && node.Name == c.cfg.NodeName
}

// annotated reports whether obj is a Service with the tunnel annotation.
func annotated(obj any) bool {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	svc, ok := obj.(*corev1.Service)
	if !ok {
		return false
	}
	_, ok = svc.Annotations[tunnelclaim.Annotation]
	return ok
}

// onSlice recomputes when the slice's Service is a tunnel Service.
func (c *Controller) onSlice(obj any) {
	es, ok := obj.(*kubeobj.EndpointSlice)
	if !ok {
		return
	}
	svc, err := c.services.Services(es.Namespace).Get(es.Service)
	if err == nil && !annotated(svc) {
		return
	}
	c.queue.Add(desiredKey)
}

func (c *Controller) enqueuePod(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		utilruntime.HandleError(err)
		return
	}
	c.queue.Add(daemon.ObjectKey(key))
}

// SetMetrics makes the controller record its metrics on m and hand the
// namespaces of the pods it serves to m's counters. Call it before Run.
func (c *Controller) SetMetrics(m *Metrics) { c.metrics = m }

// Healthy returns nil while the agent is alive: its informers run and no
// worker is stuck on one item (daemon.Liveness).
func (c *Controller) Healthy() error { return c.liveness.Check() }

// Ready reports whether the first full sync has succeeded: the desired state
// was computed, the node's namespace was converged, and so was every pod
// served at that first computation (or it stopped being served, or went).
// A served pod that cannot be converged keeps the agent unready.
func (c *Controller) Ready() bool { return c.ready.Load() }

// podConverged records a pod's successful sync for Ready.
func (c *Controller) podConverged(key string) {
	c.mu.Lock()
	delete(c.pending, key)
	c.mu.Unlock()
	c.updateReady()
}

// updateReady turns Ready true once the first full sync is complete.
func (c *Controller) updateReady() {
	c.mu.Lock()
	done := c.pending != nil && len(c.pending) == 0 && c.nodeSynced
	c.mu.Unlock()
	if done && !c.ready.Swap(true) {
		c.log.Info("ready: the first full sync is done") // the lab waits for this line (topology.Daemon.WaitReady)
	}
}

// Run waits for the caches, then converges until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		// Only a stop (SIGTERM during the start) ends the wait early: a
		// clean exit, with nothing programmed yet.
		c.log.Info("stopped before the informer caches synced")
		return nil
	}
	// The desired state must exist before any pod is synced: a pod synced
	// against an empty one would lose its tunnel IPs and get them back, and a
	// restarted agent must not flap what it adopts.
	if err := c.recompute(); err != nil {
		return err
	}
	c.mu.Lock()
	c.pending = map[string]bool{}
	for key := range c.desired {
		c.pending[key] = true
	}
	c.mu.Unlock()
	defer c.metrics.release()
	// Every local pod is already queued by its informer add event.
	c.queue.Add(nodeKey)
	var wg sync.WaitGroup
	for range c.cfg.Workers {
		wg.Go(func() {
			wait.UntilWithContext(ctx, func(ctx context.Context) {
				for c.processNext(ctx) {
				}
			}, time.Second)
		})
	}
	if c.cfg.ResyncPeriod > 0 {
		go wait.Until(func() { c.queue.Add(resyncKey) }, c.cfg.ResyncPeriod, ctx.Done())
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
	return nil
}

func (c *Controller) processNext(ctx context.Context) bool {
	key, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(key)
	defer c.liveness.Begin(key.String())()
	var err error
	var kind string
	start := time.Now()
	switch key {
	case resyncKey:
		kind, err = syncKindResync, c.resync()
	case desiredKey:
		kind, err = syncKindDesired, c.recompute()
	case nodeKey:
		kind, err = syncKindNode, c.syncNode(ctx)
	default:
		kind, err = syncKindPod, c.syncPod(ctx, key.Object)
		if err == nil {
			c.podConverged(key.Object)
		}
	}
	if errors.Is(err, errDesiredStale) {
		c.queue.Forget(key)
		return true
	}
	c.metrics.observeSync(kind, time.Since(start), err)
	c.requeue(key, err)
	return true
}

// requeue schedules key again after its sync returned err: a failure with
// the queue's back-off (up to 2 minutes), a pod whose route the network
// plugin has not added yet within routeWait's (up to 2 s), so that a new
// pod is served soon after its plugin routes it, before the router sends
// it many flows.
func (c *Controller) requeue(key daemon.QueueKey, err error) {
	switch {
	case err == nil:
		c.queue.Forget(key)
		c.routeWait.Forget(key)
	case errors.Is(err, errNoPodRoute):
		entry := c.log.WithError(err).WithField("key", key.String())
		if c.routeWait.NumRequeues(key) == 0 {
			entry.Info("waiting for the network plugin's route to a served pod")
		} else {
			entry.Debug("still waiting for the network plugin's route to a served pod")
		}
		c.queue.Forget(key)
		c.queue.AddAfter(key, c.routeWait.When(key))
	default:
		c.log.WithError(err).WithField("key", key.String()).Warn("sync failed, will retry with back-off")
		c.queue.AddRateLimited(key)
	}
}

// resync forgets which pods were clean and checks every local pod again.
func (c *Controller) resync() error {
	if err := c.recompute(); err != nil {
		return err
	}
	pods, err := c.pods.List(labels.Everything())
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.clean = map[string]string{}
	c.mu.Unlock()
	for _, pod := range pods {
		c.queue.Add(daemon.ObjectKey(pod.Namespace + "/" + pod.Name))
	}
	c.queue.Add(nodeKey)
	return nil
}

// recompute derives the desired state of every local pod and queues the pods
// whose desired state changed.
func (c *Controller) recompute() error {
	svcs, err := c.services.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing services: %w", err)
	}
	esl := kubeobj.EndpointSlices(c.slices.List())
	pods, err := c.pods.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing pods: %w", err)
	}
	nodes, err := c.nodes.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing nodes: %w", err)
	}
	policy := c.live.Get()
	desired, problems, refused := Desired(c.cfg.NodeName, policy.Pools, policy.Networks(nodes), svcs, esl, pods)
	var unlisted map[string][]netip.Addr
	var views map[string]string
	if c.conditions != nil {
		unlisted = Unlisted(c.cfg.NodeName, policy.Pools, policy.Networks(nodes), svcs, pods, desired)
		views = gateViews(c.cfg.NodeName, pods)
	}
	// A network plugin that drops the replies from the tunnel IPs is
	// logged once per pod and reason, like every problem.
	problems = append(problems, replyPathProblems(desired, pods)...)
	if c.policy != nil {
		p, err := c.policy.withPolicies(desired, pods)
		if err != nil {
			return err
		}
		problems = append(problems, p...)
	}
	carriers := CarrierSources(nodes, c.cfg.routerNodes(), c.cfg.CarrierSources)
	if len(desired) > 0 && len(carriers) == 0 && c.cfg.Mode == encap.GRE {
		problems = append(problems, fmt.Sprintf("no Node matches --router-nodes %q with an InternalIP or ExternalIP: the served pods accept GRE from no router", c.cfg.routerNodes()))
	}
	WithGuards(desired, c.cfg, carriers)

	c.mu.Lock()
	// The routers record a TunnelIPRefused event; the agent logs the same
	// reason, once per Service and reason.
	logged := map[string]string{}
	for _, r := range refused {
		logged[r.Key()] = r.Err.Error()
		if c.refused[r.Key()] != logged[r.Key()] {
			c.log.WithFields(logrus.Fields{"service": r.Key(), "vip": r.VIP, "field": "metadata.annotations[" + tunnelclaim.Annotation + "]"}).
				WithError(r.Err).Warn("tunnel IP refused: not served in this node's pods")
		}
	}
	c.refused = logged
	old := c.desired
	c.desired = desired
	oldUnlisted := c.unlisted
	c.unlisted = unlisted
	oldViews := c.gateViews
	c.gateViews = views
	c.metrics.desiredState(desired, refused)
	seen := map[string]bool{}
	for _, p := range problems {
		seen[p] = true
		if !c.problems[p] {
			c.log.Warn(p)
		}
	}
	c.problems = seen
	c.mu.Unlock()

	changed := false
	for key := range keysOf(old, desired) {
		if !old[key].Equal(desired[key]) {
			c.queue.Add(daemon.ObjectKey(key))
			changed = true
		}
	}
	// A gated pod that no longer waits for a slice may open its gate.
	for key := range oldUnlisted {
		if len(unlisted[key]) == 0 {
			c.queue.Add(daemon.ObjectKey(key))
		}
	}
	// So may a gated pod this recompute saw first, or with new addresses.
	for key, view := range views {
		if oldViews[key] != view {
			c.queue.Add(daemon.ObjectKey(key))
		}
	}
	if changed {
		c.queue.Add(nodeKey)
	}
	return nil
}

func keysOf(a, b map[string]PodTunnels) map[string]bool {
	keys := map[string]bool{}
	for k := range a {
		keys[k] = true
	}
	for k := range b {
		keys[k] = true
	}
	return keys
}

// syncPod converges one pod's namespace.
func (c *Controller) syncPod(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pod, err := c.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		// Its namespace went with it: nothing to remove, nothing to report.
		c.mu.Lock()
		delete(c.clean, key)
		delete(c.podDone, key)
		delete(c.opened, key)
		c.mu.Unlock()
		c.metrics.forgetPod(key)
		return nil
	}
	if err != nil {
		return err
	}
	if pod.Spec.HostNetwork || pod.Spec.NodeName != c.cfg.NodeName || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	podNow := runtimePod(pod)
	if len(podNow.Addrs()) == 0 {
		return nil // not started yet; its update will come
	}
	identity := string(pod.UID) + "/" + podNow.IP.String() + "/" + podNow.IPv6.String()

	c.mu.Lock()
	want, served := c.desired[key]
	wasClean := c.clean[key] == identity
	c.mu.Unlock()
	if !served {
		c.metrics.forgetPod(key)
		if wasClean {
			return c.podConvergedTo(ctx, pod, PodTunnels{Pod: podNow})
		}
		want = PodTunnels{Pod: podNow}
	}
	if want.Pod != podNow {
		c.queue.Add(desiredKey)
		return fmt.Errorf("pod %s: %w", key, errDesiredStale)
	}
	log := c.log.WithFields(logrus.Fields{"pod": key, "pod_ips": podNow.Addrs()})

	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	podNS, err := c.locator.Locate(lctx, want.Pod)
	if err != nil {
		if errors.Is(err, runtime.ErrNotFound) && len(want.TunnelIPs) == 0 {
			// No sandbox, so nothing of ours in it either.
			return c.podConvergedTo(ctx, pod, want)
		}
		return fmt.Errorf("pod %s: finding its network namespace (runtime %s): %w", key, c.locator.Name(), err)
	}
	kept := false
	defer func() {
		if !kept {
			podNS.Close()
		}
	}()
	log = log.WithFields(logrus.Fields{"netns": podNS.Path, "via": podNS.Via})
	acts, err := c.podNet.Sync(podNS.Handle, want)
	c.metrics.podChanges(acts)
	for _, a := range acts {
		log.WithField("change", a.String()).Info("pod namespace changed")
	}
	if err != nil {
		return fmt.Errorf("pod %s (netns %s): %w", key, podNS.Path, err)
	}
	// In gre mode the pod's decapsulation device counts what it receives,
	// and the policy rules count what they drop: the metrics read them
	// through this namespace at each scrape.
	kept = c.metrics.keepNamespace(key, want, podNS.Handle)
	if len(acts) > 0 {
		log.WithField("tunnel_ips", want.TunnelIPs).Info("pod converged")
	}
	// A clean pod (nothing of ours in it) is not entered again until it is
	// served; a served one must be entered when that ends.
	c.mu.Lock()
	if len(want.TunnelIPs) == 0 {
		c.clean[key] = identity
	} else {
		delete(c.clean, key)
	}
	c.mu.Unlock()
	return c.podConvergedTo(ctx, pod, want)
}

// podConvergedTo records that pod's namespace holds want, and opens the
// pod's readiness gate if that was all it waited for.
func (c *Controller) podConvergedTo(ctx context.Context, pod *corev1.Pod, want PodTunnels) error {
	c.mu.Lock()
	c.podDone[pod.Namespace+"/"+pod.Name] = want
	c.mu.Unlock()
	return c.openGate(ctx, pod)
}

// syncNode converges the node's namespace for the pods served now.
func (c *Controller) syncNode(ctx context.Context) error {
	c.mu.Lock()
	served := slices.Collect(maps.Values(c.desired))
	c.mu.Unlock()
	slices.SortFunc(served, func(a, b PodTunnels) int {
		return cmp.Or(a.Pod.IP.Compare(b.Pod.IP), a.Pod.IPv6.Compare(b.Pod.IPv6))
	})
	var nodeIP netip.Addr
	if node, err := c.nodes.Get(c.cfg.NodeName); err == nil {
		nodeIP = kubeobj.NodeAddress(node)
	}
	acts, err := c.nodeNet.Sync(served, nodeIP)
	c.metrics.nodeChanges(acts)
	for _, a := range acts {
		c.log.WithField("change", a.String()).Info("node namespace changed")
	}
	if err != nil {
		return fmt.Errorf("node %s: %w", c.cfg.NodeName, err)
	}
	c.mu.Lock()
	c.nodeSynced = true
	c.nodeDone = make(map[string]PodTunnels, len(served))
	for _, pt := range served {
		c.nodeDone[pt.Pod.Namespace+"/"+pt.Pod.Name] = pt
	}
	c.mu.Unlock()
	c.updateReady()
	c.openNodeGates(ctx, served)
	return nil
}

// Policy is the agent's address pools and ranges: livepolicy.Watch sets
// it, then calls PolicyChanged.
func (c *Controller) Policy() *livepolicy.Policy { return c.live }

// PolicyChanged recomputes every local pod's desired state with the
// current Policy: only the pods whose tunnel IPs change are written.
func (c *Controller) PolicyChanged(tunnelclaim.Policy) { c.queue.Add(desiredKey) }
