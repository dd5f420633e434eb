// Package bridgeguard keeps the pods' MPLS label off the node's bridges.
//
// In mpls mode a served pod accepts MPLS frames carrying PodLabel on its
// eth0 and pops them into its tunnel IP. The node sends it those frames (it
// swaps each router's per-endpoint label to PodLabel), but on a bridge
// plugin (cni0) another pod on the same node, with NET_RAW, can send the
// pod such a frame itself and speak to the tunnel IP with any client
// address. A frame the node routes to a pod leaves through the bridge's
// local output; a frame one pod sends another is bridged, and passes the
// bridge family's forward hook. So one rule in the node's namespace, in a
// bridge-family nftables table of the agent's own, drops bridged MPLS
// frames whose top label is PodLabel, and counts them. Frames with other
// labels, and everything else that crosses the bridge, are left alone.
//
// The source MAC address cannot tell the node's frames from a pod's (a pod
// with NET_RAW forges it, and the Linux bridge forwards a frame with its
// own address as source), which is why the guard sits on the bridge's
// forward path. Hosts on the node's own segment, which reach the node's
// MPLS input, remain trusted: that is mpls mode's L2 trust assumption
// (docs/security.md).
package bridgeguard

import (
	"encoding/binary"
	"fmt"
	"strconv"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nfttable"
)

// Table is the agent's bridge-family table; Chain its only chain, on the
// forward hook.
const (
	Table = "kube-service-tunnel"
	Chain = "forward"
)

// ethertypeMPLSUnicast is ETH_P_MPLS_UC.
const ethertypeMPLSUnicast = 0x8847

// State is what the node holds of the guard.
type State struct {
	// Present: the table exists.
	Present bool
	// Current: the table holds exactly the rule for the label asked about.
	Current bool
	// Dropped is the rule's packet counter (0 unless Current).
	Dropped uint64
}

// comment names the rule and the label it drops; a rule with another
// comment (another label, an older version) is replaced.
func comment(label uint32) string {
	return "kube-service-tunnel: bridged MPLS with the pods' label " + strconv.FormatUint(uint64(label), 10) + " dropped"
}

func table() *nftables.Table { return named(Table) }

func named(name string) *nftables.Table {
	return &nftables.Table{Name: name, Family: nftables.TableFamilyBridge}
}

// Read reports the guard's state in the namespace ns (netns.None(): the
// caller's) for label.
func Read(ns netns.NsHandle, label uint32) (State, error) {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return State{}, err
	}
	var st State
	var rules []*nftables.Rule
	shape := nfttable.Shape{Family: nftables.TableFamilyBridge, Table: Table, Chain: Chain,
		Hook: nftables.ChainHookForward, Rules: 1, Comment: comment(label)}
	if st.Present, rules, err = shape.Read(c); err != nil || rules == nil {
		return st, err
	}
	st.Current, st.Dropped = true, nfttable.Packets(rules)
	return st, nil
}

// Install makes the table hold exactly the rule for label, in one
// transaction: a table of that name already there is replaced.
func Install(ns netns.NsHandle, label uint32, replace bool) error {
	return install(ns, table(), label, replace)
}

// Probe writes the guard's table, chain and rule under the table name
// name in the namespace ns, and removes them: it fails when the kernel
// cannot hold the guard (no nf_tables, no bridge family). A kernel check
// calls it with a name of its own, never Table.
func Probe(ns netns.NsHandle, name string) error {
	if name == Table {
		return fmt.Errorf("bridge guard probe: %s is the guard's own table", name)
	}
	if err := install(ns, named(name), 100, false); err != nil {
		return err
	}
	return nfttable.Delete(ns, nftables.TableFamilyBridge, name)
}

func install(ns netns.NsHandle, t *nftables.Table, label uint32, replace bool) error {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return err
	}
	if replace {
		c.DelTable(t)
	}
	c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{
		Name:     Chain,
		Table:    t,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookForward,
		Priority: nftables.ChainPriorityFilter,
	})
	c.AddRule(&nftables.Rule{
		Table:    t,
		Chain:    ch,
		Exprs:    ruleExprs(label),
		UserData: userdata.AppendString(nil, userdata.TypeComment, comment(label)),
	})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("adding bridge table %s (does the kernel have nf_tables with the bridge family?): %w", t.Name, err)
	}
	return nil
}

// Remove deletes the table if it is there.
func Remove(ns netns.NsHandle) error { return nfttable.Delete(ns, nftables.TableFamilyBridge, Table) }

// ruleExprs is `ether type 0x8847 @nh,0,20 == label counter drop`: the
// top label is the first 20 bits of the MPLS header, which follows the
// Ethernet header. The Ethernet type is read from the frame: `meta
// protocol` in the bridge family needs the module nft_meta_bridge, which a
// kernel such as Debian 12's does not load by itself.
func ruleExprs(label uint32) []expr.Any {
	proto := binary.BigEndian.AppendUint16(nil, ethertypeMPLSUnicast)
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: proto},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 0, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: []byte{0xff, 0xff, 0xf0, 0x00}, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint32(nil, label<<12)},
		&expr.Counter{},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}
}
