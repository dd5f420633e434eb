// Package livepolicy keeps the address pools and the cluster's ranges
// (KST_POOLS, KST_POD_CIDR, KST_SERVICE_CIDR) current while a daemon runs:
// it watches the daemons' ConfigMap, so that a pool change needs no
// restart. A value given on the command line wins over the ConfigMap and
// never changes; a bad value in the ConfigMap is logged, naming the
// ConfigMap and the key, and the previous policy stays.
package livepolicy

import (
	"context"
	"flag"
	"fmt"
	"sync"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/flagenv"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// Ref names the ConfigMap to watch.
type Ref struct{ Namespace, Name string }

func (r Ref) String() string { return r.Namespace + "/" + r.Name }

// Policy is the current policy, safe for concurrent use.
type Policy struct {
	mu     sync.RWMutex
	policy tunnelclaim.Policy
}

// New returns a Policy holding p.
func New(p tunnelclaim.Policy) *Policy { return &Policy{policy: p} }

// Get returns the current policy.
func (p *Policy) Get() tunnelclaim.Policy {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.policy
}

// Set replaces the policy and reports whether it changed.
func (p *Policy) Set(next tunnelclaim.Policy) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.policy.Equal(next) {
		return false
	}
	p.policy = next
	return true
}

// Parse reads the policy from a ConfigMap's data with the daemons' own
// flags, starting from base (the command line's): a key whose flag was
// given on the command line (fixed) is not read.
func Parse(data map[string]string, base tunnelclaim.Policy, fixed map[string]bool) (tunnelclaim.Policy, error) {
	next := base
	fs := flag.NewFlagSet("configmap", flag.ContinueOnError)
	daemon.AddPolicyFlags(fs, &next)
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		key := flagenv.Name(daemon.EnvPrefix, f.Name)
		v, ok := data[key]
		if err != nil || fixed[f.Name] {
			return
		}
		if !ok {
			v = "" // a key removed from the ConfigMap clears its setting
		}
		if e := fs.Set(f.Name, v); e != nil {
			err = fmt.Errorf("key %s: %w", key, e)
		}
	})
	return next, err
}

// Watch watches the ConfigMap ref through its own informer (list and watch
// of that one name) and, whenever the policy it holds differs from p's,
// sets p and calls changed. given names the policy flags set on the command
// line (see GivenFlags). Start the returned factory.
func Watch(client kubernetes.Interface, ref Ref, p *Policy, given map[string]bool, changed func(tunnelclaim.Policy), log logrus.FieldLogger) (informers.SharedInformerFactory, error) {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ref.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", ref.Name).String()
		}))
	base := p.Get()
	apply := func(obj any) {
		cm, ok := obj.(*corev1.ConfigMap)
		if !ok || cm.Name != ref.Name {
			return
		}
		next, err := Parse(cm.Data, base, given)
		if err != nil {
			log.WithError(err).WithField("configmap", ref.String()).Error("address pools not changed: the ConfigMap's new value is refused")
			return
		}
		if p.Set(next) {
			log.WithFields(logrus.Fields{"configmap": ref.String(), "pools": next.Pools.String(), "pod_cidrs": next.PodCIDRs, "service_cidrs": next.ServiceCIDRs}).
				Info("address pools changed: re-evaluating every tunnel IP")
			changed(next)
		}
	}
	_, err := factory.Core().V1().ConfigMaps().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    apply,
		UpdateFunc: func(_, obj any) { apply(obj) },
	})
	if err != nil {
		return nil, fmt.Errorf("watching configmap %s: %w", ref, err)
	}
	return factory, nil
}

// Controller is what a daemon's controller offers Start: its Policy and
// what to do when it changed.
type Controller interface {
	Policy() *Policy
	PolicyChanged(tunnelclaim.Policy)
}

// Start watches ref for ctrl (see Watch) until ctx ends or stop is called;
// stop returns once the watch has ended.
func Start(ctx context.Context, client kubernetes.Interface, ref Ref, ctrl Controller, given map[string]bool, log logrus.FieldLogger) (stop func(), err error) {
	factory, err := Watch(client, ref, ctrl.Policy(), given, ctrl.PolicyChanged, log)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	factory.Start(ctx.Done())
	// Shutdown waits for the informer, which stops once ctx is cancelled.
	return func() { cancel(); factory.Shutdown() }, nil
}

// GivenFlags returns the names of fs's flags set on the command line
// (after fs.Parse).
func GivenFlags(fs *flag.FlagSet) map[string]bool {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	return given
}
