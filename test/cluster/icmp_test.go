package cluster

import (
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// icmpErrors records the ICMP errors (destination unreachable but for
// fragmentation needed, time exceeded) that reach the client's namespace
// about its packets to the tunnel IP. No part of the path may answer a
// client so: a pod drops what it cannot take yet, a router blackholes what
// it cannot route.
type icmpErrors struct {
	fd      int
	stopped atomic.Bool
	done    chan struct{}
	mu      sync.Mutex
	seen    []string
}

// watchICMPErrors opens a raw ICMP socket in ns and records until stop.
func watchICMPErrors(ns netns.NsHandle) (*icmpErrors, error) {
	fd := -1
	err := nsexec.Do(ns, func() (err error) {
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("raw ICMP socket in the client's namespace: %w", err)
	}
	// The reader wakes up every 200 ms to see whether it is stopped.
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200_000}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	w := &icmpErrors{fd: fd, done: make(chan struct{})}
	go w.read()
	return w, nil
}

func (w *icmpErrors) read() {
	defer close(w.done)
	buf := make([]byte, 2048)
	for !w.stopped.Load() {
		n, _, err := unix.Recvfrom(w.fd, buf, 0)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		if err != nil {
			w.mu.Lock()
			w.seen = append(w.seen, "reading the raw ICMP socket: "+err.Error())
			w.mu.Unlock()
			return
		}
		if s, ok := describeICMPError(buf[:n]); ok {
			w.mu.Lock()
			w.seen = append(w.seen, time.Now().Format("15:04:05.000")+" "+s)
			w.mu.Unlock()
		}
	}
}

// describeICMPError describes an IPv4 packet holding an ICMP destination
// unreachable or time exceeded about a packet to the tunnel IP.
func describeICMPError(b []byte) (string, bool) {
	if len(b) < 20 {
		return "", false
	}
	ihl := int(b[0]&0xf) * 4
	if len(b) < ihl+8+20 {
		return "", false
	}
	typ, code := b[ihl], b[ihl+1]
	// Fragmentation needed (3/4) is the path MTU at work, not an error.
	if typ != 3 && typ != 11 || typ == 3 && code == 4 {
		return "", false
	}
	from, _ := netip.AddrFromSlice(b[12:16])
	inner := b[ihl+8:]
	dst, _ := netip.AddrFromSlice(inner[16:20])
	if dst != tunnelIP {
		return "", false
	}
	about := dst.String()
	if iihl := int(inner[0]&0xf) * 4; len(inner) >= iihl+4 {
		about = fmt.Sprintf("%v:%d, client port %d", dst, int(inner[iihl+2])<<8|int(inner[iihl+3]), int(inner[iihl])<<8|int(inner[iihl+1]))
	}
	return fmt.Sprintf("ICMP type %d code %d from %v about %s", typ, code, from, about), true
}

// stop ends the recording, closes the socket and returns what was
// recorded.
func (w *icmpErrors) stop() []string {
	w.stopped.Store(true)
	<-w.done
	_ = unix.Close(w.fd)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seen
}
