// Command bench measures the tunnel router's datapath on this host's kernel
// and prints the figures next to an iproute2 baseline run in the same
// process and environment. Run it as root with `make bench`.
//
// What is measured: Datapath.Resync from empty (the bucket policy rules, one
// route per tunnel IP per bucket table, and the HMARK chain through
// iptables-restore) against `ip -batch` adding the same routes, each into a
// fresh network namespace. The host has no GRE, so the routes are the real
// gre-mode routes (encap ip ... dst POD) on a veth instead of the flow-based
// GRE device; the kernel does the same work for them.
package main

import (
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strings"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/bucket"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

var (
	sizes        = flag.String("tunnels", "1000,10000", "comma-separated tunnel IP counts")
	buckets      = flag.Int("buckets", 64, "buckets per tunnel IP")
	endpointsPer = flag.Int("endpoints", 10, "endpoints per tunnel IP")
	podPool      = flag.Int("pods", 64, "distinct pod IPs the endpoints are drawn from")
	processSize  = flag.Int("process-tunnels", 10000, "tunnel IPs for the real router process measurement (0 skips it)")
)

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// config is the benchmarked router's: one routing generation, so that the
// figures compare one table per bucket with ip -batch. It is validated like
// the router's own (a config without generations once made the benchmark
// crash in the generation planner).
func config() datapath.Config {
	cfg := datapath.Config{
		Mode: encap.GRE, Buckets: *buckets, Generations: 1, MarkOffset: datapath.DefaultMarkOffset, Seed: 0x5eed,
		RulePriority: datapath.DefaultRulePriority, TableBase: datapath.DefaultTableBase,
		RouteProtocol: encap.DefaultRouteProtocol, GREDevice: "veth0", Chain: "KST-HMARK",
	}
	if err := cfg.Validate(); err != nil {
		panic(fmt.Sprintf("benchmark configuration: %v", err))
	}
	return cfg
}

// tunnels builds n tunnel IPs, each with endpointsPer endpoints drawn from a
// pool of podPool pod IPs.
func tunnels(n int) []datapath.Tunnel {
	cfg := config()
	out := make([]datapath.Tunnel, n)
	for i := range out {
		vip := netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		eps := make([]netip.Addr, *endpointsPer)
		for e := range eps {
			p := (i*7 + e*13) % *podPool
			eps[e] = netip.AddrFrom4([4]byte{10, 244, byte(p >> 8), byte(p)})
		}
		out[i] = tunnelFor(cfg, vip, eps)
	}
	return out
}

func tunnelFor(cfg datapath.Config, vip netip.Addr, eps []netip.Addr) datapath.Tunnel {
	t := datapath.Tunnel{VIP: vip}
	for _, a := range bucket.Assign(cfg.Buckets, eps) {
		t.Table = append(t.Table, datapath.Endpoint{Addr: a})
	}
	return t
}

type namespace struct {
	name   string
	handle netns.NsHandle
}

func newNamespace(name string) (*namespace, error) {
	_ = exec.Command("ip", "netns", "del", name).Run()
	for _, args := range [][]string{
		{"netns", "add", name},
		{"-n", name, "link", "set", "lo", "up"},
		{"-n", name, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"},
		{"-n", name, "addr", "add", "192.168.50.1/24", "dev", "veth0"},
		{"-n", name, "link", "set", "veth0", "up"},
		{"-n", name, "link", "set", "veth1", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	h, err := netns.GetFromName(name)
	if err != nil {
		return nil, err
	}
	return &namespace{name: name, handle: h}, nil
}

func (n *namespace) close() {
	n.handle.Close()
	_ = exec.Command("ip", "netns", "del", n.name).Run()
}

// ipBatch adds the same routes as the router with `ip -batch`.
func ipBatch(ts []datapath.Tunnel) (time.Duration, int, error) {
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
	cfg := config()
	n := 0
	w := io.Writer(f)
	for _, t := range ts {
		for b, ep := range t.Table {
			fmt.Fprintf(w, "route add %s/32 encap ip id 0 dst %s ttl 64 dev veth0 table %d proto %d\n", t.VIP, ep.Addr, cfg.Table(b), cfg.RouteProtocol)
			n++
		}
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

// newDatapath opens the router's datapath inside ns.
func newDatapath(ns *namespace) (*datapath.Datapath, func(), error) {
	cfg := config()
	rc, err := rtnl.Open(ns.handle)
	if err != nil {
		return nil, nil, err
	}
	nl, err := netlink.NewHandleAt(ns.handle, unix.NETLINK_ROUTE)
	if err != nil {
		rc.Close()
		return nil, nil, err
	}
	ipt, err := testnetns.NewIPTables(ns.handle, "iptables")
	if err != nil {
		return nil, nil, err
	}
	sets, err := netlink.NewHandleAt(ns.handle, unix.NETLINK_NETFILTER)
	if err != nil {
		rc.Close()
		nl.Close()
		return nil, nil, err
	}
	chain, err := hmark.NewChain(ipt, sets, cfg.Chain, cfg.HMARKParams(), ipt)
	if err != nil {
		return nil, nil, err
	}
	log := logrus.New()
	log.Out = io.Discard
	dp := datapath.NewDatapath(cfg, rc, nl, chain, &datapath.ExistingDevice{Name: "veth0", Links: nl}, nil, log)
	return dp, func() { rc.Close(); nl.Close(); sets.Close() }, nil
}

func run() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root")
	}
	fmt.Printf("kube-service-tunnel datapath benchmark (%d CPUs, kernel %s)\n", runtime.NumCPU(), strings.TrimSpace(sh("uname", "-r")))
	fmt.Printf("gre-mode routes (encap ip ... dst POD) on a veth standing in for the GRE device; %d buckets,\n", *buckets)
	fmt.Printf("%d endpoints per tunnel IP drawn from %d pods; each run into a fresh network namespace.\n\n", *endpointsPer, *podPool)
	fmt.Printf("%-10s %-9s %-14s %-30s %s\n", "tunnels", "routes", "ip -batch", "router (rules+routes+HMARK)", "ratio")
	for _, s := range strings.Split(*sizes, ",") {
		var n int
		if _, err := fmt.Sscan(s, &n); err != nil {
			return fmt.Errorf("--tunnels %q: %w", s, err)
		}
		ts := tunnels(n)
		base, routes, err := ipBatch(ts)
		if err != nil {
			return err
		}
		ns, err := newNamespace("kst-bench-router")
		if err != nil {
			return err
		}
		dp, closeDP, err := newDatapath(ns)
		if err != nil {
			return err
		}
		start := time.Now()
		if err := dp.Resync(ts); err != nil {
			return err
		}
		took := time.Since(start)
		fmt.Printf("\n%-10d %-9d %-14v %-30v %.2fx\n", n, routes, base.Round(time.Millisecond), took.Round(time.Millisecond), took.Seconds()/base.Seconds())
		if err := removal(dp, ts); err != nil {
			return err
		}
		ts = nil // drop the benchmark's input: what remains is the datapath's state
		memory(n)
		runtime.KeepAlive(dp) // the state measured must still be referenced
		closeDP()
		ns.close()
	}
	if *processSize > 0 {
		return routerProcess(*processSize)
	}
	return nil
}

// removal removes one endpoint of 10 from one tunnel IP and reports the
// kernel operations and the time.
func removal(dp *datapath.Datapath, ts []datapath.Tunnel) error {
	cfg := config()
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
	fmt.Printf("    (%d buckets of the removed endpoint + %d balance moves; one route replace each, no rule or HMARK change)\n", own, moved)
	return nil
}

// memory prints the process's memory with n tunnel IPs programmed, after the
// benchmark's input has been dropped.
func memory(n int) {
	cfg := config()
	runtime.GC()
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Printf("  memory with %d tunnel IPs x %d buckets programmed: RSS %s, Go heap in use %.1f MiB\n",
		n, cfg.Buckets, procRSS(os.Getpid()), float64(ms.HeapInuse)/(1<<20))
	fmt.Println("    (the datapath's state; a running router also holds informer caches of Services and EndpointSlices)")
}

func sh(name string, args ...string) string {
	out, _ := exec.Command(name, args...).CombinedOutput()
	return string(out)
}
