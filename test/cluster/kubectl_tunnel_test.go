package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// kubectlTunnel runs kubectl tunnel's code with the admin kubeconfig, as
// the plugin binary does, and returns its standard output.
func kubectlTunnel(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stdout, err := tunnelctl.Output(ctx, append([]string{"--kubeconfig", adminKubeconfig}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return stdout
}

// explainStreams checks, for up to n of the streams, that the pod kubectl
// tunnel explain names for the stream's flow is the pod that greeted it. The
// seed is the one the router created in its Secret at install.
func (c *cluster) explainStreams(t *testing.T, streams []*workload.Stream, n int) {
	t.Helper()
	streams = streams[:min(n, len(streams))]
	// Each explain is a new kubectl tunnel run with its own connections to
	// the API server: four at a time.
	outs := make([]string, len(streams))
	errs := make([]error, len(streams))
	lab.InParallel(4, len(streams), func(i int) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		outs[i], errs[i] = tunnelctl.Output(ctx, "--kubeconfig", adminKubeconfig, "explain", service.String(), "--from", fmt.Sprintf("%s:%d", clientIP, streams[i].LocalPort()), "-o", "json")
	})
	right := 0
	for i, s := range streams {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		var ex tunnelctl.Explanation
		out := outs[i]
		if err := json.Unmarshal([]byte(out), &ex); err != nil {
			t.Fatalf("explain: %v\n%s", err, out)
		}
		if want := exampleNamespace + "/" + greetedPod(s); ex.Endpoint.Pod != want {
			t.Errorf("flow from %s:%d: kubectl tunnel explain names %s, %s answered", clientIP, s.LocalPort(), ex.Endpoint.Pod, want)
			continue
		}
		right++
	}
	t.Logf("kubectl tunnel explain named the answering pod of %d of %d flows (seed from %s)", right, min(n, len(streams)), "the Secret the router created")
}

// routerStatusPod waits until the router's status shows the example's
// tunnel IP with the current table, checks that the router's Node owns the
// status ConfigMap, and returns the pod the status names as its writer.
func (c *cluster) routerStatusPod(t *testing.T) string {
	t.Helper()
	c.waitFor(t, "kubectl tunnel status showing the router's current table", time.Minute, func() (bool, error) {
		var rep tunnelctl.StatusReport
		if err := json.Unmarshal([]byte(kubectlTunnel(t, "status", tunnelIP.String(), "-o", "json")), &rep); err != nil {
			return false, err
		}
		if len(rep.Tunnels) != 1 || len(rep.Tunnels[0].Routers) != 1 || !rep.Tunnels[0].Routers[0].Current() {
			return false, fmt.Errorf("status %+v", rep.Tunnels)
		}
		return true, nil
	})
	cm, err := c.kube.CoreV1().ConfigMaps(routerstatus.DefaultNamespace).Get(context.Background(), routerstatus.Name(routerNode.name), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cm.OwnerReferences) != 1 || cm.OwnerReferences[0].Kind != "Node" || cm.OwnerReferences[0].Name != routerNode.name {
		t.Fatalf("the router's status ConfigMap is owned by %v, want its Node %s", cm.OwnerReferences, routerNode.name)
	}
	r, err := routerstatus.Parse(cm)
	if err != nil {
		t.Fatal(err)
	}
	return r.Pod
}
