package tunnelclaim

import (
	"fmt"
	"net/netip"
	"strings"
)

// Annotation on a Service names the tunnel IP it is served on.
const Annotation = "cmd.nu/tunnel"

// ParseIP validates the value of the cmd.nu/tunnel annotation: exactly
// one IPv4 address, written plainly, that can be routed to a host. The error
// says what is wrong in words meant for the Service's owner.
func ParseIP(value string) (netip.Addr, error) {
	if value == "" {
		return netip.Addr{}, fmt.Errorf("%s is empty: expected one IPv4 address", Annotation)
	}
	if strings.TrimSpace(value) != value || strings.ContainsAny(value, " \t\r\n") {
		return netip.Addr{}, fmt.Errorf("%s=%q contains whitespace: expected one IPv4 address", Annotation, value)
	}
	if strings.ContainsAny(value, ",;") {
		return netip.Addr{}, fmt.Errorf("%s=%q lists several values: expected exactly one IPv4 address", Annotation, value)
	}
	ip, err := netip.ParseAddr(value)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%s=%q is not an IP address", Annotation, value)
	}
	switch {
	case ip.Zone() != "":
		return netip.Addr{}, fmt.Errorf("%s=%q has a zone: expected a plain IPv4 address", Annotation, value)
	case ip.Is4In6():
		return netip.Addr{}, fmt.Errorf("%s=%q is an IPv4-mapped IPv6 address: write it as IPv4", Annotation, value)
	case !ip.Is4():
		return netip.Addr{}, fmt.Errorf("%s=%q is IPv6: only IPv4 tunnel IPs are supported", Annotation, value)
	case ip.IsUnspecified():
		return netip.Addr{}, fmt.Errorf("%s=%q is the unspecified address", Annotation, value)
	case ip.IsLoopback():
		return netip.Addr{}, fmt.Errorf("%s=%q is a loopback address", Annotation, value)
	case ip.IsLinkLocalUnicast():
		return netip.Addr{}, fmt.Errorf("%s=%q is link-local", Annotation, value)
	case ip.IsMulticast():
		return netip.Addr{}, fmt.Errorf("%s=%q is multicast", Annotation, value)
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return netip.Addr{}, fmt.Errorf("%s=%q is the broadcast address", Annotation, value)
	case ip.As4()[0] >= 240:
		return netip.Addr{}, fmt.Errorf("%s=%q is in the reserved range 240.0.0.0/4", Annotation, value)
	case ip.As4()[0] == 0:
		return netip.Addr{}, fmt.Errorf("%s=%q is in 0.0.0.0/8 (this network)", Annotation, value)
	}
	return ip, nil
}
