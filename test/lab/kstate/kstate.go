// Package kstate snapshots the kernel networking state of a named network
// namespace (links; IPv4 and IPv6 addresses, policy rules and routes of
// every table; nexthop objects, MPLS routes, iptables and ip6tables of every
// table, ipsets and their members) as normalised text, so the lab can
// check that an add-on leaves a namespace exactly as it found it.
//
// Normalised means that two snapshots of a namespace where nothing happens
// compare equal: no counters, timestamps, lifetimes, link statistics or
// carrier flags, no interface indexes, and lines sorted within each section
// (so the order of iptables rules within a chain is not compared). Sysctls
// are not part of a snapshot: the project sets them to what its datapath
// needs and leaves them so (docs/operating.md).
//
// It reads through the command-line tools an operator would use (iproute2's
// ip, iptables-save), run with exec.CommandContext: ip with -n, the
// iptables tools started from a thread inside the namespace (as "ip netns
// exec" would run them, without its process: the emulated lab VM pays for
// every process it starts).
package kstate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
)

// State is a snapshot of one namespace: normalised lines per section
// ("link", "addr", "rule", "route", "addr6", "rule6", "route6", "nexthop",
// "mpls", "iptables/TABLE", "iptables-legacy/TABLE", "ip6tables/TABLE",
// "ip6tables-legacy/TABLE", "nftables", "ipset"). A section with no lines may be absent.
// The IPv6 sections hold what the kernel adds by itself too (link-local
// addresses and their routes, multicast routes in the local table), which
// comes and goes with the links.
type State struct {
	// Namespace is the name the snapshot was taken from.
	Namespace string
	// Sections maps a section name to its sorted lines.
	Sections map[string][]string
}

// ipCommand is iproute2's ip: the VM also has busybox, whose ip applet
// cannot print JSON nor run netns exec, so /sbin/ip wins when it exists.
func ipCommand() string {
	if _, err := os.Stat("/sbin/ip"); err == nil {
		return "/sbin/ip"
	}
	return "ip"
}

// Snapshot reads the state of the named network namespace ns (one created
// with "ip netns add").
func Snapshot(ctx context.Context, ns string) (State, error) {
	st := State{Namespace: ns, Sections: map[string][]string{}}
	ip := ipCommand()
	type source struct {
		section   string
		args      []string
		normalise func([]byte) ([]string, error)
	}
	sources := []source{
		{"link", []string{"-n", ns, "-d", "-j", "link", "show"}, linkLines},
		{"addr", []string{"-n", ns, "-4", "-j", "addr", "show"}, addrLines},
		{"rule", []string{"-n", ns, "-4", "-o", "rule", "show"}, textLines},
		{"route", []string{"-n", ns, "-4", "-o", "route", "show", "table", "all"}, routeLines},
		{"addr6", []string{"-n", ns, "-6", "-j", "addr", "show"}, addrLines},
		{"rule6", []string{"-n", ns, "-6", "-o", "rule", "show"}, textLines},
		{"route6", []string{"-n", ns, "-6", "-o", "route", "show", "table", "all"}, routeLines},
		// Ids included: a daemon that adopts its objects keeps them.
		{"nexthop", []string{"-n", ns, "-o", "nexthop", "show"}, textLines},
	}
	// Without the mpls_router module the kernel has no MPLS in any
	// namespace, and ip fails; that is not a difference worth reporting.
	if _, err := os.Stat("/proc/sys/net/mpls"); err == nil {
		sources = append(sources, source{"mpls", []string{"-n", ns, "-o", "-f", "mpls", "route", "show"}, textLines})
	}
	for _, src := range sources {
		out, err := run(ctx, netns.None(), ip, src.args...)
		if err != nil {
			return State{}, fmt.Errorf("snapshot of netns %s: %w", ns, err)
		}
		lines, err := src.normalise(out)
		if err != nil {
			return State{}, fmt.Errorf("snapshot of netns %s, %s: %w", ns, src.section, err)
		}
		st.add(src.section, lines)
	}
	// iptables-save shows the nft backend; legacy tables are separate and
	// usually empty. A missing tool means nothing to read.
	handle, err := netns.GetFromName(ns)
	if err != nil {
		return State{}, fmt.Errorf("snapshot of netns %s: %w", ns, err)
	}
	defer handle.Close()
	for _, tool := range []struct{ section, binary string }{
		{"iptables", "iptables-save"},
		{"iptables-legacy", "iptables-legacy-save"},
		{"ip6tables", "ip6tables-save"},
		{"ip6tables-legacy", "ip6tables-legacy-save"},
	} {
		path, err := exec.LookPath(tool.binary)
		if err != nil {
			continue
		}
		out, err := ipsetstate.ListRules(func() (string, error) {
			out, err := run(ctx, handle, path)
			return string(out), err
		})
		if err != nil {
			return State{}, fmt.Errorf("snapshot of netns %s: %w", ns, err)
		}
		for table, lines := range iptablesLines([]byte(out)) {
			st.add(tool.section+"/"+table, lines)
		}
	}
	// nftables tables that iptables-save does not show (bridge, netdev
	// and inet families), through netlink: the VM has no nft binary.
	nft, err := nftTables(handle)
	if err != nil {
		return State{}, fmt.Errorf("snapshot of netns %s: %w", ns, err)
	}
	st.add("nftables", nft)
	// ipsets through netlink: the VM has no ipset binary.
	sets, err := ipsetstate.InNamespace(ns)
	if err != nil {
		return State{}, fmt.Errorf("snapshot of netns %s: %w", ns, err)
	}
	st.add("ipset", sets)
	return st, nil
}

func (s State) add(section string, lines []string) {
	if len(lines) == 0 {
		return
	}
	slices.Sort(lines)
	s.Sections[section] = lines
}

// run runs a command and returns its output; a failure carries its
// stderr. With ns open the command starts from a thread inside ns, whose
// namespace it inherits; with netns.None() it runs where the test does.
func run(ctx context.Context, ns netns.NsHandle, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var err error
	if ns.IsOpen() {
		err = nsexec.Do(ns, cmd.Run)
	} else {
		err = cmd.Run()
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// fallbackDevices are created by the kernel in every namespace when a tunnel
// module loads and cannot be deleted, so they say nothing about what a
// project left behind.
var fallbackDevices = map[string]bool{
	"gre0": true, "gretap0": true, "erspan0": true, "tunl0": true, "sit0": true,
	"ip_vti0": true, "ip6tnl0": true, "ip6gre0": true, "ip6_vti0": true,
}

// linkLines turns "ip -d -j link show" into one line per link: name, kind,
// admin state, MTU, master, alias and the tunnel endpoints. Operational
// state, carrier, addresses and statistics are left out.
func linkLines(out []byte) ([]string, error) {
	var links []struct {
		Name     string   `json:"ifname"`
		Flags    []string `json:"flags"`
		MTU      int      `json:"mtu"`
		Master   string   `json:"master"`
		Alias    string   `json:"ifalias"`
		LinkInfo struct {
			Kind string         `json:"info_kind"`
			Data map[string]any `json:"info_data"`
		} `json:"linkinfo"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		return nil, fmt.Errorf("parsing ip -j link: %w", err)
	}
	var lines []string
	for _, l := range links {
		if fallbackDevices[l.Name] {
			continue
		}
		kind := l.LinkInfo.Kind
		if kind == "" {
			kind = "none"
		}
		state := "down"
		if slices.Contains(l.Flags, "UP") {
			state = "up"
		}
		f := []string{l.Name, "kind=" + kind, state, fmt.Sprintf("mtu=%d", l.MTU)}
		if l.Master != "" {
			f = append(f, "master="+l.Master)
		}
		if l.Alias != "" {
			f = append(f, fmt.Sprintf("alias=%q", l.Alias))
		}
		for _, k := range []string{"local", "remote"} {
			if v, ok := l.LinkInfo.Data[k]; ok {
				f = append(f, fmt.Sprintf("%s=%v", k, v))
			}
		}
		if v, _ := l.LinkInfo.Data["external"].(bool); v {
			f = append(f, "external")
		}
		lines = append(lines, strings.Join(f, " "))
	}
	return lines, nil
}

// addrLines turns "ip -4 -j addr show" (or -6) into one line per address.
// Lifetimes, flags (primary/secondary depends on the order addresses were
// added; nodad, tentative, ...) and the empty label of IPv6 addresses are
// left out.
func addrLines(out []byte) ([]string, error) {
	var links []struct {
		Name  string `json:"ifname"`
		Addrs []struct {
			Local     string `json:"local"`
			PrefixLen int    `json:"prefixlen"`
			Peer      string `json:"address"`
			Broadcast string `json:"broadcast"`
			Scope     string `json:"scope"`
			Label     string `json:"label"`
		} `json:"addr_info"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		return nil, fmt.Errorf("parsing ip -j addr: %w", err)
	}
	var lines []string
	for _, l := range links {
		for _, a := range l.Addrs {
			f := []string{l.Name, fmt.Sprintf("%s/%d", a.Local, a.PrefixLen)}
			if a.Peer != "" {
				f = append(f, "peer="+a.Peer)
			}
			if a.Broadcast != "" {
				f = append(f, "brd="+a.Broadcast)
			}
			f = append(f, "scope="+a.Scope)
			if a.Label != "" {
				f = append(f, "label="+a.Label)
			}
			lines = append(lines, strings.Join(f, " "))
		}
	}
	return lines, nil
}

// textLines splits one-line ("-o") output into lines with whitespace
// collapsed.
func textLines(out []byte) ([]string, error) {
	var lines []string
	for l := range strings.Lines(string(out)) {
		if l = strings.Join(strings.Fields(l), " "); l != "" {
			lines = append(lines, l)
		}
	}
	return lines, nil
}

// routeLines is textLines without the carrier flag "linkdown" and route
// expiry times, which change without anyone touching the routes.
func routeLines(out []byte) ([]string, error) {
	lines, _ := textLines(out)
	for i, l := range lines {
		f := strings.Fields(l)
		kept := f[:0]
		for j := 0; j < len(f); j++ {
			switch f[j] {
			case "linkdown":
				continue
			case "expires":
				j++ // and its value
				continue
			}
			kept = append(kept, f[j])
		}
		lines[i] = strings.Join(kept, " ")
	}
	return lines, nil
}

// iptablesLines splits iptables-save output into lines per table, without
// comments, COMMIT and counters. A built-in chain with policy ACCEPT is left
// out: the nft backend keeps a table and its empty built-in chains after
// their last rule is deleted, which is the same as no table at all. Tables
// left with no lines are absent.
func iptablesLines(out []byte) map[string][]string {
	tables := map[string][]string{}
	table := ""
	for l := range strings.Lines(string(out)) {
		l = strings.TrimSpace(l)
		switch {
		case l == "" || strings.HasPrefix(l, "#") || l == "COMMIT":
		case strings.HasPrefix(l, "*"):
			table = l[1:]
		case strings.HasPrefix(l, ":"):
			// ":CHAIN POLICY [packets:bytes]"
			f := strings.Fields(l)
			if len(f) >= 2 && f[1] == "ACCEPT" {
				continue
			}
			tables[table] = append(tables[table], strings.Join(f[:min(2, len(f))], " "))
		default:
			// "[packets:bytes] -A ..." when saved with counters.
			if strings.HasPrefix(l, "[") {
				if _, rest, ok := strings.Cut(l, "] "); ok {
					l = rest
				}
			}
			tables[table] = append(tables[table], l)
		}
	}
	return tables
}

// Diff describes how b differs from a, section by section: "+ line" for a
// line only in b, "- line" for a line only in a. It is empty when they are
// equal.
func Diff(a, b State) string {
	names := map[string]bool{}
	for n := range a.Sections {
		names[n] = true
	}
	for n := range b.Sections {
		names[n] = true
	}
	var sb strings.Builder
	for _, name := range slices.Sorted(maps.Keys(names)) {
		gone, added := difference(a.Sections[name], b.Sections[name]), difference(b.Sections[name], a.Sections[name])
		if len(gone) == 0 && len(added) == 0 {
			continue
		}
		fmt.Fprintf(&sb, "[%s]\n", name)
		for _, l := range gone {
			fmt.Fprintf(&sb, "- %s\n", l)
		}
		for _, l := range added {
			fmt.Fprintf(&sb, "+ %s\n", l)
		}
	}
	return sb.String()
}

// difference returns the lines of x not matched by a line of y, counting
// repeated lines.
func difference(x, y []string) []string {
	count := map[string]int{}
	for _, l := range y {
		count[l]++
	}
	var out []string
	for _, l := range x {
		if count[l] > 0 {
			count[l]--
			continue
		}
		out = append(out, l)
	}
	return out
}

// nftTables lists the nftables tables of the bridge, netdev and inet
// families in ns, one line per chain with its hook and number of rules.
// A kernel without nf_tables has none.
func nftTables(ns netns.NsHandle) ([]string, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, err
	}
	var lines []string
	for _, family := range []nftables.TableFamily{nftables.TableFamilyBridge, nftables.TableFamilyNetdev, nftables.TableFamilyINet} {
		tables, err := c.ListTablesOfFamily(family)
		if errors.Is(err, unix.EPROTONOSUPPORT) || errors.Is(err, unix.ENOENT) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("listing nftables tables of family %d: %w", family, err)
		}
		for _, t := range tables {
			lines = append(lines, fmt.Sprintf("table %d %s", family, t.Name))
		}
		chains, err := c.ListChainsOfTableFamily(family)
		if err != nil {
			return nil, fmt.Errorf("listing nftables chains of family %d: %w", family, err)
		}
		for _, ch := range chains {
			rules, err := c.GetRules(ch.Table, ch)
			if err != nil {
				return nil, fmt.Errorf("listing the rules of nftables chain %s %s: %w", ch.Table.Name, ch.Name, err)
			}
			hook := "none"
			if ch.Hooknum != nil {
				hook = fmt.Sprint(*ch.Hooknum)
			}
			lines = append(lines, fmt.Sprintf("chain %d %s %s hook %s rules %d", family, ch.Table.Name, ch.Name, hook, len(rules)))
		}
	}
	slices.Sort(lines)
	return lines, nil
}
