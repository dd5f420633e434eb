package endpoint

// Privileged tests of the IPv6 side on this host's kernel, which has IPv6,
// veth and VXLAN but neither GRE, ip6gre nor MPLS: the decapsulation
// devices are VXLAN stand-ins (vxlanDecap), and mpls mode's lo addresses
// are planned from an observation whose MPLS parts are filled in. The real
// ip6gre device, its decapsulation from any remote and the MPLS pop of an
// IPv6 packet are kernel_test.go's, run in the lab VM.

import (
	"io"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// vxlanDecap stands in for the GRE and ip6gre devices on a host kernel
// without them, as testnetns.VXLANDecap does for IPv4: a VXLAN device with
// the local address of either family (VNI 42 for IPv4, 46 for IPv6).
type vxlanDecap struct{}

func (vxlanDecap) NewLink(name string, local netip.Addr) netlink.Link {
	vni := 42
	if local.Is6() {
		vni = 46
	}
	return &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: name}, VxlanId: vni, SrcAddr: local.AsSlice(), Port: 4789}
}

func (vxlanDecap) Local(l netlink.Link) (netip.Addr, bool) {
	v, ok := l.(*netlink.Vxlan)
	if !ok {
		return netip.Addr{}, false
	}
	if ip4 := v.SrcAddr.To4(); ip4 != nil {
		a, _ := netip.AddrFromSlice(ip4)
		return a, true
	}
	a, _ := netip.AddrFromSlice(v.SrcAddr.To16())
	return a, true
}

// nodeLinkLocal is the node's address on the veth towards the pod, the
// pod's IPv6 gateway (as CNI plugins set it up).
const nodeLinkLocal = "fe80::1"

// podAndNode6 is podAndNode for a pod with an IPv6 address ip6 (/128 on
// net1, default route via fe80::1 on the node's end) and, when ip4 is
// valid, an IPv4 one.
func podAndNode6(t *testing.T, ip4, ip6 netip.Addr) (pod, node *testnetns.NS) {
	t.Helper()
	pod, node = testnetns.New(t), testnetns.New(t)
	pnl := pod.Netlink()
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
	// Without duplicate address detection on the veth, its link-local
	// addresses and their routes are there at once: snapshots of the pod
	// taken a second apart compare equal. The agent's devices keep the
	// namespace's default (detection on).
	for _, side := range []struct {
		ns   *testnetns.NS
		link string
	}{{pod, "net1"}, {node, "podveth"}} {
		if err := (ProcSysctls{}).Write(side.ns.Handle, "net/ipv6/conf/"+side.link+"/accept_dad", "0"); err != nil {
			t.Fatal(err)
		}
	}
	pod.Run("ip", "link", "set", "net1", "up")
	node.Run("ip", "link", "set", "podveth", "up")
	if ip4.IsValid() {
		pod.Run("ip", "addr", "add", ip4.String()+"/32", "dev", "net1")
		pod.Run("ip", "route", "add", "169.254.1.1", "dev", "net1", "scope", "link")
		pod.Run("ip", "route", "add", "default", "via", "169.254.1.1", "dev", "net1")
		node.Run("ip", "route", "add", ip4.String()+"/32", "dev", "podveth")
	}
	pod.Run("ip", "-6", "addr", "add", ip6.String()+"/128", "dev", "net1", "nodad")
	node.Run("ip", "-6", "addr", "add", nodeLinkLocal+"/64", "dev", "podveth", "nodad")
	pod.Run("ip", "-6", "route", "add", "default", "via", nodeLinkLocal, "dev", "net1")
	node.Run("ip", "-6", "route", "add", ip6.String()+"/128", "dev", "podveth")
	waitForCarrier(t, pod, "net1")
	waitForLocalRoute(t, pod, ip6)
	return pod, node
}

// dualStandIn is standInPodNetwork with the stand-in of both families.
func dualStandIn(cfg Config) *PodNetwork {
	return &PodNetwork{cfg: cfg, kind: vxlanDecap{}, sysctl: ProcSysctls{}, node: netns.None()}
}

// addrs6On lists the IPv6 addresses of a link in ns other than link-local
// ones, with ip's flags ("2001:db8::10/128 nodad noprefixroute").
func addrs6On(t *testing.T, ns *testnetns.NS, link string) []string {
	t.Helper()
	if _, err := ns.Netlink().LinkByName(link); err != nil {
		return nil
	}
	var out []string
	for l := range strings.Lines(ns.Run("ip", "-6", "-o", "addr", "show", "dev", link, "scope", "global")) {
		f := strings.Fields(l)
		// "2: kst-decap6    inet6 2001:db8::10/128 scope global nodad noprefixroute \       valid_lft ..."
		for i, w := range f {
			if w == "inet6" && i+1 < len(f) {
				entry := []string{f[i+1]}
				for _, flag := range f[i+2:] {
					if flag == "\\" {
						break
					}
					if flag != "scope" && flag != "global" {
						entry = append(entry, flag)
					}
				}
				out = append(out, strings.Join(entry, " "))
			}
		}
	}
	slices.Sort(out)
	return out
}

// loAddrs6 returns lo's IPv6 addresses in ns with their address protocols.
func loAddrs6(t *testing.T, ns *testnetns.NS) map[netip.Addr]ifAddr {
	t.Helper()
	ac, err := dialAddrs(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	addrs, err := ac.list(unix.AF_INET6)
	if err != nil {
		t.Fatal(err)
	}
	out := map[netip.Addr]ifAddr{}
	for _, a := range addrs {
		if a.LinkIndex == 1 {
			out[a.Prefix.Addr()] = a
		}
	}
	return out
}

// waitForLinkLocal waits until link in ns has a link-local address, which
// the kernel gives an IPv6-capable device once it is up.
func waitForLinkLocal(t *testing.T, ns *testnetns.NS, link string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(ns.Run("ip", "-6", "addr", "show", "dev", link, "scope", "link"), "fe80::") {
		if time.Now().After(deadline) {
			t.Fatalf("%s got no link-local address", link)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitForLocalRoute waits for the local route of an IPv6 address in ns,
// which the kernel installs from its address worker a moment after the
// address (nodad or not).
func waitForLocalRoute(t *testing.T, ns *testnetns.NS, addr netip.Addr) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		local := ns.Run("ip", "-6", "route", "show", "table", "local")
		if strings.Contains(local, "local "+addr.String()+" dev ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no local route for %v:\n%s", addr, local)
		}
	}
}

var (
	testPodIP4 = netip.MustParseAddr("198.18.11.11")
	testPodIP6 = netip.MustParseAddr("fd00:198:18:11::11")
)

// dualWant is the desired state of the test pod with testPodIP4 (when
// dual) and testPodIP6.
func dualWant(dual bool, ips ...netip.Addr) PodTunnels {
	w := PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IPv6: testPodIP6}, TunnelIPs: ips}
	if dual {
		w.Pod.IP = testPodIP4
	}
	return w
}

// TestPodNetworkDualStackDevices: a dual-stack pod gets the device of each
// family, each holding its family's tunnel IPs (IPv6 ones as /128, nodad,
// without prefix route); a restarted agent adopts both, the device's own
// link-local address notwithstanding; each family goes on its own.
func TestPodNetworkDualStackDevices(t *testing.T) {
	pod, _ := podAndNode6(t, testPodIP4, testPodIP6)
	cfg := testConfig(encap.GRE)
	pn := dualStandIn(cfg)
	before := ns6Snapshot(pod, "net1")

	w := dualWant(true, vip1, v6vip1)
	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := render(acts), "create device, local 198.18.11.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; sysctl net/ipv6/conf/kst-decap/disable_ipv6=1; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; "+
		"create IPv6 device, local fd00:198:18:11::11; set IPv6 device alias kube-service-tunnel; set IPv6 device up; add tunnel IP 192.0.2.10 on device; add tunnel IP 2001:db8::10 on IPv6 device"; got != want {
		t.Fatalf("first sync:\n got  %s\n want %s", got, want)
	}
	for _, name := range []string{DefaultDevice, DefaultDevice + "6"} {
		link, err := pod.Netlink().LinkByName(name)
		if err != nil {
			t.Fatalf("device %s not created: %v", name, err)
		}
		if link.Attrs().Alias != DeviceAlias || link.Attrs().Flags&net.FlagUp == 0 {
			t.Fatalf("%s: alias %q flags %v, want alias %q and up", name, link.Attrs().Alias, link.Attrs().Flags, DeviceAlias)
		}
	}
	if got := addrs6On(t, pod, "kst-decap6"); !slices.Equal(got, []string{"2001:db8::10/128 nodad noprefixroute"}) {
		t.Fatalf("IPv6 device addresses = %v, want the tunnel IP alone, nodad (not tentative) and noprefixroute", got)
	}
	if got := addrsOn(t, pod, DefaultDevice); !slices.Equal(got, []string{"192.0.2.10/32 kst-decap"}) {
		t.Fatalf("IPv4 device addresses = %v", got)
	}
	if main := pod.Run("ip", "-6", "route", "show", "table", "main"); strings.Contains(main, "2001:db8::10") {
		t.Errorf("a prefix route came with the tunnel IP:\n%s", main)
	}

	// A restarted agent adopts both without a write, once the kernel has
	// given the IPv6 device its link-local address too.
	waitForLinkLocal(t, pod, "kst-decap6")
	if acts, err := dualStandIn(cfg).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync after restart: %q, %v; want no change", render(acts), err)
	}
	// Drift is repaired on the IPv6 device as on the IPv4 one.
	pod.Run("ip", "-6", "addr", "del", "2001:db8::10/128", "dev", "kst-decap6")
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "add tunnel IP 2001:db8::10 on IPv6 device" {
		t.Fatalf("repair: %q, %v", render(acts), err)
	}
	// The IPv6 tunnel IP goes, and its device with it; IPv4 is untouched.
	w.TunnelIPs = []netip.Addr{vip1}
	if acts, err := pn.Sync(pod.Handle, w); err != nil || render(acts) != "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device" {
		t.Fatalf("IPv6 no longer served: %q, %v", render(acts), err)
	}
	if _, err := pod.Netlink().LinkByName("kst-decap6"); err == nil {
		t.Fatal("the IPv6 device is still there")
	}
	if got := addrsOn(t, pod, DefaultDevice); !slices.Equal(got, []string{"192.0.2.10/32 kst-decap"}) {
		t.Fatalf("IPv4 device addresses = %v after the IPv6 side went", got)
	}
	// And back, then nothing.
	w.TunnelIPs = []netip.Addr{vip1, v6vip1}
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	w.TunnelIPs = nil
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{DefaultDevice, DefaultDevice + "6"} {
		if _, err := pod.Netlink().LinkByName(name); err == nil {
			t.Errorf("device %s still there with nothing served", name)
		}
	}
	if after := ns6Snapshot(pod, "net1"); after != before {
		t.Errorf("the pod's interface changed:\n%s\nbefore:\n%s", after, before)
	}
}

// ns6Snapshot is the global addresses of link and the routes of every
// table, of both families, in ns; the routes of link-local addresses,
// which the kernel installs when it gets to it, are left out.
func ns6Snapshot(ns *testnetns.NS, link string) string {
	var b strings.Builder
	for _, args := range [][]string{
		{"-o", "addr", "show", "dev", link, "scope", "global"},
		{"route", "show", "table", "all"},
		{"-6", "route", "show", "table", "all"},
	} {
		out, _ := ns.Output("ip", args...)
		for l := range strings.Lines(out) {
			if !strings.Contains(l, "fe80:") {
				b.WriteString(l)
			}
		}
	}
	return b.String()
}

// TestPodNetworkIPv6OnlyPod: an IPv6-only pod gets the IPv6 device alone,
// and a namespace that does not hold the pod's IPv6 address is refused
// untouched.
func TestPodNetworkIPv6OnlyPod(t *testing.T) {
	pod, _ := podAndNode6(t, netip.Addr{}, testPodIP6)
	pn := dualStandIn(testConfig(encap.GRE))
	wrong := dualWant(false, v6vip1)
	wrong.Pod.IPv6 = netip.MustParseAddr("fd00:198:18:11::99")
	if _, err := pn.Sync(pod.Handle, wrong); err == nil || !strings.Contains(err.Error(), "on no interface") {
		t.Fatalf("err = %v, want a refusal", err)
	}
	if _, err := pod.Netlink().LinkByName("kst-decap6"); err == nil {
		t.Fatal("a device was created in a namespace that does not hold the pod's IPv6 address")
	}
	w := dualWant(false, v6vip1)
	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := render(acts), "create IPv6 device, local fd00:198:18:11::11; set IPv6 device alias kube-service-tunnel; set IPv6 device up; add tunnel IP 2001:db8::10 on IPv6 device"; got != want {
		t.Fatalf("sync:\n got  %s\n want %s", got, want)
	}
	if _, err := pod.Netlink().LinkByName(DefaultDevice); err == nil {
		t.Fatal("an IPv4 device was created for an IPv6-only pod")
	}
	if acts, err := dualStandIn(testConfig(encap.GRE)).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync after restart: %q, %v; want no change", render(acts), err)
	}
}

// TestPodNetworkIPv6DeviceInANamespaceWithoutIPv6ByDefault: a pod whose
// new devices start with IPv6 disabled gets it enabled on the IPv6 device
// alone, which then holds the tunnel IP; the namespace's default and the
// other interfaces are left as they were.
func TestPodNetworkIPv6DeviceInANamespaceWithoutIPv6ByDefault(t *testing.T) {
	pod, _ := podAndNode6(t, testPodIP4, testPodIP6)
	pod.Run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
	acts, err := dualStandIn(testConfig(encap.GRE)).Sync(pod.Handle, dualWant(true, v6vip1))
	if err != nil {
		t.Fatalf("%v (changes made: %q)", err, render(acts))
	}
	if !strings.Contains(render(acts), "sysctl net/ipv6/conf/kst-decap6/disable_ipv6=0; set IPv6 device up; add tunnel IP 2001:db8::10 on IPv6 device") {
		t.Fatalf("changes %q: want IPv6 enabled on the device before its tunnel IP", render(acts))
	}
	for name, want := range map[string]string{"net/ipv6/conf/kst-decap6/disable_ipv6": "0", "net/ipv6/conf/default/disable_ipv6": "1", "net/ipv6/conf/net1/disable_ipv6": "0", "net/ipv6/conf/lo/disable_ipv6": "0"} {
		if v := readSysctl(t, pod, name); v != want {
			t.Errorf("%s = %q, want %q", name, v, want)
		}
	}
	if got := addrs6On(t, pod, "kst-decap6"); !slices.Equal(got, []string{"2001:db8::10/128 nodad noprefixroute"}) {
		t.Fatalf("IPv6 device addresses = %v", got)
	}
}

// TestPodNetworkIPv6LoopbackOwnership: mpls mode's IPv6 tunnel IPs on lo
// carry the agent's address protocol; lo's other IPv6 addresses (::1,
// someone's own, someone's equal to a tunnel IP) are never touched nor
// served. This host has no MPLS, so the MPLS parts of what observe reads
// (the pop route, MPLS sysctls) are filled in; the addresses and lo's
// sysctls are the kernel's.
func TestPodNetworkIPv6LoopbackOwnership(t *testing.T) {
	pod, _ := podAndNode6(t, testPodIP4, testPodIP6)
	// An lo without IPv6 (no ::1 either) must get it back to hold the tunnel IP.
	pod.Run("sysctl", "-qw", "net.ipv6.conf.lo.disable_ipv6=1")
	mplsCfg := testConfig(encap.MPLS)
	mpls := dualStandIn(mplsCfg)
	// observeMPLS observes as the agent does in mpls mode, but for MPLS.
	observeMPLS := func() (*podConn, podState) {
		t.Helper()
		c, err := openPodConn(pod.Handle)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		have, err := dualStandIn(testConfig(encap.GRE)).observe(c, dualWant(true).Pod, false)
		if err != nil {
			t.Fatal(err)
		}
		have.Sysctls, err = ProcSysctls{}.Read(pod.Handle, podSysctls(mplsCfg, have, true))
		if err != nil {
			t.Fatal(err)
		}
		have.PopRoute = true
		have.Sysctls["net/mpls/platform_labels"], have.Sysctls["net/mpls/conf/net1/input"] = "101", "1"
		return c, have
	}
	w := dualWant(true, v6vip1)
	c, have := observeMPLS()
	acts, err := mpls.planAndApply(c, w, have, true)
	if err != nil || render(acts) != "sysctl net/ipv6/conf/lo/disable_ipv6=0; add tunnel IP 2001:db8::10 on lo" {
		t.Fatalf("first sync: %q, %v", render(acts), err)
	}
	lo := loAddrs6(t, pod)
	if a := lo[v6vip1]; a.Proto != encap.DefaultRouteProtocol || a.Flags&tunnelIPFlags != tunnelIPFlags || a.Prefix.Bits() != 128 {
		t.Fatalf("the tunnel IP on lo: %+v, want /128 with address protocol %d, nodad and noprefixroute", a, encap.DefaultRouteProtocol)
	}
	if _, ok := lo[netip.IPv6Loopback()]; !ok {
		t.Errorf("::1 did not come back with IPv6 on lo: %v", lo)
	}
	pod.Run("ip", "-6", "addr", "add", "2001:db8::50/128", "dev", "lo") // the pod's own
	c, have = observeMPLS()
	if acts, err := mpls.planAndApply(c, w, have, true); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %q, %v; want no change (adoption)", render(acts), err)
	}

	// Someone else's address equal to a tunnel IP is neither served nor touched.
	pod.Run("ip", "-6", "addr", "add", "2001:db8::11/128", "dev", "lo")
	w.TunnelIPs = []netip.Addr{v6vip1, v6vip2}
	c, have = observeMPLS()
	if acts, err := mpls.planAndApply(c, w, have, true); err == nil || !strings.Contains(err.Error(), "without kube-service-tunnel's address protocol") {
		t.Fatalf("%q, %v; want a refusal naming the address protocol", render(acts), err)
	}

	// In gre mode, mpls mode's lo addresses are leftovers: the agent's go,
	// the others stay.
	w.TunnelIPs = nil
	acts, err = dualStandIn(testConfig(encap.GRE)).Sync(pod.Handle, w)
	if err != nil || render(acts) != "remove tunnel IP 2001:db8::10 on lo" {
		t.Fatalf("gre mode, nothing served: %q, %v", render(acts), err)
	}
	lo = loAddrs6(t, pod)
	var left []string
	for ip, a := range lo {
		left = append(left, ip.String())
		if a.Proto == encap.DefaultRouteProtocol {
			t.Errorf("%v still carries the agent's protocol", ip)
		}
	}
	slices.Sort(left)
	if strings.Join(left, " ") != "2001:db8::11 2001:db8::50 ::1" {
		t.Errorf("lo's IPv6 addresses = %v, want ::1 and the pod's own two", left)
	}
}

// TestPodNetworkIPv6AdvMSS: the IPv6 default route of a pod serving an
// IPv6 tunnel IP gets the IPv6 advmss (40 bytes less than --pod-advmss in
// gre mode), the IPv4 one the IPv4 value; each goes with its family's last
// tunnel IP, and a value someone else set stays.
func TestPodNetworkIPv6AdvMSS(t *testing.T) {
	pod, _ := podAndNode6(t, testPodIP4, testPodIP6)
	cfg := testConfig(encap.GRE)
	cfg.PodAdvMSS = 1400
	pn := dualStandIn(cfg)
	route6 := func() string { return pod.Run("ip", "-6", "route", "show", "default") }
	route4 := func() string { return pod.Run("ip", "-4", "route", "show", "default") }
	w := dualWant(true, vip1, v6vip1)
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if r := route6(); !strings.Contains(r, "advmss 1360") || !strings.Contains(r, "via fe80::1 dev net1") {
		t.Fatalf("IPv6 default route = %q, want the same route with advmss 1360", r)
	}
	if r := route4(); !strings.Contains(r, "advmss 1400") {
		t.Fatalf("IPv4 default route = %q, want advmss 1400", r)
	}
	if acts, err := dualStandIn(cfg).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync: %q, %v; want no change", render(acts), err)
	}
	w.TunnelIPs = []netip.Addr{vip1}
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	if r := route6(); strings.Contains(r, "advmss") || !strings.Contains(r, "via fe80::1 dev net1") {
		t.Fatalf("IPv6 default route = %q, want it back without advmss", r)
	}
	if r := route4(); !strings.Contains(r, "advmss 1400") {
		t.Fatalf("IPv4 default route = %q, want advmss 1400 kept", r)
	}
	// Someone else's IPv6 advmss is theirs, served or not.
	pod.Run("ip", "-6", "route", "change", "default", "via", nodeLinkLocal, "dev", "net1", "advmss", "1300")
	for _, ips := range [][]netip.Addr{{vip1, v6vip1}, {vip1}} {
		w.TunnelIPs = ips
		if _, err := pn.Sync(pod.Handle, w); err != nil {
			t.Fatal(err)
		}
		if r := route6(); !strings.Contains(r, "advmss 1300") {
			t.Fatalf("serving %v: IPv6 default route = %q, want someone else's advmss 1300 kept", ips, r)
		}
	}
}

// TestPodNetworkIPv6PolicyLifecycle: an isolated dual-stack pod's rules
// are written to both filter tables, each with its family's tunnel IPs
// and sources, before the tunnel IPs; a restart adopts them; the IPv6
// rules go after the IPv6 tunnel IP, and the IPv4 table is not touched.
func TestPodNetworkIPv6PolicyLifecycle(t *testing.T) {
	for _, cmd := range []string{"iptables-save", "ip6tables-save", "ip6tables-restore"} {
		if _, err := exec.LookPath(cmd); err != nil {
			t.Skipf("no %s", cmd)
		}
	}
	pod, _ := podAndNode6(t, testPodIP4, testPodIP6)
	pod.Run("ip6tables", "-A", "INPUT", "-s", "2001:db8:99::1/128", "-j", "ACCEPT") // the pod's own
	tables := NamespaceIPTables{Binary: "iptables"}
	pn := dualStandIn(testConfig(encap.GRE)).WithPolicyTables(tables)
	in := netpol.Ingress{Isolated: true, Rules: []netpol.Rule{{AllPorts: true, Sources: []netpol.Source{
		{Prefix: netip.MustParsePrefix("203.0.113.0/24")}, {Prefix: netip.MustParsePrefix("2001:db8:77::/48")}}}}}
	withPolicy := func(w PodTunnels) PodTunnels {
		w.Policy, w.Policy6 = netpol.Render(in, w.TunnelIPsOf(false)), netpol.Render(in, w.TunnelIPsOf(true))
		return w
	}
	w := withPolicy(dualWant(true, vip1, v6vip1))
	acts, err := pn.Sync(pod.Handle, w)
	if err != nil {
		t.Fatal(err)
	}
	if want := "write network policy rules " + w.Policy.Digest + "; write IPv6 network policy rules " + w.Policy6.Digest + "; "; !strings.HasPrefix(render(acts), want) {
		t.Fatalf("first sync: %q; want the rules of both families first", render(acts))
	}
	rules6, rules4 := pod.Run("ip6tables", "-S"), pod.Run("iptables", "-S")
	for _, s := range []string{
		"-A INPUT -d 2001:db8::10/128 -m comment --comment kube-service-tunnel -j KST-POLICY",
		"-A KST-POLICY -s 2001:db8:77::/48 -m comment --comment kube-service-tunnel -j ACCEPT",
		"-A KST-POLICY -d 2001:db8::10/128 -m comment --comment kube-service-tunnel -j DROP",
	} {
		if !strings.Contains(rules6, s) {
			t.Errorf("the pod's IPv6 rules lack %q:\n%s", s, rules6)
		}
	}
	if strings.Contains(rules6, "203.0.113.0") || strings.Contains(rules4, "2001:db8") || !strings.Contains(rules4, "-s 203.0.113.0/24") {
		t.Errorf("a family's sources in the other's table:\nIPv4:\n%s\nIPv6:\n%s", rules4, rules6)
	}
	if acts, err := dualStandIn(testConfig(encap.GRE)).WithPolicyTables(tables).Sync(pod.Handle, w); err != nil || len(acts) != 0 {
		t.Fatalf("re-sync after restart: %q, %v; want no change", render(acts), err)
	}
	if drops, err := pn.PolicyDrops(pod.Handle, true); err != nil || len(drops) != 1 {
		t.Fatalf("PolicyDrops(IPv6) = %v, %v; want the IPv6 tunnel IP's counter", drops, err)
	} else if _, ok := drops[v6vip1]; !ok {
		t.Fatalf("PolicyDrops(IPv6) = %v, want %v", drops, v6vip1)
	}
	before4 := pod.Run("iptables-save")
	w = withPolicy(dualWant(true, vip1))
	acts, err = pn.Sync(pod.Handle, w)
	if err != nil || render(acts) != "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device; remove IPv6 network policy rules" {
		t.Fatalf("IPv6 no longer served: %q, %v", render(acts), err)
	}
	after6 := pod.Run("ip6tables-save")
	if strings.Contains(after6, "KST-POLICY") || !strings.Contains(after6, "-A INPUT -s 2001:db8:99::1/128 -j ACCEPT") {
		t.Errorf("IPv6 table after the IPv6 tunnel IP went:\n%s", after6)
	}
	if after4 := pod.Run("iptables-save"); stripSaveComments(after4) != stripSaveComments(before4) {
		t.Errorf("the IPv4 table changed:\n%s\nbefore:\n%s", after4, before4)
	}
}

// stripSaveComments drops iptables-save's header and footer, which name
// the time.
func stripSaveComments(s string) string {
	var keep []string
	for l := range strings.Lines(s) {
		if !strings.HasPrefix(l, "#") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "")
}

// TestCleanupRemovesIPv6State: --cleanup's core on a dual-stack pod served
// in gre mode (IPv6 device, advmss, rules in both tables) that also holds
// an mpls-mode IPv6 lo address, beside the pod's own IPv6 state; afterwards
// the namespace is exactly as before the agent.
func TestCleanupRemovesIPv6State(t *testing.T) {
	for _, cmd := range []string{"iptables-save", "ip6tables-save"} {
		if _, err := exec.LookPath(cmd); err != nil {
			t.Skipf("no %s", cmd)
		}
	}
	pod, node := podAndNode6(t, testPodIP4, testPodIP6)
	pod.Run("ip", "-6", "addr", "add", "2001:db8::50/128", "dev", "lo", "nodad")
	waitForLocalRoute(t, pod, netip.MustParseAddr("2001:db8::50"))
	// The pod's own rules: a table the agent creates stays, empty (as with
	// IPv4 alone).
	pod.Run("ip6tables", "-A", "INPUT", "-s", "2001:db8:99::1/128", "-j", "ACCEPT")
	pod.Run("iptables", "-A", "INPUT", "-s", "192.0.2.99/32", "-j", "ACCEPT")
	snapshot := func() string {
		return ns6Snapshot(pod, "lo") + ns6Snapshot(pod, "net1") + stripSaveComments(pod.Run("ip6tables-save")) + stripSaveComments(pod.Run("iptables-save"))
	}
	before := snapshot()

	cfg := testConfig(encap.GRE)
	cfg.PodAdvMSS = 1400
	tables := NamespaceIPTables{Binary: "iptables"}
	w := isolated(dualWant(true, vip1, v6vip1))
	if _, err := dualStandIn(cfg).WithPolicyTables(tables).Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}
	c, err := openPodConn(pod.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := dualStandIn(testConfig(encap.MPLS)).apply(c, PodChange{Kind: actAddTunnelIP, Addr: v6vip2, Loopback: true}); err != nil {
		t.Fatal(err)
	}
	if snapshot() == before {
		t.Fatal("the agent changed nothing; the test would prove nothing")
	}
	log := logrus.New()
	log.Out = io.Discard
	pn := dualStandIn(cfg).WithPolicyTables(tables)
	acts, err := pn.Cleanup(pod.Handle)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"remove tunnel IP 2001:db8::11 on lo", "delete IPv6 device", "IPv6 default route advmss 0", "remove IPv6 network policy rules"} {
		if !strings.Contains(render(acts), want) {
			t.Errorf("cleanup %q lacks %q", render(acts), want)
		}
	}
	if err := CleanupNamespaces(cfg, tables, []runtime.Netns{{Handle: pod.Handle, Path: "pod"}}, node.Handle, log); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(); after != before {
		t.Errorf("after cleanup:\n%s\nbefore:\n%s", after, before)
	}
}

// TestNodeNetworkIPv6Forwarding: in gre mode the node must forward IPv6
// for its pods' IPv6 tunnel IPs; the agent reports when it does not and
// never turns it on, and pods served on IPv6 alone need no IPv4
// forwarding.
func TestNodeNetworkIPv6Forwarding(t *testing.T) {
	_, node := podAndNode6(t, netip.Addr{}, testPodIP6)
	node.Run("sysctl", "-qw", "net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0")
	nn := &NodeNetwork{cfg: testConfig(encap.GRE), ns: node.Handle, sysctl: ProcSysctls{}}
	served := []PodTunnels{dualWant(false, v6vip1)}
	acts, err := nn.Sync(served, netip.Addr{})
	if err == nil || !strings.Contains(err.Error(), "net.ipv6.conf.all.forwarding") || len(acts) != 0 {
		t.Fatalf("changes %v, err %v; want none and an error naming the sysctl", acts, err)
	}
	for name, want := range map[string]string{"net/ipv6/conf/all/forwarding": "0", "net/ipv4/ip_forward": "0"} {
		if v := readSysctl(t, node, name); v != want {
			t.Errorf("%s = %q, want %q (untouched)", name, v, want)
		}
	}
	node.Run("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
	if acts, err := nn.Sync(served, netip.Addr{}); err != nil || len(acts) != 0 {
		t.Fatalf("with IPv6 forwarding on: %v, %v; want nothing to do", acts, err)
	}
}
