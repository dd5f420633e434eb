package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// IPv6 addresses have no label (IFA_LABEL is IPv4's), so the agent marks
// the IPv6 tunnel IPs it adds to a pod's lo with an address protocol
// (IFA_PROTO, "proto N" in iproute2 6.2 and later): a number the kernel
// stores with the address and reports in every dump, made for telling who
// added an address, as rtm_protocol does for routes. The kernel keeps it
// since Linux 5.18 (commit 47f0bd503210; Debian 12's 6.1 has it), and
// marks its own lo addresses with 1 (::1); older kernels ignore the
// attribute, and then the agent finds its address unmarked and refuses to
// serve it rather than take over an address it cannot tell from another's.
// vishvananda/netlink neither sends nor reads IFA_PROTO, hence these few
// requests of its own.

// ifaProto is IFA_PROTO (linux/if_addr.h): a u8, the address's protocol.
// golang.org/x/sys/unix does not define it yet.
const ifaProto = 11

// ifAddr is one interface address with what vishvananda/netlink leaves
// out: its address protocol.
type ifAddr struct {
	LinkIndex int
	Prefix    netip.Prefix
	Flags     uint32 // IFA_F_*
	Proto     uint8  // 0 when none was given
}

// addrConn is a NETLINK_ROUTE socket in a pod's network namespace for the
// address requests that carry an address protocol.
type addrConn struct {
	sockets map[int]*nl.SocketHandle
}

// netlinkTimeout bounds one request: a pod's namespace must never hold a
// worker for ever.
var netlinkTimeout = unix.Timeval{Sec: 30}

// dialAddrs opens an addrConn in ns. The socket is created on a thread
// that enters ns and is discarded afterwards (package nsexec); it belongs
// to ns for its whole life and is used from any thread.
func dialAddrs(ns netns.NsHandle) (*addrConn, error) {
	var s *nl.NetlinkSocket
	err := nsexec.Do(ns, func() error {
		var err error
		// Neither namespace open: the socket is made where the thread is.
		s, err = nl.GetNetlinkSocketAt(netns.None(), netns.None(), unix.NETLINK_ROUTE)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netlink socket in the pod namespace: %w", err)
	}
	if err := errors.Join(s.SetSendTimeout(&netlinkTimeout), s.SetReceiveTimeout(&netlinkTimeout)); err != nil {
		s.Close()
		return nil, fmt.Errorf("netlink socket timeouts: %w", err)
	}
	return &addrConn{sockets: map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: {Socket: s}}}, nil
}

// Close closes the socket.
func (c *addrConn) Close() { c.sockets[unix.NETLINK_ROUTE].Socket.Close() }

// list returns every address of family (unix.AF_INET6, unix.AF_INET) in
// the namespace.
func (c *addrConn) list(family int) ([]ifAddr, error) {
	for range 3 { // a dump interrupted by a change is read again
		req := nl.NewNetlinkRequest(unix.RTM_GETADDR, unix.NLM_F_DUMP)
		req.Sockets = c.sockets
		req.AddData(nl.NewIfAddrmsg(family))
		msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWADDR)
		if errors.Is(err, nl.ErrDumpInterrupted) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing addresses: %w", err)
		}
		out := make([]ifAddr, 0, len(msgs))
		for _, m := range msgs {
			a, err := parseIfAddr(m)
			if err != nil {
				return nil, fmt.Errorf("listing addresses: %w", err)
			}
			out = append(out, a)
		}
		return out, nil
	}
	return nil, errors.New("listing addresses: the dump was interrupted three times")
}

// add adds a, failing with EEXIST when the interface has the address
// already (whoever added it: an address is never taken over).
func (c *addrConn) add(a ifAddr) error {
	return c.do(addrRequest(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, a))
}

// del removes a's address from its interface.
func (c *addrConn) del(a ifAddr) error {
	return c.do(addrRequest(unix.RTM_DELADDR, 0, a))
}

func (c *addrConn) do(req *nl.NetlinkRequest) error {
	req.Sockets = c.sockets
	_, err := req.Execute(unix.NETLINK_ROUTE, 0)
	return err
}

// addrRequest builds an RTM_NEWADDR or RTM_DELADDR request for a, asking
// for an acknowledgement; a's flags and protocol go with it when set.
func addrRequest(typ, flags int, a ifAddr) *nl.NetlinkRequest {
	req := nl.NewNetlinkRequest(typ, flags|unix.NLM_F_ACK)
	ip := a.Prefix.Addr()
	family := unix.AF_INET6
	if ip.Is4() {
		family = unix.AF_INET
	}
	msg := nl.NewIfAddrmsg(family)
	msg.Prefixlen = uint8(a.Prefix.Bits())
	msg.Index = uint32(a.LinkIndex)
	msg.Flags = uint8(a.Flags) // the low 8 bits; IFA_FLAGS carries them all
	req.AddData(msg)
	b := ip.AsSlice()
	req.AddData(nl.NewRtAttr(unix.IFA_LOCAL, b))
	req.AddData(nl.NewRtAttr(unix.IFA_ADDRESS, b))
	if a.Flags != 0 {
		req.AddData(nl.NewRtAttr(unix.IFA_FLAGS, nl.Uint32Attr(a.Flags)))
	}
	if a.Proto != 0 {
		req.AddData(nl.NewRtAttr(ifaProto, nl.Uint8Attr(a.Proto)))
	}
	return req
}

// parseIfAddr reads one RTM_NEWADDR message (without its netlink header).
func parseIfAddr(b []byte) (ifAddr, error) {
	if len(b) < unix.SizeofIfAddrmsg {
		return ifAddr{}, fmt.Errorf("address message of %d bytes", len(b))
	}
	msg := nl.DeserializeIfAddrmsg(b)
	attrs, err := nl.ParseRouteAttr(b[unix.SizeofIfAddrmsg:])
	if err != nil {
		return ifAddr{}, fmt.Errorf("address attributes: %w", err)
	}
	a := ifAddr{LinkIndex: int(msg.Index), Flags: uint32(msg.Flags)}
	var address, local net.IP
	for _, attr := range attrs {
		switch attr.Attr.Type {
		case unix.IFA_ADDRESS:
			address = attr.Value
		case unix.IFA_LOCAL:
			local = attr.Value
		case unix.IFA_FLAGS:
			if len(attr.Value) >= 4 {
				a.Flags = nl.NativeEndian().Uint32(attr.Value)
			}
		case ifaProto:
			if len(attr.Value) >= 1 {
				a.Proto = attr.Value[0]
			}
		}
	}
	// IPv4 gives the address as IFA_LOCAL (IFA_ADDRESS is a peer's); IPv6
	// sends only IFA_ADDRESS unless there is a peer.
	if local != nil {
		address = local
	}
	ip, ok := netip.AddrFromSlice(address)
	if !ok {
		return ifAddr{}, fmt.Errorf("address message without a valid address (%d bytes)", len(address))
	}
	if msg.Family == unix.AF_INET {
		ip = ip.Unmap()
	}
	if int(msg.Prefixlen) > ip.BitLen() {
		return ifAddr{}, fmt.Errorf("address %v with prefix length %d", ip, msg.Prefixlen)
	}
	a.Prefix = netip.PrefixFrom(ip, int(msg.Prefixlen))
	return a, nil
}
