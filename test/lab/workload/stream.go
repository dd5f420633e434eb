package workload

import (
	"context"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/vishvananda/netns"
)

// StreamOptions shape a Stream's traffic; zero values take the defaults.
type StreamOptions struct {
	// ChunkSize is how many bytes are sent per tick (default 1 KiB).
	ChunkSize int
	// Interval is the time between chunks (default 10 ms).
	Interval time.Duration
	// DialTimeout bounds the connection setup (default 5 s): the
	// handshake and, for a Greeted stream, the greeting.
	DialTimeout time.Duration
	// GreetTimeout, when longer than what DialTimeout leaves after the
	// handshake, bounds the wait for the greeting instead: a slow server
	// then delays the stream rather than failing it, while a greeting
	// that never comes (a broken path) still fails it (Stream.Greeted
	// tells how long it took).
	GreetTimeout time.Duration
	// Greeted streams talk to a plain echo server that first sends one
	// line, such as examples/echo.yaml's "pod=NAME" (Stream.Greeting),
	// instead of this package's server: no ECHO command is sent.
	Greeted bool
}

// StreamStats is a Stream's progress so far.
type StreamStats struct {
	// Sent is how many bytes were written to the connection.
	Sent int64
	// Verified is how many bytes came back echoed, in order and unchanged.
	Verified int64
	// LastVerified is when the last verified byte arrived (the start time
	// until then), to see how long a flow stalled.
	LastVerified time.Time
	// Err is the first failure: the connection broke or data came back wrong.
	Err error
}

// Stream is a long-lived ECHO connection that sends a numbered byte pattern
// at a steady rate and checks every echoed byte, to prove an established
// flow survives changes around it.
type Stream struct {
	conn     *net.TCPConn
	dst      netip.AddrPort
	opts     StreamOptions
	greeting string
	// connectTook and synRetransmits describe the handshake: how long the
	// connect took, and how many SYNs the kernel sent again meanwhile.
	connectTook    time.Duration
	synRetransmits uint32
	// greetTook is how long the greeting took after the handshake.
	greetTook time.Duration

	stop     chan struct{}
	stopOnce sync.Once
	sendDone chan struct{}
	recvDone chan struct{}

	mu       sync.Mutex
	stats    StreamStats
	stopping bool // errors from here on are our own doing
}

// StartStream opens an ECHO connection to dst from network namespace ns,
// from local port srcPort when nonzero, and starts sending.
func StartStream(ns netns.NsHandle, dst netip.AddrPort, srcPort uint16, opts StreamOptions) (*Stream, error) {
	return StartStreamFrom(ns, dst, netip.AddrPortFrom(netip.Addr{}, srcPort), opts)
}

// StartStreamFrom is StartStream from the local address and port src
// (either may be zero: any); the address must be one of the namespace's.
func StartStreamFrom(ns netns.NsHandle, dst, src netip.AddrPort, opts StreamOptions) (*Stream, error) {
	srcPort := src.Port()
	if opts.ChunkSize <= 0 {
		opts.ChunkSize = 1 << 10
	}
	if opts.Interval <= 0 {
		opts.Interval = 10 * time.Millisecond
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), opts.DialTimeout)
	defer cancel()
	dialed := time.Now()
	c, err := dialTCPFrom(ctx, ns, dst, src)
	connectTook := time.Since(dialed)
	var synRetransmits uint32
	var greeting string
	if err == nil {
		synRetransmits = retransmits(c)
		if opts.Greeted {
			greetCtx := ctx
			if d, ok := ctx.Deadline(); ok && time.Until(d) < opts.GreetTimeout {
				var cancel context.CancelFunc
				greetCtx, cancel = context.WithTimeout(context.Background(), opts.GreetTimeout)
				defer cancel()
			}
			greeting, err = readLine(greetCtx, c)
		} else {
			_, err = io.WriteString(c, "ECHO\n")
		}
		if err != nil {
			c.Close()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("stream to %s from %v port %d: %w", dst, ns, srcPort, err)
	}
	s := &Stream{
		conn: c, dst: dst, opts: opts, greeting: greeting, connectTook: connectTook, synRetransmits: synRetransmits,
		greetTook: time.Since(dialed) - connectTook,
		stop:      make(chan struct{}), sendDone: make(chan struct{}), recvDone: make(chan struct{}),
		stats: StreamStats{LastVerified: time.Now()},
	}
	go s.send()
	go s.receive()
	return s, nil
}

// readLine reads the server's first line, byte by byte so that nothing
// after it is consumed, within ctx's deadline.
func readLine(ctx context.Context, c *net.TCPConn) (string, error) {
	if d, ok := ctx.Deadline(); ok {
		_ = c.SetReadDeadline(d)
		defer c.SetReadDeadline(time.Time{})
	}
	var line []byte
	b := make([]byte, 1)
	for len(line) < 256 {
		if _, err := c.Read(b); err != nil {
			return "", fmt.Errorf("reading the greeting after %q: %w", line, err)
		}
		if b[0] == '\n' {
			return string(line), nil
		}
		line = append(line, b[0])
	}
	return "", fmt.Errorf("greeting longer than 256 bytes: %q", line)
}

// Greeting is the greeted server's first line, without its newline.
func (s *Stream) Greeting() string { return s.greeting }

// Handshake returns how long the connect took and how many SYNs the
// client's kernel retransmitted for it (a lost SYN or SYN-ACK costs one,
// and at least a second).
func (s *Stream) Handshake() (took time.Duration, synRetransmits uint32) {
	return s.connectTook, s.synRetransmits
}

// Greeted is how long a Greeted stream waited for its greeting after the
// handshake.
func (s *Stream) Greeted() time.Duration { return s.greetTook }

// retransmits reads the connection's retransmission count (TCP_INFO's
// tcpi_total_retrans); right after the connect, before any data, it
// counts the SYNs sent again. 0 when it cannot be read.
func retransmits(c *net.TCPConn) uint32 {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var n uint32
	_ = raw.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n = info.Total_retrans
		}
	})
	return n
}

// LocalPort is the client's port of the connection.
func (s *Stream) LocalPort() uint16 { return uint16(s.conn.LocalAddr().(*net.TCPAddr).Port) }

// streamByte is byte i of the pattern: consecutive 8-byte big-endian
// counters, so a lost, repeated or reordered chunk shows as a mismatch.
func streamByte(i int64) byte {
	return byte(uint64(i/8) >> (8 * (7 - i%8)))
}

// Stats returns the progress so far.
func (s *Stream) Stats() StreamStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// fail records the first error, unless Stop caused it.
func (s *Stream) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stats.Err == nil && !s.stopping {
		s.stats.Err = err
	}
}

func (s *Stream) send() {
	defer close(s.sendDone)
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	buf := make([]byte, s.opts.ChunkSize)
	var off int64
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		for i := range buf {
			buf[i] = streamByte(off + int64(i))
		}
		// A write blocks when the flow stalls; Stop unblocks it with a
		// deadline, and the part written still counts.
		n, err := s.conn.Write(buf)
		off += int64(n)
		s.mu.Lock()
		s.stats.Sent = off
		s.mu.Unlock()
		if err != nil {
			select {
			case <-s.stop: // Stop's deadline
			default:
				s.fail(fmt.Errorf("write after %d bytes: %w", off, err))
			}
			return
		}
	}
}

func (s *Stream) receive() {
	defer close(s.recvDone)
	buf := make([]byte, 32<<10)
	var off int64
	for {
		n, err := s.conn.Read(buf)
		for i := range n {
			if buf[i] != streamByte(off+int64(i)) {
				s.fail(fmt.Errorf("echoed byte %d is %#x, sent %#x", off+int64(i), buf[i], streamByte(off+int64(i))))
				return
			}
		}
		if n > 0 {
			off += int64(n)
			s.mu.Lock()
			s.stats.Verified = off
			s.stats.LastVerified = time.Now()
			s.mu.Unlock()
		}
		if err == io.EOF {
			s.fail(fmt.Errorf("server closed the connection after %d echoed bytes", off))
			return
		}
		if err != nil {
			s.fail(fmt.Errorf("read after %d echoed bytes: %w", off, err))
			return
		}
	}
}

// Stop stops sending, waits until every sent byte came back (or ctx ends)
// and closes the connection. It fails if the connection broke, data came
// back wrong, or not all bytes came back.
func (s *Stream) Stop(ctx context.Context) (StreamStats, error) {
	return s.finish(ctx, false)
}

// StopWithFIN is Stop, but the client ends the connection cleanly: once
// every byte is back it sends its FIN (shutting its side down) and waits,
// until ctx ends, for the server's, then closes. The client's kernel then
// keeps the 4-tuple in TIME_WAIT; a new connection from the same bound
// port takes it over at once all the same (Linux allows it for a bound
// port when TCP timestamps are on), as a client behind a NAT gateway that
// hands the port out again does.
func (s *Stream) StopWithFIN(ctx context.Context) (StreamStats, error) {
	return s.finish(ctx, true)
}

func (s *Stream) finish(ctx context.Context, fin bool) (StreamStats, error) {
	s.stopOnce.Do(func() { close(s.stop) })
	_ = s.conn.SetWriteDeadline(time.Now())
	<-s.sendDone
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	var waitErr error
	for waitErr == nil {
		st := s.Stats()
		if st.Err != nil || st.Verified == st.Sent {
			break
		}
		select {
		case <-ctx.Done():
			waitErr = fmt.Errorf("%d of %d bytes echoed: %w", st.Verified, st.Sent, ctx.Err())
		case <-s.recvDone:
		case <-tick.C:
		}
	}
	s.mu.Lock()
	s.stopping = true
	s.mu.Unlock()
	var finErr error
	if fin && waitErr == nil {
		finErr = s.conn.CloseWrite()
		select {
		case <-s.recvDone: // the server's FIN (or an error, ignored now)
		case <-ctx.Done():
			finErr = fmt.Errorf("no FIN from the server after ours: %w", ctx.Err())
		}
	}
	// Every byte is back, so the RST of a linger-0 close loses nothing (see
	// dialTCP); after both FINs the socket is closed and sends nothing.
	closeErr := s.conn.Close()
	<-s.recvDone
	st := s.Stats()
	if err := errors.Join(st.Err, waitErr, finErr, closeErr); err != nil {
		return st, fmt.Errorf("stream to %s: %w", s.dst, err)
	}
	return st, nil
}
