// Command demo shows the tunnel router's main job on this host: two real
// tunnel-router processes, each in a network namespace of its own, against a
// real kube-apiserver, programming the bucket tables of examples/echo.yaml.
// Run it with `make demo`; it needs root and leaves nothing behind.
//
// This host has no GRE, so each router routes through a veth standing in for
// its flow-based GRE device (--gre-device-create=false): the routes, rules,
// HMARK rules and bucket tables are exactly the real ones, but packets are not
// encapsulated. The datapath with real GRE and MPLS runs in the VM lab.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/testnetns"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

const (
	seed      = 0x5eed1e55
	buckets   = 64
	tunnelIP  = "192.0.2.10"
	device    = "kst-demo"
	namespace = "demo"
)

var routers = []string{"kst-demo-router-a", "kst-demo-router-b"}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) {
	fmt.Printf("\n\033[1m==> "+format+"\033[0m\n", args...)
}

func run() error {
	if os.Geteuid() != 0 {
		return errors.New("needs root (network namespaces)")
	}
	bin, err := filepath.Abs("bin/tunnel-router")
	if err != nil {
		return err
	}
	ctx := context.Background()

	step("Starting a real kube-apiserver and etcd on 127.0.0.1")
	env, err := kubeenv.New()
	if err != nil {
		return err
	}
	defer env.Stop()
	fmt.Printf("    API server %s ready in %v\n", env.Host(), env.StartupDuration().Round(time.Millisecond))

	step("Deploying tunnel-router.yaml (RBAC, ConfigMap) and examples/echo.yaml")
	for _, f := range []string{"tunnel-router.yaml", "examples/echo.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		if err := env.ApplyYAML(ctx, env.AdminConfig(), b, false); err != nil {
			return fmt.Errorf("apply %s: %w", f, err)
		}
		fmt.Printf("    applied %s\n", f)
	}
	admin, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		return err
	}
	pods := []string{"10.244.1.11", "10.244.1.12", "10.244.2.21", "10.244.2.22"}
	fmt.Println("    no controller-manager runs here, so the demo creates the EndpointSlice the")
	fmt.Printf("    endpoint controller would: 4 ready echo pods %v\n", pods)
	if err := setEndpoints(ctx, admin, pods); err != nil {
		return err
	}

	step("Starting two tunnel routers, each in its own network namespace, as the tunnel-router ServiceAccount")
	saCfg, err := env.ServiceAccountConfig(ctx, "kube-service-tunnel", "tunnel-router")
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(env.Dir(), "tunnel-router.kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig, saCfg); err != nil {
		return err
	}
	var procs []*exec.Cmd
	defer func() {
		for _, p := range procs {
			_ = p.Process.Signal(syscall.SIGTERM)
			_, _ = p.Process.Wait()
		}
		for _, ns := range routers {
			_ = exec.Command("ip", "netns", "exec", ns, bin, "--cleanup", "--gre-device", device, "--gre-device-create=false").Run()
			_ = exec.Command("ip", "netns", "del", ns).Run()
		}
	}()
	for i, ns := range routers {
		if err := makeRouterNetns(ns, i); err != nil {
			return err
		}
		// The API server listens on the host's loopback; relay it into the
		// router's namespace at the same address.
		h, err := netns.GetFromName(ns)
		if err != nil {
			return err
		}
		stopRelay, err := testnetns.ForwardLoopback(h, strings.TrimPrefix(env.Host(), "https://"))
		h.Close()
		if err != nil {
			return err
		}
		defer stopRelay()
		logPath := filepath.Join(env.Dir(), ns+".log")
		p, err := startRouter(bin, ns, kubeconfig, logPath)
		if err != nil {
			return err
		}
		procs = append(procs, p)
		fmt.Printf("    %s: tunnel-router pid %d\n", ns, p.Process.Pid)
	}
	tables := make([]map[int]string, len(routers))
	for i, ns := range routers {
		if tables[i], err = waitTable(ns, len(pods)); err != nil {
			fmt.Printf("    %s's log:\n", ns)
			printHead(filepath.Join(env.Dir(), ns+".log"), 40)
			return err
		}
	}
	fmt.Println("    router a's log starts with:")
	printHead(filepath.Join(env.Dir(), routers[0]+".log"), 2)

	step("What router a programmed (ip -n %s ...)", routers[0])
	fmt.Println("    one policy rule per bucket, fwmark -> table:")
	printLines(sh("ip", "-n", routers[0], "rule", "show"), 3, "proto 245")
	fmt.Println("    the HMARK rule that hashes each flow to tunnel IP " + tunnelIP + " into one of 64 buckets:")
	printLines(sh("ip", "netns", "exec", routers[0], "iptables", "-t", "mangle", "-S", "KST-HMARK"), 2, "HMARK")
	fmt.Println("    and in each bucket's table, the route that encapsulates to one pod:")
	printLines(sh("ip", "-n", routers[0], "route", "show", "table", "7600"), 1, "")

	step("The bucket table of %s (bucket -> pod)", tunnelIP)
	printBucketTable(tables[0])

	step("Both routers chose the same pod for every bucket")
	if !mapsEqual(tables[0], tables[1]) {
		return errors.New("the two routers disagree")
	}
	fmt.Printf("    router a and router b: %d of %d buckets identical\n", buckets, buckets)

	step("Client flows to %s:7: bucket computed by HMARK, pod chosen by each router's kernel", tunnelIP)
	params := hmark.Params{Buckets: buckets, Offset: router.DefaultMarkOffset, Seed: seed}
	fmt.Printf("    %-24s %-7s %-15s %-15s\n", "client", "bucket", "router a", "router b")
	for i := range 6 {
		client := netip.MustParseAddr(fmt.Sprintf("198.51.100.%d", 7+i))
		flow := hmark.Flow{Src: client, Dst: netip.MustParseAddr(tunnelIP), SrcPort: uint16(40000 + 17*i), DstPort: 7, Proto: 6}
		mark := params.Mark(flow)
		var chosen []string
		for _, ns := range routers {
			out := sh("ip", "-n", ns, "route", "get", tunnelIP, "mark", fmt.Sprintf("%#x", mark))
			chosen = append(chosen, encapDst(out))
		}
		fmt.Printf("    %-24s %-7d %-15s %-15s\n", fmt.Sprintf("%v:%d", client, flow.SrcPort), mark-router.DefaultMarkOffset, chosen[0], chosen[1])
		if chosen[0] != chosen[1] || chosen[0] != tables[0][int(mark-router.DefaultMarkOffset)] {
			return errors.New("routers disagree on a flow")
		}
	}
	fmt.Println("    (the Go HMARK computation matches the kernel's, see hmark's kernel test)")

	step("Scaling down: pod %s goes away", pods[3])
	if err := setEndpoints(ctx, admin, pods[:3]); err != nil {
		return err
	}
	after, err := waitTable(routers[0], 3)
	if err != nil {
		return err
	}
	own, other := 0, 0
	for b := range buckets {
		switch {
		case tables[0][b] == pods[3]:
			own++
		case tables[0][b] != after[b]:
			other++
		}
	}
	fmt.Printf("    %d buckets of the removed pod moved; %d other buckets moved to keep the load balanced; %d stayed\n", own, other, buckets-own-other)
	afterB, err := waitTable(routers[1], 3)
	if err != nil {
		return err
	}
	fmt.Printf("    routers still agree: %v\n", mapsEqual(after, afterB))

	step("Removing the annotation: the routers remove everything they had for %s", tunnelIP)
	svc, err := admin.CoreV1().Services(namespace).Get(ctx, "echo", metav1.GetOptions{})
	if err != nil {
		return err
	}
	delete(svc.Annotations, tunnelclaim.Annotation)
	if _, err := admin.CoreV1().Services(namespace).Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
		return err
	}
	for _, ns := range routers {
		if _, err := waitTable(ns, 0); err != nil {
			return err
		}
	}
	fmt.Println("    no route and no HMARK rule for " + tunnelIP + " is left on either router")

	step("Events on Service demo/echo")
	evs, err := admin.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=echo"})
	if err != nil {
		return err
	}
	for _, e := range evs.Items {
		fmt.Printf("    %-8s %-20s %s (x%d)\n", e.Type, e.Reason, e.Message, e.Count)
	}

	step("Stopping the routers and running tunnel-router --cleanup; deleting the namespaces and the API server")
	return nil
}

func setEndpoints(ctx context.Context, cs kubernetes.Interface, pods []string) error {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: namespace, Name: "echo-demo", Labels: map[string]string{discoveryv1.LabelServiceName: "echo"}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for i, p := range pods {
		node := fmt.Sprintf("worker-%d", 1+i/2)
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{p}, NodeName: &node,
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}})
	}
	existing, err := cs.DiscoveryV1().EndpointSlices(namespace).Get(ctx, es.Name, metav1.GetOptions{})
	if err == nil {
		es.ResourceVersion = existing.ResourceVersion
		_, err = cs.DiscoveryV1().EndpointSlices(namespace).Update(ctx, es, metav1.UpdateOptions{})
		return err
	}
	_, err = cs.DiscoveryV1().EndpointSlices(namespace).Create(ctx, es, metav1.CreateOptions{})
	return err
}

func ptr[T any](v T) *T { return &v }

func makeRouterNetns(ns string, i int) error {
	_ = exec.Command("ip", "netns", "del", ns).Run()
	for _, args := range [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "link", "add", device, "type", "veth", "peer", "name", device + "-peer"},
		{"-n", ns, "addr", "add", fmt.Sprintf("172.31.0.%d/24", 1+i), "dev", device},
		{"-n", ns, "link", "set", device, "up"},
		{"-n", ns, "link", "set", device + "-peer", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

func startRouter(bin, ns, kubeconfig, logPath string) (*exec.Cmd, error) {
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("ip", "netns", "exec", ns, bin,
		"--kubeconfig", kubeconfig, "--node-name", ns, "--gre-device", device, "--gre-device-create=false",
		"--seed", fmt.Sprintf("%#x", seed), "--buckets", strconv.Itoa(buckets))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	return cmd, cmd.Start()
}

var routeRE = regexp.MustCompile(`^` + regexp.QuoteMeta(tunnelIP) + ` .*dst (\S+) .* table (\d+) `)

// waitTable polls the router's routes until the tunnel IP's buckets point to
// exactly `endpoints` distinct pods (0: no route left), and returns them.
func waitTable(ns string, endpoints int) (map[int]string, error) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		table := map[int]string{}
		for _, line := range strings.Split(sh("ip", "-n", ns, "route", "show", "table", "all", "proto", "245"), "\n") {
			if m := routeRE.FindStringSubmatch(line); m != nil {
				t, _ := strconv.Atoi(m[2])
				table[t-router.DefaultTableBase] = m[1]
			}
		}
		distinct := map[string]bool{}
		for _, p := range table {
			distinct[p] = true
		}
		marked := strings.Contains(sh("ip", "netns", "exec", ns, "iptables", "-t", "mangle", "-S"), tunnelIP)
		if endpoints == 0 && len(table) == 0 && !marked || endpoints > 0 && len(table) == buckets && len(distinct) == endpoints && marked {
			return table, nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return nil, fmt.Errorf("%s: tunnel %s not programmed with %d endpoints in time", ns, tunnelIP, endpoints)
}

func printBucketTable(table map[int]string) {
	byPod := map[string][]int{}
	for b, p := range table {
		byPod[p] = append(byPod[p], b)
	}
	podNames := make([]string, 0, len(byPod))
	for p := range byPod {
		podNames = append(podNames, p)
	}
	slices.Sort(podNames)
	for _, p := range podNames {
		bs := byPod[p]
		slices.Sort(bs)
		fmt.Printf("    %-12s %2d buckets: %v\n", p, len(bs), bs)
	}
}

func encapDst(routeGet string) string {
	f := strings.Fields(routeGet)
	for i := range f {
		if f[i] == "dst" && i+1 < len(f) {
			return f[i+1]
		}
	}
	return "?"
}

func mapsEqual(a, b map[int]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func sh(name string, args ...string) string {
	out, _ := exec.Command(name, args...).CombinedOutput()
	return string(out)
}

func printLines(text string, n int, contains string) {
	shown := 0
	for _, l := range strings.Split(strings.TrimSpace(text), "\n") {
		if strings.Contains(l, contains) && shown < n {
			fmt.Println("      " + l)
			shown++
		}
	}
}

func printHead(path string, n int) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for i := 0; i < n && s.Scan(); i++ {
		fmt.Println("      " + s.Text())
	}
}
