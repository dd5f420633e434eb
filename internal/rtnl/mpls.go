package rtnl

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// MPLS label stack entries (RFC 3032) as carried in MPLS_IPTUNNEL_DST: a
// big-endian u32 of label(20) | traffic class(3) | bottom of stack(1) | ttl(8).
const (
	mplsLabelShift = 12
	mplsBoSBit     = 1 << 8
	// MaxMPLSLabel is the largest valid MPLS label.
	MaxMPLSLabel = 1<<20 - 1
	// maxMPLSLabels is the kernel's limit on pushed labels (MAX_NEW_LABELS).
	maxMPLSLabels = 30
)

func validateLabels(labels []uint32) error {
	if labels == nil {
		return nil
	}
	if len(labels) == 0 || len(labels) > maxMPLSLabels {
		return fmt.Errorf("%w: %d MPLS labels, want 1 to %d", ErrInvalidRoute, len(labels), maxMPLSLabels)
	}
	for _, l := range labels {
		if l > MaxMPLSLabel {
			return fmt.Errorf("%w: MPLS label %d exceeds %d", ErrInvalidRoute, l, MaxMPLSLabel)
		}
	}
	return nil
}

// appendMPLSEncap appends the payload of RTA_ENCAP for LWTUNNEL_ENCAP_MPLS:
// one MPLS_IPTUNNEL_DST attribute holding the label stack.
func appendMPLSEncap(b []byte, labels []uint32) []byte {
	b = appendAttrHeader(b, unix.MPLS_IPTUNNEL_DST, 4*len(labels))
	for i, l := range labels {
		entry := l << mplsLabelShift
		if i == len(labels)-1 {
			entry |= mplsBoSBit
		}
		b = binary.BigEndian.AppendUint32(b, entry)
	}
	return b
}

// decodeMPLSEncap parses the payload of RTA_ENCAP for LWTUNNEL_ENCAP_MPLS and
// returns the label stack. MPLS_IPTUNNEL_TTL is ignored.
func decodeMPLSEncap(b []byte) ([]uint32, error) {
	var labels []uint32
	s := newAttrScanner(b)
	for s.next() {
		if s.typ != unix.MPLS_IPTUNNEL_DST {
			continue
		}
		var err error
		if labels, err = decodeLabelStack(s.val); err != nil {
			return nil, err
		}
	}
	if s.err != nil {
		return nil, fmt.Errorf("mpls encap: %w", s.err)
	}
	if labels == nil {
		return nil, fmt.Errorf("mpls encap: %w: no MPLS_IPTUNNEL_DST", errMalformed)
	}
	return labels, nil
}

func decodeLabelStack(v []byte) ([]uint32, error) {
	if len(v) == 0 || len(v)%4 != 0 {
		return nil, fmt.Errorf("mpls encap: %w: label stack of %d bytes", errMalformed, len(v))
	}
	labels := make([]uint32, len(v)/4)
	for i := range labels {
		entry := binary.BigEndian.Uint32(v[4*i:])
		last := i == len(labels)-1
		if (entry&mplsBoSBit != 0) != last {
			return nil, fmt.Errorf("mpls encap: %w: bottom-of-stack bit wrong on label %d of %d", errMalformed, i+1, len(labels))
		}
		labels[i] = entry >> mplsLabelShift
	}
	return labels, nil
}

// formatLabels formats a label stack like iproute2: "100/200".
func formatLabels(labels []uint32) string {
	s := make([]string, len(labels))
	for i, l := range labels {
		s[i] = strconv.FormatUint(uint64(l), 10)
	}
	return strings.Join(s, "/")
}
