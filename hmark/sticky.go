package hmark

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
)

// Sticky turns on connection stickiness: a flow keeps the HMARK decision
// it got when it started, even after its tunnel IP moved to another
// generation (another Offset), so that an endpoint can be drained without
// breaking established connections. The decision is saved in the
// conntrack mark (connmark) of the flow's first tracked packet and
// restored on every later one.
//
// Why the rules look the way they do (see SetSticky for the rules):
//
//   - Routing is asymmetric: the router sees only the client's packets,
//     endpoints answer clients directly. A TCP flow whose SYN conntrack
//     tracked stays in SYN_SENT (it never sees the SYN-ACK) and every
//     later packet is INVALID (no conntrack entry attached, so no
//     connmark to restore). So SYNs to
//     tunnel IPs are not tracked (raw table, CT --notrack): the next packet
//     (the ACK) is picked up mid-stream (nf_conntrack_tcp_loose, on by
//     default) as ESTABLISHED [UNREPLIED], and every later packet is
//     tracked, its entry refreshed (300 s) by each packet. The untracked
//     SYN and that first ACK both take a fresh hash decision: the same one,
//     unless a Sync moved the tunnel IP to another generation between them
//     (a window of one round trip, which only that connection's handshake
//     can fall into).
//   - A client FIN moves the entry to FIN_WAIT, CLOSE_WAIT or TIME_WAIT
//     (120 s; CLOSE_WAIT an hour where kube-proxy runs), and every later
//     packet on its 4-tuple refreshes it, those of a new connection that
//     reuses the 4-tuple too (its SYN is untracked: conntrack never
//     replaces the entry). So the FIN marks the saved decision closing (a
//     connmark bit, closingBit) and makes the handshake memory forget the
//     tuple (only a FIN with a decision saved: a FIN that is the first
//     packet after the SYN, of a request sent with it, has no conntrack
//     entry and still needs its SYN remembered). A closing decision is
//     restored only while the tuple has no newer SYN in the handshake
//     memory (the old connection's last packets); a packet that follows a
//     newer SYN is hashed as that SYN was and its decision saved over the
//     closing one, which the new connection then keeps like any other. An
//     open decision is restored whatever the entry's lifetime. A client
//     RST removes an unreplied entry at once. UDP, ICMP and other
//     protocols always restore.
//   - HMARK sets the whole skb mark. Block and Mask reserve a block of
//     marks for the router: every mark HMARK gives (every generation's
//     Offset .. Offset+Buckets-1) lies in it, a packet whose mark is in it
//     has its decision (restored, or set by an earlier rule), and a
//     connmark in it is a saved decision. Block is not 0: connmark 0 means
//     "no decision saved yet".
type Sticky struct {
	// Block is the value every router mark has under Mask.
	Block uint32
	// Mask selects the bits of a mark that Block fixes.
	Mask uint32
	// Generations is the number of routing generations the router uses (0
	// means MaxGenerations): the chain remembers the SYNs of each, so that
	// a handshake keeps the generation its SYN was hashed into (see
	// handshake.go).
	Generations int
}

// validate checks s for the chain's params (see SetSticky).
func (s *Sticky) validate(params Params) error {
	switch {
	case s.Mask == 0:
		return errors.New("sticky mark mask is 0")
	case s.Block == 0:
		return errors.New("sticky mark block is 0 (connmark 0 means no decision saved)")
	case s.Block&^s.Mask != 0:
		return fmt.Errorf("sticky mark block %#x has bits outside mask %#x", s.Block, s.Mask)
	case s.closingBit() == 0:
		return fmt.Errorf("sticky mark block %#x fills mask %#x: no bit is left for the closing connmark", s.Block, s.Mask)
	case s.Generations < 0 || s.Generations > MaxGenerations:
		return fmt.Errorf("sticky generations %d is not between 1 and %d", s.Generations, MaxGenerations)
	}
	return s.checkOffset(params.Offset, params.Buckets)
}

// checkOffset reports whether every mark offset .. offset+buckets-1 is in
// the block (mark&Mask == Block). The marks of the range all share the
// bits above the highest bit in which its first and last mark differ, and
// take both values of that bit and of every bit below it; so the range is
// in the block if its first mark is and Mask has none of those low bits.
func (s *Sticky) checkOffset(offset, buckets uint32) error {
	last := offset + buckets - 1
	varying := uint32(uint64(1)<<bits.Len32(offset^last) - 1)
	if offset&s.Mask != s.Block || s.Mask&varying != 0 {
		return fmt.Errorf("marks %#x-%#x (offset %d, %d buckets) are not all in the sticky block %s",
			offset, last, offset, buckets, s.markArg())
	}
	return nil
}

// markArg is Block/Mask as iptables prints a mark match: hex, the mask
// left out when it is 0xffffffff.
func (s *Sticky) markArg() string {
	if s.Mask == math.MaxUint32 {
		return fmt.Sprintf("%#x", s.Block)
	}
	return fmt.Sprintf("%#x/%#x", s.Block, s.Mask)
}

// ClosingBit is the connmark bit that marks a closing decision (the
// client sent its FIN): an entry with it is none of the router's flows.
func (s *Sticky) ClosingBit() uint32 { return s.closingBit() }

// closingBit is the connmark bit that says the client closed the
// connection whose decision the entry holds: the lowest bit of Mask that
// Block leaves 0, so that a closing entry's connmark is not in the block
// (the open entries' restore rule leaves it alone) and no mark HMARK gives
// has it. It is a connmark bit only; packet marks never carry it.
func (s *Sticky) closingBit() uint32 {
	free := s.Mask &^ s.Block
	return free & -free
}

// closingMarkArg is the connmark of a closing entry, Block with the
// closing bit under Mask, as iptables prints the match.
func (s *Sticky) closingMarkArg() string {
	if s.Mask == math.MaxUint32 {
		return fmt.Sprintf("%#x", s.Block|s.closingBit())
	}
	return fmt.Sprintf("%#x/%#x", s.Block|s.closingBit(), s.Mask)
}

// Sticky returns a copy of the chain's sticky settings, nil in stateless
// mode.
func (c *Chain) Sticky() *Sticky {
	if c.sticky == nil {
		return nil
	}
	s := *c.sticky
	return &s
}

// SetSticky chooses the chain's mode for the following Syncs: nil is
// stateless (every packet hashed anew), a
// Sticky keeps each flow on the decision it started with (see Sticky for
// why). Call it once, before the first Sync; nothing is written until
// Sync. It fails, changing nothing, unless Mask and Block are not 0, Block
// lies within Mask and leaves a bit of Mask 0 (the closing bit), and every
// mark of the chain's Params (Offset .. Offset+Buckets-1) is in the block.
// Sync checks the same of every Target's offset.
//
// In sticky mode the mangle chain holds, in this order (BLOCK/MASK the
// block, C the closing bit, NAME the chain and its set of all tunnel IPs,
// NAME-g the set of generation g's, NAME-sg its SYN set):
//
//	-m set ! --match-set NAME dst -j RETURN
//	-m connmark --mark BLOCK/MASK -j CONNMARK --restore-mark
//	-p tcp -m connmark --mark BLOCK|C/MASK -m set ! --match-set NAME-sg src,src,dst ... -j CONNMARK --restore-mark --ctmask ~C
//	                                             (a closing decision, unless a SYN came since: every SYN set)
//	! -p tcp -m mark --mark BLOCK/MASK -j RETURN
//	-p tcp ! --tcp-flags FIN FIN -m mark --mark BLOCK/MASK -j RETURN
//	-p tcp --tcp-flags FIN FIN -m connmark --mark BLOCK/MASK -j CONNMARK --set-xmark C/C
//	-p tcp --tcp-flags FIN FIN -m connmark --mark BLOCK|C/MASK -j SET --del-set NAME-sg src,src,dst
//	                                             (one per SYN set: the closed connection's SYN forgotten)
//	-m mark --mark BLOCK/MASK -j RETURN
//	-m set --match-set NAME-g dst -j HMARK ...   (one per generation in use, with its offset)
//	-p tcp --syn -j SET --del-set NAME-sg src,src,dst  (one per SYN set: a SYN forgets its tuple)
//	-p tcp --syn -m set --match-set NAME-g dst -j SET --add-set NAME-sg src,src,dst --exist
//	                                             (one per generation in use: its SYNs remembered)
//	-p tcp ! --syn -m set --match-set NAME-sg src,src,dst -j HMARK ...
//	                                             (one per SYN set: the packets after a remembered SYN)
//	-m connmark --mark 0x0 -m mark --mark BLOCK/MASK -j CONNMARK --save-mark
//	-m connmark --mark BLOCK|C/MASK -m mark --mark BLOCK/MASK -j CONNMARK --save-mark
//
// (each with the comment RuleComment): a packet not to a tunnel IP leaves
// at once; a tracked flow with a saved decision gets it back and leaves
// the chain (a client's FIN after marking the decision closing); any
// other packet to a tunnel IP is hashed, and the decision saved if its
// flow has none yet or a closing one. Untracked packets (the SYNs) match no
// connmark, so they are hashed and nothing is saved. The first rule's set
// match counts every packet to a tunnel IP (see Counters). The raw chain
// (NAME) holds one rule that sends the SYNs to a tunnel IP to the SYN
// subchain NAME-SYN, whose one rule keeps them untracked (CT is not a
// terminating target, so every packet then goes on as if the two were one
// rule):
//
//	-A NAME -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m set --match-set NAME dst ! --update-counters -j NAME-SYN
//	-A NAME-SYN -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -j CT --notrack
//
// Older versions wrote one rule per tunnel IP in NAME ("-d VIP/32"), then
// one rule for every packet to a tunnel IP that counted it in raw; Sync
// replaces them. The subchain's name must be a valid chain name, so a
// sticky chain's name is at most 24 characters.
//
// An IPv6 Chain writes the same rules with ip6tables, which prints them
// alike; there "-p tcp" and the TCP flags are those of the upper-layer
// header, after any extension headers, and conntrack tracks IPv6 flows
// the same way.
//
// Leaving sticky mode (SetSticky(nil), then Sync) turns the mangle chain
// back into its stateless content and removes the raw chains and the jump.
func (c *Chain) SetSticky(s *Sticky) error {
	c.last = nil
	c.synSetsReady, c.synSetsRemoved = false, false
	if s == nil {
		c.sticky = nil
		return nil
	}
	if err := validateChainName(c.synChainName()); err != nil {
		return fmt.Errorf("hmark: chain %s: set sticky: the raw SYN subchain's name: %w", c.name, err)
	}
	if err := s.validate(c.params); err != nil {
		return fmt.Errorf("hmark: chain %s: set sticky: %w", c.name, err)
	}
	cp := *s
	c.sticky = &cp
	return nil
}

// synChainSuffix makes the name of the raw SYN subchain from the chain's.
const synChainSuffix = "-SYN"

// synChainName is the raw-table subchain that keeps SYNs untracked.
func (c *Chain) synChainName() string { return c.name + synChainSuffix }

// syncSynChain leaves exactly synRuleSpec in the raw SYN subchain, which
// it creates in raw if missing, in one restore. It returns the chain
// created plus the rules added and removed.
func (c *Chain) syncSynChain(raw *savedTable) (changed int, err error) {
	syn := c.synChainName()
	changed, err = c.ensureNamedChain(raw, syn)
	if err != nil {
		return changed, err
	}
	rules := raw.chains[syn]
	want := synRuleSpec()
	missing, stale := 1, len(rules)
	if slices.ContainsFunc(rules, func(r rule) bool { return slices.Equal(r.spec, want) }) {
		missing, stale = 0, stale-1
	}
	if missing == 0 && stale == 0 {
		return changed, nil
	}
	if err := c.restorer.Restore(RawTable, restorePayloadOf(RawTable, syn, [][]string{want})); err != nil {
		return changed, fmt.Errorf("hmark: sync chain %s: table %s: restore chain %s: %w", c.name, RawTable, syn, err)
	}
	raw.chains[syn] = []rule{{pos: 1, spec: want}}
	return changed + missing + stale, nil
}

// rawRules is the content of c's raw chain in sticky mode: a rule that
// sends a SYN to a tunnel IP to the SYN subchain. The TCP flags are tested
// first: with iptables-nft they are a native match, so every other packet
// (established flows, and traffic that is not for a tunnel IP) leaves the
// raw table without the set's compat match. The set match does not count
// (the mangle chain's exit counts every packet to a tunnel IP once).
//
// The second rule keeps a SYN-ACK from a tunnel IP untracked too: where the
// router node is on the replies' way back (the clients' gateway, say), its
// conntrack never saw the SYN, so the SYN-ACK would be INVALID, which
// kube-proxy's iptables mode (and many firewalls) drop in forwarding. The
// client's ACK is then picked up mid-stream as before, and the replies
// after the SYN-ACK are that entry's replies.
func (c *Chain) rawRules() [][]string {
	return [][]string{
		slices.Concat(
			[]string{"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN",
				"-m", "set", "--match-set", c.allSetName(), "dst", "!", "--update-counters"},
			comment,
			[]string{"-j", c.synChainName()},
		),
		slices.Concat(
			[]string{"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN,ACK",
				"-m", "set", "--match-set", c.allSetName(), "src", "!", "--update-counters"},
			comment,
			[]string{"-j", "CT", "--notrack"},
		),
	}
}

// removeRawChain, in stateless mode, removes what a sticky run left in
// raw, the raw table as Sync read it: the canonical jumps to c from raw
// PREROUTING, then c's raw chain, then the SYN subchain. It touches no
// other rule: should another rule still jump to a chain, deleting it
// fails and Sync reports it.
func (c *Chain) removeRawChain(raw *savedTable) (changed int, err error) {
	if raw.has(c.name) {
		for _, r := range raw.chains[ParentChain] {
			if !r.isCanonicalJump(c.name) {
				continue
			}
			if err := c.ipt.Delete(RawTable, ParentChain, r.spec...); err != nil {
				return changed, fmt.Errorf("hmark: sync chain %s: table %s: delete jump from %s: %w", c.name, RawTable, ParentChain, err)
			}
			changed++
		}
		n, err := c.removeRawNamedChain(raw, c.name)
		changed += n
		if err != nil {
			return changed, err
		}
	}
	if syn := c.synChainName(); validateChainName(syn) == nil && raw.has(syn) {
		n, err := c.removeRawNamedChain(raw, syn)
		changed += n
		if err != nil {
			return changed, err
		}
	}
	return changed, nil
}

// removeRawNamedChain flushes (if it has rules) and deletes chain, which
// raw has, from the raw table. It counts its rules and the chain.
func (c *Chain) removeRawNamedChain(raw *savedTable, chain string) (changed int, err error) {
	if rules := raw.chains[chain]; len(rules) > 0 {
		if err := c.ipt.ClearChain(RawTable, chain); err != nil {
			return 0, fmt.Errorf("hmark: sync chain %s: table %s: flush %s: %w", c.name, RawTable, chain, err)
		}
		changed += len(rules)
		raw.chains[chain] = []rule{}
	}
	if err := c.ipt.DeleteChain(RawTable, chain); err != nil {
		return changed, fmt.Errorf("hmark: sync chain %s: table %s: delete chain %s: %w", c.name, RawTable, chain, err)
	}
	delete(raw.chains, chain)
	return changed + 1, nil
}

// fixedMangleRules are the rules of the mangle chain before (head) and
// after (tail) the HMARK rules: none in stateless mode; in sticky mode
// (see SetSticky) the restore rules, the RETURNs and the client FIN's
// rules, and the save rules. They are written exactly as iptables 1.8 (nft
// and legacy) prints them, so that Sync compares them word for word.
func (c *Chain) fixedMangleRules() (head, tail [][]string) {
	s := c.sticky
	if s == nil {
		return nil, nil
	}
	fullMasks := []string{"--nfmask", "0xffffffff", "--ctmask", "0xffffffff"}
	closing := s.closingBit()
	restoreOpen := slices.Concat(
		[]string{"-m", "connmark", "--mark", s.markArg()},
		comment, []string{"-j", "CONNMARK", "--restore-mark"}, fullMasks)
	restoreClosing := []string{"-p", "tcp", "-m", "connmark", "--mark", s.closingMarkArg()}
	for _, k := range c.synClasses() {
		restoreClosing = append(restoreClosing, "-m", "set", "!", "--match-set", c.synSetName(k), "src,src,dst")
	}
	restoreClosing = slices.Concat(restoreClosing, comment,
		[]string{"-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", fmt.Sprintf("%#x", ^closing)})
	returnOther := slices.Concat([]string{"!", "-p", "tcp", "-m", "mark", "--mark", s.markArg()}, comment, []string{"-j", "RETURN"})
	returnNotFIN := slices.Concat(notFINFlags, []string{"-m", "mark", "--mark", s.markArg()}, comment, []string{"-j", "RETURN"})
	closeOnFIN := slices.Concat(finFlags, []string{"-m", "connmark", "--mark", s.markArg()}, comment,
		[]string{"-j", "CONNMARK", "--set-xmark", fmt.Sprintf("%#x/%#x", closing, closing)})
	head = [][]string{restoreOpen, restoreClosing, returnOther, returnNotFIN, closeOnFIN}
	for _, k := range c.synClasses() {
		head = append(head, slices.Concat(finFlags, []string{"-m", "connmark", "--mark", s.closingMarkArg()}, comment,
			[]string{"-j", "SET", "--del-set", c.synSetName(k), "src,src,dst"}))
	}
	skipDecided := slices.Concat([]string{"-m", "mark", "--mark", s.markArg()}, comment, []string{"-j", "RETURN"})
	head = append(head, skipDecided)
	save := slices.Concat(
		[]string{"-m", "connmark", "--mark", "0x0", "-m", "mark", "--mark", s.markArg()},
		comment, []string{"-j", "CONNMARK", "--save-mark"}, fullMasks)
	saveOverClosing := slices.Concat(
		[]string{"-m", "connmark", "--mark", s.closingMarkArg(), "-m", "mark", "--mark", s.markArg()},
		comment, []string{"-j", "CONNMARK", "--save-mark"}, fullMasks)
	return head, [][]string{save, saveOverClosing}
}

// The TCP flags of a client's FIN, and of every other TCP packet, as
// iptables prints the match.
var (
	finFlags    = []string{"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN", "FIN"}
	notFINFlags = []string{"-p", "tcp", "-m", "tcp", "!", "--tcp-flags", "FIN", "FIN"}
)

// synRuleSpec is the one rule of the SYN subchain, which keeps SYNs
// untracked, as it is written and as iptables prints it.
func synRuleSpec() []string {
	return []string{
		"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN",
		"-m", "comment", "--comment", RuleComment,
		"-j", "CT", "--notrack",
	}
}
