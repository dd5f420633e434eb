// Package kernelcheck finds out at start whether the kernel has the features a
// daemon is about to use (GRE, MPLS, lightweight tunnels, policy routing,
// iptables HMARK and friends), so that a missing one is reported at once, by
// name and kernel option, rather than as an obscure netlink or iptables error
// on the first Service.
//
// Every feature is probed for real: the probes create what the daemon would
// create (a flow-based GRE device, an encap route, a nexthop object and a
// route through it, an MPLS route, an iptables rule in a temporary chain) and
// remove it again, preferably in a throwaway network namespace so that the
// daemon's own namespace is never touched. The kernel loads most modules by
// itself on first use; when a probe fails, the module is also tried with
// modprobe once.
//
// IPv6 tunnel IPs have features of their own (IPv6 policy routing, ip6gre,
// ip6tables' tables, inet6 ipsets), each a Feature of its own, probed through
// the IPv6 view of the same probes (Kernel.IPv6), after the IPv4 ones.
//
// Which features are needed is a pure decision (Router, Endpoint); the probes
// sit behind the Kernel interface, so the decision and the error messages are
// tested with fakes.
package kernelcheck

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// Feature is something of the kernel's that a daemon needs.
type Feature struct {
	// Name says what it is, as an operator would look for it.
	Name string
	// Option is the kernel configuration option that provides it; empty for
	// a userspace prerequisite.
	Option string
	// Module is the module that Option builds; empty when the option cannot
	// be a module.
	Module string
	// Package is the distribution package providing a userspace
	// prerequisite (Option empty).
	Package string
	// Since is the first Linux release with a feature that no option
	// selects (Option and Package empty), e.g. "Linux 5.3".
	Since string
}

// String names the feature with its option and module, or its package.
func (f Feature) String() string {
	switch {
	case f.Option == "" && f.Package != "":
		return fmt.Sprintf("%s (package %s)", f.Name, f.Package)
	case f.Option == "" && f.Since != "":
		return fmt.Sprintf("%s (%s or later, no kernel option)", f.Name, f.Since)
	case f.Option == "":
		return f.Name
	case f.Module == "":
		return fmt.Sprintf("%s (%s, built in: not available as a module)", f.Name, f.Option)
	default:
		return fmt.Sprintf("%s (%s, module %s)", f.Name, f.Option, f.Module)
	}
}

// The features the daemons use.
var (
	FlowBasedGRE = Feature{Name: "flow-based GRE", Option: "CONFIG_NET_IPGRE", Module: "ip_gre"}
	GRE          = Feature{Name: "GRE", Option: "CONFIG_NET_IPGRE", Module: "ip_gre"}
	MPLSRouting  = Feature{Name: "MPLS routing", Option: "CONFIG_MPLS_ROUTING", Module: "mpls_router"}
	// BridgeFilter holds the endpoint agent's bridge guard in mpls mode:
	// an nftables table of the bridge family (package bridgeguard).
	BridgeFilter = Feature{Name: "nftables for bridges (the bridge guard)", Option: "CONFIG_NF_TABLES_BRIDGE", Module: "nf_tables"}
	// ReplyNotrack holds the endpoint agent's reply exemption
	// (--untrack-replies): an inet-family nftables table whose rules
	// exempt packets from connection tracking (package replyexempt).
	ReplyNotrack = Feature{Name: "nftables notrack (the pods' replies untracked)", Option: "CONFIG_NFT_CT", Module: "nft_ct"}
	MPLSEncap    = Feature{Name: "MPLS encapsulation of IP routes", Option: "CONFIG_MPLS_IPTUNNEL", Module: "mpls_iptunnel"}
	// LightweightTunnels is probed with an "encap ip" route, which needs
	// nothing else (ip_tunnel_core is always built in).
	LightweightTunnels = Feature{Name: "lightweight tunnel routes", Option: "CONFIG_LWTUNNEL"}
	PolicyRouting      = Feature{Name: "policy routing", Option: "CONFIG_IP_MULTIPLE_TABLES"}
	IPTablesCommand    = Feature{Name: "the iptables command", Package: "iptables"}
	MangleTable        = Feature{Name: "the iptables mangle table", Option: "CONFIG_IP_NF_MANGLE", Module: "iptable_mangle"}
	RawTable           = Feature{Name: "the iptables raw table", Option: "CONFIG_IP_NF_RAW", Module: "iptable_raw"}
	FilterTable        = Feature{Name: "the iptables filter table", Option: "CONFIG_IP_NF_FILTER", Module: "iptable_filter"}
	HMARK              = Feature{Name: "the iptables HMARK target", Option: "CONFIG_NETFILTER_XT_TARGET_HMARK", Module: "xt_HMARK"}
	CommentMatch       = Feature{Name: "the iptables comment match", Option: "CONFIG_NETFILTER_XT_MATCH_COMMENT", Module: "xt_comment"}
	ConntrackMatch     = Feature{Name: "the iptables conntrack match", Option: "CONFIG_NETFILTER_XT_MATCH_CONNTRACK", Module: "xt_conntrack"}
	Connmark           = Feature{Name: "the iptables connmark match and CONNMARK target", Option: "CONFIG_NETFILTER_XT_CONNMARK", Module: "xt_connmark"}
	MarkMatch          = Feature{Name: "the iptables mark match", Option: "CONFIG_NETFILTER_XT_MARK", Module: "xt_mark"}
	CTTarget           = Feature{Name: "the iptables CT target", Option: "CONFIG_NETFILTER_XT_TARGET_CT", Module: "xt_CT"}
	// IPSets is probed by creating a hash:ip set through netlink: no
	// ipset command is needed.
	IPSets   = Feature{Name: "hash:ip ipsets", Option: "CONFIG_IP_SET_HASH_IP", Module: "ip_set_hash_ip"}
	SetMatch = Feature{Name: "the iptables set match", Option: "CONFIG_NETFILTER_XT_SET", Module: "xt_set"}
	// PortSets hold the ports of the tunnel IPs whose Service's ports
	// are filtered (hash:ip,port).
	PortSets = Feature{Name: "hash:ip,port ipsets", Option: "CONFIG_IP_SET_HASH_IPPORT", Module: "ip_set_hash_ipport"}
	// SynSets remember each SYN's generation (hash:ip,port,ip with a
	// timeout), with several generations; the SET target that fills them
	// is SetMatch's module.
	SynSets = Feature{Name: "hash:ip,port,ip ipsets with a timeout", Option: "CONFIG_IP_SET_HASH_IPPORTIP", Module: "ip_set_hash_ipportip"}
	// NextHopObjects ("ip nexthop") carry the routers' encapsulations: one
	// per endpoint, named by every bucket route to it. They are part of
	// IPv4 since Linux 5.3, lightweight-tunnel encapsulations included.
	NextHopObjects = Feature{Name: "nexthop objects", Since: "Linux 5.3"}
)

// The features of IPv6 tunnel IPs. Each differs from its IPv4 counterpart
// (Run tells features apart by value), by name at least: the same kernel
// option may provide both.
var (
	// IPv6Protocol is IPv6 itself: without it (or with ipv6.disable=1 on
	// the kernel command line) every other IPv6 check is skipped.
	IPv6Protocol        = Feature{Name: "IPv6", Option: "CONFIG_IPV6", Module: "ipv6"}
	FlowBasedGRE6       = Feature{Name: "flow-based IPv6 GRE", Option: "CONFIG_IPV6_GRE", Module: "ip6_gre"}
	GRE6                = Feature{Name: "IPv6 GRE", Option: "CONFIG_IPV6_GRE", Module: "ip6_gre"}
	MPLSEncap6          = Feature{Name: "MPLS encapsulation of IPv6 routes", Option: "CONFIG_MPLS_IPTUNNEL", Module: "mpls_iptunnel"}
	LightweightTunnels6 = Feature{Name: "IPv6 lightweight tunnel routes", Option: "CONFIG_LWTUNNEL"}
	PolicyRouting6      = Feature{Name: "IPv6 policy routing", Option: "CONFIG_IPV6_MULTIPLE_TABLES"}
	IP6TablesCommand    = Feature{Name: "the ip6tables command", Package: "iptables"}
	MangleTable6        = Feature{Name: "the ip6tables mangle table", Option: "CONFIG_IP6_NF_MANGLE", Module: "ip6table_mangle"}
	RawTable6           = Feature{Name: "the ip6tables raw table", Option: "CONFIG_IP6_NF_RAW", Module: "ip6table_raw"}
	FilterTable6        = Feature{Name: "the ip6tables filter table", Option: "CONFIG_IP6_NF_FILTER", Module: "ip6table_filter"}
	HMARK6              = Feature{Name: "the ip6tables HMARK target", Option: "CONFIG_NETFILTER_XT_TARGET_HMARK", Module: "xt_HMARK"}
	CommentMatch6       = Feature{Name: "the ip6tables comment match", Option: "CONFIG_NETFILTER_XT_MATCH_COMMENT", Module: "xt_comment"}
	ConntrackMatch6     = Feature{Name: "the ip6tables conntrack match", Option: "CONFIG_NETFILTER_XT_MATCH_CONNTRACK", Module: "xt_conntrack"}
	Connmark6           = Feature{Name: "the ip6tables connmark match and CONNMARK target", Option: "CONFIG_NETFILTER_XT_CONNMARK", Module: "xt_connmark"}
	MarkMatch6          = Feature{Name: "the ip6tables mark match", Option: "CONFIG_NETFILTER_XT_MARK", Module: "xt_mark"}
	CTTarget6           = Feature{Name: "the ip6tables CT target", Option: "CONFIG_NETFILTER_XT_TARGET_CT", Module: "xt_CT"}
	IPSets6             = Feature{Name: "hash:ip ipsets of family inet6", Option: "CONFIG_IP_SET_HASH_IP", Module: "ip_set_hash_ip"}
	SetMatch6           = Feature{Name: "the ip6tables set match", Option: "CONFIG_NETFILTER_XT_SET", Module: "xt_set"}
	PortSets6           = Feature{Name: "hash:ip,port ipsets of family inet6", Option: "CONFIG_IP_SET_HASH_IPPORT", Module: "ip_set_hash_ipport"}
	SynSets6            = Feature{Name: "hash:ip,port,ip ipsets of family inet6 with a timeout", Option: "CONFIG_IP_SET_HASH_IPPORTIP", Module: "ip_set_hash_ipportip"}
	NextHopObjects6     = Feature{Name: "IPv6 nexthop objects", Since: "Linux 5.3"}
)

// Kernel runs the probes. Each returns nil when the kernel did what was
// asked (and the probe removed it again), or the error it got.
//
// The probes of one address family say which below ("IPv4; IPv6 in the
// IPv6 view"): a Kernel's own act on IPv4, those of its IPv6 view on IPv6.
// The others (MPLSRouting, LoadModule) are the same in both.
type Kernel interface {
	// IPv6 returns the same probes acting on IPv6 (the IPv6 view itself
	// when called on it).
	IPv6() Kernel
	// IPStack opens and closes a socket of the family (IPv4; IPv6 in the
	// IPv6 view).
	IPStack() error
	// FlowBasedGRE creates and deletes a flow-based ("external") GRE
	// device: gre (IPv4), ip6gre (IPv6).
	FlowBasedGRE() error
	// GRE creates and deletes a GRE device with a local address: gre with
	// an IPv4 one, ip6gre with an IPv6 one.
	GRE() error
	// PolicyRouting adds and deletes (or, in the daemon's own namespace,
	// lists) policy rules of the family.
	PolicyRouting() error
	// EncapIPRoute adds and deletes a route with "encap ip" (IPv4), or an
	// IPv6 route with "encap ip6" (IPv6).
	EncapIPRoute() error
	// MPLSRouting makes sure the MPLS sysctls exist and adds and deletes an
	// MPLS route (in a throwaway namespace).
	MPLSRouting() error
	// EncapMPLSRoute adds and deletes a route of the family with "encap
	// mpls".
	EncapMPLSRoute() error
	// EncapIPNextHop adds a nexthop object of the family with "encap ip"
	// ("encap ip6") and a route of the family through it, and deletes
	// both.
	EncapIPNextHop() error
	// IPTables reports whether the iptables (ip6tables) command can be
	// used.
	IPTables() error
	// IPTablesChain creates and deletes a chain in table (of iptables;
	// ip6tables in the IPv6 view).
	IPTablesChain(table string) error
	// IPTablesRule appends rule to a temporary chain of table and deletes
	// the chain (iptables; ip6tables in the IPv6 view).
	IPTablesRule(table string, rule ...string) error
	// IPTablesRules does what IPTablesRule does for each rule, all at once
	// (one iptables-restore writes them, another removes them); it fails
	// if any rule fails, without saying which.
	IPTablesRules(rules []TableRule) error
	// IPSet creates and destroys a hash:ip set of the family (inet;
	// inet6).
	IPSet() error
	// IPSetRule creates a hash:ip set of the family, appends a rule
	// matching it to a temporary chain of table, and deletes both.
	IPSetRule(table string) error
	// PortSet creates and destroys a hash:ip,port set of the family.
	PortSet() error
	// SynSet creates and destroys a hash:ip,port,ip set of the family
	// with a timeout.
	SynSet() error
	// BridgeFilter writes a bridge-family nftables table with the bridge
	// guard's chain and rule under a probe's name, and deletes it.
	BridgeFilter() error
	// ReplyNotrack writes an inet-family nftables table with the reply
	// exemption's sets and notrack rules under a probe's name, and
	// deletes it.
	ReplyNotrack() error
	// LoadModule loads a kernel module with modprobe.
	LoadModule(name string) error
}

// TableRule is an iptables rule for a temporary chain of Table; a rule
// without arguments only creates the chain.
type TableRule struct {
	Table string
	Rule  []string
}

// Check is one feature and how to probe it.
type Check struct {
	Feature Feature
	// Requires are features without which this probe cannot tell anything
	// (a table for its rules): when one is missing, this check is skipped.
	Requires []Feature
	Probe    func(Kernel) error
	// Rule, when set, is the iptables rule Probe tries (IPTablesRule of
	// it), in the IPv6 view when IPv6 is set: Run tries the rules of each
	// family all at once first (IPTablesRules).
	Rule *TableRule
	IPv6 bool
}

// MissingError is a feature the kernel lacks, with what its probe got.
type MissingError struct {
	Feature Feature
	Err     error
}

func (e *MissingError) Error() string {
	if e.Feature.Option == "" && e.Feature.Since == "" {
		return fmt.Sprintf("%s is missing: %v", e.Feature, e.Err)
	}
	return fmt.Sprintf("kernel lacks %s: %v", e.Feature, e.Err)
}

func (e *MissingError) Unwrap() error { return e.Err }

// Run probes every check in order and returns all missing features at once
// (errors.Join of *MissingError), or nil. A failed probe whose feature has a
// module is retried once after loading that module with modprobe.
//
// The iptables rules of each family are first tried all at once: when that
// works, so would each of them, and their checks pass without a probe of
// their own (each one costs several iptables processes, which under load
// took the router's start-up seconds). When it fails, each is probed alone,
// so that the error names the missing features.
func Run(k Kernel, checks []Check) error {
	var errs []error
	missing := map[Feature]bool{}
	tried := map[bool]bool{} // by IPv6: the family's rules were tried at once
	passed := map[int]bool{}
	for i, c := range checks {
		if slices.ContainsFunc(c.Requires, func(f Feature) bool { return missing[f] }) {
			continue
		}
		if c.Rule != nil && !tried[c.IPv6] {
			tried[c.IPv6] = true
			for _, j := range passedTogether(k, checks, c.IPv6) {
				passed[j] = true
			}
		}
		if passed[i] {
			continue
		}
		err := c.Probe(k)
		if err != nil && c.Feature.Module != "" {
			if k.LoadModule(c.Feature.Module) == nil {
				err = c.Probe(k)
			}
		}
		if err != nil {
			missing[c.Feature] = true
			errs = append(errs, &MissingError{Feature: c.Feature, Err: err})
		}
	}
	return errors.Join(errs...)
}

// passedTogether tries the rules of the family's checks (IPv6 or IPv4)
// with one IPTablesRules and returns the indexes of the checks it passed:
// all of them, or none.
func passedTogether(k Kernel, checks []Check, ipv6 bool) []int {
	indexes, rules := familyRules(checks, ipv6)
	if len(rules) < 2 {
		return nil
	}
	view := k
	if ipv6 {
		view = k.IPv6()
	}
	if view.IPTablesRules(rules) != nil {
		return nil
	}
	return indexes
}

// familyRules returns the checks of the family (IPv6 or IPv4) that have an
// iptables rule: their indexes and their rules.
func familyRules(checks []Check, ipv6 bool) (indexes []int, rules []TableRule) {
	for i, c := range checks {
		if c.Rule != nil && c.IPv6 == ipv6 {
			indexes = append(indexes, i)
			rules = append(rules, *c.Rule)
		}
	}
	return indexes, rules
}

// Missing returns the missing features in an error of Run's.
func Missing(err error) []*MissingError {
	errs := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	}
	var out []*MissingError
	for _, e := range errs {
		var m *MissingError
		if errors.As(e, &m) {
			out = append(out, m)
		}
	}
	return out
}

// Names lists the features of checks, for a log line.
func Names(checks []Check) string {
	names := make([]string, len(checks))
	for i, c := range checks {
		names[i] = c.Feature.Name
	}
	return strings.Join(names, ", ")
}

// RouterParams are the router options that decide what it uses.
type RouterParams struct {
	Mode encap.Mode
	// CreateGREDevice is --gre-device-create: only then does the router
	// create a GRE device; otherwise it routes over an existing device.
	CreateGREDevice bool
	// Generations above 1 use conntrack (connmark, conntrack and mark
	// matches, the CT target in the raw table).
	Generations int
	// IPv6 adds the checks of IPv6 tunnel IPs, after the IPv4 ones.
	IPv6 bool
}

// EndpointParams are the endpoint agent options that decide what it uses.
type EndpointParams struct {
	Mode encap.Mode
	// NetworkPolicy is the agent's enforcement of NetworkPolicy in pods
	// (filter table rules).
	NetworkPolicy bool
	// IPv6 adds the checks of IPv6 tunnel IPs, after the IPv4 ones.
	IPv6 bool
	// UntrackReplies is the agent's reply exemption (one inet table, for
	// both families).
	UntrackReplies bool
}

// iptables rules that exercise one extension each. They go in a temporary
// chain of their own, so they never see a packet.
var (
	hmarkRule     = []string{"-j", "HMARK", "--hmark-tuple", "src,dst,sport,dport,proto", "--hmark-mod", "1", "--hmark-offset", "1", "--hmark-rnd", "0x1"}
	commentRule   = []string{"-m", "comment", "--comment", "kube-service-tunnel kernel check", "-j", "RETURN"}
	conntrackRule = []string{"-m", "conntrack", "--ctexpire", "1:4294967295", "-j", "RETURN"}
	connmarkRule  = []string{"-m", "connmark", "--mark", "0x1/0x1", "-j", "CONNMARK", "--restore-mark"}
	markRule      = []string{"-m", "mark", "--mark", "0x1/0x1", "-j", "RETURN"}
	notrackRule   = []string{"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN", "-j", "CT", "--notrack"}
)

// family is what one address family's checks probe: its features, and the
// view of the probes that acts on it.
type family struct {
	ipv6 bool
	// requires is what every check of the family needs besides its own
	// prerequisites: IPv6 itself for IPv6.
	requires []Feature

	policyRouting, lightweightTunnels, nextHopObjects, flowBasedGRE, gre, mplsEncap Feature
	iptablesCommand, mangleTable, rawTable, filterTable                             Feature
	hmark, commentMatch, conntrackMatch, connmark, markMatch, ctTarget              Feature
	ipsets, setMatch, portSets, synSets                                             Feature
}

var (
	ipv4 = family{
		policyRouting: PolicyRouting, lightweightTunnels: LightweightTunnels, nextHopObjects: NextHopObjects,
		flowBasedGRE: FlowBasedGRE, gre: GRE, mplsEncap: MPLSEncap,
		iptablesCommand: IPTablesCommand, mangleTable: MangleTable, rawTable: RawTable, filterTable: FilterTable,
		hmark: HMARK, commentMatch: CommentMatch, conntrackMatch: ConntrackMatch, connmark: Connmark,
		markMatch: MarkMatch, ctTarget: CTTarget, ipsets: IPSets, setMatch: SetMatch, portSets: PortSets, synSets: SynSets,
	}
	ipv6 = family{
		ipv6: true, requires: []Feature{IPv6Protocol},
		policyRouting: PolicyRouting6, lightweightTunnels: LightweightTunnels6, nextHopObjects: NextHopObjects6,
		flowBasedGRE: FlowBasedGRE6, gre: GRE6, mplsEncap: MPLSEncap6,
		iptablesCommand: IP6TablesCommand, mangleTable: MangleTable6, rawTable: RawTable6, filterTable: FilterTable6,
		hmark: HMARK6, commentMatch: CommentMatch6, conntrackMatch: ConntrackMatch6, connmark: Connmark6,
		markMatch: MarkMatch6, ctTarget: CTTarget6, ipsets: IPSets6, setMatch: SetMatch6, portSets: PortSets6, synSets: SynSets6,
	}
)

// check is a check of the family's: probe runs on the family's view of the
// probes, and the family's own prerequisites come first.
func (f family) check(feature Feature, requires []Feature, probe func(Kernel) error) Check {
	if !f.ipv6 {
		return Check{Feature: feature, Requires: requires, Probe: probe}
	}
	return Check{
		Feature:  feature,
		Requires: slices.Concat(f.requires, requires),
		Probe:    func(k Kernel) error { return probe(k.IPv6()) },
	}
}

// chainCheck probes table with a chain of its own.
func (f family) chainCheck(table Feature, tableName string) Check {
	c := f.check(table, []Feature{f.iptablesCommand}, func(k Kernel) error { return k.IPTablesChain(tableName) })
	c.Rule, c.IPv6 = &TableRule{Table: tableName}, f.ipv6
	return c
}

// ruleCheck probes an extension with rule in a chain of table.
func (f family) ruleCheck(feature Feature, table Feature, tableName string, rule []string) Check {
	c := f.check(feature, []Feature{f.iptablesCommand, table}, func(k Kernel) error { return k.IPTablesRule(tableName, rule...) })
	c.Rule, c.IPv6 = &TableRule{Table: tableName, Rule: rule}, f.ipv6
	return c
}

// stack is the check of the family itself, none for IPv4.
func (f family) stack() []Check {
	if !f.ipv6 {
		return nil
	}
	return []Check{{Feature: IPv6Protocol, Probe: func(k Kernel) error { return k.IPv6().IPStack() }}}
}

// Router returns the checks of the tunnel router with the given options:
// policy routing, encap routes, nexthop objects with the mode's encap,
// the HMARK chain and its ipsets always; conntrack's extensions with more
// than one generation; GRE when it creates its GRE device (gre mode); MPLS
// routing and encap mpls in mpls mode. With IPv6, the same again for IPv6
// (MPLS routing, of no family, excepted), after IPv6 itself.
func Router(p RouterParams) []Check {
	checks := routerChecks(p, ipv4)
	if p.IPv6 {
		checks = append(checks, routerChecks(p, ipv6)...)
	}
	return checks
}

func routerChecks(p RouterParams, f family) []Check {
	checks := slices.Concat(f.stack(), []Check{
		f.check(f.policyRouting, nil, Kernel.PolicyRouting),
		f.check(f.lightweightTunnels, nil, Kernel.EncapIPRoute),
	})
	switch p.Mode {
	case encap.GRE:
		checks = append(checks, f.check(f.nextHopObjects, []Feature{f.lightweightTunnels}, Kernel.EncapIPNextHop))
		if p.CreateGREDevice {
			checks = append(checks, f.check(f.flowBasedGRE, nil, Kernel.FlowBasedGRE))
		}
	case encap.MPLS:
		if !f.ipv6 {
			checks = append(checks, Check{Feature: MPLSRouting, Probe: Kernel.MPLSRouting})
		}
		checks = append(checks, f.check(f.mplsEncap, nil, Kernel.EncapMPLSRoute))
	}
	checks = append(checks,
		f.check(f.iptablesCommand, nil, Kernel.IPTables),
		f.chainCheck(f.mangleTable, "mangle"),
		f.ruleCheck(f.hmark, f.mangleTable, "mangle", hmarkRule),
		f.ruleCheck(f.commentMatch, f.mangleTable, "mangle", commentRule),
		f.check(f.ipsets, nil, Kernel.IPSet),
		f.check(f.setMatch, []Feature{f.iptablesCommand, f.mangleTable, f.ipsets}, func(k Kernel) error { return k.IPSetRule("mangle") }),
		f.check(f.portSets, nil, Kernel.PortSet))
	if p.Generations > 1 {
		checks = append(checks,
			f.ruleCheck(f.connmark, f.mangleTable, "mangle", connmarkRule),
			f.ruleCheck(f.markMatch, f.mangleTable, "mangle", markRule),
			f.chainCheck(f.rawTable, "raw"),
			f.ruleCheck(f.ctTarget, f.rawTable, "raw", notrackRule),
			f.check(f.synSets, nil, Kernel.SynSet))
	}
	return checks
}

// Endpoint returns the checks of the endpoint agent in mode for IPv4 tunnel
// IPs: EndpointChecks without IPv6.
func Endpoint(mode encap.Mode, networkPolicy bool) []Check {
	return EndpointChecks(EndpointParams{Mode: mode, NetworkPolicy: networkPolicy})
}

// EndpointChecks returns the checks of the endpoint agent with the given
// options: a GRE device in each pod (gre), or MPLS routes in pods and on the
// node (mpls); with NetworkPolicy, the filter table and the matches of the
// policy rules it writes in pods. With IPv6, then IPv6 itself, an ip6gre
// device in each pod (gre; mpls mode's pop route delivers IPv6 too) and,
// with NetworkPolicy, the same in ip6tables.
func EndpointChecks(p EndpointParams) []Check {
	checks := endpointChecks(p, ipv4)
	if p.IPv6 {
		checks = append(checks, endpointChecks(p, ipv6)...)
	}
	return checks
}

func endpointChecks(p EndpointParams, f family) []Check {
	checks := f.stack()
	switch p.Mode {
	case encap.GRE:
		checks = append(checks, f.check(f.gre, nil, Kernel.GRE))
	case encap.MPLS:
		if !f.ipv6 {
			checks = append(checks, Check{Feature: MPLSRouting, Probe: Kernel.MPLSRouting},
				Check{Feature: BridgeFilter, Probe: Kernel.BridgeFilter})
		}
	}
	if p.UntrackReplies && !f.ipv6 {
		checks = append(checks, Check{Feature: ReplyNotrack, Probe: Kernel.ReplyNotrack})
	}
	if p.NetworkPolicy {
		checks = append(checks,
			f.check(f.iptablesCommand, nil, Kernel.IPTables),
			f.chainCheck(f.filterTable, "filter"),
			f.ruleCheck(f.commentMatch, f.filterTable, "filter", commentRule),
			f.ruleCheck(f.conntrackMatch, f.filterTable, "filter", conntrackRule))
	}
	return checks
}
