package cluster

import (
	"strings"
	"testing"
)

// icmpPacket is an IPv4 packet from 172.20.0.21 holding an ICMP message
// of type typ and code about a UDP packet from the client's port 20001 to
// dst:7.
func icmpPacket(typ, code byte, dst [4]byte) []byte {
	outer := []byte{0x45, 0, 0, 56, 0, 0, 0, 0, 64, 1, 0, 0, 172, 20, 0, 21, 198, 51, 100, 10}
	icmp := []byte{typ, code, 0, 0, 0, 0, 0, 0}
	inner := []byte{0x45, 0, 0, 28, 0, 0, 0, 0, 63, 17, 0, 0, 198, 51, 100, 10, dst[0], dst[1], dst[2], dst[3]}
	ports := []byte{0x4e, 0x21, 0, 7}
	return append(append(append(outer, icmp...), inner...), ports...)
}

func TestDescribeICMPError(t *testing.T) {
	tunnel := tunnelIP.As4()
	if s, ok := describeICMPError(icmpPacket(3, 0, tunnel)); !ok || !strings.Contains(s, "type 3 code 0 from 172.20.0.21 about 192.0.2.10:7, client port 20001") {
		t.Errorf("net unreachable about the tunnel IP: %q, %v", s, ok)
	}
	if s, ok := describeICMPError(icmpPacket(11, 0, tunnel)); !ok {
		t.Errorf("time exceeded about the tunnel IP not recorded: %q", s)
	}
	for name, p := range map[string][]byte{
		"fragmentation needed":  icmpPacket(3, 4, tunnel),
		"echo reply":            icmpPacket(0, 0, tunnel),
		"about another address": icmpPacket(3, 1, [4]byte{192, 0, 2, 11}),
		"truncated":             icmpPacket(3, 0, tunnel)[:30],
	} {
		if s, ok := describeICMPError(p); ok {
			t.Errorf("%s recorded: %q", name, s)
		}
	}
}
