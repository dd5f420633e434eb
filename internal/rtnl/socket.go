package rtnl

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// Socket sizing. The send buffer must hold one batch (netlink rejects a
// sendmsg larger than sk_sndbuf with EMSGSIZE); the receive buffer must hold
// the acks of one batch, each a separate skb of about ackTruesize bytes of
// accounted memory, or the kernel drops them and reports ENOBUFS.
const (
	sendBufferSize = 4 << 20
	recvBufferSize = 8 << 20
	// readBufferSize bounds one datagram. Dump skbs are capped by the kernel
	// at 32 KiB; a larger reply is reported as truncated.
	readBufferSize = 64 << 10
	// replyTimeout bounds a wait for a reply the kernel owes us. Requests are
	// processed inside sendmsg, so waiting at all is unusual.
	replyTimeout = 30 * time.Second
)

// conn is a non-blocking NETLINK_ROUTE socket.
type conn struct {
	fd int
}

// dialAt opens a NETLINK_ROUTE socket in network namespace ns (the current
// one if ns is not open). The socket stays in ns for its lifetime, so no
// later call switches namespaces.
func dialAt(ns netns.NsHandle) (*conn, error) {
	fd, err := nsexec.NetlinkSocket(ns, unix.NETLINK_ROUTE, unix.SOCK_NONBLOCK)
	if err != nil {
		return nil, err
	}
	c := &conn{fd: fd}
	if err := c.configure(); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

// configure sets buffer sizes and netlink options. Forcing the buffers past
// net.core.{w,r}mem_max needs CAP_NET_ADMIN, which programming routes needs
// anyway; without it the capped sizes are used and batches shrink.
func (c *conn) configure() error {
	if err := c.setBuffer(unix.SO_SNDBUFFORCE, unix.SO_SNDBUF, sendBufferSize); err != nil {
		return err
	}
	if err := c.setBuffer(unix.SO_RCVBUFFORCE, unix.SO_RCVBUF, recvBufferSize); err != nil {
		return err
	}
	// Errors carry the kernel's message but not a copy of the request.
	for _, opt := range []int{unix.NETLINK_EXT_ACK, unix.NETLINK_CAP_ACK, unix.NETLINK_GET_STRICT_CHK} {
		if err := unix.SetsockoptInt(c.fd, unix.SOL_NETLINK, opt, 1); err != nil {
			return fmt.Errorf("set netlink socket option %d: %w", opt, err)
		}
	}
	return nil
}

func (c *conn) setBuffer(force, plain, size int) error {
	if unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, force, size) == nil {
		return nil
	}
	if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, plain, size); err != nil {
		return fmt.Errorf("set netlink socket buffer: %w", err)
	}
	return nil
}

// bufferSizes returns the receive buffer the kernel accounts acks against
// and the send buffer that bounds one sendmsg, as the kernel set them.
func (c *conn) bufferSizes() (rcvbuf, sndbuf int, err error) {
	if rcvbuf, err = unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUF); err != nil {
		return 0, 0, fmt.Errorf("get netlink receive buffer size: %w", err)
	}
	if sndbuf, err = unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_SNDBUF); err != nil {
		return 0, 0, fmt.Errorf("get netlink send buffer size: %w", err)
	}
	return rcvbuf, sndbuf, nil
}

func (c *conn) close() error { return unix.Close(c.fd) }

// send writes one datagram holding one or more requests. The kernel handles
// every request before the call returns.
func (c *conn) send(b []byte) error {
	for {
		n, err := unix.Write(c.fd, b)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			if err := c.wait(unix.POLLOUT); err != nil {
				return err
			}
			continue
		case err != nil:
			return fmt.Errorf("send netlink request: %w", err)
		case n != len(b):
			return fmt.Errorf("send netlink request: short write of %d of %d bytes", n, len(b))
		}
		return nil
	}
}

// errWouldBlock is returned by recv when nothing is queued.
var errWouldBlock = errors.New("no netlink message queued")

// recv reads one datagram into buf without blocking. It returns
// errWouldBlock when the queue is empty and unix.ENOBUFS when the kernel had
// to drop messages for us since the last read.
func (c *conn) recv(buf []byte) (int, error) {
	for {
		n, _, errno := unix.Syscall6(unix.SYS_RECVFROM, uintptr(c.fd),
			uintptr(unsafe.Pointer(unsafe.SliceData(buf))), uintptr(len(buf)),
			unix.MSG_DONTWAIT|unix.MSG_TRUNC, 0, 0)
		switch {
		case errno == unix.EINTR:
			continue
		case errno == unix.EAGAIN:
			return 0, errWouldBlock
		case errno == unix.ENOBUFS:
			return 0, unix.ENOBUFS
		case errno != 0:
			return 0, fmt.Errorf("receive netlink reply: %w", errno)
		case int(n) > len(buf):
			return 0, fmt.Errorf("receive netlink reply: %d-byte datagram truncated to %d", n, len(buf))
		}
		return int(n), nil
	}
}

// recvWait is recv that waits up to replyTimeout for a datagram.
func (c *conn) recvWait(buf []byte) (int, error) {
	for {
		n, err := c.recv(buf)
		if err != errWouldBlock {
			return n, err
		}
		if err := c.wait(unix.POLLIN); err != nil {
			return 0, err
		}
	}
}

// wait blocks until the socket is ready for events or replyTimeout passes.
func (c *conn) wait(events int16) error {
	fds := []unix.PollFd{{Fd: int32(c.fd), Events: events}}
	deadline := time.Now().Add(replyTimeout)
	for {
		timeout := time.Until(deadline)
		if timeout <= 0 {
			return fmt.Errorf("netlink socket: no reply within %s", replyTimeout)
		}
		n, err := unix.Poll(fds, int(timeout/time.Millisecond)+1)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return fmt.Errorf("poll netlink socket: %w", err)
		case n > 0:
			return nil
		}
	}
}
