package main

import (
	"bufio"
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// batchStyle is how `ip -batch` writes the routes.
type batchStyle int

const (
	inline   batchStyle = iota // route add ... encap ip dst POD dev D
	nexthops                   // nexthop add id N encap ip dst POD dev D, then route add ... nhid N
)

// ipBatch adds the routes of ts with `ip -batch` into a fresh namespace and
// returns the time and the number of routes.
func ipBatch(cfg datapath.Config, ts []datapath.Tunnel, style batchStyle) (time.Duration, int, error) {
	ns, err := newNamespace("kst-bench-ip")
	if err != nil {
		return 0, 0, err
	}
	defer ns.close()
	f, err := os.CreateTemp("", "kst-bench-*.batch")
	if err != nil {
		return 0, 0, err
	}
	defer os.Remove(f.Name())
	w := bufio.NewWriter(f)
	n := 0
	ids := map[netip.Addr]int{}
	if style == nexthops {
		for _, t := range ts {
			for _, ep := range t.Table {
				if _, ok := ids[ep.Addr]; !ok {
					ids[ep.Addr] = len(ids) + 1
					fmt.Fprintf(w, "nexthop add id %d encap ip id 0 dst %s ttl 64 dev %s proto %d\n", ids[ep.Addr], ep.Addr, cfg.GREDevice, cfg.RouteProtocol)
				}
			}
		}
	}
	for _, t := range ts {
		for b, ep := range t.Table {
			if style == nexthops {
				fmt.Fprintf(w, "route add %s/32 nhid %d table %d proto %d\n", t.VIP, ids[ep.Addr], cfg.Table(b), cfg.RouteProtocol)
			} else {
				fmt.Fprintf(w, "route add %s/32 encap ip id 0 dst %s ttl 64 dev %s table %d proto %d\n", t.VIP, ep.Addr, cfg.GREDevice, cfg.Table(b), cfg.RouteProtocol)
			}
			n++
		}
	}
	if err := w.Flush(); err != nil {
		return 0, 0, err
	}
	if err := f.Close(); err != nil {
		return 0, 0, err
	}
	start := time.Now()
	if out, err := exec.Command("ip", "-n", ns.name, "-batch", f.Name()).CombinedOutput(); err != nil {
		return 0, 0, fmt.Errorf("ip -batch: %v: %s", err, out)
	}
	return time.Since(start), n, nil
}

// routerResync programs ts from empty with the router's datapath in a fresh
// namespace; then, while the state is still there, it calls after on the
// namespace's thread.
func routerResync(cfg datapath.Config, ts []datapath.Tunnel, after func(*routerDatapath, time.Duration) error) (time.Duration, error) {
	ns, err := newNamespace("kst-bench-router")
	if err != nil {
		return 0, err
	}
	defer ns.close()
	th, err := startNSThread(ns)
	if err != nil {
		return 0, err
	}
	defer th.close()
	var took time.Duration
	err = th.do(func() error {
		dp, err := openRouterDatapath(cfg)
		if err != nil {
			return err
		}
		defer dp.close()
		start := time.Now()
		if err := dp.Resync(ts); err != nil {
			return err
		}
		took = time.Since(start)
		ts = nil // what after measures is the datapath's state
		if after != nil {
			return after(dp, took)
		}
		return nil
	})
	return took, err
}

// programming prints the route programming table: the router from empty
// against ip -batch, for each count of tunnel IPs, with the removal of one
// endpoint and the datapath's memory.
func programming(counts []int) error {
	cfg := config("veth0")
	fmt.Printf("\nroute programming from empty, %d endpoints per tunnel IP drawn from %d pods; each run into a fresh netns.\n", *endpointsPer, *podPool)
	fmt.Printf("%-10s %-9s %-14s %-30s %s\n", "tunnels", "routes", "ip -batch", "router (rules+routes+HMARK)", "ratio")
	for _, n := range counts {
		ts := tunnelsFor(cfg, n, *podPool)
		base, routes, err := ipBatch(cfg, ts, inline)
		if err != nil {
			return err
		}
		_, err = routerResync(cfg, ts, func(dp *routerDatapath, took time.Duration) error {
			fmt.Printf("\n%-10d %-9d %-14v %-30v %.2fx\n", n, routes, base.Round(time.Millisecond), took.Round(time.Millisecond), took.Seconds()/base.Seconds())
			if err := removal(dp, ts); err != nil {
				return err
			}
			ts = nil // drop the benchmark's input: what remains is the datapath's state
			memory(n)
			runtime.KeepAlive(dp) // the state measured must still be referenced
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// removal removes one endpoint of 10 from one tunnel IP and reports the
// kernel operations and the time.
func removal(dp *routerDatapath, ts []datapath.Tunnel) error {
	cfg := config("veth0")
	t := ts[0]
	seen := map[netip.Addr]bool{}
	var eps []netip.Addr
	for _, e := range t.Table {
		if !seen[e.Addr] {
			seen[e.Addr] = true
			eps = append(eps, e.Addr)
		}
	}
	removed := eps[0]
	after := tunnelFor(cfg, t.VIP, eps[1:])
	own, moved := 0, 0
	for b := range t.Table {
		if t.Table[b].Addr == removed {
			own++
		} else if t.Table[b] != after.Table[b] {
			moved++
		}
	}
	before := dp.Ops()
	start := time.Now()
	if err := dp.SetTunnel(after); err != nil {
		return err
	}
	took := time.Since(start)
	fmt.Printf("  removing 1 endpoint of %d from one tunnel IP (%d others programmed): %d kernel operations in %v\n",
		len(eps), len(ts)-1, dp.Ops()-before, took.Round(time.Microsecond))
	if moved == 0 {
		fmt.Printf("    (%d buckets of the removed endpoint, re-pointed in every generation in use; no rule or HMARK change)\n", own)
	} else {
		fmt.Printf("    (%d buckets of the removed endpoint + %d balance moves of live endpoints: a new generation, its HMARK offset)\n", own, moved)
	}
	return nil
}

// memory prints the process's memory with n tunnel IPs programmed, after the
// benchmark's input has been dropped.
func memory(n int) {
	cfg := config("veth0")
	runtime.GC()
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("  memory with %d tunnel IPs x %d buckets programmed: RSS %s, Go heap in use %.1f MiB\n",
		n, cfg.Buckets, procRSS(os.Getpid()), float64(ms.HeapInuse)/(1<<20))
	fmt.Println("    (the datapath's state; a running router also holds informer caches of Services and EndpointSlices)")
}

// programmingManyPods programs n tunnel IPs whose endpoints are drawn from
// pods distinct pods, from empty: the router, and ip -batch with nexthop
// objects and with inline encapsulation. With inline encapsulation the
// kernel compares each new route with every distinct next hop already on the
// device, so that cost grows with the number of pods.
func programmingManyPods(n, pods int) error {
	cfg := config("veth0")
	ts := tunnelsFor(cfg, n, pods)
	fmt.Printf("\nprogramming with many distinct pods: %d tunnel IPs x %d buckets, %d endpoints each drawn from %d pods, from empty\n", n, cfg.Buckets, *endpointsPer, pods)
	withNH, routes, err := ipBatch(cfg, ts, nexthops)
	if err != nil {
		return err
	}
	withInline, _, err := ipBatch(cfg, ts, inline)
	if err != nil {
		return err
	}
	var nhs, kinds string
	router, err := routerResync(cfg, ts, func(*routerDatapath, time.Duration) error {
		nhs, kinds = routerRouteKinds(cfg)
		return nil
	})
	if err != nil {
		return err
	}
	fmt.Printf("  %d routes; the router's routes: %s; its nexthop objects: %s\n", routes, kinds, nhs)
	fmt.Printf("programming %d tunnel IPs over %d pods: router %.1f s, ip -batch (nexthops) %.1f s, ip -batch (inline) %.1f s, %.2fx\n",
		n, pods, router.Seconds(), withNH.Seconds(), withInline.Seconds(), router.Seconds()/withNH.Seconds())
	return nil
}

// routerRouteKinds says how the router programmed its routes, from the
// calling thread's namespace: how many nexthop objects there are, and
// whether table 0's routes use them.
func routerRouteKinds(cfg datapath.Config) (nexthopObjects, routes string) {
	out, _ := exec.Command("ip", "nexthop", "list").Output()
	nexthopObjects = fmt.Sprint(bytes.Count(out, []byte("\n")))
	out, _ = exec.Command("ip", "route", "show", "table", fmt.Sprint(cfg.Table(0))).Output()
	switch line, _, _ := bytes.Cut(out, []byte("\n")); {
	case bytes.Contains(line, []byte(" nhid ")):
		routes = "nexthop objects (nhid)"
	case bytes.Contains(line, []byte(" encap ")):
		routes = "inline encap"
	default:
		routes = fmt.Sprintf("%q", line)
	}
	return nexthopObjects, routes
}
