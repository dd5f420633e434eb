package endpoint

import (
	"context"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The TestKernel* tests need a kernel with GRE and MPLS routing, which this
// project's hosts lack: test/lab builds this package's test binary and runs
// them inside the lab VM (TestEndpointKernelInVM). Elsewhere they skip.
// Their "ipv6" subtests (ip6gre, IPv6 over MPLS) run with them, so that the
// lab's list of tests needs no new name; they also send traffic through
// the decapsulation path, which only a real ip6gre device and MPLS
// routing can carry.

func requireGREAndMPLS(t *testing.T) {
	t.Helper()
	testnetns.RequireRoot(t)
	if _, err := os.Stat("/proc/sys/net/mpls"); err != nil {
		t.Skip("no MPLS routing in this kernel; runs in the VM lab (test/lab)")
	}
	probe := testnetns.New(t)
	if out, err := probe.Output("ip", "link", "add", "probe", "type", "gre", "local", "10.9.9.9"); err != nil {
		t.Skipf("no GRE in this kernel (%s); runs in the VM lab (test/lab)", strings.TrimSpace(out))
	}
}

func TestKernelGREPod(t *testing.T) {
	requireGREAndMPLS(t)
	ip := netip.MustParseAddr("198.18.10.91")
	pod, node := podAndNode(t, ip)
	forwardLikeAKubernetesPod(pod)
	pn := NewPodNetwork(testConfig(encap.GRE), netns.None())
	w := want(vip1, vip2)
	w.Pod.IP = ip
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	link := pod.Run("ip", "-d", "link", "show", DefaultDevice)
	for _, part := range []string{"gre remote any local 198.18.10.91", "alias " + DeviceAlias, ",UP"} {
		if !strings.Contains(link, part) {
			t.Errorf("device: %q lacks %q", link, part)
		}
	}
	if got := addrsOn(t, pod, DefaultDevice); strings.Join(got, ";") != "192.0.2.10/32 kst-decap;192.0.2.11/32 kst-decap" {
		t.Errorf("device addresses = %v", got)
	}
	if v := readSysctl(t, pod, "net/ipv4/conf/kst-decap/rp_filter"); v != "2" {
		t.Errorf("rp_filter = %q", v)
	}
	node.Run("ip", "addr", "add", nodeIPv4.String()+"/32", "dev", "lo")
	node.Run("ip", "link", "add", "gnode", "type", "gre", "local", nodeIPv4.String(), "remote", ip.String())
	node.Run("ip", "link", "set", "gnode", "up")
	node.Run("ip", "route", "add", strayIP.String()+"/32", "dev", "gnode")
	strayIsDropped(t, pod, node)
	// A restarted agent adopts the real GRE device without a change.
	if acts, err := NewPodNetwork(testConfig(encap.GRE), netns.None()).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change", render(acts), err)
	}
	w.TunnelIPs = nil
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out, err := pod.Output("ip", "link", "show", DefaultDevice); err == nil {
		t.Fatalf("device still there: %s", out)
	}
	t.Run("ipv6", kernelGREPodIPv6)
}

func TestKernelMPLSPod(t *testing.T) {
	requireGREAndMPLS(t)
	ip := netip.MustParseAddr("198.18.10.92")
	pod, node := podAndNode(t, ip)
	forwardLikeAKubernetesPod(pod)
	pod.Run("sysctl", "-qw", "net.ipv4.conf.lo.rp_filter=1")
	cfg := testConfig(encap.MPLS)
	pn := NewPodNetwork(cfg, netns.None())
	w := want(vip1)
	w.Pod.IP = ip
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out := pod.Run("ip", "-f", "mpls", "route", "show"); !strings.Contains(out, "100 dev lo proto 245") {
		t.Errorf("mpls routes = %q, want the pop route", out)
	}
	for name, want := range map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/net1/input": "1", "net/ipv4/conf/lo/rp_filter": "2"} {
		if v := readSysctl(t, pod, name); v != want {
			t.Errorf("%s = %q, want %q", name, v, want)
		}
	}
	if got := addrsOn(t, pod, "lo"); !strings.Contains(strings.Join(got, ";"), "192.0.2.10/32 "+LoopbackLabel) {
		t.Errorf("lo addresses = %v", got)
	}
	if acts, err := NewPodNetwork(cfg, netns.None()).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change", render(acts), err)
	}
	node.Run("ip", "addr", "add", nodeIPv4.String()+"/32", "dev", "lo")
	node.Run("ip", "route", "add", strayIP.String()+"/32", "encap", "mpls", strconv.Itoa(PodLabel), "via", "inet", ip.String(), "dev", "podveth")
	strayIsDropped(t, pod, node)
	w.TunnelIPs = nil
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out := pod.Run("ip", "-f", "mpls", "route", "show"); strings.Contains(out, "100 dev lo") {
		t.Errorf("pop route still there: %q", out)
	}
	t.Run("ipv6", kernelMPLSPodIPv6)
}

func TestKernelMPLSNode(t *testing.T) {
	requireGREAndMPLS(t)
	ip := netip.MustParseAddr("198.18.10.93")
	_, node := podAndNode(t, ip)
	cfg := testConfig(encap.MPLS)
	cfg.MPLSInputInterfaces = []string{"podveth"}
	nn := &NodeNetwork{cfg: cfg, ns: node.Handle, sysctl: ProcSysctls{}}
	pt := want(vip1)
	pt.Pod.IP = ip
	if _, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil {
		t.Fatal(err)
	}
	// label = 1024 + 10*256 + 93
	if out := node.Run("ip", "-f", "mpls", "route", "show"); !strings.Contains(out, "3677 as to 100 via inet 198.18.10.93 dev podveth proto 245") {
		t.Errorf("node mpls routes = %q, want the swap route", out)
	}
	if v := readSysctl(t, node, "net/mpls/platform_labels"); v != strconv.Itoa(mplslabel.PlatformLabels) {
		t.Errorf("platform_labels = %q", v)
	}
	if v := readSysctl(t, node, "net/mpls/conf/podveth/input"); v != "1" {
		t.Errorf("mpls input = %q", v)
	}
	if acts, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change (the swap route must read back as written)", acts, err)
	}
	if _, err := nn.Sync(nil, netip.Addr{}); err != nil {
		t.Fatal(err)
	}
	if out := node.Run("ip", "-f", "mpls", "route", "show"); strings.Contains(out, "3677") {
		t.Errorf("swap route still there: %q", out)
	}
	t.Run("ipv6", kernelMPLSNodeIPv6)
}

// nodeIPv4 is the node's own address the IPv4 tests send from; strayIP is
// an address routed through the pod's decapsulation path that the pod does
// not hold.
var nodeIPv4, strayIP = netip.MustParseAddr("198.18.9.1"), netip.MustParseAddr("192.0.2.99")

// forwardLikeAKubernetesPod turns IPv4 forwarding on in the pod's
// namespace, as a Kubernetes node's pods have it: a new namespace copies
// its creator's IPv4 settings, and nodes forward.
func forwardLikeAKubernetesPod(pod *testnetns.NS) {
	pod.Run("sysctl", "-qw", "net.ipv4.conf.all.forwarding=1")
	pod.Run("sysctl", "-qw", "net.ipv4.conf.default.forwarding=1")
}

// strayIsDropped sends datagrams from the node to strayIP, which the node
// routes into the pod's decapsulation path: the pod receives them and, as
// the agent turned forwarding off where they arrive (see planPod), drops
// them instead of forwarding them to its default gateway (where a real
// node would answer the client with ICMP net unreachable).
func strayIsDropped(t *testing.T, pod, node *testnetns.NS) {
	t.Helper()
	before := ipCounters(t, pod)
	const sent = 5
	if err := node.Do(func() error {
		c, err := net.DialUDP("udp", &net.UDPAddr{IP: nodeIPv4.AsSlice()}, &net.UDPAddr{IP: strayIP.AsSlice(), Port: 9})
		if err != nil {
			return err
		}
		defer c.Close()
		for range sent {
			if _, err := c.Write([]byte("stray")); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	after := ipCounters(t, pod)
	if got := after["InReceives"] - before["InReceives"]; got < sent {
		t.Errorf("the pod received %d of the %d datagrams to %v: the decapsulation path did not carry them", got, sent, strayIP)
	}
	if got := after["ForwDatagrams"] - before["ForwDatagrams"]; got != 0 {
		t.Errorf("the pod forwarded %d datagrams decapsulated for %v, which it does not hold; want them dropped", got, strayIP)
	}
}

// ipCounters reads the Ip: counters of /proc/net/snmp in ns.
func ipCounters(t *testing.T, ns *testnetns.NS) map[string]int64 {
	t.Helper()
	counters, err := testnetns.SNMPTable(ns.Run("cat", "/proc/net/snmp"), "Ip")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := counters["ForwDatagrams"]; !ok {
		t.Fatalf("no Ip: ForwDatagrams in /proc/net/snmp")
	}
	return counters
}

// routerIPv6 is the node's own address the tests' routers send from.
var routerIPv6 = netip.MustParseAddr("fd00:ff::1")

// serveTCP listens on to:port inside ns, accepting and closing
// connections, until the test ends.
func serveTCP(t *testing.T, ns *testnetns.NS, to netip.Addr, port uint16) {
	t.Helper()
	ns.ServeTCP("tcp", netip.AddrPortFrom(to, port), func(c net.Conn) { c.Close() })
}

// connect opens a TCP connection from src to to:port inside ns.
func connect(ns *testnetns.NS, src, to netip.Addr, port uint16) error {
	return ns.Do(func() error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 3 * time.Second}
		c, err := d.DialContext(context.Background(), "tcp", netip.AddrPortFrom(to, port).String())
		if err == nil {
			c.Close()
		}
		return err
	})
}

// kernelGREPodIPv6: a dual-stack pod gets a real ip6gre device with its
// IPv6 address as local address and no remote, which decapsulates GRE over
// IPv6 from a router it was never told about (the node's p2p ip6gre device
// here): a TCP connection from the node to the IPv6 tunnel IP through it
// opens, the pod answering from the tunnel IP by its default route.
func kernelGREPodIPv6(t *testing.T) {
	ip4, ip6 := netip.MustParseAddr("198.18.10.94"), netip.MustParseAddr("fd00:198:18:10::94")
	pod, node := podAndNode6(t, ip4, ip6)
	pn := NewPodNetwork(testConfig(encap.GRE), netns.None())
	w := PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IP: ip4, IPv6: ip6}, TunnelIPs: []netip.Addr{vip1, v6vip1}}
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	link, err := pod.Netlink().LinkByName(DefaultDevice + "6")
	if err != nil {
		t.Fatal(err)
	}
	gre, ok := link.(*netlink.Gretun)
	if !ok || gre.Type() != "ip6gre" || !gre.Local.Equal(ip6.AsSlice()) || !(gre.Remote == nil || gre.Remote.IsUnspecified()) ||
		link.Attrs().Alias != DeviceAlias || link.Attrs().Flags&net.FlagUp == 0 {
		t.Fatalf("IPv6 device: %T %+v; want an ip6gre device, local %v, no remote, alias %s, up\n%s", link, link, ip6, DeviceAlias, pod.Run("ip", "-d", "link", "show", DefaultDevice+"6"))
	}
	if got := addrs6On(t, pod, DefaultDevice+"6"); !slices.Equal(got, []string{"2001:db8::10/128 nodad noprefixroute"}) {
		t.Errorf("IPv6 device addresses = %v", got)
	}
	if acts, err := NewPodNetwork(testConfig(encap.GRE), netns.None()).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change", render(acts), err)
	}

	serveTCP(t, pod, v6vip1, 8080)
	node.Run("ip", "-6", "addr", "add", routerIPv6.String()+"/128", "dev", "lo", "nodad")
	node.Run("ip", "link", "add", "rtr6", "type", "ip6gre", "local", routerIPv6.String(), "remote", ip6.String())
	node.Run("ip", "link", "set", "rtr6", "up")
	node.Run("ip", "-6", "route", "add", v6vip1.String()+"/128", "dev", "rtr6")
	if err := connect(node, routerIPv6, v6vip1, 8080); err != nil {
		t.Fatalf("TCP to [%v]:8080 through GRE over IPv6: %v\npod:\n%s", v6vip1, err, pod.Run("ip", "-s", "link", "show", DefaultDevice+"6"))
	}
	if c, err := pn.DecapCounters(pod.Handle, true); err != nil || c.Packets == 0 {
		t.Errorf("IPv6 device counters %+v, %v; want the decapsulated packets", c, err)
	}

	w.TunnelIPs = []netip.Addr{vip1}
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if _, err := pod.Netlink().LinkByName(DefaultDevice + "6"); err == nil {
		t.Fatal("IPv6 device still there with no IPv6 tunnel IP")
	}
	if _, err := pod.Netlink().LinkByName(DefaultDevice); err != nil {
		t.Fatalf("the IPv4 device went with the IPv6 one: %v", err)
	}
}

// kernelMPLSPodIPv6: in mpls mode the IPv6 tunnel IP is on lo with the
// agent's address protocol, which this kernel keeps (a restart adopts it
// without a write), and the pop route delivers an IPv6 packet labelled 100
// to it: a TCP connection from the node, MPLS-encapsulated to the pod,
// opens.
func kernelMPLSPodIPv6(t *testing.T) {
	ip4, ip6 := netip.MustParseAddr("198.18.10.96"), netip.MustParseAddr("fd00:198:18:10::96")
	pod, node := podAndNode6(t, ip4, ip6)
	pod.Run("ip", "-6", "addr", "add", "fe80::2/64", "dev", "net1", "nodad")
	cfg := testConfig(encap.MPLS)
	w := PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IP: ip4, IPv6: ip6}, TunnelIPs: []netip.Addr{vip1, v6vip1}}
	if _, err := NewPodNetwork(cfg, netns.None()).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if a := loAddrs6(t, pod)[v6vip1]; a.Proto != cfg.RouteProtocol || a.Flags&tunnelIPFlags != tunnelIPFlags {
		t.Fatalf("the IPv6 tunnel IP on lo: %+v; want address protocol %d, nodad, noprefixroute (does this kernel keep IFA_PROTO?)", a, cfg.RouteProtocol)
	}
	if acts, err := NewPodNetwork(cfg, netns.None()).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change", render(acts), err)
	}

	serveTCP(t, pod, v6vip1, 8081)
	node.Run("ip", "-6", "addr", "add", routerIPv6.String()+"/128", "dev", "lo", "nodad")
	node.Run("ip", "-6", "route", "add", v6vip1.String()+"/128", "encap", "mpls", strconv.Itoa(PodLabel), "via", "fe80::2", "dev", "podveth")
	if err := connect(node, routerIPv6, v6vip1, 8081); err != nil {
		t.Fatalf("TCP to [%v]:8081 over MPLS label %d: %v", v6vip1, PodLabel, err)
	}

	w.TunnelIPs = []netip.Addr{vip1}
	if _, err := NewPodNetwork(cfg, netns.None()).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if _, ok := loAddrs6(t, pod)[v6vip1]; ok {
		t.Fatal("the IPv6 tunnel IP is still on lo")
	}
	if out := pod.Run("ip", "-f", "mpls", "route", "show"); !strings.Contains(out, "100 dev lo") {
		t.Errorf("the pop route went with the IPv6 tunnel IP although the IPv4 one is served: %q", out)
	}
}

// kernelMPLSNodeIPv6: the node swaps the label of a pod's IPv6 address to
// 100 via inet6 towards it, reads the route back as written (no change on
// a second sync), and removes it alone when the IPv6 tunnel IP goes.
func kernelMPLSNodeIPv6(t *testing.T) {
	ip4, ip6 := netip.MustParseAddr("198.18.10.95"), netip.MustParseAddr("fd00:198:18:10::93")
	_, node := podAndNode6(t, ip4, ip6)
	cfg := testConfig(encap.MPLS)
	cfg.MPLSInputInterfaces = []string{"podveth"}
	nn := &NodeNetwork{cfg: cfg, ns: node.Handle, sysctl: ProcSysctls{}}
	pt := PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IP: ip4, IPv6: ip6}, TunnelIPs: []netip.Addr{vip1, v6vip1}}
	if _, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil {
		t.Fatal(err)
	}
	label4, label6 := uint32(1024+10*256+95), uint32(mplslabel.Base6+0x93)
	podveth, err := node.Netlink().LinkByName("podveth")
	if err != nil {
		t.Fatal(err)
	}
	routes, err := nn.listRoutes(node.Netlink())
	want := map[uint32]swapRoute{label4: {Label: label4, Pod: ip4, LinkIdx: podveth.Attrs().Index}, label6: {Label: label6, Pod: ip6, LinkIdx: podveth.Attrs().Index}}
	if err != nil || !maps.Equal(routes, want) {
		t.Fatalf("swap routes %v, %v; want %v\n%s", routes, err, want, node.Run("ip", "-f", "mpls", "route", "show"))
	}
	if acts, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %v, %v; want no change (the inet6 swap route must read back as written)", acts, err)
	}
	pt.TunnelIPs = []netip.Addr{vip1}
	if acts, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil || len(acts) != 1 || acts[0].Del != label6 {
		t.Fatalf("IPv6 no longer served: %v, %v; want the IPv6 swap route removed alone", acts, err)
	}
}
