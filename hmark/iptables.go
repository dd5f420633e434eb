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
	// RawTable holds, in sticky mode, a chain of the same name that keeps
	// SYNs to the tunnel IPs untracked (the raw table is the only one seen
	// before conntrack), and counts every packet to each tunnel IP.
	RawTable = "raw"
	// ParentChain is the built-in chain that jumps to the router's chain,
	// in each table.
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

// Counter holds the traffic counters of one tunnel IP's rule (see
// Counters).
type Counter struct {
	// Packets is the number of packets the rule matched.
	Packets uint64
	// Bytes is the number of bytes of those packets, IP header included.
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
	// --noflush --counters --wait` does: atomically, each chain the payload
	// declares flushed and refilled, every other chain and rule left as it
	// is, and a rule written "[PACKETS:BYTES] -A ..." starting from those
	// counters (Chain carries a rewritten rule's counters over that way; a
	// restorer that ignores them only makes the counters restart from 0).
	// Errors may quote the payload; Chain scrubs its seed from them.
	Restore(table string, payload []byte) error
}

// ExecRestorer is the Restorer that runs an iptables-restore binary with
// --noflush --counters --wait (waiting for the xtables lock, like
// go-iptables does).
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

// Restore runs `Command --noflush --counters --wait` with payload on its
// standard input. It refuses a payload that does not start with "*table".
// Its error has the tool's output, which may quote a rule of the payload.
func (r *ExecRestorer) Restore(table string, payload []byte) error {
	if !bytes.HasPrefix(payload, []byte("*"+table+"\n")) {
		return fmt.Errorf("%s: payload does not start with *%s", r.Command, table)
	}
	cmd := exec.Command(r.Command, "--noflush", "--counters", "--wait")
	cmd.Stdin = bytes.NewReader(payload)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s --noflush --counters --wait (table %s): %w: %s", r.Command, table, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// Target is one tunnel IP and the HMARK offset its rule marks with: the
// mark of bucket 0 of the routing generation the tunnel IP is on. The
// router keeps several generations of routing tables per tunnel IP (see
// Sticky); moving a tunnel IP to a new generation is a Sync with another
// Offset for it.
type Target struct {
	// VIP is the tunnel IP (IPv4; 4-in-6 addresses are unmapped).
	VIP netip.Addr
	// Offset is the tunnel IP's --hmark-offset. 0 means the chain's
	// Params.Offset, so a router without generations passes no offset.
	Offset uint32
}

// Chain is the router's own chain in the mangle table: one HMARK rule per
// tunnel IP, and a single jump to it from mangle PREROUTING. In sticky mode
// (see SetSticky) the mangle chain also restores and saves each flow's
// decision, and a chain of the same name in the raw table, jumped to once
// from raw PREROUTING, sends every packet to a tunnel IP to a subchain
// (the name and "-SYN") that keeps SYNs untracked. Chain owns everything
// inside its chains (and removes what it did not write), but only its jump
// rules in PREROUTING and nothing in any other chain. It
// assumes it is the only writer of its chains: calls must not run
// concurrently, nor two routers share a network namespace.
type Chain struct {
	ipt    IPTables
	name   string
	params Params
	// restorer rewrites the chain's rules in one call; nil when ipt offers
	// none, and then rules are written one by one through ipt.
	restorer Restorer
	// sticky is nil in stateless mode.
	sticky *Sticky
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

// Sync makes the kernel match the desired state for targets,
// level-triggered: the chain exists, mangle PREROUTING holds exactly one
// jump to it, and the chain holds exactly one HMARK rule per tunnel IP,
// with that target's offset (Offset 0: the chain's Params.Offset) and the
// chain's other parameters, and nothing else (in sticky mode, also the
// fixed rules around them and the raw chain: see SetSticky). Targets must
// not repeat a tunnel IP. It reads what is there (one `iptables -S` of
// each PREROUTING and of each chain), compares it semantically (iptables
// prints HMARK rules in its own normalized form, the offset in hex) and
// writes only when something differs. A state that is already right costs
// no write at all, which is how a restarted router adopts what its
// predecessor left (see Offsets for adopting each tunnel IP's generation).
//
// The chains are created and the jumps fixed through go-iptables (inserted
// before any stale jump is deleted). When a chain's rules differ from the
// desired ones (a tunnel IP missing or gone, a rule with other parameters
// or another offset, a duplicate, a rule Chain did not write, fixed rules
// missing or out of order), Sync replaces the chain's whole content in one
// iptables-restore --noflush call: the chain declared (which flushes it
// and nothing else) and the desired rules, tunnel IPs in address order.
// That is atomic, so packets see either the old rules or the new ones,
// never a chain in between. The rules of the tunnel IPs that stay keep
// their packet and byte counters (see Counters): Sync lists the chain with
// its counters (`iptables -v -S`) and writes each tunnel IP's rule back
// with the sum of the counters of its old rules ("[PACKETS:BYTES]", what
// Counters reported for it), so that only the packets counted between
// that listing and the restore are lost; a tunnel IP's mangle rule keeps
// them when it moves to another generation too. Without a restorer (see
// NewChain) the missing rules are added and the unwanted ones deleted, one
// iptables call each (new tunnel IPs' rules inserted before the save rule
// in sticky mode); when the sticky fixed rules are wrong, the whole
// desired content is appended after the old rules, then the old rules
// deleted, so that the chain is never empty. Rules written that way start
// from zero counters: a tunnel IP moved to another generation, or every
// one of them when the chain is rewritten, restarts its mangle counters.
//
// The order is fixed: mangle chain and jump; in sticky mode, raw chain,
// its SYN subchain and the subchain's rule, the raw jump, then raw rules
// for new tunnel IPs (and rules of an older version replaced); the mangle
// rules; then raw rules of tunnel IPs gone (in stateless mode, the raw
// chains and the canonical jump left by a sticky run). So a tunnel IP's SYNs are
// untracked before it is hashed and until it is no longer hashed. Either
// order would be safe for packets: a hashed flow whose SYN was tracked
// only stays on fresh hash decisions (stateless), and an untracked SYN
// without a hash rule is not routed by mark.
//
// changed is the number of differences Sync repaired, not the number of
// rules written: 1 per chain created, 1 per jump inserted or deleted, and
// for each chain's rules the number added plus the number removed (a rule
// whose parameters or offset changed counts 2, a fixed rule out of place
// too), although a restore rewrites every rule. Removing the raw chains of
// an earlier sticky run counts its jump, their rules and the chains. When an
// error stops Sync part way, changed counts what was applied before it; a
// failed restore applies nothing.
//
// Errors never show the seed: go-iptables puts the whole command line in
// its errors, and iptables-restore may quote a line of its input, so Chain
// replaces the seed there with its fingerprint.
func (c *Chain) Sync(targets []Target) (changed int, err error) {
	changed, err = c.sync(targets)
	return changed, c.redactSeed(err)
}

func (c *Chain) sync(targets []Target) (changed int, err error) {
	want, err := c.normalizeTargets(targets)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}

	n, err := c.ensureChain(Table)
	changed += n
	if err != nil {
		return changed, err
	}
	n, err = c.syncJump(Table)
	changed += n
	if err != nil {
		return changed, err
	}

	var raw rawPlan
	if c.sticky != nil {
		n, err = c.ensureChain(RawTable)
		changed += n
		if err != nil {
			return changed, err
		}
		n, err = c.syncSynChain()
		changed += n
		if err != nil {
			return changed, err
		}
		n, err = c.syncJump(RawTable)
		changed += n
		if err != nil {
			return changed, err
		}
		if raw, err = c.planRaw(want); err != nil {
			return changed, err
		}
		n, err = c.addRawRules(want, &raw)
		changed += n
		if err != nil {
			return changed, err
		}
	}

	n, err = c.syncMangleRules(want)
	changed += n
	if err != nil {
		return changed, err
	}

	if c.sticky != nil {
		n, err = c.removeRawRules(want, &raw)
	} else {
		n, err = c.removeRawChain()
	}
	changed += n
	return changed, err
}

// ensureChain creates c's chain in table if it is missing.
func (c *Chain) ensureChain(table string) (changed int, err error) {
	return c.ensureNamedChain(table, c.name)
}

// ensureNamedChain creates chain (c's or its raw SYN subchain) in table if
// it is missing.
func (c *Chain) ensureNamedChain(table, chain string) (changed int, err error) {
	exists, err := c.ipt.ChainExists(table, chain)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: table %s: check chain %s: %w", c.name, table, chain, err)
	}
	if exists {
		return 0, nil
	}
	if err := c.ipt.NewChain(table, chain); err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: table %s: create chain %s: %w", c.name, table, chain, err)
	}
	return 1, nil
}

// syncJump leaves exactly one jump rule to c in table's PREROUTING, in its
// canonical form; other rules that jump or go to c there are deleted.
func (c *Chain) syncJump(table string) (changed int, err error) {
	rules, err := c.listRules(table, ParentChain, false)
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

// desiredRule is one rule of the desired content of a chain.
type desiredRule struct {
	spec []string
	// vip is the tunnel IP of an HMARK or raw rule, invalid for a fixed
	// rule.
	vip netip.Addr
	// missing is set when the chain lacks the rule where it belongs.
	missing bool
	// counters are the counters a restore writes the rule with: those of
	// the rules it replaces, zero for a new one.
	counters Counter
}

// syncMangleRules leaves exactly the desired content in c's mangle chain:
// in sticky mode the fixed head rules, one canonical HMARK rule per target
// (want is sorted and without duplicates), the save rule; in stateless
// mode only the HMARK rules. It returns the number of rules added plus
// removed.
func (c *Chain) syncMangleRules(want []Target) (changed int, err error) {
	// With the counters, to write them back should the chain be restored.
	rules, err := c.listRules(Table, c.name, true)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	head, tail := c.fixedMangleRules()
	n := len(rules)
	kept := make([]bool, n)
	structureOK := true
	var desired []desiredRule
	// The fixed rules are matched in order: the head from the top, the
	// tail from the bottom; the HMARK rules count only between them. The
	// chain has the right structure when the head is the top of the chain
	// and the tail its bottom. (changed then counts a fixed rule out of
	// place as removed and added; the matching is greedy, so in odd
	// states it may count a few more.)
	from := 0 // the HMARK rules start here
	for k, spec := range head {
		i := slices.IndexFunc(rules[from:], func(r rule) bool { return slices.Equal(r.spec, spec) })
		if i >= 0 {
			kept[from+i] = true
			from += i + 1
		}
		structureOK = structureOK && i >= 0 && from == k+1
		desired = append(desired, desiredRule{spec: spec, missing: i < 0})
	}
	to := n // and end here
	tailRules := make([]desiredRule, len(tail))
	for k := len(tail) - 1; k >= 0; k-- {
		found := -1
		for i := to - 1; i >= from; i-- {
			if slices.Equal(rules[i].spec, tail[k]) {
				found = i
				break
			}
		}
		if found >= 0 {
			kept[found] = true
			to = found
		}
		structureOK = structureOK && found >= 0 && found == n-len(tail)+k
		tailRules[k] = desiredRule{spec: tail[k], missing: found < 0}
	}

	offsets := make(map[netip.Addr]uint32, len(want))
	for _, t := range want {
		offsets[t.VIP] = t.Offset
	}
	keptVIP := make(map[netip.Addr]bool, len(want))
	var stale []int // 1-based positions in the chain, ascending
	for i, r := range rules {
		if kept[i] {
			continue
		}
		vip, params, ok := r.vipRule()
		if offset, wanted := offsets[vip]; ok && wanted && i >= from && i < to && !keptVIP[vip] && params == c.paramsAt(offset) {
			keptVIP[vip] = true
			kept[i] = true
			continue
		}
		stale = append(stale, r.pos)
	}
	var missingVIPs []Target
	carried := sumCounters(rules, c.mangleVIPRule)
	for _, t := range want {
		d := desiredRule{spec: c.ruleSpec(t.VIP, t.Offset), vip: t.VIP, missing: !keptVIP[t.VIP], counters: carried[t.VIP]}
		desired = append(desired, d)
		if d.missing {
			missingVIPs = append(missingVIPs, t)
		}
	}
	desired = append(desired, tailRules...)

	missing := 0
	for _, d := range desired {
		if d.missing {
			missing++
		}
	}
	if missing == 0 && len(stale) == 0 && structureOK {
		return 0, nil
	}
	if c.restorer != nil {
		if err := c.restorer.Restore(Table, c.restorePayload(Table, desired)); err != nil {
			return 0, fmt.Errorf("hmark: sync chain %s: table %s: restore %d rules (%d to add, %d to remove): %w",
				c.name, Table, len(desired), missing, len(stale), err)
		}
		return missing + len(stale), nil
	}
	if !structureOK {
		return c.rewriteOneByOne(Table, desired, n, stale)
	}
	// Add first: the HMARK rules all continue (HMARK is not a terminating
	// target), so with both an old and a new rule for a tunnel IP the
	// later, new one sets the mark until the old one is gone. The tail
	// (the save rule) must stay after the HMARK rules: insert new ones just
	// before it, in address order. Without a tail, append.
	pos := n - len(tail) + 1
	for _, t := range missingVIPs {
		spec := c.ruleSpec(t.VIP, t.Offset)
		if len(tail) == 0 {
			err = c.ipt.Append(Table, c.name, spec...)
		} else {
			err = c.ipt.Insert(Table, c.name, pos, spec...)
			pos++
		}
		if err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: add rule for vip %s: %w", c.name, Table, t.VIP, err)
		}
		changed++
	}
	// Delete from the end, so that the positions listed stay valid; the
	// added rules come after all of them.
	n, err = c.deleteByPosition(Table, stale)
	return changed + n, err
}

// rewriteOneByOne replaces the n rules of c's chain in table by desired
// without a restorer: it appends every desired rule after the old ones,
// then deletes the old ones from the bottom up, so that packets always
// meet a whole content (the old one first, which may return early), never
// an empty chain. Only the appends of missing rules and the deletes of
// stale ones (positions in stale) count as changes.
func (c *Chain) rewriteOneByOne(table string, desired []desiredRule, n int, stale []int) (changed int, err error) {
	for _, d := range desired {
		if err := c.ipt.Append(table, c.name, d.spec...); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: append rule %s: %w", c.name, table, d.describe(), err)
		}
		if d.missing {
			changed++
		}
	}
	for pos := n; pos >= 1; pos-- {
		if err := c.ipt.DeleteById(table, c.name, pos); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: delete old rule %d: %w", c.name, table, pos, err)
		}
		if _, found := slices.BinarySearch(stale, pos); found {
			changed++
		}
	}
	return changed, nil
}

// describe names a desired rule in errors.
func (d desiredRule) describe() string {
	if d.vip.IsValid() {
		return "for vip " + d.vip.String()
	}
	return strconv.Quote(strings.Join(d.spec, " "))
}

// deleteByPosition deletes the rules at positions (ascending) of c's chain
// in table, from the last one up, so that the positions listed stay valid.
func (c *Chain) deleteByPosition(table string, positions []int) (changed int, err error) {
	for i := len(positions) - 1; i >= 0; i-- {
		if err := c.ipt.DeleteById(table, c.name, positions[i]); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: table %s: delete stale rule %d: %w", c.name, table, positions[i], err)
		}
		changed++
	}
	return changed, nil
}

// restorePayload is the iptables-restore input that replaces the content
// of c's chain in table with desired, in order.
func (c *Chain) restorePayload(table string, desired []desiredRule) []byte {
	return restorePayloadOf(table, c.name, desired)
}

// restorePayloadOf is the iptables-restore input that replaces the content
// of chain in table with desired, in order. With --noflush, declaring the
// chain flushes it (and creates it if absent); no other chain is declared,
// so no other chain changes. A rule with non-zero counters starts with
// "[PACKETS:BYTES]", which iptables-restore --counters gives the new rule.
// No word needs quoting: the chain name is validated, the comment is
// RuleComment, the rest are numbers, addresses, chain and option names.
func restorePayloadOf(table, chain string, desired []desiredRule) []byte {
	var b bytes.Buffer
	b.Grow(64 + len(desired)*(len(chain)+200))
	fmt.Fprintf(&b, "*%s\n:%s - [0:0]\n", table, chain)
	for _, d := range desired {
		if d.counters != (Counter{}) {
			fmt.Fprintf(&b, "[%d:%d] ", d.counters.Packets, d.counters.Bytes)
		}
		b.WriteString("-A ")
		b.WriteString(chain)
		for _, w := range d.spec {
			b.WriteByte(' ')
			b.WriteString(w)
		}
		b.WriteByte('\n')
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// Cleanup removes the jump rules to c from mangle PREROUTING, then c's
// mangle chain with its rules, then the same in the raw table (where a
// sticky Chain has its chain), then the raw SYN subchain. What is already
// absent is not an error. It fails if a rule outside PREROUTING (and, for
// the subchain, outside c's raw chain) still refers to a chain: Chain
// never touches those.
func (c *Chain) Cleanup() error {
	err := c.cleanup(Table)
	if err == nil {
		err = c.cleanup(RawTable)
	}
	if err == nil {
		err = c.cleanupSynChain()
	}
	return c.redactSeed(err)
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
	rules, err := c.listRules(table, ParentChain, false)
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

// Offsets returns, by tunnel IP, the offset of each HMARK rule in c's
// mangle chain that Chain would write but for its offset: our comment,
// /32, the full tuple masks, and the Buckets and Seed of c's Params. A
// restarted router reads it to adopt the generation each tunnel IP is on,
// then passes those offsets to Sync, which then writes nothing. Should a
// tunnel IP have several such rules, the last one is reported: HMARK
// continues, so the last one sets the mark. A missing chain gives an
// empty map and no error.
func (c *Chain) Offsets() (map[netip.Addr]uint32, error) {
	offsets, err := c.offsets()
	return offsets, c.redactSeed(err)
}

func (c *Chain) offsets() (map[netip.Addr]uint32, error) {
	exists, err := c.ipt.ChainExists(Table, c.name)
	if err != nil {
		return nil, fmt.Errorf("hmark: offsets of chain %s: check chain: %w", c.name, err)
	}
	offsets := make(map[netip.Addr]uint32)
	if !exists {
		return offsets, nil
	}
	rules, err := c.listRules(Table, c.name, false)
	if err != nil {
		return nil, fmt.Errorf("hmark: offsets of chain %s: %w", c.name, err)
	}
	for _, r := range rules {
		if vip, params, ok := r.vipRule(); ok && c.sameHash(params) {
			offsets[vip] = params.Offset
		}
	}
	return offsets, nil
}

// Counters returns, by tunnel IP, the packet and byte counters of every
// packet to the tunnel IP that reached this router (went through
// PREROUTING), in either mode; nothing else is counted, so the counters of
// a tunnel IP without traffic are zero, and those of tunnel IPs that are
// not synced are left out. They come from one listing, with counters
// (`iptables -v -S`), of one of c's chains:
//
//   - stateless: the mangle chain's HMARK rules with c's Buckets and Seed
//     (any offset), which hash every packet to their tunnel IP;
//   - sticky (see SetSticky): the raw chain's rules, one per tunnel IP,
//     which every packet to it goes through (the raw table sees each
//     packet once, before conntrack), whereas the mangle chain's HMARK
//     rules see only the packets of flows without a saved decision.
//
// A tunnel IP with several such rules gets their sum. The counters run
// from when the tunnel IP's rule was first written: a Sync that restores a
// chain writes the rules of the tunnel IPs that stay with the counters
// they had (see Sync), so adding, removing or moving other tunnel IPs,
// repairing the chain, or a restarted router adopting it, does not reset
// them. They restart from 0 when a chain is written without a restorer,
// when the mode changes (the other chain is read), when Cleanup removed
// the chain, or when something else flushed it.
func (c *Chain) Counters() (map[netip.Addr]Counter, error) {
	table, match := Table, c.mangleVIPRule
	if c.sticky != nil {
		table, match = RawTable, c.rawVIPRule
	}
	rules, err := c.listRules(table, c.name, true)
	if err != nil {
		return nil, c.redactSeed(fmt.Errorf("hmark: counters of chain %s: %w", c.name, err))
	}
	for _, r := range rules {
		if _, ok := match(r); ok && !r.hasCounters {
			return nil, fmt.Errorf("hmark: counters of chain %s: table %s: no counters in rule %d", c.name, table, r.pos)
		}
	}
	return sumCounters(rules, match), nil
}

// mangleVIPRule recognizes, in the mangle chain, a tunnel IP's HMARK rule
// that hashes like c (any offset): the rules whose counters Counters
// reports in stateless mode.
func (c *Chain) mangleVIPRule(r rule) (netip.Addr, bool) {
	vip, params, ok := r.vipRule()
	return vip, ok && c.sameHash(params)
}

// sumCounters sums, by tunnel IP, the counters of the rules that match
// recognizes (rules listed without counters count zero).
func sumCounters(rules []rule, match func(rule) (netip.Addr, bool)) map[netip.Addr]Counter {
	counters := make(map[netip.Addr]Counter)
	for _, r := range rules {
		vip, ok := match(r)
		if !ok {
			continue
		}
		sum := counters[vip]
		sum.Packets += r.packets
		sum.Bytes += r.bytes
		counters[vip] = sum
	}
	return counters
}

// sameHash reports whether p hashes like c's Params: same Buckets and
// Seed, whatever the offset.
func (c *Chain) sameHash(p Params) bool {
	return p.Buckets == c.params.Buckets && p.Seed == c.params.Seed
}

// paramsAt is c's Params with offset.
func (c *Chain) paramsAt(offset uint32) Params {
	p := c.params
	p.Offset = offset
	return p
}

// normalizeTargets checks every target and returns them with their tunnel
// IP unmapped and their effective offset (0 replaced by Params.Offset),
// sorted by tunnel IP. A tunnel IP that is not IPv4 or repeats, an offset
// whose marks overflow 32 bits or (in sticky mode) leave the block, are
// errors.
func (c *Chain) normalizeTargets(targets []Target) ([]Target, error) {
	out := make([]Target, 0, len(targets))
	for _, t := range targets {
		v := t.VIP.Unmap()
		if !v.Is4() {
			return nil, fmt.Errorf("vip %q is not an IPv4 address", t.VIP)
		}
		offset := t.Offset
		if offset == 0 {
			offset = c.params.Offset
		}
		if err := c.paramsAt(offset).Validate(); err != nil {
			return nil, fmt.Errorf("vip %s: %w", v, err)
		}
		if c.sticky != nil {
			if err := c.sticky.checkOffset(offset, c.params.Buckets); err != nil {
				return nil, fmt.Errorf("vip %s: %w", v, err)
			}
		}
		out = append(out, Target{VIP: v, Offset: offset})
	}
	slices.SortFunc(out, func(a, b Target) int { return a.VIP.Compare(b.VIP) })
	for i := 1; i < len(out); i++ {
		if out[i].VIP == out[i-1].VIP {
			return nil, fmt.Errorf("vip %s appears more than once in the targets", out[i].VIP)
		}
	}
	return out, nil
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

// ruleSpec is the HMARK rule for vip with offset, as it is written.
// iptables prints it back in another form (see vipRule).
func (c *Chain) ruleSpec(vip netip.Addr, offset uint32) []string {
	return []string{
		"-d", netip.PrefixFrom(vip, 32).String(),
		"-m", "comment", "--comment", RuleComment,
		"-j", "HMARK",
		"--hmark-tuple", "src,dst,sport,dport,proto",
		"--hmark-mod", strconv.FormatUint(uint64(c.params.Buckets), 10),
		"--hmark-offset", strconv.FormatUint(uint64(offset), 10),
		"--hmark-rnd", fmt.Sprintf("0x%08x", c.params.Seed),
	}
}

// listRules lists and parses the rules of chain in table (not its -N/-P
// lines).
func (c *Chain) listRules(table, chain string, withCounters bool) ([]rule, error) {
	var lines []string
	var err error
	if withCounters {
		lines, err = c.ipt.ListWithCounters(table, chain)
	} else {
		lines, err = c.ipt.List(table, chain)
	}
	if err != nil {
		return nil, fmt.Errorf("list %s %s: %w", table, chain, err)
	}
	var rules []rule
	for _, line := range lines {
		r, ok, err := parseRule(line, chain, withCounters)
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
// (--hmark-offset only when it was given; absent means 0; iptables 1.8.9
// prints it in decimal, others in hex: both are read). Anything else in
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
