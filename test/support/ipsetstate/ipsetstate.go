// Package ipsetstate reads the ipsets of a network namespace through
// netlink (no ipset binary needed, so it also works in the lab VM), for
// tests that compare kernel states: one line per set and one per member,
// sorted, without counters.
package ipsetstate

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Lines lists every set that h (a NETLINK_NETFILTER handle) sees: "set
// NAME TYPE family F counters BOOL" (and " timeout T" for a set whose
// members expire) and "member NAME ADDR", sorted. The members of a set
// with a timeout are left out: they come and go with the traffic (the
// router's SYN sets remember each SYN for seconds), and are no state a
// daemon owns.
func Lines(h *netlink.Handle) ([]string, error) {
	sets, err := h.IpsetListAll()
	if err != nil {
		return nil, fmt.Errorf("list ipsets: %w", err)
	}
	var lines []string
	expiring := map[string]bool{}
	for _, s := range sets {
		// A set with many members comes in several messages; only the
		// first carries the type.
		if s.TypeName != "" {
			line := fmt.Sprintf("set %s %s family %d counters %t",
				s.SetName, s.TypeName, s.Family, s.CadtFlags&nl.IPSET_FLAG_WITH_COUNTERS != 0)
			if s.Timeout != nil {
				line += fmt.Sprintf(" timeout %d", *s.Timeout)
				expiring[s.SetName] = true
			}
			lines = append(lines, line)
		}
		if expiring[s.SetName] {
			continue
		}
		for _, e := range s.Entries {
			a, _ := netip.AddrFromSlice(e.IP)
			lines = append(lines, fmt.Sprintf("member %s %s", s.SetName, a.Unmap()))
		}
	}
	slices.Sort(lines)
	return slices.Compact(lines), nil
}

// Members returns the addresses in the set name, nil when it does not
// exist.
func Members(h *netlink.Handle, name string) ([]netip.Addr, error) {
	res, err := h.IpsetList(name)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil
		}
		return nil, fmt.Errorf("list ipset %s: %w", name, err)
	}
	var out []netip.Addr
	for _, e := range res.Entries {
		a, _ := netip.AddrFromSlice(e.IP)
		out = append(out, a.Unmap())
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out, nil
}

// InNamespace is Lines for the named network namespace (one made with
// "ip netns add").
func InNamespace(name string) ([]string, error) {
	var lines []string
	err := inNamespace(name, func(h *netlink.Handle) (err error) {
		lines, err = Lines(h)
		return err
	})
	return lines, err
}

// MembersInNamespace is Members for the named network namespace.
func MembersInNamespace(name, set string) ([]netip.Addr, error) {
	var members []netip.Addr
	err := inNamespace(name, func(h *netlink.Handle) (err error) {
		members, err = Members(h, set)
		return err
	})
	return members, err
}

func inNamespace(name string, fn func(*netlink.Handle) error) error {
	ns, err := netns.GetFromName(name)
	if err != nil {
		return fmt.Errorf("netns %s: %w", name, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netfilter netlink in netns %s: %w", name, err)
	}
	defer h.Close()
	return fn(h)
}

// ListRules runs list, an iptables listing (iptables-save, iptables -S),
// again while it fails because a set vanished under it, at most 5 times.
// The listing dumps the rules first and names each set-matching rule's set
// by its index afterwards, so a set destroyed in between (the router ends
// a generation: its rule goes, then its set) fails it with "Set with index
// N in kernel doesn't exist"; the next listing no longer has the rule.
func ListRules(list func() (string, error)) (string, error) {
	var out string
	var err error
	for range 5 {
		out, err = list()
		if err == nil || !strings.Contains(err.Error(), "in kernel doesn't exist") {
			break
		}
	}
	return out, err
}
