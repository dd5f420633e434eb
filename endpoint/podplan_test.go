package endpoint

import (
	"errors"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/bridgeguard"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/replyexempt"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

var (
	podIP  = netip.MustParseAddr("10.1.0.11")
	podIP6 = netip.MustParseAddr("fd00:10:1::11")
	vip1   = netip.MustParseAddr("192.0.2.10")
	vip2   = netip.MustParseAddr("192.0.2.11")
)

func testConfig(mode encap.Mode) Config {
	return Config{Mode: mode, NodeName: "n1", Device: DefaultDevice, RouteProtocol: encap.DefaultRouteProtocol, Workers: 1,
		Policy: tunnelclaim.Policy{Pools: testPools}}
}

func want(ips ...netip.Addr) PodTunnels {
	return PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IP: podIP}, TunnelIPs: ips}
}

// want6 is want for a dual-stack pod (podIP and podIP6).
func want6(ips ...netip.Addr) PodTunnels {
	w := want(ips...)
	w.Pod.IPv6 = podIP6
	return w
}

// wantOnly6 is want for an IPv6-only pod (podIP6).
func wantOnly6(ips ...netip.Addr) PodTunnels {
	w := want6(ips...)
	w.Pod.IP = netip.Addr{}
	return w
}

func render(acts []PodChange) string {
	var s []string
	for _, a := range acts {
		s = append(s, a.String())
	}
	return strings.Join(s, "; ")
}

func TestPlanPod(t *testing.T) {
	greReady := podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true}, DeviceIPs: []netip.Addr{vip1},
		Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2", "net/ipv4/conf/kst-decap/forwarding": "0"}}
	mplsReady := podState{PodLink: "eth0", LoopbackIPs: []netip.Addr{vip1}, PopRoute: true,
		Sysctls: map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "2", "net/ipv4/conf/lo/forwarding": "0"}}
	for _, tc := range []struct {
		name   string
		mode   encap.Mode
		advmss int
		want   PodTunnels
		have   podState
		plan   string
	}{
		{name: "gre: fresh pod", mode: encap.GRE, want: want(vip1), have: podState{PodLink: "eth0"},
			plan: "create device, local 10.1.0.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "gre: already right means no change (adoption)", mode: encap.GRE, want: want(vip1), have: greReady, plan: ""},
		{name: "gre: second tunnel IP added on its own", mode: encap.GRE, want: want(vip1, vip2), have: greReady,
			plan: "add tunnel IP 192.0.2.11 on device"},
		{name: "gre: one of two removed keeps the device", mode: encap.GRE, want: want(vip2),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true}, DeviceIPs: []netip.Addr{vip1, vip2},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2", "net/ipv4/conf/kst-decap/forwarding": "0"}},
			plan: "remove tunnel IP 192.0.2.10 on device"},
		{name: "gre: last removed deletes the device after the address", mode: encap.GRE, want: want(), have: greReady,
			plan: "remove tunnel IP 192.0.2.10 on device; delete device"},
		{name: "gre: device down and rp_filter drifted are repaired", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP}, DeviceIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "1", "net/ipv4/conf/kst-decap/forwarding": "0"}},
			plan: "set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2"},
		{name: "gre: device with an old local address is recreated", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: netip.MustParseAddr("10.1.0.99"), Up: true}, DeviceIPs: []netip.Addr{vip1}},
			plan: "delete device; create device, local 10.1.0.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "gre: a device left unmarked by a crash between creation and alias is adopted", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true, Unmarked: true}, DeviceIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2", "net/ipv4/conf/kst-decap/forwarding": "0"}},
			plan: "set device alias kube-service-tunnel"},
		{name: "gre: a device that forwards (made by an older agent) stops", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true}, DeviceIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2", "net/ipv4/conf/kst-decap/forwarding": "1"}},
			plan: "sysctl net/ipv4/conf/kst-decap/forwarding=0"},
		{name: "mpls: a pod whose lo forwards (served by an older agent) stops", mode: encap.MPLS, want: want(vip1),
			have: podState{PodLink: "eth0", PopRoute: true, LoopbackIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "2", "net/ipv4/conf/lo/forwarding": "1"}},
			plan: "sysctl net/ipv4/conf/lo/forwarding=0"},
		{name: "nothing wanted, nothing there", mode: encap.GRE, want: want(), have: podState{PodLink: "eth0"}, plan: ""},
		{name: "mpls: fresh pod, strict rp_filter", mode: encap.MPLS, want: want(vip1),
			have: podState{PodLink: "net1", Sysctls: map[string]string{"net/mpls/platform_labels": "0", "net/ipv4/conf/lo/rp_filter": "1"}},
			plan: "sysctl net/mpls/platform_labels=101; sysctl net/mpls/conf/net1/input=1; sysctl net/ipv4/conf/lo/rp_filter=2; sysctl net/ipv4/conf/lo/forwarding=0; add mpls route 100 dev lo; add tunnel IP 192.0.2.10 on lo"},
		{name: "mpls: rp_filter off and large platform_labels are left alone", mode: encap.MPLS, want: want(vip1),
			have: podState{PodLink: "eth0", PopRoute: true, LoopbackIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/mpls/platform_labels": "100000", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "0", "net/ipv4/conf/lo/forwarding": "0"}},
			plan: ""},
		{name: "mpls: already right", mode: encap.MPLS, want: want(vip1), have: mplsReady, plan: ""},
		{name: "mpls: last removed drops address then pop route", mode: encap.MPLS, want: want(), have: mplsReady,
			plan: "remove tunnel IP 192.0.2.10 on lo; remove mpls route 100 dev lo"},
		{name: "mode changed to gre: mpls leftovers go", mode: encap.GRE, want: want(vip1), have: mplsReady,
			plan: "remove tunnel IP 192.0.2.10 on lo; remove mpls route 100 dev lo; create device, local 10.1.0.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "advmss set when serving", mode: encap.GRE, advmss: 1400, want: want(vip1),
			have: func() podState { s := greReady; s.DefaultRoute = true; return s }(), plan: "default route advmss 1400"},
		{name: "advmss someone else set is left alone", mode: encap.GRE, advmss: 1400, want: want(vip1),
			have: func() podState { s := greReady; s.DefaultRoute, s.AdvMSS = true, 1300; return s }(), plan: ""},
		{name: "advmss removed with the last tunnel IP", mode: encap.GRE, advmss: 1400, want: want(),
			have: func() podState { s := greReady; s.DefaultRoute, s.AdvMSS = true, 1400; return s }(),
			plan: "remove tunnel IP 192.0.2.10 on device; delete device; default route advmss 0"},
		{name: "gre: an isolated pod gets its policy before its tunnel IP", mode: encap.GRE, want: isolated(want(vip1)), have: podState{PodLink: "eth0", TablesRead: true},
			plan: "write network policy rules " + isolated(want(vip1)).Policy.Digest + "; create device, local 10.1.0.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "gre: isolated and right: nothing", mode: encap.GRE, want: isolated(want(vip1)),
			have: func() podState {
				s := greReady
				s.TablesRead, s.Policy = true, observed(isolated(want(vip1)).Policy)
				return s
			}(), plan: ""},
		{name: "mpls: the last tunnel IP goes before its policy", mode: encap.MPLS, want: want(),
			have: func() podState {
				s := mplsReady
				s.TablesRead, s.Policy = true, observed(isolated(want(vip1)).Policy)
				return s
			}(),
			plan: "remove tunnel IP 192.0.2.10 on lo; remove mpls route 100 dev lo; remove network policy rules"},
		{name: "no longer isolated: rules removed, tunnel IP kept", mode: encap.GRE, want: want(vip1),
			have: func() podState {
				s := greReady
				s.TablesRead, s.Policy = true, observed(isolated(want(vip1)).Policy)
				return s
			}(),
			plan: "remove network policy rules"},
		{name: "unreadable filter table of a pod no policy isolates: ignored", mode: encap.GRE, want: want(vip1),
			have: func() podState { s := greReady; s.TablesRead, s.PolicyErr = true, errors.New("no iptables"); return s }(), plan: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(tc.mode)
			cfg.PodAdvMSS = tc.advmss
			acts, err := planPod(cfg, tc.want, tc.have)
			if err != nil {
				t.Fatal(err)
			}
			if got := render(acts); got != tc.plan {
				t.Errorf("plan:\n got  %s\n want %s", got, tc.plan)
			}
		})
	}
}

// isolated gives w a deny-all policy, for the tunnel IPs of each family.
func isolated(w PodTunnels) PodTunnels {
	w.Policy = netpol.Render(netpol.Ingress{Isolated: true}, w.TunnelIPsOf(false))
	w.Policy6 = netpol.Render(netpol.Ingress{Isolated: true}, w.TunnelIPsOf(true))
	return w
}

// observed is what a filter table holding r reads as.
func observed(r *netpol.Rules) netpol.Observed {
	o := netpol.Observed{Counts: r.Counts, Digest: r.Digest}
	for _, vip := range r.VIPs {
		o.Jumps = append(o.Jumps, netpol.ObservedJump{VIP: vip, Spec: strings.Join(netpol.Jump(vip), " ")})
	}
	return o
}

func TestPlanPodFailsClosedOnAnUnreadableFilterTable(t *testing.T) {
	have := podState{PodLink: "eth0", TablesRead: true, PolicyErr: errors.New("iptables-save: not found")}
	acts, err := planPod(testConfig(encap.GRE), isolated(want(vip1)), have)
	if err == nil || !strings.Contains(err.Error(), "network policy") {
		t.Fatalf("plan %q, err %v: want an error, and no tunnel IP served unfiltered", render(acts), err)
	}
}

func TestPlanPodRefusesForeignDevice(t *testing.T) {
	_, err := planPod(testConfig(encap.GRE), want(), podState{PodLink: "eth0", ForeignDevice: true})
	if err == nil || !strings.Contains(err.Error(), "did not create") {
		t.Fatalf("err = %v, want a refusal naming the foreign device", err)
	}
}

func TestPlanNode(t *testing.T) {
	vip, vip6 := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")
	untracked := replyexempt.Want{Sources: []netip.Addr{vip, vip6}, Links: []string{"cni0"}}
	r1 := swapRoute{Label: 1024 + 11, Pod: podIP, LinkIdx: 5}
	r2 := swapRoute{Label: 1024 + 12, Pod: netip.MustParseAddr("10.1.0.12"), LinkIdx: 5}
	for _, tc := range []struct {
		name    string
		mode    encap.Mode
		want    nodeWant
		have    nodeState
		plan    string
		problem string
	}{
		{name: "gre: forwarding and loose rp_filter towards pods", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "0", "net/ipv4/conf/cni0/rp_filter": "1"}},
			plan: "sysctl net/ipv4/ip_forward=1; sysctl net/ipv4/conf/cni0/rp_filter=2"},
		{name: "mpls: fresh node", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, Routes: map[uint32]swapRoute{r1.Label: r1}, BridgeGuard: true},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": "0"}},
			plan: "sysctl net/mpls/platform_labels=132096; sysctl net/mpls/conf/eth0/input=1; add bridge table kube-service-tunnel (bridged MPLS with label 100 dropped); mpls route 1035 as 100 via inet 10.1.0.11 dev #5"},
		{name: "mpls: stale route removed, wrong one replaced, right one kept", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, Routes: map[uint32]swapRoute{r1.Label: r1}, BridgeGuard: true},
			have: nodeState{Routes: map[uint32]swapRoute{r1.Label: {Label: r1.Label, Pod: podIP, LinkIdx: 9}, r2.Label: r2},
				Sysctls:     map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": "132096", "net/mpls/conf/eth0/input": "1"},
				BridgeGuard: bridgeguard.State{Present: true, Current: true}},
			plan: "mpls route 1035 as 100 via inet 10.1.0.11 dev #5; remove mpls route 1036"},
		{name: "mpls: a bridge table not as the agent writes it is replaced", mode: encap.MPLS,
			want: nodeWant{MPLSInput: []string{"eth0"}, Routes: map[uint32]swapRoute{r1.Label: r1}, BridgeGuard: true},
			have: nodeState{Routes: map[uint32]swapRoute{r1.Label: r1},
				Sysctls:     map[string]string{"net/mpls/platform_labels": "132096", "net/mpls/conf/eth0/input": "1"},
				BridgeGuard: bridgeguard.State{Present: true}},
			plan: "replace bridge table kube-service-tunnel (bridged MPLS with label 100 dropped)"},
		{name: "gre: replies untracked, the table added", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}, Untracked: untracked},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1"}},
			plan: "add inet table kube-service-tunnel (replies from 2 tunnel IPs on [cni0] untracked)"},
		{name: "gre: the table holds the same, in another order: nothing to do", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}, Untracked: untracked},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1"},
				ReplyExempt: replyexempt.State{Present: true, Current: true, Have: replyexempt.Want{Sources: []netip.Addr{vip6, vip}, Links: []string{"cni0", "cni0"}}}},
			plan: ""},
		{name: "gre: a tunnel IP more, or a table of another version: replaced", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}, Untracked: untracked},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1"},
				ReplyExempt: replyexempt.State{Present: true, Current: true, Have: replyexempt.Want{Sources: []netip.Addr{vip}, Links: []string{"cni0"}}}},
			plan: "replace inet table kube-service-tunnel (replies from 2 tunnel IPs on [cni0] untracked)"},
		{name: "gre: not current", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}, Untracked: untracked},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1"}, ReplyExempt: replyexempt.State{Present: true}},
			plan: "replace inet table kube-service-tunnel (replies from 2 tunnel IPs on [cni0] untracked)"},
		{name: "gre: nothing served or --untrack-replies=false: the table goes", mode: encap.GRE,
			have: nodeState{ReplyExempt: replyexempt.State{Present: true, Current: true}},
			plan: "remove inet table kube-service-tunnel"},
		{name: "nothing served: only leftovers go, no sysctl", mode: encap.MPLS,
			have: nodeState{Routes: map[uint32]swapRoute{r2.Label: r2}, Sysctls: map[string]string{"net/ipv4/ip_forward": "0"},
				BridgeGuard: bridgeguard.State{Present: true, Current: true}},
			plan: "remove bridge table kube-service-tunnel; remove mpls route 1036"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			acts, problems := planNode(tc.mode, tc.want, tc.have)
			for _, a := range acts {
				got = append(got, a.String())
			}
			if s := strings.Join(got, "; "); s != tc.plan {
				t.Errorf("plan:\n got  %s\n want %s", s, tc.plan)
			}
			joined := ""
			if err := errors.Join(problems...); err != nil {
				joined = err.Error()
			}
			if tc.problem == "" && joined != "" || !strings.Contains(joined, tc.problem) {
				t.Errorf("problems = %q, want one containing %q", joined, tc.problem)
			}
		})
	}
}

// The plans of the IPv4 half, written once for the dual-stack cases.
const (
	greCreate4 = "create device, local 10.1.0.11; set device alias kube-service-tunnel; sysctl net/ipv4/conf/kst-decap/forwarding=0; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2"
	greCreate6 = "create IPv6 device, local fd00:10:1::11; set IPv6 device alias kube-service-tunnel; set IPv6 device up"
)

func TestPlanPodDualStack(t *testing.T) {
	greDual := func() podState {
		return podState{PodLink: "eth0", PodLink6: "eth0",
			Device: &deviceState{Local: podIP, Up: true}, DeviceIPs: []netip.Addr{vip1},
			Device6: &deviceState{Local: podIP6, Up: true}, Device6IPs: []netip.Addr{v6vip1},
			Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2", "net/ipv4/conf/kst-decap/forwarding": "0", "net/ipv6/conf/kst-decap6/disable_ipv6": "0", "net/ipv6/conf/default/disable_ipv6": "0"}}
	}
	mplsDual := func() podState {
		return podState{PodLink: "eth0", PodLink6: "eth0", LoopbackIPs: []netip.Addr{vip1}, LoopbackIPs6: []netip.Addr{v6vip1},
			OtherLoopbackIPs6: []netip.Addr{netip.IPv6Loopback()}, PopRoute: true,
			Sysctls: map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "2", "net/ipv4/conf/lo/forwarding": "0", "net/ipv6/conf/lo/disable_ipv6": "0"}}
	}
	with := func(s podState, f func(*podState)) podState { f(&s); return s }
	routes := func(mss, mss6 int) func(*podState) {
		return func(s *podState) { s.DefaultRoute, s.AdvMSS, s.DefaultRoute6, s.AdvMSS6 = true, mss, true, mss6 }
	}
	policies := func(w PodTunnels) func(*podState) {
		return func(s *podState) {
			s.TablesRead, s.Tables6Read = true, true
			if w.Policy != nil {
				s.Policy = observed(w.Policy)
			}
			if w.Policy6 != nil {
				s.Policy6 = observed(w.Policy6)
			}
		}
	}
	iso := isolated(want6(vip1, v6vip1))
	for _, tc := range []struct {
		name   string
		mode   encap.Mode
		advmss int
		want   PodTunnels
		have   podState
		plan   string
	}{
		{name: "gre: fresh dual-stack pod gets both devices", mode: encap.GRE, want: want6(vip1, v6vip1),
			have: podState{PodLink: "eth0", PodLink6: "eth0", Sysctls: map[string]string{"net/ipv6/conf/default/disable_ipv6": "0"}},
			plan: strings.Replace(greCreate4, "; set device up", "; sysctl net/ipv6/conf/kst-decap/disable_ipv6=1; set device up", 1) + "; " + greCreate6 + "; add tunnel IP 192.0.2.10 on device; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "gre: already right means no change (adoption)", mode: encap.GRE, want: want6(vip1, v6vip1), have: greDual(), plan: ""},
		{name: "gre: the IPv6 tunnel IP leaves, then its device; IPv4 untouched", mode: encap.GRE, want: want6(vip1), have: greDual(),
			plan: "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device"},
		{name: "gre: the IPv4 tunnel IP leaves, then its device; IPv6 untouched", mode: encap.GRE, want: want6(v6vip1), have: greDual(),
			plan: "remove tunnel IP 192.0.2.10 on device; delete device"},
		{name: "gre: a second IPv6 tunnel IP is added on its own", mode: encap.GRE, want: want6(vip1, v6vip1, v6vip2), have: greDual(),
			plan: "add tunnel IP 2001:db8::11 on IPv6 device"},
		{name: "gre: an IPv6-only pod gets the IPv6 device alone", mode: encap.GRE, want: wantOnly6(v6vip1), have: podState{PodLink6: "eth0"},
			plan: greCreate6 + "; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "gre: a new IPv6 device in a namespace whose default disables IPv6 gets it on", mode: encap.GRE, want: wantOnly6(v6vip1),
			have: podState{PodLink6: "eth0", Sysctls: map[string]string{"net/ipv6/conf/default/disable_ipv6": "1"}},
			plan: "create IPv6 device, local fd00:10:1::11; set IPv6 device alias kube-service-tunnel; sysctl net/ipv6/conf/kst-decap6/disable_ipv6=0; set IPv6 device up; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "gre: IPv6 disabled on the IPv6 device and the device down are repaired", mode: encap.GRE, want: want6(vip1, v6vip1),
			have: with(greDual(), func(s *podState) {
				s.Device6 = &deviceState{Local: podIP6}
				s.Sysctls["net/ipv6/conf/kst-decap6/disable_ipv6"] = "1"
			}),
			plan: "sysctl net/ipv6/conf/kst-decap6/disable_ipv6=0; set IPv6 device up"},
		{name: "gre: an IPv6 device with an old local address is recreated", mode: encap.GRE, want: want6(vip1, v6vip1),
			have: with(greDual(), func(s *podState) { s.Device6 = &deviceState{Local: netip.MustParseAddr("fd00:10:1::99"), Up: true} }),
			plan: "delete IPv6 device; " + greCreate6 + "; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "gre: an IPv6 device left unmarked by a crash is adopted", mode: encap.GRE, want: want6(vip1, v6vip1),
			have: with(greDual(), func(s *podState) { s.Device6.Unmarked = true }),
			plan: "set IPv6 device alias kube-service-tunnel"},
		{name: "gre: a foreign device of the IPv6 name is no matter while only IPv4 is served", mode: encap.GRE, want: want6(vip1),
			have: with(greDual(), func(s *podState) { s.Device6, s.Device6IPs, s.ForeignDevice6 = nil, nil, true }), plan: ""},
		{name: "mpls: fresh dual-stack pod, IPv6 on its own interface, lo without IPv6", mode: encap.MPLS, want: want6(vip1, v6vip1),
			have: podState{PodLink: "eth0", PodLink6: "net6", Sysctls: map[string]string{"net/mpls/platform_labels": "0", "net/ipv4/conf/lo/rp_filter": "1", "net/ipv6/conf/lo/disable_ipv6": "1"}},
			plan: "sysctl net/mpls/platform_labels=101; sysctl net/mpls/conf/eth0/input=1; sysctl net/mpls/conf/net6/input=1; sysctl net/ipv4/conf/lo/rp_filter=2; sysctl net/ipv4/conf/lo/forwarding=0; sysctl net/ipv6/conf/lo/disable_ipv6=0; add mpls route 100 dev lo; add tunnel IP 192.0.2.10 on lo; add tunnel IP 2001:db8::10 on lo"},
		{name: "mpls: already right (adoption)", mode: encap.MPLS, want: want6(vip1, v6vip1), have: mplsDual(), plan: ""},
		{name: "mpls: the IPv6 tunnel IP leaves, the pop route stays for IPv4", mode: encap.MPLS, want: want6(vip1), have: mplsDual(),
			plan: "remove tunnel IP 2001:db8::10 on lo"},
		{name: "mpls: the last tunnel IPs leave, then the pop route", mode: encap.MPLS, want: want6(), have: mplsDual(),
			plan: "remove tunnel IP 192.0.2.10 on lo; remove tunnel IP 2001:db8::10 on lo; remove mpls route 100 dev lo"},
		{name: "mpls: an IPv6-only pod leaves IPv4's rp_filter alone", mode: encap.MPLS, want: wantOnly6(v6vip1),
			have: podState{PodLink6: "eth0", Sysctls: map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "1", "net/ipv6/conf/lo/disable_ipv6": "0"}},
			plan: "add mpls route 100 dev lo; add tunnel IP 2001:db8::10 on lo"},
		{name: "mode changed to gre: the IPv6 lo leftovers go too", mode: encap.GRE, want: want6(vip1, v6vip1), have: mplsDual(),
			plan: "remove tunnel IP 192.0.2.10 on lo; remove tunnel IP 2001:db8::10 on lo; remove mpls route 100 dev lo; " + greCreate4 + "; " + greCreate6 + "; add tunnel IP 192.0.2.10 on device; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "mode changed to mpls: the IPv6 device goes", mode: encap.MPLS, want: want6(vip1, v6vip1),
			have: with(greDual(), func(s *podState) {
				s.Sysctls = map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "0", "net/ipv4/conf/lo/forwarding": "0", "net/ipv6/conf/lo/disable_ipv6": "0"}
			}),
			plan: "remove tunnel IP 192.0.2.10 on device; remove tunnel IP 2001:db8::10 on IPv6 device; delete device; delete IPv6 device; add mpls route 100 dev lo; add tunnel IP 192.0.2.10 on lo; add tunnel IP 2001:db8::10 on lo"},
		{name: "gre: advmss on both default routes, 40 bytes less for IPv6", mode: encap.GRE, advmss: 1400, want: want6(vip1, v6vip1),
			have: with(greDual(), routes(0, 0)), plan: "default route advmss 1400; IPv6 default route advmss 1360"},
		{name: "mpls: the IPv6 advmss is 20 bytes less", mode: encap.MPLS, advmss: 1400, want: want6(vip1, v6vip1),
			have: with(mplsDual(), routes(1400, 0)), plan: "IPv6 default route advmss 1380"},
		{name: "an IPv6 advmss someone else set is left alone", mode: encap.GRE, advmss: 1400, want: want6(vip1, v6vip1),
			have: with(greDual(), routes(1400, 1300)), plan: ""},
		{name: "the other mode's IPv6 advmss is the agent's: replaced", mode: encap.GRE, advmss: 1400, want: want6(vip1, v6vip1),
			have: with(greDual(), routes(1400, 1380)), plan: "IPv6 default route advmss 1360"},
		{name: "the IPv6 advmss goes with the last IPv6 tunnel IP, the IPv4 one stays", mode: encap.GRE, advmss: 1400, want: want6(vip1),
			have: with(greDual(), routes(1400, 1360)), plan: "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device; IPv6 default route advmss 0"},
		{name: "an IPv6 advmss someone else set stays when IPv6 is no longer served", mode: encap.GRE, advmss: 1400, want: want6(vip1),
			have: with(greDual(), routes(1400, 1300)), plan: "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device"},
		{name: "an isolated dual-stack pod gets both families' rules before its tunnel IPs", mode: encap.GRE, want: iso,
			have: podState{PodLink: "eth0", PodLink6: "eth0", TablesRead: true, Tables6Read: true, Sysctls: map[string]string{}},
			plan: "write network policy rules " + iso.Policy.Digest + "; write IPv6 network policy rules " + iso.Policy6.Digest + "; " + greCreate4 + "; " + greCreate6 + "; add tunnel IP 192.0.2.10 on device; add tunnel IP 2001:db8::10 on IPv6 device"},
		{name: "isolated and right in both tables: nothing", mode: encap.GRE, want: iso, have: with(greDual(), policies(iso)), plan: ""},
		{name: "the IPv6 tunnel IP leaves before its rules; the IPv4 table is not written", mode: encap.GRE, want: isolated(want6(vip1)),
			have: with(greDual(), policies(iso)), plan: "remove tunnel IP 2001:db8::10 on IPv6 device; delete IPv6 device; remove IPv6 network policy rules"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(tc.mode)
			cfg.PodAdvMSS = tc.advmss
			acts, err := planPod(cfg, tc.want, tc.have)
			if err != nil {
				t.Fatal(err)
			}
			if got := render(acts); got != tc.plan {
				t.Errorf("plan:\n got  %s\n want %s", got, tc.plan)
			}
		})
	}
}

func TestPlanPodDualStackRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		mode encap.Mode
		want PodTunnels
		have podState
		err  string
	}{
		{"mpls: an IPv6 tunnel IP already on lo without the agent's address protocol is not taken over", encap.MPLS, want6(vip1, v6vip1),
			podState{PodLink: "eth0", PodLink6: "eth0", PopRoute: true, OtherLoopbackIPs6: []netip.Addr{netip.IPv6Loopback(), v6vip1}},
			"tunnel IP 2001:db8::10 is on lo without kube-service-tunnel's address protocol 245"},
		{"gre: a foreign device of the IPv6 name blocks IPv6 tunnel IPs", encap.GRE, want6(vip1, v6vip1),
			podState{PodLink: "eth0", PodLink6: "eth0", ForeignDevice6: true}, `a device named "kst-decap6" exists that kube-service-tunnel did not create`},
		{"an unreadable IPv6 filter table of an isolated pod", encap.GRE, isolated(want6(v6vip1)),
			podState{PodLink: "eth0", PodLink6: "eth0", TablesRead: true, Tables6Read: true, PolicyErr6: errors.New("ip6tables-save: not found")},
			"reading the pod's IPv6 filter table for its network policy: ip6tables-save: not found"},
		{"an IPv6 tunnel IP for a pod without an IPv6 address", encap.GRE, want(v6vip1), podState{PodLink: "eth0"},
			"pod a/web-1 has no address of the family of its tunnel IPs [2001:db8::10]"},
		{"mpls: no interface holds the pod's IPv6 address", encap.MPLS, want6(v6vip1), podState{PodLink: "eth0"},
			"no interface holds the pod IP fd00:10:1::11"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			acts, err := planPod(testConfig(tc.mode), tc.want, tc.have)
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("plan %q, err %v; want an error containing %q", render(acts), err, tc.err)
			}
		})
	}
	// Control: an unreadable IPv6 table of a pod no policy isolates only
	// costs it connection tracking.
	w := want6(v6vip1)
	w.Policy6 = netpol.Render(netpol.Ingress{}, w.TunnelIPsOf(true))
	have := podState{PodLink6: "eth0", Device6: &deviceState{Local: podIP6, Up: true}, Device6IPs: []netip.Addr{v6vip1},
		TablesRead: true, Tables6Read: true, PolicyErr6: errors.New("ip6tables-save: not found"), Sysctls: map[string]string{}}
	if acts, err := planPod(testConfig(encap.GRE), w, have); err != nil || len(acts) != 0 {
		t.Fatalf("plan %q, err %v; want nothing", render(acts), err)
	}
}

func TestPlanNodeDualStack(t *testing.T) {
	r4 := swapRoute{Label: 1024 + 11, Pod: podIP, LinkIdx: 5}
	r6 := swapRoute{Label: mplslabel.Base6 + 0x11, Pod: podIP6, LinkIdx: 5}
	stale6 := swapRoute{Label: mplslabel.Base6 + 0x12, Pod: netip.MustParseAddr("fd00:10:1::12"), LinkIdx: 5}
	labels := strconv.Itoa(mplslabel.PlatformLabels)
	for _, tc := range []struct {
		name    string
		mode    encap.Mode
		want    nodeWant
		have    nodeState
		plan    string
		problem string
	}{
		{name: "mpls: one swap route per address of a dual-stack pod", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, IPv6Pods: true, Routes: map[uint32]swapRoute{r4.Label: r4, r6.Label: r6}},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": "0"}},
			plan: "sysctl net/mpls/platform_labels=" + labels + "; sysctl net/mpls/conf/eth0/input=1; mpls route 1035 as 100 via inet 10.1.0.11 dev #5; mpls route 66577 as 100 via inet6 fd00:10:1::11 dev #5"},
		{name: "mpls: IPv6 pods alone need the MPLS sysctls but not IPv4 forwarding", mode: encap.MPLS,
			want: nodeWant{MPLSInput: []string{"eth0"}, IPv6Pods: true, Routes: map[uint32]swapRoute{r6.Label: r6}},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "0", "net/mpls/platform_labels": "0"}},
			plan: "sysctl net/mpls/platform_labels=" + labels + "; sysctl net/mpls/conf/eth0/input=1; mpls route 66577 as 100 via inet6 fd00:10:1::11 dev #5"},
		{name: "mpls: adopted as is; a stale IPv6 route goes, a wrong one is replaced", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, IPv6Pods: true, Routes: map[uint32]swapRoute{r4.Label: r4, r6.Label: r6}},
			have: nodeState{Routes: map[uint32]swapRoute{r4.Label: r4, r6.Label: {Label: r6.Label, Pod: podIP6, LinkIdx: 9}, stale6.Label: stale6},
				Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": labels, "net/mpls/conf/eth0/input": "1"}},
			plan: "mpls route 66577 as 100 via inet6 fd00:10:1::11 dev #5; remove mpls route 66578"},
		{name: "gre: IPv6 pods with IPv6 forwarding on: nothing to do", mode: encap.GRE,
			want: nodeWant{IPv6Pods: true}, have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "0", "net/ipv6/conf/all/forwarding": "1"}}, plan: ""},
		{name: "gre: IPv6 forwarding off is reported, never written", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}, IPv6Pods: true}, have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/ipv6/conf/all/forwarding": "0"}},
			plan: "", problem: `sysctl net.ipv6.conf.all.forwarding is "0", not 1`},
		{name: "mpls: IPv6 forwarding is not needed", mode: encap.MPLS,
			want: nodeWant{MPLSInput: []string{"eth0"}, IPv6Pods: true, Routes: map[uint32]swapRoute{r6.Label: r6}},
			have: nodeState{Routes: map[uint32]swapRoute{r6.Label: r6}, Sysctls: map[string]string{"net/mpls/platform_labels": labels, "net/mpls/conf/eth0/input": "1", "net/ipv6/conf/all/forwarding": "0"}},
			plan: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			acts, problems := planNode(tc.mode, tc.want, tc.have)
			var got []string
			for _, a := range acts {
				got = append(got, a.String())
			}
			if s := strings.Join(got, "; "); s != tc.plan {
				t.Errorf("plan:\n got  %s\n want %s", s, tc.plan)
			}
			joined := ""
			if err := errors.Join(problems...); err != nil {
				joined = err.Error()
			}
			if tc.problem == "" && joined != "" || !strings.Contains(joined, tc.problem) {
				t.Errorf("problems = %q, want one containing %q", joined, tc.problem)
			}
		})
	}
	if names := (nodeWant{IPv6Pods: true}).sysctlNames(encap.GRE); !slices.Contains(names, "net/ipv6/conf/all/forwarding") {
		t.Errorf("gre mode with IPv6 pods does not read IPv6 forwarding: %v", names)
	}
}
