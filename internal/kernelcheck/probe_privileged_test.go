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

// everyCheck is one check of every feature either daemon can need.
func everyCheck() []Check {
	var out []Check
	seen := map[Feature]bool{}
	for _, c := range slices.Concat(Router(RouterParams{Mode: encap.MPLS, Generations: 2}),
		Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1}), Endpoint(encap.GRE, true)) {
		if !seen[c.Feature] {
			seen[c.Feature] = true
			out = append(out, c)
		}
	}
	return out
}

// groundTruth finds out whether the kernel has f the way an operator would:
// with ip and iptables commands in a fresh namespace of its own. It returns
// nil when the commands worked.
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
	iptables := func(table string, rule ...string) error {
		if _, err := exec.LookPath("iptables"); err != nil {
			return err
		}
		cmds := [][]string{{"iptables", "-w", "-t", table, "-N", "GROUND-TRUTH"}}
		if len(rule) > 0 {
			cmds = append(cmds, append([]string{"iptables", "-w", "-t", table, "-A", "GROUND-TRUTH"}, rule...))
		}
		return run(cmds...)
	}
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
	case SetMatch:
		if err := ns.IPSets().IpsetCreate("GROUND-TRUTH", "hash:ip", netlink.IpsetCreateOptions{}); err != nil {
			return err
		}
		return iptables("mangle", "-m", "set", "--match-set", "GROUND-TRUTH", "src")
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

// snapshot is what a namespace holds, as ip and iptables-save print it.
func snapshot(t *testing.T, ns *testnetns.NS) string {
	t.Helper()
	var b strings.Builder
	for _, c := range [][]string{
		{"ip", "-d", "-o", "link", "show"}, {"ip", "-o", "addr", "show"}, {"ip", "rule", "show"},
		{"ip", "route", "show", "table", "all"}, {"ip", "nexthop", "show"}, {"iptables-save"},
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

// TestProbesAgreeWithTheCommands probes every feature, in a throwaway
// namespace and in place in a given one, and compares each result with what
// the ip and iptables commands say, so it holds on any kernel. On the
// development host (no GRE, no MPLS) GRE and MPLS are reported missing with
// their options and HMARK present.
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
	name, chain := p.linkName(), p.chainName()
	_ = Run(p, everyCheck())
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
	if out, _ := exec.Command("ip", "-o", "link", "show").CombinedOutput(); strings.Contains(string(out), name) {
		t.Errorf("probe device %s in the caller's namespace:\n%s", name, out)
	}
	if out, err := exec.Command("iptables-save").CombinedOutput(); err == nil && strings.Contains(string(out), chain) {
		t.Errorf("probe chain %s in the caller's namespace", chain)
	}
}

// TestVerifyLogsEachMissingFeature runs the router's gre-mode checks for real
// and compares the log with Run's outcome: a line per missing feature with its
// option, or one line saying all is there.
func TestVerifyLogsEachMissingFeature(t *testing.T) {
	requirePrivileged(t)
	log, hook := test.NewNullLogger()
	checks := Router(RouterParams{Mode: encap.GRE, CreateGREDevice: true, Generations: 1})
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
		if lines[i].Data["option"] != m.Feature.Option || lines[i].Level != logrus.ErrorLevel {
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

// TestNextHopProbeInPlace runs gre mode's nexthop probe (everyCheck keeps
// mpls mode's) in place: this host has nexthop objects and encap ip, and
// the probe leaves the namespace as it found it.
func TestNextHopProbeInPlace(t *testing.T) {
	requirePrivileged(t)
	ns := testnetns.New(t)
	p, err := OpenIn(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
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
