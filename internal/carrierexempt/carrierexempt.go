// Package carrierexempt keeps the router's own GRE carrier out of its
// node's connection tracking, and so out of the node's NAT.
//
// In gre mode the router sends each client packet to a pod inside GRE from
// its Node's address; the pod's carrier guard accepts GRE from the router
// nodes' addresses only. A network plugin that masquerades the node's own
// traffic to pods on other nodes rewrites that source on the way out:
// Flannel, with its default --ip-masq, masquerades everything from outside
// the pod network to the pod network (`! -s POD_NET -d POD_NET -j
// MASQUERADE`), so a router's GRE to a pod on another node left from the
// router node's flannel.1 address, and the pod dropped it (found by the lab
// cluster under Flannel). NAT applies to tracked packets only; the router
// therefore keeps, in its namespace, an inet-family nftables table whose
// chain, on the output hook before conntrack (priority raw), exempts from
// tracking the GRE packets it sends: those that carry one of the router's
// marks, which the encapsulated packet keeps (it was routed by it into its
// bucket's table). Nothing else is exempted.
package carrierexempt

import (
	"encoding/binary"
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nfttable"
)

// Table is the router's inet-family table; Chain its only chain. The
// agent's table (on the same node, when it runs a router and pods) is
// another.
const (
	Table = "kube-service-tunnel-carrier"
	Chain = "carrier"
	// version names the rule's shape; a table whose rule carries another
	// comment, or other marks, is replaced.
	version = "kube-service-tunnel: the router's GRE carrier untracked, v1"
)

// State is what a namespace holds of the table.
type State struct {
	// Present: a table of that name is there.
	Present bool
	// Current: it holds this version's chain and rule, for Block and Mask.
	Current     bool
	Block, Mask uint32
	// Exempted counts the packets the rule exempted (0 unless Current).
	Exempted uint64
}

func named() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyINet, Name: Table}
}

// Read reports the table's state in the namespace ns (netns.None(): the
// caller's own).
func Read(ns netns.NsHandle) (State, error) {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return State{}, err
	}
	var st State
	var rules []*nftables.Rule
	shape := nfttable.Shape{Family: nftables.TableFamilyINet, Table: Table, Chain: Chain,
		Hook: nftables.ChainHookOutput, Priority: nftables.ChainPriorityRaw, Rules: 1, Comment: version}
	if st.Present, rules, err = shape.Read(c); err != nil || rules == nil {
		return st, err
	}
	st.Exempted = nfttable.Packets(rules)
	var blockMask []uint32
	for _, e := range rules[0].Exprs {
		switch e := e.(type) {
		case *expr.Bitwise:
			if len(e.Mask) == 4 {
				blockMask = append(blockMask, binary.NativeEndian.Uint32(e.Mask))
			}
		case *expr.Cmp:
			if len(e.Data) == 4 {
				blockMask = append([]uint32{binary.NativeEndian.Uint32(e.Data)}, blockMask...)
			}
		}
	}
	if len(blockMask) != 2 {
		return st, nil
	}
	st.Current, st.Block, st.Mask = true, blockMask[0], blockMask[1]
	return st, nil
}

// Ensure makes the table hold the rule for the router's marks (block under
// mask) in one transaction, replacing a table of that name that holds
// anything else; it writes nothing when the table is current.
func Ensure(ns netns.NsHandle, block, mask uint32) (changed bool, err error) {
	st, err := Read(ns)
	if err != nil {
		return false, err
	}
	if st.Current && st.Block == block && st.Mask == mask {
		return false, nil
	}
	c, err := nfttable.Conn(ns)
	if err != nil {
		return false, err
	}
	t := named()
	if st.Present {
		c.DelTable(t)
	}
	c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{
		Name:     Chain,
		Table:    t,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookOutput,
		Priority: nftables.ChainPriorityRaw,
	})
	word := func(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }
	c.AddRule(&nftables.Rule{
		Table: t,
		Chain: ch,
		// meta l4proto gre meta mark & MASK == BLOCK counter notrack
		Exprs: []expr.Any{
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_GRE}},
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: word(mask), Xor: word(0)},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: word(block)},
			&expr.Counter{},
			&expr.Notrack{},
		},
		UserData: userdata.AppendString(nil, userdata.TypeComment, version),
	})
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("writing inet table %s (does the kernel have nf_tables and nft_ct for notrack?): %w", Table, err)
	}
	return true, nil
}

// Remove deletes the table if it is there.
func Remove(ns netns.NsHandle) error { return nfttable.Delete(ns, nftables.TableFamilyINet, Table) }
