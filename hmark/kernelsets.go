package hmark

import (
	"encoding/binary"
	"fmt"

	mdnetlink "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// HashSizedSets is implemented by IPSets that can give a hash set its
// initial number of buckets (ipset's hashsize) and swap two sets. The
// kernel grows a hash set only when userspace adds to it, never from the
// packet path (the SET target), so a set that only packets fill, a SYN
// set, keeps the buckets it is created with, each of at most 12 entries:
// with the default 1024, a SYN set is full at 12288 entries whatever its
// maxelem. Chain creates its SYN sets through it when its IPSets has it
// (KernelSets has; the router's metrics wrapper passes it on), and with
// IpsetCreate otherwise; it replaces a SYN set created smaller (by an
// earlier version) with a swap.
type HashSizedSets interface {
	IpsetCreateHashSize(setname, typename string, options netlink.IpsetCreateOptions, hashSize uint32) error
	IpsetSwap(setname, othersetname string) error
}

// SynSetHashSize is the number of buckets a SYN set is created with:
// SynSetMaxElements fills them 8 deep on average, below the 12 a bucket
// holds, so a flood fills a SYN set close to SynSetMaxElements. Its
// bucket table takes 128 KiB of the kernel's memory (8 bytes a bucket),
// allocated when the set is created.
const SynSetHashSize = SynSetMaxElements / 8

// KernelSets is the router's IPSets: vishvananda/netlink's handle, and a
// create that sets a hash set's initial size, which that handle cannot
// send (v1.3.1).
type KernelSets struct {
	*netlink.Handle
	// NetNS is the namespace the handle was opened in; 0 or netns.None()
	// is the caller's.
	NetNS netns.NsHandle
}

// IpsetCreateHashSize implements HashSizedSets: it creates a hash set
// of typename with hashSize buckets, the family, maxelem and timeout of
// options (the other options are not sent), revision 1 unless options
// says otherwise. It fails if the set exists.
func (k KernelSets) IpsetCreateHashSize(setname, typename string, options netlink.IpsetCreateOptions, hashSize uint32) error {
	revision := options.Revision
	if revision == 0 {
		revision = 1 // the lowest, as vishvananda/netlink sends for a set without counters or comments
	}
	family := options.Family
	if family == 0 {
		family = unix.AF_INET
	}
	netUint32 := func(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
	ae := mdnetlink.NewAttributeEncoder()
	ae.Uint8(nl.IPSET_ATTR_PROTOCOL, nl.IPSET_PROTOCOL)
	ae.String(nl.IPSET_ATTR_SETNAME, setname)
	ae.String(nl.IPSET_ATTR_TYPENAME, typename)
	ae.Uint8(nl.IPSET_ATTR_REVISION, revision)
	ae.Uint8(nl.IPSET_ATTR_FAMILY, family)
	ae.Nested(nl.IPSET_ATTR_DATA, func(d *mdnetlink.AttributeEncoder) error {
		d.Bytes(nl.IPSET_ATTR_HASHSIZE|nl.NLA_F_NET_BYTEORDER, netUint32(hashSize))
		if options.MaxElements != 0 {
			d.Bytes(nl.IPSET_ATTR_MAXELEM|nl.NLA_F_NET_BYTEORDER, netUint32(options.MaxElements))
		}
		if options.Timeout != nil {
			d.Bytes(nl.IPSET_ATTR_TIMEOUT|nl.NLA_F_NET_BYTEORDER, netUint32(*options.Timeout))
		}
		return nil
	})
	attrs, err := ae.Encode()
	if err != nil {
		return fmt.Errorf("ipset create %s: %w", setname, err)
	}
	conn, err := mdnetlink.Dial(unix.NETLINK_NETFILTER, &mdnetlink.Config{NetNS: k.netNS()})
	if err != nil {
		return fmt.Errorf("ipset create %s: netlink: %w", setname, err)
	}
	defer conn.Close()
	_, err = conn.Execute(mdnetlink.Message{
		Header: mdnetlink.Header{
			Type:  mdnetlink.HeaderType(unix.NFNL_SUBSYS_IPSET<<8 | nl.IPSET_CMD_CREATE),
			Flags: mdnetlink.Request | mdnetlink.Acknowledge | mdnetlink.Create | mdnetlink.Excl,
		},
		// nfgenmsg (as vishvananda/netlink sends it), then the attributes.
		Data: append([]byte{unix.AF_NETLINK, nl.NFNETLINK_V0, 0, 0}, attrs...),
	})
	if err != nil {
		return fmt.Errorf("ipset create %s (%s, hashsize %d): %w", setname, typename, hashSize, err)
	}
	return nil
}

// netNS is the namespace for mdlayher/netlink's Config (0: the caller's).
func (k KernelSets) netNS() int {
	if k.NetNS <= 0 {
		return 0
	}
	return int(k.NetNS)
}
