package rtnl

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Netlink attribute (struct nlattr) framing, shared by the route messages and
// the encapsulations. Lengths and types are in host byte order; payloads are
// whatever the attribute defines.

const (
	attrHeaderLen = 4
	// attrTypeMask strips NLA_F_NESTED and NLA_F_NET_BYTEORDER.
	attrTypeMask = 0x3fff
)

// errMalformed is wrapped by every decoding error caused by bad input bytes.
var errMalformed = errors.New("malformed netlink data")

func align4(n int) int { return (n + 3) &^ 3 }

// appendAttrHeader appends an attribute header for a payload of n bytes.
func appendAttrHeader(b []byte, typ uint16, n int) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(attrHeaderLen+n))
	return binary.NativeEndian.AppendUint16(b, typ)
}

// padTo4 appends zero bytes up to the next 4-byte boundary.
func padTo4(b []byte) []byte {
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func appendAttrBytes(b []byte, typ uint16, p []byte) []byte {
	b = appendAttrHeader(b, typ, len(p))
	return padTo4(append(b, p...))
}

func appendAttrU8(b []byte, typ uint16, v uint8) []byte {
	b = appendAttrHeader(b, typ, 1)
	return append(b, v, 0, 0, 0)
}

func appendAttrU16(b []byte, typ uint16, v uint16) []byte {
	b = appendAttrHeader(b, typ, 2)
	b = binary.NativeEndian.AppendUint16(b, v)
	return append(b, 0, 0)
}

func appendAttrBE16(b []byte, typ uint16, v uint16) []byte {
	b = appendAttrHeader(b, typ, 2)
	b = binary.BigEndian.AppendUint16(b, v)
	return append(b, 0, 0)
}

func appendAttrU32(b []byte, typ uint16, v uint32) []byte {
	b = appendAttrHeader(b, typ, 4)
	return binary.NativeEndian.AppendUint32(b, v)
}

func appendAttrBE64(b []byte, typ uint16, v uint64) []byte {
	b = appendAttrHeader(b, typ, 8)
	return binary.BigEndian.AppendUint64(b, v)
}

// beginNested appends the header of a nested attribute whose length is not
// known yet and returns its offset for endNested.
func beginNested(b []byte, typ uint16) ([]byte, int) {
	return appendAttrHeader(b, typ, 0), len(b)
}

// endNested fixes the length of the nested attribute started at off.
func endNested(b []byte, off int) []byte {
	binary.NativeEndian.PutUint16(b[off:], uint16(len(b)-off))
	return b
}

// attrScanner walks a sequence of netlink attributes without copying.
type attrScanner struct {
	rest []byte
	typ  uint16
	val  []byte
	err  error
}

func newAttrScanner(b []byte) attrScanner { return attrScanner{rest: b} }

// next advances to the next attribute; it returns false at the end of the
// data or on malformed input, which err then reports.
func (s *attrScanner) next() bool {
	if len(s.rest) == 0 || s.err != nil {
		return false
	}
	if len(s.rest) < attrHeaderLen {
		s.err = fmt.Errorf("%w: %d trailing bytes after attributes", errMalformed, len(s.rest))
		return false
	}
	n := int(binary.NativeEndian.Uint16(s.rest))
	if n < attrHeaderLen || n > len(s.rest) {
		s.err = fmt.Errorf("%w: attribute length %d with %d bytes left", errMalformed, n, len(s.rest))
		return false
	}
	s.typ = binary.NativeEndian.Uint16(s.rest[2:]) & attrTypeMask
	s.val = s.rest[attrHeaderLen:n]
	s.rest = s.rest[min(align4(n), len(s.rest)):]
	return true
}

// attrLenError reports an attribute whose payload has the wrong size.
func attrLenError(name string, got, want int) error {
	return fmt.Errorf("%w: %s attribute has %d bytes, want %d", errMalformed, name, got, want)
}
