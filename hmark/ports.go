package hmark

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Port is one protocol and destination port that a tunnel IP whose ports
// are filtered carries (see Target.FilterPorts).
type Port struct {
	// Protocol is unix.IPPROTO_TCP, IPPROTO_UDP or IPPROTO_SCTP.
	Protocol uint8
	Number   uint16
}

// PortSetType is the type of the set of the ports each filtered tunnel IP
// carries: one (address, protocol, port) per element.
const PortSetType = "hash:ip,port"

// portSetName is the set of (tunnel IP, protocol, port) that the filtered
// tunnel IPs carry; filteredSetName the set (with counters) of the tunnel
// IPs whose ports are filtered, whose counters count what the filter
// dropped (see PortDrops). Both names fit the kernel's 31 characters with
// the longest chain name.
func (c *Chain) portSetName() string     { return c.name + "-p" }
func (c *Chain) filteredSetName() string { return c.name + "-f" }

// portElem is one element of the port set.
type portElem struct {
	vip  netip.Addr
	port Port
}

// portSet is what Chain read of its port set.
type portSet struct {
	name    string
	exists  bool
	members map[portElem]bool
}

// validPortProtocol reports whether the kernel's hash:ip,port set can hold
// a port of protocol p (a port of another protocol would be stored as
// port 0).
func validPortProtocol(p uint8) bool {
	return p == unix.IPPROTO_TCP || p == unix.IPPROTO_UDP || p == unix.IPPROTO_SCTP
}

// dropRule is the mangle rule, right after the exit, that drops a packet to
// a filtered tunnel IP unless its protocol and destination port are in
// the port set; ICMP (and ICMPv6) passes, so that errors about a pod's
// flows (path MTU) reach it. The filtered set is matched last, so that its
// counters count the drops alone.
func (c *Chain) dropRule() []string {
	icmp := "icmp"
	if c.family == IPv6 {
		icmp = "ipv6-icmp" // as iptables 1.8 prints protocol 58
	}
	return slices.Concat(
		[]string{"!", "-p", icmp, "-m", "set", "!", "--match-set", c.portSetName(), "dst,dst", "-m", "set", "--match-set", c.filteredSetName(), "dst"},
		comment, []string{"-j", "DROP"})
}

// readPortSet lists the port set; a missing set is not an error, one of
// another type or family is (Chain never writes into it).
func (c *Chain) readPortSet() (portSet, error) {
	s := portSet{name: c.portSetName(), members: map[portElem]bool{}}
	res, err := c.sets.IpsetList(s.name)
	if errors.Is(err, syscall.ENOENT) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("list set %s: %w", s.name, err)
	}
	s.exists = true
	if res.TypeName != PortSetType || res.Family != c.family.setFamily() {
		return s, fmt.Errorf("set %s is %s (family %s), not the %s set (%s) the router creates: "+
			"it is not the router's %s chain's; remove the rules that use it, then the set (or run --cleanup)",
			s.name, res.TypeName, setFamilyName(res.Family), PortSetType, setFamilyName(c.family.setFamily()), c.family)
	}
	for _, e := range res.Entries {
		a, ok := netip.AddrFromSlice(e.IP)
		if !ok || e.Protocol == nil || e.Port == nil {
			continue
		}
		s.members[portElem{a.Unmap(), Port{*e.Protocol, *e.Port}}] = true
	}
	return s, nil
}

// createPortSet creates s unless it exists.
func (c *Chain) createPortSet(s *portSet) (changed int, err error) {
	if s.exists {
		return 0, nil
	}
	opts := netlink.IpsetCreateOptions{Family: c.family.setFamily(), MaxElements: SetMaxElements}
	if err := c.sets.IpsetCreate(s.name, PortSetType, opts); err != nil {
		return 0, fmt.Errorf("create set %s: %w", s.name, err)
	}
	s.exists = true
	return 1, nil
}

// portEntry is e as a set element.
func portEntry(e portElem) *netlink.IPSetEntry {
	proto, port := e.port.Protocol, e.port.Number
	return &netlink.IPSetEntry{IP: e.vip.AsSlice(), Protocol: &proto, Port: &port}
}

// addPort adds e to the port set: one netlink call.
func (c *Chain) addPort(e portElem) error {
	if err := c.sets.IpsetAdd(c.portSetName(), portEntry(e)); err != nil {
		return fmt.Errorf("add %s,%d:%d to set %s: %w", e.vip, e.port.Protocol, e.port.Number, c.portSetName(), err)
	}
	return nil
}

// delPort deletes e from the port set: one netlink call.
func (c *Chain) delPort(e portElem) error {
	if err := c.sets.IpsetDel(c.portSetName(), portEntry(e)); err != nil {
		return fmt.Errorf("delete %s,%d:%d from set %s: %w", e.vip, e.port.Protocol, e.port.Number, c.portSetName(), err)
	}
	return nil
}

// sortedPortElems returns the elements of m for which keep is true, in
// order.
func sortedPortElems(m map[portElem]bool, keep func(portElem) bool) []portElem {
	var out []portElem
	for e := range m {
		if keep(e) {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, comparePortElems)
	return out
}

func comparePortElems(a, b portElem) int {
	if c := a.vip.Compare(b.vip); c != 0 {
		return c
	}
	return ComparePorts(a.port, b.port)
}

// ComparePorts orders ports by protocol, then number.
func ComparePorts(a, b Port) int {
	if a.Protocol != b.Protocol {
		return int(a.Protocol) - int(b.Protocol)
	}
	return int(a.Number) - int(b.Number)
}

// PortDrops returns, by filtered tunnel IP, the packets and bytes the port
// filter dropped (the counters of its element in the filtered set): those
// to a protocol or port its Service does not list. A tunnel IP that is not
// filtered is left out; its counters restart from 0 when it stops being
// filtered.
func (c *Chain) PortDrops() (map[netip.Addr]Counter, error) {
	s, err := c.readSet(c.filteredSetName(), true)
	if err != nil {
		return nil, fmt.Errorf("hmark: port drops of chain %s: %w", c.name, err)
	}
	return s.members, nil
}
