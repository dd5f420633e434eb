package hmark

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// rule is one "-A CHAIN ..." line of `iptables -S`.
type rule struct {
	// pos is the rule's 1-based position in its chain.
	pos int
	// spec is the rule without "-A CHAIN": what iptables -D takes to
	// delete it.
	spec []string
}

// parseRule parses one line of `iptables -S chain`. ok is false for lines
// that are not rules of chain (-N, -P).
func parseRule(line, chain string) (r rule, ok bool, err error) {
	words, err := splitWords(line)
	if err != nil {
		return rule{}, false, fmt.Errorf("parse rule %q: %w", line, err)
	}
	if len(words) < 2 || words[0] != "-A" || words[1] != chain {
		return rule{}, false, nil
	}
	r.spec = words[2:]
	return r, true, nil
}

// targets reports whether r jumps (-j) or goes (-g) to chain.
func (r rule) targets(chain string) bool {
	for i := 0; i+1 < len(r.spec); i++ {
		if (r.spec[i] == "-j" || r.spec[i] == "-g") && r.spec[i+1] == chain {
			return true
		}
	}
	return false
}

// isCanonicalJump reports whether r is exactly the jump rule Chain writes:
// our comment and "-j chain", with no other match.
func (r rule) isCanonicalJump(chain string) bool {
	return slices.Equal(r.spec, []string{"-m", "comment", "--comment", RuleComment, "-j", chain})
}

// vipRule recognizes r as a rule older versions of Chain wrote, one per
// tunnel IP (Offsets reads them on an upgrade): "-d VIP/32", our comment,
// and an HMARK target hashing the full src,dst,sport,dport,proto tuple. It
// compares meaning, not text: iptables prints such a rule as
//
//	-d VIP/32 -m comment --comment kube-service-tunnel -j HMARK
//	  --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff
//	  --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff
//	  --hmark-rnd 0x0000abcd --hmark-mod N --hmark-offset N
//
// (--hmark-offset only when it was given; absent means 0; iptables 1.8.9
// prints it in decimal, others in hex: both are read). Anything else in
// the rule (another match, a negation, a port or SPI override, the ct tuple,
// a partial mask) makes it not ours.
func (r rule) vipRule() (vip netip.Addr, params Params, ok bool) {
	vip, opts, ok := splitVIPRule(r.spec)
	if !ok {
		return netip.Addr{}, Params{}, false
	}
	params, affinity, ok := parseHMARKOptions(opts)
	if !ok || affinity {
		return netip.Addr{}, Params{}, false
	}
	return vip, params, true
}

// splitVIPRule checks the matches of a rule spec: exactly "-d VIP/32" and
// our comment, then "-j HMARK". It returns the tunnel IP and the words
// after "-j HMARK".
func splitVIPRule(spec []string) (vip netip.Addr, targetOpts []string, ok bool) {
	var (
		dst        netip.Prefix
		haveDst    bool
		comment    bool
		matchTypes []string
	)
	for i := 0; i+1 < len(spec); i += 2 {
		arg := spec[i+1]
		switch spec[i] {
		case "-d":
			p, err := netip.ParsePrefix(arg)
			if haveDst || err != nil {
				return netip.Addr{}, nil, false
			}
			dst, haveDst = p, true
		case "-m":
			matchTypes = append(matchTypes, arg)
		case "--comment":
			if comment || arg != RuleComment {
				return netip.Addr{}, nil, false
			}
			comment = true
		case "-j":
			ok := arg == "HMARK" && haveDst && dst.Bits() == 32 && dst.Addr().Is4() &&
				comment && slices.Equal(matchTypes, []string{"comment"})
			if !ok {
				return netip.Addr{}, nil, false
			}
			return dst.Addr(), spec[i+2:], true
		default:
			return netip.Addr{}, nil, false
		}
	}
	return netip.Addr{}, nil, false
}

// parseHMARKOptions reads the HMARK options as iptables prints them and
// returns the parameters if they hash the full src,dst,sport,dport,proto
// tuple, or the addresses alone (affinity: port and protocol masks 0), and
// nothing else: /32 prefixes, 0xffff port masks and a protocol mask
// covering the protocol byte (or all three 0), the seed, the modulus and
// the offset (which iptables omits when it is 0 and was not given).
// Numbers may be decimal or 0x hex. Any other option makes the rule not
// ours.
func parseHMARKOptions(opts []string) (p Params, affinity, ok bool) {
	if len(opts)%2 != 0 {
		return Params{}, false, false
	}
	vals := make(map[string]uint64, len(opts)/2)
	for i := 0; i < len(opts); i += 2 {
		name := opts[i]
		if _, dup := vals[name]; dup || !strings.HasPrefix(name, "--hmark-") {
			return Params{}, false, false
		}
		v, err := strconv.ParseUint(opts[i+1], 0, 32)
		if err != nil {
			return Params{}, false, false
		}
		vals[name] = v
	}
	take := func(name string) (uint64, bool) {
		v, ok := vals[name]
		delete(vals, name)
		return v, ok
	}
	for _, name := range []string{"--hmark-src-prefix", "--hmark-dst-prefix"} {
		if got, ok := take(name); !ok || got != 32 {
			return Params{}, false, false
		}
	}
	sport, okS := take("--hmark-sport-mask")
	dport, okD := take("--hmark-dport-mask")
	proto, okP := take("--hmark-proto-mask")
	switch {
	case !okS || !okD || !okP:
		return Params{}, false, false
	case sport == 0 && dport == 0 && proto == 0:
		affinity = true
	// The protocol is one byte: 0xff and 0xffff (what --hmark-tuple proto
	// sets) mask it the same way.
	case sport != 0xffff || dport != 0xffff || proto&0xff != 0xff:
		return Params{}, false, false
	}
	mod, okMod := take("--hmark-mod")
	rnd, okRnd := take("--hmark-rnd")
	offset, _ := take("--hmark-offset")
	if !okMod || !okRnd || len(vals) != 0 {
		return Params{}, false, false
	}
	return Params{Buckets: uint32(mod), Offset: uint32(offset), Seed: uint32(rnd)}, affinity, true
}

// splitWords splits a line of `iptables -S` into words the way a shell
// would read them: iptables double-quotes words with spaces (comments) and
// escapes quotes and backslashes inside them with a backslash.
func splitWords(line string) ([]string, error) {
	var (
		words   []string
		cur     strings.Builder
		inWord  bool
		quoted  bool
		escaped bool
	)
	for _, ch := range line {
		switch {
		case escaped:
			cur.WriteRune(ch)
			escaped = false
		case ch == '\\':
			escaped, inWord = true, true
		case ch == '"':
			quoted, inWord = !quoted, true
		case (ch == ' ' || ch == '\t') && !quoted:
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(ch)
			inWord = true
		}
	}
	if quoted || escaped {
		return nil, errors.New("unterminated quote or escape")
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}
