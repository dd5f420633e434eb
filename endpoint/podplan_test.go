package endpoint

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

var (
	podIP = netip.MustParseAddr("10.1.0.11")
	vip1  = netip.MustParseAddr("192.0.2.10")
	vip2  = netip.MustParseAddr("192.0.2.11")
)

func testConfig(mode encap.Mode) Config {
	return Config{Mode: mode, NodeName: "n1", Device: DefaultDevice, RouteProtocol: encap.DefaultRouteProtocol, Workers: 1,
		Policy: tunnelclaim.Policy{Pools: testPools}}
}

func want(ips ...netip.Addr) PodTunnels {
	return PodTunnels{Pod: runtime.Pod{Namespace: "a", Name: "web-1", UID: "u", IP: podIP}, TunnelIPs: ips}
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
		Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2"}}
	mplsReady := podState{PodLink: "eth0", LoopbackIPs: []netip.Addr{vip1}, PopRoute: true,
		Sysctls: map[string]string{"net/mpls/platform_labels": "101", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "2"}}
	for _, tc := range []struct {
		name   string
		mode   encap.Mode
		advmss int
		want   PodTunnels
		have   podState
		plan   string
	}{
		{name: "gre: fresh pod", mode: encap.GRE, want: want(vip1), have: podState{PodLink: "eth0"},
			plan: "create device, local 10.1.0.11; set device alias kube-service-tunnel; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "gre: already right means no change (adoption)", mode: encap.GRE, want: want(vip1), have: greReady, plan: ""},
		{name: "gre: second tunnel IP added on its own", mode: encap.GRE, want: want(vip1, vip2), have: greReady,
			plan: "add tunnel IP 192.0.2.11 on device"},
		{name: "gre: one of two removed keeps the device", mode: encap.GRE, want: want(vip2),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true}, DeviceIPs: []netip.Addr{vip1, vip2},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2"}},
			plan: "remove tunnel IP 192.0.2.10 on device"},
		{name: "gre: last removed deletes the device after the address", mode: encap.GRE, want: want(), have: greReady,
			plan: "remove tunnel IP 192.0.2.10 on device; delete device"},
		{name: "gre: device down and rp_filter drifted are repaired", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP}, DeviceIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "1"}},
			plan: "set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2"},
		{name: "gre: device with an old local address is recreated", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: netip.MustParseAddr("10.1.0.99"), Up: true}, DeviceIPs: []netip.Addr{vip1}},
			plan: "delete device; create device, local 10.1.0.11; set device alias kube-service-tunnel; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "gre: a device left unmarked by a crash between creation and alias is adopted", mode: encap.GRE, want: want(vip1),
			have: podState{PodLink: "eth0", Device: &deviceState{Local: podIP, Up: true, Unmarked: true}, DeviceIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/ipv4/conf/kst-decap/rp_filter": "2"}},
			plan: "set device alias kube-service-tunnel"},
		{name: "nothing wanted, nothing there", mode: encap.GRE, want: want(), have: podState{PodLink: "eth0"}, plan: ""},
		{name: "mpls: fresh pod, strict rp_filter", mode: encap.MPLS, want: want(vip1),
			have: podState{PodLink: "net1", Sysctls: map[string]string{"net/mpls/platform_labels": "0", "net/ipv4/conf/lo/rp_filter": "1"}},
			plan: "sysctl net/mpls/platform_labels=101; sysctl net/mpls/conf/net1/input=1; sysctl net/ipv4/conf/lo/rp_filter=2; add mpls route 100 dev lo; add tunnel IP 192.0.2.10 on lo"},
		{name: "mpls: rp_filter off and large platform_labels are left alone", mode: encap.MPLS, want: want(vip1),
			have: podState{PodLink: "eth0", PopRoute: true, LoopbackIPs: []netip.Addr{vip1},
				Sysctls: map[string]string{"net/mpls/platform_labels": "100000", "net/mpls/conf/eth0/input": "1", "net/ipv4/conf/lo/rp_filter": "0"}},
			plan: ""},
		{name: "mpls: already right", mode: encap.MPLS, want: want(vip1), have: mplsReady, plan: ""},
		{name: "mpls: last removed drops address then pop route", mode: encap.MPLS, want: want(), have: mplsReady,
			plan: "remove tunnel IP 192.0.2.10 on lo; remove mpls route 100 dev lo"},
		{name: "mode changed to gre: mpls leftovers go", mode: encap.GRE, want: want(vip1), have: mplsReady,
			plan: "remove tunnel IP 192.0.2.10 on lo; remove mpls route 100 dev lo; create device, local 10.1.0.11; set device alias kube-service-tunnel; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
		{name: "advmss set when serving", mode: encap.GRE, advmss: 1400, want: want(vip1),
			have: func() podState { s := greReady; s.DefaultRoute = true; return s }(), plan: "default route advmss 1400"},
		{name: "advmss someone else set is left alone", mode: encap.GRE, advmss: 1400, want: want(vip1),
			have: func() podState { s := greReady; s.DefaultRoute, s.AdvMSS = true, 1300; return s }(), plan: ""},
		{name: "advmss removed with the last tunnel IP", mode: encap.GRE, advmss: 1400, want: want(),
			have: func() podState { s := greReady; s.DefaultRoute, s.AdvMSS = true, 1400; return s }(),
			plan: "remove tunnel IP 192.0.2.10 on device; delete device; default route advmss 0"},
		{name: "gre: an isolated pod gets its policy before its tunnel IP", mode: encap.GRE, want: isolated(want(vip1)), have: podState{PodLink: "eth0", TablesRead: true},
			plan: "write network policy rules " + isolated(want(vip1)).Policy.Digest + "; create device, local 10.1.0.11; set device alias kube-service-tunnel; set device up; sysctl net/ipv4/conf/kst-decap/rp_filter=2; add tunnel IP 192.0.2.10 on device"},
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

// isolated gives w a deny-all policy.
func isolated(w PodTunnels) PodTunnels {
	w.Policy = netpol.Render(netpol.Ingress{Isolated: true}, w.TunnelIPs)
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
	r1 := swapRoute{Label: 1024 + 11, Pod: podIP, LinkIdx: 5}
	r2 := swapRoute{Label: 1024 + 12, Pod: netip.MustParseAddr("10.1.0.12"), LinkIdx: 5}
	for _, tc := range []struct {
		name string
		mode encap.Mode
		want nodeWant
		have nodeState
		plan string
	}{
		{name: "gre: forwarding and loose rp_filter towards pods", mode: encap.GRE,
			want: nodeWant{PodLinks: []string{"cni0"}},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "0", "net/ipv4/conf/cni0/rp_filter": "1"}},
			plan: "sysctl net/ipv4/ip_forward=1; sysctl net/ipv4/conf/cni0/rp_filter=2"},
		{name: "mpls: fresh node", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, Routes: map[uint32]swapRoute{r1.Label: r1}},
			have: nodeState{Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": "0"}},
			plan: "sysctl net/mpls/platform_labels=66560; sysctl net/mpls/conf/eth0/input=1; mpls route 1035 as 100 via inet 10.1.0.11 dev #5"},
		{name: "mpls: stale route removed, wrong one replaced, right one kept", mode: encap.MPLS,
			want: nodeWant{PodLinks: []string{"cni0"}, MPLSInput: []string{"eth0"}, Routes: map[uint32]swapRoute{r1.Label: r1}},
			have: nodeState{Routes: map[uint32]swapRoute{r1.Label: {Label: r1.Label, Pod: podIP, LinkIdx: 9}, r2.Label: r2},
				Sysctls: map[string]string{"net/ipv4/ip_forward": "1", "net/mpls/platform_labels": "66560", "net/mpls/conf/eth0/input": "1"}},
			plan: "mpls route 1035 as 100 via inet 10.1.0.11 dev #5; remove mpls route 1036"},
		{name: "nothing served: only leftovers go, no sysctl", mode: encap.MPLS,
			have: nodeState{Routes: map[uint32]swapRoute{r2.Label: r2}, Sysctls: map[string]string{"net/ipv4/ip_forward": "0"}},
			plan: "remove mpls route 1036"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, a := range planNode(tc.mode, tc.want, tc.have) {
				got = append(got, a.String())
			}
			if s := strings.Join(got, "; "); s != tc.plan {
				t.Errorf("plan:\n got  %s\n want %s", s, tc.plan)
			}
		})
	}
}
