package cluster

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// The policies of examples/allow-tunnel-routers.yaml.
const (
	policyDefaultDeny = "default-deny-ingress"
	policyCarrier     = "allow-tunnel-routers"
	policyOffice      = "echo-from-office"
)

// networkPolicy runs the NetworkPolicy steps under a real policy engine:
// kube-network-policies filters the worker's forwarded traffic (the
// carrier: GRE from lab-router in gre mode, MPLS frames in mpls mode), and
// the agent of the real image, under the manifest's RBAC, filters the
// decapsulated packets in the pods.
//
//  1. examples/allow-tunnel-routers.yaml applied unchanged (default deny,
//     the router node admitted, clients from 198.51.100.0/24 on port 7):
//     the client connects;
//  2. the office policy swapped for one admitting only 203.0.113.0/24: the
//     client's new connections refused (by the agent: the carrier is
//     still admitted);
//  3. the office policy back, the carrier allowance removed: in gre mode
//     the client is refused (by the engine: it drops the GRE packets,
//     whatever the agent admits), in mpls mode it still connects (the
//     engine never sees MPLS frames);
//  4. no policy: the client connects.
//
// A connection opened before any policy keeps echoing through steps 1 and
// 2.
func (c *cluster) networkPolicy(t *testing.T, mode string) {
	ctx := context.Background()
	policies := c.kube.NetworkingV1().NetworkPolicies(exampleNamespace)
	t.Cleanup(func() {
		_ = policies.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	})
	open := startStreamOrFail(t, c)
	echoing := func(when string) {
		t.Helper()
		before := open.Stats().Verified
		c.waitFor(t, "the connection opened before any policy echoing "+when, 30*time.Second, func() (bool, error) {
			st := open.Stats()
			return st.Verified > before+256, st.Err
		})
	}

	example := vmFile(t, policyFile)
	if err := kubeenv.Apply(ctx, c.cfg, example, false); err != nil {
		t.Fatal(err)
	}
	took := c.waitFor(t, "the client admitted by examples/allow-tunnel-routers.yaml", time.Minute, func() (bool, error) { return c.connects(), nil })
	t.Logf("1. examples/allow-tunnel-routers.yaml applied: the client (in 198.51.100.0/24) connects %v after the apply", took.Round(100*time.Millisecond))
	t.Logf("%s:\n%s", engineName(), c.engineReport())
	echoing("under the example's policies")

	if err := policies.Delete(ctx, policyOffice, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := policies.Create(ctx, onlyFrom("only-elsewhere", "203.0.113.0/24"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	took = c.waitFor(t, "the client refused by a policy admitting only 203.0.113.0/24", time.Minute, func() (bool, error) { return !c.connects(), nil })
	t.Logf("2. clients admitted only from 203.0.113.0/24, the carrier still admitted: the client's new connections refused after %v (a refused try waits 2 s)", took.Round(100*time.Millisecond))
	echoing("after its address was refused")
	if _, errs := stopAll([]*workload.Stream{open}); len(errs) > 0 {
		t.Errorf("the connection open across the policy changes: %v", errs)
	}

	if err := policies.Delete(ctx, "only-elsewhere", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := kubeenv.Apply(ctx, c.cfg, example, false); err != nil {
		t.Fatal(err)
	}
	c.waitFor(t, "the client admitted again", time.Minute, func() (bool, error) { return c.connects(), nil })
	dropsBefore := c.engineDrops(t)
	if err := policies.Delete(ctx, policyCarrier, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if mode == "gre" {
		took = c.waitForOr(t, "the client refused once the router node is not admitted", time.Minute, c.engineReport, func() (bool, error) { return !c.connects(), nil })
		drops := c.engineDrops(t)
		if drops <= dropsBefore {
			t.Errorf("%s counted %d dropped packets before and %d after: the refusal was not the engine's\n%s", engineName(), dropsBefore, drops, c.engineReport())
		}
		t.Logf("3. the carrier allowance deleted (gre): the engine drops the GRE packets, the client is refused after %v; the engine's drops %d -> %d", took.Round(100*time.Millisecond), dropsBefore, drops)
	} else {
		time.Sleep(3 * time.Second) // the engine has seen the change
		refused := 0
		for range 5 {
			if !c.connects() {
				refused++
			}
		}
		if refused > 0 {
			t.Errorf("mpls: %d of 5 connections refused without the carrier allowance; MPLS frames should pass the engine\n%s", refused, c.engineReport())
		}
		t.Logf("3. the carrier allowance deleted (mpls): 5 of 5 connections still answered %v after the delete (the engine never sees MPLS frames)", time.Since(start).Round(100*time.Millisecond))
	}
	t.Logf("%s:\n%s", engineName(), c.engineReport())

	if err := policies.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	took = c.waitFor(t, "the client connects with no policy", time.Minute, func() (bool, error) { return c.connects(), nil })
	t.Logf("4. no policy: the client connects after %v", took.Round(100*time.Millisecond))
}

// engineName names the NetworkPolicy engine of the run's plugin.
func engineName() string {
	if clusterCNI() == cniCalico {
		return "Calico's Felix"
	}
	return "kube-network-policies"
}

// onlyFrom is a policy admitting clients of cidr to the echo pods' port.
func onlyFrom(name, cidr string) *networkingv1.NetworkPolicy {
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(int32(service.Port()))
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": exampleName}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: cidr}}},
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
			}},
		},
	}
}

// engineReport is what the worker's helper tells of kube-network-policies.
func (c *cluster) engineReport() string {
	b, err := c.helperGet("/engine")
	if err != nil {
		return err.Error()
	}
	return string(b)
}

// engineDrops sums the packets kube-network-policies dropped.
func (c *cluster) engineDrops(t *testing.T) int {
	t.Helper()
	b, err := c.helperGet("/engine")
	if err != nil {
		t.Fatalf("the engine's metrics: %v", err)
	}
	total := 0
	for _, l := range strings.Split(string(bytes.TrimSpace(b)), "\n") {
		if !strings.Contains(l, `verdict="drop"`) {
			continue
		}
		var v float64
		fields := strings.Fields(l)
		if _, err := fmt.Sscan(fields[len(fields)-1], &v); err == nil {
			total += int(v)
		}
	}
	return total
}

// startStreamOrFail opens one greeted echo stream from the client, which
// sends four times as often as the many flows of the other steps, so that
// its progress shows within a second or two.
func startStreamOrFail(t *testing.T, c *cluster) *workload.Stream {
	t.Helper()
	opts := streamOpt
	opts.Interval = 250 * time.Millisecond
	s, err := workload.StartStream(c.client, service, c.clientPort(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// 10 s at most: a stuck flow would hold the run until TCP gives up.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = s.Stop(ctx)
	})
	return s
}

// connects reports whether a new connection from the client is greeted
// within 2 s.
func (c *cluster) connects() bool {
	opts := streamOpt
	opts.DialTimeout = 2 * time.Second
	s, err := workload.StartStream(c.client, service, c.clientPort(), opts)
	if err != nil {
		return false
	}
	_, err = s.Stop(context.Background())
	return err == nil
}
