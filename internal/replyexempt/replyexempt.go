// Package replyexempt keeps the pods' replies from their tunnel IPs out of
// the node's connection tracking.
//
// A client's packets reach a served pod inside the carrier (GRE to the pod
// IP, or MPLS), so the conntrack of the pod's node sees only the pod's
// replies, from the tunnel IP. Its first one, a SYN-ACK, opens no valid TCP
// connection: conntrack marks it INVALID, and kube-proxy's rule in the
// node's forward path (iptables mode, whose filter rules the IPVS mode
// shares: `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP`) drops
// it, unless the whole node is made liberal (conntrack.tcpBeLiberal); so
// do many hosts' own firewalls. So the agent keeps, in the node's namespace, an
// inet-family nftables table of its own whose chain, on the prerouting hook
// before conntrack (priority raw), exempts from tracking the packets that
// arrive on an interface towards a served pod with a source address among
// the tunnel IPs served on the node. Untracked packets are neither INVALID
// nor NEW, so no conntrack rule of kube-proxy, the network plugin or the
// node matches them, and they take no conntrack entry. Everything else is
// left alone.
package replyexempt

import (
	"bytes"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nfttable"
)

// Table is the agent's inet-family table; Chain its only chain.
const (
	Table = "kube-service-tunnel"
	Chain = "replies"
	// The sets: the served tunnel IPs of each family, and the interfaces
	// towards the served pods.
	setSources4 = "tunnel-ips-v4"
	setSources6 = "tunnel-ips-v6"
	setLinks    = "pod-links"
	// version names the rules' shape; a table whose rules carry another
	// comment is replaced.
	version = "kube-service-tunnel: replies from the served tunnel IPs untracked, v1"
)

// Want is what the table holds: the tunnel IPs served on the node and the
// interfaces towards their pods.
type Want struct {
	Sources []netip.Addr
	Links   []string
}

// Normalized returns w with its lists sorted and without duplicates.
func (w Want) Normalized() Want {
	out := Want{Sources: slices.Clone(w.Sources), Links: slices.Clone(w.Links)}
	slices.SortFunc(out.Sources, netip.Addr.Compare)
	out.Sources = slices.Compact(out.Sources)
	slices.Sort(out.Links)
	out.Links = slices.Compact(out.Links)
	return out
}

// Equal reports whether w and o hold the same (normalized) elements.
func (w Want) Equal(o Want) bool {
	a, b := w.Normalized(), o.Normalized()
	return slices.Equal(a.Sources, b.Sources) && slices.Equal(a.Links, b.Links)
}

// Empty: nothing is served, so there is no table.
func (w Want) Empty() bool { return len(w.Sources) == 0 || len(w.Links) == 0 }

// State is what the node holds of the table.
type State struct {
	// Present: the table exists.
	Present bool
	// Current: it has the chain and rules of this version; Have is then
	// what its sets hold.
	Current bool
	Have    Want
	// Exempted counts the packets the rules exempted (0 unless Current).
	Exempted uint64
}

func named(name string) *nftables.Table {
	return &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
}

// Read reports the table's state in the namespace ns.
func Read(ns netns.NsHandle) (State, error) {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return State{}, err
	}
	var st State
	var rules []*nftables.Rule
	shape := nfttable.Shape{Family: nftables.TableFamilyINet, Table: Table, Chain: Chain,
		Hook: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRaw, Rules: 2, Comment: version}
	if st.Present, rules, err = shape.Read(c); err != nil || rules == nil {
		return st, err
	}
	t := named(Table)
	var have Want
	for _, name := range []string{setSources4, setSources6, setLinks} {
		set, err := c.GetSetByName(t, name)
		if err != nil {
			return st, nil // not this version's table: replaced
		}
		elems, err := c.GetSetElements(set)
		if err != nil {
			return st, fmt.Errorf("listing the elements of inet %s set %s: %w", Table, name, err)
		}
		for _, e := range elems {
			if name == setLinks {
				have.Links = append(have.Links, string(bytes.TrimRight(e.Key, "\x00")))
			} else if a, ok := netip.AddrFromSlice(e.Key); ok {
				have.Sources = append(have.Sources, a)
			}
		}
	}
	st.Current, st.Have, st.Exempted = true, have.Normalized(), nfttable.Packets(rules)
	return st, nil
}

// Install makes the table hold exactly w, in one transaction: a table of
// that name already there is replaced (replace), so that no packet sees
// the table half written.
func Install(ns netns.NsHandle, w Want, replace bool) error {
	return install(ns, named(Table), w.Normalized(), replace)
}

// Probe writes a table of the same shape under the name name in the
// namespace ns, and removes it: it fails when the kernel cannot hold the
// table (no nf_tables, no inet family, no notrack). A kernel check calls
// it with a name of its own, never Table.
func Probe(ns netns.NsHandle, name string) error {
	if name == Table {
		return fmt.Errorf("reply exemption probe: %s is the agent's own table", name)
	}
	probe := Want{Sources: []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")}, Links: []string{"lo"}}
	if err := install(ns, named(name), probe, false); err != nil {
		return err
	}
	return nfttable.Delete(ns, nftables.TableFamilyINet, name)
}

func install(ns netns.NsHandle, t *nftables.Table, w Want, replace bool) error {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return err
	}
	if replace {
		c.DelTable(t)
	}
	c.AddTable(t)
	sets := map[string]*nftables.Set{}
	for _, s := range []struct {
		name string
		key  nftables.SetDatatype
	}{{setSources4, nftables.TypeIPAddr}, {setSources6, nftables.TypeIP6Addr}, {setLinks, nftables.TypeIFName}} {
		set := &nftables.Set{Table: t, Name: s.name, KeyType: s.key}
		if s.name == setLinks {
			// Interface names are strings in host order: without it, nft
			// list shows every element as "".
			set.KeyByteOrder = binaryutil.NativeEndian
		}
		var elems []nftables.SetElement
		switch s.name {
		case setLinks:
			for _, l := range w.Links {
				elems = append(elems, nftables.SetElement{Key: nfttable.IfName(l)})
			}
		default:
			for _, a := range w.Sources {
				if a.Is4() == (s.name == setSources4) {
					elems = append(elems, nftables.SetElement{Key: a.AsSlice()})
				}
			}
		}
		if err := c.AddSet(set, elems); err != nil {
			return fmt.Errorf("inet %s set %s: %w", t.Name, s.name, err)
		}
		sets[s.name] = set
	}
	ch := c.AddChain(&nftables.Chain{
		Name:     Chain,
		Table:    t,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookPrerouting,
		Priority: nftables.ChainPriorityRaw,
	})
	for _, fam := range []struct {
		proto  byte
		offset uint32
		len    uint32
		set    *nftables.Set
	}{{unix.NFPROTO_IPV4, 12, 4, sets[setSources4]}, {unix.NFPROTO_IPV6, 8, 16, sets[setSources6]}} {
		c.AddRule(&nftables.Rule{
			Table: t,
			Chain: ch,
			// meta nfproto FAMILY iifname @pod-links ip[6] saddr @tunnel-ips-vN counter notrack
			Exprs: []expr.Any{
				&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{fam.proto}},
				&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
				&expr.Lookup{SourceRegister: 1, SetName: setLinks, SetID: sets[setLinks].ID},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: fam.offset, Len: fam.len},
				&expr.Lookup{SourceRegister: 1, SetName: fam.set.Name, SetID: fam.set.ID},
				&expr.Counter{},
				&expr.Notrack{},
			},
			UserData: userdata.AppendString(nil, userdata.TypeComment, version),
		})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("writing inet table %s (does the kernel have nf_tables and nft_ct for notrack?): %w", t.Name, err)
	}
	return nil
}

// Remove deletes the table if it is there.
func Remove(ns netns.NsHandle) error { return nfttable.Delete(ns, nftables.TableFamilyINet, Table) }
