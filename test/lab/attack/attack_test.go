package attack

import (
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// The crafted segments carry valid checksums: summed with their pseudo
// header they give 0 (0xffff before the final complement), in both
// families, so the receiving kernel does not drop them as corrupt.
func TestCraftedChecksumsVerify(t *testing.T) {
	for _, pair := range [][2]string{{"198.51.100.7", "192.0.2.10"}, {"2001:db8:100::7", "2001:db8:2::10"}} {
		src := netip.AddrPortFrom(netip.MustParseAddr(pair[0]), 4444)
		dst := netip.AddrPortFrom(netip.MustParseAddr(pair[1]), 80)
		hdr := 20
		if src.Addr().Is6() {
			hdr = 40
		}
		for name, p := range map[string][]byte{"tcp": TCPAck(src, dst, 12345), "udp": UDP(src, dst, []byte("odd"))} {
			proto := uint8(unix.IPPROTO_TCP)
			if name == "udp" {
				proto = unix.IPPROTO_UDP
			}
			if got := l4Checksum(src.Addr(), dst.Addr(), proto, p[hdr:]); got != 0 {
				t.Errorf("%s %s: checksum over the segment is %#x, want 0", name, pair[0], got)
			}
			if src.Addr().Is4() && checksum(p[:20]) != 0 {
				t.Errorf("%s: IPv4 header checksum does not verify", name)
			}
		}
	}
}
