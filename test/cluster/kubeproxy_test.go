package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// kubeProxyMode is the mode of the real kube-proxy on both nodes while the
// cluster runs each tunnel mode: the first at boot, the other after a
// restart in install (kube-proxy removes the other mode's rules itself).
var kubeProxyMode = map[string]string{"gre": "iptables", "mpls": "nftables"}

// untrackOff is the agent's flag that turns the reply exemption off.
const untrackOff = "--untrack-replies=false"

// kubeProxyURL is an address of kube-proxy's on a node.
func kubeProxyURL(n node, port int, path string) string {
	return fmt.Sprintf("http://%s:%d%s", n.linkAddr, port, path)
}

// httpText GETs url and returns its body; a status other than 200 is an
// error.
func httpText(url string) (string, error) {
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", url, resp.Status)
	}
	return strings.TrimSpace(string(b)), err
}

// useKubeProxy runs kube-proxy in mode on both nodes (restarting it where
// it runs another) and waits until both report the mode and are healthy.
func (c *cluster) useKubeProxy(t *testing.T, mode string) {
	t.Helper()
	nodes := []node{routerNode, workerNode}
	for _, n := range nodes {
		if got, _ := httpText(kubeProxyURL(n, lab.KubeProxyMetricsPort, "/proxyMode")); got == mode {
			continue
		}
		var err error
		var out []byte
		if n.role == "router" {
			out, err = exec.Command(lab.KubeProxyStart, mode).CombinedOutput()
		} else {
			var resp *http.Response
			resp, err = http.Post(c.helper+"/kube-proxy?mode="+mode, "", nil)
			if err == nil {
				out, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = fmt.Errorf("%s", resp.Status)
				}
			}
		}
		if err != nil {
			t.Fatalf("starting kube-proxy in %s mode on %s: %v: %s", mode, n.name, err, out)
		}
	}
	start := time.Now()
	c.waitForOr(t, "kube-proxy in "+mode+" mode and healthy on both nodes", 2*time.Minute, func() string {
		out, _ := exec.Command("tail", "-n", "20", lab.KubeProxyLog).CombinedOutput()
		return fmt.Sprintf("%s on %s:\n%s", lab.KubeProxyLog, routerNode.name, out)
	}, func() (bool, error) {
		for _, n := range nodes {
			if got, err := httpText(kubeProxyURL(n, lab.KubeProxyMetricsPort, "/proxyMode")); err != nil || got != mode {
				return false, nil
			}
			if _, err := httpText(kubeProxyURL(n, lab.KubeProxyHealthzPort, "/healthz")); err != nil {
				return false, nil
			}
		}
		return true, nil
	})
	t.Logf("kube-proxy in %s mode and healthy on both nodes %v after the (re)start", mode, time.Since(start).Round(100*time.Millisecond))
}

// invalidDropRule finds kube-proxy's rule that drops forwarded packets in
// conntrack state INVALID in iptables-save -c output, and returns its
// packet counter.
func invalidDropRule(save string) (packets int64, found bool) {
	return rulePackets(save, func(rule string) bool {
		return strings.Contains(rule, "-A KUBE-FORWARD ") && strings.Contains(rule, "--ctstate INVALID") && strings.HasSuffix(rule, "-j DROP")
	})
}

// rulePackets sums the packet counters of the rules in iptables-save -c
// output ("[packets:bytes] -A CHAIN ...") that match selects; found: some
// rule matched.
func rulePackets(save string, match func(rule string) bool) (packets int64, found bool) {
	for l := range strings.Lines(save) {
		l = strings.TrimSpace(l)
		if !match(l) {
			continue
		}
		found = true
		counters, _, ok := strings.Cut(strings.TrimPrefix(l, "["), "]")
		if !ok {
			continue
		}
		p, _, _ := strings.Cut(counters, ":")
		if n, err := strconv.ParseInt(p, 10, 64); err == nil {
			packets += n
		}
	}
	return packets, found
}

// workerInvalidDrops is the packet count of kube-proxy's INVALID drop on the
// worker (found: the rule is there).
func (c *cluster) workerInvalidDrops(t *testing.T) (packets int64, found bool) {
	t.Helper()
	b, err := c.helperGet("/kube-proxy")
	if err != nil {
		t.Fatalf("the worker's filter table: %v", err)
	}
	return invalidDropRule(string(b))
}

// replyExemptionOnWorker reports whether the worker's namespace holds the
// agent's reply exemption (the inet table kube-service-tunnel).
func (c *cluster) replyExemptionOnWorker() (bool, error) {
	b, err := c.helperGet("/kstate")
	if err != nil {
		return false, err
	}
	var st kstate.State
	if err := json.Unmarshal(b, &st); err != nil {
		return false, err
	}
	return slices.ContainsFunc(st.Sections["nftables"], func(l string) bool {
		return strings.HasPrefix(l, "chain 1 kube-service-tunnel replies ")
	}), nil
}

// setAgentFlag adds flag to the agent DaemonSet's arguments, or removes
// it, and waits for the rollout and the worker's reply exemption to follow.
func (c *cluster) setAgentFlag(t *testing.T, flag string, on bool) {
	t.Helper()
	ctx := context.Background()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		ds, err := c.kube.AppsV1().DaemonSets(daemonNamespace).Get(ctx, "tunnel-endpoint", metav1.GetOptions{})
		if err != nil {
			return err
		}
		for i := range ds.Spec.Template.Spec.Containers {
			ctr := &ds.Spec.Template.Spec.Containers[i]
			if ctr.Name != "tunnel-endpoint" {
				continue
			}
			ctr.Args = slices.DeleteFunc(ctr.Args, func(a string) bool { return a == flag })
			if on {
				ctr.Args = append(ctr.Args, flag)
			}
		}
		_, err = c.kube.AppsV1().DaemonSets(daemonNamespace).Update(ctx, ds, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("setting the agent's %s to %v: %v", flag, on, err)
	}
	c.waitDaemonSet(t, "tunnel-endpoint", 2)
	want := flag != untrackOff || !on
	c.waitFor(t, fmt.Sprintf("the worker's reply exemption there: %v", want), time.Minute, func() (bool, error) {
		has, err := c.replyExemptionOnWorker()
		return has == want, err
	})
}

// handshakes opens n connections from the client to the tunnel IP, each
// from a port of its own, and returns the errors of those that failed.
func (c *cluster) handshakes(n int) []error {
	var errs []error
	opt := streamOpt
	opt.DialTimeout = 4 * time.Second
	for range n {
		port := c.clientPort()
		s, err := workload.StartStream(c.client, service, port, opt)
		if err != nil {
			errs = append(errs, fmt.Errorf("client port %d: %w", port, err))
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if _, err := s.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("client port %d, greeted by %s: %w", port, greetedPod(s), err))
		}
		cancel()
	}
	return errs
}

// kubeProxyReplies shows what kube-proxy does to the pods' replies, with
// the agent's reply exemption turned off and then on again: in iptables
// mode its rule "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"
// drops every SYN-ACK (the worker's conntrack never saw the SYN, which came
// inside the carrier) and no handshake completes; its nftables mode has no
// such rule (kube-proxy v1.34). With the exemption every handshake
// completes in both.
func (c *cluster) kubeProxyReplies(t *testing.T, mode string) {
	const attempts = 3
	proxyMode := kubeProxyMode[mode]
	before, rule := c.workerInvalidDrops(t)
	if rule != (proxyMode == "iptables") {
		t.Fatalf("kube-proxy in %s mode: its INVALID drop in KUBE-FORWARD on the worker: %v, want %v", proxyMode, rule, proxyMode == "iptables")
	}
	felixBefore := c.felixInvalidDrops(t)
	c.setAgentFlag(t, untrackOff, true)
	without := c.handshakes(attempts)
	dropped, _ := c.workerInvalidDrops(t)
	if felix := c.felixInvalidDrops(t); clusterCNI() == cniCalico {
		t.Logf("Calico: Felix's INVALID drop in its from-workload chains counted %d packets without the exemption", felix-felixBefore)
	}
	c.setAgentFlag(t, untrackOff, false)
	with := c.handshakes(attempts)
	after, _ := c.workerInvalidDrops(t)
	t.Logf("kube-proxy %s mode, the agent %s: %d of %d handshakes failed (%v); kube-proxy's INVALID drop counted %d packets",
		proxyMode, untrackOff, len(without), attempts, without, dropped-before)
	t.Logf("kube-proxy %s mode, the reply exemption on (the default): %d of %d handshakes failed (%v); INVALID drop: %d more packets (late SYN-ACK retransmissions of the failed handshakes)",
		proxyMode, len(with), attempts, with, after-dropped)
	switch proxyMode {
	case "iptables":
		if len(without) != attempts {
			t.Errorf("without the reply exemption %d of %d handshakes completed under kube-proxy's iptables mode, want none (its INVALID drop)", attempts-len(without), attempts)
		}
		if dropped-before < attempts {
			t.Errorf("kube-proxy's INVALID drop counted %d packets while the handshakes failed, want at least %d (a SYN-ACK each)", dropped-before, attempts)
		}
	case "nftables":
		if clusterCNI() == cniCalico {
			// Felix drops what conntrack calls INVALID leaving a pod.
			if len(without) != attempts {
				t.Errorf("without the reply exemption %d of %d handshakes completed under Calico, whose from-workload chains drop conntrack INVALID, want none", attempts-len(without), attempts)
			}
			break
		}
		if len(without) != 0 {
			t.Errorf("without the reply exemption %d of %d handshakes failed under kube-proxy's nftables mode, which has no INVALID drop: %v", len(without), attempts, without)
		}
	}
	if len(with) != 0 {
		t.Errorf("with the reply exemption %d of %d handshakes failed: %v", len(with), attempts, with)
	}
}

// felixInvalidDrops is, under Calico, the packet count of Felix's drop of
// conntrack INVALID in its from-workload chains (cali-fw-*) on the worker;
// 0 under other plugins.
func (c *cluster) felixInvalidDrops(t *testing.T) int64 {
	t.Helper()
	if clusterCNI() != cniCalico {
		return 0
	}
	b, err := c.helperGet("/iptables?table=filter")
	if err != nil {
		t.Fatalf("the worker's filter table: %v", err)
	}
	packets, _ := rulePackets(string(b), func(rule string) bool {
		return strings.Contains(rule, "-A cali-fw-") && strings.Contains(rule, "--ctstate INVALID") && strings.HasSuffix(rule, "-j DROP")
	})
	return packets
}
