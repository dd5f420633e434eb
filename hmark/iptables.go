package hmark

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"

	"github.com/coreos/go-iptables/iptables"
)

// IPTables is the part of github.com/coreos/go-iptables' *iptables.IPTables
// that Chain uses. It is the seam to the kernel: unit tests give Chain a
// fake, privileged tests an iptables bound to a test network namespace.
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
	// ListWithCounters is List with "-c PACKETS BYTES" in every rule.
	ListWithCounters(table, chain string) ([]string, error)
	// Append adds a rule at the end of chain.
	Append(table, chain string, rulespec ...string) error
	// Insert adds a rule at position pos (1-based) of chain.
	Insert(table, chain string, pos int, rulespec ...string) error
	// Delete removes the first rule of chain that matches rulespec.
	Delete(table, chain string, rulespec ...string) error
	// DeleteById (go-iptables' spelling) removes the rule at position id
	// (1-based) of chain.
	DeleteById(table, chain string, id int) error
}

const (
	// Table is the iptables table that holds the router's chain: HMARK
	// must mark packets before the routing decision.
	Table = "mangle"
	// ParentChain is the built-in chain that jumps to the router's chain.
	ParentChain = "PREROUTING"
	// DefaultChainName is the router's own chain when none is configured.
	DefaultChainName = "KST-HMARK"
	// RuleComment is the iptables comment on every rule the router writes,
	// so that operators can tell where a rule comes from.
	RuleComment = "kube-service-tunnel"
	// maxChainNameLen is the longest chain name iptables accepts
	// (XT_EXTENSION_MAXNAMELEN - 1).
	maxChainNameLen = 28
)

// Counter holds the traffic counters of one tunnel IP's HMARK rule.
type Counter struct {
	// Packets is the number of packets the rule marked.
	Packets uint64
	// Bytes is the number of bytes of those packets.
	Bytes uint64
}

// Restorer is the seam to iptables-restore: Chain hands it the whole new
// content of its chain in one payload, so that rewriting 10,000 rules costs
// one process instead of 10,000. ExecRestorer runs the real binary; unit
// tests give Chain a fake, privileged tests a restorer bound to a test
// network namespace.
type Restorer interface {
	// Restore applies payload, in iptables-save format and for table only
	// ("*table", chain declarations, rules, "COMMIT"), as `iptables-restore
	// --noflush --wait` does: atomically, each chain the payload declares
	// flushed and refilled, every other chain and rule left as it is.
	// Errors may quote the payload; Chain scrubs its seed from them.
	Restore(table string, payload []byte) error
}

// ExecRestorer is the Restorer that runs an iptables-restore binary with
// --noflush --wait (waiting for the xtables lock, like go-iptables does).
type ExecRestorer struct {
	// Command is the iptables-restore binary: a name looked up in PATH,
	// or a path. It must match the iptables binary Chain reads with (same
	// backend), or Chain writes rules where it never reads them.
	Command string
}

// NewExecRestorer returns the Restorer that runs the iptables-restore
// matching iptablesBinary, a name or a path: "iptables" (or "") gives
// "iptables-restore", "iptables-legacy" gives "iptables-legacy-restore",
// "/usr/sbin/iptables-nft" gives "/usr/sbin/iptables-nft-restore".
func NewExecRestorer(iptablesBinary string) *ExecRestorer {
	if iptablesBinary == "" {
		iptablesBinary = "iptables"
	}
	return &ExecRestorer{Command: iptablesBinary + "-restore"}
}

// Restore runs `Command --noflush --wait` with payload on its standard
// input. It refuses a payload that does not start with "*table". Its error
// has the tool's output, which may quote a rule of the payload.
func (r *ExecRestorer) Restore(table string, payload []byte) error {
	if !bytes.HasPrefix(payload, []byte("*"+table+"\n")) {
		return fmt.Errorf("%s: payload does not start with *%s", r.Command, table)
	}
	cmd := exec.Command(r.Command, "--noflush", "--wait")
	cmd.Stdin = bytes.NewReader(payload)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s --noflush --wait (table %s): %w: %s", r.Command, table, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// Chain is the router's own chain in the mangle table: one HMARK rule per
// tunnel IP, and a single jump to it from mangle PREROUTING. Chain owns
// everything inside its chain (and removes what it did not write), but only
// its jump rule in PREROUTING and nothing in any other chain. It assumes it
// is the only writer of its chain: calls must not run concurrently, nor two
// routers share a network namespace.
type Chain struct {
	ipt    IPTables
	name   string
	params Params
	// restorer rewrites the chain's rules in one call; nil when ipt offers
	// none, and then rules are written one by one through ipt.
	restorer Restorer
}

// NewChain returns the router's chain named name (DefaultChainName when
// empty), programmed through ipt, whose rules mark packets with params.
// Nothing is written until Sync.
//
// The chain's rules are written with iptables-restore (see Sync), chosen
// from ipt: ipt itself when it also implements Restorer; for go-iptables'
// *iptables.IPTables, iptables-restore from PATH (ip6tables-restore for
// IPv6), which matches the binary iptables.New() uses by default, so give
// an *iptables.IPTables on another binary (iptables-legacy, a path) its
// restorer with NewChainWithRestorer and NewExecRestorer. Any other ipt
// (say, a wrapper running iptables in another network namespace) has no
// restorer, and Chain then writes its rules one by one through ipt: the
// same result, one iptables process per rule.
func NewChain(ipt IPTables, name string, params Params) (*Chain, error) {
	var restorer Restorer
	switch v := ipt.(type) {
	case Restorer:
		restorer = v
	case *iptables.IPTables:
		binary := "iptables"
		if v.Proto() == iptables.ProtocolIPv6 {
			binary = "ip6tables"
		}
		restorer = NewExecRestorer(binary)
	}
	return newChain(ipt, name, params, restorer)
}

// NewChainWithRestorer is NewChain with the Restorer that writes the
// chain's rules, e.g. NewExecRestorer("iptables-legacy") for an ipt driving
// iptables-legacy. restorer must write where ipt reads: the same backend,
// in the same network namespace.
func NewChainWithRestorer(ipt IPTables, name string, params Params, restorer Restorer) (*Chain, error) {
	if restorer == nil {
		return nil, errors.New("hmark: new chain: nil restorer")
	}
	return newChain(ipt, name, params, restorer)
}

func newChain(ipt IPTables, name string, params Params, restorer Restorer) (*Chain, error) {
	if ipt == nil {
		return nil, errors.New("hmark: new chain: nil iptables")
	}
	if name == "" {
		name = DefaultChainName
	}
	if err := validateChainName(name); err != nil {
		return nil, fmt.Errorf("hmark: new chain: %w", err)
	}
	if err := params.Validate(); err != nil {
		return nil, fmt.Errorf("hmark: new chain %s: %w", name, err)
	}
	return &Chain{ipt: ipt, name: name, params: params, restorer: restorer}, nil
}

// Name returns the name of the chain.
func (c *Chain) Name() string { return c.name }

// Params returns the HMARK parameters the chain installs.
func (c *Chain) Params() Params { return c.params }

// Sync makes the kernel match the desired state for vips, level-triggered:
// the chain exists, mangle PREROUTING holds exactly one jump to it, and the
// chain holds exactly one HMARK rule per tunnel IP with c's parameters and
// nothing else. It reads what is there (one `iptables -S` of PREROUTING and
// one of the chain), compares it semantically (iptables prints HMARK rules
// in its own normalized form) and writes only when something differs. A
// state that is already right costs no write at all, which is how a
// restarted router adopts what its predecessor left.
//
// The chain is created and the jump fixed through go-iptables (inserted
// before any stale jump is deleted). When the chain's rules differ from the
// desired ones (a tunnel IP missing or gone, a rule with other parameters
// after a config change, a duplicate, a rule Chain did not write), Sync
// replaces the chain's whole content in one iptables-restore --noflush
// call: the chain declared (which flushes it and nothing else) and one rule
// per tunnel IP appended, in address order. That is atomic, so packets see
// either the old rules or the new ones, never a chain in between; it also
// resets the packet and byte counters of every rule in the chain (see
// Counters). Without a restorer (see NewChain) the missing rules are
// appended and the unwanted ones deleted, one iptables call each.
//
// changed is the number of differences Sync repaired, not the number of
// rules written: 1 for a created chain, 1 per jump inserted or deleted, and
// for the chain's rules the number added plus the number removed (a rule
// whose parameters changed counts 2), although a restore rewrites every
// rule. When an error stops Sync part way, changed counts what was applied
// before it; a failed restore applies nothing.
//
// Errors never show the seed: go-iptables puts the whole command line in
// its errors, and iptables-restore may quote a line of its input, so Chain
// replaces the seed there with its fingerprint.
func (c *Chain) Sync(vips []netip.Addr) (changed int, err error) {
	changed, err = c.sync(vips)
	return changed, c.redactSeed(err)
}

func (c *Chain) sync(vips []netip.Addr) (changed int, err error) {
	want, err := normalizeVIPs(vips)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}

	exists, err := c.ipt.ChainExists(Table, c.name)
	if err != nil {
		return changed, fmt.Errorf("hmark: sync chain %s: check chain: %w", c.name, err)
	}
	if !exists {
		if err := c.ipt.NewChain(Table, c.name); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: create chain: %w", c.name, err)
		}
		changed++
	}

	n, err := c.syncJump()
	changed += n
	if err != nil {
		return changed, err
	}
	n, err = c.syncRules(want)
	changed += n
	return changed, err
}

// syncJump leaves exactly one jump rule to c in PREROUTING, in its
// canonical form; other rules that jump or go to c there are deleted.
func (c *Chain) syncJump() (changed int, err error) {
	rules, err := c.listRules(ParentChain, false)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	haveCanonical := false
	var stale []rule
	for _, r := range rules {
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
		if err := c.ipt.Insert(Table, ParentChain, 1, c.jumpSpec()...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: insert jump in %s: %w", c.name, ParentChain, err)
		}
		changed++
	}
	for _, r := range stale {
		// By spec, not position: other agents write PREROUTING too.
		if err := c.ipt.Delete(Table, ParentChain, r.spec...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: delete stale jump %q from %s: %w",
				c.name, strings.Join(r.spec, " "), ParentChain, err)
		}
		changed++
	}
	return changed, nil
}

// syncRules leaves exactly one canonical HMARK rule per wanted tunnel IP
// (want is sorted and without duplicates) in c's own chain and nothing
// else there, and returns the number of rules added plus removed.
func (c *Chain) syncRules(want []netip.Addr) (changed int, err error) {
	rules, err := c.listRules(c.name, false)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	wanted := make(map[netip.Addr]bool, len(want))
	for _, vip := range want {
		wanted[vip] = true
	}
	kept := make(map[netip.Addr]bool, len(want))
	var stale []int // 1-based positions in the chain, ascending
	for _, r := range rules {
		vip, params, ok := r.vipRule()
		if ok && params == c.params && wanted[vip] && !kept[vip] {
			kept[vip] = true
			continue
		}
		stale = append(stale, r.pos)
	}
	missing := make([]netip.Addr, 0, len(want)-len(kept))
	for _, vip := range want {
		if !kept[vip] {
			missing = append(missing, vip)
		}
	}
	if len(missing) == 0 && len(stale) == 0 {
		return 0, nil
	}
	if c.restorer == nil {
		return c.syncRulesOneByOne(missing, stale)
	}
	if err := c.restorer.Restore(Table, c.restorePayload(want)); err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: restore %d rules (%d to add, %d to remove): %w",
			c.name, len(want), len(missing), len(stale), err)
	}
	return len(missing) + len(stale), nil
}

// restorePayload is the iptables-restore input that replaces the content
// of c's chain with one rule per tunnel IP of want, in want's order. With
// --noflush, declaring the chain flushes it (and creates it if absent);
// no other chain is declared, so no other chain changes. No word needs
// quoting: the chain name is validated, the comment is RuleComment.
func (c *Chain) restorePayload(want []netip.Addr) []byte {
	var b bytes.Buffer
	b.Grow(64 + len(want)*(len(c.name)+200))
	fmt.Fprintf(&b, "*%s\n:%s - [0:0]\n", Table, c.name)
	for _, vip := range want {
		b.WriteString("-A ")
		b.WriteString(c.name)
		for _, w := range c.ruleSpec(vip) {
			b.WriteByte(' ')
			b.WriteString(w)
		}
		b.WriteByte('\n')
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// syncRulesOneByOne appends the rules for missing and deletes the rules at
// the positions in stale (ascending), one iptables call each, for a Chain
// without a restorer.
func (c *Chain) syncRulesOneByOne(missing []netip.Addr, stale []int) (changed int, err error) {
	// Append first: the chain's rules all continue (HMARK is not a
	// terminating target), so with both an old and a new rule for a tunnel
	// IP the later, new one sets the mark until the old one is gone.
	for _, vip := range missing {
		if err := c.ipt.Append(Table, c.name, c.ruleSpec(vip)...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: append rule for vip %s: %w", c.name, vip, err)
		}
		changed++
	}
	// Delete from the end, so that the positions listed stay valid; the
	// appended rules come after all of them.
	for i := len(stale) - 1; i >= 0; i-- {
		if err := c.ipt.DeleteById(Table, c.name, stale[i]); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: delete stale rule %d: %w", c.name, stale[i], err)
		}
		changed++
	}
	return changed, nil
}

// Cleanup removes the jump rules to c from PREROUTING, then c's chain with
// its rules. What is already absent is not an error. It fails if a rule
// outside PREROUTING still refers to the chain: Chain never touches those.
func (c *Chain) Cleanup() error {
	return c.redactSeed(c.cleanup())
}

func (c *Chain) cleanup() error {
	rules, err := c.listRules(ParentChain, false)
	if err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: %w", c.name, err)
	}
	for _, r := range rules {
		if !r.targets(c.name) {
			continue
		}
		if err := c.ipt.Delete(Table, ParentChain, r.spec...); err != nil {
			return fmt.Errorf("hmark: cleanup chain %s: delete jump %q from %s: %w",
				c.name, strings.Join(r.spec, " "), ParentChain, err)
		}
	}
	exists, err := c.ipt.ChainExists(Table, c.name)
	if err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: check chain: %w", c.name, err)
	}
	if !exists {
		return nil
	}
	if err := c.ipt.ClearChain(Table, c.name); err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: flush: %w", c.name, err)
	}
	if err := c.ipt.DeleteChain(Table, c.name); err != nil {
		return fmt.Errorf("hmark: cleanup chain %s: delete chain: %w", c.name, err)
	}
	return nil
}

// Counters returns the packet and byte counters of the chain's HMARK rules
// with c's parameters, by tunnel IP (summed should a tunnel IP have more
// than one such rule). Other rules are left out. The counters run from when
// the rule was written: a Sync that restores the chain (because any of its
// rules differed) writes every rule anew, with zero counters.
func (c *Chain) Counters() (map[netip.Addr]Counter, error) {
	rules, err := c.listRules(c.name, true)
	if err != nil {
		return nil, c.redactSeed(fmt.Errorf("hmark: counters of chain %s: %w", c.name, err))
	}
	counters := make(map[netip.Addr]Counter)
	for _, r := range rules {
		vip, params, ok := r.vipRule()
		if !ok || params != c.params {
			continue
		}
		if !r.hasCounters {
			return nil, fmt.Errorf("hmark: counters of chain %s: no counters in rule %d", c.name, r.pos)
		}
		sum := counters[vip]
		sum.Packets += r.packets
		sum.Bytes += r.bytes
		counters[vip] = sum
	}
	return counters, nil
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

// jumpSpec is the canonical jump rule to c in PREROUTING.
func (c *Chain) jumpSpec() []string {
	return []string{"-m", "comment", "--comment", RuleComment, "-j", c.name}
}

// ruleSpec is the HMARK rule for vip, as it is written. iptables prints it
// back in another form (see vipRule).
func (c *Chain) ruleSpec(vip netip.Addr) []string {
	return []string{
		"-d", netip.PrefixFrom(vip, 32).String(),
		"-m", "comment", "--comment", RuleComment,
		"-j", "HMARK",
		"--hmark-tuple", "src,dst,sport,dport,proto",
		"--hmark-mod", strconv.FormatUint(uint64(c.params.Buckets), 10),
		"--hmark-offset", strconv.FormatUint(uint64(c.params.Offset), 10),
		"--hmark-rnd", fmt.Sprintf("0x%08x", c.params.Seed),
	}
}

// listRules lists and parses the rules of chain (not its -N/-P lines).
func (c *Chain) listRules(chain string, withCounters bool) ([]rule, error) {
	var lines []string
	var err error
	if withCounters {
		lines, err = c.ipt.ListWithCounters(Table, chain)
	} else {
		lines, err = c.ipt.List(Table, chain)
	}
	if err != nil {
		return nil, fmt.Errorf("list %s %s: %w", Table, chain, err)
	}
	var rules []rule
	for _, line := range lines {
		r, ok, err := parseRule(line, chain, withCounters)
		if err != nil {
			return nil, fmt.Errorf("list %s %s: %w", Table, chain, err)
		}
		if !ok {
			continue
		}
		r.pos = len(rules) + 1
		rules = append(rules, r)
	}
	return rules, nil
}

// normalizeVIPs checks that every tunnel IP is IPv4 and returns them
// unmapped, sorted and without duplicates.
func normalizeVIPs(vips []netip.Addr) ([]netip.Addr, error) {
	out := make([]netip.Addr, 0, len(vips))
	for _, vip := range vips {
		v := vip.Unmap()
		if !v.Is4() {
			return nil, fmt.Errorf("vip %q is not an IPv4 address", vip)
		}
		out = append(out, v)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out), nil
}

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

// rule is one "-A CHAIN ..." line of `iptables -S`.
type rule struct {
	// pos is the rule's 1-based position in its chain.
	pos int
	// spec is the rule without "-A CHAIN" and without counters: what
	// iptables -D takes to delete it.
	spec []string
	// hasCounters, packets and bytes come from "-c PACKETS BYTES".
	hasCounters    bool
	packets, bytes uint64
}

// parseRule parses one line of `iptables -S chain`, or of `iptables -v -S
// chain` when withCounters. ok is false for lines that are not rules of
// chain (-N, -P).
func parseRule(line, chain string, withCounters bool) (r rule, ok bool, err error) {
	words, err := splitWords(line)
	if err != nil {
		return rule{}, false, fmt.Errorf("parse rule %q: %w", line, err)
	}
	if len(words) < 2 || words[0] != "-A" || words[1] != chain {
		return rule{}, false, nil
	}
	r.spec = words[2:]
	if !withCounters {
		return r, true, nil
	}
	// "-c PACKETS BYTES" sits before the target; go-iptables moves nft's
	// "[P:B]" prefix to the end of the line instead.
	for i := 0; i+2 < len(r.spec); i++ {
		if r.spec[i] != "-c" {
			continue
		}
		p, perr := strconv.ParseUint(r.spec[i+1], 10, 64)
		b, berr := strconv.ParseUint(r.spec[i+2], 10, 64)
		if perr != nil || berr != nil {
			continue
		}
		r.hasCounters, r.packets, r.bytes = true, p, b
		r.spec = slices.Delete(slices.Clone(r.spec), i, i+3)
		break
	}
	return r, true, nil
}

// targets reports whether r jumps (-j) or goes (-g) to chain.
func (r rule) targets(chain string) bool {
	for i := 0; i+1 < len(r.spec); i++ {
		if (r.spec[i] == "-j" || r.spec[i] == "-g") && r.spec[i+1] == chain {
			return true
		}
	}
	return false
}

// isCanonicalJump reports whether r is exactly the jump rule Chain writes:
// our comment and "-j chain", with no other match.
func (r rule) isCanonicalJump(chain string) bool {
	return slices.Equal(r.spec, []string{"-m", "comment", "--comment", RuleComment, "-j", chain})
}

// vipRule recognizes r as a rule Chain writes: "-d VIP/32", our comment,
// and an HMARK target hashing the full src,dst,sport,dport,proto tuple. It
// compares meaning, not text: iptables prints such a rule as
//
//	-d VIP/32 -m comment --comment kube-service-tunnel -j HMARK
//	  --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff
//	  --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff
//	  --hmark-rnd 0x0000abcd --hmark-mod N --hmark-offset N
//
// (--hmark-offset only when it was given; absent means 0). Anything else in
// the rule (another match, a negation, a port or SPI override, the ct tuple,
// a partial mask) makes it not ours.
func (r rule) vipRule() (vip netip.Addr, params Params, ok bool) {
	vip, opts, ok := splitVIPRule(r.spec)
	if !ok {
		return netip.Addr{}, Params{}, false
	}
	params, ok = parseHMARKOptions(opts)
	if !ok {
		return netip.Addr{}, Params{}, false
	}
	return vip, params, true
}

// splitVIPRule checks the matches of a rule spec: exactly "-d VIP/32" and
// our comment, then "-j HMARK". It returns the tunnel IP and the words
// after "-j HMARK".
func splitVIPRule(spec []string) (vip netip.Addr, targetOpts []string, ok bool) {
	var (
		dst        netip.Prefix
		haveDst    bool
		comment    bool
		matchTypes []string
	)
	for i := 0; i+1 < len(spec); i += 2 {
		arg := spec[i+1]
		switch spec[i] {
		case "-d":
			p, err := netip.ParsePrefix(arg)
			if haveDst || err != nil {
				return netip.Addr{}, nil, false
			}
			dst, haveDst = p, true
		case "-m":
			matchTypes = append(matchTypes, arg)
		case "--comment":
			if comment || arg != RuleComment {
				return netip.Addr{}, nil, false
			}
			comment = true
		case "-j":
			ok := arg == "HMARK" && haveDst && dst.Bits() == 32 && dst.Addr().Is4() &&
				comment && slices.Equal(matchTypes, []string{"comment"})
			if !ok {
				return netip.Addr{}, nil, false
			}
			return dst.Addr(), spec[i+2:], true
		default:
			return netip.Addr{}, nil, false
		}
	}
	return netip.Addr{}, nil, false
}

// parseHMARKOptions reads the HMARK options as iptables prints them and
// returns the parameters if they hash the full src,dst,sport,dport,proto
// tuple and nothing else: /32 prefixes, 0xffff port masks, a protocol mask
// covering the protocol byte, the seed, the modulus and the offset (which
// iptables omits when it is 0 and was not given). Numbers may be decimal or
// 0x hex. Any other option makes the rule not ours.
func parseHMARKOptions(opts []string) (Params, bool) {
	if len(opts)%2 != 0 {
		return Params{}, false
	}
	vals := make(map[string]uint64, len(opts)/2)
	for i := 0; i < len(opts); i += 2 {
		name := opts[i]
		if _, dup := vals[name]; dup || !strings.HasPrefix(name, "--hmark-") {
			return Params{}, false
		}
		v, err := strconv.ParseUint(opts[i+1], 0, 32)
		if err != nil {
			return Params{}, false
		}
		vals[name] = v
	}
	take := func(name string) (uint64, bool) {
		v, ok := vals[name]
		delete(vals, name)
		return v, ok
	}
	for name, want := range map[string]uint64{
		"--hmark-src-prefix": 32,
		"--hmark-dst-prefix": 32,
		"--hmark-sport-mask": 0xffff,
		"--hmark-dport-mask": 0xffff,
	} {
		if got, ok := take(name); !ok || got != want {
			return Params{}, false
		}
	}
	// The protocol is one byte: 0xff and 0xffff (what --hmark-tuple proto
	// sets) mask it the same way.
	if pm, ok := take("--hmark-proto-mask"); !ok || pm&0xff != 0xff {
		return Params{}, false
	}
	mod, okMod := take("--hmark-mod")
	rnd, okRnd := take("--hmark-rnd")
	offset, _ := take("--hmark-offset")
	if !okMod || !okRnd || len(vals) != 0 {
		return Params{}, false
	}
	return Params{Buckets: uint32(mod), Offset: uint32(offset), Seed: uint32(rnd)}, true
}

// splitWords splits a line of `iptables -S` into words the way a shell
// would read them: iptables double-quotes words with spaces (comments) and
// escapes quotes and backslashes inside them with a backslash.
func splitWords(line string) ([]string, error) {
	var (
		words   []string
		cur     strings.Builder
		inWord  bool
		quoted  bool
		escaped bool
	)
	for _, ch := range line {
		switch {
		case escaped:
			cur.WriteRune(ch)
			escaped = false
		case ch == '\\':
			escaped, inWord = true, true
		case ch == '"':
			quoted, inWord = !quoted, true
		case (ch == ' ' || ch == '\t') && !quoted:
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(ch)
			inWord = true
		}
	}
	if quoted || escaped {
		return nil, errors.New("unterminated quote or escape")
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}
