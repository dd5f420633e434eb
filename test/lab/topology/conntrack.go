package topology

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// ConntrackEntry is one entry of a namespace's conntrack table, as
// /proc/net/nf_conntrack shows it (the same fields as `conntrack -L`).
type ConntrackEntry struct {
	// Proto is the protocol's name (tcp, udp, icmp, ...).
	Proto string
	// Timeout is the entry's remaining lifetime in seconds.
	Timeout int
	// State is the TCP state (ESTABLISHED, FIN_WAIT, ...), "" for other
	// protocols.
	State string
	// Src, Dst, SrcPort and DstPort are the original direction's tuple.
	Src, Dst         netip.Addr
	SrcPort, DstPort uint16
	// Flags are the bracketed status words: UNREPLIED, ASSURED.
	Flags []string
	// Packets and Bytes count the original direction, when conntrack
	// accounting is on (HasCounters; the lab turns it on in routers).
	Packets, Bytes uint64
	HasCounters    bool
	// Mark is the connmark.
	Mark uint32
	// Line is the entry as the kernel printed it.
	Line string
}

// String is the entry in a form for failure reports.
func (e ConntrackEntry) String() string {
	flow := fmt.Sprintf("%v:%d -> %v:%d", e.Src, e.SrcPort, e.Dst, e.DstPort)
	state := e.State
	if state == "" {
		state = "-"
	}
	s := fmt.Sprintf("%-4s %-35s %-12s timeout %3ds mark %#x", e.Proto, flow, state, e.Timeout, e.Mark)
	if e.HasCounters {
		s += fmt.Sprintf(" packets %d bytes %d", e.Packets, e.Bytes)
	}
	if len(e.Flags) > 0 {
		s += " [" + strings.Join(e.Flags, " ") + "]"
	}
	return s
}

// Conntrack returns the conntrack table of node n's namespace.
func (l *Lab) Conntrack(ctx context.Context, n *Node) ([]ConntrackEntry, error) {
	out, err := InNS(ctx, n.Name, "cat", "/proc/net/nf_conntrack")
	if err != nil {
		return nil, err
	}
	return parseConntrack(out), nil
}

// parseConntrack reads /proc/net/nf_conntrack: "ipv4 2 tcp 6 299
// ESTABLISHED src=C dst=V sport=P dport=80 [UNREPLIED] src=V dst=C sport=80
// dport=P mark=4127 zone=0 use=2" (with "packets=N bytes=N" after each
// direction's ports when accounting is on); "ipv4 2 udp 17 29 src=... ".
// Lines it cannot read are skipped.
func parseConntrack(table string) []ConntrackEntry {
	var out []ConntrackEntry
	for _, line := range strings.Split(table, "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		timeout, err := strconv.Atoi(f[4])
		if err != nil {
			continue
		}
		e := ConntrackEntry{Proto: f[2], Timeout: timeout, Line: line}
		rest := f[5:]
		if e.Proto == "tcp" {
			e.State, rest = f[5], f[6:]
		}
		seen := map[string]bool{} // the first of each key is the original direction's
		for _, w := range rest {
			k, v, ok := strings.Cut(w, "=")
			if !ok {
				if strings.HasPrefix(w, "[") && strings.HasSuffix(w, "]") {
					e.Flags = append(e.Flags, strings.Trim(w, "[]"))
				}
				continue
			}
			if seen[k] {
				continue
			}
			seen[k] = true
			n, _ := strconv.ParseUint(v, 10, 64)
			switch k {
			case "src":
				e.Src, _ = netip.ParseAddr(v)
			case "dst":
				e.Dst, _ = netip.ParseAddr(v)
			case "sport":
				e.SrcPort = uint16(n)
			case "dport":
				e.DstPort = uint16(n)
			case "packets":
				e.Packets, e.HasCounters = n, true
			case "bytes":
				e.Bytes = n
			case "mark":
				e.Mark = uint32(n)
			}
		}
		out = append(out, e)
	}
	return out
}

// OldGenerationEntries returns router r's conntrack entries towards vip
// whose mark belongs to a routing generation other than cur: the entries
// that keep an older generation alive (a closing entry's connmark has the
// closing bit, so it is in no generation).
func (l *Lab) OldGenerationEntries(ctx context.Context, r *Node, vip netip.Addr, cur int) ([]ConntrackEntry, error) {
	all, err := l.Conntrack(ctx, r)
	if err != nil {
		return nil, err
	}
	var out []ConntrackEntry
	for _, e := range all {
		if gen, ok := l.GenerationOfMark(e.Mark); ok && e.Dst == vip && gen != cur {
			out = append(out, e)
		}
	}
	return out, nil
}

// GenerationOfMark returns the routing generation a router mark (HMARK's,
// saved in the connmark) selects; ok is false for other marks.
func (l *Lab) GenerationOfMark(mark uint32) (gen int, ok bool) {
	if mark < datapath.DefaultMarkOffset || mark >= datapath.DefaultMarkOffset+uint32(datapath.DefaultGenerations*l.Opts.Buckets) {
		return 0, false
	}
	return int(mark-datapath.DefaultMarkOffset) / l.Opts.Buckets, true
}
