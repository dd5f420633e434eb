package kernelcheck

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// fakeKernel answers each probe from fail (by probe name, "rule:TABLE:TARGET"
// for iptables rules) and records the calls.
type fakeKernel struct {
	fail map[string]error
	// loads makes LoadModule of a module succeed and clear these probes.
	loads map[string][]string
	calls []string
}

func (f *fakeKernel) probe(name string) error {
	f.calls = append(f.calls, name)
	return f.fail[name]
}

func (f *fakeKernel) FlowBasedGRE() error              { return f.probe("flow-gre") }
func (f *fakeKernel) GRE() error                       { return f.probe("gre") }
func (f *fakeKernel) PolicyRouting() error             { return f.probe("rules") }
func (f *fakeKernel) EncapIPRoute() error              { return f.probe("encap-ip") }
func (f *fakeKernel) MPLSRouting() error               { return f.probe("mpls") }
func (f *fakeKernel) EncapMPLSRoute() error            { return f.probe("encap-mpls") }
func (f *fakeKernel) EncapIPNextHop() error            { return f.probe("nexthop-ip") }
func (f *fakeKernel) IPTables() error                  { return f.probe("iptables") }
func (f *fakeKernel) IPTablesChain(table string) error { return f.probe("chain:" + table) }
func (f *fakeKernel) IPSet() error                     { return f.probe("ipset") }
func (f *fakeKernel) IPSetRule(table string) error     { return f.probe("rule:" + table + ":set") }
func (f *fakeKernel) IPTablesRule(table string, rule ...string) error {
	return f.probe("rule:" + table + ":" + target(rule))
}

func (f *fakeKernel) LoadModule(name string) error {
	f.calls = append(f.calls, "modprobe:"+name)
	probes, ok := f.loads[name]
	if !ok {
		return errors.New("modprobe: FATAL: Module " + name + " not found")
	}
	for _, p := range probes {
		delete(f.fail, p)
	}
	return nil
}

// target is the extension a probe rule exercises: its -m match, or its -j
// target when it has no match.
func target(rule []string) string {
	if i := slices.Index(rule, "-m"); i >= 0 && rule[i+1] != "tcp" {
		return rule[i+1]
	}
	return rule[slices.Index(rule, "-j")+1]
}

func features(checks []Check) []string {
	var names []string
	for _, c := range checks {
		names = append(names, c.Feature.Module+c.Feature.Package)
	}
	return names
}

func TestRouterChecksFollowModeAndFlags(t *testing.T) {
	base := []string{"", "", "iptables", "iptable_mangle", "xt_HMARK", "xt_comment", "ip_set_hash_ip", "xt_set"}
	sticky := []string{"xt_conntrack", "xt_connmark", "xt_mark", "iptable_raw", "xt_CT"}
	// Nexthop objects have neither module nor package: "".
	greBase := slices.Concat(base[:2], []string{""}, base[2:])
	mpls := []string{"mpls_router", "mpls_iptunnel"} // and no nexthop objects
	for _, tc := range []struct {
		name string
		p    RouterParams
		want []string
	}{
		{"gre creating its device", RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1},
			slices.Concat(greBase[:3], []string{"ip_gre"}, greBase[3:])},
		{"gre over an existing device", RouterParams{Mode: encap.GRE, Generations: 1}, greBase},
		{"mpls ignores --gre-device-create", RouterParams{Mode: encap.MPLS, CreateGREDevice: true, Generations: 1},
			slices.Concat(base[:2], mpls, base[2:])},
		{"generations use conntrack", RouterParams{Mode: encap.GRE, Generations: 4}, slices.Concat(greBase, sticky)},
		{"mpls with generations", RouterParams{Mode: encap.MPLS, Generations: 2},
			slices.Concat(base[:2], mpls, base[2:], sticky)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := features(Router(tc.p)); !slices.Equal(got, tc.want) {
				t.Errorf("Router(%+v) modules %q, want %q", tc.p, got, tc.want)
			}
		})
	}
	// The first two are the built-in options.
	got := Router(RouterParams{Mode: encap.GRE, Generations: 1})
	if got[0].Feature != PolicyRouting || got[1].Feature != LightweightTunnels {
		t.Errorf("Router starts with %v, %v; want policy routing and lightweight tunnels", got[0].Feature, got[1].Feature)
	}
}

func TestEndpointChecksFollowMode(t *testing.T) {
	for mode, want := range map[encap.Mode][]Feature{
		encap.GRE:  {GRE},
		encap.MPLS: {MPLSRouting},
		"vxlan":    nil,
	} {
		var got []Feature
		for _, c := range Endpoint(mode, false) {
			got = append(got, c.Feature)
		}
		if !slices.Equal(got, want) {
			t.Errorf("Endpoint(%q, false) = %v, want %v", mode, got, want)
		}
		got = nil
		for _, c := range Endpoint(mode, true) {
			got = append(got, c.Feature)
		}
		if want = append(want, IPTablesCommand, FilterTable, CommentMatch, ConntrackMatch); !slices.Equal(got, want) {
			t.Errorf("Endpoint(%q, true) = %v, want %v", mode, got, want)
		}
	}
}

func TestEveryCheckProbesWhatItNames(t *testing.T) {
	// Each probe of the most demanding router and of both agents fails
	// alone, and only its own feature is reported.
	checks := slices.Concat(Router(RouterParams{Mode: encap.MPLS, Generations: 2}),
		Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1}), Endpoint(encap.GRE, false))
	probes := map[Feature][]string{
		PolicyRouting: {"rules"}, LightweightTunnels: {"encap-ip"}, FlowBasedGRE: {"flow-gre"}, GRE: {"gre"},
		MPLSRouting: {"mpls"}, MPLSEncap: {"encap-mpls"}, IPTablesCommand: {"iptables"},
		MangleTable: {"chain:mangle"}, RawTable: {"chain:raw"}, HMARK: {"rule:mangle:HMARK"},
		CommentMatch: {"rule:mangle:comment"}, ConntrackMatch: {"rule:mangle:conntrack"},
		Connmark: {"rule:mangle:connmark"}, MarkMatch: {"rule:mangle:mark"}, CTTarget: {"rule:raw:CT"},
		IPSets: {"ipset"}, SetMatch: {"rule:mangle:set"},
		// Probed in gre mode only: mpls mode keeps inline routes.
		NextHopObjects: {"nexthop-ip"},
	}
	for _, c := range checks {
		names, ok := probes[c.Feature]
		if !ok {
			t.Fatalf("no probe known for %v", c.Feature)
		}
		k := &fakeKernel{fail: map[string]error{}}
		for _, probe := range names {
			k.fail[probe] = errors.New("boom")
		}
		err := Run(k, []Check{c})
		m := Missing(err)
		if len(m) != 1 || m[0].Feature != c.Feature {
			t.Errorf("%v with probes %s failing: %v", c.Feature, names, err)
		}
		if err := Run(&fakeKernel{}, []Check{c}); err != nil {
			t.Errorf("%v with nothing failing: %v", c.Feature, err)
		}
	}
}

func TestRunReportsEveryMissingFeatureByNameOptionAndModule(t *testing.T) {
	k := &fakeKernel{fail: map[string]error{
		"flow-gre":          errors.New("operation not supported"),
		"rule:mangle:HMARK": errors.New("iptables: No chain/target/match by that name."),
		"rules":             errors.New("address family not supported by protocol"),
	}}
	err := Run(k, Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1}))
	want := []string{
		"kernel lacks policy routing (CONFIG_IP_MULTIPLE_TABLES, built in: not available as a module): address family not supported by protocol",
		"kernel lacks flow-based GRE (CONFIG_NET_IPGRE, module ip_gre): operation not supported",
		"kernel lacks the iptables HMARK target (CONFIG_NETFILTER_XT_TARGET_HMARK, module xt_HMARK): iptables: No chain/target/match by that name.",
	}
	if got := strings.Split(err.Error(), "\n"); !slices.Equal(got, want) {
		t.Errorf("error:\n%s\nwant:\n%s", err, strings.Join(want, "\n"))
	}
	if m := Missing(err); len(m) != 3 || m[1].Feature != FlowBasedGRE {
		t.Errorf("Missing = %v", m)
	}
	// Every probe ran (the missing ones twice around modprobe, except
	// policy routing, which cannot be a module).
	for _, c := range []string{"rules", "encap-ip", "flow-gre", "modprobe:ip_gre", "iptables", "chain:mangle", "rule:mangle:HMARK", "modprobe:xt_HMARK", "rule:mangle:comment"} {
		if !slices.Contains(k.calls, c) {
			t.Errorf("probe %s did not run; calls %v", c, k.calls)
		}
	}
	if slices.Contains(k.calls, "modprobe:") {
		t.Errorf("modprobe without a module: %v", k.calls)
	}
}

func TestRunRetriesAfterLoadingTheModule(t *testing.T) {
	k := &fakeKernel{
		fail:  map[string]error{"mpls": errors.New("no /proc/sys/net/mpls"), "encap-mpls": errors.New("operation not supported")},
		loads: map[string][]string{"mpls_router": {"mpls"}},
	}
	err := Run(k, Router(RouterParams{Mode: encap.MPLS, Generations: 1}))
	m := Missing(err)
	if len(m) != 1 || m[0].Feature != MPLSEncap {
		t.Fatalf("after modprobe mpls_router: %v", err)
	}
	if want := "kernel lacks MPLS encapsulation of IP routes (CONFIG_MPLS_IPTUNNEL, module mpls_iptunnel): operation not supported"; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	if i := slices.Index(k.calls, "modprobe:mpls_router"); i < 0 || k.calls[i+1] != "mpls" {
		t.Errorf("MPLS routing not probed again after modprobe: %v", k.calls)
	}
}

func TestRunSkipsChecksWhosePrerequisiteIsMissing(t *testing.T) {
	k := &fakeKernel{fail: map[string]error{"iptables": errors.New(`exec: "iptables": executable file not found in $PATH`)}}
	err := Run(k, Router(RouterParams{Mode: encap.GRE, Generations: 3}))
	if want := `the iptables command (package iptables) is missing: exec: "iptables": executable file not found in $PATH`; err == nil || err.Error() != want {
		t.Fatalf("error %v, want %q", err, want)
	}
	for _, c := range k.calls {
		if strings.HasPrefix(c, "chain:") || strings.HasPrefix(c, "rule:") || strings.HasPrefix(c, "modprobe:") {
			t.Errorf("%s probed without iptables", c)
		}
	}

	k = &fakeKernel{fail: map[string]error{"chain:raw": errors.New("can't initialize iptables table `raw'")}}
	err = Run(k, Router(RouterParams{Mode: encap.GRE, Generations: 3}))
	if m := Missing(err); len(m) != 1 || m[0].Feature != RawTable {
		t.Errorf("raw table missing: %v", err)
	}
	if slices.Contains(k.calls, "rule:raw:CT") {
		t.Errorf("CT probed without the raw table: %v", k.calls)
	}
	if !slices.Contains(k.calls, "rule:mangle:conntrack") {
		t.Errorf("mangle rules skipped although only raw is missing: %v", k.calls)
	}
}

func TestNoNextHopObjects(t *testing.T) {
	k := &fakeKernel{fail: map[string]error{"nexthop-ip": errors.New("creating a nexthop object: operation not supported")}}
	err := Run(k, Router(RouterParams{Mode: encap.GRE, Generations: 1}))
	if want := "kernel lacks nexthop objects (Linux 5.3 or later, no kernel option): creating a nexthop object: operation not supported"; err == nil || err.Error() != want {
		t.Errorf("error %v, want %q", err, want)
	}
	if slices.Contains(k.calls, "modprobe:") {
		t.Errorf("modprobe without a module: %v", k.calls)
	}
	// mpls mode uses no nexthop objects (see router/datapath): not probed.
	k = &fakeKernel{}
	if err := Run(k, Router(RouterParams{Mode: encap.MPLS, Generations: 1})); err != nil || slices.Contains(k.calls, "nexthop-ip") {
		t.Errorf("mpls: %v after calls %v, want no nexthop probe", err, k.calls)
	}
}

func TestMissingOfOneError(t *testing.T) {
	if m := Missing(nil); m != nil {
		t.Errorf("Missing(nil) = %v", m)
	}
	one := &MissingError{Feature: GRE, Err: errors.New("x")}
	if m := Missing(one); len(m) != 1 || m[0] != one {
		t.Errorf("Missing(one) = %v", m)
	}
	if !errors.Is(errors.Join(one), one.Err) {
		t.Error("MissingError does not unwrap to the probe's error")
	}
}
