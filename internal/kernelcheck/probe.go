package kernelcheck

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/coreos/go-iptables/iptables"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/bridgeguard"
	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/cmdnu/kube-service-tunnel/internal/replyexempt"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// What the probes create. Names get a random suffix so that they cannot meet
// anything of the daemon's when the probes run in its own namespace.
const (
	// probeTable holds the probe routes: no rule of anyone's looks it up.
	probeTable = 0xfffffe00
	// probeLabel is the MPLS label of the probe route (the pods' label).
	probeLabel = 100
	// platformLabels lets probeLabel be routed.
	platformLabels = probeLabel + 1
	// sysctlPlatformLabels is where MPLS routing shows, per namespace,
	// under the sysctl directory (WithProcSys).
	sysctlPlatformLabels = "net/mpls/platform_labels"
)

// Addresses of the probes, from TEST-NET-1 and, for IPv6, 2001:db8::/32.
var (
	// probeRoute is the destination of the probe routes.
	probeRoute = &net.IPNet{IP: net.IPv4(192, 0, 2, 1), Mask: net.CIDRMask(32, 32)}
	// probeTunnel is the outer destination of the encap ip route.
	probeTunnel = netip.MustParseAddr("192.0.2.2")
	// probeLocal is the local address of the probe GRE device.
	probeLocal = net.IPv4(192, 0, 2, 3)

	probeRoute6  = &net.IPNet{IP: net.ParseIP("2001:db8::1"), Mask: net.CIDRMask(128, 128)}
	probeTunnel6 = netip.MustParseAddr("2001:db8::2")
	probeLocal6  = net.ParseIP("2001:db8::3")
)

// Probes is the real Kernel: netlink and iptables in one network namespace.
// Its IPv6 view (IPv6) shares everything but the family: the namespace, the
// names, and the leftovers that Close reports.
type Probes struct {
	*session
	// ipv6 is true in the IPv6 view: the family's probes act on IPv6.
	ipv6 bool
	// ipt is the family's iptables (ip6tables in the IPv6 view), or iptErr
	// why there is none.
	ipt    *iptables.IPTables
	iptErr error
}

// session is what both families' probes share.
type session struct {
	ns netns.NsHandle
	// enter is true when work that needs a thread in the namespace
	// (iptables, sysctls) must switch one there: false in the caller's own
	// namespace, where switching would need CAP_SYS_ADMIN.
	enter bool
	// scratch is true for the probes' own throwaway namespace, where they
	// may also set sysctls.
	scratch bool
	nl      *netlink.Handle
	// iptables is the iptables binary (WithIPTables), ip6tables the
	// ip6tables one (WithIP6Tables; empty: iptables' counterpart).
	iptables, ip6tables string
	// procSys is the sysctl directory (WithProcSys).
	procSys string
	suffix  string
	// leftovers are probe objects that could not be removed, by either
	// family's probes.
	leftovers []error
	// v6 is the IPv6 view, made on first use.
	v6 *Probes
}

var _ Kernel = (*Probes)(nil)

// Open prepares probes that run in a throwaway namespace of their own, or,
// without the privilege to create one (CAP_SYS_ADMIN), in the caller's own
// namespace, with names that meet nothing there, removed at once. Close
// releases them.
func Open(opts ...Option) (*Probes, error) {
	p, err := newProbes(opts)
	if err != nil {
		return nil, err
	}
	if ns, err := newNamespace(); err == nil {
		p.ns, p.enter, p.scratch = ns, true, true
	}
	return p.open()
}

// OpenIn prepares probes that run in place in the namespace ns, which the
// caller keeps open, as in the caller's own namespace (the probes change no
// sysctl there).
func OpenIn(ns netns.NsHandle, opts ...Option) (*Probes, error) {
	p, err := newProbes(opts)
	if err != nil {
		return nil, err
	}
	p.ns, p.enter = ns, true
	return p.open()
}

// Option changes how probes run.
type Option func(*Probes)

// WithProcSys makes the probes read and write sysctls under dir instead
// of /proc/sys (--proc-sys).
func WithProcSys(dir string) Option {
	return func(p *Probes) { p.procSys = dir }
}

// WithIPTables makes the probes run iptables rules with binary (a name on
// PATH or a path, e.g. "iptables-legacy") instead of "iptables": the
// backend the daemon writes its rules with.
func WithIPTables(binary string) Option {
	return func(p *Probes) { p.iptables = binary }
}

// WithIP6Tables makes the IPv6 probes run ip6tables rules with binary
// instead of the counterpart of the iptables binary: "ip6tables" for
// "iptables", "ip6tables-legacy" for "iptables-legacy" (the same directory
// for a path), and "ip6tables" for a binary not named iptables*.
func WithIP6Tables(binary string) Option {
	return func(p *Probes) { p.ip6tables = binary }
}

// ip6tablesOf is the ip6tables counterpart of an iptables binary.
func ip6tablesOf(binary string) string {
	dir, base := filepath.Split(binary)
	if rest, ok := strings.CutPrefix(base, "iptables"); ok {
		return dir + "ip6tables" + rest
	}
	return "ip6tables"
}

func newProbes(opts []Option) (*Probes, error) {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("kernel check: random name: %w", err)
	}
	p := &Probes{session: &session{ns: netns.None(), suffix: hex.EncodeToString(b), iptables: "iptables", procSys: "/proc/sys"}}
	for _, o := range opts {
		o(p)
	}
	if p.ip6tables == "" {
		p.ip6tables = ip6tablesOf(p.iptables)
	}
	return p, nil
}

func (p *Probes) open() (*Probes, error) {
	var err error
	if p.enter {
		p.nl, err = netlink.NewHandleAt(p.ns, unix.NETLINK_ROUTE)
	} else {
		p.nl, err = netlink.NewHandle(unix.NETLINK_ROUTE)
	}
	if err != nil {
		p.closeNamespace()
		return nil, fmt.Errorf("kernel check: netlink handle: %w", err)
	}
	if p.scratch {
		if err := p.setLoopbackUp(); err != nil {
			p.Close()
			return nil, err
		}
	}
	p.ipt, p.iptErr = iptables.New(iptables.Path(p.iptables))
	return p, nil
}

// IPv6 implements Kernel. The view's ip6tables is looked up on first use,
// so that IPv4-only daemons never run it.
func (p *Probes) IPv6() Kernel {
	if p.ipv6 {
		return p
	}
	if p.v6 == nil {
		p.v6 = &Probes{session: p.session, ipv6: true}
		p.v6.ipt, p.v6.iptErr = iptables.New(iptables.IPFamily(iptables.ProtocolIPv6), iptables.Path(p.ip6tables))
	}
	return p.v6
}

// familyName names the probes' family in errors.
func (p *Probes) familyName() string {
	if p.ipv6 {
		return "IPv6"
	}
	return "IPv4"
}

// a names one thing of the family in errors: "a route", "an IPv6 route"
// (the IPv4 probes' errors read as before IPv6).
func (p *Probes) a(thing string) string {
	if p.ipv6 {
		return "an IPv6 " + thing
	}
	return "a " + thing
}

// IPStack implements Kernel. The address families are the kernel's, not a
// namespace's: any thread's socket tells.
func (p *Probes) IPStack() error {
	af := unix.AF_INET
	if p.ipv6 {
		af = unix.AF_INET6
	}
	fd, err := unix.Socket(af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		err = fmt.Errorf("opening an %s socket: %w", p.familyName(), err)
		if b, rerr := os.ReadFile("/sys/module/ipv6/parameters/disable"); p.ipv6 && rerr == nil && strings.TrimSpace(string(b)) == "1" {
			err = fmt.Errorf("%w (IPv6 is disabled on the kernel command line: ipv6.disable=1)", err)
		}
		return err
	}
	return unix.Close(fd)
}

// newNamespace creates a network namespace on a thread that is thrown away.
func newNamespace() (netns.NsHandle, error) {
	var ns netns.NsHandle
	err := nsexec.OnDiscardedThread(func() error {
		h, err := netns.New()
		ns = h
		return err
	})
	if err != nil {
		return netns.None(), fmt.Errorf("creating a network namespace: %w", err)
	}
	return ns, nil
}

func (p *Probes) setLoopbackUp() error {
	lo, err := p.nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("kernel check: finding lo in the probe namespace: %w", err)
	}
	if err := p.nl.LinkSetUp(lo); err != nil {
		return fmt.Errorf("kernel check: setting lo up in the probe namespace: %w", err)
	}
	return nil
}

// Scratch reports whether the probes run in a throwaway namespace of their own.
func (p *Probes) Scratch() bool { return p.scratch }

// Close releases the probes and returns what they could not remove.
func (p *Probes) Close() error {
	if p.nl != nil {
		p.nl.Close()
	}
	p.closeNamespace()
	return errors.Join(p.leftovers...)
}

func (p *Probes) closeNamespace() {
	if p.scratch {
		_ = p.ns.Close()
	}
}

// in runs fn with a thread in the probes' namespace.
func (p *Probes) in(fn func() error) error {
	if !p.enter {
		return fn()
	}
	return nsexec.Do(p.ns, fn)
}

func (p *Probes) leftover(what string, err error) {
	if err != nil {
		p.leftovers = append(p.leftovers, fmt.Errorf("kernel check: removing %s: %w", what, err))
	}
}

// linkName is the probe device's name ("kst-probe6..." for IPv6; 15
// characters at most).
func (p *Probes) linkName() string {
	if p.ipv6 {
		return "kst-probe6" + p.suffix[:5]
	}
	return "kst-probe" + p.suffix[:5]
}

// greKind is the kind of the family's GRE devices.
func (p *Probes) greKind() string {
	if p.ipv6 {
		return "ip6gre"
	}
	return "gre"
}

// addLink creates link and deletes it again.
func (p *Probes) addLink(link netlink.Link) error {
	if err := p.nl.LinkAdd(link); err != nil {
		return err
	}
	p.leftover("device "+link.Attrs().Name, p.nl.LinkDel(link))
	return nil
}

// FlowBasedGRE implements Kernel.
func (p *Probes) FlowBasedGRE() error {
	// Local is not sent for a flow-based device, but the library derives
	// the kind from it: IPv4 asks for "gre", IPv6 for "ip6gre".
	local := net.IPv4zero
	if p.ipv6 {
		local = net.IPv6zero
	}
	err := p.addLink(&netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: p.linkName()}, FlowBased: true, Local: local})
	if errors.Is(err, unix.EEXIST) && p.hasFlowBasedGRE() {
		return nil // a namespace holds one flow-based device of a kind at most
	}
	if err != nil {
		if p.ipv6 {
			return fmt.Errorf("creating a flow-based ip6gre device: %w", err)
		}
		return fmt.Errorf("creating a flow-based GRE device: %w", err)
	}
	return nil
}

// hasFlowBasedGRE reports whether the namespace has a flow-based device of
// the family's kind (the library tells the kinds apart by the local
// address the kernel reports: 0.0.0.0 or ::).
func (p *Probes) hasFlowBasedGRE() bool {
	links, err := p.nl.LinkList()
	if err != nil {
		return false
	}
	for _, l := range links {
		if g, ok := l.(*netlink.Gretun); ok && g.FlowBased && g.Type() == p.greKind() {
			return true
		}
	}
	return false
}

// GRE implements Kernel.
func (p *Probes) GRE() error {
	local := probeLocal
	if p.ipv6 {
		local = probeLocal6
	}
	if err := p.addLink(&netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: p.linkName()}, Local: local}); err != nil {
		if p.ipv6 {
			return fmt.Errorf("creating an ip6gre device with a local address: %w", err)
		}
		return fmt.Errorf("creating a GRE device: %w", err)
	}
	return nil
}

// PolicyRouting implements Kernel.
func (p *Probes) PolicyRouting() error {
	nlFamily := netlink.FAMILY_V4
	if p.ipv6 {
		nlFamily = netlink.FAMILY_V6
	}
	if !p.scratch {
		if _, err := p.nl.RuleList(nlFamily); err != nil {
			return fmt.Errorf("listing %s policy rules: %w", p.familyName(), err)
		}
		return nil
	}
	rule := netlink.NewRule()
	rule.Family, rule.Priority, rule.Mark, rule.Table = nlFamily, 100, 0x1000, 100
	if err := p.nl.RuleAdd(rule); err != nil {
		return fmt.Errorf("adding an %s fwmark rule: %w", p.familyName(), err)
	}
	p.leftover(p.familyName()+" fwmark rule", p.nl.RuleDel(rule))
	return nil
}

// addRoute adds route (replacing a leftover) and deletes it again.
func (p *Probes) addRoute(route *netlink.Route) error {
	if err := p.nl.RouteReplace(route); err != nil {
		return err
	}
	p.leftover("probe route", p.nl.RouteDel(route))
	return nil
}

// addEncapRoute adds and deletes a route with encap in probeTable. IPv4:
// an unreachable route, for which the kernel builds the encapsulation as for
// any route, needs no device (lo may be down), and would drop rather than
// send whatever found the route. IPv6 builds no encapsulation for a reject
// route (it only checks that the type is known), so the IPv6 route is one
// to lo, which must be up (as in the daemon's namespace and the probes'
// own); no rule looks probeTable up.
func (p *Probes) addEncapRoute(encap netlink.Encap) error {
	if !p.ipv6 {
		return p.addRoute(&netlink.Route{Dst: probeRoute, Table: probeTable, Type: unix.RTN_UNREACHABLE, Encap: encap})
	}
	lo, err := p.nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	return p.addRoute(&netlink.Route{Dst: probeRoute6, Table: probeTable, LinkIndex: lo.Attrs().Index, Encap: encap})
}

// addMPLSRoute adds and deletes an MPLS route that pops probeLabel to lo.
func (p *Probes) addMPLSRoute() error {
	lo, err := p.nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	label := probeLabel
	return p.addRoute(&netlink.Route{MPLSDst: &label, LinkIndex: lo.Attrs().Index})
}

// tunnelDst is the outer destination of the family's probe encapsulations.
func (p *Probes) tunnelDst() netip.Addr {
	if p.ipv6 {
		return probeTunnel6
	}
	return probeTunnel
}

// EncapIPRoute implements Kernel.
func (p *Probes) EncapIPRoute() error {
	if err := p.addEncapRoute(&rtnl.IPEncap{Dst: p.tunnelDst()}); err != nil {
		if p.ipv6 {
			return fmt.Errorf("adding an IPv6 route with encap ip6: %w", err)
		}
		return fmt.Errorf("adding a route with encap ip: %w", err)
	}
	return nil
}

// probeNextHopID is the id of the probe nexthop object, from the top of the
// id space (the routers' ranges end below 0xff000000 for their default
// protocol), with the probes' random suffix in the low bits; the IPv6
// view's is another.
func (p *Probes) probeNextHopID() uint32 {
	id, _ := strconv.ParseUint(p.suffix[:4], 16, 32)
	if p.ipv6 {
		return 0xfffd0000 | uint32(id)
	}
	return 0xfffe0000 | uint32(id)
}

// addNextHop creates a nexthop object on lo with the given encapsulation
// and a route through it in probeTable, then deletes the object (and with
// it the route). A taken id means the kernel has nexthop objects.
func (p *Probes) addNextHop(n rtnl.NextHop) error {
	lo, err := p.nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	c, err := rtnl.Open(p.ns)
	if err != nil {
		return err
	}
	defer c.Close()
	n.ID, n.LinkIndex, n.IPv6 = p.probeNextHopID(), lo.Attrs().Index, p.ipv6
	dst, _ := netip.AddrFromSlice(probeRoute.IP.To4())
	if p.ipv6 {
		dst, _ = netip.AddrFromSlice(probeRoute6.IP)
	}
	route := rtnl.Route{Table: probeTable, Dst: netip.PrefixFrom(dst, dst.BitLen()), Type: rtnl.Unicast, NextHopID: n.ID}
	err = c.Apply([]rtnl.Op{{Kind: rtnl.AddNextHop, NextHop: n}})
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("creating %s: %w", p.a("nexthop object"), err)
	}
	err = c.Apply([]rtnl.Op{{Kind: rtnl.Replace, Route: route}})
	if err != nil {
		err = fmt.Errorf("adding %s through a nexthop object: %w", p.a("route"), err)
	}
	p.leftover(p.familyName()+" nexthop object", c.Apply([]rtnl.Op{{Kind: rtnl.DeleteNextHop, NextHop: n}}))
	return err
}

// EncapIPNextHop implements Kernel.
func (p *Probes) EncapIPNextHop() error {
	return p.addNextHop(rtnl.NextHop{IPEncap: &rtnl.IPEncap{Dst: p.tunnelDst()}})
}

// EncapMPLSRoute implements Kernel.
func (p *Probes) EncapMPLSRoute() error {
	if err := p.addEncapRoute(&netlink.MPLSEncap{Labels: []int{probeLabel}}); err != nil {
		return fmt.Errorf("adding %s with encap mpls: %w", p.a("route"), err)
	}
	return nil
}

// MPLSRouting implements Kernel. The MPLS sysctls exist once mpls_router is
// loaded; an MPLS route request loads it when it is not.
func (p *Probes) MPLSRouting() error {
	labels, err := p.readSysctl(sysctlPlatformLabels)
	if errors.Is(err, os.ErrNotExist) {
		addErr := p.addMPLSRoute()
		if labels, err = p.readSysctl(sysctlPlatformLabels); errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("no %s, and adding an MPLS route: %w", filepath.Join(p.procSys, filepath.Dir(sysctlPlatformLabels)), addErr)
		}
	}
	if err != nil {
		return fmt.Errorf("reading net.mpls.platform_labels: %w", err)
	}
	if !p.scratch {
		return nil // never change the daemon's own sysctls to probe
	}
	if n, _ := strconv.Atoi(labels); n < platformLabels {
		if err := p.writeSysctl(sysctlPlatformLabels, strconv.Itoa(platformLabels)); err != nil {
			return fmt.Errorf("setting net.mpls.platform_labels: %w", err)
		}
	}
	if err := p.addMPLSRoute(); err != nil {
		return fmt.Errorf("adding an MPLS route: %w", err)
	}
	return nil
}

func (p *Probes) readSysctl(name string) (string, error) {
	var v string
	err := p.in(func() error {
		b, err := os.ReadFile(filepath.Join(p.procSys, name))
		v = strings.TrimSpace(string(b))
		return err
	})
	return v, err
}

func (p *Probes) writeSysctl(name, value string) error {
	return p.in(func() error { return os.WriteFile(filepath.Join(p.procSys, name), []byte(value+"\n"), 0o644) })
}

// IPTables implements Kernel.
func (p *Probes) IPTables() error {
	if p.iptErr != nil {
		return fmt.Errorf("go-iptables: %w", p.iptErr)
	}
	return nil
}

// iptablesBinary is the family's iptables command.
func (p *Probes) iptablesBinary() string {
	if p.ipv6 {
		return p.ip6tables
	}
	return p.iptables
}

func (p *Probes) chainName() string { return "KST-PROBE-" + p.suffix }

// IPTablesChain implements Kernel.
func (p *Probes) IPTablesChain(table string) error {
	return p.IPTablesRule(table)
}

// IPTablesRule implements Kernel; without a rule it only creates the chain.
func (p *Probes) IPTablesRule(table string, rule ...string) error {
	if p.ipt == nil {
		return p.IPTables()
	}
	chain := p.chainName()
	return p.in(func() error {
		if err := p.ipt.NewChain(table, chain); err != nil {
			return fmt.Errorf("creating chain %s in table %s: %w", chain, table, err)
		}
		var err error
		if len(rule) > 0 {
			if err = p.ipt.Append(table, chain, rule...); err != nil {
				err = fmt.Errorf("appending %q to a chain of table %s: %w", strings.Join(rule, " "), table, err)
			}
		}
		p.leftover("chain "+chain+" of "+p.iptablesBinary()+" table "+table, p.ipt.ClearAndDeleteChain(table, chain))
		return err
	})
}

// IPTablesRules implements Kernel: one iptables-restore (of the family's
// iptables binary) creates a temporary chain in each table and appends the
// rules, and a second one removes the chains, in both cases as a whole.
func (p *Probes) IPTablesRules(rules []TableRule) error {
	if p.ipt == nil {
		return p.IPTables()
	}
	chain := p.chainName()
	var tables []string
	byTable := map[string][]string{}
	for _, r := range rules {
		if _, ok := byTable[r.Table]; !ok {
			tables = append(tables, r.Table)
			byTable[r.Table] = nil
		}
		if len(r.Rule) > 0 {
			byTable[r.Table] = append(byTable[r.Table], restoreLine(chain, r.Rule))
		}
	}
	var add, remove strings.Builder
	for _, table := range tables {
		fmt.Fprintf(&add, "*%s\n:%s - [0:0]\n", table, chain)
		for _, line := range byTable[table] {
			add.WriteString(line + "\n")
		}
		add.WriteString("COMMIT\n")
		// Declaring the chain flushes it; then it is deleted.
		fmt.Fprintf(&remove, "*%s\n:%s - [0:0]\n-X %s\nCOMMIT\n", table, chain, chain)
	}
	restore := p.iptablesBinary() + "-restore"
	return p.in(func() error {
		err := runRestore(restore, add.String())
		if err != nil {
			err = fmt.Errorf("%d rules in chains %s of tables %s at once: %w", len(rules), chain, strings.Join(tables, ", "), err)
		}
		// Removing what may not exist (when the first failed) fails
		// harmlessly; it is reported only after a success.
		if rerr := runRestore(restore, remove.String()); err == nil {
			p.leftover("chains "+chain+" of "+restore+" tables "+strings.Join(tables, ", "), rerr)
		}
		return err
	})
}

// restoreLine is an iptables-restore line appending rule to chain, with
// the arguments that hold spaces quoted.
func restoreLine(chain string, rule []string) string {
	args := []string{"-A", chain}
	for _, a := range rule {
		if strings.ContainsAny(a, " \t") {
			a = strconv.Quote(a)
		}
		args = append(args, a)
	}
	return strings.Join(args, " ")
}

func runRestore(restore, input string) error {
	cmd := exec.Command(restore, "--noflush", "-w")
	cmd.Stdin = strings.NewReader(input)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w: %s", restore, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// setName is the probe ipset's name: both families' sets share one
// namespace of names.
func (p *Probes) setName() string {
	if p.ipv6 {
		return "KST-PROBE6-" + p.suffix
	}
	return "KST-PROBE-" + p.suffix
}

// IPSet implements Kernel.
func (p *Probes) IPSet() error {
	return p.in(func() error {
		if err := p.createSet(); err != nil {
			return err
		}
		p.leftover("ipset "+p.setName(), netlink.IpsetDestroy(p.setName()))
		return nil
	})
}

func (p *Probes) createSet() error {
	af, of := uint8(unix.AF_INET), ""
	if p.ipv6 {
		af, of = unix.AF_INET6, " of family inet6"
	}
	if err := netlink.IpsetCreate(p.setName(), "hash:ip", netlink.IpsetCreateOptions{Family: af, Counters: true}); err != nil {
		return fmt.Errorf("creating hash:ip set %s%s: %w", p.setName(), of, err)
	}
	return nil
}

// ReplyNotrack implements Kernel, in the probes' namespace (the daemon's
// own when they do not enter one).
func (p *Probes) ReplyNotrack() error {
	ns := p.ns
	if !p.enter {
		ns = netns.None() // the daemon's own, without setns
	}
	return replyexempt.Probe(ns, "kst-probe"+p.suffix[:5])
}

// BridgeFilter implements Kernel, in the probes' namespace (the daemon's
// own when they do not enter one).
func (p *Probes) BridgeFilter() error {
	ns := p.ns
	if !p.enter {
		ns = netns.None() // the daemon's own, without setns
	}
	return bridgeguard.Probe(ns, "kst-probe"+p.suffix[:5])
}

// PortSet implements Kernel.
func (p *Probes) PortSet() error {
	return p.in(func() error {
		af, of := uint8(unix.AF_INET), ""
		if p.ipv6 {
			af, of = unix.AF_INET6, " of family inet6"
		}
		if err := netlink.IpsetCreate(p.setName(), "hash:ip,port", netlink.IpsetCreateOptions{Family: af}); err != nil {
			return fmt.Errorf("creating hash:ip,port set %s%s: %w", p.setName(), of, err)
		}
		p.leftover("ipset "+p.setName(), netlink.IpsetDestroy(p.setName()))
		return nil
	})
}

// SynSet implements Kernel.
func (p *Probes) SynSet() error {
	return p.in(func() error {
		af, of := uint8(unix.AF_INET), ""
		if p.ipv6 {
			af, of = unix.AF_INET6, " of family inet6"
		}
		timeout := uint32(10)
		if err := netlink.IpsetCreate(p.setName(), "hash:ip,port,ip", netlink.IpsetCreateOptions{Family: af, Timeout: &timeout}); err != nil {
			return fmt.Errorf("creating hash:ip,port,ip set %s%s with a timeout: %w", p.setName(), of, err)
		}
		p.leftover("ipset "+p.setName(), netlink.IpsetDestroy(p.setName()))
		return nil
	})
}

// IPSetRule implements Kernel.
func (p *Probes) IPSetRule(table string) error {
	var err error
	if cerr := p.in(p.createSet); cerr != nil {
		return cerr
	}
	err = p.IPTablesRule(table, "-m", "set", "--match-set", p.setName(), "dst", "-j", "RETURN")
	p.leftover("ipset "+p.setName(), p.in(func() error { return netlink.IpsetDestroy(p.setName()) }))
	return err
}

// LoadModule implements Kernel.
func (p *Probes) LoadModule(name string) error {
	path, err := exec.LookPath("modprobe")
	if err != nil {
		return err
	}
	if out, err := exec.Command(path, "-q", name).CombinedOutput(); err != nil {
		return fmt.Errorf("modprobe %s: %w: %s", name, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Verify probes checks and logs the outcome: one error line per missing
// feature. It returns Run's error.
func Verify(checks []Check, log logrus.FieldLogger, opts ...Option) error {
	if len(checks) == 0 {
		return nil
	}
	p, err := Open(opts...)
	if err != nil {
		return err
	}
	err = Run(p, checks)
	if lerr := p.Close(); lerr != nil {
		log.WithError(lerr).Warn("kernel check left something behind")
	}
	for _, m := range Missing(err) {
		fields := logrus.Fields{"feature": m.Feature.Name}
		for k, v := range map[string]string{"option": m.Feature.Option, "module": m.Feature.Module, "package": m.Feature.Package, "since": m.Feature.Since} {
			if v != "" {
				fields[k] = v
			}
		}
		log.WithFields(fields).WithError(m.Err).Error("kernel feature missing")
	}
	if err != nil {
		return err
	}
	log.WithFields(logrus.Fields{"features": Names(checks), "throwaway_netns": p.Scratch()}).Info("kernel has every feature needed")
	return nil
}
