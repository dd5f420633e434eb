package status

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// LoadBalancerClass is the spec.loadBalancerClass naming kube-service-tunnel.
// The router publishes the tunnel IP of a Service of type LoadBalancer whose
// class is this one or unset; a Service of another class belongs to another
// load-balancer implementation and its status is never touched.
const LoadBalancerClass = "cmd.nu/tunnel"

// Writer publishes each served tunnel IP in the status.loadBalancer.ingress
// of its Service, when the Service is of type LoadBalancer, so that kubectl
// get svc shows it as the EXTERNAL-IP. Every router writes the same status
// (they decide alike) and writes only when the status differs, so the
// writes are idempotent across routers and restarts.
//
// It owns exactly the ingress entries whose IP lies in an address pool
// (pools are for tunnel IPs only): those it adds and removes; every other
// entry is left as it is. An entry it publishes has ipMode Proxy, which
// tells kube-proxy not to capture the IP on the nodes: packets to it must
// reach the tunnel routers' HMARK rules unchanged, not kube-proxy's DNAT.
type Writer struct {
	client   kubernetes.Interface
	services corelisters.ServiceLister
	owns     func(netip.Addr) bool
	queue    workqueue.TypedRateLimitingInterface[string]
	log      logrus.FieldLogger

	mu     sync.Mutex
	served map[string][]netip.Addr // Service key -> the tunnel IPs it is served, IPv4 first
}

// NewWriter returns a writer that patches Services through client.
// owns reports whether an ingress IP is one the router manages (in a pool).
func NewWriter(client kubernetes.Interface, services corelisters.ServiceLister, owns func(netip.Addr) bool, log logrus.FieldLogger) *Writer {
	return &Writer{
		client: client, services: services, owns: owns, log: log,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "tunnel-router-status"}),
		served: map[string][]netip.Addr{},
	}
}

// Set records that the Service key is served vips (none: it is not served)
// and queues a check of its status. It never blocks on the API server.
func (w *Writer) Set(key string, vips []netip.Addr) {
	w.mu.Lock()
	if len(vips) > 0 {
		w.served[key] = slices.Clone(vips)
	} else {
		delete(w.served, key)
	}
	w.mu.Unlock()
	w.queue.Add(key)
}

// Run writes statuses until ctx ends.
func (w *Writer) Run(ctx context.Context) {
	defer utilruntime.HandleCrash()
	go func() { <-ctx.Done(); w.queue.ShutDown() }()
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		for ctx.Err() == nil && w.processNext(ctx) {
		}
	}, time.Second)
}

func (w *Writer) processNext(ctx context.Context) bool {
	key, shutdown := w.queue.Get()
	if shutdown {
		return false
	}
	defer w.queue.Done(key)
	if err := w.sync(ctx, key); err != nil {
		w.log.WithError(err).WithField("service", key).Warn("publishing status.loadBalancer.ingress failed, will retry")
		w.queue.AddRateLimited(key)
		return true
	}
	w.queue.Forget(key)
	return true
}

func (w *Writer) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	svc, err := w.services.Services(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	w.mu.Lock()
	vips := w.served[key]
	w.mu.Unlock()
	want, ok := DesiredIngress(svc, vips, w.owns)
	if !ok || ingressEqual(svc.Status.LoadBalancer.Ingress, want) {
		return nil
	}
	// A JSON merge patch replaces the whole list; the resourceVersion makes
	// it fail (and retry on fresh data) if the status changed meanwhile, so
	// entries of others written since are not lost.
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"resourceVersion": svc.ResourceVersion},
		"status":   map[string]any{"loadBalancer": map[string]any{"ingress": want}},
	})
	if err != nil {
		return err
	}
	_, err = w.client.CoreV1().Services(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "tunnel-router"}, "status")
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("patching status.loadBalancer.ingress: %w", err)
	}
	w.log.WithFields(logrus.Fields{"service": key, "ingress": ingressIPs(want)}).Info("published status.loadBalancer.ingress")
	return nil
}

// DesiredIngress computes the status.loadBalancer.ingress the router wants
// on svc when the Service is served tunnel IPs vips (none: not served). ok
// is false when the router does not manage the Service's status: it is not
// of type LoadBalancer, or has another spec.loadBalancerClass. Entries whose
// IP owns does not claim are kept, in their order; the router's own entries
// come first, one per tunnel IP (IPv4 first, as the caller gives them).
func DesiredIngress(svc *corev1.Service, vips []netip.Addr, owns func(netip.Addr) bool) (want []corev1.LoadBalancerIngress, ok bool) {
	if svc.Spec.Type != corev1.ServiceTypeLoadBalancer {
		return nil, false
	}
	if c := svc.Spec.LoadBalancerClass; c != nil && *c != LoadBalancerClass {
		return nil, false
	}
	for _, vip := range vips {
		proxy := corev1.LoadBalancerIPModeProxy
		want = append(want, corev1.LoadBalancerIngress{IP: vip.String(), IPMode: &proxy})
	}
	for _, in := range svc.Status.LoadBalancer.Ingress {
		if ip, err := netip.ParseAddr(in.IP); err == nil && owns(ip) {
			continue
		}
		want = append(want, in)
	}
	return want, true
}

func ingressEqual(a, b []corev1.LoadBalancerIngress) bool {
	return slices.EqualFunc(a, b, func(x, y corev1.LoadBalancerIngress) bool {
		xb, _ := json.Marshal(x)
		yb, _ := json.Marshal(y)
		return string(xb) == string(yb)
	})
}

func ingressIPs(in []corev1.LoadBalancerIngress) []string {
	out := make([]string, 0, len(in))
	for _, i := range in {
		out = append(out, i.IP+i.Hostname)
	}
	return out
}
