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
// and an HMARK target hashing the full src,dst,sport,dport,proto tuple
// (for family IPv6, /128 addresses and prefixes). It compares meaning, not
// text: iptables prints such a rule as
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
func (r rule) vipRule(family Family) (vip netip.Addr, params Params, ok bool) {
	vip, opts, ok := splitVIPRule(r.spec, family)
	if !ok {
		return netip.Addr{}, Params{}, false
	}
	o, ok := parseHMARKOptions(opts)
	if !ok || o.affinity || o.prefix != family.bits() {
		return netip.Addr{}, Params{}, false
	}
	return vip, o.params, true
}

// splitVIPRule checks the matches of a rule spec: exactly "-d VIP/32" (for
// IPv6 "-d VIP/128") and our comment, then "-j HMARK". It returns the
// tunnel IP and the words after "-j HMARK".
func splitVIPRule(spec []string, family Family) (vip netip.Addr, targetOpts []string, ok bool) {
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
			ok := arg == "HMARK" && haveDst && dst.Bits() == family.bits() && dst.Addr().Is4() == (family == IPv4) &&
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

// hmarkOptions are the options of an HMARK rule of Chain's, as
// parseHMARKOptions reads them.
type hmarkOptions struct {
	params Params
	// prefix is both --hmark-src-prefix and --hmark-dst-prefix: a whole
	// address, 32 (IPv4) or 128 (IPv6).
	prefix int
	// affinity is true when the rule hashes the addresses alone (port and
	// protocol masks 0; see ClientFlow), false for the full tuple.
	affinity bool
}

// parseHMARKOptions reads the HMARK options as iptables (or ip6tables)
// prints them and returns them if they hash the full
// src,dst,sport,dport,proto tuple, or the addresses alone (affinity: port
// and protocol masks 0), and nothing else: both prefixes 32, or both 128,
// 0xffff port masks and a protocol mask covering the protocol byte (or all
// three 0), the seed, the modulus and the offset (which iptables omits
// when it is 0 and was not given). Numbers may be decimal or 0x hex. Any
// other option makes the rule not ours.
func parseHMARKOptions(opts []string) (o hmarkOptions, ok bool) {
	if len(opts)%2 != 0 {
		return hmarkOptions{}, false
	}
	vals := make(map[string]uint64, len(opts)/2)
	for i := 0; i < len(opts); i += 2 {
		name := opts[i]
		if _, dup := vals[name]; dup || !strings.HasPrefix(name, "--hmark-") {
			return hmarkOptions{}, false
		}
		v, err := strconv.ParseUint(opts[i+1], 0, 32)
		if err != nil {
			return hmarkOptions{}, false
		}
		vals[name] = v
	}
	take := func(name string) (uint64, bool) {
		v, ok := vals[name]
		delete(vals, name)
		return v, ok
	}
	src, okSrc := take("--hmark-src-prefix")
	dst, okDst := take("--hmark-dst-prefix")
	if !okSrc || !okDst || src != dst || (src != 32 && src != 128) {
		return hmarkOptions{}, false
	}
	o.prefix = int(src)
	sport, okS := take("--hmark-sport-mask")
	dport, okD := take("--hmark-dport-mask")
	proto, okP := take("--hmark-proto-mask")
	switch {
	case !okS || !okD || !okP:
		return hmarkOptions{}, false
	case sport == 0 && dport == 0 && proto == 0:
		o.affinity = true
	// The protocol is one byte: 0xff and 0xffff (what --hmark-tuple proto
	// sets) mask it the same way.
	case sport != 0xffff || dport != 0xffff || proto&0xff != 0xff:
		return hmarkOptions{}, false
	}
	mod, okMod := take("--hmark-mod")
	rnd, okRnd := take("--hmark-rnd")
	offset, _ := take("--hmark-offset")
	if !okMod || !okRnd || len(vals) != 0 {
		return hmarkOptions{}, false
	}
	o.params = Params{Buckets: uint32(mod), Offset: uint32(offset), Seed: uint32(rnd)}
	return o, true
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
