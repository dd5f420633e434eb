// Package kernelcheck finds out at start whether the kernel has the features a
// daemon is about to use (GRE, MPLS, lightweight tunnels, policy routing,
// iptables HMARK and friends), so that a missing one is reported at once, by
// name and kernel option, rather than as an obscure netlink or iptables error
// on the first Service.
//
// Every feature is probed for real: the probes create what the daemon would
// create (a flow-based GRE device, an encap route, a nexthop object and a
// route through it, an MPLS route, an iptables rule in a temporary chain) and remove it again, preferably in a throwaway
// network namespace so that the daemon's own namespace is never touched. The
// kernel loads most modules by itself on first use; when a probe fails, the
// module is also tried with modprobe once.
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
	// NextHopObjects ("ip nexthop") carry the routers' encapsulations: one
	// per endpoint, named by every bucket route to it. They are part of
	// IPv4 since Linux 5.3, lightweight-tunnel encapsulations included.
	NextHopObjects = Feature{Name: "nexthop objects", Since: "Linux 5.3"}
)

// Kernel runs the probes. Each returns nil when the kernel did what was
// asked (and the probe removed it again), or the error it got.
type Kernel interface {
	// FlowBasedGRE creates and deletes a flow-based ("external") GRE device.
	FlowBasedGRE() error
	// GRE creates and deletes a GRE device with a local address.
	GRE() error
	// PolicyRouting adds and deletes (or, in the daemon's own namespace,
	// lists) IPv4 policy rules.
	PolicyRouting() error
	// EncapIPRoute adds and deletes an IPv4 route with "encap ip".
	EncapIPRoute() error
	// MPLSRouting makes sure the MPLS sysctls exist and adds and deletes an
	// MPLS route (in a throwaway namespace).
	MPLSRouting() error
	// EncapMPLSRoute adds and deletes an IPv4 route with "encap mpls".
	EncapMPLSRoute() error
	// EncapIPNextHop adds a nexthop object with "encap ip" and a route
	// through it, and deletes both.
	EncapIPNextHop() error
	// IPTables reports whether the iptables command can be used.
	IPTables() error
	// IPTablesChain creates and deletes a chain in table.
	IPTablesChain(table string) error
	// IPTablesRule appends rule to a temporary chain of table and deletes
	// the chain.
	IPTablesRule(table string, rule ...string) error
	// IPSet creates and destroys a hash:ip set.
	IPSet() error
	// IPSetRule creates a hash:ip set, appends a rule matching it to a
	// temporary chain of table, and deletes both.
	IPSetRule(table string) error
	// LoadModule loads a kernel module with modprobe.
	LoadModule(name string) error
}

// Check is one feature and how to probe it.
type Check struct {
	Feature Feature
	// Requires are features without which this probe cannot tell anything
	// (a table for its rules): when one is missing, this check is skipped.
	Requires []Feature
	Probe    func(Kernel) error
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
func Run(k Kernel, checks []Check) error {
	var errs []error
	missing := map[Feature]bool{}
	for _, c := range checks {
		if slices.ContainsFunc(c.Requires, func(f Feature) bool { return missing[f] }) {
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

func ruleCheck(f Feature, table Feature, tableName string, rule []string) Check {
	return Check{Feature: f, Requires: []Feature{IPTablesCommand, table}, Probe: func(k Kernel) error { return k.IPTablesRule(tableName, rule...) }}
}

// Router returns the checks of the tunnel router with the given options:
// policy routing, encap routes, nexthop objects with the mode's encap,
// the HMARK chain and its ipsets always; conntrack's extensions with more
// than one generation; GRE when it creates its GRE device (gre mode); MPLS
// routing and encap mpls in mpls mode.
func Router(p RouterParams) []Check {
	checks := []Check{
		{Feature: PolicyRouting, Probe: Kernel.PolicyRouting},
		{Feature: LightweightTunnels, Probe: Kernel.EncapIPRoute},
	}
	switch p.Mode {
	case encap.GRE:
		checks = append(checks, Check{Feature: NextHopObjects, Requires: []Feature{LightweightTunnels}, Probe: Kernel.EncapIPNextHop})
		if p.CreateGREDevice {
			checks = append(checks, Check{Feature: FlowBasedGRE, Probe: Kernel.FlowBasedGRE})
		}
	case encap.MPLS:
		checks = append(checks,
			Check{Feature: MPLSRouting, Probe: Kernel.MPLSRouting},
			Check{Feature: MPLSEncap, Probe: Kernel.EncapMPLSRoute})
	}
	checks = append(checks,
		Check{Feature: IPTablesCommand, Probe: Kernel.IPTables},
		Check{Feature: MangleTable, Requires: []Feature{IPTablesCommand}, Probe: func(k Kernel) error { return k.IPTablesChain("mangle") }},
		ruleCheck(HMARK, MangleTable, "mangle", hmarkRule),
		ruleCheck(CommentMatch, MangleTable, "mangle", commentRule),
		Check{Feature: IPSets, Probe: Kernel.IPSet},
		Check{Feature: SetMatch, Requires: []Feature{IPTablesCommand, MangleTable, IPSets}, Probe: func(k Kernel) error { return k.IPSetRule("mangle") }})
	if p.Generations > 1 {
		checks = append(checks,
			ruleCheck(ConntrackMatch, MangleTable, "mangle", conntrackRule),
			ruleCheck(Connmark, MangleTable, "mangle", connmarkRule),
			ruleCheck(MarkMatch, MangleTable, "mangle", markRule),
			Check{Feature: RawTable, Requires: []Feature{IPTablesCommand}, Probe: func(k Kernel) error { return k.IPTablesChain("raw") }},
			ruleCheck(CTTarget, RawTable, "raw", notrackRule))
	}
	return checks
}

// Endpoint returns the checks of the endpoint agent in mode: a GRE device
// in each pod (gre), or MPLS routes in pods and on the node (mpls); with
// networkPolicy, the filter table and the matches of the policy rules it
// writes in pods.
func Endpoint(mode encap.Mode, networkPolicy bool) []Check {
	var checks []Check
	switch mode {
	case encap.GRE:
		checks = []Check{{Feature: GRE, Probe: Kernel.GRE}}
	case encap.MPLS:
		checks = []Check{{Feature: MPLSRouting, Probe: Kernel.MPLSRouting}}
	}
	if networkPolicy {
		checks = append(checks,
			Check{Feature: IPTablesCommand, Probe: Kernel.IPTables},
			Check{Feature: FilterTable, Requires: []Feature{IPTablesCommand}, Probe: func(k Kernel) error { return k.IPTablesChain("filter") }},
			ruleCheck(CommentMatch, FilterTable, "filter", commentRule),
			ruleCheck(ConntrackMatch, FilterTable, "filter", conntrackRule))
	}
	return checks
}
