package hmark

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
)

// Target is one tunnel IP and the HMARK offset its packets are marked
// with: the mark of bucket 0 of the routing generation the tunnel IP is on.
// The router keeps several generations of routing tables per tunnel IP
// (see Sticky); moving a tunnel IP to a new generation is a Sync with
// another Offset for it.
type Target struct {
	// VIP is the tunnel IP, of the chain's family: for an IPv4 Chain an
	// IPv4 address (4-in-6 addresses are unmapped), for an IPv6 Chain an
	// IPv6 address that is not IPv4-mapped (such an address is an IPv4
	// tunnel IP, which is the IPv4 chain's; netlink would also add it to
	// a set as IPv4).
	VIP netip.Addr
	// Offset is the tunnel IP's --hmark-offset: Params.Offset + g×Buckets
	// for a generation g below MaxGenerations. 0 means the chain's
	// Params.Offset (generation 0), so a router without generations passes
	// no offset.
	Offset uint32
	// ClientAffinity hashes the client's address alone (ports and protocol
	// masked to 0), so that every flow of one client gets one bucket: see
	// ClientFlow.
	ClientAffinity bool
	// FilterPorts: the tunnel IP carries only Ports (and ICMP); every
	// other packet to it is dropped before it is marked, and counted (see
	// PortDrops). Otherwise it carries every protocol and port.
	FilterPorts bool
	// Ports are the protocols (TCP, UDP, SCTP) and destination ports a
	// tunnel IP with FilterPorts carries.
	Ports []Port
}

// Sync makes the kernel match the desired state for targets,
// level-triggered. The desired state does not grow with the number of
// tunnel IPs in rules, only in set elements:
//
//   - the set NAME (hash:ip, with counters) holds every tunnel IP, and the
//     set NAME-g (hash:ip) the tunnel IPs of generation g, for each
//     generation that has one (NAME is the chain's name); tunnel IPs with
//     client affinity are in NAME-cg instead;
//   - mangle PREROUTING holds exactly one jump to the chain NAME, which
//     holds a fixed rule list: first a RETURN for every packet whose
//     destination is not in NAME (so other traffic leaves after one rule),
//     then one HMARK rule per set in use, matching NAME-g (or NAME-cg,
//     hashing the client's address alone), with offset Params.Offset +
//     g×Buckets (in sticky mode also the restore and save rules around
//     them: see SetSticky);
//   - in sticky mode, the raw chain NAME holds one rule sending every
//     packet to a tunnel IP to the SYN subchain;
//   - while some target filters its ports, the set NAME-f (hash:ip, with
//     counters) holds those tunnel IPs, NAME-p (hash:ip,port) their
//     protocols and ports, and the rule after the exit drops a packet to
//     a tunnel IP of NAME-f whose protocol and port are not in NAME-p
//     (ICMP passes), counting it in NAME-f (see PortDrops).
//
// A packet therefore walks at most 1 + 2×MaxGenerations rules (sticky: 5
// more, and a packet without a saved decision up to 2×MaxGenerations +
// 2×Sticky.Generations more: the handshake memory, handshake.go), whatever
// the number of tunnel IPs. Targets must not repeat a
// tunnel IP.
//
// Sync reads what is there (each set of NAME over netlink, and each
// table, mangle and raw, in one `iptables-save -t TABLE`: its chains, the
// jumps in its PREROUTING and the rules of Chain's chains), compares it
// (iptables prints HMARK rules in its own normalized form, the offset in
// decimal or hex) and writes only what differs: a state that is already
// right costs no write at all, which is how a restarted router adopts
// what its predecessor left (see Offsets for adopting each tunnel IP's
// generation). Set elements are added and deleted one by one, one netlink
// call per changed tunnel IP; a chain whose rules differ is replaced in
// one atomic iptables-restore --noflush call. So a Sync that changes
// nothing, or only set elements, runs two iptables processes (one
// iptables-save per table), and one that changes a chain's rules one more
// per chain rewritten; only creating a chain or fixing a jump costs an
// iptables call of its own.
//
// The order is fixed so that a tunnel IP is in NAME (its SYNs untracked,
// its packets counted) before it is hashed, and hashed until it leaves
// NAME: sets created, mangle chain and jump; in sticky mode the raw chain,
// its SYN subchain, the raw jump and rule; new tunnel IPs added to NAME,
// then to their generation's set; the mangle rules; tunnel IPs deleted from
// the generation sets they left, then from NAME; the sets of generations
// no longer used destroyed (in stateless mode, the raw chains left by a
// sticky run removed). A tunnel IP that moves from generation a to b is
// in both sets between its add and its delete: the later rule (the higher
// generation) marks its packets then, and both generations' tables are
// programmed while it moves.
//
// changed is the number of differences Sync repaired: 1 per set or chain
// created or destroyed, per jump inserted or deleted, per set element
// added or deleted, and for each chain's rules the number added plus the
// number removed. When an error stops Sync part way, changed counts what
// was applied before it; a failed restore applies nothing.
//
// Errors never show the seed: go-iptables puts the whole command line in
// its errors, and iptables-restore may quote a line of its input, so Chain
// replaces the seed there with its fingerprint.
func (c *Chain) Sync(targets []Target) (changed int, err error) {
	changed, err = c.sync(targets)
	return changed, c.redactSeed(err)
}

// wantedTarget is a normalized Target with its class (generation and
// tuple).
type wantedTarget struct {
	vip   netip.Addr
	class int
	// filter and ports are Target's FilterPorts and Ports (sorted, without
	// repeats; none without filter).
	filter bool
	ports  []Port
}

// portPlan is what the port filter holds for targets: the filtered tunnel
// IPs and the elements of the port set.
type portPlan struct {
	filtered map[netip.Addr]bool
	elems    map[portElem]bool
}

func planPorts(want []wantedTarget) portPlan {
	p := portPlan{filtered: map[netip.Addr]bool{}, elems: map[portElem]bool{}}
	for _, t := range want {
		if !t.filter {
			continue
		}
		p.filtered[t.vip] = true
		for _, port := range t.ports {
			p.elems[portElem{t.vip, port}] = true
		}
	}
	return p
}

// sortedAddrs returns the addresses of m, in order.
func sortedAddrs(m map[netip.Addr]bool) []netip.Addr {
	out := make([]netip.Addr, 0, len(m))
	for a := range m {
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

func (c *Chain) sync(targets []Target) (changed int, err error) {
	c.last = nil
	want, err := c.normalizeTargets(targets)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	// count adds the changes of one step to changed and wraps its error.
	count := func(n int, err error) error {
		changed += n
		if err != nil {
			return fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
		}
		return nil
	}

	sets, err := c.readSets()
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	// Each table is read once; the steps below compare with what was read
	// (and with what they wrote since).
	mangle, err := c.readTable(Table)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	raw, err := c.readTable(RawTable)
	if err != nil {
		return 0, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
	}
	all := make([]netip.Addr, len(want))
	var byClass [classes][]netip.Addr
	class := make(map[netip.Addr]int, len(want))
	for i, t := range want {
		all[i] = t.vip
		byClass[t.class] = append(byClass[t.class], t.vip)
		class[t.vip] = t.class
	}
	var inUse []int
	for k, vips := range byClass {
		if len(vips) > 0 {
			inUse = append(inUse, k)
		}
	}

	// The port filter's sets and rule exist while some tunnel IP is
	// filtered.
	ports := planPorts(want)
	filtering := len(ports.filtered) > 0
	if err := count(c.createSet(&sets.all, true)); err != nil {
		return changed, err
	}
	if filtering {
		if err := count(c.createSet(&sets.filtered, true)); err != nil {
			return changed, err
		}
		if err := count(c.createPortSet(&sets.ports)); err != nil {
			return changed, err
		}
	}
	for _, k := range inUse {
		if err := count(c.createSet(&sets.classes[k], false)); err != nil {
			return changed, err
		}
	}
	if err := count(c.ensureChain(mangle)); err != nil {
		return changed, err
	}
	if err := count(c.syncJump(mangle)); err != nil {
		return changed, err
	}
	if c.sticky != nil {
		if err := count(c.ensureChain(raw)); err != nil {
			return changed, err
		}
		if err := count(c.syncSynChain(raw)); err != nil {
			return changed, err
		}
		if err := count(c.syncJump(raw)); err != nil {
			return changed, err
		}
		if err := count(c.syncRules(raw, c.name, c.rawRules())); err != nil {
			return changed, err
		}
	}

	// A tunnel IP's port filter is complete before it joins the sets of
	// all and of its class, and opens (leaves the filtered set) before its
	// ports go.
	for _, e := range sortedPortElems(ports.elems, func(e portElem) bool { return !sets.ports.members[e] }) {
		if err := c.addPort(e); err != nil {
			return changed, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
		}
		changed++
		sets.ports.members[e] = true
	}
	if err := count(c.addMembers(&sets.filtered, sortedAddrs(ports.filtered))); err != nil {
		return changed, err
	}
	if err := count(c.addMembers(&sets.all, all)); err != nil {
		return changed, err
	}
	for _, k := range inUse {
		if err := count(c.addMembers(&sets.classes[k], byClass[k])); err != nil {
			return changed, err
		}
	}

	if c.sticky != nil {
		if err := count(c.ensureSynSets()); err != nil {
			return changed, err
		}
	}
	if err := count(c.syncRules(mangle, c.name, c.mangleRules(inUse, filtering))); err != nil {
		return changed, err
	}

	for k := range sets.classes {
		keep := func(a netip.Addr) bool { ka, ok := class[a]; return ok && ka == k }
		if err := count(c.removeMembers(&sets.classes[k], keep)); err != nil {
			return changed, err
		}
	}
	keep := func(a netip.Addr) bool { _, ok := class[a]; return ok }
	if err := count(c.removeMembers(&sets.all, keep)); err != nil {
		return changed, err
	}
	if filtering {
		if err := count(c.removeMembers(&sets.filtered, func(a netip.Addr) bool { return ports.filtered[a] })); err != nil {
			return changed, err
		}
		for _, e := range sortedPortElems(sets.ports.members, func(e portElem) bool { return !ports.elems[e] }) {
			if err := c.delPort(e); err != nil {
				return changed, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
			}
			changed++
			delete(sets.ports.members, e)
		}
	} else {
		// The rule that matched them is gone.
		if err := count(c.destroySet(&sets.filtered)); err != nil {
			return changed, err
		}
		if sets.ports.exists {
			if err := c.destroySetNamed(sets.ports.name); err != nil {
				return changed, fmt.Errorf("hmark: sync chain %s: %w", c.name, err)
			}
			changed++
		}
	}
	for k := range sets.classes {
		if len(byClass[k]) == 0 {
			if err := count(c.destroySet(&sets.classes[k])); err != nil {
				return changed, err
			}
		}
	}
	if c.sticky == nil {
		if err = count(c.removeRawChain(raw)); err != nil {
			return changed, err
		}
		if err = count(c.removeSynSets()); err != nil {
			return changed, err
		}
	}
	c.last = &lastSync{class: class, inUse: inUse, ports: ports}
	return changed, nil
}

// lastSync is what the last successful Sync or Update left in the kernel,
// as far as Update needs to know: each tunnel IP's class, the classes in
// use (which decide the rules), and the port filter.
type lastSync struct {
	class map[netip.Addr]int
	inUse []int
	ports portPlan
}

// Update is Sync for a router that is the only writer of its chains and
// sets: it trusts that the kernel still holds what the last successful
// Sync or Update left, reads nothing, and writes only the set elements of
// the tunnel IPs that were added, removed or moved since, in Sync's order
// (new tunnel IPs join the set of all, then their generation's set; moved
// ones join their new set, then leave the old one; removed ones leave
// their generation's set, then the set of all). A change that brings a
// generation into use or ends one (its rule and set come or go), the first
// call, a call after a failure or after SetSticky, are a full Sync. Repairing
// drift needs Sync: call it periodically.
func (c *Chain) Update(targets []Target) (changed int, err error) {
	changed, err = c.update(targets)
	return changed, c.redactSeed(err)
}

func (c *Chain) update(targets []Target) (changed int, err error) {
	last := c.last
	if last == nil {
		return c.sync(targets)
	}
	want, err := c.normalizeTargets(targets)
	if err != nil {
		return 0, fmt.Errorf("hmark: update chain %s: %w", c.name, err)
	}
	class := make(map[netip.Addr]int, len(want))
	var used [classes]bool
	for _, t := range want {
		class[t.vip] = t.class
		used[t.class] = true
	}
	var inUse []int
	for k, u := range used {
		if u {
			inUse = append(inUse, k)
		}
	}
	ports := planPorts(want)
	if !slices.Equal(inUse, last.inUse) || (len(ports.filtered) > 0) != (len(last.ports.filtered) > 0) {
		return c.sync(targets) // a rule and its sets come or go
	}
	c.last = nil // until every write below succeeded
	var added, moved, removed []netip.Addr
	for _, t := range want {
		switch k, ok := last.class[t.vip]; {
		case !ok:
			added = append(added, t.vip)
		case k != t.class:
			moved = append(moved, t.vip)
		}
	}
	for vip := range last.class {
		if _, ok := class[vip]; !ok {
			removed = append(removed, vip)
		}
	}
	slices.SortFunc(removed, netip.Addr.Compare)
	// One set element per step, each the (set, tunnel IP, add or delete)
	// of a tunnel IP that changed, in Sync's order.
	type step struct {
		add bool
		set string
		vip netip.Addr
	}
	var steps []step
	// The port filter first: elements to add, then tunnel IPs that become
	// filtered (new ones included), so that a tunnel IP is never open
	// before its filter is complete.
	for _, e := range sortedPortElems(ports.elems, func(e portElem) bool { return !last.ports.elems[e] }) {
		if err := c.addPort(e); err != nil {
			return changed, fmt.Errorf("hmark: update chain %s: %w", c.name, err)
		}
		changed++
	}
	for _, vip := range sortedAddrs(ports.filtered) {
		if !last.ports.filtered[vip] {
			steps = append(steps, step{true, c.filteredSetName(), vip})
		}
	}
	for _, vip := range added {
		steps = append(steps, step{true, c.allSetName(), vip})
	}
	for _, vip := range slices.Concat(added, moved) {
		steps = append(steps, step{true, c.classSetName(class[vip]), vip})
	}
	for _, vip := range slices.Concat(moved, removed) {
		steps = append(steps, step{false, c.classSetName(last.class[vip]), vip})
	}
	for _, vip := range removed {
		steps = append(steps, step{false, c.allSetName(), vip})
	}
	for _, vip := range sortedAddrs(last.ports.filtered) {
		if !ports.filtered[vip] {
			steps = append(steps, step{false, c.filteredSetName(), vip})
		}
	}
	for _, st := range steps {
		write := c.delMember
		if st.add {
			write = c.addMember
		}
		if err := write(st.set, st.vip); err != nil {
			return changed, fmt.Errorf("hmark: update chain %s: %w", c.name, err)
		}
		changed++
	}
	for _, e := range sortedPortElems(last.ports.elems, func(e portElem) bool { return !ports.elems[e] }) {
		if err := c.delPort(e); err != nil {
			return changed, fmt.Errorf("hmark: update chain %s: %w", c.name, err)
		}
		changed++
	}
	c.last = &lastSync{class: class, inUse: inUse, ports: ports}
	return changed, nil
}

// normalizeTargets checks every target and returns them with their tunnel
// IP normalized (see vipOf) and their generation, sorted by tunnel IP. A
// tunnel IP that is not of c's family or repeats, an offset that is not a
// generation's, are errors.
func (c *Chain) normalizeTargets(targets []Target) ([]wantedTarget, error) {
	out := make([]wantedTarget, 0, len(targets))
	for _, t := range targets {
		v, err := c.vipOf(t.VIP)
		if err != nil {
			return nil, err
		}
		offset := t.Offset
		if offset == 0 {
			offset = c.params.Offset
		}
		g, err := c.generationOf(offset)
		if err != nil {
			return nil, fmt.Errorf("vip %s: %w", v, err)
		}
		if err := c.paramsAt(offset).Validate(); err != nil {
			return nil, fmt.Errorf("vip %s: %w", v, err)
		}
		if c.sticky != nil {
			if err := c.sticky.checkOffset(offset, c.params.Buckets); err != nil {
				return nil, fmt.Errorf("vip %s: %w", v, err)
			}
		}
		w := wantedTarget{vip: v, class: classOf(g, t.ClientAffinity), filter: t.FilterPorts}
		if t.FilterPorts {
			for _, p := range t.Ports {
				if !validPortProtocol(p.Protocol) {
					return nil, fmt.Errorf("vip %s: port %d of protocol %d: only TCP, UDP and SCTP ports can be filtered", v, p.Number, p.Protocol)
				}
			}
			w.ports = slices.Clone(t.Ports)
			slices.SortFunc(w.ports, ComparePorts)
			w.ports = slices.Compact(w.ports)
		}
		out = append(out, w)
	}
	slices.SortFunc(out, func(a, b wantedTarget) int { return a.vip.Compare(b.vip) })
	for i := 1; i < len(out); i++ {
		if out[i].vip == out[i-1].vip {
			return nil, fmt.Errorf("vip %s appears more than once in the targets", out[i].vip)
		}
	}
	return out, nil
}

// vipOf is vip as c's sets hold it, or an error naming vip when it is not
// of c's family: for IPv4, vip unmapped, which must then be IPv4; for
// IPv6, vip itself, which must be IPv6, not IPv4-mapped and without a
// zone (a set holds no zone, and a tunnel IP is global).
func (c *Chain) vipOf(vip netip.Addr) (netip.Addr, error) {
	if c.family == IPv4 {
		v := vip.Unmap()
		if !v.Is4() {
			return netip.Addr{}, fmt.Errorf("vip %q is not an IPv4 address (the IPv4 chain %s takes IPv4 tunnel IPs only)", vip, c.name)
		}
		return v, nil
	}
	switch {
	case !vip.Is6():
		return netip.Addr{}, fmt.Errorf("vip %q is not an IPv6 address (the IPv6 chain %s takes IPv6 tunnel IPs only)", vip, c.name)
	case vip.Is4In6():
		return netip.Addr{}, fmt.Errorf("vip %q is an IPv4-mapped IPv6 address, an IPv4 tunnel IP: the IPv6 chain %s takes IPv6 tunnel IPs only", vip, c.name)
	case vip.Zone() != "":
		return netip.Addr{}, fmt.Errorf("vip %q has a zone: a tunnel IP is a global IPv6 address", vip)
	}
	return vip, nil
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

// comment is the match every rule of Chain carries.
var comment = []string{"-m", "comment", "--comment", RuleComment}

// mangleRules is the content of c's mangle chain when the classes inUse
// (ascending) have tunnel IPs: the exit for other traffic, in sticky mode
// the restore rules and the RETURN, one HMARK rule per class, in sticky
// mode the save rule. They are written as iptables 1.8 (nft and
// legacy) prints them, so that syncRules compares them word for word (the
// HMARK options semantically).
func (c *Chain) mangleRules(inUse []int, filtering bool) [][]string {
	// The exit counts every packet to a tunnel IP in the set's counters
	// (the raw rule, in sticky mode, does not).
	exit := []string{"-m", "set", "!", "--match-set", c.allSetName(), "dst"}
	rules := [][]string{slices.Concat(exit, comment, []string{"-j", "RETURN"})}
	if filtering {
		rules = append(rules, c.dropRule())
	}
	head, tail := c.fixedMangleRules()
	rules = append(rules, head...)
	for _, k := range inUse {
		rules = append(rules, c.classRuleSpec(k))
	}
	if c.sticky != nil {
		rules = append(rules, c.handshakeRules(inUse)...)
	}
	return append(rules, tail...)
}

// fullTupleMasks hash the whole 5-tuple; clientMasks none of the ports and
// protocol, leaving the addresses: the tunnel IP, fixed, and the client's.
var (
	fullTupleMasks = []string{"--hmark-sport-mask", "0xffff", "--hmark-dport-mask", "0xffff", "--hmark-proto-mask", "0xffff"}
	clientMasks    = []string{"--hmark-sport-mask", "0x0", "--hmark-dport-mask", "0x0", "--hmark-proto-mask", "0x0"}
)

// classRuleSpec is the HMARK rule of class k, as iptables (or ip6tables,
// with /128 prefixes) prints it.
func (c *Chain) classRuleSpec(k int) []string {
	return slices.Concat(
		[]string{"-m", "set", "--match-set", c.classSetName(k), "dst"},
		comment,
		c.hmarkTarget(k))
}

// hmarkTarget is the HMARK target of class k: its offset and tuple.
func (c *Chain) hmarkTarget(k int) []string {
	g, affinity := classGeneration(k)
	// The whole address, of either family: what Params.Mark predicts.
	prefix := strconv.Itoa(c.family.bits())
	masks := fullTupleMasks
	if affinity {
		masks = clientMasks
	}
	return slices.Concat(
		[]string{"-j", "HMARK", "--hmark-src-prefix", prefix, "--hmark-dst-prefix", prefix},
		masks,
		[]string{
			"--hmark-rnd", fmt.Sprintf("0x%08x", c.params.Seed),
			"--hmark-mod", strconv.FormatUint(uint64(c.params.Buckets), 10),
			"--hmark-offset", strconv.FormatUint(uint64(c.offsetOf(g)), 10),
		})
}

// syncRules leaves exactly desired in chain of t (which has it), in
// order, replacing its content in one restore when anything differs. It
// returns the number of rules added plus removed (a rule out of place
// counts as both).
func (c *Chain) syncRules(t *savedTable, chain string, desired [][]string) (changed int, err error) {
	table, rules := t.name, t.chains[chain]
	if len(rules) == len(desired) && !slices.ContainsFunc(rules, func(r rule) bool { return !sameRule(r.spec, desired[r.pos-1]) }) {
		return 0, nil
	}
	// The rules that stay are a longest common subsequence of both lists
	// (a few rules each: quadratic is fine); every other one is added or
	// removed.
	lcs := make([]int, len(desired)+1)
	for _, r := range rules {
		prev := 0 // lcs[j-1] of the previous row
		for j := 1; j <= len(desired); j++ {
			cur := lcs[j]
			if sameRule(r.spec, desired[j-1]) {
				lcs[j] = prev + 1
			} else {
				lcs[j] = max(lcs[j], lcs[j-1])
			}
			prev = cur
		}
	}
	changed = len(rules) + len(desired) - 2*lcs[len(desired)]
	if err := c.restorer.Restore(table, restorePayloadOf(table, chain, desired)); err != nil {
		return 0, fmt.Errorf("table %s: restore chain %s with %d rules (%d differences): %w", table, chain, len(desired), changed, err)
	}
	written := make([]rule, len(desired))
	for i, spec := range desired {
		written[i] = rule{pos: i + 1, spec: spec}
	}
	t.chains[chain] = written
	return changed, nil
}

// sameRule compares a listed rule with a desired one: word for word,
// except that HMARK options compare by value (iptables versions print
// the offset in decimal or in hex, a mask of 0 as 0x0000).
func sameRule(got, want []string) bool {
	j := slices.Index(want, "HMARK")
	if j < 1 || want[j-1] != "-j" {
		return slices.Equal(got, want)
	}
	if len(got) <= j || !slices.Equal(got[:j+1], want[:j+1]) {
		return false
	}
	g, okG := parseHMARKOptions(got[j+1:])
	w, okW := parseHMARKOptions(want[j+1:])
	return okG && okW && g == w
}

// Offsets returns, by tunnel IP, the offset it is hashed with: that of
// the generation set it is in (the highest, should it be in several: the
// later rule sets the mark). A restarted router reads it to adopt the
// generation each tunnel IP is on, then passes those offsets to Sync,
// which then writes nothing. When the router's set of all tunnel IPs does
// not exist, it reads instead the per-tunnel-IP HMARK rules an older
// version wrote in the mangle chain (our comment, /32, the full tuple,
// c's Buckets and Seed), so that an upgrade keeps every tunnel IP on its
// generation (no version wrote such rules for IPv6; an IPv6 Chain reads
// the same with /128, and finds none). Nothing at all gives an empty map
// and no error.
func (c *Chain) Offsets() (map[netip.Addr]uint32, error) {
	offsets, err := c.offsets()
	return offsets, c.redactSeed(err)
}

func (c *Chain) offsets() (map[netip.Addr]uint32, error) {
	sets, err := c.readSets()
	if err != nil {
		return nil, fmt.Errorf("hmark: offsets of chain %s: %w", c.name, err)
	}
	offsets := make(map[netip.Addr]uint32)
	if sets.all.exists {
		for k, s := range sets.classes {
			g, _ := classGeneration(k)
			for vip := range s.members {
				offsets[vip] = c.offsetOf(g)
			}
		}
		return offsets, nil
	}
	exists, err := c.ipt.ChainExists(Table, c.name)
	if err != nil {
		return nil, fmt.Errorf("hmark: offsets of chain %s: check chain: %w", c.name, err)
	}
	if !exists {
		return offsets, nil
	}
	rules, err := c.listRules(Table, c.name)
	if err != nil {
		return nil, fmt.Errorf("hmark: offsets of chain %s: %w", c.name, err)
	}
	for _, r := range rules {
		if vip, params, ok := r.vipRule(c.family); ok && c.sameHash(params) {
			offsets[vip] = params.Offset
		}
	}
	return offsets, nil
}
