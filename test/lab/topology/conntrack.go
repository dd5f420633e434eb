package topology

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// ConntrackEntry is one entry of a namespace's conntrack table, as
// ctnetlink gives it (the fields `conntrack -L` prints).
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

// Conntrack returns the conntrack table of node n's namespace, both
// families, as a ctnetlink dump gives it. Not /proc/net/nf_conntrack: the
// kernel prints that file a page per read, each read finding its place
// again by counting entries from the start of the (all namespaces') hash
// table, so an entry removed before that place between two reads makes the
// next read skip one live entry. A dump resumes at the hash bucket it
// stopped in, so entries that come and go elsewhere skip none.
func (l *Lab) Conntrack(ctx context.Context, n *Node) ([]ConntrackEntry, error) {
	ns, err := n.NS()
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	entries, err := ConntrackIn(ctx, ns)
	if err != nil {
		return nil, fmt.Errorf("conntrack of %s: %w", n.Name, err)
	}
	return entries, nil
}

// ConntrackIn returns the conntrack table of namespace ns, both families.
func ConntrackIn(ctx context.Context, ns netns.NsHandle) ([]ConntrackEntry, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(ns)})
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(deadline); err != nil {
			return nil, err
		}
	}
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_CTNETLINK<<8 | nl.IPCTNL_MSG_CT_GET),
			Flags: netlink.Request | netlink.Dump,
		},
		// nfgenmsg: every family, version 0, resource id 0.
		Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	out := make([]ConntrackEntry, 0, len(msgs))
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		e, err := decodeConntrack(m.Data[4:])
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// The status bits decodeConntrack reads (linux/netfilter/nf_conntrack_common.h;
// the attributes are vishvananda/netlink's nl constants).
const (
	ipsSeenReply = 1 << 1
	ipsAssured   = 1 << 2
)

// tcpStates are conntrack's TCP state names, by number, as
// /proc/net/nf_conntrack and `conntrack -L` print them.
var tcpStates = []string{"NONE", "SYN_SENT", "SYN_RECV", "ESTABLISHED", "FIN_WAIT", "CLOSE_WAIT", "LAST_ACK", "TIME_WAIT", "CLOSE", "SYN_SENT2"}

// decodeConntrack reads the attributes of one entry of a ctnetlink dump.
func decodeConntrack(data []byte) (ConntrackEntry, error) {
	var e ConntrackEntry
	ad, err := netlink.NewAttributeDecoder(data)
	if err != nil {
		return e, err
	}
	ad.ByteOrder = binary.BigEndian
	var proto uint8
	for ad.Next() {
		switch ad.Type() {
		case nl.CTA_TUPLE_ORIG:
			ad.Nested(func(tuple *netlink.AttributeDecoder) error {
				for tuple.Next() {
					switch tuple.Type() {
					case nl.CTA_TUPLE_IP:
						tuple.Nested(func(ip *netlink.AttributeDecoder) error {
							for ip.Next() {
								a, _ := netip.AddrFromSlice(ip.Bytes())
								switch ip.Type() {
								case nl.CTA_IP_V4_SRC, nl.CTA_IP_V6_SRC:
									e.Src = a
								case nl.CTA_IP_V4_DST, nl.CTA_IP_V6_DST:
									e.Dst = a
								}
							}
							return nil
						})
					case nl.CTA_TUPLE_PROTO:
						tuple.Nested(func(p *netlink.AttributeDecoder) error {
							p.ByteOrder = binary.BigEndian
							for p.Next() {
								switch p.Type() {
								case nl.CTA_PROTO_NUM:
									proto = p.Uint8()
								case nl.CTA_PROTO_SRC_PORT:
									e.SrcPort = p.Uint16()
								case nl.CTA_PROTO_DST_PORT:
									e.DstPort = p.Uint16()
								}
							}
							return nil
						})
					}
				}
				return nil
			})
		case nl.CTA_STATUS:
			status := ad.Uint32()
			if status&ipsSeenReply == 0 {
				e.Flags = append(e.Flags, "UNREPLIED")
			}
			if status&ipsAssured != 0 {
				e.Flags = append(e.Flags, "ASSURED")
			}
		case nl.CTA_PROTOINFO:
			ad.Nested(func(info *netlink.AttributeDecoder) error {
				for info.Next() {
					if info.Type() != nl.CTA_PROTOINFO_TCP {
						continue
					}
					info.Nested(func(tcp *netlink.AttributeDecoder) error {
						for tcp.Next() {
							if tcp.Type() == nl.CTA_PROTOINFO_TCP_STATE {
								if s := int(tcp.Uint8()); s < len(tcpStates) {
									e.State = tcpStates[s]
								} else {
									e.State = strconv.Itoa(s)
								}
							}
						}
						return nil
					})
				}
				return nil
			})
		case nl.CTA_TIMEOUT:
			e.Timeout = int(ad.Uint32())
		case nl.CTA_MARK:
			e.Mark = ad.Uint32()
		case nl.CTA_COUNTERS_ORIG:
			e.HasCounters = true
			ad.Nested(func(c *netlink.AttributeDecoder) error {
				c.ByteOrder = binary.BigEndian
				for c.Next() {
					switch c.Type() {
					case nl.CTA_COUNTERS_PACKETS:
						e.Packets = c.Uint64()
					case nl.CTA_COUNTERS_BYTES:
						e.Bytes = c.Uint64()
					}
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return e, fmt.Errorf("decoding an entry: %w", err)
	}
	e.Proto = protoName(proto)
	return e, nil
}

// protoName names an IP protocol as conntrack prints it.
func protoName(p uint8) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	case unix.IPPROTO_ICMP:
		return "icmp"
	case unix.IPPROTO_ICMPV6:
		return "icmpv6"
	case unix.IPPROTO_GRE:
		return "gre"
	case unix.IPPROTO_SCTP:
		return "sctp"
	}
	return "unknown"
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
