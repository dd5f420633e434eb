package kernelcheck

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// requirePrivileged skips unless root, and fails instead when
// KST_REQUIRE_INTEGRATION=1.
func requirePrivileged(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 && os.Getenv("KST_REQUIRE_INTEGRATION") == "1" {
		t.Fatal("KST_REQUIRE_INTEGRATION=1 but not root: the kernel probes need CAP_NET_ADMIN and CAP_SYS_ADMIN")
	}
	testnetns.RequireRoot(t)
}

// everyCheck is one check of every feature either daemon can need, IPv6's
// included.
func everyCheck() []Check {
	var out []Check
	seen := map[Feature]bool{}
	for _, c := range slices.Concat(Router(RouterParams{Mode: encap.MPLS, Generations: 2, IPv6: true}),
		Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1, IPv6: true}),
		EndpointChecks(EndpointParams{Mode: encap.GRE, NetworkPolicy: true, IPv6: true}),
		EndpointChecks(EndpointParams{Mode: encap.MPLS})) {
		if !seen[c.Feature] {
			seen[c.Feature] = true
			out = append(out, c)
		}
	}
	return out
}

// groundTruth finds out whether the kernel has f the way an operator would:
// with ip, iptables and ip6tables commands in a fresh namespace of its own.
// It returns nil when the commands worked.
func groundTruth(t *testing.T, f Feature) error {
	t.Helper()
	ns := testnetns.New(t)
	run := func(cmds ...[]string) error {
		for _, c := range cmds {
			if out, err := ns.Output(c[0], c[1:]...); err != nil {
				return errors.New(strings.Join(c, " ") + ": " + err.Error() + ": " + strings.TrimSpace(out))
			}
		}
		return nil
	}
	xtables := func(binary, table string, rule ...string) error {
		if _, err := exec.LookPath(binary); err != nil {
			return err
		}
		cmds := [][]string{{binary, "-w", "-t", table, "-N", "GROUND-TRUTH"}}
		if len(rule) > 0 {
			cmds = append(cmds, append([]string{binary, "-w", "-t", table, "-A", "GROUND-TRUTH"}, rule...))
		}
		return run(cmds...)
	}
	iptables := func(table string, rule ...string) error { return xtables("iptables", table, rule...) }
	ip6tables := func(table string, rule ...string) error { return xtables("ip6tables", table, rule...) }
	switch f {
	case FlowBasedGRE:
		return run([]string{"ip", "link", "add", "gt", "type", "gre", "external"})
	case GRE:
		return run([]string{"ip", "link", "add", "gt", "type", "gre", "local", "198.51.100.7"})
	case PolicyRouting:
		return run([]string{"ip", "rule", "add", "fwmark", "0x10", "lookup", "10"})
	case LightweightTunnels:
		return run([]string{"ip", "route", "add", "198.51.100.1/32", "encap", "ip", "id", "5", "dst", "198.51.100.2", "dev", "lo", "table", "10"})
	case MPLSEncap:
		return run([]string{"ip", "route", "add", "198.51.100.1/32", "encap", "mpls", "200", "dev", "lo", "table", "10"})
	case NextHopObjects:
		// everyCheck keeps mpls mode's probe, skipped where encap mpls is
		// missing (as on the development host): the feature itself is
		// what the commands check.
		return run([]string{"ip", "nexthop", "add", "id", "5", "encap", "ip", "id", "5", "dst", "198.51.100.2", "dev", "lo"},
			[]string{"ip", "route", "add", "198.51.100.1/32", "nhid", "5", "table", "10"})
	case MPLSRouting:
		err := ns.Do(func() error { return os.WriteFile("/proc/sys/net/mpls/platform_labels", []byte("300\n"), 0o644) })
		if err != nil {
			return err
		}
		return run([]string{"ip", "-f", "mpls", "route", "add", "200", "dev", "lo"})
	case BridgeFilter:
		// ebtables-nft (in Debian's iptables package) writes the bridge
		// family through nftables: a base chain and an Ethernet type match.
		if _, err := exec.LookPath("ebtables-nft"); err != nil {
			return err
		}
		return run([]string{"ebtables-nft", "-t", "filter", "-A", "FORWARD", "-p", "0x8847", "-j", "DROP"})
	case IPTablesCommand:
		_, err := exec.LookPath("iptables")
		return err
	case MangleTable:
		return iptables("mangle")
	case RawTable:
		return iptables("raw")
	case FilterTable:
		return iptables("filter")
	case HMARK:
		return iptables("mangle", "-j", "HMARK", "--hmark-tuple", "src,dst", "--hmark-mod", "3", "--hmark-rnd", "0x7")
	case CommentMatch:
		return iptables("mangle", "-m", "comment", "--comment", "ground truth")
	case ConntrackMatch:
		return iptables("mangle", "-m", "conntrack", "--ctstate", "NEW")
	case Connmark:
		return iptables("mangle", "-m", "connmark", "--mark", "0x2", "-j", "CONNMARK", "--save-mark")
	case MarkMatch:
		return iptables("mangle", "-m", "mark", "--mark", "0x2")
	case CTTarget:
		return iptables("raw", "-p", "udp", "-j", "CT", "--notrack")
	case IPSets:
		// No ipset command here: the set is created through netlink.
		return ns.IPSets().IpsetCreate("GROUND-TRUTH", "hash:ip", netlink.IpsetCreateOptions{})
	case PortSets:
		return ns.IPSets().IpsetCreate("GROUND-TRUTH-P", "hash:ip,port", netlink.IpsetCreateOptions{})
	case SynSets:
		timeout := uint32(10)
		return ns.IPSets().IpsetCreate("GROUND-TRUTH-S", "hash:ip,port,ip", netlink.IpsetCreateOptions{Timeout: &timeout})
	case SetMatch:
		if err := ns.IPSets().IpsetCreate("GROUND-TRUTH", "hash:ip", netlink.IpsetCreateOptions{}); err != nil {
			return err
		}
		return iptables("mangle", "-m", "set", "--match-set", "GROUND-TRUTH", "src")

	case IPv6Protocol:
		return run([]string{"ip", "-6", "route", "add", "unreachable", "2001:db8::9/128"})
	case FlowBasedGRE6:
		return run([]string{"ip", "link", "add", "gt", "type", "ip6gre", "external"})
	case GRE6:
		return run([]string{"ip", "link", "add", "gt", "type", "ip6gre", "local", "2001:db8::7"})
	case PolicyRouting6:
		return run([]string{"ip", "-6", "rule", "add", "fwmark", "0x10", "lookup", "10"})
	case LightweightTunnels6:
		return run([]string{"ip", "-6", "route", "add", "2001:db8::1/128", "encap", "ip6", "id", "5", "dst", "2001:db8::2", "dev", "lo", "table", "10"})
	case MPLSEncap6:
		return run([]string{"ip", "-6", "route", "add", "2001:db8::1/128", "encap", "mpls", "200", "dev", "lo", "table", "10"})
	case NextHopObjects6:
		return run([]string{"ip", "-6", "nexthop", "add", "id", "5", "encap", "ip6", "id", "5", "dst", "2001:db8::2", "dev", "lo"},
			[]string{"ip", "-6", "route", "add", "2001:db8::1/128", "nhid", "5", "table", "10"})
	case IP6TablesCommand:
		_, err := exec.LookPath("ip6tables")
		return err
	case MangleTable6:
		return ip6tables("mangle")
	case RawTable6:
		return ip6tables("raw")
	case FilterTable6:
		return ip6tables("filter")
	case HMARK6:
		return ip6tables("mangle", "-j", "HMARK", "--hmark-tuple", "src,dst", "--hmark-mod", "3", "--hmark-rnd", "0x7")
	case CommentMatch6:
		return ip6tables("mangle", "-m", "comment", "--comment", "ground truth")
	case ConntrackMatch6:
		return ip6tables("mangle", "-m", "conntrack", "--ctstate", "NEW")
	case Connmark6:
		return ip6tables("mangle", "-m", "connmark", "--mark", "0x2", "-j", "CONNMARK", "--save-mark")
	case MarkMatch6:
		return ip6tables("mangle", "-m", "mark", "--mark", "0x2")
	case CTTarget6:
		return ip6tables("raw", "-p", "udp", "-j", "CT", "--notrack")
	case IPSets6:
		return ns.IPSets().IpsetCreate("GROUND-TRUTH6", "hash:ip", netlink.IpsetCreateOptions{Family: unix.AF_INET6})
	case PortSets6:
		return ns.IPSets().IpsetCreate("GROUND-TRUTH6-P", "hash:ip,port", netlink.IpsetCreateOptions{Family: unix.AF_INET6})
	case SynSets6:
		timeout := uint32(10)
		return ns.IPSets().IpsetCreate("GROUND-TRUTH6-S", "hash:ip,port,ip", netlink.IpsetCreateOptions{Family: unix.AF_INET6, Timeout: &timeout})
	case SetMatch6:
		// ip6tables refuses a set of family inet.
		if err := ns.IPSets().IpsetCreate("GROUND-TRUTH6", "hash:ip", netlink.IpsetCreateOptions{Family: unix.AF_INET6}); err != nil {
			return err
		}
		return ip6tables("mangle", "-m", "set", "--match-set", "GROUND-TRUTH6", "src")
	}
	t.Fatalf("no ground truth for %v", f)
	return nil
}

// compareWithGroundTruth runs every check with p and compares each outcome
// with groundTruth's.
func compareWithGroundTruth(t *testing.T, p *Probes, truth map[Feature]error) {
	t.Helper()
	err := Run(p, everyCheck())
	missing := map[Feature]*MissingError{}
	for _, m := range Missing(err) {
		missing[m.Feature] = m
	}
	for _, c := range everyCheck() {
		f := c.Feature
		m, gotMissing := missing[f]
		switch wantMissing := truth[f] != nil; {
		case gotMissing && !wantMissing:
			t.Errorf("%v reported missing (%v), but the commands worked", f, m.Err)
		case !gotMissing && wantMissing:
			t.Errorf("%v reported present, but the commands failed: %v", f, truth[f])
		case gotMissing:
			msg := m.Error()
			for _, part := range []string{f.Name, f.Option, f.Module, f.Package} {
				if !strings.Contains(msg, part) {
					t.Errorf("error %q does not name %q", msg, part)
				}
			}
			t.Logf("missing, as the commands agree: %s", msg)
		}
	}
}

// snapshot is what a namespace holds, as ip, iptables-save and
// ip6tables-save print it.
func snapshot(t *testing.T, ns *testnetns.NS) string {
	t.Helper()
	var b strings.Builder
	for _, c := range [][]string{
		{"ip", "-d", "-o", "link", "show"}, {"ip", "-o", "addr", "show"}, {"ip", "rule", "show"}, {"ip", "-6", "rule", "show"},
		{"ip", "route", "show", "table", "all"}, {"ip", "-6", "route", "show", "table", "all"}, {"ip", "nexthop", "show"},
		{"iptables-save"}, {"ip6tables-save"},
	} {
		out, _ := ns.Output(c[0], c[1:]...)
		for _, l := range strings.Split(out, "\n") {
			if !strings.HasPrefix(l, "#") { // iptables-save's dated comments
				b.WriteString(l + "\n")
			}
		}
	}
	b.WriteString(ns.IPSetState())
	return b.String()
}

// TestProbesAgreeWithTheCommands probes every feature, IPv6's included, in a
// throwaway namespace and in place in a given one, and compares each result
// with what the ip, iptables and ip6tables commands say, so it holds on any
// kernel. On the development host (no GRE, no ip6gre, no MPLS) GRE, ip6gre
// and MPLS (routing, and encap mpls of both families) are reported missing
// with their options, HMARK and the rest present.
func TestProbesAgreeWithTheCommands(t *testing.T) {
	requirePrivileged(t)
	truth := map[Feature]error{}
	for _, c := range everyCheck() {
		truth[c.Feature] = groundTruth(t, c.Feature)
	}

	t.Run("throwaway namespace", func(t *testing.T) {
		p, err := Open()
		if err != nil {
			t.Fatal(err)
		}
		if !p.Scratch() {
			t.Error("as root the probes should run in a throwaway namespace")
		}
		compareWithGroundTruth(t, p, truth)
		if err := p.Close(); err != nil {
			t.Errorf("left behind: %v", err)
		}
	})

	t.Run("in place", func(t *testing.T) {
		ns := testnetns.New(t)
		p, err := OpenIn(ns.Handle)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if p.Scratch() {
			t.Error("probes with a namespace must run in it")
		}
		// A first round loads what modules it can (their fallback
		// devices then appear in every namespace); the second must leave
		// the namespace exactly as it found it.
		_ = Run(p, everyCheck())
		before := snapshot(t, ns)
		compareWithGroundTruth(t, p, truth)
		if after := snapshot(t, ns); after != before {
			t.Errorf("the probes changed the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		if err := p.Close(); err != nil {
			t.Errorf("left behind: %v", err)
		}
	})
}

// TestProbesLeaveTheCallersNamespaceAlone: probes that create their own
// namespace leave nothing of theirs in the caller's.
func TestProbesLeaveTheCallersNamespaceAlone(t *testing.T) {
	requirePrivileged(t)
	p, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	v6 := p.IPv6().(*Probes)
	names, chain := []string{p.linkName(), v6.linkName()}, p.chainName()
	_ = Run(p, everyCheck())
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
	if out, _ := exec.Command("ip", "-o", "link", "show").CombinedOutput(); strings.Contains(string(out), names[0]) || strings.Contains(string(out), names[1]) {
		t.Errorf("probe device %s in the caller's namespace:\n%s", names, out)
	}
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if out, err := exec.Command(save).CombinedOutput(); err == nil && strings.Contains(string(out), chain) {
			t.Errorf("probe chain %s in the caller's namespace (%s)", chain, save)
		}
	}
	for _, ip := range []string{"-4", "-6"} {
		if out, err := exec.Command("ip", ip, "route", "show", "table", fmt.Sprint(probeTable)).CombinedOutput(); err == nil && len(out) > 0 {
			t.Errorf("probe route in the caller's namespace (ip %s):\n%s", ip, out)
		}
	}
	sets, err := netlink.IpsetListAll()
	for _, s := range sets {
		if strings.Contains(s.SetName, p.suffix) {
			t.Errorf("probe ipset %s in the caller's namespace", s.SetName)
		}
	}
	if err != nil {
		t.Logf("ipsets not checked: %v", err)
	}
}

// TestVerifyLogsEachMissingFeature runs the router's gre-mode checks, IPv6's
// included, for real and compares the log with Run's outcome: a line per
// missing feature with its option, or one line saying all is there.
func TestVerifyLogsEachMissingFeature(t *testing.T) {
	requirePrivileged(t)
	log, hook := test.NewNullLogger()
	checks := Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1, IPv6: true})
	err := Verify(checks, log)
	missing := Missing(err)
	var lines []*logrus.Entry
	for _, e := range hook.AllEntries() {
		if e.Message == "kernel feature missing" {
			lines = append(lines, e)
		}
	}
	if len(lines) != len(missing) {
		t.Fatalf("%d log lines for %d missing features: %v", len(lines), len(missing), err)
	}
	for i, m := range missing {
		if lines[i].Data["feature"] != m.Feature.Name || lines[i].Data["option"] != m.Feature.Option || lines[i].Level != logrus.ErrorLevel {
			t.Errorf("log line %d: %v, want option %s", i, lines[i].Data, m.Feature.Option)
		}
	}
	if err == nil && hook.LastEntry().Message != "kernel has every feature needed" {
		t.Errorf("no summary line: %v", hook.AllEntries())
	}
	if err != nil {
		t.Logf("this host's router (gre mode) would stop with:\n%v", err)
	}
}

// helperEnv makes the test binary run TestHelperProbesWithoutSysAdmin.
const helperEnv = "KST_KERNELCHECK_HELPER"

// TestProbesWithoutSysAdmin runs the probes as the router's manifest runs
// it, with CAP_NET_ADMIN but without CAP_SYS_ADMIN: they cannot create a
// namespace, so they run in the daemon's own (here a test namespace), where
// they must agree with the commands and leave nothing behind.
func TestProbesWithoutSysAdmin(t *testing.T) {
	requirePrivileged(t)
	setpriv, err := exec.LookPath("setpriv")
	if err == nil {
		err = exec.Command(setpriv, "--bounding-set=-sys_admin", "--", "true").Run()
	}
	if err != nil {
		t.Skipf("needs util-linux's setpriv to drop CAP_SYS_ADMIN: %v", err)
	}
	ns := testnetns.New(t)
	probe := func() map[Feature]bool {
		t.Helper()
		cmd := exec.Command(setpriv, "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--",
			os.Args[0], "-test.run=^TestHelperProbesWithoutSysAdmin$", "-test.v")
		cmd.Env = append(os.Environ(), helperEnv+"=1")
		var out []byte
		if err := ns.Do(func() (err error) { out, err = cmd.CombinedOutput(); return err }); err != nil {
			t.Fatalf("helper: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "in place: true") {
			t.Fatalf("helper did not run in place:\n%s", out)
		}
		missing := map[Feature]bool{}
		for _, c := range everyCheck() {
			missing[c.Feature] = strings.Contains(string(out), "missing: "+c.Feature.String()+"\n")
		}
		return missing
	}
	probe() // loads what modules it can
	before := snapshot(t, ns)
	missing := probe()
	if after := snapshot(t, ns); after != before {
		t.Errorf("the probes changed the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	for _, c := range everyCheck() {
		f := c.Feature
		if truth := groundTruth(t, f); missing[f] != (truth != nil) {
			t.Errorf("%v: reported missing %v, commands say %v", f, missing[f], truth)
		}
	}
}

// TestHelperProbesWithoutSysAdmin is TestProbesWithoutSysAdmin's child.
func TestHelperProbesWithoutSysAdmin(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		t.Skip("run by TestProbesWithoutSysAdmin")
	}
	p, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("in place: %v\n", !p.Scratch())
	for _, m := range Missing(Run(p, everyCheck())) {
		fmt.Printf("missing: %v\n", m.Feature)
	}
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
}

// probesInPlace opens probes in place in a namespace of the test's own,
// closed when the test ends.
func probesInPlace(t *testing.T) (*Probes, *testnetns.NS) {
	t.Helper()
	requirePrivileged(t)
	ns := testnetns.New(t)
	p, err := OpenIn(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, ns
}

// TestNextHopProbeInPlace runs gre mode's nexthop probe (everyCheck keeps
// mpls mode's) in place: this host has nexthop objects and encap ip, and
// the probe leaves the namespace as it found it.
func TestNextHopProbeInPlace(t *testing.T) {
	p, ns := probesInPlace(t)
	before := snapshot(t, ns)
	if err := p.EncapIPNextHop(); err != nil {
		t.Errorf("EncapIPNextHop: %v (the kernel has had nexthop objects since 5.3)", err)
	}
	if after := snapshot(t, ns); after != before {
		t.Errorf("the probe changed the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
}

// TestNextHopProbeInPlaceIPv6 is TestNextHopProbeInPlace for an IPv6 nexthop
// object with encap ip6 and an IPv6 route through it.
func TestNextHopProbeInPlaceIPv6(t *testing.T) {
	p, ns := probesInPlace(t)
	before := snapshot(t, ns)
	if err := p.IPv6().EncapIPNextHop(); err != nil {
		t.Errorf("IPv6 EncapIPNextHop: %v (the kernel has had IPv6 nexthop objects since 5.3)", err)
	}
	if after := snapshot(t, ns); after != before {
		t.Errorf("the probe changed the namespace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
}

// TestIPv6ViewIsTheSameProbes: the IPv6 view shares the namespace and the
// leftovers (Close reports what either family's probes left), and is its
// own IPv6 view.
func TestIPv6ViewIsTheSameProbes(t *testing.T) {
	requirePrivileged(t)
	p, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	v6, ok := p.IPv6().(*Probes)
	if !ok || !v6.ipv6 || v6.session != p.session || v6.IPv6() != Kernel(v6) || p.IPv6() != Kernel(v6) {
		t.Fatalf("IPv6 view %#v of %#v", p.IPv6(), p)
	}
	boom := errors.New("device busy")
	v6.leftover("an IPv6 probe object", boom)
	if err := p.Close(); !errors.Is(err, boom) || !strings.Contains(err.Error(), "an IPv6 probe object") {
		t.Errorf("Close = %v, want the IPv6 view's leftover", err)
	}
}

// TestIP6TablesBinary: the IPv6 probes run the counterpart of the iptables
// binary unless told another, and report a missing one as the ip6tables
// command's absence.
func TestIP6TablesBinary(t *testing.T) {
	for in, want := range map[string]string{
		"iptables": "ip6tables", "iptables-nft": "ip6tables-nft", "/usr/sbin/iptables-legacy": "/usr/sbin/ip6tables-legacy",
		"my-wrapper": "ip6tables",
	} {
		if got := ip6tablesOf(in); got != want {
			t.Errorf("ip6tablesOf(%q) = %q, want %q", in, got, want)
		}
	}
	requirePrivileged(t)
	if _, err := exec.LookPath("ip6tables"); err != nil {
		t.Skip("needs ip6tables")
	}
	ns := testnetns.New(t)
	for _, tc := range []struct {
		opts    []Option
		missing bool
	}{
		{nil, false},
		{[]Option{WithIPTables("iptables-kst-none")}, true},
		{[]Option{WithIPTables("iptables-kst-none"), WithIP6Tables("ip6tables")}, false},
		{[]Option{WithIP6Tables("ip6tables-kst-none")}, true},
	} {
		p, err := OpenIn(ns.Handle, tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		err = Run(p, Router(RouterParams{Mode: encap.GRE, IPv6: true})[len(Router(RouterParams{Mode: encap.GRE})):])
		got := slices.ContainsFunc(Missing(err), func(m *MissingError) bool { return m.Feature == IP6TablesCommand })
		if got != tc.missing {
			t.Errorf("%s: ip6tables missing %v, want %v: %v", p.ip6tables, got, tc.missing, err)
		}
		if err := p.Close(); err != nil {
			t.Errorf("left behind: %v", err)
		}
	}
}

// TestRulesAtOnce: the rules of every check of a family, tried together in
// a namespace, pass on this kernel and leave nothing behind; one rule with
// a target no kernel has makes the whole try fail, and still leaves
// nothing behind.
func TestRulesAtOnce(t *testing.T) {
	p, ns := probesInPlace(t)
	for _, ipv6 := range []bool{false, true} {
		_, rules := familyRules(everyCheck(), ipv6)
		view := Kernel(p)
		if ipv6 {
			view = p.IPv6()
		}
		if len(rules) < 5 {
			t.Fatalf("ipv6=%v: only %d rules: %v", ipv6, len(rules), rules)
		}
		// A first try makes the tables appear (and loads modules); from
		// then on a try must leave the namespace exactly as it was.
		if err := view.IPTablesRules(rules); err != nil {
			t.Errorf("ipv6=%v: %d rules together: %v", ipv6, len(rules), err)
		}
		before := snapshot(t, ns)
		if err := view.IPTablesRules(rules); err != nil {
			t.Errorf("ipv6=%v: %d rules together, again: %v", ipv6, len(rules), err)
		}
		bogus := append(slices.Clone(rules), TableRule{Table: "mangle", Rule: []string{"-j", "KSTNOSUCHTARGET"}})
		if err := view.IPTablesRules(bogus); err == nil || !strings.Contains(err.Error(), "at once") {
			t.Errorf("ipv6=%v: with a target no kernel has: %v, want an error", ipv6, err)
		}
		if after := snapshot(t, ns); after != before {
			t.Errorf("ipv6=%v: the rules tried together changed the namespace:\nbefore:\n%s\nafter:\n%s", ipv6, before, after)
		}
	}
}
