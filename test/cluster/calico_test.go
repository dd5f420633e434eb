package cluster

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"

	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// What docs/network-plugins.md#calico tells a user on Calico to set, as
// the merge patches of its kubectl patch commands; the lab applies them
// as written.
const (
	// calicoFelixPatch: kubectl patch felixconfiguration default --type=merge -p '...'
	calicoFelixPatch = `{"spec":{"workloadSourceSpoofing":"Any"}}`
	// calicoTemplatePatch: kubectl -n demo patch deployment echo -p '...'
	calicoTemplatePatch = `{"spec":{"template":{"metadata":{"annotations":{"cni.projectcalico.org/allowedSourcePrefixes":"[\"192.0.2.10/32\"]"}}}}}`
	// calicoTunnelNodeConfig: kubectl apply -f of this FelixConfiguration
	// for each tunnel node (node.NAME is Felix's per-node configuration).
	calicoTunnelNodeConfig = `{"apiVersion":"crd.projectcalico.org/v1","kind":"FelixConfiguration","metadata":{"name":"node.lab-router"},"spec":{"chainInsertMode":"Append"}}`
	// The router's warning about rules ahead of its jump in mangle
	// PREROUTING (router/startup: rulesAheadWarner).
	routerRulesAheadWarning = "come before the router's jump"
	routerJumpFirst         = "the router's jump is the first rule of mangle PREROUTING"
	// calicoPrefixesAnnotation is the pod annotation Calico's CNI plugin
	// reads.
	calicoPrefixesAnnotation = "cni.projectcalico.org/allowedSourcePrefixes"
	// calicoWarning is in the agent's warning about a pod Felix will
	// guard against its tunnel IPs (endpoint/replypath.go).
	calicoWarning = "is on Calico's network"
)

// felixConfigurations is Calico's FelixConfiguration in its Kubernetes
// datastore (no Calico API server runs; kubectl patch felixconfiguration
// reaches the same objects).
var felixConfigurations = schema.GroupVersionResource{Group: "crd.projectcalico.org", Version: "v1", Resource: "felixconfigurations"}

// calicoReplies runs where the nodes run Calico, after the example's pods
// are served and before the first answer is awaited: with Calico's
// defaults, it shows the pods' replies dropped by Felix's workload source
// check (its raw table's reverse-path drop counts them) and the agent's
// warning naming each pod; then it applies what docs/network-plugins.md
// says, as written (FelixConfiguration first, then the pod template),
// and waits for the rollout. deployExample then waits for the answer.
func (c *cluster) calicoReplies(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	const attempts = 3
	dropsBefore := c.felixSourceDrops(t)
	without := c.handshakes(attempts)
	drops := c.felixSourceDrops(t)
	t.Logf("Calico's defaults: %d of %d handshakes failed (%v); Felix's reverse-path drop in cali-PREROUTING counted %d packets",
		len(without), attempts, without, drops-dropsBefore)
	if len(without) != attempts {
		t.Errorf("with Calico's defaults %d of %d handshakes completed; Felix's workload source check should drop every reply from the tunnel IP", attempts-len(without), attempts)
	}
	if drops-dropsBefore < attempts {
		t.Errorf("Felix's reverse-path drop counted %d packets while the handshakes failed, want at least %d (a SYN-ACK each)", drops-dropsBefore, attempts)
	}
	took := c.waitFor(t, "the agent's warning about every echo pod", time.Minute, func() (bool, error) {
		logs := c.agentLogs(t)
		for _, p := range c.examplePods(t) {
			if !strings.Contains(logs, "pod "+p.Namespace+"/"+p.Name+" "+calicoWarning) {
				return false, nil
			}
		}
		return true, nil
	})
	t.Logf("the agent warned about every echo pod (%v more): %s", took.Round(100*time.Millisecond), grepLine(c.agentLogs(t), calicoWarning))

	applied := time.Now()
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	felix := dyn.Resource(felixConfigurations)
	if _, err := felix.Patch(ctx, "default", types.MergePatchType, []byte(calicoFelixPatch), metav1.PatchOptions{}); apierrors.IsNotFound(err) {
		// kubectl patch needs it to exist; calico-node's startup makes it.
		t.Fatalf("no FelixConfiguration default: %v", err)
	} else if err != nil {
		t.Fatalf("patching FelixConfiguration default: %v", err)
	}
	if _, err := c.kube.AppsV1().Deployments(exampleNamespace).Patch(ctx, exampleName, types.StrategicMergePatchType, []byte(calicoTemplatePatch), metav1.PatchOptions{}); err != nil {
		t.Fatalf("patching the example's pod template: %v", err)
	}
	c.waitRollout(t, 3*time.Minute)
	t.Logf("FelixConfiguration default patched (%s; its spec now %v) and the pod template annotated: the rollout done %v after",
		calicoFelixPatch, c.felixConfiguration(t).Object["spec"], time.Since(applied).Round(100*time.Millisecond))
	// The tunnel node: Felix inserts its chains first in the tables the
	// router shares with it (iptables-nft), and accepts there every packet
	// of an established connection, which the router's chain then never
	// marks.
	took = c.waitFor(t, "the router's warning about Felix's chain ahead of its jump", 3*time.Minute, func() (bool, error) {
		return strings.Contains(c.routerLogLines(t, routerRulesAheadWarning), "cali-PREROUTING"), nil
	})
	t.Logf("the router warned (%v more): %s", took.Round(100*time.Millisecond), grepLine(c.routerLogLines(t, routerRulesAheadWarning), "cali-PREROUTING"))
	broken := c.echoes(attempts)
	t.Logf("the replies allowed, Felix's chains first on the tunnel node: %d of %d connections failed to echo for 3 s (%v)", len(broken), attempts, broken)
	if len(broken) != attempts {
		// The lab's replies pass the router node, whose conntrack then
		// calls the client's packets established, which Felix accepts.
		t.Errorf("with Felix's chains ahead of the router's jump %d of %d connections echoed, want none", attempts-len(broken), attempts)
	}
	node := &unstructured.Unstructured{}
	if err := node.UnmarshalJSON([]byte(calicoTunnelNodeConfig)); err != nil {
		t.Fatal(err)
	}
	applied = time.Now()
	if _, err := felix.Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("creating FelixConfiguration %s: %v", node.GetName(), err)
	}
	took = c.waitFor(t, "the router's jump first in mangle PREROUTING", 3*time.Minute, func() (bool, error) {
		return c.routerLogLines(t, routerJumpFirst) != "", nil
	})
	t.Logf("FelixConfiguration %s (chainInsertMode: Append) created: the router's jump first %v after", node.GetName(), took.Round(100*time.Millisecond))
	for _, p := range c.examplePods(t) {
		if p.Annotations[calicoPrefixesAnnotation] == "" {
			t.Errorf("pod %s has no %s after the rollout", p.Name, calicoPrefixesAnnotation)
		}
	}
}

// calicoReady reports whether the example's pod template already carries
// what Calico needs (a mode that ran before set it).
func (c *cluster) calicoReady(t *testing.T) bool {
	t.Helper()
	d, err := c.kube.AppsV1().Deployments(exampleNamespace).Get(context.Background(), exampleName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return d.Spec.Template.Annotations[calicoPrefixesAnnotation] != ""
}

// felixConfiguration is FelixConfiguration default, for the log.
func (c *cluster) felixConfiguration(t *testing.T) *unstructured.Unstructured {
	t.Helper()
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	u, err := dyn.Resource(felixConfigurations).Get(context.Background(), "default", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// agentLogs is the logs of the agent on the worker.
func (c *cluster) agentLogs(t *testing.T) string {
	t.Helper()
	var logs strings.Builder
	for _, p := range c.daemonPods(t, "tunnel-endpoint") {
		if p.Spec.NodeName == workerNode.name {
			logs.WriteString(c.podLogs(t, p))
		}
	}
	return logs.String()
}

// felixSourceDrops is the packet count of Felix's workload source check on
// the worker: the reverse-path drop of its raw table's cali-PREROUTING.
func (c *cluster) felixSourceDrops(t *testing.T) int64 {
	t.Helper()
	b, err := c.helperGet("/iptables?table=raw")
	if err != nil {
		t.Fatalf("the worker's raw table: %v", err)
	}
	n, found := felixRPFDrops(string(b))
	if !found {
		t.Fatalf("no reverse-path drop of Felix's in the worker's raw table:\n%s", b)
	}
	return n
}

// felixRPFDrops sums the packet counters of Felix's reverse-path drops in
// iptables-save -c -t raw output.
func felixRPFDrops(save string) (packets int64, found bool) {
	return rulePackets(save, func(rule string) bool {
		return strings.Contains(rule, "-A cali-PREROUTING ") && strings.Contains(rule, "-m rpfilter") && strings.HasSuffix(rule, "-j DROP")
	})
}

// echoes opens n connections from the client, one after the other, each
// sending a chunk every 250 ms for 3 s, and returns the errors of those
// that did not echo every chunk: unlike a handshake, this needs the
// client's packets of an established connection to reach the pod.
func (c *cluster) echoes(n int) []error {
	var errs []error
	opts := streamOpt
	opts.Interval = 250 * time.Millisecond
	opts.DialTimeout = 4 * time.Second
	for range n {
		port := c.clientPort()
		s, err := workload.StartStream(c.client, service, port, opts)
		if err != nil {
			errs = append(errs, fmt.Errorf("client port %d: %w", port, err))
			continue
		}
		time.Sleep(3 * time.Second)
		verified := s.Stats().Verified
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = s.Stop(ctx)
		cancel()
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("client port %d, greeted by %s: %w", port, greetedPod(s), err))
		case verified == 0:
			errs = append(errs, fmt.Errorf("client port %d, greeted by %s: nothing echoed in 3 s", port, greetedPod(s)))
		}
	}
	return errs
}
