package datapath

import (
	"math/bits"

	"github.com/vishvananda/netlink"
)

// The slot rules send each marked packet to its slot's table. The kernel
// walks policy rules one by one, so one "fwmark M lookup T" rule per slot
// in a row cost a packet of slot k k+1 rules: about 9 ns each on this
// project's benchmark host, up to 2 µs a packet for the last generation of
// 4 x 64 slots. Instead the rules form a binary search tree over the bits
// of the slot number, which the marks carry in their low bits (MarkOffset
// is a multiple of the mark block, see MarkBlock):
//
//   - A test rule "fwmark PREFIX|1<<i / MASK goto P1" checks, among the
//     packets whose higher slot bits are PREFIX, bit i: set, it jumps to
//     the subtree of those slots at priority P1; clear, the packet goes on
//     to the next priority, where the subtree of the other half starts.
//   - A leaf rule "fwmark MARK lookup TABLE" is slot k's lookup.
//
// The rules are laid out in pre-order from RulePriority on, so that a
// marked packet walks at most log2(slots)+1 rules (9 for 256 slots), and
// the kernel resolves every goto forwards. A subtree holding only slots
// beyond the last has no rules, nor a test that would lead to it. Each
// test also matches the higher bits (and the mark block), so a packet
// whose slot table has no route for its destination falls through the
// remaining rules without a jump, as it would through a row of lookups.

// slotBits is the number of slot-number bits the tree tests: log2 of the
// mark block (see markBlockSize).
func slotBits(slots int) int { return bits.TrailingZeros32(markBlockSize(slots)) }

// slotRuleCount is how many rules SlotRules lays out for slots slots.
func slotRuleCount(slots int) int {
	return subtreeRules(slots, slotBits(slots), 0, 0)
}

// subtreeRules counts the rules of the subtree of the slots whose top depth
// of k bits are prefix.
func subtreeRules(slots, k, depth int, prefix int) int {
	if prefix<<(k-depth) >= slots {
		return 0
	}
	if depth == k {
		return 1
	}
	n := subtreeRules(slots, k, depth+1, prefix<<1) + subtreeRules(slots, k, depth+1, prefix<<1|1)
	if (prefix<<1|1)<<(k-depth-1) < slots {
		n++ // the test rule
	}
	return n
}

// slotRuleIndex is the position of slot's lookup rule among SlotRules: the
// test rules on its path, plus the whole lower subtree at each bit it has
// set (a lower subtree is always full: the higher half holds slots).
func slotRuleIndex(slots, slot int) int {
	k := slotBits(slots)
	index := 0
	for depth := 0; depth < k; depth++ {
		prefix := slot >> (k - depth)
		if (prefix<<1|1)<<(k-depth-1) >= slots {
			continue // no higher half here: no test rule
		}
		index++
		if slot>>(k-depth-1)&1 == 1 {
			index += 1<<(k-depth) - 1 // the full lower subtree's rules
		}
	}
	return index
}

// SlotRules are the router's slot rules in priority order: the binary
// search tree described above, from RulePriority on.
func (c Config) SlotRules() []netlink.Rule {
	slots := c.Slots()
	k := slotBits(slots)
	block, blockMask := c.MarkBlock()
	rules := make([]netlink.Rule, 0, slotRuleCount(slots))
	var emit func(depth, prefix int)
	emit = func(depth, prefix int) {
		if prefix<<(k-depth) >= slots {
			return
		}
		if depth == k {
			rules = append(rules, c.SlotRule(prefix))
			return
		}
		higher := (prefix<<1 | 1) << (k - depth - 1)
		if higher >= slots {
			emit(depth+1, prefix<<1)
			return
		}
		test := c.newRule(c.RulePriority + len(rules))
		test.Mark = block | uint32(higher)
		mask := blockMask | uint32((1<<(depth+1)-1)<<(k-depth-1))
		test.Mask = &mask
		rules = append(rules, test)
		at := len(rules) - 1
		emit(depth+1, prefix<<1)
		rules[at].Goto = c.RulePriority + len(rules)
		emit(depth+1, prefix<<1|1)
	}
	emit(0, 0)
	return rules
}

// SlotRule is the lookup rule of slot b: fwmark Mark(b) lookup Table(b), at
// Priority(b).
func (c Config) SlotRule(b int) netlink.Rule {
	r := c.newRule(c.Priority(b))
	r.Mark = c.Mark(b)
	mask := uint32(0xffffffff)
	r.Mask = &mask
	r.Table = c.Table(b)
	return r
}

func (c Config) newRule(priority int) netlink.Rule {
	r := *netlink.NewRule()
	r.Family = c.Family.af()
	r.Priority = priority
	r.Protocol = c.RouteProtocol
	return r
}
