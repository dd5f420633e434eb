package hmark

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// IPSets is the ipset seam: the calls of github.com/vishvananda/netlink's
// *netlink.Handle (opened with NETLINK_NETFILTER, in the router's network
// namespace) that Chain uses. Which tunnel IPs a packet may be for, and
// which generation's offset it is hashed with, are decided by looking its
// destination up in Chain's sets, so that the rules a packet walks do not
// grow with the number of tunnel IPs. Unit tests give Chain a fake.
type IPSets interface {
	IpsetCreate(setname, typename string, options netlink.IpsetCreateOptions) error
	IpsetDestroy(setname string) error
	IpsetList(setname string) (*netlink.IPSetResult, error)
	IpsetAdd(setname string, entry *netlink.IPSetEntry) error
	IpsetDel(setname string, entry *netlink.IPSetEntry) error
}

const (
	// MaxGenerations is the number of offsets a Chain can hash with at
	// once: Params.Offset + g×Buckets for g below it (see Target), each
	// with its own set.
	MaxGenerations = 8
	// SetType is the type of every set Chain creates: one address per
	// element (of the chain's family: an IPv4 Chain's sets are inet, an
	// IPv6 Chain's inet6), looked up in constant time.
	SetType = "hash:ip"
	// SetMaxElements is the capacity of each set, fixed when the set is
	// created: the most tunnel IPs a router serves.
	SetMaxElements = 1 << 18
)

// allSetName is the set of every synced tunnel IP: the packets whose
// destination is not in it leave Chain's chains at their first rule. Its
// elements carry the tunnel IPs' packet and byte counters (see Counters).
func (c *Chain) allSetName() string { return c.name }

// A tunnel IP's hash class is its generation and the tuple it is hashed
// on: the whole 5-tuple, or the client's address alone (client affinity).
// Each class has its set and, while the set has members, its HMARK rule.
const classes = 2 * MaxGenerations

// classOf is the class of generation g, with client affinity or not.
func classOf(g int, affinity bool) int {
	if affinity {
		return MaxGenerations + g
	}
	return g
}

// classGeneration is class k's generation, and whether it hashes the
// client's address alone.
func classGeneration(k int) (g int, affinity bool) { return k % MaxGenerations, k >= MaxGenerations }

// generationSetName is the set of the tunnel IPs hashed on the 5-tuple
// with generation g's offset (Params.Offset + g×Buckets).
func (c *Chain) generationSetName(g int) string { return fmt.Sprintf("%s-%d", c.name, g) }

// classSetName is the set of class k's tunnel IPs: NAME-g for the 5-tuple,
// NAME-cg for the client's address alone.
func (c *Chain) classSetName(k int) string {
	if g, affinity := classGeneration(k); affinity {
		return fmt.Sprintf("%s-c%d", c.name, g)
	}
	return c.generationSetName(k)
}

// generationOf is the generation of offset: g such that offset is
// Params.Offset + g×Buckets.
func (c *Chain) generationOf(offset uint32) (int, error) {
	base, step := uint64(c.params.Offset), uint64(c.params.Buckets)
	o := uint64(offset)
	if o < base || (o-base)%step != 0 || (o-base)/step >= MaxGenerations {
		return 0, fmt.Errorf("offset %d is not %d + g×%d for a generation g below %d", offset, base, step, MaxGenerations)
	}
	return int((o - base) / step), nil
}

// offsetOf is generation g's offset.
func (c *Chain) offsetOf(g int) uint32 { return c.params.Offset + uint32(g)*c.params.Buckets }

// ipset is what Chain read of one of its sets.
type ipset struct {
	name   string
	exists bool
	// members are the set's addresses, with their counters (zero in a set
	// without counters).
	members map[netip.Addr]Counter
}

// readSet lists the set name; a missing set is not an error. A set of
// that name that Chain would not have created (another type or family,
// or without counters where withCounters) is an error: Chain never
// writes into it.
func (c *Chain) readSet(name string, withCounters bool) (ipset, error) {
	s := ipset{name: name, members: map[netip.Addr]Counter{}}
	res, err := c.sets.IpsetList(name)
	if errors.Is(err, syscall.ENOENT) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("list set %s: %w", name, err)
	}
	s.exists = true
	counters := res.CadtFlags&nl.IPSET_FLAG_WITH_COUNTERS != 0
	if res.TypeName != SetType || res.Family != c.family.setFamily() || (withCounters && !counters) {
		return s, fmt.Errorf("set %s is %s (family %s, counters %t), not the %s set (%s, counters %t) the router creates: "+
			"it is not the router's %s chain's, or an older one; remove the rules that use it, then the set (or run --cleanup)",
			name, res.TypeName, setFamilyName(res.Family), counters, SetType, setFamilyName(c.family.setFamily()), withCounters, c.family)
	}
	for _, e := range res.Entries {
		a, ok := netip.AddrFromSlice(e.IP)
		if !ok {
			continue
		}
		var n Counter
		if e.Packets != nil {
			n.Packets = *e.Packets
		}
		if e.Bytes != nil {
			n.Bytes = *e.Bytes
		}
		s.members[a.Unmap()] = n
	}
	return s, nil
}

// setFamilyName names the address family of a set as ipset does: inet,
// inet6, or the number.
func setFamilyName(af uint8) string {
	switch af {
	case unix.AF_INET:
		return "inet"
	case unix.AF_INET6:
		return "inet6"
	}
	return strconv.Itoa(int(af))
}

// chainSets are Chain's sets as read: the set of all tunnel IPs and one
// per class.
type chainSets struct {
	all     ipset
	classes [classes]ipset
	// filtered and ports are the port filter's sets.
	filtered ipset
	ports    portSet
}

// readSets reads every set of c.
func (c *Chain) readSets() (chainSets, error) {
	var s chainSets
	var err error
	if s.all, err = c.readSet(c.allSetName(), true); err != nil {
		return s, err
	}
	if s.filtered, err = c.readSet(c.filteredSetName(), true); err != nil {
		return s, err
	}
	if s.ports, err = c.readPortSet(); err != nil {
		return s, err
	}
	for k := range s.classes {
		if s.classes[k], err = c.readSet(c.classSetName(k), false); err != nil {
			return s, err
		}
	}
	return s, nil
}

// createSet creates s unless it exists.
func (c *Chain) createSet(s *ipset, withCounters bool) (changed int, err error) {
	if s.exists {
		return 0, nil
	}
	opts := netlink.IpsetCreateOptions{Family: c.family.setFamily(), Counters: withCounters, MaxElements: SetMaxElements}
	if err := c.sets.IpsetCreate(s.name, SetType, opts); err != nil {
		return 0, fmt.Errorf("create set %s: %w", s.name, err)
	}
	s.exists = true
	return 1, nil
}

// addMembers adds to s the addresses of want it lacks, in address order.
func (c *Chain) addMembers(s *ipset, want []netip.Addr) (changed int, err error) {
	for _, a := range want {
		if _, ok := s.members[a]; ok {
			continue
		}
		if err := c.addMember(s.name, a); err != nil {
			return changed, err
		}
		s.members[a] = Counter{}
		changed++
	}
	return changed, nil
}

// removeMembers deletes from s the addresses that keep does not hold, in
// address order.
func (c *Chain) removeMembers(s *ipset, keep func(netip.Addr) bool) (changed int, err error) {
	var gone []netip.Addr
	for a := range s.members {
		if !keep(a) {
			gone = append(gone, a)
		}
	}
	slices.SortFunc(gone, netip.Addr.Compare)
	for _, a := range gone {
		if err := c.delMember(s.name, a); err != nil {
			return changed, err
		}
		delete(s.members, a)
		changed++
	}
	return changed, nil
}

// addMember adds a to the set named set: one netlink call.
func (c *Chain) addMember(set string, a netip.Addr) error {
	if err := c.sets.IpsetAdd(set, &netlink.IPSetEntry{IP: a.AsSlice()}); err != nil {
		return fmt.Errorf("add %s to set %s: %w", a, set, err)
	}
	return nil
}

// delMember deletes a from the set named set: one netlink call.
func (c *Chain) delMember(set string, a netip.Addr) error {
	if err := c.sets.IpsetDel(set, &netlink.IPSetEntry{IP: a.AsSlice()}); err != nil {
		return fmt.Errorf("delete %s from set %s: %w", a, set, err)
	}
	return nil
}

// destroySet destroys s if it exists. The kernel refuses while a rule
// still uses it: Chain removes its own rules first, and never a rule of
// anyone else.
func (c *Chain) destroySet(s *ipset) (changed int, err error) {
	if !s.exists {
		return 0, nil
	}
	if err := c.destroySetNamed(s.name); err != nil {
		return 0, err
	}
	s.exists = false
	s.members = map[netip.Addr]Counter{}
	return 1, nil
}

// destroySetNamed destroys the set name: one netlink call.
func (c *Chain) destroySetNamed(name string) error {
	if err := c.sets.IpsetDestroy(name); err != nil {
		if errors.Is(err, syscall.EBUSY) || errors.Is(err, nl.IPSetError(nl.IPSET_ERR_BUSY)) || errors.Is(err, nl.IPSetError(nl.IPSET_ERR_REFERENCED)) {
			return fmt.Errorf("destroy set %s: a rule that is not the router's still uses it: %w", name, err)
		}
		return fmt.Errorf("destroy set %s: %w", name, err)
	}
	return nil
}
