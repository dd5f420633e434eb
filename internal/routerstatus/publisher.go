package routerstatus

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// MinInterval is the shortest time between two writes of a router's status:
// a burst of changes (a rolling update, a resync) is written once.
const MinInterval = time.Second

// RefreshInterval is how often the status is written without a change: its
// updated time tells readers the router is alive, and a ConfigMap the
// garbage collector removed with a previous pod comes back.
const RefreshInterval = time.Minute

// Publisher keeps one router's status ConfigMap current. The controller
// tells it what it programmed; Run writes it, at most once per MinInterval,
// and again after a failed write.
type Publisher struct {
	client    kubernetes.Interface
	namespace string
	nodeUID   func() types.UID
	log       logrus.FieldLogger
	now       func() time.Time

	mu      sync.Mutex
	header  Router // without Tunnels
	tunnels map[netip.Addr]Tunnel
	dirty   chan struct{}
}

// NewPublisher returns a publisher of header's router (Node must be set)
// in namespace ns; podName is the router's pod, recorded in the status.
// nodeUID, when set and once it returns the UID of header.Node, makes the
// router's Node the owner of the ConfigMap, so that the garbage collector
// removes it with the Node. Not the pod: the status namespace is not the
// pod's, and an owner in another namespace counts as absent (the garbage
// collector would delete the ConfigMap at once); readers tell a status
// whose pod is gone by its Pod.
func NewPublisher(client kubernetes.Interface, ns string, header Router, podName string, nodeUID func() types.UID, log logrus.FieldLogger) *Publisher {
	p := &Publisher{
		client: client, namespace: ns, log: log, now: time.Now, nodeUID: nodeUID,
		header: header, tunnels: map[netip.Addr]Tunnel{}, dirty: make(chan struct{}, 1),
	}
	p.header.Pod = podName
	return p
}

// owner is the ConfigMap's owner reference, the router's Node, when its UID
// is known.
func (p *Publisher) owner() *metav1.OwnerReference {
	if p.nodeUID == nil {
		return nil
	}
	uid := p.nodeUID()
	if uid == "" {
		return nil
	}
	return &metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: p.header.Node, UID: uid}
}

// Set records what the router programmed for one tunnel IP.
func (p *Publisher) Set(t Tunnel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, ok := p.tunnels[t.VIP]; ok && old == t {
		return
	}
	p.tunnels[t.VIP] = t
	p.markDirty()
}

// Announce records whether the router announces vip.
func (p *Publisher) Announce(vip netip.Addr, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.tunnels[vip]; ok && t.Announced != on {
		t.Announced = on
		p.tunnels[vip] = t
		p.markDirty()
	}
}

// SetPolicy records the pools and cluster ranges the router admits claims
// with, so that kubectl tunnel judges claims as the router does even when
// a flag overrides the ConfigMap.
func (p *Publisher) SetPolicy(policy tunnelclaim.Policy) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.header.Policy != nil && p.header.Policy.Equal(policy) {
		return
	}
	p.header.Policy = &policy
	p.markDirty()
}

// Remove records that the router removed vip.
func (p *Publisher) Remove(vip netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.tunnels[vip]; ok {
		delete(p.tunnels, vip)
		p.markDirty()
	}
}

// Replace records the whole programmed state (after a full resync).
func (p *Publisher) Replace(ts []Tunnel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	next := make(map[netip.Addr]Tunnel, len(ts))
	for _, t := range ts {
		next[t.VIP] = t
	}
	if !maps.Equal(next, p.tunnels) {
		p.tunnels = next
		p.markDirty()
	}
}

func (p *Publisher) markDirty() {
	select {
	case p.dirty <- struct{}{}:
	default:
	}
}

// Run writes the status until ctx ends: once at start, then after changes
// and every RefreshInterval.
// It never deletes the ConfigMap: a restarted router takes it over, and the
// garbage collector removes it with the router's Node (or the namespace
// goes at uninstall).
func (p *Publisher) Run(ctx context.Context) {
	p.markDirty()
	backoff := MinInterval
	refresh := time.NewTicker(RefreshInterval)
	defer refresh.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.dirty:
		case <-refresh.C:
		}
		if err := p.write(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			p.log.WithError(err).WithField("configmap", p.namespace+"/"+Name(p.header.Node)).Warn("publishing the router's status failed; retrying")
			p.markDirty()
			backoff = min(2*backoff, time.Minute)
		} else {
			backoff = MinInterval
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// Snapshot returns the status as the next write renders it.
func (p *Publisher) Snapshot() Router {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.header
	r.Updated = p.now()
	r.Tunnels = slices.Collect(maps.Values(p.tunnels))
	return r
}

func (p *Publisher) write(ctx context.Context) error {
	owner := p.owner()
	want := p.Snapshot().ConfigMap(p.namespace, owner)
	cms := p.client.CoreV1().ConfigMaps(p.namespace)
	have, err := cms.Get(ctx, want.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, err := cms.Create(ctx, want, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("creating configmap %s/%s: %w", p.namespace, want.Name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading configmap %s/%s: %w", p.namespace, want.Name, err)
	}
	// The router owns the whole object: its data, labels and owner (an
	// older owner reference, a pod's before, is replaced by the Node's).
	want.ResourceVersion = have.ResourceVersion
	if owner == nil {
		want.OwnerReferences = have.OwnerReferences
	}
	if _, err := cms.Update(ctx, want, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("updating configmap %s/%s: %w", p.namespace, want.Name, err)
	}
	return nil
}
