package main

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cmdnu/kube-service-tunnel/router/datapath"

	"github.com/vishvananda/netlink"
	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"
)

// The forwarding topology: client netns -veth- router netns -veth- sink
// netns, all the benchmark's own. The client sends 64-byte UDP packets to
// a tunnel IP; the router netns forwards them through the router's real
// datapath (HMARK chain, fwmark rules, bucket tables, as the router's code
// programs them); the sink drops them in its raw table and its veth's
// rx_packets counts them.
const (
	clientNS   = "kst-bench-client"
	fwdNS      = "kst-bench-fwd"
	sinkNS     = "kst-bench-sink"
	clientAddr = "192.168.60.2"
	routerAddr = "192.168.60.1"
	// sinkDev is the router's veth towards the sink. This host has no GRE:
	// it stands in for the flow-based GRE device, so the bucket routes are
	// the router's real gre-mode routes (encap ip ... dst POD dev sinkDev),
	// and a veth ignores the encapsulation metadata and sends the packet
	// as it is, to the sink.
	sinkDev     = "s0"
	sinkPeer    = "s1"
	senderPorts = 64 // source ports (one UDP socket each): 64 flows
	batchSize   = 64 // packets per sendmmsg
	payloadSize = 64 - 14 - 20 - 8
)

type fwdTopology struct {
	client, router, sink *namespace
	sinkLinks            *netlink.Handle
}

// newFwdTopology builds the three namespaces, their names ending in suffix
// (so that a plain topology can stand beside the router's).
func newFwdTopology(suffix string) (*fwdTopology, error) {
	t := &fwdTopology{}
	clientNS, fwdNS, sinkNS := clientNS+suffix, fwdNS+suffix, sinkNS+suffix
	var err error
	for _, n := range []struct {
		name string
		ns   **namespace
	}{{clientNS, &t.client}, {fwdNS, &t.router}, {sinkNS, &t.sink}} {
		if *n.ns, err = newEmptyNamespace(n.name); err != nil {
			t.close()
			return nil, err
		}
	}
	for _, args := range [][]string{
		{"-n", clientNS, "link", "add", "c0", "type", "veth", "peer", "name", "c1", "netns", fwdNS},
		{"-n", fwdNS, "link", "add", sinkDev, "type", "veth", "peer", "name", sinkPeer, "netns", sinkNS},
		{"-n", clientNS, "addr", "add", clientAddr + "/24", "dev", "c0"},
		{"-n", clientNS, "link", "set", "c0", "up"},
		{"-n", clientNS, "route", "add", "default", "via", routerAddr},
		{"-n", fwdNS, "addr", "add", routerAddr + "/24", "dev", "c1"},
		{"-n", fwdNS, "addr", "add", "192.168.61.1/24", "dev", sinkDev},
		{"-n", fwdNS, "link", "set", "c1", "up"},
		{"-n", fwdNS, "link", "set", sinkDev, "up"},
		{"-n", sinkNS, "addr", "add", "192.168.61.2/24", "dev", sinkPeer},
		{"-n", sinkNS, "link", "set", sinkPeer, "up"},
	} {
		if err := ipCmd(args...); err != nil {
			t.close()
			return nil, err
		}
	}
	// A router's sysctls (see router/startup's warnings and docs/operating.md).
	if err := t.router.sysctls("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
		"net.ipv4.conf.default.rp_filter=0", "net.ipv4.conf.c1.rp_filter=0", "net.ipv4.conf."+sinkDev+".rp_filter=0"); err != nil {
		t.close()
		return nil, err
	}
	if _, err := t.sink.run("iptables", "-t", "raw", "-A", "PREROUTING", "-j", "DROP"); err != nil {
		t.close()
		return nil, err
	}
	if t.sinkLinks, err = netlink.NewHandleAt(t.sink.handle, unix.NETLINK_ROUTE); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

func (t *fwdTopology) close() {
	if t.sinkLinks != nil {
		t.sinkLinks.Close()
	}
	for _, n := range []*namespace{t.client, t.router, t.sink} {
		if n != nil {
			n.close()
		}
	}
}

// target makes vip reachable from the router's main table (plain
// forwarding) and resolves it to the sink's MAC: the bucket routes have no
// gateway, so the router asks for vip itself on sinkDev.
func (t *fwdTopology) target(vip netip.Addr) error {
	link, err := t.sinkLinks.LinkByName(sinkPeer)
	if err != nil {
		return err
	}
	mac := link.Attrs().HardwareAddr.String()
	if err := ipCmd("-n", t.router.name, "neigh", "replace", vip.String(), "lladdr", mac, "dev", sinkDev, "nud", "permanent"); err != nil {
		return err
	}
	return ipCmd("-n", t.router.name, "route", "replace", vip.String()+"/32", "dev", sinkDev)
}

func (t *fwdTopology) sinkPackets() (uint64, error) {
	link, err := t.sinkLinks.LinkByName(sinkPeer)
	if err != nil {
		return 0, err
	}
	return link.Attrs().Statistics.RxPackets, nil
}

// generator sends 64-byte UDP packets from the client netns to one tunnel
// IP, senderPorts source ports round robin, batchSize packets per sendmmsg,
// from one thread pinned to one CPU.
type generator struct {
	conns []*ipv4.PacketConn
	raw   []*net.UDPConn
}

func newGenerator(client *namespace, vip netip.Addr) (*generator, error) {
	g := &generator{}
	th, err := startNSThread(client)
	if err != nil {
		return nil, err
	}
	defer th.close()
	err = th.do(func() error {
		for range senderPorts {
			c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP(clientAddr)}, net.UDPAddrFromAddrPort(netip.AddrPortFrom(vip, 9)))
			if err != nil {
				return err
			}
			g.raw = append(g.raw, c)
			g.conns = append(g.conns, ipv4.NewPacketConn(c))
		}
		return nil
	})
	if err != nil {
		g.close()
		return nil, err
	}
	return g, nil
}

func (g *generator) close() {
	for _, c := range g.raw {
		c.Close()
	}
}

// run sends until stop is set; it returns the packets sent.
func (g *generator) run(stop *atomic.Bool) (sent uint64, err error) {
	msgs := make([]ipv4.Message, batchSize)
	payload := make([]byte, payloadSize)
	for i := range msgs {
		msgs[i].Buffers = [][]byte{payload}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		pinToOneCPU()
		for i := 0; !stop.Load(); i++ {
			n, werr := g.conns[i%len(g.conns)].WriteBatch(msgs, 0)
			sent += uint64(max(n, 0))
			if werr != nil && !isTransient(werr) {
				err = werr
				return
			}
		}
	}()
	<-done
	return sent, err
}

// pinToOneCPU locks the calling goroutine to its thread and that thread to
// the last CPU: with veth, the whole path (client, router, sink) runs in
// the softirq of the sending CPU, so the figure is one core's.
func pinToOneCPU() {
	lockThread()
	var set unix.CPUSet
	set.Set(numCPU() - 1)
	_ = unix.SchedSetaffinity(0, &set)
}

func isTransient(err error) bool {
	return strings.Contains(err.Error(), "no buffer space") || strings.Contains(err.Error(), "resource temporarily unavailable") ||
		strings.Contains(err.Error(), "connection refused")
}

// measure runs the generator for warm-up plus d and returns the packets
// per second the sink received during d.
func (t *fwdTopology) measure(g *generator, warmup, d time.Duration) (float64, error) {
	var stop atomic.Bool
	var wg sync.WaitGroup
	var genErr error
	wg.Add(1)
	go func() { defer wg.Done(); _, genErr = g.run(&stop) }()
	time.Sleep(warmup)
	before, err := t.sinkPackets()
	start := time.Now()
	if err == nil {
		time.Sleep(d)
	}
	after, err2 := t.sinkPackets()
	took := time.Since(start)
	stop.Store(true)
	wg.Wait()
	if err == nil {
		err = err2
	}
	if err == nil {
		err = genErr
	}
	if err != nil {
		return 0, err
	}
	return float64(after-before) / took.Seconds(), nil
}

// forwarding measures plain forwarding (through namespaces without the
// router's state), then the router's datapath programmed with each count of
// tunnel IPs, each next to plain forwarding measured just before, sending to
// the last tunnel IP (the last in the HMARK chain's order), its chains
// written with the iptables binary named. The canonical run prints the
// issue's line form; another backend's lines name it.
func forwarding(counts []int, iptablesBinary string, canonical bool) error {
	return forwardingWith(config(sinkDev), counts, iptablesBinary, canonical)
}

// forwardingWith is forwarding with the router configuration cfg; a
// configuration of another number of generations than the benchmark's
// prints its lines with it.
func forwardingWith(cfg datapath.Config, counts []int, iptablesBinary string, canonical bool) error {
	topo, err := newFwdTopology("")
	if err != nil {
		return err
	}
	defer topo.close()
	// Plain forwarding through identical namespaces without the router's
	// state, measured again just before each count: on this VM the rate of
	// the same path drifts for tens of seconds at a time, so R2 divides by
	// a plain figure of the same moment.
	plainTopo, err := newFwdTopology("-plain")
	if err != nil {
		return err
	}
	defer plainTopo.close()
	with := ""
	if !canonical {
		with = " with " + iptablesBinary
	}
	if cfg.Generations != *generations {
		with += fmt.Sprintf(" with --generations=%d", cfg.Generations)
	}
	fmt.Printf("\nforwarding%s: 64-byte UDP, %d source ports, client netns -> router netns -> sink netns over veth,\n", with, senderPorts)
	fmt.Printf("one sending thread pinned to one CPU (the whole path runs in its softirq); the best of %d rounds of %v,\n", *fwdRounds, *fwdDuration)
	fmt.Printf("each from new source ports (some sets of ports run at half the rate through conntrack for as long as they are used),\n")
	fmt.Printf("after %v warm-up each; each round starts once the machine is %.0f%% idle over %v (the kernel frees\n", *fwdWarmup, quietIdle*100, quietWindow)
	fmt.Printf("deleted namespaces' routes for seconds) and runs with this process's garbage collector off.\n")
	fmt.Printf("The router netns holds the router's real datapath (HMARK chain written by %s, %d generations, fwmark rules, bucket tables,\n", iptablesBinary, cfg.Generations)
	fmt.Printf("programmed by router/datapath); the bucket routes are its gre-mode routes on a veth, which forwards\n")
	fmt.Printf("the packet unencapsulated: this host has no GRE, so no encapsulation cost is included.\n")

	vipOf := func(n int) netip.Addr { return tunnelVIP(n - 1) }
	// Plain forwarding at the start, printed on its own line.
	plainVIP := vipOf(counts[len(counts)-1])
	plain, rounds, err := plainTopo.measureTo(plainVIP)
	if err != nil {
		return err
	}
	fmt.Printf("forwarding%s plain (no router rules): %.0f pps\n", with, plain)
	fmt.Printf("  rounds: %s\n", rounds)
	if cfg.Generations > 1 {
		// What conntrack alone costs: sticky generations need it, so it
		// bounds R2 in the default mode whatever the router's rules.
		tracked, rounds, err := measureTracked(plainVIP, iptablesBinary)
		if err != nil {
			return err
		}
		fmt.Printf("forwarding%s plain with conntrack on (one rule: %s): %.0f pps, %.2fx of plain forwarding, %s\n",
			with, strings.Join(conntrackRule, " "), tracked, tracked/plain, costOver(tracked, plain))
		fmt.Printf("  rounds: %s\n", rounds)
	}

	th, err := startNSThread(topo.router)
	if err != nil {
		return err
	}
	defer th.close()
	var dp *routerDatapath
	if err := th.do(func() (err error) { dp, err = openRouterDatapathWith(cfg, iptablesBinary); return err }); err != nil {
		return err
	}
	defer th.do(func() error { dp.close(); return nil }) //nolint:errcheck
	var one float64
	for _, n := range counts {
		ts := tunnelsFor(cfg, n, *podPool)
		if err := th.do(func() error { return dp.Resync(ts) }); err != nil {
			return fmt.Errorf("programming %d tunnel IPs: %w", n, err)
		}
		vip := vipOf(n)
		plain, plainRounds, err := plainTopo.measureTo(plainVIP)
		if err != nil {
			return err
		}
		pps, rounds, err := topo.measureTo(vip)
		if err != nil {
			return err
		}
		if n == 1 || one == 0 {
			one = pps
		}
		rules, err := topo.ruleCounts(iptablesBinary)
		if err != nil {
			return err
		}
		oneRatio := "n/a"
		if counts[0] == 1 {
			oneRatio = fmt.Sprintf("%.2fx", pps/one)
		}
		fmt.Printf("forwarding %d tunnel IPs%s: %.0f pps, %s of 1 tunnel IP, %.2fx of plain forwarding\n", n, with, pps, oneRatio, pps/plain)
		fmt.Printf("  rounds: %s; plain forwarding just before: %.0f pps (rounds: %s); %s\n", rounds, plain, plainRounds, costOver(pps, plain))
		fmt.Printf("  iptables rules with %d tunnel IPs: %s\n", n, rules)
		// Traffic that is not for a tunnel IP crosses the same netns: what
		// the router's rules (chains, fwmark rules) cost everything else
		// on a router node.
		other, rounds, err := topo.measureTo(otherAddr)
		if err != nil {
			return err
		}
		fmt.Printf("  other traffic (not to a tunnel IP) with %d tunnel IPs programmed: %.0f pps, %.2fx of plain forwarding, %s (rounds: %s)\n", n, other, other/plain, costOver(other, plain), rounds)
	}
	return nil
}

// costOver is what a packet costs at pps more than at plain pps, in
// nanoseconds of the one sending CPU: R2 divides by a plain figure that
// this VM runs 2x faster or slower from one phase to the next, while the
// router's own cost per packet stays about the same.
func costOver(pps, plain float64) string {
	return fmt.Sprintf("%+.0f ns a packet over plain", 1e9/pps-1e9/plain)
}

// otherAddr is a destination beyond the sink that is no tunnel IP.
var otherAddr = netip.MustParseAddr("198.19.255.1")

// measureTo makes dst reachable (see target) and measures forwarding to it
// in fwdRounds rounds, each from a new generator (new source ports): the
// best packets per second the sink received, and every round's figure.
// Some sets of 64 source ports run at half the rate for as long as they are
// used, through the router's rules and conntrack (plain forwarding shows no
// such thing); a round with new ports draws again.
func (t *fwdTopology) measureTo(dst netip.Addr) (best float64, rounds string, err error) {
	if err := t.target(dst); err != nil {
		return 0, "", err
	}
	var all []string
	for range max(*fwdRounds, 1) {
		g, err := newGenerator(t.client, dst)
		if err != nil {
			return 0, "", err
		}
		pps, err := quietRound(func() (float64, error) { return t.measure(g, *fwdWarmup, *fwdDuration) })
		g.close()
		if err != nil {
			return 0, "", err
		}
		best = max(best, pps)
		all = append(all, fmt.Sprintf("%.0f", pps))
	}
	return best, strings.Join(all, ", ") + " pps", nil
}

// conntrackRule turns conntrack on in a netns, as on a node where
// kube-proxy runs: the rule itself matches nothing in the benchmark.
var conntrackRule = []string{"-t", "filter", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"}

// measureTracked measures forwarding to dst through a topology of its own
// whose router netns holds conntrackRule, written with iptablesBinary, and
// nothing else (iptables-nft cannot remove the base chain it creates, so
// the rule does not go into the plain topology).
func measureTracked(dst netip.Addr, iptablesBinary string) (best float64, rounds string, err error) {
	t, err := newFwdTopology("-ct")
	if err != nil {
		return 0, "", err
	}
	defer t.close()
	if _, err := t.router.run(iptablesBinary, conntrackRule...); err != nil {
		return 0, "", err
	}
	return t.measureTo(dst)
}

// ruleCounts counts the lines of `iptables -S` in the raw and mangle tables
// of the router netns (which hold nothing but the router's), without the
// built-in chains' policies.
func (t *fwdTopology) ruleCounts(iptablesBinary string) (string, error) {
	var parts []string
	total := 0
	for _, table := range []string{"raw", "mangle"} {
		out, err := t.router.run(iptablesBinary, "-t", table, "-S")
		if err != nil {
			return "", err
		}
		n := 0
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "-A ") || (strings.HasPrefix(l, "-N ")) {
				n++
			}
		}
		total += n
		parts = append(parts, fmt.Sprintf("%s %d", table, n))
	}
	return fmt.Sprintf("%d (%s; iptables -S lines, -N and -A)", total, strings.Join(parts, ", ")), nil
}
