package hmark

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/iptsave"
)

// IPTables is the part of github.com/coreos/go-iptables' *iptables.IPTables
// that Chain uses: it writes the chains themselves and the jumps in
// PREROUTING, and reads single chains outside Sync (Offsets, RulesAhead,
// Cleanup), while Sync reads whole tables, and the rules inside Chain's
// chains are written, through its Restorer. It is the seam to the kernel:
// unit tests give Chain a fake, privileged tests an iptables bound to a
// test network namespace.
type IPTables interface {
	// ChainExists reports whether chain exists in table.
	ChainExists(table, chain string) (bool, error)
	// NewChain creates chain in table; it fails if it exists.
	NewChain(table, chain string) error
	// ClearChain flushes chain in table (creating it if absent).
	ClearChain(table, chain string) error
	// DeleteChain deletes the empty, unreferenced chain from table.
	DeleteChain(table, chain string) error
	// List returns chain's rules as `iptables -S` prints them.
	List(table, chain string) ([]string, error)
	// Insert adds a rule at position pos (1-based) of chain.
	Insert(table, chain string, pos int, rulespec ...string) error
	// Delete removes the first rule of chain that matches rulespec.
	Delete(table, chain string, rulespec ...string) error
}

const (
	// Table is the iptables table that holds the router's chain: HMARK
	// must mark packets before the routing decision.
	Table = "mangle"
	// RawTable holds, in sticky mode, a chain of the same name that keeps
	// SYNs to the tunnel IPs untracked (the raw table is the only one seen
	// before conntrack), and counts every packet to each tunnel IP.
	RawTable = "raw"
	// ParentChain is the built-in chain that jumps to the router's chain,
	// in each table.
	ParentChain = "PREROUTING"
	// DefaultChainName is the router's own chain when none is configured.
	DefaultChainName = "KST-HMARK"
	// DefaultChainName6 is the IPv6 chain's name when none is configured.
	// It differs from DefaultChainName although ip6tables has tables of
	// its own, because ipsets are not: a network namespace has one set of
	// names for both families, and Chain names its sets after itself.
	DefaultChainName6 = "KST-HMARK6"
	// RuleComment is the iptables comment on every rule the router writes,
	// so that operators can tell where a rule comes from.
	RuleComment = "kube-service-tunnel"
	// maxChainNameLen is the longest chain name iptables accepts
	// (XT_EXTENSION_MAXNAMELEN - 1).
	maxChainNameLen = 28
)

// Family is the address family of a Chain: of its tunnel IPs, of its sets
// (inet or inet6) and of the tables its rules live in (iptables' or
// ip6tables'). A dual-stack router has one Chain of each family, under
// different names (see DefaultChainName6); neither reads nor writes what
// the other owns. Its zero value is no family, so that a Chain built
// without one is an error rather than silently IPv4.
type Family uint8

const (
	// IPv4 is the family of iptables and inet sets.
	IPv4 Family = 4
	// IPv6 is the family of ip6tables and inet6 sets.
	IPv6 Family = 6
)

// String returns "IPv4" or "IPv6".
func (f Family) String() string {
	switch f {
	case IPv4:
		return "IPv4"
	case IPv6:
		return "IPv6"
	}
	return fmt.Sprintf("Family(%d)", uint8(f))
}

// valid reports whether f is IPv4 or IPv6.
func (f Family) valid() bool { return f == IPv4 || f == IPv6 }

// bits is the length of one of f's addresses: the prefix of an address
// in the rules ("-d VIP/32", "--hmark-src-prefix 128").
func (f Family) bits() int {
	if f == IPv6 {
		return 128
	}
	return 32
}

// setFamily is the kernel's address family of f's sets, as netlink
// passes it.
func (f Family) setFamily() uint8 {
	if f == IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// Chain is the router's own chain in the mangle table, a single jump to it
// from mangle PREROUTING, and its ipsets: the set of every tunnel IP and one
// set per generation, which the chain's few rules match (one HMARK rule per
// generation, not per tunnel IP: see Sync). In sticky mode (see SetSticky)
// the mangle chain also restores and saves each flow's decision, and a
// chain of the same name in the raw table, jumped to once from raw
// PREROUTING, sends every packet to a tunnel IP to a subchain (the name and
// "-SYN") that keeps SYNs untracked. Chain owns everything inside its
// chains and sets (and removes what it did not write), but only its jump
// rules in PREROUTING and nothing in any other chain or set. It assumes it
// is the only writer of its chains and sets: calls must not run
// concurrently, nor two routers share a network namespace. A Chain is of
// one address family (see Family): an IPv6 Chain is the same chains, rules
// and sets in ip6tables and inet6 sets, for IPv6 tunnel IPs.
type Chain struct {
	family Family
	ipt    IPTables
	sets   IPSets
	name   string
	params Params
	// restorer rewrites the content of a chain in one call.
	restorer Restorer
	// sticky is nil in stateless mode.
	sticky *Sticky
	// last is what the last successful Sync or Update wrote (see Update);
	// nil when unknown.
	last *lastSync
	// synSetsReady: the SYN sets of the handshake memory exist (sticky
	// mode; see ensureSynSets); synSetsRemoved: a stateless Sync removed
	// any a sticky run left.
	synSetsReady, synSetsRemoved bool
}

// NewChain returns the router's IPv4 chain named name (DefaultChainName
// when empty), whose rules mark packets with params. The chains are read,
// created and jumped to through ipt; their rules are written through
// restorer (see Sync), which must write where ipt reads: the same backend,
// in the same network namespace (for go-iptables' iptables.New(), which
// runs "iptables", NewExecRestorer("iptables")). The sets are read and
// written through sets, in the same network namespace. Nothing is written
// until Sync.
func NewChain(ipt IPTables, sets IPSets, name string, params Params, restorer Restorer) (*Chain, error) {
	return NewChainFamily(IPv4, ipt, sets, name, params, restorer)
}

// NewChainFamily is NewChain for the address family family. For IPv6, ipt
// and restorer drive ip6tables (go-iptables' iptables.New with
// iptables.IPFamily(iptables.ProtocolIPv6), or iptables.Path of an
// ip6tables binary; NewExecRestorer("ip6tables")), and name defaults to
// DefaultChainName6: the sets of both families share one namespace of
// names, so the IPv6 chain must not be named like the IPv4 one. An
// ExecRestorer of the other family's iptables is refused, since the rules
// it wrote would never be where ipt reads them.
func NewChainFamily(family Family, ipt IPTables, sets IPSets, name string, params Params, restorer Restorer) (*Chain, error) {
	if !family.valid() {
		return nil, fmt.Errorf("hmark: new chain: address family %s is neither IPv4 nor IPv6", family)
	}
	if restorer == nil {
		return nil, errors.New("hmark: new chain: nil restorer")
	}
	if ipt == nil {
		return nil, errors.New("hmark: new chain: nil iptables")
	}
	if sets == nil {
		return nil, errors.New("hmark: new chain: nil ipsets")
	}
	if name == "" {
		name = DefaultChainName
		if family == IPv6 {
			name = DefaultChainName6
		}
	}
	if err := validateChainName(name); err != nil {
		return nil, fmt.Errorf("hmark: new chain: %w", err)
	}
	if err := params.Validate(); err != nil {
		return nil, fmt.Errorf("hmark: new chain %s: %w", name, err)
	}
	if err := checkRestorerFamily(family, restorer); err != nil {
		return nil, fmt.Errorf("hmark: new chain %s: %w", name, err)
	}
	return &Chain{family: family, ipt: ipt, sets: sets, name: name, params: params, restorer: restorer}, nil
}

// checkRestorerFamily refuses an ExecRestorer that runs the other
// family's iptables-restore (judged by the binary's name: ip6tables*
// is IPv6, iptables* IPv4; any other name is the caller's to get right).
// Other Restorers cannot be told apart.
func checkRestorerFamily(family Family, restorer Restorer) error {
	r, ok := restorer.(*ExecRestorer)
	if !ok {
		return nil
	}
	base := filepath.Base(r.Command)
	var other bool
	switch {
	case strings.HasPrefix(base, "ip6tables"):
		other = family != IPv6
	case strings.HasPrefix(base, "iptables"):
		other = family != IPv4
	}
	if other {
		return fmt.Errorf("restorer %s is not of the chain's family %s", r.Command, family)
	}
	return nil
}

// Name returns the name of the chain.
func (c *Chain) Name() string { return c.name }

// Family returns the chain's address family.
func (c *Chain) Family() Family { return c.family }

// Params returns the HMARK parameters the chain installs.
func (c *Chain) Params() Params { return c.params }

// ensureChain creates c's chain in t if it is missing.
func (c *Chain) ensureChain(t *savedTable) (changed int, err error) {
	return c.ensureNamedChain(t, c.name)
}

// ensureNamedChain creates chain (c's or its raw SYN subchain) in t if it
// is missing; t then has it, empty.
func (c *Chain) ensureNamedChain(t *savedTable, chain string) (changed int, err error) {
	if t.has(chain) {
		return 0, nil
	}
	if err := c.ipt.NewChain(t.name, chain); err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: table %s: create chain %s: %w", c.name, t.name, chain, err)
	}
	t.chains[chain] = []rule{}
	return 1, nil
}

// syncJump leaves exactly one jump rule to c in the PREROUTING of t, in its
// canonical form; other rules that jump or go to c there are deleted.
func (c *Chain) syncJump(t *savedTable) (changed int, err error) {
	table := t.name
	haveCanonical := false
	var stale []rule
	for _, r := range t.chains[ParentChain] {
		if !r.targets(c.name) {
			continue
		}
		if !haveCanonical && r.isCanonicalJump(c.name) {
			haveCanonical = true
			continue
		}
		stale = append(stale, r)
	}
	if !haveCanonical {
		// Insert before deleting, so that traffic is never left unmarked.
		if err := c.ipt.Insert(table, ParentChain, 1, c.jumpSpec()...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: insert jump in %s: %w", c.name, table, ParentChain, err)
		}
		changed++
	}
	for _, r := range stale {
		// By spec, not position: other agents write PREROUTING too.
		if err := c.ipt.Delete(table, ParentChain, r.spec...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: delete stale jump %q from %s: %w",
				c.name, table, strings.Join(r.spec, " "), ParentChain, err)
		}
		changed++
	}
	return changed, nil
}

// RulesAhead returns the rules of mangle PREROUTING that come before c's
// jump there, as iptables -S prints them without "-A PREROUTING" (none
// when the jump is first or absent). A rule ahead that accepts a packet
// ends the table's PREROUTING for it: the packet never reaches c's chain,
// so it is neither marked nor given its connection's mark, and is routed
// as if no tunnel IP were served (Calico's Felix, inserting its chain
// first, accepts every packet of an established connection there).
// Syncing does not move c's jump ahead of them: another agent that keeps
// its own rule first would fight it for the place.
func (c *Chain) RulesAhead() ([]string, error) {
	rules, err := c.listRules(Table, ParentChain)
	if err != nil {
		return nil, fmt.Errorf("hmark: chain %s: %w", c.name, err)
	}
	var ahead []string
	for _, r := range rules {
		if r.targets(c.name) {
			return ahead, nil
		}
		ahead = append(ahead, strings.Join(r.spec, " "))
	}
	return nil, nil
}

// jumpSpec is the canonical jump rule to c in PREROUTING.
func (c *Chain) jumpSpec() []string {
	return []string{"-m", "comment", "--comment", RuleComment, "-j", c.name}
}

// savedTable is what Sync knows of one table: the chains it has, and the
// rules of those Chain reads (PREROUTING, c's chain and its SYN
// subchain), as one Restorer.Save printed them, then kept up to date with
// Sync's own writes to c's chains.
type savedTable struct {
	name string
	// chains has every chain of the table; the rules of the chains read,
	// in order (each rule's pos its position), and none of the others.
	chains map[string][]rule
}

// has reports whether the table has chain.
func (t *savedTable) has(chain string) bool {
	_, ok := t.chains[chain]
	return ok
}

// readTable reads table in one Restorer.Save: which chains exist, and
// the rules of PREROUTING, of c's chain and of its SYN subchain (the
// rules of other chains are not parsed). A save that prints no such table
// is an empty table (none of its chains exist).
func (c *Chain) readTable(table string) (*savedTable, error) {
	out, err := c.restorer.Save(table)
	if err != nil {
		return nil, fmt.Errorf("table %s: read: %w", table, err)
	}
	t := &savedTable{name: table, chains: make(map[string][]rule)}
	read := []string{ParentChain, c.name, c.synChainName()}
	for l := range iptsave.Table(string(out), table) {
		if l.Declared != "" {
			if !t.has(l.Declared) {
				t.chains[l.Declared] = []rule{}
			}
			continue
		}
		if !slices.Contains(read, l.Chain) {
			continue
		}
		words, err := splitWords(l.Spec)
		if err != nil {
			return nil, fmt.Errorf("table %s: read: parse rule %q of %s: %w", table, l.Spec, l.Chain, err)
		}
		rules := t.chains[l.Chain]
		t.chains[l.Chain] = append(rules, rule{pos: len(rules) + 1, spec: words})
	}
	return t, nil
}

// listRules lists and parses the rules of chain in table (not its -N/-P
// lines).
func (c *Chain) listRules(table, chain string) ([]rule, error) {
	lines, err := c.ipt.List(table, chain)
	if err != nil {
		return nil, fmt.Errorf("list %s %s: %w", table, chain, err)
	}
	var rules []rule
	for _, line := range lines {
		r, ok, err := parseRule(line, chain)
		if err != nil {
			return nil, fmt.Errorf("list %s %s: %w", table, chain, err)
		}
		if !ok {
			continue
		}
		r.pos = len(rules) + 1
		rules = append(rules, r)
	}
	return rules, nil
}

// Cleanup removes the jump rules to c from mangle PREROUTING, then c's
// mangle chain with its rules, then the same in the raw table (where a
// sticky Chain has its chain), then the raw SYN subchain, then c's sets.
// What is already absent is not an error. It fails if a rule outside
// PREROUTING (and, for the subchain, outside c's raw chain) still refers
// to a chain, or a rule that is not c's to one of its sets: Chain never
// touches those.
func (c *Chain) Cleanup() error {
	c.last = nil
	c.synSetsReady, c.synSetsRemoved = false, false
	err := c.cleanup(Table)
	if err == nil {
		err = c.cleanup(RawTable)
	}
	if err == nil {
		err = c.cleanupSynChain()
	}
	if err == nil {
		err = c.cleanupSets()
	}
	return c.redactSeed(err)
}

// cleanupSets destroys c's sets, once the chains that matched them are
// gone.
func (c *Chain) cleanupSets() error {
	sets := []ipset{{name: c.allSetName()}, {name: c.filteredSetName()}, {name: c.portSetName()}}
	for k := range classes {
		sets = append(sets, ipset{name: c.classSetName(k)}, ipset{name: c.synSetName(k)}, ipset{name: c.synSetName(k) + synSetTempSuffix})
	}
	for _, s := range sets {
		// Destroying a set that does not exist is no error; no need to
		// read it first (nor to mind what it holds).
		s.exists = true
		if _, err := c.destroySet(&s); err != nil {
			return fmt.Errorf("hmark: cleanup chain %s: %w", c.name, err)
		}
	}
	return nil
}

func (c *Chain) cleanup(table string) error {
	if table != Table {
		// A raw chain is rare (sticky mode only); a jump to a missing
		// chain cannot exist.
		exists, err := c.ipt.ChainExists(table, c.name)
		if err != nil {
			return fmt.Errorf("hmark: cleanup chain %s: table %s: check chain: %w", c.name, table, err)
		}
		if !exists {
			return nil
		}
	}
	rules, err := c.listRules(table, ParentChain)
	if err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: %w", c.name, err)
	}
	for _, r := range rules {
		if !r.targets(c.name) {
			continue
		}
		if err := c.ipt.Delete(table, ParentChain, r.spec...); err != nil {
			return fmt.Errorf("hmark: cleanup chain %s: table %s: delete jump %q from %s: %w",
				c.name, table, strings.Join(r.spec, " "), ParentChain, err)
		}
	}
	return c.deleteChain(table, c.name)
}

// cleanupSynChain removes the raw SYN subchain, once c's raw chain (the
// only one of c's chains that jumps to it) is gone. A Chain whose name
// leaves no room for the subchain's name never had one.
func (c *Chain) cleanupSynChain() error {
	syn := c.synChainName()
	if validateChainName(syn) != nil {
		return nil
	}
	return c.deleteChain(RawTable, syn)
}

// deleteChain flushes and deletes chain from table, if it exists.
func (c *Chain) deleteChain(table, chain string) error {
	exists, err := c.ipt.ChainExists(table, chain)
	if err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: table %s: check chain %s: %w", c.name, table, chain, err)
	}
	if !exists {
		return nil
	}
	if err := c.ipt.ClearChain(table, chain); err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: table %s: flush %s: %w", c.name, table, chain, err)
	}
	if err := c.ipt.DeleteChain(table, chain); err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: table %s: delete chain %s: %w", c.name, table, chain, err)
	}
	return nil
}

// redactSeed hides c's seed, in the form Chain writes it and iptables
// prints it, from err's message; the wrapped errors stay reachable with
// errors.Is and errors.As.
func (c *Chain) redactSeed(err error) error {
	if err == nil {
		return nil
	}
	return &seedRedactedError{err: err, seed: fmt.Sprintf("0x%08x", c.params.Seed), fingerprint: SeedFingerprint(c.params.Seed)}
}

// seedRedactedError is an error whose message has the seed replaced by
// its fingerprint.
type seedRedactedError struct {
	err               error
	seed, fingerprint string
}

func (e *seedRedactedError) Error() string {
	return strings.ReplaceAll(e.err.Error(), e.seed, "<seed "+e.fingerprint+">")
}

func (e *seedRedactedError) Unwrap() error { return e.err }

// validateChainName rejects names iptables would refuse or misread.
func validateChainName(name string) error {
	switch {
	case len(name) > maxChainNameLen:
		return fmt.Errorf("chain name %q is longer than %d characters", name, maxChainNameLen)
	case strings.HasPrefix(name, "-") || strings.HasPrefix(name, "!"):
		return fmt.Errorf("chain name %q must not start with %q", name, name[:1])
	case strings.ContainsFunc(name, func(r rune) bool { return r <= ' ' || r > '~' || r == '"' || r == '\'' }):
		return fmt.Errorf("chain name %q must be printable ASCII without spaces or quotes", name)
	case slices.Contains([]string{"ACCEPT", "DROP", "RETURN", "QUEUE", "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}, name):
		return fmt.Errorf("chain name %q is reserved by iptables", name)
	}
	return nil
}
