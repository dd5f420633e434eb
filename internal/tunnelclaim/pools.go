package tunnelclaim

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// PoolsFlag names the setting of the address pools in messages, so that an
// operator reading a refusal knows what to change.
const PoolsFlag = "--pools"

// Pool is a range of tunnel IPs that Services may claim, optionally only
// Services of some namespaces.
type Pool struct {
	Prefix netip.Prefix
	// Namespaces limits the pool to Services of these namespaces, sorted;
	// empty means every namespace.
	Namespaces []string
}

// String renders the pool in the syntax ParsePools reads.
func (p Pool) String() string {
	if len(p.Namespaces) == 0 {
		return p.Prefix.String()
	}
	return p.Prefix.String() + "=" + strings.Join(p.Namespaces, ",")
}

// allows reports whether a Service of namespace may use the pool.
func (p Pool) allows(namespace string) bool {
	return len(p.Namespaces) == 0 || slices.Contains(p.Namespaces, namespace)
}

// Pools are the address pools tunnel IPs are served from. No pool: nothing
// is served. Pools never overlap each other or a reserved range (ParsePools
// refuses both), so a tunnel IP is in at most one pool.
type Pools []Pool

// String renders the pools in the syntax ParsePools reads.
func (ps Pools) String() string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.String()
	}
	return strings.Join(parts, ";")
}

// reservedRange is a range no tunnel IP may come from.
type reservedRange struct {
	prefix netip.Prefix
	what   string
}

// reserved are the ranges that cannot be routed to a Service (RFC 6890 and
// its IPv6 registry). The documentation ranges (192.0.2.0/24,
// 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32) are not among them: the
// examples, the demo and the lab use them. Nor are the IPv6 unique local
// addresses (fc00::/7): an on-premises network routes them like any other,
// as it does 10.0.0.0/8.
var reserved = []reservedRange{
	{netip.MustParsePrefix("0.0.0.0/8"), `"this network"`},
	{netip.MustParsePrefix("127.0.0.0/8"), "loopback"},
	{netip.MustParsePrefix("169.254.0.0/16"), "link-local"},
	{netip.MustParsePrefix("192.0.0.0/24"), "IETF protocol assignments"},
	{netip.MustParsePrefix("224.0.0.0/4"), "multicast"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved for future use, and the broadcast address"},
	{netip.MustParsePrefix("::/8"), "reserved by the IETF: unspecified, loopback, IPv4-mapped and IPv4-compatible addresses"},
	{netip.MustParsePrefix("100::/64"), "discard-only"},
	{netip.MustParsePrefix("2001::/23"), "IETF protocol assignments"},
	{netip.MustParsePrefix("fe80::/10"), "link-local"},
	{netip.MustParsePrefix("fec0::/10"), "deprecated site-local"},
	{netip.MustParsePrefix("ff00::/8"), "multicast"},
}

// ParsePools reads the address pools: entries separated by ";" (or new
// lines), each a CIDR or a single address, IPv4 or IPv6, optionally
// followed by "=" and a comma-separated list of the namespaces that may use
// it:
//
//	192.0.2.0/24;203.0.113.0/28=team-a,team-b;2001:db8:5::/64
//
// Blanks around entries and names are ignored. Refused, with an error naming
// the pool: an IPv4-mapped IPv6 range (write it as IPv4), a zone, a CIDR
// with host bits set, an empty or
// invalid namespace list, a pool overlapping a reserved range (loopback,
// link-local, multicast, ...), and two pools that overlap. An empty value is
// no pool at all.
func ParsePools(value string) (Pools, error) {
	var pools Pools
	var errs []error
	entries := strings.FieldsFunc(value, func(r rune) bool { return r == ';' || r == '\n' })
	for _, entry := range entries {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		p, err := parsePool(entry)
		if err != nil {
			errs = append(errs, fmt.Errorf("pool %q: %w", entry, err))
			continue
		}
		for _, q := range pools {
			if q.Prefix.Overlaps(p.Prefix) {
				errs = append(errs, fmt.Errorf("pool %q overlaps pool %q: pools must not overlap", entry, q.String()))
			}
		}
		pools = append(pools, p)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return pools, nil
}

func parsePool(entry string) (Pool, error) {
	cidr, nsList, limited := strings.Cut(entry, "=")
	cidr = strings.TrimSpace(cidr)
	var p Pool
	if strings.Contains(cidr, "/") {
		prefix, err := netip.ParsePrefix(cidr)
		if err != nil {
			return Pool{}, fmt.Errorf("not a CIDR (expected e.g. 192.0.2.0/24 or 2001:db8:5::/64): %w", err)
		}
		if prefix != prefix.Masked() {
			return Pool{}, fmt.Errorf("host bits are set: write %v", prefix.Masked())
		}
		p.Prefix = prefix
	} else {
		ip, err := netip.ParseAddr(cidr)
		if err != nil {
			return Pool{}, fmt.Errorf("not a CIDR or an address (expected e.g. 192.0.2.0/24): %w", err)
		}
		p.Prefix = netip.PrefixFrom(ip, ip.BitLen())
	}
	if p.Prefix.Addr().Zone() != "" {
		return Pool{}, errors.New("has a zone: write the range alone")
	}
	if p.Prefix.Addr().Is4In6() {
		return Pool{}, errors.New("is IPv4-mapped IPv6: write the range as IPv4")
	}
	for _, r := range reserved {
		if r.prefix.Overlaps(p.Prefix) {
			return Pool{}, fmt.Errorf("overlaps the reserved range %v (%s), which is never served", r.prefix, r.what)
		}
	}
	if limited {
		for _, ns := range strings.Split(nsList, ",") {
			ns = strings.TrimSpace(ns)
			if ns == "" {
				return Pool{}, errors.New(`empty namespace in the list after "=" (expected e.g. =team-a,team-b; leave out "=" for every namespace)`)
			}
			if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
				return Pool{}, fmt.Errorf("namespace %q is not a valid namespace name: %s", ns, strings.Join(msgs, "; "))
			}
			if !slices.Contains(p.Namespaces, ns) {
				p.Namespaces = append(p.Namespaces, ns)
			}
		}
		slices.Sort(p.Namespaces)
	}
	return p, nil
}

// ParseCIDRs reads a comma-separated list of CIDRs, IPv4 or IPv6 (the
// --pod-cidr and --service-cidr flags).
func ParseCIDRs(value string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range strings.Split(value, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		prefix, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR: %w", s, err)
		}
		out = append(out, prefix.Masked())
	}
	return out, nil
}

// JoinCIDRs renders prefixes as ParseCIDRs reads them.
func JoinCIDRs(ps []netip.Prefix) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.String()
	}
	return strings.Join(parts, ",")
}

// Network is a range the cluster uses, and where it is known from.
type Network struct {
	Prefix netip.Prefix
	// Source says where the range comes from, e.g. "Node n1 spec.podCIDRs"
	// or "--pod-cidr".
	Source string
}

// Networks are the addresses a tunnel IP must never take because the
// cluster itself uses them. Build them with KnownNetworks.
type Networks struct {
	// NodeAddresses maps every InternalIP and ExternalIP of every Node, of
	// either family, to the Node's name.
	NodeAddresses map[netip.Addr]string
	// PodCIDRs are the Nodes' pod ranges and those of --pod-cidr.
	PodCIDRs []Network
	// ServiceCIDRs are the ranges of --service-cidr.
	ServiceCIDRs []Network
}

// Equal reports whether two Networks hold the same ranges and addresses.
func (n Networks) Equal(o Networks) bool {
	if len(n.NodeAddresses) != len(o.NodeAddresses) {
		return false
	}
	for a, name := range n.NodeAddresses {
		if other, ok := o.NodeAddresses[a]; !ok || other != name {
			return false
		}
	}
	return slices.Equal(n.PodCIDRs, o.PodCIDRs) && slices.Equal(n.ServiceCIDRs, o.ServiceCIDRs)
}

// KnownNetworks collects the Nodes' addresses (InternalIP and ExternalIP,
// of either family) and pod ranges (spec.podCIDRs and spec.podCIDR), plus the
// ranges the flags name. The answer does not depend on the Nodes' order.
func KnownNetworks(nodes []*corev1.Node, podCIDRs, serviceCIDRs []netip.Prefix) Networks {
	n := Networks{NodeAddresses: map[netip.Addr]string{}}
	for _, node := range nodes {
		for _, a := range node.Status.Addresses {
			if a.Type != corev1.NodeInternalIP && a.Type != corev1.NodeExternalIP {
				continue
			}
			ip, err := netip.ParseAddr(a.Address)
			if err != nil || ip.Zone() != "" {
				continue
			}
			ip = ip.Unmap()
			if other, ok := n.NodeAddresses[ip]; !ok || node.Name < other {
				n.NodeAddresses[ip] = node.Name
			}
		}
		cidrs := node.Spec.PodCIDRs
		if node.Spec.PodCIDR != "" && !slices.Contains(cidrs, node.Spec.PodCIDR) {
			cidrs = append(slices.Clip(cidrs), node.Spec.PodCIDR)
		}
		for _, s := range cidrs {
			if prefix, err := netip.ParsePrefix(s); err == nil {
				n.PodCIDRs = append(n.PodCIDRs, Network{Prefix: prefix.Masked(), Source: "Node " + node.Name + " spec.podCIDRs"})
			}
		}
	}
	for _, p := range podCIDRs {
		n.PodCIDRs = append(n.PodCIDRs, Network{Prefix: p, Source: "--pod-cidr"})
	}
	for _, p := range serviceCIDRs {
		n.ServiceCIDRs = append(n.ServiceCIDRs, Network{Prefix: p, Source: "--service-cidr"})
	}
	byRange := func(a, b Network) int {
		return cmp.Or(a.Prefix.Addr().Compare(b.Prefix.Addr()), cmp.Compare(a.Prefix.Bits(), b.Prefix.Bits()), strings.Compare(a.Source, b.Source))
	}
	slices.SortFunc(n.PodCIDRs, byRange)
	slices.SortFunc(n.ServiceCIDRs, byRange)
	return n
}

// Admit decides whether a Service of namespace may have tunnel IP ip. It is
// a pure function of its arguments, so the routers and the endpoint agents
// decide alike. Refused, in this order: every IP when no pool is configured;
// a reserved range; the address of a Node; an IP inside a pod or service
// range; an IP in no pool; an IP in a pool limited to other namespaces. The
// error says why in words meant for the Service's owner.
func (ps Pools) Admit(ip netip.Addr, namespace string, known Networks) error {
	if len(ps) == 0 {
		return fmt.Errorf("tunnel IP %v is not served: no address pool is configured (%s)", ip, PoolsFlag)
	}
	if ip.Is4In6() || ip.Zone() != "" || !ip.IsValid() {
		return fmt.Errorf("tunnel IP %v is not a plain IPv4 or IPv6 address", ip)
	}
	for _, r := range reserved {
		if r.prefix.Contains(ip) {
			return fmt.Errorf("tunnel IP %v is in the reserved range %v (%s)", ip, r.prefix, r.what)
		}
	}
	if node, ok := known.NodeAddresses[ip]; ok {
		return fmt.Errorf("tunnel IP %v is the address of Node %s", ip, node)
	}
	for _, n := range known.PodCIDRs {
		if n.Prefix.Contains(ip) {
			return fmt.Errorf("tunnel IP %v is inside the pod network %v (%s)", ip, n.Prefix, n.Source)
		}
	}
	for _, n := range known.ServiceCIDRs {
		if n.Prefix.Contains(ip) {
			return fmt.Errorf("tunnel IP %v is inside the service network %v (%s)", ip, n.Prefix, n.Source)
		}
	}
	for _, p := range ps {
		if !p.Prefix.Contains(ip) {
			continue
		}
		if !p.allows(namespace) {
			return fmt.Errorf("tunnel IP %v is in address pool %v, which only namespaces %s may use, not %s",
				ip, p.Prefix, strings.Join(p.Namespaces, ", "), namespace)
		}
		return nil
	}
	return fmt.Errorf("tunnel IP %v is in no address pool (%s %s)", ip, PoolsFlag, ps)
}

// Policy is the admission configuration every router and endpoint agent
// must share: the pools, and the cluster's ranges the flags name.
type Policy struct {
	Pools Pools
	// PodCIDRs (--pod-cidr) add to the Nodes' spec.podCIDRs.
	PodCIDRs []netip.Prefix
	// ServiceCIDRs (--service-cidr) are the cluster's Service ranges.
	ServiceCIDRs []netip.Prefix
}

// Equal reports whether p and q admit the same claims: the same pools (as
// --pools renders them) and the same ranges.
func (p Policy) Equal(q Policy) bool {
	return p.Pools.String() == q.Pools.String() && slices.Equal(p.PodCIDRs, q.PodCIDRs) && slices.Equal(p.ServiceCIDRs, q.ServiceCIDRs)
}

// Networks returns the ranges a tunnel IP must not take, given the Nodes.
func (p Policy) Networks(nodes []*corev1.Node) Networks {
	return KnownNetworks(nodes, p.PodCIDRs, p.ServiceCIDRs)
}

// Contains reports whether ip lies in one of the pools, whichever
// namespaces the pool allows.
func (ps Pools) Contains(ip netip.Addr) bool {
	for _, p := range ps {
		if p.Prefix.Contains(ip) {
			return true
		}
	}
	return false
}
