// Package nfttable holds what the agent's own nftables tables (the bridge
// guard, the reply exemption) share: a netlink connection in a network
// namespace, finding a table of the agent's and its chains, and deleting
// it. Each table's shape stays with its package.
package nfttable

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
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
