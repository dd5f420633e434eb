package rtnl

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// Batching limits for Apply.
const (
	// maxBatchBytes is the size of the requests written per sendmsg, if the
	// socket's send buffer allows.
	maxBatchBytes = 256 << 10
	// maxRequestLen bounds one encoded route request (30 MPLS labels).
	maxRequestLen = 512
	// ackTruesize is the receive-buffer memory the kernel charges per ack
	// (measured: about 830 bytes on Linux 6.18), with headroom.
	ackTruesize = 1024
	// maxStalls bounds consecutive batches that lose their first ack; each
	// halves the batch, so this many reach a batch of one request.
	maxStalls = 32
)

// ErrInvalidRoute is wrapped by OpErrors for routes (and nexthops) that
// Apply refused to send.
var ErrInvalidRoute = errors.New("invalid route")

// OpKind says what Apply does with a route or nexthop object.
type OpKind uint8

const (
	// Replace creates the route, or replaces the route at its key
	// (RTM_NEWROUTE with NLM_F_CREATE|NLM_F_REPLACE).
	Replace OpKind = iota + 1
	// Delete removes the route at the key of Route (table and destination)
	// whatever its next hop, provided it has Route.Protocol (any protocol
	// if 0). A route that is already absent is not an error.
	Delete
	// ReplaceNextHop creates the nexthop object NextHop or replaces the one
	// with its ID; routes using it follow.
	ReplaceNextHop
	// DeleteNextHop removes the nexthop object with NextHop.ID, and with it
	// every route that uses it. An absent nexthop is not an error.
	DeleteNextHop
	// AddNextHop creates the nexthop object NextHop; it fails (EEXIST) if
	// its ID is taken, so that it never replaces someone else's nexthop
	// (RTM_NEWNEXTHOP with NLM_F_CREATE|NLM_F_EXCL).
	AddNextHop
)

// String returns "replace", "delete", "replace nexthop", "delete nexthop"
// or "add nexthop".
func (k OpKind) String() string {
	switch k {
	case Replace:
		return "replace"
	case Delete:
		return "delete"
	case ReplaceNextHop:
		return "replace nexthop"
	case DeleteNextHop:
		return "delete nexthop"
	case AddNextHop:
		return "add nexthop"
	}
	return fmt.Sprintf("op%d", uint8(k))
}

// Op is one change for Apply: a route, or a nexthop object.
type Op struct {
	Kind OpKind
	// Route is the subject of Replace and Delete.
	Route Route
	// NextHop is the subject of AddNextHop, ReplaceNextHop and
	// DeleteNextHop (which only needs the ID).
	NextHop NextHop
}

// validate checks op before anything is sent.
func (op *Op) validate() error {
	switch op.Kind {
	case Replace:
		return op.Route.validate()
	case Delete:
		return op.Route.validateKey()
	case ReplaceNextHop, AddNextHop:
		return op.NextHop.validate()
	case DeleteNextHop:
		if op.NextHop.ID == 0 {
			return fmt.Errorf("%w: nexthop id 0", ErrInvalidRoute)
		}
		return nil
	}
	return fmt.Errorf("%w: unknown operation %d", ErrInvalidRoute, op.Kind)
}

// String names the operation and its subject.
func (op *Op) String() string {
	switch op.Kind {
	case ReplaceNextHop, DeleteNextHop, AddNextHop:
		return fmt.Sprintf("%s %s", op.Kind, &op.NextHop)
	}
	return fmt.Sprintf("%s route %s", op.Kind, &op.Route)
}

// OpError is one operation of an Apply call that failed.
type OpError struct {
	// Index is the position of Op in the slice given to Apply.
	Index int
	Op    Op
	// Err unwraps to the kernel's syscall.Errno (its extended ack message
	// is part of Err's text), or wraps ErrInvalidRoute.
	Err error
}

// Error names the operation and the route, e.g.
// "replace route 10.96.0.1/32 ... table 7600 proto 200: no such device".
func (e *OpError) Error() string {
	return fmt.Sprintf("%s: %v", &e.Op, e.Err)
}

// Unwrap returns the underlying error.
func (e *OpError) Unwrap() error { return e.Err }

// ApplyError reports every operation of an Apply call that failed; all the
// others were applied.
type ApplyError struct {
	Failed []*OpError
}

// maxListedFailures bounds how many failures Error spells out.
const maxListedFailures = 5

// Error lists the first few failed operations and counts the rest.
func (e *ApplyError) Error() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d route operation(s) failed: ", len(e.Failed))
	for i, f := range e.Failed {
		if i == maxListedFailures {
			fmt.Fprintf(&sb, "; and %d more", len(e.Failed)-i)
			break
		}
		if i > 0 {
			sb.WriteString("; ")
		}
		sb.WriteString(f.Error())
	}
	return sb.String()
}

// Unwrap returns the OpErrors, so errors.Is and errors.As see through it.
func (e *ApplyError) Unwrap() []error {
	errs := make([]error, len(e.Failed))
	for i, f := range e.Failed {
		errs[i] = f
	}
	return errs
}

// batchEntry is one operation of the current batch.
type batchEntry struct {
	op      int   // index into the ops given to Apply
	invalid error // set if the op was not sent
	ackSlot int   // index into Client.acks if sent
}

// ack is the kernel's answer to one sent request.
type ack struct {
	received bool
	err      nlError
}

// Apply performs ops, on routes and nexthop objects, in order. Requests are
// pipelined: each sendmsg carries a batch of acknowledged requests (up to
// 256 KiB, and no more acks than the receive buffer holds), then the acks
// are read and matched to ops by sequence number. A failing op does not stop
// the others: Apply returns an *ApplyError naming every failed route, or
// another error if the socket itself failed (the outcome of in-flight ops is
// then unknown; applying the same ops again is safe).
//
// Should the kernel still drop acks (ENOBUFS), the ops from the first
// unacknowledged one on are sent again in smaller batches; replacing and
// deleting are idempotent, and order is preserved.
func (c *Client) Apply(ops []Op) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return ErrClosed
	}
	var failed []*OpError
	stalls := 0
	for next := 0; next < len(ops); {
		settled, err := c.applyBatch(ops, next, &failed)
		if err == nil && settled == next {
			if stalls++; stalls > maxStalls {
				err = fmt.Errorf("kernel keeps dropping acks (ENOBUFS) at op %d", next)
			}
		} else {
			stalls = 0
		}
		if err != nil {
			return errors.Join(fmt.Errorf("apply routes: %w", err), applyError(failed))
		}
		next = settled
	}
	return applyError(failed)
}

func applyError(failed []*OpError) error {
	if len(failed) == 0 {
		return nil
	}
	return &ApplyError{Failed: failed}
}

// applyBatch sends one batch starting at ops[start], reads its acks, records
// failures and returns the index of the first op not yet settled.
func (c *Client) applyBatch(ops []Op, start int, failed *[]*OpError) (int, error) {
	firstSeq := c.seq + 1
	end := c.buildBatch(ops, start)
	if len(c.sendBuf) > 0 {
		if err := c.conn.send(c.sendBuf); err != nil {
			return start, err
		}
		if err := c.readAcks(firstSeq); err != nil {
			return start, err
		}
	}
	return c.settle(ops, end, failed), nil
}

// buildBatch encodes ops from start into c.sendBuf and c.entries and returns
// the index after the last op taken.
func (c *Client) buildBatch(ops []Op, start int) int {
	c.sendBuf = c.sendBuf[:0]
	c.entries = c.entries[:0]
	c.acks = c.acks[:0]
	i := start
	for ; i < len(ops) && len(c.acks) < c.maxBatch && len(c.sendBuf) < c.maxBatchBytes; i++ {
		op := &ops[i]
		if err := op.validate(); err != nil {
			c.entries = append(c.entries, batchEntry{op: i, invalid: err})
			continue
		}
		c.entries = append(c.entries, batchEntry{op: i, ackSlot: len(c.acks)})
		c.acks = append(c.acks, ack{})
		c.sendBuf = appendRequest(c.sendBuf, op, c.nextSeq())
	}
	return i
}

func appendRequest(b []byte, op *Op, seq uint32) []byte {
	switch op.Kind {
	case Delete:
		return appendDelRoute(b, &op.Route, seq)
	case ReplaceNextHop:
		return appendNewNextHop(b, &op.NextHop, unix.NLM_F_REPLACE, seq)
	case AddNextHop:
		return appendNewNextHop(b, &op.NextHop, unix.NLM_F_EXCL, seq)
	case DeleteNextHop:
		return appendDelNextHop(b, op.NextHop.ID, seq)
	}
	return appendNewRoute(b, &op.Route, seq)
}

// readAcks reads the acks of the batch whose first request had firstSeq.
// Requests are processed inside sendmsg, so every ack is queued by now
// unless the kernel dropped it for lack of buffer space, which a read then
// reports as ENOBUFS; in that case readAcks returns once the queue is empty.
func (c *Client) readAcks(firstSeq uint32) error {
	pending, overrun := len(c.acks), false
	for pending > 0 {
		n, err := c.conn.recv(c.readBuf)
		switch {
		case err == unix.ENOBUFS:
			overrun = true
			continue
		case err == errWouldBlock && overrun:
			return nil
		case err == errWouldBlock:
			if err := c.conn.wait(unix.POLLIN); err != nil {
				return err
			}
			continue
		case err != nil:
			return err
		}
		got, err := c.recordAcks(c.readBuf[:n], firstSeq)
		if err != nil {
			return err
		}
		pending -= got
	}
	return nil
}

// recordAcks stores the acks found in one datagram and returns their number.
func (c *Client) recordAcks(b []byte, firstSeq uint32) (int, error) {
	got := 0
	s := newMsgScanner(b)
	for s.next() {
		slot := int(s.hdr.seq - firstSeq)
		if s.hdr.typ != unix.NLMSG_ERROR || slot < 0 || slot >= len(c.acks) || c.acks[slot].received {
			continue // not an ack of this batch
		}
		e, err := parseNLError(s.hdr, s.payload)
		if err != nil {
			return got, fmt.Errorf("read ack: %w", err)
		}
		c.acks[slot] = ack{received: true, err: e}
		got++
	}
	if s.err != nil {
		return got, fmt.Errorf("read ack: %w", s.err)
	}
	return got, nil
}

// settle records the failures of the batch up to its first unacknowledged
// request and returns the index of the next op to send. After lost acks the
// batch size is halved so that the resent ops' acks fit.
func (c *Client) settle(ops []Op, end int, failed *[]*OpError) int {
	for _, e := range c.entries {
		if e.invalid != nil {
			*failed = append(*failed, &OpError{Index: e.op, Op: ops[e.op], Err: e.invalid})
			continue
		}
		a := &c.acks[e.ackSlot]
		if !a.received {
			c.maxBatch = max(1, e.ackSlot/2)
			return e.op
		}
		if err := opFailure(&ops[e.op], a.err); err != nil {
			*failed = append(*failed, &OpError{Index: e.op, Op: ops[e.op], Err: err})
		}
	}
	return end
}

// opFailure turns an ack into the op's error: nil for success and for
// deleting something that is not there.
func opFailure(op *Op, e nlError) error {
	switch {
	case e.errno == 0:
		return nil
	case op.Kind == Delete && e.errno == unix.ESRCH:
		return nil
	case op.Kind == DeleteNextHop && e.errno == unix.ENOENT:
		return nil
	}
	return &e
}
