// Package attack crafts the packets of the lab's attacks on the tunnel's
// carrier and sends them from inside a network namespace: GRE from an
// arbitrary host, MPLS frames from an L2 neighbour, and plain packets to a
// tunnel IP; a Listener in the target pod counts what gets through. It only
// ever sends to the namespaces of the lab that runs it.
package attack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// UDP returns an IP packet (IPv4 or IPv6, the family of src and dst)
// carrying one UDP datagram.
func UDP(src, dst netip.AddrPort, payload []byte) []byte {
	udp := make([]byte, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], src.Port())
	binary.BigEndian.PutUint16(udp[2:], dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], payload)
	sum := l4Checksum(src.Addr(), dst.Addr(), unix.IPPROTO_UDP, udp)
	if sum == 0 {
		sum = 0xffff
	}
	binary.BigEndian.PutUint16(udp[6:], sum)
	return ipPacket(src.Addr(), dst.Addr(), unix.IPPROTO_UDP, udp)
}

// TCPAck returns an IP packet carrying a bare TCP ACK (no SYN: the
// mid-stream packet that conntrack picks up as a new ESTABLISHED entry)
// with sequence number seq.
func TCPAck(src, dst netip.AddrPort, seq uint32) []byte {
	return tcpSegment(src, dst, seq, 0x10)
}

// TCPSyn returns an IP packet carrying a TCP SYN with sequence number seq,
// the first packet of a connection.
func TCPSyn(src, dst netip.AddrPort, seq uint32) []byte {
	return tcpSegment(src, dst, seq, 0x02)
}

// tcpSegment returns an IP packet carrying a TCP segment without payload
// or options, with the given flags.
func tcpSegment(src, dst netip.AddrPort, seq uint32, flags byte) []byte {
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], seq)
	if flags&0x10 != 0 {
		binary.BigEndian.PutUint32(tcp[8:], seq^0x5a5a5a5a)
	}
	tcp[12] = 5 << 4 // data offset: 5 words
	tcp[13] = flags
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	binary.BigEndian.PutUint16(tcp[16:], l4Checksum(src.Addr(), dst.Addr(), unix.IPPROTO_TCP, tcp))
	return ipPacket(src.Addr(), dst.Addr(), unix.IPPROTO_TCP, tcp)
}

// l4Checksum is the checksum of a TCP or UDP segment with its pseudo
// header.
func l4Checksum(s, d netip.Addr, proto uint8, segment []byte) uint16 {
	var pseudo []byte
	pseudo = append(pseudo, s.AsSlice()...)
	pseudo = append(pseudo, d.AsSlice()...)
	if s.Is4() {
		pseudo = append(pseudo, 0, proto, byte(len(segment)>>8), byte(len(segment)))
	} else {
		pseudo = binary.BigEndian.AppendUint32(pseudo, uint32(len(segment)))
		pseudo = append(pseudo, 0, 0, 0, proto)
	}
	return checksum(append(pseudo, segment...))
}

// ipPacket puts an IPv4 or IPv6 header (TTL 64) before segment.
func ipPacket(s, d netip.Addr, proto uint8, segment []byte) []byte {
	if s.Is4() {
		h := make([]byte, 20)
		h[0] = 0x45
		binary.BigEndian.PutUint16(h[2:], uint16(20+len(segment)))
		h[8] = 64
		h[9] = proto
		copy(h[12:], s.AsSlice())
		copy(h[16:], d.AsSlice())
		binary.BigEndian.PutUint16(h[10:], checksum(h))
		return append(h, segment...)
	}
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(segment)))
	h[6] = proto
	h[7] = 64
	copy(h[8:], s.AsSlice())
	copy(h[24:], d.AsSlice())
	return append(h, segment...)
}

// SendRaw sends each of packets (whole IP packets of one family, any
// source address) from the namespace ns, through a raw socket that takes
// the header as it is (IPPROTO_RAW); the kernel routes each by its
// destination.
func SendRaw(ns netns.NsHandle, packets [][]byte) error {
	if len(packets) == 0 {
		return nil
	}
	return nsexec.Do(ns, func() error {
		family := unix.AF_INET
		if packets[0][0]>>4 == 6 {
			family = unix.AF_INET6
		}
		fd, err := unix.Socket(family, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		defer unix.Close(fd)
		for _, p := range packets {
			var sa unix.Sockaddr
			if family == unix.AF_INET {
				sa = &unix.SockaddrInet4{Addr: [4]byte(p[16:20])}
			} else {
				sa = &unix.SockaddrInet6{Addr: [16]byte(p[24:40])}
			}
			if err := unix.Sendto(fd, p, 0, sa); err != nil {
				return fmt.Errorf("sending a raw packet: %w", err)
			}
		}
		return nil
	})
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// EtherType of an IP packet (by its version nibble).
func EtherType(packet []byte) uint16 {
	if packet[0]>>4 == 6 {
		return unix.ETH_P_IPV6
	}
	return unix.ETH_P_IP
}

// GRE returns the GRE header (no key, no checksum) and inner, as the
// routers send it.
func GRE(inner []byte) []byte {
	h := []byte{0, 0, 0, 0}
	binary.BigEndian.PutUint16(h[2:], EtherType(inner))
	return append(h, inner...)
}

// MPLS returns one label stack entry (bottom of stack, TTL 64) and inner.
func MPLS(label uint32, inner []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, label<<12|1<<8|64), inner...)
}

// SendGRE sends payload (GRE) n times from the namespace ns to dst, through
// a raw socket of protocol 47: the kernel writes the outer header, with the
// source address its routes choose in ns for dst.
func SendGRE(ns netns.NsHandle, dst netip.Addr, payload []byte, n int) error {
	return nsexec.Do(ns, func() error {
		family, sa := unix.AF_INET6, unix.Sockaddr(&unix.SockaddrInet6{Addr: dst.As16()})
		if dst.Is4() {
			family, sa = unix.AF_INET, &unix.SockaddrInet4{Addr: dst.As4()}
		}
		fd, err := unix.Socket(family, unix.SOCK_RAW, unix.IPPROTO_GRE)
		if err != nil {
			return fmt.Errorf("raw GRE socket: %w", err)
		}
		defer unix.Close(fd)
		for range n {
			if err := unix.Sendto(fd, payload, 0, sa); err != nil {
				return fmt.Errorf("sending GRE to %v: %w", dst, err)
			}
		}
		return nil
	})
}

// SendFrame sends payload n times from the namespace ns as Ethernet frames
// of etherType on link to the MAC address dst (a packet socket: the kernel
// writes the Ethernet header with link's own address).
func SendFrame(ns netns.NsHandle, link string, dst net.HardwareAddr, etherType uint16, payload []byte, n int) error {
	return nsexec.Do(ns, func() error {
		ifi, err := net.InterfaceByName(link)
		if err != nil {
			return err
		}
		proto := htons(etherType)
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(proto))
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Ifindex: ifi.Index, Protocol: proto, Halen: uint8(len(dst))}
		copy(sa.Addr[:], dst)
		for range n {
			if err := unix.Sendto(fd, payload, 0, sa); err != nil {
				return fmt.Errorf("sending a frame on %s to %v: %w", link, dst, err)
			}
		}
		return nil
	})
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// LinkMAC returns the MAC address of link in the namespace ns.
func LinkMAC(ns netns.NsHandle, link string) (net.HardwareAddr, error) {
	var mac net.HardwareAddr
	err := nsexec.Do(ns, func() error {
		ifi, err := net.InterfaceByName(link)
		if err != nil {
			return err
		}
		mac = ifi.HardwareAddr
		return nil
	})
	return mac, err
}

// Listener counts the UDP datagrams that reach a port of a pod, by
// payload: each attack sends its own token, so that the attacks of a round
// run at once and are counted apart.
type Listener struct {
	conns []net.PacketConn
	mu    sync.Mutex
	seen  map[string]int
}

// Listen opens UDP sockets on port in the namespace ns, on every IPv4 and
// every IPv6 address (the tunnel IPs and the pod IPs alike).
func Listen(ns netns.NsHandle, port int) (*Listener, error) {
	l := &Listener{seen: map[string]int{}}
	err := nsexec.Do(ns, func() error {
		for _, network := range []string{"udp4", "udp6"} {
			c, err := net.ListenPacket(network, fmt.Sprintf(":%d", port))
			if err != nil {
				return fmt.Errorf("listening on %s port %d: %w", network, port, err)
			}
			l.conns = append(l.conns, c)
		}
		return nil
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	for _, c := range l.conns {
		go l.read(c)
	}
	return l, nil
}

func (l *Listener) read(c net.PacketConn) {
	buf := make([]byte, 2048)
	for {
		n, _, err := c.ReadFrom(buf)
		if errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		l.mu.Lock()
		l.seen[string(buf[:n])]++
		l.mu.Unlock()
	}
}

// Count returns how many datagrams carrying token arrived.
func (l *Listener) Count(token string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.seen[token]
}

// Close closes the sockets.
func (l *Listener) Close() {
	for _, c := range l.conns {
		c.Close()
	}
}

// Settle is how long the attacks' packets are given to arrive.
const Settle = time.Second

// SendUDP sends payload n times from the namespace ns to dst, from an
// ordinary UDP socket (the address its routes choose in ns).
func SendUDP(ns netns.NsHandle, dst netip.AddrPort, payload []byte, n int) error {
	return nsexec.Do(ns, func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
		if err != nil {
			return fmt.Errorf("dialing %v: %w", dst, err)
		}
		defer c.Close()
		for range n {
			if _, err := c.Write(payload); err != nil {
				return fmt.Errorf("sending to %v: %w", dst, err)
			}
		}
		return nil
	})
}
