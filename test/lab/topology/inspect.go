package topology

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
)

// HMARK returns the routers' HMARK parameters, to compute a flow's bucket.
func (l *Lab) HMARK() hmark.Params {
	return hmark.Params{Buckets: uint32(l.Opts.Buckets), Offset: datapath.DefaultMarkOffset, Seed: l.Opts.Seed}
}

// A router's bucket route for a tunnel IP in `ip route show table all`
// output, which repeats its nexthop object's encapsulation: GRE "VIP nhid ID
// encap ip id 0 src 0.0.0.0 dst POD ... table T" (IPv6: "encap ip6 ... dst
// POD6"), MPLS "VIP encap mpls LABEL via NODE dev eth0 table T"; a node's
// swap route "LABEL as to 100 via inet POD dev cni0" (IPv6: "via inet6
// POD6").
var (
	greDstRE   = regexp.MustCompile(`encap ip6? .*\bdst (\S+)`)
	mplsEncRE  = regexp.MustCompile(`encap mpls\s+(\d+)\S*\s+via (?:inet6? )?(\S+)`)
	tableRE    = regexp.MustCompile(`\btable (\d+)\b`)
	mplsSwapRE = regexp.MustCompile(`^(\d+) as to \S+ via inet6? (\S+)`)
)

// FamilyArgs is the ip option selecting a's family: none for IPv4, "-6"
// for IPv6.
func FamilyArgs(a netip.Addr) []string {
	if a.Is4() {
		return nil
	}
	return []string{"-6"}
}

// HostPrefix is a's host prefix as ip prints it: "192.0.2.1/32",
// "2001:db8::1/128".
func HostPrefix(a netip.Addr) string { return netip.PrefixFrom(a, a.BitLen()).String() }

// PodAddr is the pod's address of vip's family: an IPv6 tunnel IP is
// carried to the pods' IPv6 addresses.
func PodAddr(p *Pod, vip netip.Addr) netip.Addr {
	if vip.Is4() {
		return p.Addr
	}
	return p.Addr6
}

// NodeAddrFor is node n's fabric address of vip's family: a router's next
// hop for vip, on the gateway's routes and in its BGP announcements.
func NodeAddrFor(n *Node, vip netip.Addr) netip.Addr {
	if vip.Is4() {
		return n.Addr
	}
	return n.Addr6
}

// ClientAddrFor is the client's address of vip's family.
func ClientAddrFor(vip netip.Addr) netip.Addr {
	if vip.Is4() {
		return ClientAddr
	}
	return ClientAddr6
}

// BucketTable reads the router's kernel state for vip and returns, for each
// bucket of the tunnel IP's current generation (the one its HMARK rule
// marks new flows for), the pod the kernel sends that bucket's flows to (the
// zero Addr where the bucket has no route). In MPLS mode the label is
// resolved to the pod through the node's swap route.
func (l *Lab) BucketTable(ctx context.Context, r *Node, vip netip.Addr) ([]netip.Addr, error) {
	gen, err := l.CurrentGeneration(ctx, r, vip)
	if err != nil {
		return nil, err
	}
	return l.GenerationTable(ctx, r, vip, gen)
}

// GenerationTable is BucketTable for one routing generation of the router,
// current or not: the tables TableBase + gen*Buckets + bucket.
func (l *Lab) GenerationTable(ctx context.Context, r *Node, vip netip.Addr, gen int) ([]netip.Addr, error) {
	routes, err := l.bucketRoutes(ctx, r, vip)
	if err != nil {
		return nil, err
	}
	table := make([]netip.Addr, l.Opts.Buckets)
	swaps := map[netip.Addr]map[string]netip.Addr{} // node -> label -> pod
	for slot, line := range routes {
		if slot.gen != gen {
			continue
		}
		bucket := slot.bucket
		var pod netip.Addr
		if m := greDstRE.FindStringSubmatch(line); m != nil {
			pod, err = netip.ParseAddr(m[1])
		} else if m := mplsEncRE.FindStringSubmatch(line); m != nil {
			node, perr := netip.ParseAddr(m[2])
			if perr != nil {
				return nil, fmt.Errorf("%s: MPLS route %q: %w", r.Name, line, perr)
			}
			if swaps[node] == nil {
				if swaps[node], err = l.mplsSwaps(ctx, node); err != nil {
					return nil, err
				}
			}
			var ok bool
			if pod, ok = swaps[node][m[1]]; !ok {
				return nil, fmt.Errorf("%s: generation %d bucket %d label %s has no swap route on node %s", r.Name, gen, bucket, m[1], node)
			}
		} else {
			return nil, fmt.Errorf("%s: unexpected route for %s: %q", r.Name, vip, line)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: route %q: %w", r.Name, line, err)
		}
		table[bucket] = pod
	}
	return table, nil
}

// Generations returns, sorted, the routing generations in which the router
// holds at least one route for vip: the current one, and older ones that
// established flows still use until the router collects them.
func (l *Lab) Generations(ctx context.Context, r *Node, vip netip.Addr) ([]int, error) {
	routes, err := l.bucketRoutes(ctx, r, vip)
	if err != nil {
		return nil, err
	}
	var gens []int
	for slot := range routes {
		if !slices.Contains(gens, slot.gen) {
			gens = append(gens, slot.gen)
		}
	}
	slices.Sort(gens)
	return gens, nil
}

// CurrentGeneration returns the routing generation the router's HMARK rule
// for vip marks new flows for: (--hmark-offset - MarkOffset) / Buckets. It
// fails when the router has no HMARK rule for vip.
func (l *Lab) CurrentGeneration(ctx context.Context, r *Node, vip netip.Addr) (int, error) {
	offset, ok, err := l.hmarkOffset(ctx, r, vip)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, fmt.Errorf("%s has no HMARK rule for %s", r.Name, vip)
	}
	return generationOf(offset, datapath.DefaultMarkOffset, l.Opts.Buckets)
}

// TableOf is the routing table of bucket in generation gen.
func (l *Lab) TableOf(gen, bucket int) int {
	return datapath.DefaultTableBase + gen*l.Opts.Buckets + bucket
}

// generationOf turns an HMARK offset into its generation.
func generationOf(offset, markOffset uint32, buckets int) (int, error) {
	if offset < markOffset || int(offset-markOffset)%buckets != 0 {
		return 0, fmt.Errorf("HMARK offset %#x is not %#x plus a multiple of %d buckets", offset, markOffset, buckets)
	}
	return int(offset-markOffset) / buckets, nil
}

// slot is where a bucket route lives: generation and bucket.
type slot struct{ gen, bucket int }

// slotOf places a routing table of the router's range, if it is one.
func slotOf(table, tableBase, buckets int) (slot, bool) {
	if table < tableBase {
		return slot{}, false
	}
	return slot{gen: (table - tableBase) / buckets, bucket: (table - tableBase) % buckets}, true
}

// bucketRoutes returns the router's route lines for vip by generation and
// bucket, in every generation.
func (l *Lab) bucketRoutes(ctx context.Context, r *Node, vip netip.Addr) (map[slot]string, error) {
	out, err := IP(ctx, append(append([]string{"-n", r.Name}, FamilyArgs(vip)...), "route", "show", "table", "all", "proto", "245")...)
	if err != nil {
		return nil, err
	}
	routes := map[slot]string{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || (f[0] != vip.String() && f[0] != HostPrefix(vip)) {
			continue
		}
		tm := tableRE.FindStringSubmatch(line)
		if tm == nil {
			continue
		}
		t, _ := strconv.Atoi(tm[1])
		if s, ok := slotOf(t, datapath.DefaultTableBase, l.Opts.Buckets); ok {
			routes[s] = line
		}
	}
	return routes, nil
}

// mplsSwaps reads the worker's MPLS swap routes: label -> pod.
func (l *Lab) mplsSwaps(ctx context.Context, nodeAddr netip.Addr) (map[string]netip.Addr, error) {
	var node *Node
	for _, w := range l.Workers {
		if w.Addr == nodeAddr || w.Addr6 == nodeAddr {
			node = w
		}
	}
	if node == nil {
		return nil, fmt.Errorf("no worker has address %s", nodeAddr)
	}
	out, err := IP(ctx, "-n", node.Name, "-f", "mpls", "route", "show")
	if err != nil {
		return nil, err
	}
	swaps := map[string]netip.Addr{}
	for _, line := range strings.Split(out, "\n") {
		if m := mplsSwapRE.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			if a, err := netip.ParseAddr(m[2]); err == nil {
				swaps[m[1]] = a
			}
		}
	}
	return swaps, nil
}

// PodHasAddr reports whether the pod's namespace holds addr (a host
// address: /32 or /128). It asks netlink in the pod's namespace, not ip:
// the lab's waits call it for every pod several times a second, and each
// ip process costs the emulated VM far more than a netlink dump.
func PodHasAddr(ctx context.Context, p *Pod, addr netip.Addr) (bool, error) {
	ns, err := p.NS()
	if err != nil {
		return false, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE) // the VM's kernel has no XFRM
	if err != nil {
		return false, fmt.Errorf("netlink in %s: %w", p.Name, err)
	}
	defer h.Close()
	family := netlink.FAMILY_V4
	if addr.Is6() {
		family = netlink.FAMILY_V6
	}
	addrs, err := h.AddrList(nil, family)
	if err != nil {
		return false, fmt.Errorf("addresses of %s: %w", p.Name, err)
	}
	for _, a := range addrs {
		ones, bits := a.Mask.Size()
		if got, ok := netip.AddrFromSlice(a.IP); ok && got.Unmap() == addr && ones == bits && bits == addr.BitLen() {
			return true, nil
		}
	}
	return false, nil
}

// WaitTunnel waits (up to a minute, or ctx) until every router sends every
// bucket of vip to one of pods (their addresses of vip's family), together
// using exactly those pods, both routers agree, and each of pods holds vip.
// It returns the bucket table.
func (l *Lab) WaitTunnel(ctx context.Context, vip netip.Addr, pods ...*Pod) ([]netip.Addr, error) {
	want := make([]netip.Addr, len(pods))
	for i, p := range pods {
		want[i] = PodAddr(p, vip)
	}
	slices.SortFunc(want, func(a, b netip.Addr) int { return a.Compare(b) })
	var table []netip.Addr
	err := l.poll(ctx, time.Minute, func() (bool, string, error) {
		// The pods first: a netlink dump each, where a router's check
		// runs ip and iptables-save, which the emulated VM runs slowly.
		for _, p := range pods {
			ok, err := PodHasAddr(ctx, p, vip)
			if err != nil || !ok {
				return false, fmt.Sprintf("%s does not hold %s yet", p.Name, vip), err
			}
		}
		var first []netip.Addr
		for _, r := range l.Routers {
			t, err := l.BucketTable(ctx, r, vip)
			if err != nil {
				// e.g. the router is faster than the node's agent (MPLS).
				return false, err.Error(), nil
			}
			used := distinct(t)
			if !slices.Equal(used, want) || slices.Contains(t, netip.Addr{}) {
				return false, fmt.Sprintf("%s sends %s to %v (want every bucket on %v)", r.Name, vip, used, want), nil
			}
			if first == nil {
				first = t
			} else if !slices.Equal(first, t) {
				return false, fmt.Sprintf("routers disagree on %s", vip), nil
			}
			// (BucketTable read the generation from the HMARK rule, which
			// the router adds after the bucket routes: it marks vip.)
		}
		table = first
		return true, "", nil
	})
	return table, err
}

// WaitNoTunnel waits until no router has a route or HMARK rule for vip and
// no pod holds it.
func (l *Lab) WaitNoTunnel(ctx context.Context, vip netip.Addr) error {
	return l.poll(ctx, time.Minute, func() (bool, string, error) {
		for _, p := range l.Pods {
			if ok, err := PodHasAddr(ctx, p, vip); err != nil || ok {
				return false, fmt.Sprintf("%s still holds %s", p.Name, vip), err
			}
		}
		for _, r := range l.Routers {
			routes, err := l.bucketRoutes(ctx, r, vip)
			if err != nil {
				return false, "", err
			}
			if len(routes) > 0 {
				return false, fmt.Sprintf("%s still has %d bucket routes for %s", r.Name, len(routes), vip), nil
			}
			if marked, err := l.marks(ctx, r, vip); err != nil || marked {
				return false, fmt.Sprintf("%s still marks %s", r.Name, vip), err
			}
		}
		return true, "", nil
	})
}

// marks reports whether the router hashes vip's packets.
func (l *Lab) marks(ctx context.Context, r *Node, vip netip.Addr) (bool, error) {
	_, ok, err := l.hmarkOffset(ctx, r, vip)
	return ok, err
}

// hmarkOffset reads the --hmark-offset with which the router hashes vip's
// new flows: that of the HMARK rule matching the generation set vip is in
// (iptables-save -t mangle, the sets through netlink); ok is false when
// vip is in no such set, or not in the set of all tunnel IPs.
func (l *Lab) hmarkOffset(ctx context.Context, r *Node, vip netip.Addr) (offset uint32, ok bool, err error) {
	save := "iptables-save"
	if vip.Is6() {
		save = "ip6tables-save"
	}
	rules, err := ipsetstate.ListRules(func() (string, error) {
		return InNS(ctx, r.Name, save, "-t", "mangle")
	})
	if err != nil {
		return 0, false, err
	}
	inSet := func(set string) (bool, error) {
		members, err := ipsetstate.MembersInNamespace(r.Name, set)
		return slices.Contains(members, vip), err
	}
	return parseHMARKOffset(rules, inSet)
}

// parseHMARKOffset finds, in iptables-save or iptables -S output, the
// HMARK rules that match a set ("-A CHAIN -m set --match-set SET dst ...
// -j HMARK ... --hmark-offset 0x1040", the offset in hex or decimal) and
// returns the offset of the last one whose set holds the tunnel IP (a
// later HMARK rule overrides an earlier mark), provided the chain's exit
// rule lets it through (its set of all tunnel IPs holds it too).
func parseHMARKOffset(rules string, inSet func(set string) (bool, error)) (uint32, bool, error) {
	var offset uint32
	found := false
	for _, line := range strings.Split(rules, "\n") {
		f := strings.Fields(line)
		i := slices.Index(f, "--match-set")
		if i < 1 || i+2 >= len(f) || f[i+2] != "dst" {
			continue // not a match of the tunnel IP (a SYN set's: src,src,dst)
		}
		in, err := inSet(f[i+1])
		if err != nil {
			return 0, false, err
		}
		switch {
		case f[i-1] == "!" && !in && slices.Contains(f, "RETURN"):
			return 0, false, nil // the chain's exit: not a tunnel IP
		case f[i-1] == "!" || !in || !slices.Contains(f, "HMARK"):
			continue
		}
		j := slices.Index(f, "--hmark-offset")
		if j < 0 {
			offset, found = 0, true // the kernel omits an offset of 0
			continue
		}
		if j+1 >= len(f) {
			return 0, false, fmt.Errorf("HMARK rule without an offset value: %q", line)
		}
		v, err := strconv.ParseUint(f[j+1], 0, 32)
		if err != nil {
			return 0, false, fmt.Errorf("HMARK rule %q: offset: %w", line, err)
		}
		offset, found = uint32(v), true
	}
	return offset, found, nil
}

// distinct returns the sorted valid addresses of t, each once.
func distinct(t []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, a := range t {
		if a.IsValid() && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out
}

// poll calls check every 200 ms until it reports done, fails, ctx ends or
// timeout passes; the error then carries check's last reason. Every 10 s of
// waiting it logs the reason.
func (l *Lab) poll(ctx context.Context, timeout time.Duration, check func() (done bool, reason string, err error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start, lastLog := time.Now(), time.Now()
	for {
		done, reason, err := check()
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		if time.Since(lastLog) > 10*time.Second {
			l.logf("still waiting after %v: %s", time.Since(start).Round(time.Second), reason)
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out after %v: %s", time.Since(start).Round(time.Second), reason)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
