package datapath

import (
	"fmt"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// walk follows the kernel's policy-rule walk (fib_rules_lookup) for a
// packet with mark over rules in priority order: a rule matches when
// mark&mask == value (inverted for "not"), a goto continues at the first
// rule of its target priority. It returns the table of the first matching
// lookup (0 for none) and the number of rules looked at.
func walk(rules []netlink.Rule, mark uint32) (table, walked int) {
	for i := 0; i < len(rules); i++ {
		r := rules[i]
		walked++
		mask := uint32(0xffffffff)
		if r.Mask != nil {
			mask = *r.Mask
		}
		if (mark&mask == r.Mark) == r.Invert {
			continue
		}
		switch {
		case r.Goto > 0:
			j := i + 1
			for j < len(rules) && rules[j].Priority < r.Goto {
				j++
			}
			i = j - 1
		case r.Table > 0:
			return r.Table, walked
		}
	}
	return 0, walked
}

func TestSlotRulesAreASearchTree(t *testing.T) {
	for _, shape := range []struct{ buckets, generations int }{
		{1, 1}, {2, 1}, {3, 1}, {64, 1}, {64, 4}, {100, 1}, {100, 3}, {1024, 8},
	} {
		t.Run(fmt.Sprintf("%dx%d", shape.buckets, shape.generations), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Buckets, cfg.Generations = shape.buckets, shape.generations
			cfg.MarkOffset = 0x100000 // a multiple of every shape's mark block
			slots := cfg.Slots()
			tree := cfg.SlotRules()
			if len(tree) != slotRuleCount(slots) || len(tree) >= 2*slots && slots > 1 {
				t.Fatalf("%d rules for %d slots (slotRuleCount %d), want fewer than %d", len(tree), slots, slotRuleCount(slots), 2*slots)
			}
			for i, r := range tree {
				if r.Priority != cfg.RulePriority+i {
					t.Fatalf("rule %d has priority %d, want %d: the tree is laid out contiguously", i, r.Priority, cfg.RulePriority+i)
				}
				if r.Goto > 0 && (r.Goto <= r.Priority || r.Goto >= cfg.RulePriority+len(tree)) {
					t.Fatalf("rule %d jumps to %d: not forwards inside the tree", i, r.Goto)
				}
			}
			guard, target := cfg.GuardRules()
			all := append(append([]netlink.Rule{guard}, tree...), target)
			maxWalk := slotBits(slots) + 2 // the guard, the tests, the lookup
			for s := 0; s < slots; s++ {
				if p := cfg.Priority(s); tree[p-cfg.RulePriority].Table != cfg.Table(s) {
					t.Fatalf("Priority(%d) = %d holds %+v, not slot %d's lookup", s, p, tree[p-cfg.RulePriority], s)
				}
				table, walked := walk(all, cfg.Mark(s))
				if table != cfg.Table(s) {
					t.Fatalf("slot %d (mark %#x) looks up table %d, want %d", s, cfg.Mark(s), table, cfg.Table(s))
				}
				if walked > maxWalk {
					t.Errorf("slot %d walks %d rules, want at most %d", s, walked, maxWalk)
				}
			}
			// Marks that are not the router's (none, kube-proxy's, the
			// block's marks beyond the last slot) look up no slot table,
			// and packets without the router's mark jump over the tree.
			block, _ := cfg.MarkBlock()
			for _, mark := range []uint32{0, 0x4000, block + uint32(slots), block + markBlockSize(slots)} {
				if table, walked := walk(all, mark); table != 0 {
					t.Errorf("mark %#x looks up table %d", mark, table)
				} else if mark&^(markBlockSize(slots)-1) != block && walked != 2 {
					t.Errorf("mark %#x walked %d rules, want 2 (the guard and its target)", mark, walked)
				}
			}
		})
	}
}

// TestIPv6RulesMirrorIPv4: the IPv6 datapath's rules are IPv4's (the same
// marks, tables and priorities: the kernel keeps each family's rules and
// tables apart) in family AF_INET6, and each family owns only its own.
func TestIPv6RulesMirrorIPv4(t *testing.T) {
	v4, v6 := testConfig(), testConfig().ForFamily(IPv6)
	rules4, rules6 := v4.SlotRules(), v6.SlotRules()
	g4, t4 := v4.GuardRules()
	g6, t6 := v6.GuardRules()
	rules4, rules6 = append(rules4, g4, t4), append(rules6, g6, t6)
	if len(rules4) != len(rules6) {
		t.Fatalf("%d IPv6 rules, %d IPv4 ones", len(rules6), len(rules4))
	}
	for i := range rules6 {
		r4, r6 := rules4[i], rules6[i]
		if r4.Family != unix.AF_INET || r6.Family != unix.AF_INET6 {
			t.Fatalf("rule %d: families %d and %d", i, r4.Family, r6.Family)
		}
		r4.Family = r6.Family
		if !sameRule(&r4, &r6) || r4.Protocol != r6.Protocol {
			t.Errorf("rule %d: IPv6 %+v, IPv4 %+v", i, r6, r4)
		}
		if !v6.ownsRule(&rules6[i]) || v6.ownsRule(&rules4[i]) || !v4.ownsRule(&rules4[i]) || v4.ownsRule(&rules6[i]) {
			t.Errorf("rule %d: a family owns the other's, or not its own", i)
		}
	}
}
