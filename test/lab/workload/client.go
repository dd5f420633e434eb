package workload

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// udpRetry is how often Who resends a UDP request that got no answer yet.
const udpRetry = 250 * time.Millisecond

// Who asks dst over network "tcp" or "udp", from network namespace ns and
// from local port srcPort when nonzero (so the flow's 5-tuple, and with it
// its hash bucket, is fixed), which pod answers. Over UDP the reply must come
// from dst itself (the socket is connected); the request is resent until the
// reply arrives or ctx ends.
func Who(ctx context.Context, ns netns.NsHandle, network string, dst netip.AddrPort, srcPort uint16) (Identity, error) {
	return WhoFrom(ctx, ns, network, dst, netip.AddrPortFrom(netip.Addr{}, srcPort))
}

// WhoFrom is Who from the local address and port src (either may be zero:
// any); the address must be one of the namespace's. UDP takes src's port
// only.
func WhoFrom(ctx context.Context, ns netns.NsHandle, network string, dst, src netip.AddrPort) (Identity, error) {
	srcPort := src.Port()
	var id Identity
	var err error
	switch network {
	case "tcp":
		err = withTCPFrom(ctx, ns, dst, src, func(c *net.TCPConn) error {
			if _, err := io.WriteString(c, "WHO\n"); err != nil {
				return err
			}
			reply, err := io.ReadAll(c) // the server closes after its line
			if err != nil {
				return err
			}
			id, err = parseIdentity(string(reply))
			return err
		})
	case "udp":
		id, err = whoUDP(ctx, ns, dst, srcPort)
	default:
		err = fmt.Errorf("unknown network %q", network)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("WHO %s %s from %v %s: %w", network, dst, ns, src, err)
	}
	return id, nil
}

func whoUDP(ctx context.Context, ns netns.NsHandle, dst netip.AddrPort, srcPort uint16) (Identity, error) {
	var c net.Conn
	err := nsexec.Do(ns, func() error {
		var err error
		c, err = dialer(srcPort, "udp").DialContext(ctx, family("udp", dst.Addr()), dst.String())
		return err
	})
	if err != nil {
		return Identity{}, err
	}
	defer c.Close()
	defer context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })()
	buf := make([]byte, 1500)
	var refused error // an ICMP port unreachable for an earlier datagram
	for {
		_, err := c.Write([]byte("WHO"))
		if err == nil {
			_ = c.SetReadDeadline(time.Now().Add(udpRetry))
			if ctx.Err() == nil {
				var n int
				if n, err = c.Read(buf); err == nil {
					return parseIdentity(string(buf[:n]))
				}
			}
		}
		var ne net.Error
		switch {
		case ctx.Err() != nil:
			err = fmt.Errorf("no reply from %s (the socket is connected: replies from other addresses are dropped): %w", dst, ctx.Err())
			if refused != nil {
				err = fmt.Errorf("%w (earlier: %v)", err, refused)
			}
			return Identity{}, err
		case errors.Is(err, syscall.ECONNREFUSED):
			// Keep asking until ctx ends: the port may be opening.
			refused = err
			time.Sleep(udpRetry / 5)
		case errors.As(err, &ne) && ne.Timeout():
		default:
			return Identity{}, err
		}
	}
}

// Upload sends n bytes of Payload(n) to dst from network namespace ns
// ("SINK n") and checks that the server got exactly those bytes; it returns
// who took them.
func Upload(ctx context.Context, ns netns.NsHandle, dst netip.AddrPort, n int) (Identity, error) {
	var id Identity
	err := withTCP(ctx, ns, dst, 0, func(c *net.TCPConn) error {
		if _, err := fmt.Fprintf(c, "SINK %d\n", n); err != nil {
			return err
		}
		h := sha256.New()
		if _, err := io.Copy(io.MultiWriter(c, h), Payload(n)); err != nil {
			return err
		}
		reply, err := io.ReadAll(c)
		if err != nil {
			return err
		}
		fields, err := parseFields(string(reply))
		if err != nil {
			return err
		}
		if want := strconv.Itoa(n); fields["got"] != want {
			return fmt.Errorf("server got %s bytes, sent %s", fields["got"], want)
		}
		if want := hex.EncodeToString(h.Sum(nil)); fields["sha256"] != want {
			return fmt.Errorf("server got sha256 %s, sent %s", fields["sha256"], want)
		}
		id, err = identityFrom(fields)
		return err
	})
	if err != nil {
		return Identity{}, fmt.Errorf("upload %d bytes to %s from %v: %w", n, dst, ns, err)
	}
	return id, nil
}

// Download asks dst, from network namespace ns, for n bytes ("SOURCE n") and
// checks they are exactly Payload(n).
func Download(ctx context.Context, ns netns.NsHandle, dst netip.AddrPort, n int) error {
	err := withTCP(ctx, ns, dst, 0, func(c *net.TCPConn) error {
		if _, err := fmt.Fprintf(c, "SOURCE %d\n", n); err != nil {
			return err
		}
		want := Payload(n)
		got := bufio.NewReaderSize(c, 64<<10)
		wbuf, gbuf := make([]byte, 32<<10), make([]byte, 32<<10)
		for off := 0; ; {
			k, err := got.Read(gbuf)
			if k > 0 {
				w, _ := io.ReadFull(want, wbuf[:k])
				if w < k {
					return fmt.Errorf("server sent more than %d bytes", n)
				}
				if i := firstDiff(gbuf[:k], wbuf[:k]); i >= 0 {
					return fmt.Errorf("byte %d differs", off+i)
				}
				off += k
			}
			if err == io.EOF {
				if off != n {
					return fmt.Errorf("got %d bytes, want %d", off, n)
				}
				return nil
			}
			if err != nil {
				return fmt.Errorf("after %d bytes: %w", off, err)
			}
		}
	})
	if err != nil {
		return fmt.Errorf("download %d bytes from %s to %v: %w", n, dst, ns, err)
	}
	return nil
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// withTCP dials dst from namespace ns, runs fn with the connection under
// ctx's deadline and cancellation, and closes it.
func withTCP(ctx context.Context, ns netns.NsHandle, dst netip.AddrPort, srcPort uint16, fn func(*net.TCPConn) error) error {
	return withTCPFrom(ctx, ns, dst, netip.AddrPortFrom(netip.Addr{}, srcPort), fn)
}

// withTCPFrom is withTCP from local address and port src.
func withTCPFrom(ctx context.Context, ns netns.NsHandle, dst, src netip.AddrPort, fn func(*net.TCPConn) error) error {
	c, err := dialTCPFrom(ctx, ns, dst, src)
	if err != nil {
		return err
	}
	defer c.Close()
	defer context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })()
	if d, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(d)
	}
	return ctxErr(ctx, fn(c))
}

// dialTCP connects to dst from a thread inside namespace ns; the connection
// stays in ns and is used from any goroutine afterwards.
//
// Tests reuse fixed source ports: the same 4-tuple again right away, maybe
// towards another pod. A client socket in TIME_WAIT would make that connect
// fail (EADDRNOTAVAIL) for a minute, so the client never gets there:
//   - SO_REUSEADDR before bind lets the port be bound while an older socket
//     with it still exists, e.g. another flow to a different destination;
//   - SO_LINGER 0 makes Close send a RST and drop the socket at once instead
//     of a FIN that leads to TIME_WAIT;
//   - the server closes first after each reply and the client reads until
//     EOF before closing, so the RST never discards data in flight (for ECHO,
//     Stream.Stop waits for every echoed byte before closing).
//
// The RST also removes the server's FIN_WAIT2 socket, so neither side keeps
// state for the 4-tuple.
func dialTCP(ctx context.Context, ns netns.NsHandle, dst netip.AddrPort, srcPort uint16) (*net.TCPConn, error) {
	return dialTCPFrom(ctx, ns, dst, netip.AddrPortFrom(netip.Addr{}, srcPort))
}

// dialTCPFrom is dialTCP from local address and port src.
func dialTCPFrom(ctx context.Context, ns netns.NsHandle, dst, src netip.AddrPort) (*net.TCPConn, error) {
	var c net.Conn
	err := nsexec.Do(ns, func() error {
		var err error
		d := dialer(src.Port(), "tcp")
		if src.Addr().IsValid() {
			d.LocalAddr = &net.TCPAddr{IP: src.Addr().AsSlice(), Port: int(src.Port())}
		}
		c, err = d.DialContext(ctx, family("tcp", dst.Addr()), dst.String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	tc := c.(*net.TCPConn)
	if err := tc.SetLinger(0); err != nil {
		tc.Close()
		return nil, fmt.Errorf("SO_LINGER 0: %w", err)
	}
	return tc, nil
}

// family is network ("tcp", "udp") limited to a's address family: "tcp4"
// or "tcp6", ...
func family(network string, a netip.Addr) string {
	if a.Is4() || a.Is4In6() {
		return network + "4"
	}
	return network + "6"
}

// dialer binds the local port srcPort (any port when 0) with SO_REUSEADDR.
func dialer(srcPort uint16, network string) *net.Dialer {
	var local net.Addr = &net.TCPAddr{Port: int(srcPort)}
	if network == "udp" {
		local = &net.UDPAddr{Port: int(srcPort)}
	}
	return &net.Dialer{
		LocalAddr: local,
		Control: func(_, _ string, rc syscall.RawConn) error {
			var sockErr error
			if err := rc.Control(func(fd uintptr) {
				sockErr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
			}); err != nil {
				return err
			}
			return sockErr
		},
	}
}

// ctxErr reports ctx's error instead of the deadline error it caused.
func ctxErr(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
	}
	return err
}
