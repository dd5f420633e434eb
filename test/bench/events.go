package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netns"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
)

// updateGap is the pause between two updates, after the router process
// has gone idle: each update is measured on an idle router (its worker has
// finished the previous one, HMARK included).
const updateGap = 20 * time.Millisecond

// eventToDatapath updates EndpointSlices in the real API server, one at a
// time, while the real router process runs in ns with n tunnel IPs, and
// measures from just before each update is sent until the kernel of ns
// holds the Service's new bucket table in one generation's routes (seen
// through rtnetlink notifications). Each update replaces one endpoint of a
// different Service by a new pod, so that no generation can hold the new
// table already.
func eventToDatapath(ctx context.Context, cs kubernetes.Interface, ns *namespace, n, pid int) error {
	cfg := config("veth0")
	count := *updates
	step := max(1, n/count)
	service := func(k int) int { return (k * step) % n }
	var vips []netip.Addr
	for k := range count {
		vips = append(vips, tunnelVIP(service(k)))
	}
	th, err := startNSThread(ns)
	if err != nil {
		return err
	}
	defer th.close()
	var w *routeWatch
	err = th.do(func() error {
		client, err := rtnl.Open(netns.None())
		if err != nil {
			return err
		}
		defer client.Close()
		w, err = watchRoutes(cfg, client, vips)
		return err
	})
	if err != nil {
		return err
	}
	defer w.close()

	// A watch of the benchmark's own, next to the router's: when another
	// client of the API server hears of each update.
	slicesAPI := cs.DiscoveryV1().EndpointSlices(benchNamespace)
	list, err := slicesAPI.List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return err
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	watcher, err := slicesAPI.Watch(watchCtx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		return err
	}
	defer watcher.Stop()
	var mu sync.Mutex
	heard := map[string]time.Time{}
	go func() {
		for ev := range watcher.ResultChan() {
			if es, ok := ev.Object.(*discoveryv1.EndpointSlice); ok {
				mu.Lock()
				heard[es.Name+"@"+es.ResourceVersion] = time.Now()
				mu.Unlock()
			}
		}
	}()

	var latencyLog *os.File
	if *latencies != "" {
		if latencyLog, err = os.Create(*latencies); err != nil {
			return err
		}
		defer latencyLog.Close()
	}
	var toKernel, written, toWatch, busy []time.Duration
	timeouts := 0
	for k := range count {
		name := fmt.Sprintf("svc-%d", service(k))
		es, err := slicesAPI.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pod := netip.AddrFrom4([4]byte{10, 250, byte(k >> 8), byte(k)})
		replaced := &es.Endpoints[k%len(es.Endpoints)]
		replaced.Addresses = []string{pod.String()}
		replaced.TargetRef = benchPodRef(fmt.Sprintf("new-%d", k))
		var addrs []netip.Addr
		for _, ep := range es.Endpoints {
			addrs = append(addrs, netip.MustParseAddr(ep.Addresses[0]))
		}
		done := w.expect(tunnelVIP(service(k)), bucket.Assign(cfg.Buckets, addrs))
		start := time.Now()
		up, err := slicesAPI.Update(ctx, es, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
		written = append(written, time.Since(start))
		select {
		case at := <-done:
			toKernel = append(toKernel, at.Sub(start))
			if latencyLog != nil {
				fmt.Fprintf(latencyLog, "%d %s %s %s\n", k, name, ms(written[len(written)-1]), ms(at.Sub(start)))
			}
		case <-time.After(10 * time.Second):
			timeouts++
		}
		busy = append(busy, waitIdle(pid).Sub(start))
		time.Sleep(updateGap)
		mu.Lock()
		if at, ok := heard[name+"@"+up.ResourceVersion]; ok {
			toWatch = append(toWatch, at.Sub(start))
		}
		mu.Unlock()
	}
	if w.err != nil {
		return w.err
	}
	if len(toKernel) == 0 {
		return fmt.Errorf("no update reached the kernel within 10 s")
	}
	fmt.Printf("event to datapath %d tunnel IPs: p50 %s ms, p99 %s ms over %d updates\n", n, ms(pct(toKernel, 50)), ms(pct(toKernel, 99)), len(toKernel))
	fmt.Printf("  (from just before the EndpointSlice update is sent to the last changed bucket route of the new table in the\n")
	fmt.Printf("  router netns' kernel, rtnetlink notifications; one endpoint replaced by a new pod per update, each sent once\n")
	fmt.Printf("  the router process had been idle, no CPU time and no child process, for %v)\n", idleWindow)
	fmt.Printf("  split: update call returned p50 %s p99 %s ms; another client's watch hears it p50 %s p99 %s ms; p90 to the kernel %s ms",
		ms(pct(written, 50)), ms(pct(written, 99)), ms(pct(toWatch, 50)), ms(pct(toWatch, 99)), ms(pct(toKernel, 90)))
	fmt.Printf("; router busy (HMARK included) p50 %s p99 %s ms", ms(pct(busy, 50)), ms(pct(busy, 99)))
	if timeouts > 0 {
		fmt.Printf("; %d updates not in the kernel within 10 s", timeouts)
	}
	fmt.Println()
	return nil
}

// pct is the q-th percentile of ds (nearest rank).
func pct(ds []time.Duration, q int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (q*len(s)+99)/100 - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d.Microseconds())/1000) }

// idleWindow is how long the router process must use no CPU time and have
// no child process (iptables, iptables-restore, ...) to count as idle.
const idleWindow = 60 * time.Millisecond

// waitIdle waits until process pid has been idle for idleWindow and returns
// when it last did something (at most 60 s).
func waitIdle(pid int) time.Time {
	last, _ := idleFor(pid, idleWindow, time.Minute)
	return last
}

// idleFor waits until process pid has used no CPU time and had no child
// process for window, at most max. It returns when the process last did
// something, and whether it was idle for window before max.
func idleFor(pid int, window, max time.Duration) (time.Time, bool) {
	last, lastTicks := time.Now(), uint64(0)
	for deadline := time.Now().Add(max); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		ticks, children := procActivity(pid)
		now := time.Now()
		if ticks != lastTicks || children {
			last, lastTicks = now, ticks
			continue
		}
		if now.Sub(last) >= window {
			return last, true
		}
	}
	return last, false
}

// procActivity returns the CPU ticks process pid used (utime+stime) and
// whether it has a child process.
func procActivity(pid int) (ticks uint64, children bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The fields after the command's closing parenthesis: state is field 3,
	// utime and stime are fields 14 and 15.
	if i := strings.LastIndexByte(string(b), ')'); i >= 0 {
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 12 {
			u, _ := strconv.ParseUint(f[11], 10, 64)
			s, _ := strconv.ParseUint(f[12], 10, 64)
			ticks = u + s
		}
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, t := range tasks {
		if c, _ := os.ReadFile(t); len(strings.TrimSpace(string(c))) > 0 {
			return ticks, true
		}
	}
	return ticks, false
}
