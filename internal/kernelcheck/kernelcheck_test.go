package kernelcheck

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// fakeKernel answers each probe from fail (by probe name, "rule:TABLE:TARGET"
// for iptables rules, prefixed "6:" in the IPv6 view) and records the calls.
type fakeKernel struct {
	fail map[string]error
	// loads makes LoadModule of a module succeed and clear these probes.
	loads map[string][]string
	calls []string
	// root is the fake whose IPv6 view this is (nil in the fake itself),
	// and prefix "6:" then.
	root   *fakeKernel
	prefix string
}

// top is the fake that holds fail, loads and calls.
func (f *fakeKernel) top() *fakeKernel {
	if f.root != nil {
		return f.root
	}
	return f
}

func (f *fakeKernel) probe(name string) error {
	t := f.top()
	t.calls = append(t.calls, f.prefix+name)
	return t.fail[f.prefix+name]
}

func (f *fakeKernel) IPv6() Kernel {
	if f.root != nil {
		return f
	}
	return &fakeKernel{root: f, prefix: "6:"}
}

func (f *fakeKernel) IPStack() error                   { return f.probe("stack") }
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
func (f *fakeKernel) PortSet() error                   { return f.probe("portset") }
func (f *fakeKernel) SynSet() error                    { return f.probe("synset") }
func (f *fakeKernel) BridgeFilter() error              { return f.probe("bridge-filter") }
func (f *fakeKernel) ReplyNotrack() error              { return f.probe("reply-notrack") }
func (f *fakeKernel) IPTablesRule(table string, rule ...string) error {
	return f.probe("rule:" + table + ":" + target(rule))
}

// IPTablesRules, recorded as "together", fails with the first failing
// probe among iptables and each rule's.
func (f *fakeKernel) IPTablesRules(rules []TableRule) error {
	t := f.top()
	t.calls = append(t.calls, f.prefix+"together")
	names := []string{"iptables"}
	for _, r := range rules {
		if len(r.Rule) == 0 {
			names = append(names, "chain:"+r.Table)
		} else {
			names = append(names, "rule:"+r.Table+":"+target(r.Rule))
		}
	}
	for _, name := range names {
		if err := t.fail[f.prefix+name]; err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeKernel) LoadModule(name string) error {
	f = f.top()
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
	base := []string{"", "", "iptables", "iptable_mangle", "xt_HMARK", "xt_comment", "ip_set_hash_ip", "xt_set", "ip_set_hash_ipport"}
	sticky := []string{"xt_connmark", "xt_mark", "iptable_raw", "xt_CT", "ip_set_hash_ipportip"}
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
		{"generations use connmarks", RouterParams{Mode: encap.GRE, Generations: 4}, slices.Concat(greBase, sticky)},
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

// featuresOf lists the features of checks in order.
func featuresOf(checks []Check) []Feature {
	var out []Feature
	for _, c := range checks {
		out = append(out, c.Feature)
	}
	return out
}

func TestRouterIPv6ChecksFollowTheIPv4Ones(t *testing.T) {
	tables := []Feature{IP6TablesCommand, MangleTable6, HMARK6, CommentMatch6, IPSets6, SetMatch6, PortSets6}
	sticky := []Feature{Connmark6, MarkMatch6, RawTable6, CTTarget6, SynSets6}
	for _, tc := range []struct {
		name string
		p    RouterParams
		want []Feature
	}{
		{"gre creating its devices", RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1, IPv6: true},
			slices.Concat([]Feature{IPv6Protocol, PolicyRouting6, LightweightTunnels6, NextHopObjects6, FlowBasedGRE6}, tables)},
		{"gre over existing devices, with generations", RouterParams{Mode: encap.GRE, Generations: 4, IPv6: true},
			slices.Concat([]Feature{IPv6Protocol, PolicyRouting6, LightweightTunnels6, NextHopObjects6}, tables, sticky)},
		{"mpls: encap mpls on IPv6 routes, MPLS routing once (IPv4's)", RouterParams{Mode: encap.MPLS, CreateGREDevice: true, Generations: 1, IPv6: true},
			slices.Concat([]Feature{IPv6Protocol, PolicyRouting6, LightweightTunnels6, MPLSEncap6}, tables)},
		{"mpls with generations", RouterParams{Mode: encap.MPLS, Generations: 2, IPv6: true},
			slices.Concat([]Feature{IPv6Protocol, PolicyRouting6, LightweightTunnels6, MPLSEncap6}, tables, sticky)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v4 := tc.p
			v4.IPv6 = false
			want := slices.Concat(featuresOf(Router(v4)), tc.want)
			checks := Router(tc.p)
			if got := featuresOf(checks); !slices.Equal(got, want) {
				t.Errorf("Router(%+v):\n%v\nwant\n%v", tc.p, got, want)
			}
			// Without IPv6 no other IPv6 check can tell anything.
			for _, c := range checks[len(Router(v4)):] {
				if c.Feature != IPv6Protocol && !slices.Contains(c.Requires, IPv6Protocol) {
					t.Errorf("%v does not require IPv6", c.Feature)
				}
			}
		})
	}
}

// TestIPv6FeaturesAreTheirOwn: Run keys missing features by value, and
// operators read them by name: no IPv6 feature may equal or be named like
// an IPv4 one.
func TestIPv6FeaturesAreTheirOwn(t *testing.T) {
	v4 := slices.Concat(featuresOf(Router(RouterParams{Mode: encap.MPLS, Generations: 2})),
		featuresOf(Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true})),
		featuresOf(EndpointChecks(EndpointParams{Mode: encap.GRE, NetworkPolicy: true})))
	all := slices.Concat(featuresOf(Router(RouterParams{Mode: encap.MPLS, Generations: 2, IPv6: true})),
		featuresOf(Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, IPv6: true})),
		featuresOf(EndpointChecks(EndpointParams{Mode: encap.GRE, NetworkPolicy: true, IPv6: true})))
	names := map[string]Feature{}
	for _, f := range all {
		if g, ok := names[f.Name]; ok && g != f {
			t.Errorf("two features named %q: %v and %v", f.Name, g, f)
		}
		names[f.Name] = f
	}
	var v6 []Feature
	for _, f := range all {
		if !slices.Contains(v4, f) && !slices.Contains(v6, f) {
			v6 = append(v6, f)
		}
	}
	if want := 21; len(v6) != want { // MPLS routing is of no family
		t.Errorf("%d IPv6 features, want %d: %v", len(v6), want, v6)
	}
	for _, f := range v6 {
		if !strings.Contains(f.Name, "IPv6") && !strings.Contains(f.Name, "ip6tables") && !strings.Contains(f.Name, "inet6") {
			t.Errorf("%v does not say it is IPv6's", f)
		}
	}
}

func TestEndpointIPv6Checks(t *testing.T) {
	policy := []Feature{IPTablesCommand, FilterTable, CommentMatch, ConntrackMatch}
	policy6 := []Feature{IP6TablesCommand, FilterTable6, CommentMatch6, ConntrackMatch6}
	for _, tc := range []struct {
		p    EndpointParams
		want []Feature
	}{
		{EndpointParams{Mode: encap.GRE, IPv6: true}, []Feature{GRE, IPv6Protocol, GRE6}},
		// The pod's MPLS pop route delivers IPv6 as it is.
		{EndpointParams{Mode: encap.MPLS, IPv6: true}, []Feature{MPLSRouting, BridgeFilter, IPv6Protocol}},
		{EndpointParams{Mode: encap.GRE, NetworkPolicy: true, IPv6: true},
			slices.Concat([]Feature{GRE}, policy, []Feature{IPv6Protocol, GRE6}, policy6)},
		{EndpointParams{Mode: encap.MPLS, NetworkPolicy: true, IPv6: true},
			slices.Concat([]Feature{MPLSRouting, BridgeFilter}, policy, []Feature{IPv6Protocol}, policy6)},
		{EndpointParams{Mode: encap.MPLS, NetworkPolicy: true}, slices.Concat([]Feature{MPLSRouting, BridgeFilter}, policy)},
		// One inet table for both families, checked with IPv4's.
		{EndpointParams{Mode: encap.GRE, UntrackReplies: true, IPv6: true}, []Feature{GRE, ReplyNotrack, IPv6Protocol, GRE6}},
	} {
		if got := featuresOf(EndpointChecks(tc.p)); !slices.Equal(got, tc.want) {
			t.Errorf("EndpointChecks(%+v) = %v, want %v", tc.p, got, tc.want)
		}
		if !tc.p.IPv6 {
			if got, want := featuresOf(Endpoint(tc.p.Mode, tc.p.NetworkPolicy)), featuresOf(EndpointChecks(tc.p)); !slices.Equal(got, want) {
				t.Errorf("Endpoint(%q, %v) = %v, want EndpointChecks' %v", tc.p.Mode, tc.p.NetworkPolicy, got, want)
			}
		}
	}
}

func TestEndpointChecksFollowMode(t *testing.T) {
	for mode, want := range map[encap.Mode][]Feature{
		encap.GRE:  {GRE},
		encap.MPLS: {MPLSRouting, BridgeFilter},
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
	// Each probe of the most demanding routers and agents, IPv6 included,
	// fails alone, and only its own feature is reported.
	checks := slices.Concat(Router(RouterParams{Mode: encap.MPLS, Generations: 2, IPv6: true}),
		Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1, IPv6: true}),
		EndpointChecks(EndpointParams{Mode: encap.GRE, NetworkPolicy: true, IPv6: true}))
	// The probes whose failure makes the feature's checks fail (the
	// router's in mangle, the agent's in filter).
	probes := map[Feature][]string{
		PolicyRouting: {"rules"}, LightweightTunnels: {"encap-ip"}, FlowBasedGRE: {"flow-gre"}, GRE: {"gre"},
		MPLSRouting: {"mpls"}, MPLSEncap: {"encap-mpls"}, IPTablesCommand: {"iptables"},
		MangleTable: {"chain:mangle"}, RawTable: {"chain:raw"}, FilterTable: {"chain:filter"}, HMARK: {"rule:mangle:HMARK"},
		CommentMatch: {"rule:mangle:comment", "rule:filter:comment"}, ConntrackMatch: {"rule:mangle:conntrack", "rule:filter:conntrack"},
		Connmark: {"rule:mangle:connmark"}, MarkMatch: {"rule:mangle:mark"}, CTTarget: {"rule:raw:CT"},
		IPSets: {"ipset"}, SetMatch: {"rule:mangle:set"}, PortSets: {"portset"}, SynSets: {"synset"}, BridgeFilter: {"bridge-filter"},
		// Probed in gre mode only: mpls mode keeps inline routes.
		NextHopObjects: {"nexthop-ip"},

		IPv6Protocol: {"6:stack"}, PolicyRouting6: {"6:rules"}, LightweightTunnels6: {"6:encap-ip"},
		FlowBasedGRE6: {"6:flow-gre"}, GRE6: {"6:gre"}, MPLSEncap6: {"6:encap-mpls"}, NextHopObjects6: {"6:nexthop-ip"},
		IP6TablesCommand: {"6:iptables"}, MangleTable6: {"6:chain:mangle"}, RawTable6: {"6:chain:raw"},
		FilterTable6: {"6:chain:filter"}, HMARK6: {"6:rule:mangle:HMARK"},
		CommentMatch6: {"6:rule:mangle:comment", "6:rule:filter:comment"}, ConntrackMatch6: {"6:rule:mangle:conntrack", "6:rule:filter:conntrack"},
		Connmark6: {"6:rule:mangle:connmark"}, MarkMatch6: {"6:rule:mangle:mark"}, CTTarget6: {"6:rule:raw:CT"},
		IPSets6: {"6:ipset"}, SetMatch6: {"6:rule:mangle:set"}, PortSets6: {"6:portset"}, SynSets6: {"6:synset"},
	}
	failing := func(names []string) *fakeKernel {
		k := &fakeKernel{fail: map[string]error{}}
		for _, probe := range names {
			k.fail[probe] = errors.New("boom")
		}
		return k
	}
	for _, c := range checks {
		names, ok := probes[c.Feature]
		if !ok {
			t.Fatalf("no probe known for %v", c.Feature)
		}
		err := Run(failing(names), []Check{c})
		m := Missing(err)
		if len(m) != 1 || m[0].Feature != c.Feature {
			t.Errorf("%v with probes %s failing: %v", c.Feature, names, err)
		}
		if err := Run(&fakeKernel{}, []Check{c}); err != nil {
			t.Errorf("%v with nothing failing: %v", c.Feature, err)
		}
		// Among all the checks, no other feature's check runs these
		// probes (an IPv6 check on the IPv4 view, or the reverse).
		for _, m := range Missing(Run(failing(names), checks)) {
			if m.Feature != c.Feature {
				t.Errorf("probes %s failing: %v reported missing too: %v", names, m.Feature, m.Err)
			}
		}
	}
}

func TestRunSkipsIPv6ChecksWithoutIPv6(t *testing.T) {
	k := &fakeKernel{fail: map[string]error{"6:stack": errors.New("opening an IPv6 socket: address family not supported by protocol")}}
	err := Run(k, Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 2, IPv6: true}))
	if want := "kernel lacks IPv6 (CONFIG_IPV6, module ipv6): opening an IPv6 socket: address family not supported by protocol"; err == nil || err.Error() != want {
		t.Fatalf("error %v, want %q", err, want)
	}
	for _, c := range k.calls {
		if strings.HasPrefix(c, "6:") && c != "6:stack" {
			t.Errorf("%s probed without IPv6", c)
		}
	}
	if !slices.Contains(k.calls, "modprobe:ipv6") || !slices.Contains(k.calls, "together") || !slices.Contains(k.calls, "ipset") {
		t.Errorf("calls %v: want modprobe ipv6 and every IPv4 probe", k.calls)
	}
}

func TestRunReportsIPv6FeaturesByTheirOwnNames(t *testing.T) {
	k := &fakeKernel{fail: map[string]error{
		"6:flow-gre":          errors.New("creating a flow-based ip6gre device: operation not supported"),
		"6:rule:mangle:HMARK": errors.New("ip6tables: No chain/target/match by that name."),
	}}
	err := Run(k, Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1, IPv6: true}))
	want := []string{
		"kernel lacks flow-based IPv6 GRE (CONFIG_IPV6_GRE, module ip6_gre): creating a flow-based ip6gre device: operation not supported",
		"kernel lacks the ip6tables HMARK target (CONFIG_NETFILTER_XT_TARGET_HMARK, module xt_HMARK): ip6tables: No chain/target/match by that name.",
	}
	if err == nil {
		t.Fatal("no error")
	}
	if got := strings.Split(err.Error(), "\n"); !slices.Equal(got, want) {
		t.Errorf("error:\n%s\nwant:\n%s", err, strings.Join(want, "\n"))
	}
	// The IPv4 rules passed together; the IPv6 ones were probed alone.
	for _, c := range []string{"modprobe:ip6_gre", "6:rule:mangle:comment", "flow-gre", "together", "6:together"} {
		if !slices.Contains(k.calls, c) {
			t.Errorf("%s not in calls %v", c, k.calls)
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
	if !slices.Contains(k.calls, "rule:mangle:connmark") {
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

// TestRunTriesEachFamilysRulesAtOnce: when a family's iptables rules all
// work together, none is probed alone; when one fails, each is, and only
// the failing one is reported.
func TestRunTriesEachFamilysRulesAtOnce(t *testing.T) {
	k := &fakeKernel{}
	if err := Run(k, Router(RouterParams{Mode: encap.GRE, Generations: 4, IPv6: true})); err != nil {
		t.Fatal(err)
	}
	for _, c := range k.calls {
		if strings.Contains(c, "chain:") || (strings.Contains(c, "rule:") && !strings.HasSuffix(c, ":set")) {
			t.Errorf("%s probed alone although the family's rules passed together; calls %v", c, k.calls)
		}
	}
	if n := strings.Count(strings.Join(k.calls, " "), "together"); n != 2 {
		t.Errorf("%d tries of rules at once, want one per family: %v", n, k.calls)
	}

	k = &fakeKernel{fail: map[string]error{"6:rule:mangle:connmark": errors.New("ip6tables: No chain/target/match by that name.")}}
	m := Missing(Run(k, Router(RouterParams{Mode: encap.GRE, Generations: 4, IPv6: true})))
	if len(m) != 1 || m[0].Feature != Connmark6 {
		t.Fatalf("missing %v, want only the ip6tables connmark", m)
	}
	if slices.Contains(k.calls, "rule:mangle:HMARK") || !slices.Contains(k.calls, "6:rule:mangle:HMARK") || !slices.Contains(k.calls, "6:rule:raw:CT") {
		t.Errorf("calls %v: want the IPv6 rules probed one by one after failing together, the IPv4 ones not", k.calls)
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
