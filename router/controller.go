package router

import (
	"context"
	"fmt"
	"hash/maphash"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/router/metrics"
	"github.com/cmdnu/kube-service-tunnel/router/status"
	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
)

// Event reasons the router records on Services.
const (
	ReasonProgrammed       = "TunnelProgrammed"
	ReasonInvalidTunnelIP  = "InvalidTunnelIP"
	ReasonRefused          = "TunnelIPRefused"
	ReasonConflict         = "TunnelIPConflict"
	ReasonNoReadyEndpoints = "NoReadyEndpoints"
	ReasonIdleEndpoints    = "MoreEndpointsThanBuckets"
	ReasonProgramFailed    = "TunnelProgramFailed"
	ReasonForeignEndpoint  = "ForeignEndpoint"
)

// Queue items that are not one Service.
var (
	// resyncKey hands the datapath the whole desired state.
	resyncKey = daemon.Job("resync")
	// networksKey re-reads the Nodes' addresses and pod ranges, and
	// re-evaluates every Service when they changed (the address pools).
	networksKey = daemon.Job("networks")
	// generationsKey removes the routing generations no flow uses any more.
	generationsKey = daemon.Job("generations")
)

// Programmer is what the controller asks of the datapath (*Datapath).
type Programmer interface {
	Resync([]datapath.Tunnel) error
	SetTunnel(datapath.Tunnel) error
	RemoveTunnel(netip.Addr) error
}

// GenerationReader tells the generation new flows of a tunnel IP use
// (*datapath.Datapath); without it the controller publishes generation 0.
type GenerationReader interface {
	CurrentGeneration(netip.Addr) int
}

// FamilyServer tells whether the datapath serves a tunnel IP's address
// family (*datapath.Families: IPv6 only with --ipv6); without it every
// family is served.
type FamilyServer interface {
	Serves(netip.Addr) bool
}

// StatusPublisher publishes what the router programmed
// (*routerstatus.Publisher).
type StatusPublisher interface {
	Set(routerstatus.Tunnel)
	Remove(netip.Addr)
	Replace([]routerstatus.Tunnel)
	// SetPolicy records the pools and ranges claims are admitted with.
	SetPolicy(tunnelclaim.Policy)
}

// GenerationCollector removes routing generations no flow uses any more
// (*datapath.Datapath); the controller's worker calls it, so that only the
// worker writes to the kernel.
type GenerationCollector interface {
	CollectGenerations() (removed int, err error)
}

// Announcer announces the tunnel IPs this router serves to the network
// (*bgp.Speaker). Announce replaces the whole set and must not block.
type Announcer interface {
	Announce([]netip.Addr)
}

// Controller watches annotated Services, their EndpointSlices and the Nodes,
// and keeps the datapath programmed with one bucket table per tunnel IP. Event
// handlers only queue keys; one worker re-reads the listers and converges.
type Controller struct {
	cfg      Config
	services corelisters.ServiceLister
	slices   cache.Indexer // EndpointSlices, indexed by Service
	nodes    corelisters.NodeLister
	pods     corelisters.PodLister
	synced   []cache.InformerSynced
	queue    workqueue.TypedRateLimitingInterface[daemon.QueueKey]
	recorder record.EventRecorder
	dp       Programmer
	log      logrus.FieldLogger

	claims   map[string][]netip.Addr // Service key -> admitted tunnel IPs it claims, IPv4 first
	byVIP    map[netip.Addr][]string // tunnel IP -> keys of the Services claiming it, in no order
	reported map[string]reported     // Service key -> its last events (see report)
	networks tunnelclaim.Networks    // what tunnel IPs must not take, as of the last resync
	live     *livepolicy.Policy      // the address pools and ranges, which may change while running
	policy   tunnelclaim.Policy      // live's value for the reconcile in progress (the worker's)
	refused  map[string][]string     // Service key -> why its claims are refused, one reason per claim (metrics.RefusedInvalid, metrics.RefusedPolicy)
	metrics  *metrics.Metrics        // nil: none
	status   *status.Writer          // publishes served tunnel IPs in LoadBalancer Services' status
	synced1  atomic.Bool
	// listing is set once the initial resync is about to list the caches
	// (see add).
	listing  atomic.Bool
	liveness daemon.Liveness
	// queuedAt is when each key was first queued by an informer event
	// since its last sync began (the informers' goroutines write it, the
	// worker takes it); syncQueued and syncStart are the current sync's.
	// The "table written" log line splits a change's time with them.
	queuedMu              sync.Mutex
	queuedAt              map[daemon.QueueKey]time.Time
	syncQueued, syncStart time.Time

	announcer Announcer
	announce  map[netip.Addr]bool // tunnel IPs programmed with a ready endpoint
	published StatusPublisher     // nil: none
	// afterResync runs after each full resync (see SetAfterResync).
	afterResync func()
}

// SetAfterResync gives the controller a function to call after each full
// resync, successful or not. The daemon gives debug.FreeOSMemory: a full
// resync of 10,000 tunnel IPs allocates several times the router's live
// heap, which the Go runtime would otherwise keep for minutes (RSS 303 MB
// after start-up instead of 191 MB). Resyncs are rare (start-up,
// --resync-period, Node address changes), so the forced collection costs
// little. Call it before Run.
func (c *Controller) SetAfterResync(f func()) { c.afterResync = f }

// SetMetrics makes the controller export its state and reconciles to m.
// Call it before Run; without it nothing is recorded.
func (c *Controller) SetMetrics(m *metrics.Metrics) { c.metrics = m }

// claimMetrics exports how many tunnel IPs are served and how many Services'
// claims are refused, by reason (conflict losers: every claimant of a
// tunnel IP but its winner).
func (c *Controller) claimMetrics() {
	if c.metrics == nil {
		return
	}
	refused := map[string]int{}
	for _, reasons := range c.refused {
		for _, reason := range reasons {
			refused[reason]++
		}
	}
	for _, keys := range c.byVIP {
		refused[metrics.RefusedConflict] += len(keys) - 1
	}
	c.metrics.SetClaims(len(c.byVIP), refused)
}

// Policy is the controller's address pools and ranges: livepolicy.Watch
// sets it, then calls PolicyChanged.
func (c *Controller) Policy() *livepolicy.Policy { return c.live }

// PolicyChanged re-evaluates every claim with the current Policy: tunnel
// IPs the pools no longer admit are withdrawn (with a TunnelIPRefused
// Warning), newly admitted ones are served, and nothing else is written.
func (c *Controller) PolicyChanged(tunnelclaim.Policy) { c.add(resyncKey) }

// SetStatusPublisher makes the controller publish each tunnel IP it
// programmed to p. Call it before Run.
func (c *Controller) SetStatusPublisher(p StatusPublisher) { c.published = p }

// publish hands the status publisher what t's tunnel IP is programmed with.
func (c *Controller) publish(t datapath.Tunnel) {
	if c.published != nil {
		c.published.Set(c.tunnelStatus(t))
	}
}

// tunnelStatus is the published status of a programmed tunnel.
func (c *Controller) tunnelStatus(t datapath.Tunnel) routerstatus.Tunnel {
	s := routerstatus.Tunnel{VIP: t.VIP, Announced: c.announce[t.VIP], ClientAffinity: t.ClientAffinity}
	if g, ok := c.dp.(GenerationReader); ok {
		s.Generation = g.CurrentGeneration(t.VIP)
	}
	addrs, nodes := TableAddrs(t)
	s.Table = routerstatus.TableDigest(addrs, nodes)
	distinct := map[netip.Addr]bool{}
	for _, a := range addrs {
		distinct[a] = true
	}
	s.Endpoints = len(distinct)
	for _, ep := range t.Present {
		if ep.Draining {
			s.Draining++
		}
	}
	return s
}

// TableAddrs returns, per bucket of t's table, the endpoint's address and,
// in mpls mode, its node's address (nil in gre mode): what
// routerstatus.TableDigest digests.
func TableAddrs(t datapath.Tunnel) (addrs, nodeIPs []netip.Addr) {
	addrs = make([]netip.Addr, len(t.Table))
	for b, ep := range t.Table {
		addrs[b] = ep.Addr
		if ep.NodeIP.IsValid() {
			if nodeIPs == nil {
				nodeIPs = make([]netip.Addr, len(t.Table))
			}
			nodeIPs[b] = ep.NodeIP
		}
	}
	return addrs, nodeIPs
}

// SetAnnouncer makes the controller announce every tunnel IP whose datapath
// is programmed and which has a ready endpoint. Call it before Run.
func (c *Controller) SetAnnouncer(a Announcer) { c.announcer = a }

// announced records whether vip is to be announced, and hands the whole set
// to the announcer when that changed.
func (c *Controller) announced(vip netip.Addr, on bool) {
	if c.announcer == nil || c.announce[vip] == on {
		return
	}
	if on {
		c.announce[vip] = true
	} else {
		delete(c.announce, vip)
	}
	c.pushAnnouncements()
}

func (c *Controller) pushAnnouncements() {
	vips := make([]netip.Addr, 0, len(c.announce))
	for v := range c.announce {
		vips = append(vips, v)
	}
	c.announcer.Announce(vips)
}

// NewController builds the controller on an informer factory. Call
// factory.Start after NewController and before Run.
func NewController(cfg Config, client kubernetes.Interface, factory informers.SharedInformerFactory, dp Programmer, recorder record.EventRecorder, log logrus.FieldLogger) (*Controller, error) {
	svcInformer := factory.Core().V1().Services()
	sliceInformer := factory.Discovery().V1().EndpointSlices()
	nodeInformer := factory.Core().V1().Nodes()
	podInformer := factory.Core().V1().Pods()
	// The caches keep only what the router reads of each object (see
	// kubeobj.Slim): of a Pod, its metadata (DrainAnnotation).
	if err := kubeobj.SetTransforms(svcInformer.Informer(), sliceInformer.Informer(), nodeInformer.Informer(), podInformer.Informer()); err != nil {
		return nil, err
	}
	if err := sliceInformer.Informer().AddIndexers(cache.Indexers{sliceServiceIndex: sliceService}); err != nil {
		return nil, fmt.Errorf("indexing endpointslices: %w", err)
	}
	c := &Controller{
		cfg:      cfg,
		services: svcInformer.Lister(),
		slices:   sliceInformer.Informer().GetIndexer(),
		nodes:    nodeInformer.Lister(),
		pods:     podInformer.Lister(),
		synced: []cache.InformerSynced{svcInformer.Informer().HasSynced, sliceInformer.Informer().HasSynced,
			nodeInformer.Informer().HasSynced, podInformer.Informer().HasSynced},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[daemon.QueueKey](),
			workqueue.TypedRateLimitingQueueConfig[daemon.QueueKey]{Name: "tunnel-router"}),
		recorder: recorder,
		dp:       dp,
		log:      log,
		claims:   map[string][]netip.Addr{},
		byVIP:    map[netip.Addr][]string{},
		reported: map[string]reported{},
		queuedAt: map[daemon.QueueKey]time.Time{},
		refused:  map[string][]string{},
		announce: map[netip.Addr]bool{},
		live:     livepolicy.New(cfg.Policy),
		policy:   cfg.Policy,
	}
	for name, informer := range map[string]cache.SharedIndexInformer{"services": svcInformer.Informer(),
		"endpointslices": sliceInformer.Informer(), "nodes": nodeInformer.Informer(), "pods": podInformer.Informer()} {
		c.liveness.Watch(name, informer)
	}
	c.status = status.NewWriter(client, c.services, func(a netip.Addr) bool { return c.live.Get().Pools.Contains(a) }, log.WithField("component", "status"))
	if _, err := svcInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueObject,
		UpdateFunc: func(_, obj any) { c.enqueueObject(obj) },
		DeleteFunc: c.enqueueObject,
	}); err != nil {
		return nil, fmt.Errorf("watching services: %w", err)
	}
	if _, err := sliceInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueSliceService,
		UpdateFunc: func(_, obj any) { c.enqueueSliceService(obj) },
		DeleteFunc: c.enqueueSliceService,
	}); err != nil {
		return nil, fmt.Errorf("watching endpointslices: %w", err)
	}
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if drainAnnotated(obj) {
				c.enqueuePodServices(obj)
			}
		},
		UpdateFunc: func(old, obj any) {
			if drainAnnotated(old) != drainAnnotated(obj) {
				c.enqueuePodServices(obj)
			}
		},
		DeleteFunc: func(obj any) {
			if drainAnnotated(obj) {
				c.enqueuePodServices(obj)
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("watching pods: %w", err)
	}
	// Nodes' addresses and pod ranges are refused as tunnel IPs (and, in
	// mpls mode, the node address is where an endpoint's packets go).
	if _, err := nodeInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { c.add(networksKey) },
		UpdateFunc: func(old, obj any) {
			o, n := old.(*corev1.Node), obj.(*corev1.Node)
			if kubeobj.NodeAddress(o) != kubeobj.NodeAddress(n) || !nodeNetworksEqual(o, n) {
				c.add(networksKey)
			}
		},
		DeleteFunc: func(any) { c.add(networksKey) },
	}); err != nil {
		return nil, fmt.Errorf("watching nodes: %w", err)
	}
	return c, nil
}

// NewEventRecorder returns a recorder that writes Events through client.
func NewEventRecorder(ctx context.Context, client kubernetes.Interface, component, node string) record.EventRecorder {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: component, Host: node})
}

// add queues an informer event's work, once the initial resync is about to
// list the caches: an event before that is already in the caches (an
// informer updates its store before it calls the handlers), so the initial
// resync covers it. Without this, start-up synced every Service once more
// after the resync (10,000 redundant syncs at 10,000 Services).
func (c *Controller) add(key daemon.QueueKey) {
	if c.listing.Load() {
		c.queuedMu.Lock()
		if _, ok := c.queuedAt[key]; !ok {
			c.queuedAt[key] = time.Now()
		}
		c.queuedMu.Unlock()
		c.queue.Add(key)
	}
}

func (c *Controller) enqueueObject(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		utilruntime.HandleError(err)
		return
	}
	c.add(daemon.ObjectKey(key))
}

func (c *Controller) enqueueSliceService(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	es, ok := obj.(*kubeobj.EndpointSlice)
	if !ok {
		return
	}
	if es.Service != "" {
		c.add(daemon.ObjectKey(es.Namespace + "/" + es.Service))
	}
}

// sliceServiceIndex indexes EndpointSlices by the "namespace/name" of their
// Service (the kubernetes.io/service-name label): a Service's slices are
// found in constant time, not by filtering every slice of its namespace
// (which made a full resync quadratic in the Services of one namespace).
const sliceServiceIndex = "service"

func sliceService(obj any) ([]string, error) {
	es, ok := obj.(*kubeobj.EndpointSlice)
	if !ok || es.Service == "" {
		return nil, nil
	}
	return []string{es.Namespace + "/" + es.Service}, nil
}

// drainAnnotated reports whether a Pod carries DrainAnnotation="true".
func drainAnnotated(obj any) bool {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	return ok && Drained(pod)
}

// Drained reports whether pod is drained by its DrainAnnotation.
func Drained(pod *corev1.Pod) bool { return pod.Annotations[DrainAnnotation] == "true" }

// enqueuePodServices queues the Services whose EndpointSlices list the Pod.
// It looks through every cached slice: a Pod's drain annotation changes
// rarely (an operator's act), and at 10,000 Services the scan takes about
// a millisecond, where an index from Pods to slices held a set per Pod of
// the cluster (tens of MB at 100,000 endpoints).
func (c *Controller) enqueuePodServices(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	for _, obj := range c.slices.List() {
		es, ok := obj.(*kubeobj.EndpointSlice)
		if !ok {
			continue
		}
		for _, ep := range es.Endpoints {
			if !ep.Pod.IsZero() && ep.Pod.Key() == key {
				c.enqueueSliceService(es)
				break
			}
		}
	}
}

// drained reports whether the Pod is marked with DrainAnnotation.
func (c *Controller) drained(namespace, name string) bool {
	pod, err := c.pods.Pods(namespace).Get(name)
	return err == nil && drainAnnotated(pod)
}

// Ready reports whether the first full synchronisation has succeeded.
func (c *Controller) Ready() bool { return c.synced1.Load() }

// Healthy returns nil while the controller is alive: its informers run and
// its worker is not stuck on one item (daemon.Liveness).
func (c *Controller) Healthy() error { return c.liveness.Check() }

// Run waits for the caches, programs the whole desired state once (adopting
// what the kernel already has), then processes changes until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		// Only a stop (SIGTERM during the start) ends the wait early: a
		// clean exit, with nothing programmed yet.
		c.log.Info("stopped before the informer caches synced")
		return nil
	}
	statusDone := make(chan struct{})
	go func() { c.status.Run(ctx); close(statusDone) }()
	defer func() { <-statusDone }()
	// Adopt and converge the whole state before handling single Services, so
	// that nothing is programmed against a device or rule set not yet ensured.
	backoff := wait.Backoff{Duration: time.Second, Factor: 2, Jitter: 0.1, Steps: 1 << 30, Cap: time.Minute}
	c.listing.Store(true)
	for {
		err := c.reconcile(metrics.ReconcileResync, c.resyncAndRelease)
		if err == nil {
			break
		}
		c.log.WithError(err).Warn("initial sync failed, retrying")
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff.Step()):
		}
	}
	// Run returns only once the worker has: nothing touches the datapath or
	// records an event after it (the item in hand is finished, the rest of
	// the queue is dropped).
	workerDone := make(chan struct{})
	go func() {
		defer close(workerDone)
		wait.UntilWithContext(ctx, func(ctx context.Context) {
			for ctx.Err() == nil && c.processNext() {
			}
		}, time.Second)
	}()
	if c.cfg.ResyncPeriod > 0 {
		go wait.Until(func() { c.queue.Add(resyncKey) }, c.cfg.ResyncPeriod, ctx.Done())
	}
	if _, ok := c.dp.(GenerationCollector); ok && c.cfg.Generations > 1 && c.cfg.GenerationCheckPeriod > 0 {
		go wait.Until(func() { c.queue.Add(generationsKey) }, c.cfg.GenerationCheckPeriod, ctx.Done())
	}
	<-ctx.Done()
	c.queue.ShutDown() // wakes a worker waiting for work
	<-workerDone
	return nil
}

func (c *Controller) processNext() bool {
	key, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(key)
	defer c.liveness.Begin(key.String())()
	// The policy of this reconcile (a live change is followed by a resync).
	c.policy = c.live.Get()
	c.queuedMu.Lock()
	c.syncQueued, c.syncStart = c.queuedAt[key], time.Now()
	delete(c.queuedAt, key)
	c.queuedMu.Unlock()
	var err error
	switch key {
	case resyncKey:
		err = c.reconcile(metrics.ReconcileResync, c.resyncAndRelease)
	case networksKey:
		err = c.reconcile(metrics.ReconcileNetworks, c.networksChanged)
	case generationsKey:
		err = c.collectGenerations()
	default:
		err = c.reconcile(metrics.ReconcileService, func() error { return c.syncService(key.Object) })
	}
	if err != nil {
		c.log.WithError(err).WithField("key", key.String()).Warn("sync failed, will retry")
		c.queue.AddRateLimited(key)
		return true
	}
	c.queue.Forget(key)
	return true
}

// reconcile runs one reconcile of kind and records its duration and error.
func (c *Controller) reconcile(kind string, fn func() error) error {
	start := time.Now()
	err := fn()
	c.metrics.Reconciled(kind, time.Since(start), err)
	return err
}

// collectGenerations removes the routing generations that no flow uses any
// more. A failure is logged and retried at the next period, not sooner.
func (c *Controller) collectGenerations() error {
	if _, err := c.dp.(GenerationCollector).CollectGenerations(); err != nil {
		c.log.WithError(err).Warn("looking for unused generations")
	}
	return nil
}

// claimOf judges the tunnel IP claims of a Service alone
// (tunnelclaim.Judge) and returns the tunnel IPs admitted, IPv4 first; ok
// is false when the Service carries no annotation. A bad annotation, or a
// tunnel IP the address pools refuse, is reported on the Service and claims
// nothing: it never beats an admitted claimant of the same IP. Each family
// is judged on its own: a refused IPv6 tunnel IP leaves the IPv4 one
// admitted.
func (c *Controller) claimOf(svc *corev1.Service) (vips []netip.Addr, ok bool) {
	key := tunnelclaim.ServiceKey(svc)
	delete(c.refused, key)
	claims, annotated := tunnelclaim.Judge(svc, c.policy.Pools, c.networks)
	if !annotated {
		return nil, false
	}
	field := "metadata.annotations[" + tunnelclaim.Annotation + "]"
	for _, claim := range claims {
		switch claim.Verdict {
		case tunnelclaim.Invalid:
			c.refused[key] = append(c.refused[key], metrics.RefusedInvalid)
			c.log.WithFields(logrus.Fields{"service": key, "field": field}).WithError(claim.Err).Warn("invalid tunnel IP")
			c.report(svc, netip.Addr{}, corev1.EventTypeWarning, ReasonInvalidTunnelIP, claim.Err.Error())
		case tunnelclaim.Refused:
			c.refused[key] = append(c.refused[key], metrics.RefusedPolicy)
			// Logged with the event: once per reason, not on every resync.
			if c.report(svc, claim.VIP, corev1.EventTypeWarning, ReasonRefused, claim.Err.Error()) {
				c.log.WithFields(logrus.Fields{"service": key, "field": field, "vip": claim.VIP}).WithError(claim.Err).Warn("tunnel IP refused")
			}
		default:
			vips = append(vips, claim.VIP)
		}
	}
	c.forgetReports(key, claims)
	return vips, true
}

// knownNetworks reads what tunnel IPs must not take from the Nodes.
func (c *Controller) knownNetworks() (tunnelclaim.Networks, error) {
	nodes, err := c.nodes.List(labels.Everything())
	if err != nil {
		return tunnelclaim.Networks{}, fmt.Errorf("listing nodes: %w", err)
	}
	return c.policy.Networks(nodes), nil
}

// networksChanged re-evaluates every Service when the Nodes' addresses or
// pod ranges changed, and always in mpls mode, where an endpoint's node
// address is part of its route.
func (c *Controller) networksChanged() error {
	known, err := c.knownNetworks()
	if err != nil {
		return err
	}
	if c.cfg.Mode != encap.MPLS && known.Equal(c.networks) {
		return nil
	}
	return c.resyncAndRelease()
}

// nodeNetworksEqual reports whether two versions of a Node have the same
// addresses and pod ranges (status heartbeats change neither).
func nodeNetworksEqual(a, b *corev1.Node) bool {
	return a.Spec.PodCIDR == b.Spec.PodCIDR && slices.Equal(a.Spec.PodCIDRs, b.Spec.PodCIDRs) &&
		slices.Equal(a.Status.Addresses, b.Status.Addresses)
}

// resyncAndRelease is resync, then the hook SetAfterResync gave, once
// resync's lists (every tunnel IP's table, the datapath's operations) are
// garbage.
func (c *Controller) resyncAndRelease() error {
	err := c.resync()
	if c.afterResync != nil {
		c.afterResync()
	}
	return err
}

// resync rebuilds every claim from the listers and hands the whole desired
// state to the datapath.
func (c *Controller) resync() error {
	known, err := c.knownNetworks()
	if err != nil {
		return err
	}
	c.networks = known
	svcs, err := c.services.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing services: %w", err)
	}
	c.claims, c.byVIP, c.refused = map[string][]netip.Addr{}, map[netip.Addr][]string{}, map[string][]string{}
	for _, svc := range svcs {
		if vips, ok := c.claimOf(svc); ok {
			c.setClaims(svc.Namespace+"/"+svc.Name, vips)
		}
	}
	c.claimMetrics()
	for key := range c.reported {
		if _, err := c.service(key); apierrors.IsNotFound(err) {
			delete(c.reported, key)
		}
	}
	tunnels := make([]datapath.Tunnel, 0, len(c.byVIP))
	var notices []notice
	for vip := range c.byVIP {
		t, winner, n := c.tunnelFor(vip)
		if winner != nil && !c.serves(vip) {
			notices = append(notices, c.unservedFamily(winner, vip))
			continue
		}
		tunnels = append(tunnels, t)
		notices = append(notices, n...)
	}
	start := time.Now()
	if err := c.dp.Resync(tunnels); err != nil {
		return fmt.Errorf("resync of %d tunnel IPs: %w", len(tunnels), err)
	}
	c.record(notices)
	c.log.WithFields(logrus.Fields{"tunnels": len(tunnels), "duration": time.Since(start).Round(time.Millisecond)}).Info("resynced datapath")
	c.metrics.SetTunnels(tunnels)
	for _, svc := range svcs {
		c.publishStatus(svc.Namespace + "/" + svc.Name)
	}
	if c.announcer != nil {
		c.announce = map[netip.Addr]bool{}
		for _, t := range tunnels {
			if t.HasReady() {
				c.announce[t.VIP] = true
			}
		}
		c.pushAnnouncements()
	}
	if c.published != nil {
		all := make([]routerstatus.Tunnel, len(tunnels))
		for i, t := range tunnels {
			all[i] = c.tunnelStatus(t)
		}
		c.published.Replace(all)
		c.published.SetPolicy(c.policy)
	}
	if !c.synced1.Swap(true) {
		c.log.Info("ready: the first full sync is done") // the lab waits for this line (topology.Daemon.WaitReady)
	}
	return nil
}

func (c *Controller) service(key string) (*corev1.Service, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil, err
	}
	return c.services.Services(ns).Get(name)
}

// svcAnnotation returns the tunnel annotation of svc, which may be nil.
func svcAnnotation(svc *corev1.Service) (string, bool) {
	if svc == nil {
		return "", false
	}
	v, ok := svc.Annotations[tunnelclaim.Annotation]
	return v, ok
}

// syncService converges the tunnel IPs one Service claimed before and claims now.
func (c *Controller) syncService(key string) error {
	svc, err := c.service(key)
	if err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	affected := map[netip.Addr]bool{}
	for _, vip := range c.claims[key] {
		affected[vip] = true
	}
	var vips []netip.Addr
	if svc != nil {
		vips, _ = c.claimOf(svc)
	} else {
		delete(c.refused, key)
	}
	if _, annotated := svcAnnotation(svc); !annotated {
		delete(c.reported, key) // a later annotation reports afresh
	}
	c.setClaims(key, vips)
	c.claimMetrics()
	for _, vip := range vips {
		affected[vip] = true
	}
	// The Service, and every other claimant of the tunnel IPs it took or
	// released (a conflict's loser may have become the winner).
	c.publishStatus(key)
	for v := range affected {
		for _, other := range c.byVIP[v] {
			if other != key {
				c.publishStatus(other)
			}
		}
	}
	for v := range affected {
		if err := c.syncVIP(v); err != nil {
			return err
		}
	}
	return nil
}

// publishStatus hands the status writer the tunnel IPs the Service key is
// served: those it claims and wins.
func (c *Controller) publishStatus(key string) {
	var won []netip.Addr
	for _, vip := range c.claims[key] {
		if w, _ := c.decide(vip); w != nil && tunnelclaim.ServiceKey(w) == key {
			won = append(won, vip)
		}
	}
	c.status.Set(key, won)
}

// syncVIP programs or removes one tunnel IP.
func (c *Controller) syncVIP(vip netip.Addr) error {
	t, winner, notices := c.tunnelFor(vip)
	if winner == nil {
		c.announced(vip, false)
		if err := c.dp.RemoveTunnel(vip); err != nil {
			return fmt.Errorf("removing tunnel %v: %w", vip, err)
		}
		c.metrics.RemoveTunnel(vip)
		if c.published != nil {
			c.published.Remove(vip)
		}
		c.log.WithField("vip", vip).Info("tunnel removed")
		return nil
	}
	if !c.serves(vip) {
		// Nothing to program or announce; the Service is told once.
		c.announced(vip, false)
		c.record([]notice{c.unservedFamily(winner, vip)})
		return nil
	}
	if !t.HasReady() {
		c.announced(vip, false)
	}
	if err := c.dp.SetTunnel(t); err != nil {
		c.announced(vip, false) // not announced while its datapath may be wrong
		c.report(winner, vip, corev1.EventTypeWarning, ReasonProgramFailed, fmt.Sprintf("programming tunnel IP %v failed: %v", vip, err))
		return fmt.Errorf("programming tunnel %v: %w", vip, err)
	}
	// Reported once the kernel holds it: a failed write is never preceded
	// by a success event.
	c.record(notices)
	c.metrics.SetTunnel(t)
	c.announced(vip, t.HasReady())
	c.publish(t)
	return nil
}

// serves reports whether the datapath serves vip's address family.
func (c *Controller) serves(vip netip.Addr) bool {
	fs, ok := c.dp.(FamilyServer)
	return !ok || fs.Serves(vip)
}

// unservedFamily is the Warning on a Service whose tunnel IP is of a
// family this router does not serve.
func (c *Controller) unservedFamily(svc *corev1.Service, vip netip.Addr) notice {
	return notice{svc, vip, corev1.EventTypeWarning, ReasonProgramFailed,
		fmt.Sprintf("tunnel IP %v is not served: this router runs without %s (--ipv6=false)", vip, tunnelclaim.Family(vip))}
}

// setClaims records that the Service key claims vips (none: it claims
// nothing).
func (c *Controller) setClaims(key string, vips []netip.Addr) {
	if slices.Equal(c.claims[key], vips) {
		return
	}
	c.dropClaims(key)
	if len(vips) == 0 {
		return
	}
	c.claims[key] = vips
	for _, vip := range vips {
		// Almost every tunnel IP has one claimant: a slice of keys is a
		// tenth of a set's memory (at 10,000 tunnel IPs, 0.5 MB instead
		// of 3.5).
		c.byVIP[vip] = append(c.byVIP[vip], key)
	}
}

// dropClaims forgets the claims of the Service key, if any.
func (c *Controller) dropClaims(key string) {
	for _, vip := range c.claims[key] {
		keys := slices.DeleteFunc(c.byVIP[vip], func(k string) bool { return k == key })
		if len(keys) == 0 {
			delete(c.byVIP, vip)
		} else {
			c.byVIP[vip] = keys
		}
	}
	delete(c.claims, key)
}

// decide returns the Service that wins vip and the admitted claimants that
// lose it, by the decision every router and endpoint agent makes alike
// (tunnelclaim.Decide); winner is nil when no Service claims vip.
func (c *Controller) decide(vip netip.Addr) (winner *corev1.Service, losers []*corev1.Service) {
	var svcs []*corev1.Service
	for _, key := range c.byVIP[vip] {
		if svc, err := c.service(key); err == nil {
			svcs = append(svcs, svc)
		}
	}
	d := tunnelclaim.Decide(svcs, c.policy.Pools, c.networks)
	for _, claim := range d.With(tunnelclaim.Lost) {
		losers = append(losers, claim.Service)
	}
	return d.Winners[vip], losers
}

// serviceSlices returns the EndpointSlices of svc from the informer's index.
func (c *Controller) serviceSlices(svc *corev1.Service) ([]*kubeobj.EndpointSlice, error) {
	objs, err := c.slices.ByIndex(sliceServiceIndex, svc.Namespace+"/"+svc.Name)
	if err != nil {
		return nil, err
	}
	return kubeobj.EndpointSlices(objs), nil
}

// notice is an event to record on a Service once the datapath holds what it
// says.
type notice struct {
	svc *corev1.Service
	// vip is the tunnel IP the notice is about (see report).
	vip                        netip.Addr
	eventType, reason, message string
}

// tunnelFor computes the desired bucket table of vip from its winning Service
// (nil when no Service claims vip), and what an operator should know of it
// on the Services involved: the caller records those notices after the
// datapath write succeeded.
func (c *Controller) tunnelFor(vip netip.Addr) (t datapath.Tunnel, winner *corev1.Service, notices []notice) {
	svc, losers := c.decide(vip)
	t = datapath.Tunnel{VIP: vip}
	if svc == nil {
		return t, nil, nil
	}
	key := tunnelclaim.ServiceKey(svc)
	// The port filter holds from the tunnel IP's first programming, so
	// that it is in place before any route to a pod.
	var portProblems []string
	t.FilterPorts, t.Ports, portProblems = PortFilter(svc)
	for _, p := range portProblems {
		c.log.WithFields(logrus.Fields{"service": key, "vip": vip}).Warn(p)
	}
	for _, loser := range losers {
		notices = append(notices, notice{loser, vip, corev1.EventTypeWarning, ReasonConflict,
			fmt.Sprintf("tunnel IP %v is already served for Service %s (older); this Service gets it when that one releases it", vip, key)})
	}
	esl, err := c.serviceSlices(svc)
	if err != nil {
		c.log.WithError(err).WithField("service", key).Warn("listing endpointslices")
	}
	family := AddressType(vip)
	eps, problems := ServiceEndpoints(esl, family, c.cfg.Mode == encap.MPLS, c.drained)
	if c.cfg.Mode == encap.MPLS {
		eps, problems = c.withNodeIPs(eps, problems)
	}
	var foreign []string
	for _, p := range problems {
		c.log.WithFields(logrus.Fields{"service": key, "vip": vip}).Warn(p)
		if msg, ok := strings.CutPrefix(p, ForeignEndpointPrefix); ok {
			foreign = append(foreign, msg)
		}
	}
	if len(foreign) > 0 {
		// One event per Service and tunnel IP holds its state (report):
		// the endpoints left out join the Service's last notice.
		defer func() { notices = withForeignEndpoints(notices, svc, foreign) }()
	}
	if len(eps) == 0 {
		msg := fmt.Sprintf("tunnel IP %v has no ready endpoint; its traffic is dropped", vip)
		if !hasAddressType(esl, family) {
			msg = fmt.Sprintf("tunnel IP %v has no ready endpoint: the Service has no EndpointSlice of addressType %s (an %s tunnel IP is carried to the pods' %s addresses: make the Service dual-stack with spec.ipFamilyPolicy); its traffic is dropped",
				vip, family, family, family)
		}
		notices = append(notices, notice{svc, vip, corev1.EventTypeWarning, ReasonNoReadyEndpoints, msg})
		return t, svc, notices
	}
	filter, ports := t.FilterPorts, t.Ports
	t = NewTunnel(vip, eps, c.cfg.Buckets)
	t.ClientAffinity = ClientAffinity(svc)
	t.FilterPorts, t.Ports = filter, ports
	ready, draining := splitDraining(eps)
	if len(ready) == 0 {
		notices = append(notices, notice{svc, vip, corev1.EventTypeWarning, ReasonNoReadyEndpoints,
			fmt.Sprintf("tunnel IP %v has no ready endpoint; new flows go to its %d draining endpoints", vip, len(draining))})
		return t, svc, notices
	}
	if idle := bucket.Unassigned(tableAddrs(t), endpointAddrs(ready)); len(idle) > 0 {
		notices = append(notices, notice{svc, vip, corev1.EventTypeWarning, ReasonIdleEndpoints,
			fmt.Sprintf("tunnel IP %v: %d of its %d ready endpoints own none of the %d buckets and get no traffic (raise --buckets): %v", vip, len(idle), len(ready), c.cfg.Buckets, idle)})
		return t, svc, notices
	}
	msg := fmt.Sprintf("tunnel IP %v programmed: %d endpoints over %d buckets (%s)", vip, len(ready), c.cfg.Buckets, c.cfg.Mode)
	if t.ClientAffinity {
		msg += ", client affinity"
	}
	msg += "; " + describePorts(t.FilterPorts, t.Ports)
	if len(draining) > 0 {
		msg += fmt.Sprintf("; %d draining (no new flows)", len(draining))
	}
	notices = append(notices, notice{svc, vip, corev1.EventTypeNormal, ReasonProgrammed, msg})
	return t, svc, notices
}

// withForeignEndpoints adds the endpoints left out for naming another
// namespace's pod to svc's last notice, which turns a Warning of reason
// ReasonForeignEndpoint if it was Normal.
func withForeignEndpoints(notices []notice, svc *corev1.Service, foreign []string) []notice {
	for i := len(notices) - 1; i >= 0; i-- {
		if notices[i].svc != svc {
			continue
		}
		if notices[i].eventType == corev1.EventTypeNormal {
			notices[i].eventType, notices[i].reason = corev1.EventTypeWarning, ReasonForeignEndpoint
		}
		notices[i].message += "; " + strings.Join(foreign, "; ")
		break
	}
	return notices
}

// NewTunnel is the desired state of tunnel IP vip with endpoints eps (ready
// and draining): the bucket table for new flows, which every router and
// kubectl tunnel compute alike. New flows go to the ready endpoints; to the
// draining ones only when no endpoint is ready (as kube-proxy does with
// terminating endpoints). With no endpoint there is no table.
func NewTunnel(vip netip.Addr, eps []datapath.Endpoint, buckets int) datapath.Tunnel {
	t := datapath.Tunnel{VIP: vip}
	if len(eps) == 0 {
		return t
	}
	t.Present = eps
	assignable, draining := splitDraining(eps)
	if len(assignable) == 0 {
		assignable = draining
	}
	byAddr := make(map[netip.Addr]datapath.Endpoint, len(assignable))
	for _, ep := range assignable {
		byAddr[ep.Addr] = ep
	}
	table := bucket.Assign(buckets, endpointAddrs(assignable))
	t.Table = make([]datapath.Endpoint, len(table))
	for b, a := range table {
		t.Table[b] = byAddr[a]
	}
	return t
}

// ClientAffinity reports whether svc's flows are hashed on the client's
// address alone: spec.sessionAffinity ClientIP. Its
// sessionAffinityConfig.clientIP.timeoutSeconds has no counterpart: the
// hash keeps a client on one pod for as long as the bucket table does not
// change, however long the client is idle.
func ClientAffinity(svc *corev1.Service) bool {
	return svc.Spec.SessionAffinity == corev1.ServiceAffinityClientIP
}

// splitDraining splits endpoints into those that take new flows and those
// that drain.
func splitDraining(eps []datapath.Endpoint) (ready, draining []datapath.Endpoint) {
	for _, ep := range eps {
		if ep.Draining {
			draining = append(draining, ep)
		} else {
			ready = append(ready, ep)
		}
	}
	return ready, draining
}

func endpointAddrs(eps []datapath.Endpoint) []netip.Addr {
	addrs := make([]netip.Addr, len(eps))
	for i, ep := range eps {
		addrs[i] = ep.Addr
	}
	return addrs
}

func tableAddrs(t datapath.Tunnel) []netip.Addr {
	addrs, _ := TableAddrs(t)
	return addrs
}

// withNodeIPs fills in each endpoint's node address (mpls mode).
func (c *Controller) withNodeIPs(eps []datapath.Endpoint, problems []string) ([]datapath.Endpoint, []string) {
	return WithNodeIPs(eps, problems, c.nodes.Get)
}

// WithNodeIPs fills in each endpoint's node address from its Node (mpls
// mode), of the endpoint's family, leaving out, with a problem, the
// endpoints whose node has none.
func WithNodeIPs(eps []datapath.Endpoint, problems []string, getNode func(name string) (*corev1.Node, error)) ([]datapath.Endpoint, []string) {
	out := eps[:0]
	for _, ep := range eps {
		node, err := getNode(ep.NodeName)
		if err != nil {
			problems = append(problems, fmt.Sprintf("endpoint %v: node %q: %v", ep.Addr, ep.NodeName, err))
			continue
		}
		ip := kubeobj.NodeAddressOf(node, ep.Addr.Is4())
		if !ip.IsValid() {
			problems = append(problems, fmt.Sprintf("endpoint %v: node %q has no %s InternalIP or ExternalIP in status.addresses", ep.Addr, ep.NodeName, tunnelclaim.Family(ep.Addr)))
			continue
		}
		ep.NodeIP = ip
		out = append(out, ep)
	}
	return out, problems
}

// record reports each notice on its Service.
func (c *Controller) record(notices []notice) {
	for _, n := range notices {
		if c.report(n.svc, n.vip, n.eventType, n.reason, n.message) && n.reason == ReasonProgrammed && !c.syncQueued.IsZero() {
			c.logProgrammed(n)
		}
	}
}

// logProgrammed logs, for a tunnel IP's new table that an informer event
// led to, where its time went: from the event to the start of its sync
// (queued: the worker busy with other keys), and from there to the kernel
// holding the table (sync). event is the TunnelProgrammed event's message.
func (c *Controller) logProgrammed(n notice) {
	c.log.WithFields(logrus.Fields{
		"vip":       n.vip,
		"service":   n.svc.Namespace + "/" + n.svc.Name,
		"queued_ms": c.syncStart.Sub(c.syncQueued).Milliseconds(),
		"sync_ms":   time.Since(c.syncStart).Milliseconds(),
		"event":     n.message,
	}).Info("table written")
}

// reportSeed hashes the reported states.
var reportSeed = maphash.MakeSeed()

// reported holds, per Service, the hash of its last event of each topic:
// the annotation as a whole (when it is invalid), its IPv4 tunnel IP and
// its IPv6 tunnel IP. A hash, not the text: at 10,000 Services the
// messages would be a megabyte kept only to be compared.
type reported [3]uint64

// topic is the slot of the events about vip: 0 for the annotation as a
// whole (the zero Addr), 1 for an IPv4 tunnel IP, 2 for an IPv6 one.
func topic(vip netip.Addr) int {
	switch {
	case !vip.IsValid():
		return 0
	case vip.Is4():
		return 1
	}
	return 2
}

// report records an event on a Service about vip (the zero Addr: about its
// annotation) when that topic's state changed since its last event, so that
// resyncs do not repeat it; it reports whether it recorded one. Each
// family's tunnel IP has its own topic: a dual-stack Service's two tunnel
// IPs do not undo each other's deduplication.
func (c *Controller) report(svc *corev1.Service, vip netip.Addr, eventType, reason, message string) bool {
	key := svc.Namespace + "/" + svc.Name
	state := maphash.String(reportSeed, eventType+"\x00"+reason+"\x00"+message)
	r := c.reported[key]
	if r[topic(vip)] == state {
		return false
	}
	r[topic(vip)] = state
	c.reported[key] = r
	c.recorder.Event(svc, eventType, reason, message)
	return true
}

// forgetReports forgets the last events of the topics the Service's claims
// no longer cover, so that a state that comes back is reported again: the
// annotation's topic once it is valid, a family's once it claims no tunnel
// IP of that family.
func (c *Controller) forgetReports(key string, claims []tunnelclaim.Claim) {
	r, ok := c.reported[key]
	if !ok {
		return
	}
	var keep [3]bool
	for _, claim := range claims {
		keep[topic(claim.VIP)] = true
	}
	for i := range r {
		if !keep[i] {
			r[i] = 0
		}
	}
	c.reported[key] = r
}
