// Package iptsave reads the output of iptables-save (and ip6tables-save),
// with or without counters (-c), and writes the small pieces of rule text
// the agent's chains share. It knows nothing of any chain's meaning: the
// packages that own chains (endpoint/netpol, endpoint/guard) interpret
// what it yields.
package iptsave

import (
	"iter"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
)

// Counter is a rule's packet and byte counters (zero when saved without
// -c).
type Counter struct{ Packets, Bytes uint64 }

// Line is one chain declaration or one rule of a table.
type Line struct {
	// Declared is the chain a ":NAME POLICY [p:b]" line declares ("" for a
	// rule).
	Declared string
	// Chain and Spec are a rule's "-A CHAIN SPEC", with Counter its
	// "[packets:bytes]" prefix.
	Chain, Spec string
	Counter     Counter
}

var (
	counterPrefix = regexp.MustCompile(`^\[(\d+):(\d+)\] `)
	target        = regexp.MustCompile(`(?:^| )-j (\S+)`)
)

// Table yields the declarations and rules of table in save, in order;
// other tables, comments and COMMIT lines are skipped.
func Table(save, table string) iter.Seq[Line] {
	return func(yield func(Line) bool) {
		current := ""
		for line := range strings.Lines(save) {
			line = strings.TrimSpace(line)
			switch {
			case strings.HasPrefix(line, "*"):
				current = line[1:]
				continue
			case current != table:
				continue
			case strings.HasPrefix(line, ":"):
				name, _, _ := strings.Cut(line[1:], " ")
				if !yield(Line{Declared: name}) {
					return
				}
				continue
			}
			var c Counter
			if m := counterPrefix.FindStringSubmatch(line); m != nil {
				c.Packets, _ = strconv.ParseUint(m[1], 10, 64)
				c.Bytes, _ = strconv.ParseUint(m[2], 10, 64)
				line = line[len(m[0]):]
			}
			rest, ok := strings.CutPrefix(line, "-A ")
			if !ok {
				continue
			}
			chain, spec, _ := strings.Cut(rest, " ")
			if !yield(Line{Chain: chain, Spec: spec, Counter: c}) {
				return
			}
		}
	}
}

// Target returns the target of a saved rule's spec ("" when it has none).
func Target(spec string) string {
	if m := target.FindStringSubmatch(spec); m != nil {
		return m[1]
	}
	return ""
}

// Host is a as a rule names a single address: a /32 or /128 prefix.
func Host(a netip.Addr) string { return netip.PrefixFrom(a, a.BitLen()).String() }
