package integration

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// poolsPolicy is an open pool and a pool only namespace team may use.
func poolsPolicy(t *testing.T, team string) tunnelclaim.Policy {
	t.Helper()
	pools, err := tunnelclaim.ParsePools("192.0.2.0/24;203.0.113.0/28=" + team)
	if err != nil {
		t.Fatal(err)
	}
	return tunnelclaim.Policy{Pools: pools}
}

// createNodeAt creates a Node whose InternalIP is addr (deleted at the end).
func createNodeAt(t *testing.T, cs kubernetes.Interface, name, addr string) {
	t.Helper()
	ctx := context.Background()
	node, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}}
	if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// The router, as its ServiceAccount, serves only tunnel IPs its pools admit:
// a Service outside every pool gets a TunnelIPRefused Warning and is not
// programmed, one inside is; a namespace-limited pool refuses the other
// namespaces; a Node that appears with a served tunnel IP as its address
// takes it away, and gives it back when it goes.
func TestRouterAddressPools(t *testing.T) {
	cs := adminClient(t)
	team, other := freshNamespace(t, cs), freshNamespace(t, cs)
	cfg := routerCfg(encap.GRE, 16)
	cfg.Policy = poolsPolicy(t, team)
	rec := startRouter(t, cfg)

	inside := createService(t, cs, other, "inside", "192.0.2.90")
	applySlice(t, cs, other, "inside", "inside-1", ep{addr: "10.244.9.1", node: "node-1"})
	outside := createService(t, cs, other, "outside", "198.51.100.90")
	applySlice(t, cs, other, "outside", "outside-1", ep{addr: "10.244.9.2", node: "node-1"})
	limited := createService(t, cs, other, "limited", "203.0.113.5")
	applySlice(t, cs, other, "limited", "limited-1", ep{addr: "10.244.9.3", node: "node-1"})
	allowed := createService(t, cs, team, "allowed", "203.0.113.6")
	applySlice(t, cs, team, "allowed", "allowed-1", ep{addr: "10.244.9.4", node: "node-1"})

	waitTable(t, rec, "192.0.2.90", 16, addrs("10.244.9.1"))
	waitEvent(t, cs, inside, corev1.EventTypeNormal, router.ReasonProgrammed, "192.0.2.90")
	waitTable(t, rec, "203.0.113.6", 16, addrs("10.244.9.4"))
	waitEvent(t, cs, allowed, corev1.EventTypeNormal, router.ReasonProgrammed, "203.0.113.6")
	waitEvent(t, cs, outside, corev1.EventTypeWarning, router.ReasonRefused,
		"tunnel IP 198.51.100.90 is in no address pool (--pools 192.0.2.0/24;203.0.113.0/28="+team+")")
	waitEvent(t, cs, limited, corev1.EventTypeWarning, router.ReasonRefused,
		fmt.Sprintf("tunnel IP 203.0.113.5 is in address pool 203.0.113.0/28, which only namespaces %s may use, not %s", team, other))
	for _, vip := range []string{"198.51.100.90", "203.0.113.5"} {
		if _, ok := rec.get(vip); ok {
			t.Errorf("refused tunnel IP %s is programmed", vip)
		}
	}

	// A Node appears with the served tunnel IP as its address.
	nodeName := "pools-node-" + other
	createNodeAt(t, cs, nodeName, "192.0.2.90")
	waitRemoved(t, rec, "192.0.2.90", "once Node "+nodeName+" has it as its address")
	waitEvent(t, cs, inside, corev1.EventTypeWarning, router.ReasonRefused, "tunnel IP 192.0.2.90 is the address of Node "+nodeName)
	if err := cs.CoreV1().Nodes().Delete(context.Background(), nodeName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTable(t, rec, "192.0.2.90", 16, addrs("10.244.9.1"))
	if _, ok := rec.get("203.0.113.6"); !ok {
		t.Error("the namespace's own pool lost its tunnel IP on the way")
	}
}

// The endpoint agent, as its ServiceAccount, reaches the routers' decision:
// a pod backing an admitted, an out-of-pool and a namespace-limited tunnel
// Service holds only the admitted tunnel IP, the refusals are logged with
// the router's reasons, and a Node taking the tunnel IP as its address
// removes it from the pod (every Node is watched, not only the agent's own).
func TestEndpointAgentAddressPools(t *testing.T) {
	testnetns.RequireRoot(t)
	cs := adminClient(t)
	team, ns := freshNamespace(t, cs), freshNamespace(t, cs)
	node := testnetns.New(t)
	nodeName := "node-" + ns
	ip := netip.MustParseAddr("198.18.32.11")
	podNS := newPodNetns(t, node, ip, "veth-pools")
	pod := createPod(t, cs, ns, "web-1", nodeName, ip)
	a := startAgentWithPolicy(t, nodeName, node, poolsPolicy(t, team))

	for name, vip := range map[string]string{"inside": "192.0.2.95", "outside": "198.51.100.95", "limited": "203.0.113.7"} {
		createService(t, cs, ns, name, vip)
		applyPodSlice(t, cs, name, pod)
	}
	waitTunnelIPs(t, podNS, "192.0.2.95", "only the admitted tunnel IP in the pod")
	eventually(t, 10*time.Second, "refusals logged", func() error {
		log := a.log.String()
		for _, want := range []string{
			"tunnel IP 198.51.100.95 is in no address pool",
			fmt.Sprintf("tunnel IP 203.0.113.7 is in address pool 203.0.113.0/28, which only namespaces %s may use, not %s", team, ns),
		} {
			if !strings.Contains(log, want) {
				return fmt.Errorf("no %q in the log:\n%s", want, log)
			}
		}
		return nil
	})

	otherNode := "pools-agent-node-" + ns
	createNodeAt(t, cs, otherNode, "192.0.2.95")
	waitTunnelIPs(t, podNS, "", "tunnel IP removed once Node "+otherNode+" has it as its address")
	if err := cs.CoreV1().Nodes().Delete(context.Background(), otherNode, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitTunnelIPs(t, podNS, "192.0.2.95", "tunnel IP back once the Node is gone")
}
