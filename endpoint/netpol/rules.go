package netpol

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Chain is the filter chain, in a served pod's network namespace, that
// holds its tunneled ingress policy; INPUT jumps to it for packets to the
// pod's tunnel IPs.
const Chain = "KST-POLICY"

// comment marks every rule the agent writes.
const comment = "kube-service-tunnel"

// RestorePayload renders in, for the pod's tunnel IPs vips, as an
// iptables-restore --noflush payload of the filter table: Chain (and one
// subchain per source with excepts) replaced whole, and the INPUT jumps
// to Chain for each tunnel IP (the caller removes stale jumps). Packets of
// established connections are admitted first (as network plugins do), so
// that a policy change cuts no open connection; then the rules; then a
// DROP. A pod that no policy isolates gets a Chain that returns at once.
// Subchains a previous payload declared and this one does not are left
// (unreferenced): the caller deletes them.
func RestorePayload(in Ingress, vips []netip.Addr) []byte {
	var chains []string
	var rules []string
	add := func(chain string, words ...string) {
		rules = append(rules, "-A "+chain+" "+strings.Join(words, " ")+" -m comment --comment "+comment)
	}
	chains = append(chains, Chain)
	if !in.Isolated {
		add(Chain, "-j", "RETURN")
	} else {
		add(Chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
		sub := 0
		for _, r := range in.Rules {
			ports := portMatches(r)
			if len(ports) == 0 {
				continue // a rule whose every port was refused admits nothing
			}
			sources := []Source{{}} // any source
			if !r.AllSources {
				sources = r.Sources
			}
			for _, s := range sources {
				from := []string{}
				if s.Prefix.IsValid() {
					from = []string{"-s", s.Prefix.String()}
				}
				if len(s.Except) == 0 {
					for _, p := range ports {
						add(Chain, slices.Concat(from, p, []string{"-j", "ACCEPT"})...)
					}
					continue
				}
				name := fmt.Sprintf("%s-%d", Chain, sub)
				sub++
				chains = append(chains, name)
				add(Chain, slices.Concat(from, []string{"-j", name})...)
				for _, e := range s.Except {
					add(name, "-s", e.String(), "-j", "RETURN")
				}
				for _, p := range ports {
					add(name, slices.Concat(p, []string{"-j", "ACCEPT"})...)
				}
			}
		}
		add(Chain, "-j", "DROP")
	}
	var b strings.Builder
	b.WriteString("*filter\n")
	for _, c := range chains {
		fmt.Fprintf(&b, ":%s - [0:0]\n", c)
	}
	for _, r := range rules {
		b.WriteString(r + "\n")
	}
	b.WriteString("COMMIT\n")
	return []byte(b.String())
}

// Jump is the INPUT rule sending packets to tunnel IP vip to Chain.
func Jump(vip netip.Addr) []string {
	return []string{"-d", netip.PrefixFrom(vip, vip.BitLen()).String(), "-m", "comment", "--comment", comment, "-j", Chain}
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
