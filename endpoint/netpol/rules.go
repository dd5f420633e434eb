package netpol

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/cmdnu/kube-service-tunnel/internal/iptsave"
)

// Chain is the filter chain, in a served pod's network namespace, that
// holds its tunneled ingress policy; INPUT jumps to it for packets to the
// pod's tunnel IPs. Sources with excepts get subchains Chain-0, Chain-1...
const Chain = "KST-POLICY"

// Comment marks every rule the agent writes; the first rule of Chain
// carries Comment + ":" + the digest of the whole chain.
const Comment = "kube-service-tunnel"

// Rules are a pod's tunneled ingress policy rendered for the filter
// table.
type Rules struct {
	// Isolated: a policy selects the pod. When false the rules only turn on
	// connection tracking in the pod's namespace (see Render).
	Isolated bool
	// VIPs are the pod's tunnel IPs, each with a jump from INPUT.
	VIPs []netip.Addr
	// Chains are Chain and its subchains, in order.
	Chains []string
	// Body is the "-A chain ..." lines of every chain.
	Body []string
	// Counts is the number of rules of each chain.
	Counts map[string]int
	// Digest identifies Body; the kernel's copy carries it in a comment.
	Digest string
}

// Equal reports whether r and o render the same kernel state.
func (r *Rules) Equal(o *Rules) bool {
	if r == nil || o == nil {
		return r == o
	}
	return r.Digest == o.Digest && slices.Equal(r.VIPs, o.VIPs)
}

// Render renders in for the pod's tunnel IPs vips (sorted) of one address
// family, the family of the first: the IPv4 ones for iptables, or the IPv6
// ones for ip6tables (tunnel IPs of the other family are left out). It
// returns nil when there is no tunnel IP. Only the sources of that family
// are rendered: an IPv4 ipBlock or peer pod address admits no IPv6 client,
// nor the reverse, and a rule whose peers are all of the other family
// admits nothing here. Packets of established connections are admitted first
// (as network plugins do), so that a policy change cuts no open
// connection; then the rules; then one DROP per tunnel IP, whose counters
// count what the policy dropped.
//
// A pod that no policy isolates gets Chain with that first rule alone
// (returning) and no jump to it: the rule's conntrack match turns on
// connection tracking in the pod's namespace (the kernel tracks
// connections in a namespace only once a rule there needs it), so that the
// connections it accepts before a policy isolates it are known as
// established when one does, instead of being picked up mid-stream as new
// and dropped.
func Render(in Ingress, vips []netip.Addr) *Rules {
	if len(vips) == 0 {
		return nil
	}
	ipv6 := vips[0].Is6()
	vips = slices.DeleteFunc(slices.Clone(vips), func(a netip.Addr) bool { return a.Is6() != ipv6 })
	r := &Rules{Isolated: in.Isolated, Chains: []string{Chain}, Counts: map[string]int{}}
	add := func(chain string, words ...string) {
		r.Body = append(r.Body, "-A "+chain+" "+strings.Join(words, " ")+" -m comment --comment "+Comment)
		r.Counts[chain]++
	}
	if !in.Isolated {
		add(Chain, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "RETURN")
		r.seal()
		return r
	}
	r.VIPs = vips
	add(Chain, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT")
	sub := 0
	for _, rule := range in.Rules {
		ports := portMatches(rule)
		if len(ports) == 0 {
			continue // a rule whose every port was refused admits nothing
		}
		sources := []Source{{}} // any source
		if !rule.AllSources {
			sources = nil
			for _, s := range rule.Sources {
				// Excepts lie within their prefix (the API checks), so
				// they are of its family.
				if s.Prefix.Addr().Is6() == ipv6 {
					sources = append(sources, s)
				}
			}
		}
		for _, s := range sources {
			var from []string
			if s.Prefix.IsValid() {
				from = []string{"-s", s.Prefix.String()}
			}
			if len(s.Except) == 0 {
				for _, p := range ports {
					add(Chain, slices.Concat(from, p, []string{"-j", "ACCEPT"})...)
				}
				continue
			}
			name := Chain + "-" + strconv.Itoa(sub)
			sub++
			r.Chains = append(r.Chains, name)
			add(Chain, slices.Concat(from, []string{"-j", name})...)
			for _, e := range s.Except {
				add(name, "-s", e.String(), "-j", "RETURN")
			}
			for _, p := range ports {
				add(name, slices.Concat(p, []string{"-j", "ACCEPT"})...)
			}
		}
	}
	for _, vip := range r.VIPs {
		add(Chain, "-d", iptsave.Host(vip), "-j", "DROP")
	}
	r.seal()
	return r
}

// seal computes the digest of the body and puts it in the first rule's
// comment.
func (r *Rules) seal() {
	sum := sha256.Sum256([]byte(strings.Join(r.Body, "\n")))
	r.Digest = hex.EncodeToString(sum[:4])
	r.Body[0] = strings.TrimSuffix(r.Body[0], Comment) + Comment + ":" + r.Digest
}

// Jump is the INPUT rule sending packets to tunnel IP vip to Chain.
func Jump(vip netip.Addr) []string {
	return []string{"-d", iptsave.Host(vip), "-m", "comment", "--comment", Comment, "-j", Chain}
}

// Observed is what a pod's filter table holds of the agent's, read from
// iptables-save (ParseSave).
type Observed struct {
	// Counts is the number of rules of each of the agent's chains (Chain
	// and its subchains) present.
	Counts map[string]int
	// Digest is the one the first rule of Chain carries ("" if none).
	Digest string
	// Jumps are the INPUT rules jumping to Chain: their tunnel IP and the
	// rule as saved (without "-A INPUT").
	Jumps []ObservedJump
	// Dropped are the counters of each tunnel IP's DROP rule (when saved
	// with -c).
	Dropped map[netip.Addr]Counter
}

// ObservedJump is one INPUT jump to Chain.
type ObservedJump struct {
	VIP  netip.Addr
	Spec string
}

// Counter is a rule's packet and byte counters.
type Counter = iptsave.Counter

// Empty reports whether the table holds nothing of the agent's.
func (o Observed) Empty() bool { return len(o.Counts) == 0 && len(o.Jumps) == 0 }

var (
	digestComment = regexp.MustCompile(`--comment "?` + regexp.QuoteMeta(Comment) + `:([0-9a-f]+)"?`)
	destination   = regexp.MustCompile(`-d (\S+)`)
)

// hostDestination returns the single address a saved rule's -d names
// (invalid when it names none, or a wider prefix).
func hostDestination(spec string) netip.Addr {
	if m := destination.FindStringSubmatch(spec); m != nil {
		if p, err := netip.ParsePrefix(m[1]); err == nil && p.IsSingleIP() {
			return p.Addr()
		}
	}
	return netip.Addr{}
}

// ours reports whether chain is Chain or one of its subchains.
func ours(chain string) bool {
	if chain == Chain {
		return true
	}
	n, ok := strings.CutPrefix(chain, Chain+"-")
	_, err := strconv.Atoi(n)
	return ok && err == nil
}

// ParseSave reads the filter table of iptables-save's output (with or
// without -c; other tables are skipped).
func ParseSave(save string) Observed {
	o := Observed{Counts: map[string]int{}, Dropped: map[netip.Addr]Counter{}}
	for l := range iptsave.Table(save, "filter") {
		chain, spec := l.Chain, l.Spec
		switch {
		case l.Declared != "":
			if ours(l.Declared) {
				o.Counts[l.Declared] += 0
			}
		case chain == "INPUT" && iptsave.Target(spec) == Chain:
			o.Jumps = append(o.Jumps, ObservedJump{VIP: hostDestination(spec), Spec: spec})
		case ours(chain):
			if o.Counts[chain] == 0 && chain == Chain {
				if m := digestComment.FindStringSubmatch(spec); m != nil {
					o.Digest = m[1]
				}
			}
			o.Counts[chain]++
			if vip := hostDestination(spec); chain == Chain && iptsave.Target(spec) == "DROP" && vip.IsValid() {
				o.Dropped[vip] = l.Counter
			}
		}
	}
	return o
}

// Update returns the iptables-restore --noflush payload that turns have
// into want (want nil: remove everything of the agent's), or nil when the
// table already holds exactly want. Chains are replaced whole in one
// transaction; jumps are added at the top of INPUT and only the missing
// ones are; stale jumps and chains are deleted.
func Update(want *Rules, have Observed) []byte {
	var wantVIPs []netip.Addr
	wantCounts := map[string]int{}
	if want != nil {
		wantVIPs, wantCounts = want.VIPs, want.Counts
	}
	var staleJumps []string
	var haveVIPs []netip.Addr
	for _, j := range have.Jumps {
		if !j.VIP.IsValid() || !slices.Contains(wantVIPs, j.VIP) || slices.Contains(haveVIPs, j.VIP) {
			staleJumps = append(staleJumps, j.Spec)
			continue
		}
		haveVIPs = append(haveVIPs, j.VIP)
	}
	var missing []netip.Addr
	for _, vip := range wantVIPs {
		if !slices.Contains(haveVIPs, vip) {
			missing = append(missing, vip)
		}
	}
	sameChains := len(have.Counts) == len(wantCounts)
	for c, n := range wantCounts {
		if have.Counts[c] != n {
			sameChains = false
		}
	}
	chainsRight := want != nil && sameChains && have.Digest == want.Digest
	if chainsRight && len(staleJumps) == 0 && len(missing) == 0 {
		return nil
	}
	if want == nil && have.Empty() {
		return nil
	}

	var b strings.Builder
	b.WriteString("*filter\n")
	var stale []string
	for c := range have.Counts {
		if _, ok := wantCounts[c]; !ok {
			stale = append(stale, c)
		}
	}
	slices.Sort(stale)
	// Declaring a chain flushes it. Ours are rewritten whole unless they
	// are right already (only jumps to add or remove).
	rewrite := want != nil && !chainsRight
	if rewrite {
		for _, c := range want.Chains {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
	}
	for _, c := range stale {
		fmt.Fprintf(&b, ":%s - [0:0]\n", c)
	}
	for _, spec := range staleJumps {
		b.WriteString("-D INPUT " + spec + "\n")
	}
	if rewrite {
		for _, line := range want.Body {
			b.WriteString(line + "\n")
		}
	}
	for _, vip := range missing {
		b.WriteString("-I INPUT 1 " + strings.Join(Jump(vip), " ") + "\n")
	}
	for _, c := range stale {
		b.WriteString("-X " + c + "\n")
	}
	b.WriteString("COMMIT\n")
	return []byte(b.String())
}

// portMatches are the iptables matches of a rule's ports: one empty match
// for every port of every protocol.
func portMatches(r Rule) [][]string {
	if r.AllPorts {
		return [][]string{{}}
	}
	var out [][]string
	for _, p := range r.Ports {
		proto := strings.ToLower(string(p.Protocol))
		if p.Protocol == "" {
			proto = strings.ToLower(string(corev1.ProtocolTCP))
		}
		m := []string{"-p", proto}
		switch {
		case p.First == 0:
		case p.First == p.Last:
			m = append(m, "--dport", fmt.Sprint(p.First))
		default:
			m = append(m, "--dport", fmt.Sprintf("%d:%d", p.First, p.Last))
		}
		out = append(out, m)
	}
	return out
}
