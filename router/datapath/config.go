package datapath

import (
	"errors"
	"fmt"
	"time"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// Defaults. They stay clear of kube-proxy's marks (0x4000 masquerade, 0x8000
// drop), Calico's mark bits (0xffff0000 by default), Cilium's magic marks
// (0x0f00 bits), the kernel's reserved tables (0, 253-255) and the default rule
// priorities (0, 32766, 32767).
const (
	DefaultBuckets      = 64
	DefaultMarkOffset   = 0x1000
	DefaultRulePriority = 7600
	DefaultTableBase    = 7600
	DefaultGREDevice    = "kst-gre"
	DefaultChain        = "KST-HMARK"
	// DefaultGenerations is the number of routing generations: the current
	// bucket tables plus up to three older ones kept for established flows.
	DefaultGenerations = 4
	// DefaultGenerationCheckPeriod is how often the router looks in the
	// conntrack table for older generations no flow uses any more.
	DefaultGenerationCheckPeriod = 10 * time.Second
	// MaxBuckets bounds the table count; each bucket costs one rule and one table.
	MaxBuckets = 1024
	// MaxGenerations bounds the generations; each costs one rule and one
	// table per bucket.
	MaxGenerations = 8
	// ownedSlots is the number of (generation, bucket) slots whose rules and
	// tables the router considers its own, whatever its current flags, so
	// that a smaller --buckets or --generations still finds the old ones.
	// Their rules take up to 2*ownedSlots priorities (see SlotRules).
	ownedSlots = 8192
)

// foreignMarkBits are mark bits owned by kube-proxy and Calico. A bucket mark
// must not set any of them, since HMARK overwrites the whole packet mark.
const foreignMarkBits = 0x4000 | 0x8000 | 0xffff0000

// Config is the datapath configuration every tunnel router must share, plus
// the node-local ranges it owns. Everything the router creates is identified by
// these ranges; nothing outside them is ever touched.
type Config struct {
	Mode encap.Mode
	// Buckets is the number of HMARK buckets (--hmark-mod), one rule and one
	// routing table each per generation.
	Buckets int
	// Generations is the number of routing generations (see Slot). With 1 the
	// router is stateless: every packet is hashed, nothing uses conntrack.
	Generations int
	// GenerationCheckPeriod is how often older generations are checked for
	// flows still using them (conntrack), and removed when none does.
	GenerationCheckPeriod time.Duration
	// MarkOffset is the mark of generation 0's bucket 0; slot k has mark MarkOffset+k.
	MarkOffset uint32
	// Seed is the HMARK seed (--hmark-rnd). All routers must share it.
	Seed uint32
	// RulePriority is the priority of slot 0's policy rule; slot k uses RulePriority+k.
	RulePriority int
	// TableBase is slot 0's routing table; slot k uses TableBase+k.
	TableBase int
	// RouteProtocol marks the routes the router installs.
	RouteProtocol uint8
	// GREDevice is the name of the flow-based GRE device (gre mode).
	GREDevice string
	// Chain is the iptables chain in the mangle table that holds the HMARK rules.
	Chain string
}

// DefaultConfig returns the defaults of every field but Seed, which every
// cluster must choose.
func DefaultConfig() Config {
	return Config{
		Mode: encap.GRE, Buckets: DefaultBuckets, MarkOffset: DefaultMarkOffset,
		RulePriority: DefaultRulePriority, TableBase: DefaultTableBase, RouteProtocol: encap.DefaultRouteProtocol,
		GREDevice: DefaultGREDevice, Chain: DefaultChain,
		Generations: DefaultGenerations, GenerationCheckPeriod: DefaultGenerationCheckPeriod,
	}
}

// Validate checks the configuration and names the first bad field.
func (c Config) Validate() error {
	var errs []error
	if err := c.Mode.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.Buckets < 1 || c.Buckets > MaxBuckets {
		errs = append(errs, fmt.Errorf("buckets %d: must be between 1 and %d", c.Buckets, MaxBuckets))
	}
	if c.MarkOffset == 0 {
		errs = append(errs, errors.New("mark offset 0: mark 0 means unmarked, choose a non-zero offset"))
	}
	if c.Generations < 1 || c.Generations > MaxGenerations {
		errs = append(errs, fmt.Errorf("generations %d: must be between 1 and %d", c.Generations, MaxGenerations))
	}
	if c.Buckets >= 1 && c.Buckets <= MaxBuckets && c.Generations >= 1 && c.Generations <= MaxGenerations {
		slots := c.Slots()
		for k := 0; k < slots; k++ {
			if m := uint64(c.MarkOffset) + uint64(k); m > 0xffffffff || uint32(m)&foreignMarkBits != 0 {
				errs = append(errs, fmt.Errorf("mark offset %#x with %d buckets x %d generations: mark %#x sets bits of kube-proxy (0x4000, 0x8000) or Calico (0xffff0000)", c.MarkOffset, c.Buckets, c.Generations, m))
				break
			}
		}
		if c.Generations > 1 {
			if size := markBlockSize(slots); c.MarkOffset%size != 0 {
				errs = append(errs, fmt.Errorf("mark offset %#x: with %d buckets x %d generations it must be a multiple of %#x, so that one mark mask covers every mark of the router (conntrack restores only those)", c.MarkOffset, c.Buckets, c.Generations, size))
			}
		}
		lastTable := c.TableBase + slots - 1
		if c.TableBase < 1 || lastTable >= 1<<31 || (c.TableBase <= 255 && lastTable >= 253) {
			errs = append(errs, fmt.Errorf("tables %d-%d: must avoid 0 and the kernel's tables 253-255", c.TableBase, lastTable))
		}
		// The guard rule sits just before the slot rules, its target just
		// after them (see GuardRules and SlotRules).
		firstPrio, lastPrio := c.RulePriority-1, c.RulePriority+slotRuleCount(slots)
		if firstPrio < 1 || lastPrio >= 32766 {
			errs = append(errs, fmt.Errorf("rule priorities %d-%d (rule priority %d, its guard before and its target after the %d rules of %d slots): must be between 1 and 32765 (0, 32766 and 32767 hold the kernel's default rules)", firstPrio, lastPrio, c.RulePriority, slotRuleCount(slots), slots))
		}
	}
	if c.Generations > 1 && c.GenerationCheckPeriod <= 0 {
		errs = append(errs, fmt.Errorf("generation check period %v: must be positive", c.GenerationCheckPeriod))
	}
	if c.Mode == encap.GRE && (c.GREDevice == "" || len(c.GREDevice) > 15) {
		errs = append(errs, fmt.Errorf("gre device %q: must be 1-15 characters", c.GREDevice))
	}
	if c.Mode == encap.GRE && (c.GREDevice == "gre0" || c.GREDevice == "gretap0") {
		errs = append(errs, fmt.Errorf("gre device %q: the kernel's fallback device cannot be flow-based", c.GREDevice))
	}
	// iptables names have at most 28 characters; with generations the raw
	// table also holds the chain's "-SYN" subchain.
	if maxChain := chainNameLimit(c.Generations); c.Chain == "" || len(c.Chain) > maxChain {
		errs = append(errs, fmt.Errorf("chain %q: must be 1-%d characters (--generations %d)", c.Chain, maxChain, c.Generations))
	}
	if c.RouteProtocol < 5 {
		errs = append(errs, fmt.Errorf("route protocol %d: 0-4 are the kernel's own", c.RouteProtocol))
	}
	return errors.Join(errs...)
}

// Slots is the number of (generation, bucket) slots: one policy rule, one
// routing table and one mark each. Slot k is bucket k%Buckets of
// generation k/Buckets.
func (c Config) Slots() int { return c.Buckets * c.Generations }

// Slot is the slot of bucket b in generation g.
func (c Config) Slot(g, b int) int { return g*c.Buckets + b }

// Table is slot k's routing table.
func (c Config) Table(k int) int { return c.TableBase + k }

// Mark is the packet mark of slot k.
func (c Config) Mark(k int) uint32 { return c.MarkOffset + uint32(k) }

// GenerationOffset is the HMARK offset that puts new flows in generation g.
func (c Config) GenerationOffset(g int) uint32 { return c.Mark(c.Slot(g, 0)) }

// Priority is the priority of slot k's lookup rule (see SlotRules).
func (c Config) Priority(k int) int { return c.RulePriority + slotRuleIndex(c.Slots(), k) }

// HMARKParams are the HMARK parameters of the router's chain: one bucket
// per --buckets, marks from MarkOffset, the shared seed.
func (c Config) HMARKParams() hmark.Params {
	return hmark.Params{Buckets: uint32(c.Buckets), Offset: c.MarkOffset, Seed: c.Seed}
}

// Sticky is the chain's sticky mode with several generations: conntrack
// saves and restores the router's marks (MarkBlock), TCP marks only while
// an entry has more than tcpMinExpire seconds to live.
func (c Config) Sticky(tcpMinExpire uint32) *hmark.Sticky {
	block, mask := c.MarkBlock()
	return &hmark.Sticky{Block: block, Mask: mask, TCPMinExpire: tcpMinExpire}
}

// MarkBlock returns the value and mask that every mark of the router matches
// (mark&mask == value), and only those: the marks conntrack saves and restores.
func (c Config) MarkBlock() (value, mask uint32) {
	size := markBlockSize(c.Slots())
	return c.MarkOffset &^ (size - 1), ^(size - 1)
}

// markBlockSize is the smallest power of two holding slots marks.
func markBlockSize(slots int) uint32 {
	size := uint32(1)
	for int(size) < slots {
		size <<= 1
	}
	return size
}

// chainNameLimit is the longest --chain name: iptables allows 28
// characters, and with several generations the "-SYN" subchain (hmark's
// sticky mode) must fit too.
func chainNameLimit(generations int) int {
	if generations > 1 {
		return 28 - len("-SYN")
	}
	return 28
}
