package hmark

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
)

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
// them when it moves to another generation too.
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
	// count adds the changes of one step to changed and passes its error on.
	count := func(n int, err error) error {
		changed += n
		return err
	}

	if err := count(c.ensureChain(Table)); err != nil {
		return changed, err
	}
	if err := count(c.syncJump(Table)); err != nil {
		return changed, err
	}

	var raw rawPlan
	if c.sticky != nil {
		if err := count(c.ensureChain(RawTable)); err != nil {
			return changed, err
		}
		if err := count(c.syncSynChain()); err != nil {
			return changed, err
		}
		if err := count(c.syncJump(RawTable)); err != nil {
			return changed, err
		}
		if raw, err = c.planRaw(want); err != nil {
			return changed, err
		}
		if err := count(c.addRawRules(want, &raw)); err != nil {
			return changed, err
		}
	}

	if err := count(c.syncMangleRules(want)); err != nil {
		return changed, err
	}

	if c.sticky != nil {
		err = count(c.removeRawRules(want, &raw))
	} else {
		err = count(c.removeRawChain())
	}
	return changed, err
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

// desiredRule is one rule of the desired content of a chain.
type desiredRule struct {
	spec []string
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
	stale := 0
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
		stale++
	}
	carried := sumCounters(rules, c.mangleVIPRule)
	for _, t := range want {
		desired = append(desired, desiredRule{spec: c.ruleSpec(t.VIP, t.Offset), missing: !keptVIP[t.VIP], counters: carried[t.VIP]})
	}
	desired = append(desired, tailRules...)

	missing := 0
	for _, d := range desired {
		if d.missing {
			missing++
		}
	}
	if missing == 0 && stale == 0 && structureOK {
		return 0, nil
	}
	if err := c.restorer.Restore(Table, c.restorePayload(Table, desired)); err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: table %s: restore %d rules (%d to add, %d to remove): %w",
			c.name, Table, len(desired), missing, stale, err)
	}
	return missing + stale, nil
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

// restorePayload is the iptables-restore input that replaces the content
// of c's chain in table with desired, in order.
func (c *Chain) restorePayload(table string, desired []desiredRule) []byte {
	return restorePayloadOf(table, c.name, desired)
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
