package endpoint

import (
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// podAndNode builds a pod namespace whose interface "net1" (deliberately not
// eth0) holds the pod IP, wired by a veth to a node namespace that routes to
// it through "podveth"; the pod's default route points at the node.
func podAndNode(t *testing.T, ip netip.Addr) (pod, node *testnetns.NS) {
	t.Helper()
	pod, node = testnetns.New(t), testnetns.New(t)
	pnl, nnl := pod.Netlink(), node.Netlink()
	if err := pnl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "net1"}, PeerName: "podveth"}); err != nil {
		t.Fatal(err)
	}
	peer, err := pnl.LinkByName("podveth")
	if err != nil {
		t.Fatal(err)
	}
	if err := pnl.LinkSetNsFd(peer, int(node.Handle)); err != nil {
		t.Fatal(err)
	}
	gw := netip.MustParseAddr("169.254.1.1")
	pod.Run("ip", "link", "set", "net1", "up")
	pod.Run("ip", "addr", "add", ip.String()+"/32", "dev", "net1")
	pod.Run("ip", "route", "add", gw.String(), "dev", "net1", "scope", "link")
	pod.Run("ip", "route", "add", "default", "via", gw.String(), "dev", "net1")
	node.Run("ip", "link", "set", "podveth", "up")
	node.Run("ip", "route", "add", ip.String()+"/32", "dev", "podveth")
	_ = nnl
	waitForCarrier(t, pod, "net1")
	return pod, node
}

// waitForCarrier waits until link in ns is operationally up (its veth peer
// too), so that snapshots taken a moment apart do not differ by a carrier
// that came up in between.
func waitForCarrier(t *testing.T, ns *testnetns.NS, link string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		l, err := ns.Netlink().LinkByName(link)
		if err != nil {
			t.Fatal(err)
		}
		if l.Attrs().OperState == netlink.OperUp {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still %v", link, l.Attrs().OperState)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func standInPodNetwork(cfg Config) *PodNetwork {
	return &PodNetwork{cfg: cfg, kind: testnetns.VXLANDecap{}, sysctl: ProcSysctls{}, node: netns.None()}
}

func readSysctl(t *testing.T, ns *testnetns.NS, name string) string {
	t.Helper()
	v, err := ProcSysctls{}.Read(ns.Handle, []string{name})
	if err != nil {
		t.Fatal(err)
	}
	return v[name]
}

// addrsOn lists the IPv4 addresses of a link in ns with their labels.
func addrsOn(t *testing.T, ns *testnetns.NS, link string) []string {
	t.Helper()
	nl := ns.Netlink()
	l, err := nl.LinkByName(link)
	if err != nil {
		return nil
	}
	addrs, err := nl.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range addrs {
		out = append(out, a.IPNet.String()+" "+a.Label)
	}
	slices.Sort(out)
	return out
}

func TestPodNetworkDeviceLifecycle(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.11")
	pod, _ := podAndNode(t, ip)
	cfg := testConfig(encap.GRE)
	pn := standInPodNetwork(cfg)
	w := PodTunnels{Pod: want().Pod, TunnelIPs: []netip.Addr{vip1}}
	w.Pod.IP = ip
	before := addrsOn(t, pod, "net1")

	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(acts) == 0 {
		t.Fatal("first sync made no change")
	}
	link, err := pod.Netlink().LinkByName(cfg.Device)
	if err != nil {
		t.Fatalf("device not created: %v", err)
	}
	if link.Attrs().Alias != DeviceAlias || link.Attrs().Flags&net.FlagUp == 0 {
		t.Fatalf("device alias %q flags %v: want alias %q and up", link.Attrs().Alias, link.Attrs().Flags, DeviceAlias)
	}
	if got := addrsOn(t, pod, cfg.Device); !slices.Equal(got, []string{"192.0.2.10/32 kst-decap"}) {
		t.Fatalf("device addresses = %v", got)
	}
	if v := readSysctl(t, pod, "net/ipv4/conf/kst-decap/rp_filter"); v != "2" {
		t.Fatalf("rp_filter on device = %q, want 2", v)
	}

	// A restarted agent (a new PodNetwork) adopts it without a write.
	if acts, err := standInPodNetwork(cfg).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync after restart: changes %v, err %v; want none", acts, err)
	}

	// Each tunnel IP is added and removed on its own.
	w.TunnelIPs = []netip.Addr{vip1, vip2}
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "add tunnel IP 192.0.2.11 on device" {
		t.Fatalf("adding a second tunnel IP: %q, %v", render(acts), err)
	}
	w.TunnelIPs = []netip.Addr{vip2}
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "remove tunnel IP 192.0.2.10 on device" {
		t.Fatalf("removing one tunnel IP: %q, %v", render(acts), err)
	}
	if got := addrsOn(t, pod, cfg.Device); !slices.Equal(got, []string{"192.0.2.11/32 kst-decap"}) {
		t.Fatalf("device addresses = %v", got)
	}

	// Drift is repaired: an operator deleted the address by hand.
	pod.Run("ip", "addr", "del", "192.0.2.11/32", "dev", cfg.Device)
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "add tunnel IP 192.0.2.11 on device" {
		t.Fatalf("repair: %q, %v", render(acts), err)
	}

	// The last one takes the device with it; the pod's own interface is untouched.
	w.TunnelIPs = nil
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if _, err := pod.Netlink().LinkByName(cfg.Device); err == nil {
		t.Fatal("device still exists after the last tunnel IP went")
	}
	if after := addrsOn(t, pod, "net1"); !slices.Equal(before, after) {
		t.Fatalf("pod interface changed: %v -> %v", before, after)
	}
}

func TestPodNetworkRefusesWrongNamespace(t *testing.T) {
	pod, _ := podAndNode(t, netip.MustParseAddr("198.18.10.21"))
	w := want(vip1)
	w.Pod.IP = netip.MustParseAddr("198.18.10.99") // not this namespace's pod
	_, err := standInPodNetwork(testConfig(encap.GRE)).Sync(pod.Handle, w)
	if err == nil || !strings.Contains(err.Error(), "on no interface") {
		t.Fatalf("err = %v, want a refusal", err)
	}
	if _, err := pod.Netlink().LinkByName(DefaultDevice); err == nil {
		t.Fatal("a device was created in a namespace that does not hold the pod IP")
	}
}

func TestPodNetworkLeavesForeignDeviceAlone(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.31")
	pod, _ := podAndNode(t, ip)
	pod.Run("ip", "link", "add", DefaultDevice, "type", "vxlan", "id", "7", "dstport", "4789")
	pod.Run("ip", "addr", "add", "192.0.2.77/32", "dev", DefaultDevice)
	w := want(vip1)
	w.Pod.IP = ip
	if _, err := standInPodNetwork(testConfig(encap.GRE)).Sync(pod.Handle, w); err == nil || !strings.Contains(err.Error(), "did not create") {
		t.Fatalf("err = %v, want a refusal", err)
	}
	w.TunnelIPs = nil
	if _, err := standInPodNetwork(testConfig(encap.GRE)).Sync(pod.Handle, w); err == nil {
		t.Fatal("cleanup sync touched or ignored a foreign device silently")
	}
	if got := addrsOn(t, pod, DefaultDevice); !slices.Equal(got, []string{"192.0.2.77/32 kst-decap"}) {
		t.Fatalf("foreign device changed: %v", got)
	}
}

// TestPodNetworkLoopbackOwnership checks the mpls-mode addresses on lo: only
// those labelled lo:kst are the agent's. It runs in gre mode (this host has no
// MPLS), where leftovers of mpls mode must be removed.
func TestPodNetworkLoopbackOwnership(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.41")
	pod, _ := podAndNode(t, ip)
	pod.Run("ip", "addr", "add", "192.0.2.10/32", "dev", "lo", "label", LoopbackLabel)
	pod.Run("ip", "addr", "add", "192.0.2.50/32", "dev", "lo") // the pod's own
	w := want()
	w.Pod.IP = ip
	acts, err := standInPodNetwork(testConfig(encap.GRE)).Sync(pod.Handle, w)
	if err != nil || render(acts) != "remove tunnel IP 192.0.2.10 on lo" {
		t.Fatalf("changes %q, err %v", render(acts), err)
	}
	got := addrsOn(t, pod, "lo")
	if !slices.Contains(got, "192.0.2.50/32 lo") || slices.Contains(got, "192.0.2.10/32 "+LoopbackLabel) {
		t.Fatalf("lo addresses = %v: want the pod's own kept and the agent's removed", got)
	}
}

func TestPodNetworkMPLSNeedsKernelSupport(t *testing.T) {
	testnetns.RequireRoot(t)
	if _, err := os.Stat("/proc/sys/net/mpls"); err == nil {
		t.Skip("this kernel has MPLS; the lab tests the mpls datapath")
	}
	ip := netip.MustParseAddr("198.18.10.51")
	pod, _ := podAndNode(t, ip)
	w := want(vip1)
	w.Pod.IP = ip
	_, err := standInPodNetwork(testConfig(encap.MPLS)).Sync(pod.Handle, w)
	if err == nil || !strings.Contains(err.Error(), "CONFIG_MPLS_ROUTING") {
		t.Fatalf("err = %v, want one naming CONFIG_MPLS_ROUTING", err)
	}
	if got := addrsOn(t, pod, "lo"); slices.ContainsFunc(got, func(s string) bool { return strings.HasPrefix(s, "192.0.2.10") }) {
		t.Fatalf("tunnel IP added although the decapsulation path is impossible: %v", got)
	}
}

func TestPodNetworkAdvMSS(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.61")
	pod, _ := podAndNode(t, ip)
	cfg := testConfig(encap.GRE)
	cfg.PodAdvMSS = 1400
	w := want(vip1)
	w.Pod.IP = ip
	if _, err := standInPodNetwork(cfg).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out := pod.Run("ip", "-4", "route", "show", "default"); !strings.Contains(out, "advmss 1400") || !strings.Contains(out, "via 169.254.1.1 dev net1") {
		t.Fatalf("default route = %q, want the same route with advmss 1400", out)
	}
	w.TunnelIPs = nil
	if _, err := standInPodNetwork(cfg).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out := pod.Run("ip", "-4", "route", "show", "default"); strings.Contains(out, "advmss") || !strings.Contains(out, "via 169.254.1.1 dev net1") {
		t.Fatalf("default route = %q, want it back without advmss", out)
	}
}

func TestNodeNetworkSysctls(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.71")
	_, node := podAndNode(t, ip)
	node.Run("sysctl", "-qw", "net.ipv4.conf.podveth.rp_filter=1")
	nn := &NodeNetwork{cfg: testConfig(encap.GRE), ns: node.Handle, sysctl: ProcSysctls{}}
	pt := want(vip1)
	pt.Pod.IP = ip
	acts, err := nn.Sync([]PodTunnels{pt}, netip.Addr{})
	if err != nil {
		t.Fatal(err)
	}
	if len(acts) != 2 {
		t.Fatalf("changes = %v, want ip_forward and rp_filter", acts)
	}
	if v := readSysctl(t, node, "net/ipv4/ip_forward"); v != "1" {
		t.Fatalf("ip_forward = %q", v)
	}
	if v := readSysctl(t, node, "net/ipv4/conf/podveth/rp_filter"); v != "2" {
		t.Fatalf("rp_filter on the pod-facing interface = %q, want 2", v)
	}
	if acts, err := nn.Sync([]PodTunnels{pt}, netip.Addr{}); err != nil || len(acts) != 0 {
		t.Fatalf("second sync: %v, %v; want no change", acts, err)
	}
}

// TestCleanupRemovesOnlyWhatTheAgentOwns: --cleanup's core on two pods' namespaces
// (one served in gre mode with advmss, one holding an mpls-mode lo address)
// with foreign state beside the agent's; afterwards the namespaces are exactly
// as before the agent, the foreign state included.
func TestCleanupRemovesOnlyWhatTheAgentOwns(t *testing.T) {
	ipA, ipB := netip.MustParseAddr("198.18.10.81"), netip.MustParseAddr("198.18.10.82")
	podA, node := podAndNode(t, ipA)
	podB, _ := podAndNode(t, ipB)
	podA.Run("ip", "addr", "add", "192.0.2.60/32", "dev", "lo") // the pod's own
	podB.Run("ip", "link", "add", "other", "type", "veth", "peer", "name", "other2")
	snapshot := func(ns *testnetns.NS) string {
		return ns.Run("ip", "-d", "-4", "addr") + ns.Run("ip", "-4", "route", "show", "table", "all")
	}
	beforeA, beforeB := snapshot(podA), snapshot(podB)

	cfg := testConfig(encap.GRE)
	cfg.PodAdvMSS = 1400
	w := want(vip1, vip2)
	w.Pod.IP = ipA
	if _, err := standInPodNetwork(cfg).Sync(podA.Handle, w); err != nil {
		t.Fatal(err)
	}
	podB.Run("ip", "addr", "add", "192.0.2.10/32", "dev", "lo", "label", LoopbackLabel)
	if snapshot(podA) == beforeA {
		t.Fatal("the agent changed nothing in pod A; the test would prove nothing")
	}

	nss := []runtime.Netns{{Handle: podA.Handle, Path: "podA"}, {Handle: podB.Handle, Path: "podB"}}
	log := logrus.New()
	log.Out = io.Discard
	if err := CleanupNamespaces(cfg, nil, nss, node.Handle, log); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(podA); after != beforeA {
		t.Errorf("pod A after cleanup:\n%s\nbefore:\n%s", after, beforeA)
	}
	if after := snapshot(podB); after != beforeB {
		t.Errorf("pod B after cleanup:\n%s\nbefore:\n%s", after, beforeB)
	}
	if _, err := podB.Netlink().LinkByName("other"); err != nil {
		t.Errorf("foreign device removed: %v", err)
	}
}

func TestPodNetworkPolicyLifecycle(t *testing.T) {
	if _, err := exec.LookPath("iptables-save"); err != nil {
		t.Skip("no iptables-save")
	}
	ip := netip.MustParseAddr("198.18.10.21")
	pod, _ := podAndNode(t, ip)
	pod.Run("iptables", "-A", "INPUT", "-s", "192.0.2.99/32", "-j", "ACCEPT") // the pod's own
	tables := NamespaceIPTables{Binary: "iptables"}
	pn := standInPodNetwork(testConfig(encap.GRE)).WithPolicyTables(tables)
	w := isolated(want(vip1))
	w.Pod.IP = ip

	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(render(acts), "write network policy rules "+w.Policy.Digest+";") {
		t.Fatalf("first sync: %q; want the policy written first", render(acts))
	}
	rules := pod.Run("iptables", "-S")
	for _, s := range []string{"-A INPUT -d 192.0.2.10/32 -m comment --comment kube-service-tunnel -j KST-POLICY", "-A KST-POLICY -d 192.0.2.10/32 -m comment --comment kube-service-tunnel -j DROP"} {
		if !strings.Contains(rules, s) {
			t.Fatalf("the pod's rules lack %q:\n%s", s, rules)
		}
	}
	// A restarted agent adopts the rules without a write.
	if acts, err := standInPodNetwork(testConfig(encap.GRE)).WithPolicyTables(tables).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync after restart: %q, %v; want no change", render(acts), err)
	}
	// A second tunnel IP: the rules are rewritten before it is added.
	w.TunnelIPs = []netip.Addr{vip1, vip2}
	w = isolated(w)
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "write network policy rules "+w.Policy.Digest+"; add tunnel IP 192.0.2.11 on device" {
		t.Fatalf("second tunnel IP: %q, %v", render(acts), err)
	}
	// Drift: someone deleted a jump; it is put back.
	pod.Run("iptables", "-D", "INPUT", "-d", "192.0.2.11/32", "-m", "comment", "--comment", "kube-service-tunnel", "-j", "KST-POLICY")
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "write network policy rules "+w.Policy.Digest {
		t.Fatalf("repairing a deleted jump: %q, %v", render(acts), err)
	}
	if drops, err := pn.PolicyDrops(pod.Handle, false); err != nil || len(drops) != 2 {
		t.Fatalf("PolicyDrops = %v, %v; want a counter for each tunnel IP", drops, err)
	}
	// No longer served: the rules go with the tunnel IPs; the pod's own rule stays.
	w = want()
	w.Pod.IP = ip
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	after := pod.Run("iptables-save")
	if strings.Contains(after, "KST-POLICY") || !strings.Contains(after, "-A INPUT -s 192.0.2.99/32 -j ACCEPT") {
		t.Fatalf("after the last tunnel IP went:\n%s", after)
	}
}

func TestCleanupRemovesPolicyRules(t *testing.T) {
	if _, err := exec.LookPath("iptables-save"); err != nil {
		t.Skip("no iptables-save")
	}
	ip := netip.MustParseAddr("198.18.10.31")
	pod, node := podAndNode(t, ip)
	pod.Run("iptables", "-A", "INPUT", "-s", "192.0.2.99/32", "-j", "ACCEPT")
	before := pod.Run("iptables-save")
	tables := NamespaceIPTables{Binary: "iptables"}
	cfg := testConfig(encap.GRE)
	w := isolated(want(vip1))
	w.Pod.IP = ip
	if _, err := standInPodNetwork(cfg).WithPolicyTables(tables).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.Out = io.Discard
	if err := CleanupNamespaces(cfg, tables, []runtime.Netns{{Handle: pod.Handle, Path: "pod"}}, node.Handle, log); err != nil {
		t.Fatal(err)
	}
	strip := func(s string) string { // iptables-save's header and footer name the time
		var keep []string
		for l := range strings.Lines(s) {
			if !strings.HasPrefix(l, "#") {
				keep = append(keep, l)
			}
		}
		return strings.Join(keep, "")
	}
	if after := pod.Run("iptables-save"); strip(after) != strip(before) {
		t.Errorf("filter table after cleanup:\n%s\nbefore:\n%s", after, before)
	}
}

// The agent's rules go before the decapsulation device and the tunnel IP,
// even for a pod that no policy isolates: a device without the carrier
// guard decapsulates GRE from anyone.
func TestPodNetworkRulesBeforeTheTunnelIP(t *testing.T) {
	if _, err := exec.LookPath("iptables-save"); err != nil {
		t.Skip("no iptables-save")
	}
	ip := netip.MustParseAddr("198.18.10.41")
	pod, _ := podAndNode(t, ip)
	cfg := testConfig(encap.GRE)
	pn := standInPodNetwork(cfg).WithPolicyTables(NamespaceIPTables{Binary: "iptables"})
	w := want(vip1)
	w.Pod.IP = ip
	w.Policy = netpol.Render(netpol.Ingress{}, w.TunnelIPs) // not isolated
	desired := map[string]PodTunnels{"p": w}
	WithGuards(desired, cfg, []netip.Addr{netip.MustParseAddr("198.18.0.1")})
	w = desired["p"]
	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if got := render(acts); !strings.HasPrefix(got, "write carrier guard "+w.Guard.Digest+"; write network policy rules "+w.Policy.Digest+"; create device") {
		t.Fatalf("changes %q: want the guard, then the tracking rule, then the device", got)
	}
	if rules := pod.Run("iptables", "-S"); strings.Contains(rules, "-j KST-POLICY") || !strings.Contains(rules, "-A KST-POLICY -m conntrack --ctstate RELATED,ESTABLISHED") {
		t.Fatalf("want the tracking rule alone, no jump:\n%s", rules)
	}
	if rules := pod.Run("iptables", "-t", "raw", "-S"); !strings.Contains(rules, "-A PREROUTING -m comment --comment \"kube-service-tunnel:"+w.Guard.Digest+"\" -j KST-GUARD") {
		t.Fatalf("want the guard's jump first in PREROUTING:\n%s", rules)
	}
	if acts, err := pn.Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("second sync: %q, %v; want no change", render(acts), err)
	}
}
