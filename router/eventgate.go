package router

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
)

// EventLeaseName is the Lease, in the router's namespace, held by the one
// router that records the Services' events.
const EventLeaseName = "tunnel-router-events"

// EventGate lets one router of the cluster record the events every router
// decides alike (they compute the same claims and tables), so that a change
// gives one Event, not one per router. The router holding the Lease
// EventLeaseName records; every router logs each event it would record.
// A router competes for the Lease once it is ready (its first full sync
// is done) and releases it when it stops, so the next ready router takes
// over within a retry period; a router that dies without releasing it is
// replaced after the Lease's duration, and events of that gap are only in
// the routers' logs.
type EventGate struct {
	leader atomic.Bool
	log    logrus.FieldLogger
	// Timings of the leader election (client-go's usual ones by default).
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
}

// NewEventGate returns a gate that records nothing until Run wins the Lease.
func NewEventGate(log logrus.FieldLogger) *EventGate {
	return &EventGate{log: log, LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second}
}

// Leader reports whether this router records events now.
func (g *EventGate) Leader() bool { return g.leader.Load() }

// Recorder wraps inner: events go through only while this router holds
// the Lease, and are logged either way.
func (g *EventGate) Recorder(inner record.EventRecorder) record.EventRecorder {
	return gatedRecorder{gate: g, inner: inner}
}

// Run competes for the Lease ns/EventLeaseName as identity once ready()
// holds, and again whenever it loses it, until ctx ends; then it releases
// the Lease if it holds it.
func (g *EventGate) Run(ctx context.Context, client kubernetes.Interface, ns, identity string, ready func() bool) {
	_ = wait.PollUntilContextCancel(ctx, time.Second, true, func(context.Context) (bool, error) { return ready(), nil })
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: ns, Name: EventLeaseName},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: identity},
	}
	for ctx.Err() == nil {
		leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
			Lock:            lock,
			LeaseDuration:   g.LeaseDuration,
			RenewDeadline:   g.RenewDeadline,
			RetryPeriod:     g.RetryPeriod,
			ReleaseOnCancel: true,
			Name:            EventLeaseName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(context.Context) {
					g.leader.Store(true)
					g.log.WithField("lease", ns+"/"+EventLeaseName).Info("this router now records the Services' events")
				},
				OnStoppedLeading: func() {
					if g.leader.Swap(false) {
						g.log.WithField("lease", ns+"/"+EventLeaseName).Info("this router no longer records the Services' events")
					}
				},
			},
		})
	}
}

// gatedRecorder is EventGate's record.EventRecorder.
type gatedRecorder struct {
	gate  *EventGate
	inner record.EventRecorder
}

func (r gatedRecorder) logEvent(obj runtime.Object, eventType, reason, message string) {
	entry := r.gate.log.WithFields(logrus.Fields{"type": eventType, "reason": reason, "recorded": r.gate.Leader()})
	if m, err := apimeta.Accessor(obj); err == nil {
		entry = entry.WithField("object", m.GetNamespace()+"/"+m.GetName())
	}
	if eventType == corev1.EventTypeWarning {
		entry.Warn(message)
	} else {
		entry.Info(message)
	}
}

func (r gatedRecorder) Event(obj runtime.Object, eventType, reason, message string) {
	r.logEvent(obj, eventType, reason, message)
	if r.gate.Leader() {
		r.inner.Event(obj, eventType, reason, message)
	}
}

func (r gatedRecorder) Eventf(obj runtime.Object, eventType, reason, format string, args ...any) {
	r.Event(obj, eventType, reason, fmt.Sprintf(format, args...))
}

func (r gatedRecorder) AnnotatedEventf(obj runtime.Object, annotations map[string]string, eventType, reason, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	r.logEvent(obj, eventType, reason, msg)
	if r.gate.Leader() {
		r.inner.AnnotatedEventf(obj, annotations, eventType, reason, "%s", msg)
	}
}
