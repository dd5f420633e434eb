// Package nfttable holds what the daemons' own nftables tables (the
// agent's bridge guard and reply exemption, the router's carrier
// exemption) share: a netlink connection in a network namespace, finding a
// table of theirs and its chains, reading it when it has the shape it
// should, and deleting it. Each table's rules stay with its package.
package nfttable

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Conn opens an nftables connection in ns; netns.None() is the caller's
// own namespace, which needs no setns (and so no CAP_SYS_ADMIN).
func Conn(ns netns.NsHandle) (*nftables.Conn, error) {
	var opts []nftables.ConnOption
	if ns != netns.None() {
		opts = append(opts, nftables.WithNetNSFd(int(ns)))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("nftables connection: %w", err)
	}
	return c, nil
}

// familyName is how nft names a table family.
func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyBridge:
		return "bridge"
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	case nftables.TableFamilyNetdev:
		return "netdev"
	}
	return fmt.Sprintf("family %d", f)
}

// Chains reports whether the table name of family exists, and its chains.
func Chains(c *nftables.Conn, family nftables.TableFamily, name string) (present bool, chains []*nftables.Chain, err error) {
	tables, err := c.ListTablesOfFamily(family)
	if err != nil {
		return false, nil, fmt.Errorf("listing %s-family nftables tables (does the kernel have nf_tables?): %w", familyName(family), err)
	}
	for _, t := range tables {
		present = present || t.Name == name
	}
	if !present {
		return false, nil, nil
	}
	all, err := c.ListChainsOfTableFamily(family)
	if err != nil {
		return true, nil, fmt.Errorf("listing %s-family chains: %w", familyName(family), err)
	}
	for _, ch := range all {
		if ch.Table != nil && ch.Table.Name == name {
			chains = append(chains, ch)
		}
	}
	return true, chains, nil
}

// Delete deletes the table name of family in ns if it is there.
func Delete(ns netns.NsHandle, family nftables.TableFamily, name string) error {
	c, err := Conn(ns)
	if err != nil {
		return err
	}
	tables, err := c.ListTablesOfFamily(family)
	if err != nil {
		return fmt.Errorf("listing %s-family nftables tables: %w", familyName(family), err)
	}
	for _, t := range tables {
		if t.Name != name {
			continue
		}
		c.DelTable(&nftables.Table{Name: name, Family: family})
		if err := c.Flush(); err != nil {
			return fmt.Errorf("removing %s table %s: %w", familyName(family), name, err)
		}
	}
	return nil
}

// Shape is one of the daemons' own tables: a single base chain on a hook
// (at a priority, when Priority is not nil) holding Rules rules, each with
// the comment Comment, which names the rules' version; or, when Comments is
// not nil, holding one rule a comment of Comments, in that order (a table
// whose rules differ in what they match, each comment naming its rule).
type Shape struct {
	Family       nftables.TableFamily
	Table, Chain string
	Hook         *nftables.ChainHook
	Priority     *nftables.ChainPriority
	Rules        int
	Comment      string
	Comments     []string
}

// Read reports whether the shape's table is there and, when it has exactly
// the shape (its chain, hook, priority, number of rules and their
// comment), its rules; nil rules mean a table of another shape or version,
// to be replaced.
func (s Shape) Read(c *nftables.Conn) (present bool, rules []*nftables.Rule, err error) {
	present, ours, err := Chains(c, s.Family, s.Table)
	if err != nil || !present {
		return present, nil, err
	}
	if len(ours) != 1 || ours[0].Name != s.Chain || ours[0].Hooknum == nil || *ours[0].Hooknum != *s.Hook ||
		(s.Priority != nil && (ours[0].Priority == nil || *ours[0].Priority != *s.Priority)) {
		return true, nil, nil
	}
	rules, err = c.GetRules(&nftables.Table{Name: s.Table, Family: s.Family}, ours[0])
	if err != nil {
		return true, nil, fmt.Errorf("listing the rules of %s %s %s: %w", familyName(s.Family), s.Table, s.Chain, err)
	}
	want := s.Rules
	if s.Comments != nil {
		want = len(s.Comments)
	}
	if len(rules) != want {
		return true, nil, nil
	}
	for i, r := range rules {
		comment := s.Comment
		if s.Comments != nil {
			comment = s.Comments[i]
		}
		if got, _ := userdata.GetString(r.UserData, userdata.TypeComment); got != comment {
			return true, nil, nil
		}
	}
	return true, rules, nil
}

// IfName is an interface name as nftables compares it (meta iifname, and
// the keys of a set of names): IFNAMSIZ bytes, zero-padded.
func IfName(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}

// Packets sums the packet counters of rules.
func Packets(rules []*nftables.Rule) uint64 {
	var n uint64
	for _, r := range rules {
		for _, e := range r.Exprs {
			if ctr, ok := e.(*expr.Counter); ok {
				n += ctr.Packets
			}
		}
	}
	return n
}
