package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router/startup"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// routerProcess runs the real tunnel-router binary in a network namespace
// against a real API server holding n annotated Services with their
// EndpointSlices, and reports its start-up programming time and its RSS.
func routerProcess(n int) error {
	bin, err := filepath.Abs("bin/tunnel-router")
	if err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("%s missing (make build): %w", bin, err)
	}
	env, err := kubeenv.New()
	if errors.Is(err, kubeenv.ErrNoAssets) {
		fmt.Printf("\nrouter process: skipped (%v)\n", err)
		return nil
	}
	if err != nil {
		return err
	}
	defer env.Stop()
	ctx := context.Background()
	manifest, err := os.ReadFile("tunnel-router.yaml")
	if err != nil {
		return err
	}
	if err := env.ApplyYAML(ctx, env.AdminConfig(), manifest, false); err != nil {
		return err
	}
	admin, err := kubernetes.NewForConfig(env.AdminConfig())
	if err != nil {
		return err
	}
	start := time.Now()
	if err := createServices(ctx, admin, n); err != nil {
		return err
	}
	fmt.Printf("\nrouter process: created %d annotated Services and their EndpointSlices in %v\n", n, time.Since(start).Round(time.Second))

	saCfg, err := env.ServiceAccountConfig(ctx, "kube-service-tunnel", "tunnel-router")
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(env.Dir(), "router.kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig, saCfg); err != nil {
		return err
	}
	ns, err := newNamespace("kst-bench-process")
	if err != nil {
		return err
	}
	defer ns.close()
	stopRelay, err := testnetns.ForwardLoopback(ns.handle, strings.TrimPrefix(env.Host(), "https://"))
	if err != nil {
		return err
	}
	defer stopRelay()
	logPath := filepath.Join(env.Dir(), "router.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := exec.Command("ip", "netns", "exec", ns.name, bin, "--kubeconfig", kubeconfig,
		"--gre-device", "veth0", "--gre-device-create=false", "--ipv6=false", "--seed", "0x5eed", "--buckets", fmt.Sprint(*buckets),
		"--generations", fmt.Sprint(*generations),
		"--pools", "198.18.0.0/16") // the tunnel IPs createServices annotates
	cmd.Stdout, cmd.Stderr = logFile, logFile
	start = time.Now()
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		_ = exec.Command("ip", "netns", "exec", ns.name, bin, "--cleanup", "--gre-device", "veth0", "--gre-device-create=false", "--ipv6=false").Run()
	}()
	want := fmt.Sprintf("tunnels=%d", n)
	for {
		b, _ := os.ReadFile(logPath)
		if strings.Contains(string(b), "resynced datapath") && strings.Contains(string(b), want) {
			break
		}
		if time.Since(start) > 10*time.Minute {
			return fmt.Errorf("router did not program %d tunnels in time; log:\n%s", n, b)
		}
		time.Sleep(200 * time.Millisecond)
	}
	took := time.Since(start)
	fmt.Printf("  tunnel-router start to all %d tunnel IPs x %d buckets programmed (informer sync, assignment, kernel): %v\n", n, *buckets, took.Round(time.Millisecond))
	// The figure is the router at rest: after start-up it still records
	// an event per Service (client-side rate limited) and its RSS moves
	// with each collection until that is done.
	waitStart := time.Now()
	if _, ok := idleFor(cmd.Process.Pid, 2*time.Second, 3*time.Minute); !ok {
		return errors.New("router still busy 3 minutes after its start-up programming")
	}
	fmt.Printf("  the router was idle (no CPU time, no child process for 2 s) %v after its start-up programming\n", time.Since(waitStart).Round(100*time.Millisecond))
	rss := procStatusKB(cmd.Process.Pid, "VmRSS")
	fmt.Printf("memory %d tunnel IPs: router process RSS %.0f MB\n", n, float64(rss)/1000)
	fmt.Printf("  (%d generations, %d endpoints each, informer caches of %d Services and EndpointSlices included; peak RSS during start-up %.0f MB)\n",
		*generations, *endpointsPer, n, float64(procStatusKB(cmd.Process.Pid, "VmHWM"))/1000)
	fmt.Printf("  (of which anonymous memory %.0f MB, the Go heap and runtime; file-backed %.0f MB, the touched pages of the binary)\n",
		float64(procStatusKB(cmd.Process.Pid, "RssAnon"))/1000, float64(procStatusKB(cmd.Process.Pid, "RssFile"))/1000)
	// A real router is scraped: what a scrape of every series costs.
	for i := range 3 {
		text, took, err := scrapeMetrics(ns)
		if err != nil {
			return fmt.Errorf("scraping the router's /metrics: %w", err)
		}
		fmt.Printf("  /metrics scrape %d (gzip, as Prometheus asks): %.1f MB of text in %v; router process RSS after it %.0f MB\n",
			i+1, float64(len(text))/1e6, took.Round(time.Millisecond), float64(procStatusKB(cmd.Process.Pid, "VmRSS"))/1000)
		if i == 0 {
			fmt.Printf("    (its Go heap at that scrape: %.0f MB in use, next collection at %.0f MB)\n",
				metricValue(text, "go_memstats_heap_inuse_bytes")/1e6, metricValue(text, "go_memstats_next_gc_bytes")/1e6)
		}
	}
	if *updates > 0 {
		// ip netns exec execs the router: cmd's PID is the router's.
		// The updates' writer has no client-side rate limit: client-go's
		// token bucket (QPS) would hold each Update back for up to 1/QPS
		// (20 ms at QPS 50) before sending it, and that wait would be
		// counted as the router's.
		wcfg := env.AdminConfig()
		wcfg.QPS = -1
		writer, err := kubernetes.NewForConfig(wcfg)
		if err != nil {
			return err
		}
		if err := eventToDatapath(ctx, writer, ns, n, cmd.Process.Pid); err != nil {
			return fmt.Errorf("event to datapath: %w", err)
		}
		fmt.Printf("  router process RSS after the updates %.0f MB\n", float64(procStatusKB(cmd.Process.Pid, "VmRSS"))/1000)
	}
	if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
		b, _ := os.ReadFile(logPath)
		return fmt.Errorf("router exited: %v; log:\n%s", err, b)
	}
	return nil
}

func createServices(ctx context.Context, cs kubernetes.Interface, n int) error {
	const ns = benchNamespace
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	work := make(chan int)
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				if err := createOne(ctx, cs, ns, i); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		}()
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

func createOne(ctx context.Context, cs kubernetes.Interface, ns string, i int) error {
	name := fmt.Sprintf("svc-%d", i)
	vip := tunnelVIP(i)
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{tunnelclaim.Annotation: vip.String()}},
		Spec:       corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Ports: []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}
	if _, err := cs.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("service %s: %w", name, err)
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for e := range *endpointsPer {
		p := endpointPods(i, *podPool)[e]
		node := fmt.Sprintf("node-%d", p%8)
		// As the EndpointSlice controller writes them: the Pod named, all
		// three conditions.
		ready, terminating := true, false
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
			Addresses: []string{podIP(p).String()}, NodeName: &node, TargetRef: benchPodRef(fmt.Sprintf("pod-%d", p)),
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready, Terminating: &terminating}})
	}
	if _, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, es, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("endpointslice %s: %w", name, err)
	}
	return nil
}

// scrapeMetrics GETs the router's /metrics (on its default address, in its
// network namespace) as Prometheus does, gzip accepted, and returns the
// uncompressed text and how long the scrape took.
func scrapeMetrics(ns *namespace) ([]byte, time.Duration, error) {
	th, err := startNSThread(ns)
	if err != nil {
		return nil, 0, err
	}
	defer th.close()
	transport := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (conn net.Conn, err error) {
		// The socket is made on the namespace's thread, so it lives there.
		err = th.do(func() (err error) { conn, err = (&net.Dialer{}).DialContext(ctx, network, addr); return err })
		return conn, err
	}}
	defer transport.CloseIdleConnections()
	start := time.Now()
	resp, err := (&http.Client{Transport: transport, Timeout: time.Minute}).Get("http://127.0.0.1" + startup.DefaultMetricsAddress + "/metrics")
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, 0, fmt.Errorf("/metrics: %s", resp.Status)
	}
	text, err := io.ReadAll(resp.Body) // the transport gunzips it
	return text, time.Since(start), err
}

// metricValue is the value of the series name without labels in a text
// exposition (0 if absent).
func metricValue(text []byte, name string) float64 {
	for line := range strings.SplitSeq(string(text), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// benchPodRef is an endpoint's targetRef to the Pod name in the benchmark's
// namespace, with a UID as long as a real one.
func benchPodRef(name string) *corev1.ObjectReference {
	sum := sha256.Sum256([]byte(name))
	return &corev1.ObjectReference{Kind: "Pod", Namespace: benchNamespace, Name: name, UID: types.UID(fmt.Sprintf("%x-%x-%x-%x-%x", sum[0:4], sum[4:6], sum[6:8], sum[8:10], sum[10:16]))}
}

// procStatusKB reads a kB field of /proc/PID/status (0 if unknown).
func procStatusKB(pid int, field string) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == field+":" {
			v, _ := strconv.Atoi(f[1])
			return v
		}
	}
	return 0
}

func procRSS(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			return strings.Join(strings.Fields(l)[1:], " ")
		}
	}
	return "?"
}

// benchNamespace holds the benchmark's Services and EndpointSlices.
const benchNamespace = "bench"
