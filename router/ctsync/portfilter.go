package ctsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nfttable"
)

// conntrackd (1.4.7) receives the sync messages on a UDP socket bound to
// 0.0.0.0 at the group's port: besides the multicast of the sync link, it
// takes the port's datagrams sent to any of the node's addresses, from any
// interface, and multicast to a group every interface joins (224.0.0.1),
// and writes the entries they carry into the kernel table, marks included,
// without authentication (router/ctsync's privileged tests send each). So
// the router keeps, in its namespace, an ip-family nftables table of its
// own whose chain, on the input hook, accepts the port's datagrams that
// arrive on the sync link from the other routers (PortFilter.Peers; from
// anyone on the link without them) and drops the rest of the port's
// datagrams. Forwarded traffic (the tunnel's clients) passes the forward
// hook, not input, and so is never matched. conntrackd's sockets are IPv4
// only (AF_INET), which no IPv6 datagram reaches: IPv6 needs no rule.

// PortFilterTable is the router's ip-family table guarding conntrackd's
// port; PortFilterChain its only chain.
const (
	PortFilterTable = "kube-service-tunnel-ctsync"
	PortFilterChain = "sync-port"
	// portFilterVersion starts each rule's comment, which names the rule;
	// a table whose rules carry other comments is replaced.
	portFilterVersion = "kube-service-tunnel: conntrackd's sync port, v1: "
)

// PortFilter is what the filter of conntrackd's port lets in: the group's
// UDP port on Interface, from Peers (from any source when Peers is empty).
type PortFilter struct {
	Interface string
	Group     int
	Peers     []netip.Prefix
}

// PortRule is one rule of the chain, as data: the group's UDP datagrams
// that arrive on Interface (any interface when empty) from Source (any
// source when not valid) are accepted, or dropped.
type PortRule struct {
	Group     int
	Interface string
	Source    netip.Prefix
	Accept    bool
}

// String is the rule as nft lists it.
func (r PortRule) String() string {
	var b strings.Builder
	if r.Interface != "" {
		fmt.Fprintf(&b, "iifname %q ", r.Interface)
	}
	if r.Source.IsValid() {
		if r.Source.IsSingleIP() {
			fmt.Fprintf(&b, "ip saddr %s ", r.Source.Addr())
		} else {
			fmt.Fprintf(&b, "ip saddr %s ", r.Source)
		}
	}
	verdict := "drop"
	if r.Accept {
		verdict = "accept"
	}
	fmt.Fprintf(&b, "udp dport %d counter %s", r.Group, verdict)
	return b.String()
}

// Rules returns the chain's rules, in order: one accept for each peer on
// the interface (one for the interface alone without peers), then the drop
// of every other datagram to the port.
func (f PortFilter) Rules() []PortRule {
	var rules []PortRule
	peers := normalizedPeers(f.Peers)
	if len(peers) == 0 {
		rules = append(rules, PortRule{Group: f.Group, Interface: f.Interface, Accept: true})
	}
	for _, p := range peers {
		rules = append(rules, PortRule{Group: f.Group, Interface: f.Interface, Source: p, Accept: true})
	}
	return append(rules, PortRule{Group: f.Group})
}

// Validate reports the first setting the filter cannot hold, naming the
// flag an operator sets.
func (f PortFilter) Validate() error {
	switch {
	case f.Interface == "":
		return errors.New("--conntrack-sync-interface is empty")
	case len(f.Interface) >= unix.IFNAMSIZ:
		return fmt.Errorf("--conntrack-sync-interface %q: longer than %d characters, not an interface name", f.Interface, unix.IFNAMSIZ-1)
	case f.Group <= 0 || f.Group > 65535:
		return fmt.Errorf("--conntrack-sync-group %d: want a UDP port, 1-65535", f.Group)
	}
	for _, p := range f.Peers {
		if !p.IsValid() || !p.Addr().Is4() {
			return fmt.Errorf("--conntrack-sync-peers %s: not an IPv4 address or CIDR (conntrackd's sync here is IPv4)", p)
		}
	}
	return nil
}

// comments are the rules' comments, each naming its rule.
func (f PortFilter) comments() []string {
	rules := f.Rules()
	out := make([]string, len(rules))
	for i, r := range rules {
		out[i] = portFilterVersion + r.String()
	}
	return out
}

// normalizedPeers is peers masked, sorted and without duplicates.
func normalizedPeers(peers []netip.Prefix) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(peers))
	for _, p := range peers {
		out = append(out, p.Masked())
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if n := a.Addr().Compare(b.Addr()); n != 0 {
			return n
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(out)
}

// ParsePeers parses --conntrack-sync-peers: IPv4 addresses or CIDRs,
// separated by commas (blanks around each allowed); the empty string is no
// peer.
func ParsePeers(s string) ([]netip.Prefix, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []netip.Prefix
	for _, field := range strings.Split(s, ",") {
		field = strings.TrimSpace(field)
		if field == "" {
			return nil, fmt.Errorf("%q: an empty element (want IPv4 addresses or CIDRs separated by commas)", s)
		}
		var p netip.Prefix
		if strings.Contains(field, "/") {
			var err error
			if p, err = netip.ParsePrefix(field); err != nil {
				return nil, fmt.Errorf("%q: not an IPv4 address or CIDR", field)
			}
			if p != p.Masked() {
				return nil, fmt.Errorf("%q: host bits set (the network is %s)", field, p.Masked())
			}
		} else {
			a, err := netip.ParseAddr(field)
			if err != nil {
				return nil, fmt.Errorf("%q: not an IPv4 address or CIDR", field)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if !p.Addr().Is4() {
			return nil, fmt.Errorf("%q: not IPv4 (conntrackd's sync messages here are IPv4)", field)
		}
		out = append(out, p)
	}
	return normalizedPeers(out), nil
}

// PortFilterState is what a namespace holds of the table.
type PortFilterState struct {
	// Present: a table of that name is there.
	Present bool
	// Current: it holds exactly the rules of the filter asked for (Read:
	// the rules of some filter of this version).
	Current bool
	// Rules are the rules' comments, without the version (Current only).
	Rules []string
	// Accepted and Dropped count the port's datagrams the rules accepted
	// and dropped since the table was written (Current only).
	Accepted, Dropped uint64
}

func portFilterTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: PortFilterTable}
}

// readPortFilter reads the table, current when its rules are want's (when
// want is nil, when they are any rules of this version).
func readPortFilter(c *nftables.Conn, want []string) (PortFilterState, error) {
	var st PortFilterState
	present, chains, err := nfttable.Chains(c, nftables.TableFamilyIPv4, PortFilterTable)
	st.Present = present
	if err != nil || !present {
		return st, err
	}
	if want == nil {
		if len(chains) != 1 || chains[0].Name != PortFilterChain {
			return st, nil
		}
		rules, err := c.GetRules(portFilterTable(), chains[0])
		if err != nil {
			return st, fmt.Errorf("listing the rules of ip %s %s: %w", PortFilterTable, PortFilterChain, err)
		}
		for _, r := range rules {
			got, _ := userdata.GetString(r.UserData, userdata.TypeComment)
			if !strings.HasPrefix(got, portFilterVersion) {
				return st, nil
			}
			want = append(want, got)
		}
		if want == nil {
			return st, nil
		}
	}
	shape := nfttable.Shape{Family: nftables.TableFamilyIPv4, Table: PortFilterTable, Chain: PortFilterChain,
		Hook: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Comments: want}
	_, rules, err := shape.Read(c)
	if err != nil || rules == nil {
		return st, err
	}
	st.Current = true
	for i, r := range rules {
		st.Rules = append(st.Rules, strings.TrimPrefix(want[i], portFilterVersion))
		if packets := nfttable.Packets([]*nftables.Rule{r}); strings.HasSuffix(want[i], " accept") {
			st.Accepted += packets
		} else {
			st.Dropped += packets
		}
	}
	return st, nil
}

// ReadPortFilter reports the table's state in the namespace ns
// (netns.None(): the caller's own).
func ReadPortFilter(ns netns.NsHandle) (PortFilterState, error) {
	c, err := nfttable.Conn(ns)
	if err != nil {
		return PortFilterState{}, err
	}
	return readPortFilter(c, nil)
}

// EnsurePortFilter makes the namespace ns hold the table of f, in one
// transaction that replaces a table of that name holding anything else
// (no datagram sees it half written, nor the port unguarded); it writes
// nothing when the table is current, whose counters then go on. It returns
// the table's state (the counters of the table it found current, zero
// after a write) and whether it wrote.
func EnsurePortFilter(ns netns.NsHandle, f PortFilter) (PortFilterState, bool, error) {
	if err := f.Validate(); err != nil {
		return PortFilterState{}, false, err
	}
	c, err := nfttable.Conn(ns)
	if err != nil {
		return PortFilterState{}, false, err
	}
	want := f.comments()
	st, err := readPortFilter(c, want)
	if err != nil {
		return st, false, err
	}
	if st.Current {
		return st, false, nil
	}
	t := portFilterTable()
	if st.Present {
		c.DelTable(t)
	}
	c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{
		Name:     PortFilterChain,
		Table:    t,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookInput,
		Priority: nftables.ChainPriorityFilter,
	})
	for i, r := range f.Rules() {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs(), UserData: userdata.AppendString(nil, userdata.TypeComment, want[i])})
	}
	if err := c.Flush(); err != nil {
		return PortFilterState{}, false, fmt.Errorf("writing ip table %s, the filter of conntrackd's port (does the kernel have nf_tables?): %w", PortFilterTable, err)
	}
	rules := make([]string, len(want))
	for i, w := range want {
		rules[i] = strings.TrimPrefix(w, portFilterVersion)
	}
	return PortFilterState{Present: true, Current: true, Rules: rules}, true, nil
}

// exprs is the rule in nftables' expressions:
//
//	meta l4proto udp [iifname IFACE] [ip saddr & MASK == NET] udp dport GROUP counter accept|drop
func (r PortRule) exprs() []expr.Any {
	out := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
	}
	if r.Interface != "" {
		out = append(out,
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: nfttable.IfName(r.Interface)})
	}
	if r.Source.IsValid() {
		p := r.Source.Masked()
		out = append(out, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4})
		if p.Bits() < 32 {
			mask := binary.BigEndian.AppendUint32(nil, ^uint32(0)<<(32-p.Bits()))
			out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}})
		}
		out = append(out, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()})
	}
	verdict := expr.VerdictDrop
	if r.Accept {
		verdict = expr.VerdictAccept
	}
	return append(out,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, uint16(r.Group))},
		&expr.Counter{},
		&expr.Verdict{Kind: verdict})
}

// RemovePortFilter deletes the table if it is there.
func RemovePortFilter(ns netns.NsHandle) error {
	return nfttable.Delete(ns, nftables.TableFamilyIPv4, PortFilterTable)
}
