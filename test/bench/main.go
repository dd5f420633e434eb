// Command bench measures the tunnel router on this host's kernel and prints
// each figure next to a baseline measured in the same run. Run it as root
// with `make bench`; docs/benchmarks.md explains every line.
//
// What is measured, in order:
//   - route programming: Datapath.Resync from empty (the bucket policy
//     rules, one route per tunnel IP per bucket table, and the HMARK chain)
//     against `ip -batch` adding the same routes, each into a fresh network
//     namespace, then the removal of one endpoint and the datapath's memory;
//   - forwarding: packets per second through a router netns holding the
//     router's datapath, for several tunnel IP counts, against plain
//     forwarding through the same netns;
//   - programming with many distinct pods: the router against `ip -batch`
//     with inline encapsulation and with nexthop objects;
//   - the real tunnel-router process against a real API server: start-up,
//     the time from an EndpointSlice update to the changed routes in the
//     kernel, and the process's memory.
//
// The host has no GRE, so the routes are the real gre-mode routes (encap ip
// ... dst POD) on a veth instead of the flow-based GRE device; the kernel
// does the same work for them.
package main

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

var (
	sizes        = flag.String("tunnels", "1000,10000", "comma-separated tunnel IP counts of the route programming table (empty skips it)")
	buckets      = flag.Int("buckets", datapath.DefaultBuckets, "buckets per tunnel IP")
	generations  = flag.Int("generations", datapath.DefaultGenerations, "routing generations of the benchmarked router")
	endpointsPer = flag.Int("endpoints", 10, "endpoints per tunnel IP")
	podPool      = flag.Int("pods", 64, "distinct pod IPs the endpoints are drawn from (route programming table, forwarding)")
	fwdSizes     = flag.String("forward-tunnels", "1,1000,10000", "comma-separated tunnel IP counts of the forwarding figure; the first should be 1 (empty skips it)")
	fwdDuration  = flag.Duration("forward-duration", 4*time.Second, "measuring time per forwarding point")
	fwdWarmup    = flag.Duration("forward-warmup", time.Second, "traffic sent before each forwarding point is measured")
	fwdBackends  = flag.String("forward-iptables", "iptables,iptables-legacy", "iptables binaries the forwarding figure's router writes its chains with, comma-separated: the first (the host's default) prints the canonical lines, each other one its own")
	fwdStateless = flag.Bool("forward-stateless", true, "also measure forwarding with --generations=1 (no conntrack) on the first backend, at the first and last count")
	fwdRounds    = flag.Int("forward-rounds", 3, "measurements per forwarding point; the best is reported (the others are printed)")
	manyTunnels  = flag.Int("many-pods-tunnels", 10000, "tunnel IPs of the programming-with-many-pods figure (0 skips it)")
	manyPods     = flag.Int("many-pods", 5000, "distinct pods of the programming-with-many-pods figure")
	processSize  = flag.Int("process-tunnels", 10000, "tunnel IPs for the real router process measurements (0 skips them)")
	updates      = flag.Int("updates", 200, "EndpointSlice updates of the event-to-datapath figure")
	latencies    = flag.String("latencies", "", "file to write each update's latencies to (update, service, call ms, to kernel ms)")
)

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// config is the benchmarked router's: the router's defaults (generations,
// marks, rules, tables, chain), with device standing in for the GRE device.
// It is validated like the router's own (a config without generations once
// made the benchmark crash in the generation planner).
func config(device string) datapath.Config {
	cfg := datapath.DefaultConfig()
	cfg.Buckets, cfg.Generations, cfg.Seed, cfg.GREDevice = *buckets, *generations, 0x5eed, device
	if err := cfg.Validate(); err != nil {
		panic(fmt.Sprintf("benchmark configuration: %v", err))
	}
	return cfg
}

// tunnelVIP is the i-th tunnel IP: they sort in the order of i.
func tunnelVIP(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
}

// podIP is the p-th pod IP.
func podIP(p int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(244 + p>>16), byte(p >> 8), byte(p)})
}

// endpointPods are the pods of tunnel IP i's endpoints: endpointsPer of
// pods, spread so that every pod is used when there are enough tunnel IPs.
func endpointPods(i, pods int) []int {
	out := make([]int, *endpointsPer)
	for e := range out {
		out[e] = (i*7 + e*13) % pods
		if pods > 64 {
			out[e] = (i**endpointsPer + e) % pods
		}
	}
	return out
}

// tunnelsFor builds n tunnel IPs, each with endpointsPer endpoints drawn
// from pods pod IPs.
func tunnelsFor(cfg datapath.Config, n, pods int) []datapath.Tunnel {
	out := make([]datapath.Tunnel, n)
	for i := range out {
		var eps []netip.Addr
		for _, p := range endpointPods(i, pods) {
			eps = append(eps, podIP(p))
		}
		out[i] = tunnelFor(cfg, tunnelVIP(i), eps)
	}
	return out
}

func tunnelFor(cfg datapath.Config, vip netip.Addr, eps []netip.Addr) datapath.Tunnel {
	t := datapath.Tunnel{VIP: vip}
	for _, a := range bucket.Assign(cfg.Buckets, eps) {
		t.Table = append(t.Table, datapath.Endpoint{Addr: a})
		t.Present = append(t.Present, datapath.Endpoint{Addr: a})
	}
	return t
}

func parseCounts(flagName, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		var n int
		if _, err := fmt.Sscan(f, &n); err != nil || n < 1 {
			return nil, fmt.Errorf("-%s %q: want positive counts", flagName, s)
		}
		out = append(out, n)
	}
	return out, nil
}

func run() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root")
	}
	progCounts, err := parseCounts("tunnels", *sizes)
	if err != nil {
		return err
	}
	fwdCounts, err := parseCounts("forward-tunnels", *fwdSizes)
	if err != nil {
		return err
	}
	cfg := config("veth0")
	fmt.Printf("kube-service-tunnel router benchmark (%d CPUs, kernel %s, load average %s at start)\n", runtime.NumCPU(), hostKernel(), loadAverage())
	fmt.Printf("router configuration: %d buckets, %d generations (the router's defaults but the seed); gre-mode routes\n", cfg.Buckets, cfg.Generations)
	fmt.Printf("(encap ip ... dst POD) on a veth standing in for the GRE device, which this host lacks.\n")
	if len(progCounts) > 0 {
		if err := programming(progCounts); err != nil {
			return err
		}
	}
	if len(fwdCounts) > 0 {
		for i, backend := range strings.Split(*fwdBackends, ",") {
			if i > 0 {
				if _, err := exec.LookPath(backend); err != nil {
					fmt.Printf("\nforwarding with %s: skipped (%v)\n", backend, err)
					continue
				}
			}
			if err := forwarding(fwdCounts, backend, i == 0); err != nil {
				return err
			}
		}
		if *fwdStateless && *generations > 1 {
			// The stateless mode (no conntrack, no draining) on the host's
			// backend, at 1 tunnel IP and the largest count: what the
			// sticky generations' conntrack costs.
			stateless := config(sinkDev)
			stateless.Generations = 1
			counts := []int{fwdCounts[0], fwdCounts[len(fwdCounts)-1]}
			if err := forwardingWith(stateless, slices.Compact(counts), strings.Split(*fwdBackends, ",")[0], true); err != nil {
				return err
			}
		}
	}
	// The router process runs before the many-pods figure: deleting that
	// figure's namespaces (640,000 inline routes) holds the kernel's route
	// lock for minutes, and etcd, started right after, hung in it.
	if *processSize > 0 {
		if err := waitQuiet(); err != nil {
			fmt.Printf("\n(%v; starting the router process anyway)\n", err)
		}
		if err := routerProcess(*processSize); err != nil {
			return err
		}
	}
	if *manyTunnels > 0 {
		return programmingManyPods(*manyTunnels, *manyPods)
	}
	return nil
}

func lockThread() { runtime.LockOSThread() }

func numCPU() int { return runtime.NumCPU() }

// loadAverage is the 1-minute load average: on a shared machine, other
// work (and the kernel's global route lock, RTNL, which every netns
// shares) changes the timings.
func loadAverage() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}
