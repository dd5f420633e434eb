package workload

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// maxTransfer bounds SINK and SOURCE sizes, so a garbled command cannot make
// a server stream forever.
const maxTransfer = 1 << 30

// Server answers the workload protocol as one pod. Its sockets were opened
// inside the pod's network namespace; its goroutines run anywhere.
type Server struct {
	name      string
	listeners []net.Listener
	udp       []*net.UDPConn

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// Serve starts, inside network namespace ns, TCP listeners on 0.0.0.0:port
// and [::]:port for each of tcpPorts and UDP sockets on 0.0.0.0:port and
// [::]:port for each of udpPorts, answering as pod name. The IPv6 sockets
// are IPv6-only: IPv4 clients reach the IPv4 ones as they always did.
// Close stops it.
func Serve(ns netns.NsHandle, name string, tcpPorts, udpPorts []int) (*Server, error) {
	s := &Server{name: name, conns: map[net.Conn]struct{}{}}
	err := nsexec.Do(ns, func() error {
		for _, network := range []string{"tcp4", "tcp6"} {
			for _, port := range tcpPorts {
				// Go makes "tcp6" sockets IPV6_V6ONLY.
				ln, err := net.ListenTCP(network, &net.TCPAddr{Port: port})
				if err != nil {
					return fmt.Errorf("listen %s port %d: %w", network, port, err)
				}
				s.listeners = append(s.listeners, ln)
			}
		}
		for _, network := range []string{"udp4", "udp6"} {
			for _, port := range udpPorts {
				c, err := listenUDPPktinfo(network, port)
				if err != nil {
					return fmt.Errorf("listen %s port %d: %w", network, port, err)
				}
				s.udp = append(s.udp, c)
			}
		}
		return nil
	})
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("workload server %s in %v: %w", name, ns, err)
	}
	for _, ln := range s.listeners {
		s.wg.Add(1)
		go s.acceptLoop(ln)
	}
	for _, c := range s.udp {
		s.wg.Add(1)
		go s.udpLoop(c)
	}
	return s, nil
}

// Close stops the listeners, closes every open connection (clients see them
// end) and waits for all of the server's goroutines.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	var errs []error
	for _, ln := range s.listeners {
		errs = append(errs, ln.Close())
	}
	for _, c := range s.udp {
		errs = append(errs, c.Close())
	}
	s.wg.Wait()
	return errors.Join(errs...)
}

// Peers returns the remote address and port of every open TCP connection,
// e.g. to tell which pod each of the client's long-lived streams reached.
func (s *Server) Peers() []netip.AddrPort {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]netip.AddrPort, 0, len(s.conns))
	for c := range s.conns {
		out = append(out, addrPort(c.RemoteAddr()))
	}
	return out
}

// track registers an accepted connection so Close can end it; it returns
// false when the server is already closing.
func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	return true
}

func (s *Server) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	_ = c.Close()
	s.wg.Done()
}

func (s *Server) acceptLoop(ln net.Listener) {
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return // closed
		}
		if !s.track(c) {
			_ = c.Close()
			return
		}
		go func() {
			defer s.untrack(c)
			_ = s.handleTCP(c)
		}()
	}
}

// handleTCP serves one command. The server closes first after every reply
// except ECHO (see dialTCP for why that matters to the client).
func (s *Server) handleTCP(c net.Conn) error {
	id := Identity{Pod: s.name, Peer: addrPort(c.RemoteAddr()), Local: addrPort(c.LocalAddr())}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return err
	}
	cmd, arg, _ := strings.Cut(strings.TrimSpace(line), " ")
	switch cmd {
	case "WHO":
		_, err = fmt.Fprintf(c, "%s\n", id)
		return err
	case "SINK":
		n, err := transferSize(arg)
		if err != nil {
			return err
		}
		h := sha256.New()
		got, err := io.CopyN(h, r, int64(n))
		if err != nil {
			return fmt.Errorf("SINK %d: got %d bytes: %w", n, got, err)
		}
		_, err = fmt.Fprintf(c, "got=%d sha256=%s %s\n", got, hex.EncodeToString(h.Sum(nil)), id)
		return err
	case "SOURCE":
		n, err := transferSize(arg)
		if err != nil {
			return err
		}
		_, err = io.Copy(c, Payload(n))
		return err
	case "ECHO":
		_, err = io.Copy(c, r)
		return err
	default:
		_, _ = fmt.Fprintf(c, "error unknown command %q\n", cmd)
		return fmt.Errorf("unknown command %q", cmd)
	}
}

func transferSize(arg string) (int, error) {
	n, err := strconv.Atoi(arg)
	if err != nil || n < 0 || n > maxTransfer {
		return 0, fmt.Errorf("bad size %q", arg)
	}
	return n, nil
}

// listenUDPPktinfo opens a UDP socket on 0.0.0.0:port ("udp4") or [::]:port
// ("udp6", IPv6 only) that reports each datagram's destination address
// (IP_PKTINFO, IPV6_RECVPKTINFO), so replies can be sent from it. Called on
// a thread inside the pod's namespace.
func listenUDPPktinfo(network string, port int) (*net.UDPConn, error) {
	c, err := net.ListenUDP(network, &net.UDPAddr{Port: port})
	if err != nil {
		return nil, err
	}
	level, opt, name := unix.IPPROTO_IP, unix.IP_PKTINFO, "IP_PKTINFO"
	if network == "udp6" {
		level, opt, name = unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, "IPV6_RECVPKTINFO"
	}
	raw, err := c.SyscallConn()
	if err != nil {
		c.Close()
		return nil, err
	}
	var sockErr error
	if err := raw.Control(func(fd uintptr) {
		sockErr = unix.SetsockoptInt(int(fd), level, opt, 1)
	}); err != nil {
		sockErr = err
	}
	if sockErr != nil {
		c.Close()
		return nil, fmt.Errorf("setsockopt %s: %w", name, sockErr)
	}
	return c, nil
}

// udpLoop answers "WHO" datagrams. The tunnel IP is only one of the pod's
// addresses and the socket is bound to the wildcard address, so the
// destination of each request comes from its packet info and the reply
// carries it back as the source address (ipi_spec_dst, ipi6_addr);
// otherwise the kernel would pick the source by route and the client would
// get the answer from an address it never asked.
func (s *Server) udpLoop(c *net.UDPConn) {
	defer s.wg.Done()
	port := uint16(c.LocalAddr().(*net.UDPAddr).Port)
	buf := make([]byte, 1500)
	oob := make([]byte, unix.CmsgSpace(max(unix.SizeofInet4Pktinfo, unix.SizeofInet6Pktinfo)))
	for {
		n, oobn, _, peer, err := c.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if strings.TrimSpace(string(buf[:n])) != "WHO" {
			continue
		}
		dst, ok := pktinfoDst(oob[:oobn])
		if !ok {
			continue
		}
		id := Identity{Pod: s.name, Peer: unmap(peer), Local: netip.AddrPortFrom(dst, port)}
		var src []byte
		if dst.Is4() {
			src = unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: dst.As4()})
		} else {
			src = unix.PktInfo6(&unix.Inet6Pktinfo{Addr: dst.As16()})
		}
		_, _, _ = c.WriteMsgUDPAddrPort([]byte(id.String()), src, peer)
	}
}

// pktinfoDst returns the header destination address (ipi_addr, ipi6_addr)
// from the control messages of a received datagram.
func pktinfoDst(oob []byte) (netip.Addr, bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}, false
	}
	for _, m := range msgs {
		switch {
		// struct in_pktinfo { int ipi_ifindex; in_addr ipi_spec_dst; in_addr ipi_addr; }
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			return netip.AddrFrom4([4]byte(m.Data[8:12])), true
		// struct in6_pktinfo { in6_addr ipi6_addr; int ipi6_ifindex; }
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			return netip.AddrFrom16([16]byte(m.Data[0:16])), true
		}
	}
	return netip.Addr{}, false
}

func addrPort(a net.Addr) netip.AddrPort {
	if ap, err := netip.ParseAddrPort(a.String()); err == nil {
		return unmap(ap)
	}
	return netip.AddrPort{}
}

func unmap(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
