package rtnl

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrDumpInterrupted means the kernel state changed during every attempt to
// dump it, so the listing might be inconsistent.
var ErrDumpInterrupted = errors.New("rtnl: dump interrupted by concurrent changes")

// dumpAttempts bounds how often a listing restarts an interrupted dump.
const dumpAttempts = 3

// TableRange is an inclusive range of routing table ids. The zero value
// means every table.
type TableRange struct {
	First, Last uint32
}

func (t TableRange) all() bool { return t == TableRange{} }

func (t TableRange) contains(table uint32) bool {
	return t.all() || (table >= t.First && table <= t.Last)
}

// single reports whether the range is exactly one table, which the kernel
// can filter on by itself.
func (t TableRange) single() bool { return !t.all() && t.First == t.Last }

// ListFilter selects the routes List returns. The zero value selects every
// IPv4 route in every table.
type ListFilter struct {
	// IPv6 selects the IPv6 routes instead of the IPv4 ones.
	IPv6 bool
	// Tables limits the result to these tables.
	Tables TableRange
	// Protocol, if not zero, keeps only routes with this rtm_protocol.
	Protocol uint8
}

// family is the address family f selects.
func (f *ListFilter) family() uint8 {
	if f.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func (f *ListFilter) matches(family uint8, table uint32, protocol uint8) bool {
	return family == f.family() && f.Tables.contains(table) && (f.Protocol == 0 || f.Protocol == protocol)
}

// List returns the IPv4 (or, with f.IPv6, IPv6) routes selected by f, in
// kernel dump order. The whole table set is streamed through one dump;
// filtering happens while decoding (and, for the protocol and a single
// table, inside the kernel). Routes are decoded including their IP, IP6 or
// MPLS encapsulation.
func (c *Client) List(f ListFilter) ([]Route, error) {
	var routes []Route
	err := c.Walk(f, func() { routes = routes[:0] }, func(r Route) error {
		routes = append(routes, r)
		return nil
	})
	return routes, err
}

// Walk is List without the list: it calls visit for each selected route as
// its message is decoded, so that reading a large table costs one route's
// memory, not all of them. If the kernel interrupts the dump (the routes
// changed meanwhile) Walk calls reset and starts over: the caller forgets
// what it was told. A visit error ends the walk.
func (c *Client) Walk(f ListFilter, reset func(), visit func(Route) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	err := c.dumpConsistent(
		func(b []byte, seq uint32) []byte { return appendRouteDumpRequest(b, &f, seq) },
		reset,
		func(typ uint16, payload []byte) error {
			if typ != unix.RTM_NEWROUTE {
				return nil
			}
			return decodeSelected(payload, &f, visit)
		})
	if errors.Is(err, unix.ENOENT) && f.Tables.single() {
		return nil // the table does not exist (yet)
	}
	if err != nil {
		return fmt.Errorf("list routes: %w", err)
	}
	return nil
}

// decodeSelected decodes one route message if f selects it.
func decodeSelected(b []byte, f *ListFilter, add func(Route) error) error {
	a, err := scanRoute(b)
	if err != nil {
		return fmt.Errorf("decode route: %w", err)
	}
	if !f.matches(a.hdr.family, a.table, a.hdr.protocol) {
		return nil
	}
	r, err := a.route()
	if err != nil {
		return fmt.Errorf("decode route in table %d: %w", a.table, err)
	}
	return add(r)
}

// appendRouteDumpRequest appends an RTM_GETROUTE dump request. With
// NETLINK_GET_STRICT_CHK the kernel filters on rtm_protocol and RTA_TABLE.
func appendRouteDumpRequest(b []byte, f *ListFilter, seq uint32) []byte {
	b = appendNlmsghdr(b, unix.RTM_GETROUTE, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq)
	hdr := rtmsg{family: f.family(), protocol: f.Protocol}
	b = hdr.append(b)
	if f.Tables.single() {
		b = appendAttrU32(b, unix.RTA_TABLE, f.Tables.First)
	}
	return finishMessage(b, 0)
}

// dumpConsistent runs a dump until one completes without NLM_F_DUMP_INTR,
// calling reset before each attempt and handle for every message.
func (c *Client) dumpConsistent(request func(b []byte, seq uint32) []byte, reset func(), handle func(typ uint16, payload []byte) error) error {
	if c.conn == nil {
		return ErrClosed
	}
	for range dumpAttempts {
		reset()
		interrupted, err := c.dump(request, handle)
		if err != nil || !interrupted {
			return err
		}
	}
	return ErrDumpInterrupted
}

// dump sends one dump request and streams its replies to handle, datagram
// by datagram, until NLMSG_DONE. A failed dump returns an error wrapping the
// kernel's errno. After handle fails, the rest of the dump is still read
// (and ignored): the kernel refuses a new dump on the socket with EBUSY
// while one is unfinished.
func (c *Client) dump(request func(b []byte, seq uint32) []byte, handle func(typ uint16, payload []byte) error) (interrupted bool, err error) {
	seq := c.nextSeq()
	if err := c.conn.send(request(c.sendBuf[:0], seq)); err != nil {
		return false, err
	}
	var handleErr error
	keepFirstError := func(typ uint16, payload []byte) error {
		if handleErr == nil {
			handleErr = handle(typ, payload)
		}
		return nil
	}
	for {
		n, err := c.conn.recvWait(c.readBuf)
		if err != nil {
			return false, err
		}
		done, intr, err := handleDumpDatagram(c.readBuf[:n], seq, keepFirstError)
		interrupted = interrupted || intr
		if err != nil || done {
			return interrupted, cmp.Or(handleErr, err)
		}
	}
}

// handleDumpDatagram passes the messages of one dump datagram to handle.
func handleDumpDatagram(b []byte, seq uint32, handle func(typ uint16, payload []byte) error) (done, interrupted bool, err error) {
	s := newMsgScanner(b)
	for s.next() {
		if s.hdr.seq != seq {
			continue // e.g. a late ack of an earlier, aborted Apply
		}
		interrupted = interrupted || s.hdr.flags&unix.NLM_F_DUMP_INTR != 0
		switch s.hdr.typ {
		case unix.NLMSG_DONE:
			return true, interrupted, dumpDoneError(s.payload)
		case unix.NLMSG_ERROR:
			return true, interrupted, dumpErrorMessage(s.hdr, s.payload)
		default:
			if err := handle(s.hdr.typ, s.payload); err != nil {
				return true, interrupted, err
			}
		}
	}
	return false, interrupted, s.err
}

// dumpDoneError returns the error an NLMSG_DONE carries, if any.
func dumpDoneError(b []byte) error {
	if len(b) < 4 {
		return nil
	}
	if errno := syscall.Errno(-int32(binary.NativeEndian.Uint32(b))); errno != 0 {
		return fmt.Errorf("dump: %w", &nlError{errno: errno})
	}
	return nil
}

func dumpErrorMessage(hdr nlmsghdr, b []byte) error {
	e, err := parseNLError(hdr, b)
	if err != nil {
		return err
	}
	if e.errno == 0 {
		return nil
	}
	return fmt.Errorf("dump: %w", &e)
}
