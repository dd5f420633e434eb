package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/router/bgp"
	"github.com/cmdnu/kube-service-tunnel/test/bgppeer"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The BGP tests run the real tunnel-router binary, each instance in its own
// network namespace, as the router's ServiceAccount, against a real bird2
// standing for the datacenter router. All namespaces hang on a bridge in
// the peer's namespace:
//
//	peer 198.51.100.1 (bird2, AS 64500) ── br0 ──┬── router a 198.51.100.2 (AS 64512)
//	                                              └── router b 198.51.100.3 (AS 64512)
//
// A dual-stack lab (peerOptions.ipv6, ipv6OverIPv4) adds 2001:db8:100::1,
// ::2 and ::3 to the same links, and bird an IPv6 session with each router
// (ipv6) or IPv6 routes on the IPv4 sessions (ipv6OverIPv4).
var (
	bgpPeerAddr = netip.MustParseAddr("198.51.100.1")
	bgpRouterA  = netip.MustParseAddr("198.51.100.2")
	bgpRouterB  = netip.MustParseAddr("198.51.100.3")

	bgpPeerAddr6 = netip.MustParseAddr("2001:db8:100::1")
	bgpRouterA6  = netip.MustParseAddr("2001:db8:100::2")
	bgpRouterB6  = netip.MustParseAddr("2001:db8:100::3")
)

// bgpPools are the routers' address pools: the IPv4 tunnel IPs of every
// test, and the IPv6 ones of the dual-stack tests.
const bgpPools = "192.0.2.0/24;2001:db8:5::/64"

const (
	bgpPeerASN   = 64500
	bgpRouterASN = 64512
)

var (
	routerBinaryOnce sync.Once
	routerBinary     string
	routerBinaryErr  error
)

// buildRouter builds cmd/tunnel-router once per test run.
func buildRouter(t *testing.T) string {
	t.Helper()
	routerBinaryOnce.Do(func() {
		_, here, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(here), "..", "..")
		dir, err := os.MkdirTemp("", "kst-it-router-")
		if err != nil {
			routerBinaryErr = err
			return
		}
		routerBinary = filepath.Join(dir, "tunnel-router")
		cmd := exec.Command("go", "build", "-o", routerBinary, "./cmd/tunnel-router")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			routerBinaryErr = fmt.Errorf("go build ./cmd/tunnel-router: %v: %s", err, out)
		}
	})
	if routerBinaryErr != nil {
		t.Fatal(routerBinaryErr)
	}
	return routerBinary
}

// bgpLab is the peer and the router namespaces of one test.
type bgpLab struct {
	peer      *bgppeer.Peer
	peerNS    *testnetns.NS
	routers   map[string]*testnetns.NS
	links     map[string]string // router name -> its link's name in the router's namespace
	apiServer string            // host:port of the API server, relayed into each router namespace

	cs         kubernetes.Interface
	kubeconfig string            // the router's ServiceAccount
	namespace  string            // of the test's Service "web"
	nodes      map[string]string // router name -> its Node's name
	vip        netip.Prefix      // the Service's tunnel IP as a host prefix
}

// peerOptions are the bird side's per-neighbour options.
type peerOptions struct {
	bfd      bool
	password string
	// ipv6 addresses the links with IPv6 too, gives the Nodes an IPv6
	// InternalIP, and adds an IPv6 session with each router (named
	// router_a6, router_b6).
	ipv6 bool
	// ipv6OverIPv4 addresses the links with IPv6 too and lets the IPv4
	// sessions carry IPv6 routes (multiprotocol BGP).
	ipv6OverIPv4 bool
	// originate are routes bird announces to the routers.
	originate []netip.Prefix
}

// newBGPLab builds the bridge, one namespace per router, starts bird, and
// creates the routers' Nodes (with nodeLabels) and a Service "web" claiming
// vip (its annotation: one tunnel IP or "IPv4, IPv6") in a fresh namespace.
func newBGPLab(t *testing.T, opts peerOptions, vip string, nodeLabels map[string]string) *bgpLab {
	t.Helper()
	testnetns.RequireRoot(t)
	bgppeer.RequireBird(t)
	buildRouter(t) // before any timing starts
	u, err := url.Parse(env.AdminConfig().Host)
	if err != nil {
		t.Fatal(err)
	}
	lab := &bgpLab{peerNS: testnetns.New(t), routers: map[string]*testnetns.NS{}, links: map[string]string{}, apiServer: u.Host}
	linksIPv6 := opts.ipv6 || opts.ipv6OverIPv4
	nl := lab.peerNS.Netlink()
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := nl.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrAdd(br, &netlink.Addr{IPNet: testnetns.IPNet(netip.PrefixFrom(bgpPeerAddr, 24))}); err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	if linksIPv6 {
		addAddr6(t, nl, "br0", netip.PrefixFrom(bgpPeerAddr6, 64))
	}
	var neighbors []bgppeer.Neighbor
	addrs := map[string][]netip.Addr{}
	for _, r := range []struct {
		name        string
		addr, addr6 netip.Addr
	}{{"a", bgpRouterA, bgpRouterA6}, {"b", bgpRouterB, bgpRouterB6}} {
		ns := testnetns.New(t)
		port := lab.peerNS.AddVeth("port_"+r.name, "eth_"+r.name, netip.Prefix{})
		l, err := nl.LinkByIndex(port)
		if err != nil {
			t.Fatal(err)
		}
		if err := nl.LinkSetMaster(l, br); err != nil {
			t.Fatal(err)
		}
		moveLink(t, lab.peerNS, ns, "eth_"+r.name, netip.PrefixFrom(r.addr, 24))
		addrs[r.name] = []netip.Addr{r.addr}
		if linksIPv6 {
			addAddr6(t, ns.Netlink(), "eth_"+r.name, netip.PrefixFrom(r.addr6, 64))
			addrs[r.name] = append(addrs[r.name], r.addr6)
		}
		stop, err := testnetns.ForwardLoopback(ns.Handle, lab.apiServer)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		lab.routers[r.name], lab.links[r.name] = ns, "eth_"+r.name
		neighbors = append(neighbors, bgppeer.Neighbor{Name: "router_" + r.name, Address: r.addr, ASN: bgpRouterASN,
			HoldTime: 3 * time.Second, KeepaliveTime: time.Second, BFD: opts.bfd, Password: opts.password, CarryIPv6: opts.ipv6OverIPv4})
		if opts.ipv6 {
			neighbors = append(neighbors, bgppeer.Neighbor{Name: "router_" + r.name + "6", Address: r.addr6, ASN: bgpRouterASN,
				HoldTime: 3 * time.Second, KeepaliveTime: time.Second, BFD: opts.bfd, Password: opts.password})
		}
	}
	cfg := bgppeer.Config{RouterID: bgpPeerAddr, ASN: bgpPeerASN, Neighbors: neighbors, Originate: opts.originate}
	if opts.bfd {
		cfg.BFD = bgppeer.BFDIntervals{MinTx: 300 * time.Millisecond, MinRx: 300 * time.Millisecond, Multiplier: 3}
	}
	lab.peer = bgppeer.Start(t, lab.peerNS, cfg)

	lab.cs = adminClient(t)
	lab.kubeconfig = writeKubeconfig(t, routerConfig(t))
	lab.namespace = freshNamespace(t, lab.cs)
	lab.nodes = map[string]string{"a": "bgp-a-" + lab.namespace, "b": "bgp-b-" + lab.namespace}
	bgpNode(t, lab.cs, lab.nodes["a"], nodeLabels, addrs["a"]...)
	bgpNode(t, lab.cs, lab.nodes["b"], nodeLabels, addrs["b"]...)
	first, _, _ := strings.Cut(vip, ",")
	lab.vip = netip.PrefixFrom(netip.MustParseAddr(first), 32)
	createService(t, lab.cs, lab.namespace, "web", vip)
	return lab
}

// addAddr6 gives a link an IPv6 address without duplicate address
// detection, so that it is usable at once.
func addAddr6(t *testing.T, nl *netlink.Handle, link string, addr netip.Prefix) {
	t.Helper()
	l, err := nl.LinkByName(link)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(addr), Flags: unix.IFA_F_NODAD}); err != nil {
		t.Fatalf("add %s to %s: %v", addr, link, err)
	}
}

// setEndpoint sets the Service's one endpoint's readiness.
func (l *bgpLab) setEndpoint(t *testing.T, addr string, ready bool) {
	t.Helper()
	e := ep{addr: addr, ready: ptr(ready)}
	if !ready {
		e.serving = ptr(false)
	}
	applySlice(t, l.cs, l.namespace, "web", "web-1", e)
}

// moveLink moves a link into another namespace and addresses it there.
func moveLink(t *testing.T, from, to *testnetns.NS, name string, addr netip.Prefix) {
	t.Helper()
	src := from.Netlink()
	l, err := src.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.LinkSetNsFd(l, int(to.Handle)); err != nil {
		t.Fatal(err)
	}
	dst := to.Netlink()
	if l, err = dst.LinkByName(name); err != nil {
		t.Fatal(err)
	}
	if err := dst.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(addr)}); err != nil {
		t.Fatal(err)
	}
	if err := dst.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
}

// setLink sets a router's link up or down: a dead node, as its peer sees it.
func (l *bgpLab) setLink(t *testing.T, router string, up bool) {
	t.Helper()
	nl := l.routers[router].Netlink()
	link, err := nl.LinkByName(l.links[router])
	if err != nil {
		t.Fatal(err)
	}
	if up {
		err = nl.LinkSetUp(link)
	} else {
		err = nl.LinkSetDown(link)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// bgpNode creates a Node whose InternalIPs are the router's addresses: the
// BGP router ID and the next hop of each family.
func bgpNode(t *testing.T, cs kubernetes.Interface, name string, labels map[string]string, addrs ...netip.Addr) {
	t.Helper()
	ctx := context.Background()
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	setNodeAddresses(t, cs, name, addrs...)
}

// setNodeAddresses makes addrs the Node's InternalIPs.
func setNodeAddresses(t *testing.T, cs kubernetes.Interface, name string, addrs ...netip.Addr) {
	t.Helper()
	ctx := context.Background()
	node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.Addresses = nil
	for _, a := range addrs {
		node.Status.Addresses = append(node.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: a.String()})
	}
	if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// writeKubeconfig writes a kubeconfig for a client configuration.
func writeKubeconfig(t *testing.T, cfg *rest.Config) string {
	t.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters["it"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["it"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["it"] = &clientcmdapi.Context{Cluster: "it", AuthInfo: "it"}
	kc.CurrentContext = "it"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// routerProcess is a tunnel-router binary running in a namespace.
type routerProcess struct {
	name string
	cmd  *exec.Cmd
	log  *syncBuffer
	done chan error
	ns   *testnetns.NS
	// cfgPath is the router's BGP configuration file.
	cfgPath string
}

// startRouterProcess runs tunnel-router in the router's namespace, on a
// stand-in device for GRE (this host has no GRE; see the router's
// privileged tests), with the BGP configuration bgpYAML.
func (l *bgpLab) startRouterProcess(t *testing.T, router, bgpYAML string) *routerProcess {
	t.Helper()
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "bgp.yaml")
	if err := os.WriteFile(cfgPath, []byte(bgpYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	p := &routerProcess{name: router, log: &syncBuffer{}, done: make(chan error, 1), ns: l.routers[router], cfgPath: cfgPath}
	p.cmd = exec.Command(buildRouter(t), "--kubeconfig", l.kubeconfig, "--node-name", l.nodes[router], "--seed", "7",
		"--gre-device-create=false", "--gre-device", l.links[router], "--gre6-device", l.links[router], "--generations", "1", "--pools", bgpPools,
		"--bgp-config", cfgPath, "--metrics-address", "127.0.0.1:9641", "--log-level", "debug")
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	// The child inherits the namespace of the thread that forks it. No
	// Pdeathsig: that thread ends right after the fork.
	if err := p.ns.Do(p.cmd.Start); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		p.stop(syscall.SIGKILL)
		if t.Failed() {
			t.Logf("router %s log:\n%s", router, lastLines(p.log.String(), 40))
		}
		// No pod owns the status ConfigMap of a router process here.
		_ = l.cs.CoreV1().ConfigMaps(routerstatus.DefaultNamespace).Delete(context.Background(), routerstatus.Name(l.nodes[router]), metav1.DeleteOptions{})
	})
	return p
}

// stop signals the router and waits for it to exit.
func (p *routerProcess) stop(sig syscall.Signal) error {
	if p.cmd.ProcessState != nil {
		return nil
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		return fmt.Errorf("router %s did not exit within 20 s of %v", p.name, sig)
	}
}

// metrics scrapes the router's /metrics inside its namespace.
func (p *routerProcess) metrics(t *testing.T) string {
	t.Helper()
	var conn net.Conn
	if err := p.ns.Do(func() (err error) { conn, err = net.Dial("tcp", "127.0.0.1:9641"); return err }); err != nil {
		t.Fatalf("router %s metrics: %v", p.name, err)
	}
	defer conn.Close()
	fmt.Fprint(conn, "GET /metrics HTTP/1.0\r\n\r\n")
	b, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// metric returns the value of one sample line, "" when absent.
func metric(metrics, sample string) string {
	sc := bufio.NewScanner(strings.NewReader(metrics))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), sample+" "); ok {
			return v
		}
	}
	return ""
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func routerBGPConfig(extra string) string {
	return fmt.Sprintf(`asn: %d
withdrawDelay: 1s
%speers:
- address: %v
  asn: %d
  holdTime: 3s
  keepaliveTime: 1s
  connectRetry: 1s
`, bgpRouterASN, extra, bgpPeerAddr, bgpPeerASN)
}

// TestBGPAnnouncesServedTunnelIPs follows one tunnel IP through its life as
// the peer sees it: announced once a ready endpoint exists, by both routers
// (ECMP), withdrawn when the last endpoint goes and when a router stops,
// dropped after the hold time when a router dies without a word.
func TestBGPAnnouncesServedTunnelIPs(t *testing.T) {
	lab := newBGPLab(t, peerOptions{}, "192.0.2.61", nil)
	vip := lab.vip

	start := time.Now()
	a := lab.startRouterProcess(t, "a", routerBGPConfig(""))
	t.Logf("bgp: session with router a established %v after its start", lab.peer.WaitEstablished(t, "router_a", start, 30*time.Second))
	// No ready endpoint: nothing is announced, though the session is up.
	time.Sleep(time.Second)
	if routes, err := lab.peer.Routes(vip); err != nil || len(routes) != 0 {
		t.Fatalf("tunnel IP without endpoints announced: %v %v", routes, err)
	}
	if m := a.metrics(t); metric(m, fmt.Sprintf(`kube_service_tunnel_bgp_session_up{peer="%v"}`, bgpPeerAddr)) != "1" ||
		metric(m, "kube_service_tunnel_bgp_announced_prefixes") != "0" {
		t.Fatalf("router a metrics: session up and 0 prefixes expected:\n%s", grepLines(m, "kube_service_tunnel_bgp"))
	}

	start = time.Now()
	lab.setEndpoint(t, "10.244.1.5", true)
	t.Logf("bgp: endpoint ready -> peer's kernel route via router a took %v", lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterA))
	// The speaker sets the gauge once its whole batch is handed over, a
	// moment after the peer may have the route (CI caught it at 0 once).
	eventually(t, 5*time.Second, "router a's metrics count the announced prefix", func() error {
		if m := a.metrics(t); metric(m, "kube_service_tunnel_bgp_announced_prefixes") != "1" {
			return fmt.Errorf("router a announces 1 prefix, metrics say:\n%s", grepLines(m, "kube_service_tunnel_bgp"))
		}
		return nil
	})

	start = time.Now()
	lab.startRouterProcess(t, "b", routerBGPConfig(""))
	t.Logf("bgp: router b started -> ECMP over both routers took %v", lab.peer.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA, bgpRouterB))

	// The last endpoint stops being ready: both withdraw.
	start = time.Now()
	lab.setEndpoint(t, "10.244.1.5", false)
	t.Logf("bgp: last endpoint not ready -> route withdrawn by both took %v", lab.peer.WaitRoutes(t, vip, 0, start, 20*time.Second))
	start = time.Now()
	lab.setEndpoint(t, "10.244.1.5", true)
	t.Logf("bgp: endpoint ready again -> ECMP route back took %v", lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterA, bgpRouterB))

	// A bad annotation stops the claim: withdrawn. Fixed: announced again.
	start = time.Now()
	setAnnotation(t, lab.cs, lab.namespace, "web", ptr("not-an-ip"))
	t.Logf("bgp: annotation made invalid -> withdrawn took %v", lab.peer.WaitRoutes(t, vip, 0, start, 20*time.Second))
	setAnnotation(t, lab.cs, lab.namespace, "web", ptr(vip.Addr().String()))
	lab.peer.WaitKernelNextHops(t, vip, time.Now(), 20*time.Second, bgpRouterA, bgpRouterB)

	// SIGTERM: router a withdraws, waits, closes; b keeps the route.
	start = time.Now()
	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	withdrawn := lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterB)
	if err := a.stop(syscall.SIGTERM); err != nil {
		t.Fatalf("router a exit after SIGTERM: %v", err)
	}
	t.Logf("bgp: router a SIGTERM -> only router b left took %v (process exited after %v, withdrawDelay 1s)", withdrawn, time.Since(start))
	if withdrawn >= time.Second {
		t.Errorf("router a's path went %v after SIGTERM, not before it closed its session (withdrawDelay 1s)", withdrawn)
	}
	if !strings.Contains(a.log.String(), "withdrew every tunnel IP") {
		t.Errorf("router a did not log its withdrawal on SIGTERM:\n%s", lastLines(a.log.String(), 20))
	}

	// Router a back, then its node dies (link down): without BFD the peer
	// waits for the hold time (3 s).
	a = lab.startRouterProcess(t, "a", routerBGPConfig(""))
	lab.peer.WaitKernelNextHops(t, vip, time.Now(), 30*time.Second, bgpRouterA, bgpRouterB)
	start = time.Now()
	lab.setLink(t, "a", false)
	took := lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterB)
	t.Logf("bgp: router a's link cut (no BFD, hold time 3s) -> its path dropped took %v", took)
	if took < 2*time.Second {
		t.Errorf("path dropped after %v, before the hold time could expire: the test did not cut the node off", took)
	}
	lab.setLink(t, "a", true)
	start = time.Now()
	t.Logf("bgp: router a's link restored -> ECMP back took %v", lab.peer.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA, bgpRouterB))
	_ = a
}

// TestBGPWithBFDDetectsADeadRouterFast pairs GoBGP's BFD with bird's: a
// router whose link dies loses its path in well under the hold time.
func TestBGPWithBFDDetectsADeadRouterFast(t *testing.T) {
	lab := newBGPLab(t, peerOptions{bfd: true}, "192.0.2.62", nil)
	vip := lab.vip
	lab.setEndpoint(t, "10.244.1.6", true)
	// 300 ms x 3, not 100 ms: CI runs this next to a qemu VM that saturates
	// both cores, and a BFD packet late by 300 ms flapped healthy sessions.
	cfg := strings.Replace(routerBGPConfig(""), "  connectRetry: 1s\n", "  connectRetry: 1s\n  bfd: {minInterval: 300ms, multiplier: 3}\n", 1)
	start := time.Now()
	lab.startRouterProcess(t, "a", cfg)
	lab.startRouterProcess(t, "b", cfg)
	t.Logf("bgp+bfd: both routers started -> ECMP took %v", lab.peer.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA, bgpRouterB))
	bgppeer.Poll(t, time.Now(), 10*time.Second, "BFD sessions up at the peer", func() (bool, string) {
		out, err := lab.peer.Birdc("show", "bfd", "sessions")
		if err != nil {
			return false, err.Error()
		}
		return strings.Count(out, " Up ") == 2, out
	})
	start = time.Now()
	lab.setLink(t, "a", false)
	// What is measured is router a's path going; router b's session is not
	// part of it (should it flap under load, it comes back below).
	took := bgppeer.Poll(t, start, 20*time.Second, "router a's path gone from the peer's kernel route", func() (bool, string) {
		hops, err := lab.peer.KernelNextHops(vip)
		if err != nil {
			return false, err.Error()
		}
		return !slices.Contains(hops, bgpRouterA), fmt.Sprint(hops)
	})
	t.Logf("bgp+bfd: router a's link cut (BFD 300ms x 3) -> its path dropped took %v", took)
	if took >= 3*time.Second {
		t.Errorf("with BFD the path went after %v, not before the 3 s hold time", took)
	}
	lab.peer.WaitKernelNextHops(t, vip, time.Now(), 30*time.Second, bgpRouterB)
}

// TestBGPPeerNodeSelector: a peer with a nodeSelector is used only by the
// routers whose Node matches, and follows a label change.
func TestBGPPeerNodeSelector(t *testing.T) {
	lab := newBGPLab(t, peerOptions{}, "192.0.2.63", map[string]string{"rack": "r2"})
	vip, cs, nodeA := lab.vip, lab.cs, lab.nodes["a"]
	lab.setEndpoint(t, "10.244.1.7", true)
	cfg := strings.Replace(routerBGPConfig(""), "  connectRetry: 1s\n", "  connectRetry: 1s\n  nodeSelector: {matchLabels: {rack: r1}}\n", 1)
	a := lab.startRouterProcess(t, "a", cfg)
	bgppeer.Poll(t, time.Now(), 20*time.Second, "router a ready", func() (bool, string) {
		return strings.Contains(a.log.String(), "resynced datapath"), lastLines(a.log.String(), 5)
	})
	time.Sleep(2 * time.Second) // bird would connect within 1 s if the router peered
	if up, state, err := lab.peer.Established("router_a"); err != nil || up {
		t.Fatalf("router a on rack r2 peered with the rack r1 peer: %v %v", state, err)
	}
	node, err := cs.CoreV1().Nodes().Get(context.Background(), nodeA, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels["rack"] = "r1"
	if _, err := cs.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	t.Logf("bgp: node relabelled -> route via router a took %v", lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterA))
}

// TestBGPRejectsBadConfiguration: the router refuses to start on a bad BGP
// configuration and names the field.
func TestBGPRejectsBadConfiguration(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "bgp.yaml")
	if err := os.WriteFile(path, []byte("asn: 64512\npeers:\n- address: 198.51.100.1\n  asn: 64500\n  holdTime: 1s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(buildRouter(t), "--seed", "1", "--bgp-config", path, "--kubeconfig", "/nonexistent").CombinedOutput()
	if err == nil || !regexp.MustCompile(`peers\[0\]\.holdTime`).Match(out) {
		t.Fatalf("router with holdTime 1s: err %v, output %s", err, out)
	}
}

func grepLines(s, part string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, part) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestBGPGracefulRestartKeepsRoutesThroughACrash: with graceful restart, a
// router killed without a word (SIGKILL: no withdrawal, no notification)
// keeps its path at the peer, whose helper marks it stale, and the restarted
// router takes it over again; without it the path goes at once.
func TestBGPGracefulRestartKeepsRoutesThroughACrash(t *testing.T) {
	lab := newBGPLab(t, peerOptions{}, "192.0.2.64", nil)
	vip := lab.vip
	lab.setEndpoint(t, "10.244.1.8", true)
	cfg := routerBGPConfig("gracefulRestart: {enabled: true, restartTime: 30s}\n")
	a := lab.startRouterProcess(t, "a", cfg)
	lab.startRouterProcess(t, "b", cfg)
	lab.peer.WaitKernelNextHops(t, vip, time.Now(), 30*time.Second, bgpRouterA, bgpRouterB)
	// Crash router a, restart it 2 s later, and watch the peer's kernel
	// route every 20 ms from the kill until the new session is established.
	_ = a.stop(syscall.SIGKILL) // "signal: killed"
	killed := time.Now()
	var lost []string
	watch := func(until time.Duration) {
		for time.Since(killed) < until {
			nh, err := lab.peer.KernelNextHops(vip)
			if err != nil {
				t.Fatal(err)
			}
			if len(nh) != 2 {
				lost = append(lost, fmt.Sprintf("%v: %v", time.Since(killed).Round(time.Millisecond), nh))
			}
			time.Sleep(bgppeer.PollInterval)
		}
	}
	watch(2 * time.Second)
	lab.startRouterProcess(t, "a", cfg)
	restarted := time.Since(killed)
	established := lab.peer.WaitEstablished(t, "router_a", killed, 30*time.Second)
	watch(established + 3*time.Second)
	if len(lost) > 0 {
		t.Fatalf("the peer's route lost router a's path during its crash and restart (graceful restart should keep it): %s", strings.Join(lost[:min(len(lost), 10)], "; "))
	}
	t.Logf("bgp+gr: router a killed, restarted after %v, session back after %v; the peer's ECMP route kept both paths throughout (polled every %v)",
		restarted.Round(time.Millisecond), established.Round(time.Millisecond), bgppeer.PollInterval)
}

// TestBGPPasswordFromFile: TCP MD5 with the password read from a file (a
// mounted Secret); a wrong password never establishes.
func TestBGPPasswordFromFile(t *testing.T) {
	lab := newBGPLab(t, peerOptions{password: "s3cret-kst"}, "192.0.2.65", nil)
	vip := lab.vip
	lab.setEndpoint(t, "10.244.1.9", true)
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "good"), filepath.Join(dir, "bad")
	if err := os.WriteFile(good, []byte("s3cret-kst\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("wrong"), 0o600); err != nil {
		t.Fatal(err)
	}
	withFile := func(path string) string {
		return strings.Replace(routerBGPConfig(""), "  connectRetry: 1s\n", "  connectRetry: 1s\n  passwordFile: "+path+"\n", 1)
	}
	start := time.Now()
	lab.startRouterProcess(t, "a", withFile(good))
	lab.startRouterProcess(t, "b", withFile(bad))
	t.Logf("bgp+md5: route via the router with the right password took %v", lab.peer.WaitKernelNextHops(t, vip, start, 20*time.Second, bgpRouterA))
	time.Sleep(3 * time.Second)
	if up, state, err := lab.peer.Established("router_b"); err != nil || up {
		t.Fatalf("router b with a wrong MD5 password: session %q %v", state, err)
	}
	if nh, err := lab.peer.KernelNextHops(vip); err != nil || len(nh) != 1 {
		t.Fatalf("peer's next hops %v %v, want router a only", nh, err)
	}
}

// The BGP configuration file changes under a running router (as kubelet
// refreshes the mounted ConfigMap): a peer's corrected AS number brings the
// session up, and a new router ID restarts BGP, without a restart of the
// router; a file that does not validate changes nothing.
func TestBGPConfigChangeAppliesWithoutRestart(t *testing.T) {
	lab := newBGPLab(t, peerOptions{}, "192.0.2.66", nil)
	vip := lab.vip
	lab.setEndpoint(t, "10.244.1.8", true)
	wrongASN := strings.Replace(routerBGPConfig(""), fmt.Sprintf("  asn: %d\n", bgpPeerASN), fmt.Sprintf("  asn: %d\n", bgpPeerASN+1), 1)
	a := lab.startRouterProcess(t, "a", wrongASN)
	bgppeer.Poll(t, time.Now(), 20*time.Second, "router a ready", func() (bool, string) {
		return strings.Contains(a.log.String(), "resynced datapath"), lastLines(a.log.String(), 5)
	})
	time.Sleep(3 * time.Second)
	if up, state, err := lab.peer.Established("router_a"); err != nil || up {
		t.Fatalf("a session came up with the wrong peer AS: %v %v", state, err)
	}
	pid := a.cmd.Process.Pid

	// A file that does not validate: refused, logged, nothing changes.
	if err := os.WriteFile(a.cfgPath, []byte("asn: 0\npeers: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	bgppeer.Poll(t, time.Now(), 20*time.Second, "the bad file refused", func() (bool, string) {
		return strings.Contains(a.log.String(), "BGP configuration not changed"), lastLines(a.log.String(), 5)
	})

	start := time.Now()
	if err := os.WriteFile(a.cfgPath, []byte(routerBGPConfig("")), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("bgp: peer AS corrected in the file -> route via router a took %v (the file is read every %v)",
		lab.peer.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA), bgp.ConfigWatchPeriod)

	start = time.Now()
	if err := os.WriteFile(a.cfgPath, []byte(routerBGPConfig("routerID: 10.99.0.1\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	bgppeer.Poll(t, start, 30*time.Second, "BGP restarted with the new router ID", func() (bool, string) {
		return strings.Contains(a.log.String(), "restarting BGP") && strings.Contains(a.log.String(), `router_id=10.99.0.1`), lastLines(a.log.String(), 5)
	})
	t.Logf("bgp: router ID changed -> route via router a again after %v", lab.peer.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA))
	if a.cmd.ProcessState != nil || a.cmd.Process.Pid != pid {
		t.Errorf("the router restarted")
	}
}

// routerBGPConfigDualStack is routerBGPConfig with the peer's IPv6 address
// as a second peer.
func routerBGPConfigDualStack(extra string) string {
	return routerBGPConfig(extra) + fmt.Sprintf(`- address: %v
  asn: %d
  holdTime: 3s
  keepaliveTime: 1s
  connectRetry: 1s
`, bgpPeerAddr6, bgpPeerASN)
}

// setEndpoint6 sets the readiness of the one endpoint of the Service's
// IPv6 EndpointSlice.
func (l *bgpLab) setEndpoint6(t *testing.T, addr string, ready bool) {
	t.Helper()
	ctx := context.Background()
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: l.namespace, Name: "web-6", Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv6,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{addr},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready), Serving: ptr(ready)}}},
	}
	existing, err := l.cs.DiscoveryV1().EndpointSlices(l.namespace).Get(ctx, es.Name, metav1.GetOptions{})
	if err == nil {
		es.ResourceVersion = existing.ResourceVersion
		_, err = l.cs.DiscoveryV1().EndpointSlices(l.namespace).Update(ctx, es, metav1.UpdateOptions{})
	} else {
		_, err = l.cs.DiscoveryV1().EndpointSlices(l.namespace).Create(ctx, es, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestBGPAnnouncesIPv6TunnelIPs runs the router binaries with an IPv4 and
// an IPv6 peer (bird2 with an IPv4 and an IPv6 session per router) and a
// dual-stack Service: its IPv6 tunnel IP goes to the IPv6 peer with each
// router's IPv6 address (its Node's) as next hop, an ECMP route in the
// peer's kernel, and its IPv4 one to the IPv4 peer, each session carrying
// its own family. A node's new IPv6 address becomes the next hop without a
// session reset; a node without one withdraws the IPv6 tunnel IP alone and
// says what to set, once; the Service dropping its IPv6 address withdraws
// it while the IPv4 one stays.
func TestBGPAnnouncesIPv6TunnelIPs(t *testing.T) {
	lab := newBGPLab(t, peerOptions{ipv6: true}, "192.0.2.67, 2001:db8:5::67", nil)
	vip4, vip6 := lab.vip, netip.MustParsePrefix("2001:db8:5::67/128")
	lab.setEndpoint(t, "10.244.1.10", true)
	lab.setEndpoint6(t, "fd00:244:1::10", true)

	start := time.Now()
	a := lab.startRouterProcess(t, "a", routerBGPConfigDualStack(""))
	lab.startRouterProcess(t, "b", routerBGPConfigDualStack(""))
	t.Logf("bgp6: both routers started -> IPv6 ECMP in the peer's kernel took %v",
		lab.peer.WaitKernelNextHops(t, vip6, start, 30*time.Second, bgpRouterA6, bgpRouterB6))
	lab.peer.WaitKernelNextHops(t, vip4, start, 30*time.Second, bgpRouterA, bgpRouterB)
	lab.checkRouteSources(t, vip6, "router_a6="+bgpRouterA6.String(), "router_b6="+bgpRouterB6.String())
	lab.checkRouteSources(t, vip4, "router_a="+bgpRouterA.String(), "router_b="+bgpRouterB.String())
	if out := lab.peerNS.Run("ip", "-6", "route", "show", vip6.String()); !strings.Contains(out, "via "+bgpRouterA6.String()) ||
		!strings.Contains(out, "via "+bgpRouterB6.String()) {
		t.Errorf("ip -6 route show %s in the peer's namespace, want both routers:\n%s", vip6, out)
	}
	if log := a.log.String(); !strings.Contains(log, fmt.Sprintf("next_hop_ipv6=%q", bgpRouterA6.String())) {
		t.Errorf("router a did not take its Node's IPv6 address as the IPv6 next hop:\n%s", grepLines(log, "BGP speaker started"))
	}
	if log := a.log.String(); !strings.Contains(log, fmt.Sprintf(`msg="announcing tunnel IP" component=bgp next_hop=%q vip=%q`, bgpRouterA6, vip6.Addr())) {
		t.Errorf("router a did not log its IPv6 announcement:\n%s", grepLines(log, "announcing tunnel IP"))
	}
	// The routers serve the Services of the earlier tests too: count the
	// prefixes from here.
	m := a.metrics(t)
	if metric(m, fmt.Sprintf(`kube_service_tunnel_bgp_session_up{peer="%v"}`, bgpPeerAddr6)) != "1" {
		t.Errorf("router a metrics: IPv6 session up expected:\n%s", grepLines(m, "kube_service_tunnel_bgp"))
	}
	dualStack := metric(m, "kube_service_tunnel_bgp_announced_prefixes")

	// Node a's IPv6 address changes: its path follows, the session stays.
	moved := netip.MustParseAddr("2001:db8:100::12")
	addAddr6(t, lab.routers["a"].Netlink(), lab.links["a"], netip.PrefixFrom(moved, 64))
	start = time.Now()
	setNodeAddresses(t, lab.cs, lab.nodes["a"], bgpRouterA, moved)
	t.Logf("bgp6: node a's IPv6 address changed -> the peer's next hop followed in %v",
		lab.peer.WaitKernelNextHops(t, vip6, start, 20*time.Second, moved, bgpRouterB6))
	if n := strings.Count(a.log.String(), "BGP speaker started"); n != 1 {
		t.Errorf("router a started BGP %d times, want once (a new IPv6 address must not restart BGP)", n)
	}

	// Node a loses its IPv6 address: router a withdraws the IPv6 tunnel IP
	// and says what to set, once; the IPv4 one stays announced by both.
	start = time.Now()
	setNodeAddresses(t, lab.cs, lab.nodes["a"], bgpRouterA)
	t.Logf("bgp6: node a without an IPv6 address -> its IPv6 path withdrawn in %v",
		lab.peer.WaitKernelNextHops(t, vip6, start, 20*time.Second, bgpRouterB6))
	// A relabelled Node reaches the speaker (SetNode) and reconciles it
	// again: the warning is not repeated.
	if _, err := lab.cs.CoreV1().Nodes().Patch(context.Background(), lab.nodes["a"], types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"kst-test":"relabelled"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if n := strings.Count(a.log.String(), "set nextHopIPv6 in the BGP configuration"); n != 1 {
		t.Errorf("router a logged the missing IPv6 next hop %d times, want once:\n%s", n, grepLines(a.log.String(), "not announced"))
	}
	if hops, err := lab.peer.KernelNextHops(vip4); err != nil || !slices.Equal(hops, []netip.Addr{bgpRouterA, bgpRouterB}) {
		t.Errorf("IPv4 next hops %v (%v), want both routers still", hops, err)
	}
	setNodeAddresses(t, lab.cs, lab.nodes["a"], bgpRouterA, bgpRouterA6)
	lab.peer.WaitKernelNextHops(t, vip6, time.Now(), 20*time.Second, bgpRouterA6, bgpRouterB6)

	// The Service drops its IPv6 address: withdrawn by both; the IPv4
	// tunnel IP stays announced to the IPv4 peer.
	start = time.Now()
	setAnnotation(t, lab.cs, lab.namespace, "web", ptr(vip4.Addr().String()))
	t.Logf("bgp6: the Service dropped its IPv6 address -> withdrawn by both in %v", lab.peer.WaitRoutes(t, vip6, 0, start, 20*time.Second))
	lab.peer.WaitKernelNextHops(t, vip6, start, 5*time.Second)
	time.Sleep(500 * time.Millisecond)
	if hops, err := lab.peer.KernelNextHops(vip4); err != nil || !slices.Equal(hops, []netip.Addr{bgpRouterA, bgpRouterB}) {
		t.Errorf("after the IPv6 address went: IPv4 next hops %v (%v), want both routers", hops, err)
	}
	before, _ := strconv.Atoi(dualStack)
	if m := a.metrics(t); metric(m, "kube_service_tunnel_bgp_announced_prefixes") != strconv.Itoa(before-1) {
		t.Errorf("router a announced %s prefixes with the dual-stack Service, want one less now, metrics say:\n%s", dualStack, grepLines(m, "kube_service_tunnel_bgp"))
	}
}

// checkRouteSources checks that the peer's BGP routes for prefix come from
// exactly the sessions and next hops want ("router_a6=2001:db8:100::2").
func (l *bgpLab) checkRouteSources(t *testing.T, prefix netip.Prefix, want ...string) {
	t.Helper()
	routes, err := l.peer.Routes(prefix)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range routes {
		got = append(got, r.FromNeighbor+"="+r.NextHop.String())
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("the peer's BGP routes for %s come from %v, want %v", prefix, got, want)
	}
}

// TestBGPIPv6OverIPv4Session: a peer with IPv4 sessions only that enables
// IPv6 unicast on them (multiprotocol BGP) gets a dual-stack Service's IPv6
// tunnel IP over them, with each router's IPv6 address as next hop, as an
// ECMP route in its kernel: the router offers IPv6 unicast to every IPv4
// peer. (The peers of the other BGP tests do not enable it, and get IPv4
// alone.)
func TestBGPIPv6OverIPv4Session(t *testing.T) {
	lab := newBGPLab(t, peerOptions{ipv6OverIPv4: true}, "192.0.2.69, 2001:db8:5::69", nil)
	vip4, vip6 := lab.vip, netip.MustParsePrefix("2001:db8:5::69/128")
	lab.setEndpoint(t, "10.244.1.13", true)
	lab.setEndpoint6(t, "fd00:244:1::13", true)
	start := time.Now()
	lab.startRouterProcess(t, "a", routerBGPConfig(""))
	lab.startRouterProcess(t, "b", routerBGPConfig(""))
	t.Logf("bgp6 over IPv4 sessions: both routers started -> IPv6 ECMP in the peer's kernel took %v",
		lab.peer.WaitKernelNextHops(t, vip6, start, 30*time.Second, bgpRouterA6, bgpRouterB6))
	lab.peer.WaitKernelNextHops(t, vip4, start, 30*time.Second, bgpRouterA, bgpRouterB)
	lab.checkRouteSources(t, vip6, "router_a="+bgpRouterA6.String(), "router_b="+bgpRouterB6.String())
	lab.checkRouteSources(t, vip4, "router_a="+bgpRouterA.String(), "router_b="+bgpRouterB.String())

	start = time.Now()
	setAnnotation(t, lab.cs, lab.namespace, "web", ptr(vip4.Addr().String()))
	t.Logf("bgp6 over IPv4 sessions: the Service dropped its IPv6 address -> withdrawn by both in %v", lab.peer.WaitRoutes(t, vip6, 0, start, 20*time.Second))
	if hops, err := lab.peer.KernelNextHops(vip4); err != nil || !slices.Equal(hops, []netip.Addr{bgpRouterA, bgpRouterB}) {
		t.Errorf("IPv4 next hops %v (%v), want both routers", hops, err)
	}
}

// TestBGPWithBFDOverIPv6 pairs GoBGP's BFD with bird's on the IPv6 sessions
// too: when a router's link dies, the peer takes its IPv6 session down by
// BFD, well within the 3 s hold time.
func TestBGPWithBFDOverIPv6(t *testing.T) {
	lab := newBGPLab(t, peerOptions{ipv6: true, bfd: true}, "192.0.2.70", nil)
	lab.setEndpoint(t, "10.244.1.12", true)
	cfg := strings.ReplaceAll(routerBGPConfigDualStack(""), "  connectRetry: 1s\n", "  connectRetry: 1s\n  bfd: {minInterval: 300ms, multiplier: 3}\n")
	start := time.Now()
	lab.startRouterProcess(t, "a", cfg)
	lab.startRouterProcess(t, "b", cfg)
	for _, n := range []string{"router_a6", "router_b6"} {
		t.Logf("bgp6+bfd: session %s established %v after the start", n, lab.peer.WaitEstablished(t, n, start, 30*time.Second))
	}
	bfdUp := bgppeer.Poll(t, start, 20*time.Second, "BFD sessions up at the peer with both routers' IPv6 addresses", func() (bool, string) {
		out, err := lab.peer.Birdc("show", "bfd", "sessions")
		if err != nil {
			return false, err.Error()
		}
		up := 0
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) > 2 && (f[0] == bgpRouterA6.String() || f[0] == bgpRouterB6.String()) && f[2] == "Up" {
				up++
			}
		}
		return up == 2, out
	})
	t.Logf("bgp6+bfd: IPv6 BFD sessions up %v after the start", bfdUp)
	start = time.Now()
	lab.setLink(t, "a", false)
	var state string
	took := bgppeer.Poll(t, start, 20*time.Second, "router a's IPv6 session down", func() (bool, string) {
		var up bool
		var err error
		up, state, err = lab.peer.Established("router_a6")
		return err == nil && !up, state
	})
	t.Logf("bgp6+bfd: router a's link cut (BFD 300ms x 3) -> its IPv6 session down after %v (%s)", took, state)
	if took >= 3*time.Second || !strings.Contains(state, "BFD") {
		t.Errorf("IPv6 session went down after %v with %q, want by BFD before the 3 s hold time", took, state)
	}
}
