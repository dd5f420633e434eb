package hmark

import (
	"errors"
	"fmt"
	"slices"
	"syscall"

	"github.com/vishvananda/netlink"
)

// The handshake memory (sticky mode): a TCP connection's SYN is untracked,
// and its conntrack entry is made by its next packet, usually the client's
// ACK, one round trip later. When a Sync moves the tunnel IP to another
// generation in between, the SYN was hashed with the old generation's
// offset and the ACK would be hashed with the new one: the connection's SYN
// reached one endpoint and the rest of it another, which resets it.
//
// So the chain remembers each SYN's class for a few seconds: the SYN of a
// tunnel IP of class k adds (client address, client port, tunnel IP) to
// the SYN set of class k (NAME-sK, hash:ip,port,ip with a timeout), and a
// TCP packet that is not a SYN, has no restored decision and is in the SYN
// set of class k, is hashed with class k's offset and tuple, whatever its
// tunnel IP's class is now. Its decision is then saved in the new conntrack
// entry like any other: the connection stays on the endpoint that answered
// its SYN, and keeps the generation it began in.
//
// A SYN first deletes its tuple from every SYN set, so that a client that
// reuses its port is hashed by its latest SYN, not by an earlier
// connection's remembered in another class.
//
// A packet walks the SYN sets only after every restore has failed: an
// established flow returns before them, other traffic never reaches the
// chain's second rule, a SYN is deleted from each set and tests one set of
// its class. A client's first packet after its SYN tests the flags and
// each SYN set.
const (
	// SynSetType is the type of the SYN sets: client address, client port
	// (with its protocol, TCP) and tunnel IP.
	SynSetType = "hash:ip,port,ip"
	// SynMemorySeconds is how long a SYN set remembers a SYN: each SYN
	// (a retransmission too) renews it. It covers the handshake's round
	// trip and a client's ACK that is lost and sent again after the
	// endpoint's SYN-ACK retransmission (1 s, then 3 s).
	SynMemorySeconds = 10
	// SynSetMaxElements bounds each SYN set: a SYN flood of more than
	// SynSetMaxElements/SynMemorySeconds SYNs a second to the tunnel IPs of
	// one class fills it; further SYNs are then not remembered (their
	// connections are hashed as without the memory) until entries expire,
	// and the set's memory stays bounded (about 5.5 MB when full). The
	// set must be created with enough buckets to hold that many
	// (SynSetHashSize, HashSizedSets): the kernel does not grow it from
	// the packet path.
	SynSetMaxElements = 1 << 17
)

// synSetName is the SYN set of class k: NAME-sG for the 5-tuple classes,
// NAME-scG for client affinity.
func (c *Chain) synSetName(k int) string {
	if g, affinity := classGeneration(k); affinity {
		return fmt.Sprintf("%s-sc%d", c.name, g)
	}
	return fmt.Sprintf("%s-s%d", c.name, k)
}

// synClasses are the classes whose SYNs the chain remembers: both tuples
// of every generation the router uses (Sticky.Generations), ascending.
func (c *Chain) synClasses() []int {
	var out []int
	for _, affinity := range []bool{false, true} {
		for g := range c.sticky.generations() {
			out = append(out, classOf(g, affinity))
		}
	}
	return out
}

// synFlags and notSynFlags match a TCP SYN and any other TCP packet, as
// iptables prints them.
var (
	synFlags    = []string{"-p", "tcp", "-m", "tcp", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN"}
	notSynFlags = []string{"-p", "tcp", "-m", "tcp", "!", "--tcp-flags", "FIN,SYN,RST,ACK", "SYN"}
)

// synForgetRule deletes a SYN's tuple from class k's SYN set: every SYN
// passes one per remembered class before its own class records it, so
// that a client that reuses its port within SynMemorySeconds is not
// hashed by its previous connection's SYN, remembered in another class.
func (c *Chain) synForgetRule(k int) []string {
	return slices.Concat(synFlags, comment,
		[]string{"-j", "SET", "--del-set", c.synSetName(k), "src,src,dst"})
}

// synRecordRule remembers a SYN to a tunnel IP of class k in k's SYN set.
func (c *Chain) synRecordRule(k int) []string {
	return slices.Concat(synFlags,
		[]string{"-m", "set", "--match-set", c.classSetName(k), "dst"},
		comment,
		[]string{"-j", "SET", "--add-set", c.synSetName(k), "src,src,dst", "--exist"})
}

// handshakeRule hashes a packet that follows a SYN remembered in class k's
// SYN set as that SYN was: with class k's offset and tuple.
func (c *Chain) handshakeRule(k int) []string {
	return slices.Concat(notSynFlags,
		[]string{"-m", "set", "--match-set", c.synSetName(k), "src,src,dst"},
		comment,
		c.hmarkTarget(k))
}

// handshakeRules are the rules of the handshake memory in the mangle
// chain, after the classes' HMARK rules: one per remembered class that
// makes a SYN forget its tuple there, one that remembers the SYNs of each
// class in use, then one per remembered class that re-hashes the packets
// following a remembered SYN.
func (c *Chain) handshakeRules(inUse []int) [][]string {
	var rules [][]string
	for _, k := range c.synClasses() {
		rules = append(rules, c.synForgetRule(k))
	}
	for _, k := range inUse {
		rules = append(rules, c.synRecordRule(k))
	}
	for _, k := range c.synClasses() {
		rules = append(rules, c.handshakeRule(k))
	}
	return rules
}

// ensureSynSets, in sticky mode, creates the SYN sets that do not exist,
// once per Chain (and after SetSticky or Cleanup): a set of that name
// that is not a SYN set of c's family is an error, and Chain writes no
// rule that uses it. Existing sets are not listed again after that: a SYN
// flood can fill them, and Sync must not read them all.
func (c *Chain) ensureSynSets() (changed int, err error) {
	if c.synSetsReady {
		return 0, nil
	}
	for _, k := range c.synClasses() {
		name := c.synSetName(k)
		res, err := c.sets.IpsetList(name)
		switch {
		case errors.Is(err, syscall.ENOENT):
			if err := c.createSynSet(name); err != nil {
				return changed, err
			}
			changed++
		case err != nil:
			return changed, fmt.Errorf("list set %s: %w", name, err)
		case res.TypeName != SynSetType || res.Family != c.family.setFamily():
			return changed, fmt.Errorf("set %s is %s (family %s), not the %s SYN set (%s) the router creates: "+
				"it is not the router's %s chain's; remove the rules that use it, then the set (or run --cleanup)",
				name, res.TypeName, setFamilyName(res.Family), SynSetType, setFamilyName(c.family.setFamily()), c.family)
		case res.HashSize < SynSetHashSize:
			n, err := c.enlargeSynSet(name)
			if err != nil {
				return changed, err
			}
			changed += n
		}
	}
	c.synSetsReady = true
	return changed, nil
}

// synSetOptions are a SYN set's options of c's family.
func (c *Chain) synSetOptions() netlink.IpsetCreateOptions {
	timeout := uint32(SynMemorySeconds)
	return netlink.IpsetCreateOptions{Family: c.family.setFamily(), MaxElements: SynSetMaxElements, Timeout: &timeout}
}

// createSynSet creates the SYN set name with SynSetHashSize buckets when
// c's IPSets can (HashSizedSets), else with the kernel's default.
func (c *Chain) createSynSet(name string) error {
	var err error
	if sized, ok := c.sets.(HashSizedSets); ok {
		err = sized.IpsetCreateHashSize(name, SynSetType, c.synSetOptions(), SynSetHashSize)
	} else {
		err = c.sets.IpsetCreate(name, SynSetType, c.synSetOptions())
	}
	if err != nil {
		return fmt.Errorf("create set %s: %w", name, err)
	}
	return nil
}

// synSetTempSuffix names the set enlargeSynSet creates before it swaps it
// in (a SYN set's name is at most 28 characters, so this one is at most
// 30, within ipset's 31).
const synSetTempSuffix = "-r"

// enlargeSynSet replaces the SYN set name, which has fewer buckets than
// SynSetHashSize (an earlier version created it), with an empty one that
// has them: created under a temporary name, swapped with it (the rules
// that use the set keep it by name), and the old one destroyed. The SYNs
// it remembered are forgotten, which matters only to a handshake that
// straddles a table change at that moment. Without HashSizedSets it does
// nothing.
func (c *Chain) enlargeSynSet(name string) (changed int, err error) {
	sized, ok := c.sets.(HashSizedSets)
	if !ok {
		return 0, nil
	}
	tmp := name + synSetTempSuffix
	// A temporary set a crash left behind.
	if err := c.sets.IpsetDestroy(tmp); err != nil && !errors.Is(err, syscall.ENOENT) {
		return 0, fmt.Errorf("destroy set %s: %w", tmp, err)
	}
	if err := sized.IpsetCreateHashSize(tmp, SynSetType, c.synSetOptions(), SynSetHashSize); err != nil {
		return 0, fmt.Errorf("enlarge set %s: create %s: %w", name, tmp, err)
	}
	if err := sized.IpsetSwap(name, tmp); err != nil {
		_ = c.sets.IpsetDestroy(tmp)
		return 1, fmt.Errorf("enlarge set %s: swap with %s: %w", name, tmp, err)
	}
	if err := c.sets.IpsetDestroy(tmp); err != nil {
		return 2, fmt.Errorf("enlarge set %s: destroy the old one, now %s: %w", name, tmp, err)
	}
	return 3, nil
}

// removeSynSets destroys the SYN sets a sticky run left (stateless mode:
// their rules are gone), once per Chain.
func (c *Chain) removeSynSets() (changed int, err error) {
	if c.synSetsRemoved {
		return 0, nil
	}
	for k := range classes {
		name := c.synSetName(k)
		if _, err := c.sets.IpsetList(name); errors.Is(err, syscall.ENOENT) {
			continue
		} else if err != nil {
			return changed, fmt.Errorf("list set %s: %w", name, err)
		}
		if err := c.destroySetNamed(name); err != nil {
			return changed, err
		}
		changed++
	}
	c.synSetsRemoved = true
	return changed, nil
}

// generations is the number of routing generations whose SYNs the chain
// remembers.
func (s *Sticky) generations() int {
	if s.Generations == 0 {
		return MaxGenerations
	}
	return s.Generations
}
