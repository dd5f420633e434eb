package endpoint

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
)

// ReadinessGate is the pod condition the agent sets to True once a pod's
// tunnel IPs are in place: its namespace holds them and its decapsulation,
// and the node holds what the replies need. A pod that lists it in
// spec.readinessGates is ready, and so in its Services' EndpointSlices as
// ready, and so sent flows by the routers, only from then on
// (docs/draining.md, "New pods").
const ReadinessGate corev1.PodConditionType = "cmd.nu/tunnel-ready"

// The condition's reason when the agent sets it.
const reasonTunnelIPsInPlace = "TunnelIPsInPlace"

// HasReadinessGate reports whether pod lists ReadinessGate.
func HasReadinessGate(pod *corev1.Pod) bool {
	for _, g := range pod.Spec.ReadinessGates {
		if g.ConditionType == ReadinessGate {
			return true
		}
	}
	return false
}

// gateOpen reports whether pod's ReadinessGate condition is True.
func gateOpen(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == ReadinessGate {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// PodConditionWriter sets one condition in a pod's status.
type PodConditionWriter interface {
	SetPodCondition(ctx context.Context, pod *corev1.Pod, cond corev1.PodCondition) error
}

// APIConditionWriter writes pod conditions through the API server: a
// strategic merge patch of pods/status (conditions merge by type, so the
// kubelet's own are left alone) that names the pod's UID, so that it
// fails on a new pod of the same name.
type APIConditionWriter struct{ Client kubernetes.Interface }

// SetPodCondition patches cond into pod's status.
func (w APIConditionWriter) SetPodCondition(ctx context.Context, pod *corev1.Pod, cond corev1.PodCondition) error {
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"uid": pod.UID},
		"status":   map[string]any{"conditions": []corev1.PodCondition{cond}},
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = w.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{FieldManager: "tunnel-endpoint"}, "status")
	return err
}

// SetConditionWriter makes the controller open the readiness gates of the
// pods that list ReadinessGate through w. Call it before Run; without it
// the agent leaves the gates alone (and such pods never become ready).
func (c *Controller) SetConditionWriter(w PodConditionWriter) { c.conditions = w }

// gateView is what the desired state of a gated pod was computed from:
// the pod (by UID) and its addresses.
func gateView(pod *corev1.Pod) string {
	v4, v6 := podAddrs(pod)
	return fmt.Sprintf("%s %v %v", pod.UID, v4, v6)
}

// localGatedPods are the pods of node, in its pod network, that list the
// gate.
func localGatedPods(node string, pods []*corev1.Pod) []*corev1.Pod {
	var gated []*corev1.Pod
	for _, pod := range pods {
		if pod.Spec.NodeName == node && !pod.Spec.HostNetwork && HasReadinessGate(pod) {
			gated = append(gated, pod)
		}
	}
	return gated
}

// gateViews returns the gateView of every local pod that lists the gate.
func gateViews(node string, pods []*corev1.Pod) map[string]string {
	views := map[string]string{}
	for _, pod := range localGatedPods(node, pods) {
		views[pod.Namespace+"/"+pod.Name] = gateView(pod)
	}
	return views
}

// gateBlocker returns why the ReadinessGate of the local pod, whose
// addresses are now podNow, cannot open yet, or "" when it can: the last
// recompute saw the pod with these addresses (a pod whose address came
// after it would look as if no tunnel Service selected it), the pod and
// the node hold the pod's desired state, and no tunnel Service whose
// selector matches the pod waits for its EndpointSlice to list it.
func (c *Controller) gateBlocker(pod *corev1.Pod, podNow PodTunnels) string {
	key := pod.Namespace + "/" + pod.Name
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gateViews[key] != gateView(pod) {
		return "the agent has not computed its tunnel IPs for its current addresses yet"
	}
	if vips := c.unlisted[key]; len(vips) > 0 {
		return fmt.Sprintf("tunnel IPs %v wait for the EndpointSlices to list the pod", vips)
	}
	want, served := c.desired[key]
	if !served {
		want = podNow
	}
	if done, ok := c.podDone[key]; !ok || !done.Equal(want) {
		return "its namespace is not converged yet"
	}
	if len(want.TunnelIPs) > 0 && !c.nodeDone[key].Equal(want) {
		return "the node's namespace is not converged for it yet"
	}
	return ""
}

// openGate sets pod's ReadinessGate condition to True when the pod lists
// the gate, its condition is not True yet, and nothing blocks it.
func (c *Controller) openGate(ctx context.Context, pod *corev1.Pod) error {
	if c.conditions == nil || !HasReadinessGate(pod) || gateOpen(pod) || pod.DeletionTimestamp != nil {
		return nil
	}
	podNow := runtimePod(pod)
	if len(podNow.Addrs()) == 0 {
		return nil
	}
	key := pod.Namespace + "/" + pod.Name
	c.mu.Lock()
	done := c.opened[key] == pod.UID
	c.mu.Unlock()
	if done {
		return nil
	}
	if why := c.gateBlocker(pod, PodTunnels{Pod: podNow}); why != "" {
		c.log.WithFields(logrus.Fields{"pod": key, "condition": string(ReadinessGate)}).Debug("readiness gate stays closed: " + why)
		return nil
	}
	c.mu.Lock()
	vips := c.desired[key].TunnelIPs
	c.mu.Unlock()
	msg := "the pod serves no tunnel IP"
	if len(vips) > 0 {
		msg = fmt.Sprintf("tunnel IPs %v in place", vips)
	}
	cond := corev1.PodCondition{Type: ReadinessGate, Status: corev1.ConditionTrue, Reason: reasonTunnelIPsInPlace,
		Message: msg, LastTransitionTime: metav1.Now()}
	if err := c.conditions.SetPodCondition(ctx, pod, cond); err != nil {
		return fmt.Errorf("pod %s: setting its condition %s: %w", key, ReadinessGate, err)
	}
	c.mu.Lock()
	c.opened[key] = pod.UID
	c.mu.Unlock()
	c.log.WithFields(logrus.Fields{"pod": key, "condition": string(ReadinessGate), "tunnel_ips": vips}).Info("readiness gate opened")
	c.metrics.gateOpened()
	return nil
}

// openNodeGates opens the gates that waited for the node's namespace.
func (c *Controller) openNodeGates(ctx context.Context, served []PodTunnels) {
	for _, pt := range served {
		key := pt.Pod.Namespace + "/" + pt.Pod.Name
		pod, err := c.pods.Pods(pt.Pod.Namespace).Get(pt.Pod.Name)
		if err != nil {
			continue
		}
		if err := c.openGate(ctx, pod); err != nil {
			c.log.WithError(err).WithField("pod", key).Warn("opening the readiness gate failed, will retry")
			c.queue.AddRateLimited(daemon.ObjectKey(key))
		}
	}
}
