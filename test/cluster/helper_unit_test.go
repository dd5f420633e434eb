package cluster

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
)

func TestGenerationSwitches(t *testing.T) {
	log := `2026-11-28T07:12:18.58596526Z stderr F time="2026-11-28T07:12:18Z" level=info msg="starting tunnel router" generations=4
2026-11-28T07:12:29.36487148Z stderr F time="2026-11-28T07:12:29Z" level=info msg="new flows go to a new generation; established flows keep theirs" from_generation=2 to_generation=3
2026-11-28T07:12:44.97396444Z stderr F time="2026-11-28T07:12:44Z" level=info msg="older generation unused by any flow; removed" generation=3
2026-11-28T07:12:53.64795346Z stderr F time="2026-11-28T07:12:53Z" level=info msg="new flows go to a new generation; established flows keep theirs" from_generation=2 to_generation=3`
	got := generationSwitches(log)
	want := []time.Time{time.Date(2026, 11, 28, 7, 12, 29, 364871480, time.UTC), time.Date(2026, 11, 28, 7, 12, 53, 647953460, time.UTC)}
	if len(got) != len(want) || !got[0].Equal(want[0]) || !got[1].Equal(want[1]) {
		t.Errorf("generationSwitches = %v, want %v", got, want)
	}
}

// TestWithoutCNIBridge: the bridge, the pods' veths on it and what the
// kernel adds for them are left out; the rest, another veth included, stays.
func TestWithoutCNIBridge(t *testing.T) {
	st := kstate.State{Namespace: "node", Sections: map[string][]string{
		"link":   {"cni0 kind=bridge up mtu=1500", "veth1a2b3c4d kind=veth up mtu=1500 master=cni0", "kst-probe kind=veth up mtu=1500", "eth0 kind=none up mtu=1500"},
		"addr6":  {"veth1a2b3c4d fe80::1/64 scope=link", "eth0 fd00::1/64 scope=global"},
		"route6": {"fe80::/64 dev veth1a2b3c4d proto kernel metric 256 pref medium", "fe80::/64 dev kst-probe proto kernel metric 256 pref medium"},
		"route":  {"10.244.2.0/24 dev cni0 proto kernel scope link src 10.244.2.1"},
	}}
	got := withoutCNIBridge(st)
	want := map[string][]string{
		"link":   {"kst-probe kind=veth up mtu=1500", "eth0 kind=none up mtu=1500"},
		"addr6":  {"eth0 fd00::1/64 scope=global"},
		"route6": {"fe80::/64 dev kst-probe proto kernel metric 256 pref medium"},
	}
	if !reflect.DeepEqual(got.Sections, want) {
		t.Errorf("got %v\nwant %v", got.Sections, want)
	}
}

// TestWithoutKubeProxy: kube-proxy's chains and jumps leave the iptables
// sections; the project's KST-* chains and every other section stay.
func TestWithoutKubeProxy(t *testing.T) {
	st := kstate.State{Namespace: "node", Sections: map[string][]string{
		"iptables/filter":        {":KUBE-FORWARD -", "-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD", ":KST-POLICY -", "-A KST-POLICY -j DROP"},
		"iptables-legacy/mangle": {"-A PREROUTING -d 192.0.2.10/32 -j KST-HMARK"},
		"ip6tables/nat":          {":KUBE-SERVICES -"},
		"link":                   {"KUBE-weird kind=veth"},
	}}
	got := withoutKubeProxy(st)
	want := map[string][]string{
		"iptables/filter":        {":KST-POLICY -", "-A KST-POLICY -j DROP"},
		"iptables-legacy/mangle": {"-A PREROUTING -d 192.0.2.10/32 -j KST-HMARK"},
		"link":                   {"KUBE-weird kind=veth"},
	}
	if !reflect.DeepEqual(got.Sections, want) {
		t.Errorf("got %v\nwant %v", got.Sections, want)
	}
}

// TestInvalidDropRule reads the packet counter of kube-proxy's INVALID drop
// from iptables-save -c, and reports a filter table without it.
func TestInvalidDropRule(t *testing.T) {
	save := `*filter
:KUBE-FORWARD - [0:0]
[12:480] -A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
[7:420] -A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
[0:0] -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
COMMIT
`
	if n, found := invalidDropRule(save); !found || n != 7 {
		t.Errorf("invalidDropRule = %d, %v; want 7, true", n, found)
	}
	if n, found := invalidDropRule("*filter\n[3:9] -A KUBE-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\nCOMMIT\n"); found {
		t.Errorf("invalidDropRule found %d packets in a table without the rule", n)
	}
}

// TestClusterPlan: make cluster runs gre mode on Flannel and mpls mode on
// Calico (make test the first alone, through the variables below); make
// cluster CNI=X both modes on X, or those of
// KST_CLUSTER_MODES; a plugin it does not know is an error.
func TestClusterPlan(t *testing.T) {
	t.Setenv(demoEnv, "")
	t.Setenv(modesEnv, "")
	t.Setenv(cniEnv, "")
	plan, err := clusterPlan()
	if err != nil || len(plan) != 2 || plan[0].name() != "flannel_gre" || plan[1].name() != "calico_mpls" {
		t.Errorf("default plan: %v, %v; want flannel_gre, calico_mpls", plan, err)
	}
	t.Setenv(cniEnv, cniCalico)
	if plan, err := clusterPlan(); err != nil || len(plan) != 1 || plan[0].name() != "calico_gre_mpls" {
		t.Errorf("CNI=calico: %v, %v; want calico_gre_mpls", plan, err)
	}
	t.Setenv(modesEnv, "mpls")
	if plan, err := clusterPlan(); err != nil || len(plan) != 1 || plan[0].name() != "calico_mpls" {
		t.Errorf("CNI=calico KST_CLUSTER_MODES=mpls: %v, %v; want calico_mpls", plan, err)
	}
	t.Setenv(cniEnv, "weave")
	if _, err := clusterPlan(); err == nil {
		t.Error("CNI=weave: want an error")
	}
}

// TestFelixCounters: Felix's reverse-path drops and its to-workload drops
// are read from iptables-save -c output as the lab prints it.
func TestFelixCounters(t *testing.T) {
	raw := `*raw
[5060:2488351] -A cali-PREROUTING -m comment --comment "cali:DQ6LK2guiBRMyrLK" -j MARK --set-xmark 0x0/0x1b0000
[12:720] -A cali-PREROUTING -m comment --comment "cali:uvipz_NmQPrGYnTB" -m mark --mark 0x80000/0x80000 -m rpfilter --validmark --invert -j DROP
[3:180] -A cali-PREROUTING -m comment --comment "cali:other" -m mark --mark 0x80000/0x80000 -m rpfilter --validmark --invert -j DROP
COMMIT
`
	if n, found := felixRPFDrops(raw); !found || n != 15 {
		t.Errorf("felixRPFDrops = %d, %v; want 15, true", n, found)
	}
	if _, found := felixRPFDrops("*raw\nCOMMIT\n"); found {
		t.Error("felixRPFDrops found a drop in an empty table")
	}
	filter := `[7:420] -A cali-tw-cali58bbb0b5aab -m comment --comment "cali:mf6URJ9MHUclOLp_" -m comment --comment "Drop if no profiles matched" -j DROP
[2:120] -A cali-pi-_abc -m comment --comment "cali:x" -s 198.51.100.0/24 -j MARK --set-xmark 0x10000/0x10000
[1:60] -A cali-fw-cali58bbb0b5aab -m comment --comment "cali:y" -j DROP
`
	got := felixPolicyVerdicts(filter)
	want := "felix_packets{chain=\"cali-tw-cali58bbb0b5aab\",verdict=\"drop\"} 7\n"
	if !strings.HasPrefix(got, want) || strings.Contains(got, "cali-fw-") {
		t.Errorf("felixPolicyVerdicts =\n%s\nwant it to start with\n%s\nand leave out cali-fw-", got, want)
	}
}

// TestWithoutCalicoRoutes: Calico's routes through vxlan.calico leave the
// comparison, other routes stay.
func TestWithoutCalicoRoutes(t *testing.T) {
	st := kstate.State{Sections: map[string][]string{"route": {
		"10.244.120.128 dev vxlan.calico scope link mtu 1450",
		"10.244.120.128/26 via 10.244.120.128 dev vxlan.calico onlink mtu 1450",
		"198.51.100.0/24 via 172.20.0.11 dev eth1",
	}}}
	got := withoutCalicoRoutes(st).Sections["route"]
	if len(got) != 1 || got[0] != "198.51.100.0/24 via 172.20.0.11 dev eth1" {
		t.Errorf("withoutCalicoRoutes kept %q", got)
	}
}
