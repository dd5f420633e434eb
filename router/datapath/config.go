package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

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
	// DefaultGRE6Device is the flow-based ip6gre device of the IPv6
	// datapath (gre mode).
	DefaultGRE6Device = "kst-gre6"
	// DefaultChain6 is the IPv6 HMARK chain, in ip6tables' mangle table.
	// Its name differs from DefaultChain's because the chain names its
	// ipsets after itself, and a network namespace has one set of ipset
	// names for both families.
	DefaultChain6 = "KST-HMARK6"
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

// Family is the address family of a Datapath's tunnel IPs, and so of
// everything it programs and reads: its policy rules, routes, nexthop
// objects, device and conntrack entries. A tunnel IP of a family is carried
// to endpoints of that family only (a dual-stack Service has one
// EndpointSlice per family).
type Family uint8

const (
	// IPv4 is the zero Family: a Config that names none is IPv4's.
	IPv4 Family = iota
	// IPv6 tunnel IPs: IPv6 routes (/128) and rules, AF_INET6 nexthop
	// objects, outer IPv6 through the ip6gre device (gre mode) or labels
	// towards the nodes' IPv6 addresses (mpls mode).
	IPv6
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

// FamilyOf is the family of address a; ok is false for an invalid address
// or an IPv4-mapped IPv6 one, which belongs to neither.
func FamilyOf(a netip.Addr) (f Family, ok bool) {
	switch {
	case a.Is4():
		return IPv4, true
	case a.Is6() && !a.Is4In6():
		return IPv6, true
	}
	return 0, false
}

// has reports whether address a is of family f.
func (f Family) has(a netip.Addr) bool {
	g, ok := FamilyOf(a)
	return ok && g == f
}

// bits is the length of f's addresses: a tunnel IP's route is VIP/bits.
func (f Family) bits() int {
	if f == IPv6 {
		return 128
	}
	return 32
}

// af is f's kernel address family (AF_INET, AF_INET6).
func (f Family) af() int {
	if f == IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// Config is the datapath configuration every tunnel router must share, plus
// the node-local ranges it owns. Everything the router creates is identified by
// these ranges; nothing outside them is ever touched.
//
// A dual-stack router runs one Datapath per family from one Config (see
// ForFamily and Families): the same marks, tables and rule priorities
// (the kernel keeps each family's rules and tables apart), each family
// with its own device and HMARK chain.
type Config struct {
	Mode encap.Mode
	// Family is the family of the tunnel IPs the datapath programs (the
	// zero value IPv4).
	Family Family
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
	// GREDevice is the name of the flow-based GRE device (gre mode, IPv4).
	GREDevice string
	// GRE6Device is the name of the flow-based ip6gre device (gre mode,
	// IPv6): outer IPv6 towards IPv6 pods.
	GRE6Device string
	// Chain is the iptables chain in the mangle table that holds the HMARK rules.
	Chain string
	// Chain6 is the ip6tables chain that holds the IPv6 HMARK rules.
	Chain6 string
	// EncapSources are the outer source addresses of gre mode's packets,
	// at most one per family: the router node's own address, which the
	// endpoint agents accept the carrier from (any other source is
	// dropped in the pods). None of a family: the kernel chooses it by
	// route (the pods then refuse the carrier unless that is the node's
	// address).
	EncapSources []netip.Addr
}

// encapSource is the outer source of c's family (gre mode), or the zero
// Addr when the kernel chooses it.
func (c Config) encapSource() netip.Addr {
	for _, a := range c.EncapSources {
		if c.Family.has(a) {
			return a
		}
	}
	return netip.Addr{}
}

// ForFamily is c for the Datapath of family f.
func (c Config) ForFamily(f Family) Config {
	c.Family = f
	return c
}

// GREDeviceName is the flow-based device of c's family (gre mode):
// GREDevice or GRE6Device.
func (c Config) GREDeviceName() string {
	if c.Family == IPv6 {
		return c.GRE6Device
	}
	return c.GREDevice
}

// ChainName is the HMARK chain of c's family: Chain or Chain6.
func (c Config) ChainName() string {
	if c.Family == IPv6 {
		return c.Chain6
	}
	return c.Chain
}

// DefaultConfig returns the defaults of every field but Seed, which every
// cluster must choose.
func DefaultConfig() Config {
	return Config{
		Mode: encap.GRE, Buckets: DefaultBuckets, MarkOffset: DefaultMarkOffset,
		RulePriority: DefaultRulePriority, TableBase: DefaultTableBase, RouteProtocol: encap.DefaultRouteProtocol,
		GREDevice: DefaultGREDevice, Chain: DefaultChain,
		GRE6Device: DefaultGRE6Device, Chain6: DefaultChain6,
		Generations: DefaultGenerations, GenerationCheckPeriod: DefaultGenerationCheckPeriod,
	}
}

// Validate checks the configuration and names the first bad field.
func (c Config) Validate() error {
	var errs []error
	if err := c.Mode.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.Family != IPv4 && c.Family != IPv6 {
		errs = append(errs, fmt.Errorf("family %v: must be IPv4 or IPv6", c.Family))
	}
	seen := map[Family]bool{}
	for _, a := range c.EncapSources {
		f, ok := FamilyOf(a)
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("encap source %v: not an IPv4 or IPv6 address", a))
		case seen[f]:
			errs = append(errs, fmt.Errorf("encap sources %v: more than one %v address", c.EncapSources, f))
		}
		seen[f] = true
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
	// The IPv6 names are checked when set, and must be for IPv6.
	if c.Mode == encap.GRE && (c.Family == IPv6 || c.GRE6Device != "") {
		switch dev := c.GRE6Device; {
		case dev == "" || len(dev) > 15:
			errs = append(errs, fmt.Errorf("gre6 device %q: must be 1-15 characters", dev))
		case dev == "ip6gre0" || dev == "ip6gretap0" || dev == "ip6tnl0":
			errs = append(errs, fmt.Errorf("gre6 device %q: the kernel's fallback device cannot be flow-based", dev))
		}
	}
	// iptables names have at most 28 characters; with generations the raw
	// table also holds the chain's "-SYN" subchain.
	maxChain := chainNameLimit(c.Generations)
	if c.Chain == "" || len(c.Chain) > maxChain {
		errs = append(errs, fmt.Errorf("chain %q: must be 1-%d characters (--generations %d)", c.Chain, maxChain, c.Generations))
	}
	if c.Family == IPv6 || c.Chain6 != "" {
		switch {
		case c.Chain6 == "" || len(c.Chain6) > maxChain:
			errs = append(errs, fmt.Errorf("chain6 %q: must be 1-%d characters (--generations %d)", c.Chain6, maxChain, c.Generations))
		case c.Chain6 == c.Chain:
			// The chains name their ipsets after themselves, and both
			// families' sets share one namespace.
			errs = append(errs, fmt.Errorf("chain6 %q: the IPv4 chain has that name, and so would their ipsets", c.Chain6))
		}
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
// saves and restores the router's marks (MarkBlock), and a handshake keeps
// the generation of its SYN in each of the Generations.
func (c Config) Sticky() *hmark.Sticky {
	block, mask := c.MarkBlock()
	return &hmark.Sticky{Block: block, Mask: mask, Generations: c.Generations}
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
