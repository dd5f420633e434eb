package rtnl

import (
	"encoding/binary"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// nlmsghdr mirrors struct nlmsghdr.
type nlmsghdr struct {
	len   uint32
	typ   uint16
	flags uint16
	seq   uint32
	pid   uint32
}

// msgScanner walks the netlink messages of one datagram without copying.
type msgScanner struct {
	rest    []byte
	hdr     nlmsghdr
	payload []byte
	err     error
}

func newMsgScanner(b []byte) msgScanner { return msgScanner{rest: b} }

func (s *msgScanner) next() bool {
	if len(s.rest) == 0 || s.err != nil {
		return false
	}
	if len(s.rest) < nlmsgHeaderLen {
		s.err = fmt.Errorf("%w: %d trailing bytes after messages", errMalformed, len(s.rest))
		return false
	}
	s.hdr = nlmsghdr{
		len:   binary.NativeEndian.Uint32(s.rest),
		typ:   binary.NativeEndian.Uint16(s.rest[4:]),
		flags: binary.NativeEndian.Uint16(s.rest[6:]),
		seq:   binary.NativeEndian.Uint32(s.rest[8:]),
		pid:   binary.NativeEndian.Uint32(s.rest[12:]),
	}
	n := int(s.hdr.len)
	if n < nlmsgHeaderLen || n > len(s.rest) {
		s.err = fmt.Errorf("%w: message length %d with %d bytes left", errMalformed, n, len(s.rest))
		return false
	}
	s.payload = s.rest[nlmsgHeaderLen:n]
	s.rest = s.rest[min(align4(n), len(s.rest)):]
	return true
}

// nlError is the content of an NLMSG_ERROR message (also used for acks,
// with errno 0) or of an NLMSG_DONE carrying an error.
type nlError struct {
	errno syscall.Errno
	msg   string // NLMSGERR_ATTR_MSG, the kernel's extended ack message
}

func (e *nlError) Error() string {
	if e.msg == "" {
		return e.errno.Error()
	}
	return fmt.Sprintf("%s (%s)", e.errno.Error(), e.msg)
}

func (e *nlError) Unwrap() error { return e.errno }

// parseNLError decodes the payload of NLMSG_ERROR: a negative errno, the
// request's header (or the whole request without NETLINK_CAP_ACK) and, with
// NLM_F_ACK_TLVS, extended ack attributes.
func parseNLError(hdr nlmsghdr, b []byte) (nlError, error) {
	if len(b) < 4+nlmsgHeaderLen {
		return nlError{}, fmt.Errorf("%w: error message of %d bytes", errMalformed, len(b))
	}
	e := nlError{errno: syscall.Errno(-int32(binary.NativeEndian.Uint32(b)))}
	if hdr.flags&unix.NLM_F_ACK_TLVS == 0 {
		return e, nil
	}
	reqLen := nlmsgHeaderLen
	if hdr.flags&unix.NLM_F_CAPPED == 0 {
		reqLen = int(binary.NativeEndian.Uint32(b[4:]))
	}
	off := 4 + align4(reqLen)
	if reqLen < nlmsgHeaderLen || off > len(b) {
		return e, nil // no usable TLVs; the errno is what matters
	}
	e.msg = extAckMessage(b[off:])
	return e, nil
}

// extAckMessage returns NLMSGERR_ATTR_MSG from extended ack attributes.
func extAckMessage(b []byte) string {
	s := newAttrScanner(b)
	for s.next() {
		if s.typ == unix.NLMSGERR_ATTR_MSG {
			return cString(s.val)
		}
	}
	return ""
}

func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
