package endpoint

import (
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The TestKernel* tests need a kernel with GRE and MPLS routing, which this
// project's hosts lack: test/lab builds this package's test binary and runs
// them inside the lab VM (TestEndpointKernelInVM). Elsewhere they skip.

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
	pod, _ := podAndNode(t, ip)
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
}

func TestKernelMPLSPod(t *testing.T) {
	requireGREAndMPLS(t)
	ip := netip.MustParseAddr("198.18.10.92")
	pod, _ := podAndNode(t, ip)
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
	w.TunnelIPs = nil
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if out := pod.Run("ip", "-f", "mpls", "route", "show"); strings.Contains(out, "100 dev lo") {
		t.Errorf("pop route still there: %q", out)
	}
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
	if v := readSysctl(t, node, "net/mpls/platform_labels"); v != "66560" {
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
}
