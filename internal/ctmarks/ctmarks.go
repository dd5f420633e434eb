// Package ctmarks lists the conntrack entries whose mark lies in given
// ranges, filtered by the kernel: only those entries cross netlink, and
// they are decoded one netlink buffer at a time (64 KiB), never gathered,
// so a listing costs the same memory whatever the number of entries. The router's marks are a small range; a flood of entries with
// other marks (or none: traffic that is not for a tunnel IP) costs the
// router neither time nor memory when it looks for the flows of its older
// generations.
//
// The kernel's dump filter (CTA_MARK, CTA_MARK_MASK) matches one value
// under one mask, so a range is listed as the aligned blocks that cover
// it, one dump each (one for the router's default marks).
package ctmarks

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"net"
	"slices"
	"syscall"

	"github.com/mdlayher/netlink"
	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// Range is the marks First to First+Count-1.
type Range struct{ First, Count uint32 }

// Block is the marks m with m&Mask == Value.
type Block struct{ Value, Mask uint32 }

// Blocks returns the aligned blocks that cover r exactly, fewest first to
// last (the decomposition of an address range into prefixes).
func Blocks(r Range) []Block {
	var out []Block
	first, left := uint64(r.First), uint64(r.Count)
	if first+left > 1<<32 {
		left = 1<<32 - first
	}
	for left > 0 {
		// The largest power of two that first is aligned to and that fits.
		size := uint64(1) << 32
		if first != 0 {
			size = uint64(1) << bits.TrailingZeros64(first)
		}
		for size > left {
			size >>= 1
		}
		out = append(out, Block{Value: uint32(first), Mask: ^uint32(size - 1)})
		first += size
		left -= size
	}
	return out
}

// Lister lists conntrack entries of one network namespace.
type Lister struct {
	// NetNS is a file descriptor of the namespace; 0 is the caller's.
	NetNS int
}

// ctnetlink's attributes that EachMarked reads or sends (linux/netfilter/
// nfnetlink_conntrack.h).
const (
	ctaTupleOrig = 1
	ctaTimeout   = 7
	ctaMark      = 8
	ctaMarkMask  = 21

	ctaTupleIP    = 1
	ctaTupleProto = 2

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3
)

// EachMarked calls fn with each entry of family (unix.AF_INET or
// unix.AF_INET6) whose mark lies in one of ranges, as vishvananda/netlink's
// ConntrackFlow with the fields the router reads: the original direction's
// protocol, addresses and ports, the mark and the timeout left. The entries
// are decoded as the kernel sends them, one netlink buffer at a time, so
// the memory used does not grow with their number.
func (l Lister) EachMarked(family vnl.InetFamily, ranges []Range, fn func(*vnl.ConntrackFlow)) error {
	fd, err := l.socket()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for _, r := range ranges {
		for _, b := range Blocks(r) {
			if err := dump(fd, family, b, fn); err != nil {
				return fmt.Errorf("listing conntrack entries with mark %#x/%#x: %w", b.Value, b.Mask, err)
			}
		}
	}
	return nil
}

// socket opens a NETLINK_NETFILTER socket in the Lister's namespace.
func (l Lister) socket() (int, error) {
	ns := netns.None()
	if l.NetNS != 0 {
		ns = netns.NsHandle(l.NetNS)
	}
	fd, err := nsexec.NetlinkSocket(ns, unix.NETLINK_NETFILTER, 0)
	if err != nil {
		return -1, fmt.Errorf("conntrack: %w", err)
	}
	return fd, nil
}

// dump sends one filtered dump request on fd and decodes its answer.
func dump(fd int, family vnl.InetFamily, b Block, fn func(*vnl.ConntrackFlow)) error {
	const seq = 1
	attrs, err := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: ctaMark, Data: binary.BigEndian.AppendUint32(nil, b.Value)},
		{Type: ctaMarkMask, Data: binary.BigEndian.AppendUint32(nil, b.Mask)},
	})
	if err != nil {
		return err
	}
	// nlmsghdr, nfgenmsg (family, version 0, resource id 0), attributes.
	body := append([]byte{byte(family), unix.NFNETLINK_V0, 0, 0}, attrs...)
	req := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
	binary.NativeEndian.PutUint32(req[0:4], uint32(unix.NLMSG_HDRLEN+len(body)))
	binary.NativeEndian.PutUint16(req[4:6], unix.NFNL_SUBSYS_CTNETLINK<<8|nl.IPCTNL_MSG_CT_GET)
	binary.NativeEndian.PutUint16(req[6:8], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:12], seq)
	req = append(req, body...)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return nil
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return errors.New("short netlink error message")
				}
				if errno := -int32(binary.NativeEndian.Uint32(m.Data[:4])); errno != 0 {
					return unix.Errno(errno)
				}
				return nil
			}
			if len(m.Data) < 4 {
				continue
			}
			f, err := decodeFlow(m.Data[4:])
			if err != nil {
				return err
			}
			f.FamilyType = uint8(family)
			// Kernels before 4.20 do not filter dumps by family.
			if (f.Forward.DstIP.To4() != nil) == (family == unix.AF_INET) {
				fn(f)
			}
		}
	}
}

// decodeFlow reads the attributes of one conntrack entry.
func decodeFlow(data []byte) (*vnl.ConntrackFlow, error) {
	f := &vnl.ConntrackFlow{}
	ad, err := netlink.NewAttributeDecoder(data)
	if err != nil {
		return nil, err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		switch ad.Type() {
		case ctaMark:
			f.Mark = ad.Uint32()
		case ctaTimeout:
			f.TimeOut = ad.Uint32()
		case ctaTupleOrig:
			ad.Nested(func(tuple *netlink.AttributeDecoder) error {
				tuple.ByteOrder = binary.BigEndian
				for tuple.Next() {
					switch tuple.Type() {
					case ctaTupleIP:
						tuple.Nested(func(ip *netlink.AttributeDecoder) error {
							for ip.Next() {
								switch ip.Type() {
								case ctaIPv4Src, ctaIPv6Src:
									f.Forward.SrcIP = net.IP(slices.Clone(ip.Bytes()))
								case ctaIPv4Dst, ctaIPv6Dst:
									f.Forward.DstIP = net.IP(slices.Clone(ip.Bytes()))
								}
							}
							return nil
						})
					case ctaTupleProto:
						tuple.Nested(func(proto *netlink.AttributeDecoder) error {
							proto.ByteOrder = binary.BigEndian
							for proto.Next() {
								switch proto.Type() {
								case ctaProtoNum:
									f.Forward.Protocol = proto.Uint8()
								case ctaProtoSrcPort:
									f.Forward.SrcPort = proto.Uint16()
								case ctaProtoDstPort:
									f.Forward.DstPort = proto.Uint16()
								}
							}
							return nil
						})
					}
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return nil, fmt.Errorf("decoding a conntrack entry: %w", err)
	}
	return f, nil
}
