package ipv6probe

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The router's state for the one tunnel IP, as the project's defaults
// would number it: bucket 0 of a one-bucket HMARK (mark 0x1000), its table
// and policy rule 7600, a nexthop object id.
const (
	table    = "7600"
	rulePref = "7600"
	mark     = "0x1000"
	seed     = "0x5eed1e55"
	nhID     = "7601"
	// greDev6 is the flow-based ip6gre device on the routers and the
	// decapsulating ip6gre device in the pod; greDev4 the IPv4 ones.
	greDev6 = "kst-gre6"
	greDev4 = "kst-gre"
	// podPlatformLabels lets a pod's MPLS accept the pod label.
	podPlatformLabels = "1000"
	// bulk is the size of the uploads and downloads that need path MTU
	// discovery (client to pod) or none (pod to client).
	bulk = 300_000
)

// vip is the IPv6 tunnel IP the probe serves.
var vip = topology.TunnelIP6(10)

// guestTimeout bounds the VM run: several times what it takes on the
// slowest machine of CI's kind known (docs/testing.md, "Time budget").
const guestTimeout = 8 * time.Minute

func TestIPv6Probe(t *testing.T) {
	if lab.IsGuest() {
		t.Skip("TestIPv6Probe boots the VM; it does not run inside it")
	}
	if testing.Short() {
		t.Skip("-short: the probe boots the lab VM, which takes minutes")
	}
	consoleLog := filepath.Join(os.TempDir(), "kst-ipv6probe-console.log")
	lab.RunGuestKernelTests(t, "./test/lab/ipv6probe", "^TestInVM$", guestTimeout, consoleLog)
}

// TestInVM probes each mode on a fresh lab network.
func TestInVM(t *testing.T) {
	if !lab.IsGuest() {
		t.Skip("runs inside the lab VM; TestIPv6Probe boots it")
	}
	ctx := context.Background()
	for _, args := range [][]string{{"cat", "/proc/version"}, {"/sbin/ip", "-V"}, {"ip6tables", "-V"}} {
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		t.Logf("RESULT version %s: %s %v", strings.Join(args, " "), strings.TrimSpace(string(out)), err)
	}
	t.Run("gre", testGRE)
	t.Run("mpls", testMPLS)
	t.Run("ip6tables", testIP6Tables)
}

// probe is one mode's lab network with a server in every pod.
type probe struct {
	t      *testing.T
	l      *topology.Lab
	client netns.NsHandle
}

func up(t *testing.T) *probe {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	l, err := topology.UpNetwork(ctx, topology.Options{Log: testWriter{t}})
	t.Cleanup(func() {
		if err := l.Down(context.Background()); err != nil {
			t.Errorf("tearing the network down: %v", err)
		}
	})
	if err != nil {
		t.Fatalf("network up: %v", err)
	}
	for _, p := range l.Pods {
		ns, err := p.NS()
		if err != nil {
			t.Fatal(err)
		}
		srv, err := workload.Serve(ns, p.Name, []int{topology.TCPPort}, []int{topology.UDPPort})
		ns.Close()
		if err != nil {
			t.Fatalf("server in %s: %v", p.Name, err)
		}
		t.Cleanup(func() { _ = srv.Close() })
	}
	client, err := l.Client.NS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	t.Logf("lab network up in %v", time.Since(start).Round(time.Millisecond))
	return &probe{t: t, l: l, client: client}
}

// try runs a command and logs it as a command line that worked ("cmd:")
// or did not ("FAILED:"), with its output.
func (p *probe) try(name string, args ...string) (string, error) {
	p.t.Helper()
	return p.tryIn(nil, name, args...)
}

func (p *probe) tryIn(stdin []byte, name string, args ...string) (string, error) {
	p.t.Helper()
	return p.exec(true, stdin, name, args...)
}

// read runs a command that only reads state (counters), without logging it,
// failing the test on an error.
func (p *probe) read(name string, args ...string) string {
	p.t.Helper()
	out, err := p.exec(false, nil, name, args...)
	if err != nil {
		p.t.Fatal(err)
	}
	return out
}

func (p *probe) exec(log bool, stdin []byte, name string, args ...string) (string, error) {
	p.t.Helper()
	line := strings.Join(append([]string{name}, args...), " ")
	path := name
	if name == "ip" {
		path = "/sbin/ip" // not busybox's applet
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
		line += " <<EOF\n" + string(stdin) + "EOF"
	}
	b, err := cmd.CombinedOutput()
	out := strings.TrimRight(string(b), "\n")
	if err != nil {
		if log {
			p.t.Logf("FAILED: %s\n    %v: %s", line, err, out)
		}
		return out, fmt.Errorf("%s: %w: %s", line, err, out)
	}
	switch {
	case !log:
	case out != "":
		p.t.Logf("cmd: %s\n%s", line, indent(out))
	default:
		p.t.Logf("cmd: %s", line)
	}
	return out, nil
}

// must is try that fails the test.
func (p *probe) must(name string, args ...string) string {
	p.t.Helper()
	out, err := p.try(name, args...)
	if err != nil {
		p.t.Fatal(err)
	}
	return out
}

// ip runs iproute2's ip, failing the test on an error.
func (p *probe) ip(args ...string) string {
	p.t.Helper()
	return p.must("ip", args...)
}

// in runs a command in namespace ns (ip netns exec), failing the test on an
// error.
func (p *probe) in(ns string, args ...string) string {
	p.t.Helper()
	return p.must("ip", append([]string{"netns", "exec", ns}, args...)...)
}

// result logs a finding; a failed one fails the test too.
func (p *probe) result(name string, ok bool, format string, args ...any) {
	p.t.Helper()
	verdict := "pass"
	if !ok {
		verdict = "FAIL"
	}
	p.t.Logf("RESULT %s: %s: %s", name, verdict, fmt.Sprintf(format, args...))
	if !ok {
		p.t.Errorf("%s failed", name)
	}
}

// finding logs what the kernel did where either answer is a result (an
// alternative that may or may not work).
func (p *probe) finding(name string, works bool, format string, args ...any) {
	p.t.Helper()
	verdict := "works"
	if !works {
		verdict = "does NOT work"
	}
	p.t.Logf("RESULT %s: %s: %s", name, verdict, fmt.Sprintf(format, args...))
}

// hmark puts the one-bucket HMARK rule for vip on every router, and a rule
// counting the packets from vip (the pods' replies, which must not come
// through a router) on every node.
func (p *probe) hmark() {
	for _, r := range p.l.Routers {
		p.in(r.Name, "ip6tables", "-t", "mangle", "-A", "PREROUTING", "-d", vip.String()+"/128", "-j", "HMARK",
			"--hmark-tuple", "src,dst,sport,dport,proto", "--hmark-mod", "1", "--hmark-offset", mark, "--hmark-rnd", seed)
	}
	for _, n := range p.l.Nodes() {
		p.in(n.Name, "ip6tables", "-t", "mangle", "-A", "PREROUTING", "-s", vip.String()+"/128")
	}
}

// rule is the policy rule sending bucket 0's mark to the table, on every
// router.
func (p *probe) rule() {
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "-6", "rule", "add", "pref", rulePref, "fwmark", mark, "lookup", table)
	}
}

// counter returns the packets matched by the mangle PREROUTING rule of
// namespace ns whose spec contains spec (ip6tables-save -c).
func (p *probe) counter(ns, spec string) int {
	p.t.Helper()
	out := p.read("ip", "netns", "exec", ns, "ip6tables-save", "-c", "-t", "mangle")
	for _, line := range strings.Split(out, "\n") {
		if !strings.Contains(line, "-A PREROUTING") || !strings.Contains(line, spec) {
			continue
		}
		// "[packets:bytes] -A PREROUTING ..."
		if m := regexp.MustCompile(`^\[(\d+):\d+\]`).FindStringSubmatch(line); m != nil {
			n, _ := strconv.Atoi(m[1])
			return n
		}
	}
	p.t.Fatalf("%s: no PREROUTING rule with %q in:\n%s", ns, spec, out)
	return 0
}

// linkStats returns a link's rx and tx packets and its MTU.
func (p *probe) linkStats(ns, dev string) (rx, tx, mtu int) {
	p.t.Helper()
	out := p.read("ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev)
	var links []struct {
		MTU   int `json:"mtu"`
		Stats struct {
			RX struct {
				Packets int `json:"packets"`
			} `json:"rx"`
			TX struct {
				Packets int `json:"packets"`
			} `json:"tx"`
		} `json:"stats64"`
	}
	if err := json.Unmarshal([]byte(out), &links); err != nil || len(links) != 1 {
		p.t.Fatalf("ip -j link show %s in %s: %v: %s", dev, ns, err, out)
	}
	return links[0].Stats.RX.Packets, links[0].Stats.TX.Packets, links[0].MTU
}

// who asks vip over network which pod answers, within d.
func (p *probe) who(network string, d time.Duration) (workload.Identity, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	port := uint16(topology.TCPPort)
	if network == "udp" {
		port = topology.UDPPort
	}
	return workload.Who(ctx, p.client, network, netip.AddrPortFrom(vip, port), 0)
}

// reach checks that TCP and UDP from the client reach pod through vip, with
// the client's address as the source the server sees and vip as the
// address it answers from, and that no reply crosses a router.
func (p *probe) reach(check string, pod *topology.Pod) {
	p.t.Helper()
	replies := map[string]int{}
	for _, n := range p.l.Nodes() {
		replies[n.Name] = p.counter(n.Name, "-s "+vip.String())
	}
	for _, network := range []string{"tcp", "udp"} {
		port := uint16(topology.TCPPort)
		if network == "udp" {
			port = topology.UDPPort
		}
		id, err := p.who(network, 20*time.Second)
		ok := err == nil && id.Pod == pod.Name && id.Peer.Addr() == topology.ClientAddr6 && id.Local == netip.AddrPortFrom(vip, port)
		p.result(check+"-"+network, ok, "client %v -> [%v]:%d: server says %q (want pod=%s peer=[%v]:* local=[%v]:%d), err %v",
			topology.ClientAddr6, vip, port, id.String(), pod.Name, topology.ClientAddr6, vip, port, err)
	}
	var through []string
	for _, n := range p.l.Nodes() {
		if d := p.counter(n.Name, "-s "+vip.String()) - replies[n.Name]; d > 0 {
			through = append(through, fmt.Sprintf("%s %d", n.Name, d))
		}
	}
	direct := len(through) > 0 && !strings.Contains(strings.Join(through, ","), "router")
	p.result(check+"-direct-reply", direct, "packets from %v entering each node: %v (only %s's worker expected, no router)", vip, through, pod.Name)
}

// snmp returns a counter of a namespace's /proc/net/snmp6 ("Icmp6InPktTooBigs")
// or /proc/net/snmp (table "Tcp", "RetransSegs").
func (p *probe) snmp(ns, table, name string) int {
	p.t.Helper()
	if table == "" {
		out := p.read("ip", "netns", "exec", ns, "cat", "/proc/net/snmp6")
		for _, line := range strings.Split(out, "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[0] == name {
				n, _ := strconv.Atoi(f[1])
				return n
			}
		}
		p.t.Fatalf("%s: no %s in /proc/net/snmp6", ns, name)
	}
	counters, err := testnetns.SNMPTable(p.read("ip", "netns", "exec", ns, "cat", "/proc/net/snmp"), table)
	if err != nil {
		p.t.Fatalf("%s: %v", ns, err)
	}
	if n, ok := counters[name]; ok {
		return int(n)
	}
	p.t.Fatalf("%s: no %s %s in /proc/net/snmp", ns, table, name)
	return 0
}

// bulk uploads (client to pod: needs path MTU discovery through the router)
// and downloads (pod to client, direct) bulk bytes and reports the path MTU
// the client learned, the Packet Too Big messages it got and the segments
// it sent again.
func (p *probe) bulk(check string, pod *topology.Pod) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	ptb0, retrans0 := p.snmp(topology.ClientNS, "", "Icmp6InPktTooBigs"), p.snmp(topology.ClientNS, "Tcp", "RetransSegs")
	start := time.Now()
	dst := netip.AddrPortFrom(vip, topology.TCPPort)
	id, err := workload.Upload(ctx, p.client, dst, bulk)
	took := time.Since(start).Round(time.Millisecond)
	ptb, retrans := p.snmp(topology.ClientNS, "", "Icmp6InPktTooBigs")-ptb0, p.snmp(topology.ClientNS, "Tcp", "RetransSegs")-retrans0
	p.result(check+"-upload", err == nil && id.Pod == pod.Name, "%d bytes client -> pod in %v (client got %d Packet Too Big, resent %d segments): %v %v",
		bulk, took, ptb, retrans, id, err)
	start = time.Now()
	err = workload.Download(ctx, p.client, dst, bulk)
	p.result(check+"-download", err == nil, "%d bytes pod -> client in %v: %v", bulk, time.Since(start).Round(time.Millisecond), err)
	out := p.ip("-n", topology.ClientNS, "-6", "route", "get", vip.String())
	pmtu := "none (no Packet Too Big received)"
	if m := regexp.MustCompile(`\bmtu (\d+)`).FindStringSubmatch(out); m != nil {
		pmtu = m[1]
	}
	p.t.Logf("RESULT %s-pmtu: the client's path MTU to %v after the upload: %s", check, vip, pmtu)
}

// viaEachRouter checks that the pod answers when the gateway sends vip's
// traffic through one router only, for each router in turn, and that that
// router sent it (its device dev's tx packets).
func (p *probe) viaEachRouter(check string, pod *topology.Pod, dev string) {
	p.t.Helper()
	ctx := context.Background()
	for _, r := range p.l.Routers {
		if err := p.l.RouteTunnels6Via(ctx, r); err != nil {
			p.t.Fatal(err)
		}
		p.t.Logf("cmd: ip -n %s route replace %v via %v", topology.GatewayNS, topology.TunnelNet6, r.Addr6)
		_, before, _ := p.linkStats(r.Name, dev)
		idT, errT := p.who("tcp", 20*time.Second)
		idU, errU := p.who("udp", 20*time.Second)
		_, after, _ := p.linkStats(r.Name, dev)
		ok := errT == nil && errU == nil && idT.Pod == pod.Name && idU.Pod == pod.Name && after > before
		p.result(check+"-via-"+r.Name, ok, "only %s routes %v: tcp %q %v, udp %q %v; %s tx packets on %s %d -> %d",
			r.Name, topology.TunnelNet6, idT.String(), errT, idU.String(), errU, r.Name, dev, before, after)
	}
	if err := p.l.RouteTunnels6Via(ctx, p.l.Routers...); err != nil {
		p.t.Fatal(err)
	}
}

// nexthopVariants tries, as alternatives to the routes in place, the
// tunnel IP's route through a nexthop object of family inet6 (add6, whose
// id is its 5th word) and through one of family inet (add4), on every
// router: whether the kernel takes each, and whether TCP and UDP then
// still reach the pod. The routes in place are put back at the end.
func (p *probe) nexthopVariants(check string, pod *topology.Pod, add6, add4 []string) {
	p.t.Helper()
	r0 := p.l.Routers[0].Name
	before := p.read("ip", "-n", r0, "-6", "route", "show", "table", table)
	for _, v := range []struct {
		name string
		add  []string
	}{{"nexthop-inet6", add6}, {"nexthop-inet", add4}} {
		works := true
		for _, r := range p.l.Routers {
			if _, err := p.try("ip", append([]string{"-n", r.Name}, v.add...)...); err != nil {
				works = false
				break
			}
			if _, err := p.try("ip", "-n", r.Name, "-6", "route", "replace", vip.String()+"/128", "nhid", v.add[4], "table", table); err != nil {
				works = false
				break
			}
		}
		detail := "the kernel refused it (see FAILED above)"
		if works {
			idT, errT := p.who("tcp", 20*time.Second)
			idU, errU := p.who("udp", 20*time.Second)
			works = errT == nil && errU == nil && idT.Pod == pod.Name && idU.Pod == pod.Name
			detail = fmt.Sprintf("tcp %q %v, udp %q %v", idT.String(), errT, idU.String(), errU)
		}
		p.finding(check+"-"+v.name, works, "an IPv6 route naming a nexthop object: ip %s: %s", strings.Join(v.add, " "), detail)
	}
	// Back to the routes in place (one line, as ip prints it).
	for _, r := range p.l.Routers {
		for _, line := range strings.Split(strings.TrimSpace(before), "\n") {
			p.ip(append([]string{"-n", r.Name, "-6", "route", "replace"}, append(strings.Fields(line), "table", table)...)...)
		}
		for _, id := range []string{add6[4], add4[4]} {
			_, _ = p.exec(false, nil, "ip", "-n", r.Name, "nexthop", "del", "id", id)
		}
	}
}

func testGRE(t *testing.T) {
	p := up(t)
	pod := p.l.Pods[0]
	vip128 := vip.String() + "/128"

	// Routers: one flow-based ip6gre device, a nexthop object per pod
	// (family inet6, no gateway) encapsulating towards the pod, the
	// bucket's route naming it.
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "link", "add", greDev6, "type", "ip6gre", "external")
		p.ip("-n", r.Name, "link", "set", greDev6, "up")
	}
	nexthops := true
	for _, r := range p.l.Routers {
		if _, err := p.try("ip", "-n", r.Name, "-6", "nexthop", "add", "id", nhID, "encap", "ip6", "dst", pod.Addr6.String(), "hoplimit", "64", "dev", greDev6); err != nil {
			nexthops = false
		}
	}
	p.finding("gre6-nexthop-object", nexthops, "an IPv6 nexthop object (family inet6, no gateway) with encap ip6 on the ip6gre external device")
	for _, r := range p.l.Routers {
		if nexthops {
			p.ip("-n", r.Name, "-6", "route", "add", vip128, "nhid", nhID, "table", table)
		} else {
			p.ip("-n", r.Name, "-6", "route", "add", vip128, "encap", "ip6", "dst", pod.Addr6.String(), "hoplimit", "64", "dev", greDev6, "table", table)
		}
	}
	p.rule()
	// The pod: an ip6gre device with a local address and no remote, which
	// takes GRE from any router, holding the tunnel IP.
	p.ip("-n", pod.Name, "link", "add", greDev6, "type", "ip6gre", "local", pod.Addr6.String())
	p.ip("-n", pod.Name, "link", "set", greDev6, "up")
	p.ip("-n", pod.Name, "-6", "addr", "add", vip128, "dev", greDev6, "nodad")
	r0 := p.l.Routers[0].Name
	p.ip("-n", r0, "-d", "link", "show", greDev6)
	p.ip("-n", pod.Name, "-d", "link", "show", greDev6)
	p.ip("-n", r0, "-6", "nexthop", "show")
	p.ip("-n", r0, "-6", "route", "show", "table", table)

	// (c) Without the HMARK rule nothing marks the packets and the rule
	// does not send them to the table: the pod gets nothing.
	rx0, _, _ := p.linkStats(pod.Name, greDev6)
	_, err := p.who("udp", 3*time.Second)
	rx1, _, _ := p.linkStats(pod.Name, greDev6)
	p.result("gre6-no-hmark-no-delivery", err != nil && rx1 == rx0, "without the HMARK rule: WHO udp: %v; pod %s rx %d -> %d", err, greDev6, rx0, rx1)
	p.hmark()
	p.ip("-n", r0, "-6", "route", "get", vip.String(), "from", topology.ClientAddr6.String(), "iif", "eth0", "mark", mark)

	// (a) TCP and UDP reach the pod through either router, the reply goes
	// back directly.
	p.reach("gre6", pod)
	marked := 0
	for _, r := range p.l.Routers {
		marked += p.counter(r.Name, "-j HMARK")
	}
	p.result("gre6-hmark-selects-table", marked > 0, "the routers' HMARK rules matched %d packets, which the fwmark rule sent to table %s", marked, table)
	p.viaEachRouter("gre6-pod-device-accepts-any-router", pod, greDev6)

	// MTUs, and bulk data both ways.
	_, _, routerMTU := p.linkStats(r0, greDev6)
	_, _, podMTU := p.linkStats(pod.Name, greDev6)
	_, _, ethMTU := p.linkStats(r0, "eth0")
	p.t.Logf("RESULT gre6-mtu: router %s external device mtu %d, pod %s device mtu %d, fabric eth0 mtu %d", greDev6, routerMTU, greDev6, podMTU, ethMTU)
	p.bulk("gre6", pod)

	// The alternative: IPv4 outer headers for an IPv6 tunnel IP, through
	// the IPv4 flow-based gre device, to an IPv4 gre device in the pod.
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "link", "add", greDev4, "type", "gre", "external")
		p.ip("-n", r.Name, "link", "set", greDev4, "up")
	}
	p.ip("-n", pod.Name, "link", "add", greDev4, "type", "gre", "local", pod.Addr.String())
	p.ip("-n", pod.Name, "link", "set", greDev4, "up")
	v4outer := true
	for _, r := range p.l.Routers {
		if _, err := p.try("ip", "-n", r.Name, "-6", "route", "replace", vip128, "encap", "ip", "dst", pod.Addr.String(), "ttl", "64", "dev", greDev4, "table", table); err != nil {
			v4outer = false
		}
	}
	if v4outer {
		p.ip("-n", r0, "-6", "route", "show", "table", table)
		rx0, _, _ := p.linkStats(pod.Name, greDev4)
		idT, errT := p.who("tcp", 20*time.Second)
		idU, errU := p.who("udp", 20*time.Second)
		rx1, _, _ := p.linkStats(pod.Name, greDev4)
		v4outer = errT == nil && errU == nil && idT.Peer.Addr() == topology.ClientAddr6 && idU.Peer.Addr() == topology.ClientAddr6 && rx1 > rx0
		p.finding("gre6-over-ipv4-outer", v4outer, "IPv6 route with encap ip (IPv4 outer) via the IPv4 gre external device: tcp %q %v, udp %q %v; pod %s rx %d -> %d",
			idT.String(), errT, idU.String(), errU, greDev4, rx0, rx1)
		_, _, mtu4 := p.linkStats(r0, greDev4)
		p.t.Logf("RESULT gre6-over-ipv4-mtu: router %s external device mtu %d", greDev4, mtu4)
		p.ip("-n", topology.ClientNS, "-6", "route", "flush", "cache")
		p.bulk("gre6-over-ipv4", pod)
		p.nexthopVariants("gre6-over-ipv4", pod,
			[]string{"-6", "nexthop", "add", "id", "7602", "encap", "ip", "dst", pod.Addr.String(), "ttl", "64", "dev", greDev4},
			[]string{"-4", "nexthop", "add", "id", "7603", "encap", "ip", "dst", pod.Addr.String(), "ttl", "64", "dev", greDev4})
	} else {
		p.finding("gre6-over-ipv4-outer", false, "the kernel refused an IPv6 route with encap ip (see FAILED above)")
	}

	// (d) A blackhole route in the bucket's table drops.
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "-6", "route", "replace", "blackhole", vip128, "table", table)
	}
	p.ip("-n", r0, "-6", "route", "show", "table", table)
	rx0, _, _ = p.linkStats(pod.Name, greDev6)
	rx40, _, _ := p.linkStats(pod.Name, greDev4)
	_, errU := p.who("udp", 3*time.Second)
	_, errT := p.who("tcp", 3*time.Second)
	rx1, _, _ = p.linkStats(pod.Name, greDev6)
	rx41, _, _ := p.linkStats(pod.Name, greDev4)
	p.result("gre6-blackhole-drops", errU != nil && errT != nil && rx1 == rx0 && rx41 == rx40,
		"WHO udp: %v; WHO tcp: %v; pod rx %s %d -> %d, %s %d -> %d", errU, errT, greDev6, rx0, rx1, greDev4, rx40, rx41)
}

func testMPLS(t *testing.T) {
	p := up(t)
	pod := p.l.Pods[0]
	node := pod.Node
	vip128 := vip.String() + "/128"
	label, err := mplslabel.ForEndpoint(pod.Addr6)
	if err != nil {
		t.Fatal(err)
	}
	l := strconv.Itoa(int(label))

	// Routers push the pod's label towards its node.
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "-6", "route", "add", vip128, "encap", "mpls", l, "via", "inet6", node.Addr6.String(), "dev", "eth0", "table", table)
	}
	p.rule()
	p.hmark()
	// The node swaps it to the pod label towards the pod.
	p.in(node.Name, "sysctl", "-w", "net.mpls.platform_labels="+strconv.Itoa(mplslabel.PlatformLabels))
	p.in(node.Name, "sysctl", "-w", "net.mpls.conf.eth0.input=1")
	p.ip("-n", node.Name, "-f", "mpls", "route", "add", l, "as", strconv.Itoa(mplslabel.PodLabel), "via", "inet6", pod.Addr6.String(), "dev", topology.PodBridge)
	// The pod pops it to lo, which holds the tunnel IP.
	p.in(pod.Name, "sysctl", "-w", "net.mpls.platform_labels="+podPlatformLabels)
	p.in(pod.Name, "sysctl", "-w", "net.mpls.conf.eth0.input=1")
	p.ip("-n", pod.Name, "-f", "mpls", "route", "add", strconv.Itoa(mplslabel.PodLabel), "dev", "lo")
	p.ip("-n", pod.Name, "-6", "addr", "add", vip128, "dev", "lo", "nodad")
	r0 := p.l.Routers[0].Name
	p.ip("-n", r0, "-6", "route", "show", "table", table)
	p.ip("-n", node.Name, "-f", "mpls", "route", "show")
	p.ip("-n", pod.Name, "-f", "mpls", "route", "show")
	p.ip("-n", r0, "-6", "route", "get", vip.String(), "from", topology.ClientAddr6.String(), "iif", "eth0", "mark", mark)

	// (b) TCP and UDP reach the pod through either router, the reply goes
	// back directly.
	p.reach("mpls6", pod)
	p.viaEachRouter("mpls6", pod, "eth0")
	p.bulk("mpls6", pod)
	_, _, ethMTU := p.linkStats(r0, "eth0")
	p.t.Logf("RESULT mpls6-mtu: router eth0 mtu %d (one label: 4 bytes)", ethMTU)

	p.nexthopVariants("mpls6", pod,
		[]string{"-6", "nexthop", "add", "id", "7602", "encap", "mpls", l, "via", node.Addr6.String(), "dev", "eth0"},
		[]string{"-4", "nexthop", "add", "id", "7603", "encap", "mpls", l, "via", node.Addr.String(), "dev", "eth0"})

	// (d) in mpls mode too.
	for _, r := range p.l.Routers {
		p.ip("-n", r.Name, "-6", "route", "replace", "blackhole", vip128, "table", table)
	}
	rx0, _, _ := p.linkStats(pod.Name, "eth0")
	_, errU := p.who("udp", 3*time.Second)
	rx1, _, _ := p.linkStats(pod.Name, "eth0")
	p.result("mpls6-blackhole-drops", errU != nil, "WHO udp: %v; pod eth0 rx %d -> %d (neighbour discovery may add some)", errU, rx0, rx1)
}

// testIP6Tables checks the rules a router writes for an IPv6 tunnel IP with
// both ip6tables backends, one by one and through ip6tables-restore, in a
// namespace of their own.
func testIP6Tables(t *testing.T) {
	p := &probe{t: t}
	ns := "ip6tables-probe"
	p.ip("netns", "add", ns)
	t.Cleanup(func() { _, _ = p.try("ip", "netns", "del", ns) })
	vip128 := vip.String() + "/128"
	for _, backend := range []string{"nft", "legacy"} {
		bin := "ip6tables-" + backend
		_, errM := p.try("ip", "netns", "exec", ns, bin, "-t", "mangle", "-A", "PREROUTING", "-d", vip128, "-j", "HMARK",
			"--hmark-tuple", "src,dst,sport,dport,proto", "--hmark-mod", "64", "--hmark-offset", mark, "--hmark-rnd", seed)
		_, errR := p.try("ip", "netns", "exec", ns, bin, "-t", "raw", "-A", "PREROUTING", "-d", vip128, "-j", "CT", "--notrack")
		restore := "*mangle\n:KST-HMARK6 - [0:0]\n-A KST-HMARK6 -d " + vip128 + " -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 64 --hmark-offset " + mark + " --hmark-rnd " + seed + "\nCOMMIT\n"
		_, errS := p.tryIn([]byte(restore), "ip", "netns", "exec", ns, bin+"-restore", "--noflush")
		out, errV := p.try("ip", "netns", "exec", ns, bin+"-save")
		p.result("ip6tables-"+backend, errM == nil && errR == nil && errS == nil && errV == nil && strings.Contains(out, "HMARK"),
			"mangle HMARK: %v; raw CT --notrack: %v; restore: %v; save: %v", errM, errR, errS, errV)
	}
}

func indent(s string) string {
	return "    " + strings.ReplaceAll(s, "\n", "\n    ")
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}
