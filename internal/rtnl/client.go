package rtnl

import (
	"errors"
	"fmt"
	"sync"

	"github.com/vishvananda/netns"
)

// ErrClosed is returned by calls on a closed Client.
var ErrClosed = errors.New("rtnl: client closed")

// Client lists and programs IPv4 and IPv6 routes in one network namespace
// through its own rtnetlink socket. It is safe for concurrent use; calls are
// serialized.
type Client struct {
	mu   sync.Mutex
	conn *conn
	seq  uint32
	// maxBatch is how many requests go into one sendmsg: as many acks as the
	// receive buffer holds. It shrinks if the kernel ever drops acks.
	maxBatch int
	// maxBatchBytes bounds a sendmsg below the socket's send buffer.
	maxBatchBytes int
	sendBuf       []byte
	readBuf       []byte
	entries       []batchEntry
	acks          []ack
}

// Open returns a Client for network namespace ns; netns.None() means the
// namespace of the calling thread. The handle is only used during Open and
// may be closed afterwards.
func Open(ns netns.NsHandle) (*Client, error) {
	c, err := dialAt(ns)
	if err != nil {
		return nil, fmt.Errorf("open rtnetlink in netns %s: %w", ns, err)
	}
	rcvbuf, sndbuf, err := c.bufferSizes()
	if err != nil {
		c.close()
		return nil, fmt.Errorf("open rtnetlink: %w", err)
	}
	// A sendmsg must stay below sk_sndbuf; one request may overshoot the
	// byte limit.
	batchBytes := max(maxRequestLen, min(maxBatchBytes, sndbuf/2-maxRequestLen))
	return &Client{
		conn:          c,
		maxBatch:      max(1, rcvbuf/ackTruesize),
		maxBatchBytes: batchBytes,
		sendBuf:       make([]byte, 0, batchBytes+maxRequestLen),
		readBuf:       make([]byte, readBufferSize),
	}, nil
}

// Close closes the socket. Calls after Close return ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return nil
	}
	err := c.conn.close()
	c.conn = nil
	if err != nil {
		return fmt.Errorf("close rtnetlink socket: %w", err)
	}
	return nil
}

// nextSeq returns a fresh sequence number.
func (c *Client) nextSeq() uint32 {
	c.seq++
	return c.seq
}
