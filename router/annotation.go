package router

import (
	"fmt"
	"net/netip"
	"strings"
)

// TunnelAnnotation on a Service names the tunnel IP it is served on.
const TunnelAnnotation = "cmd.nu/tunnel"

// ParseTunnelIP validates the value of the cmd.nu/tunnel annotation: exactly
// one IPv4 address, written plainly, that can be routed to a host. The error
// says what is wrong in words meant for the Service's owner.
func ParseTunnelIP(value string) (netip.Addr, error) {
	if value == "" {
		return netip.Addr{}, fmt.Errorf("%s is empty: expected one IPv4 address", TunnelAnnotation)
	}
	if strings.TrimSpace(value) != value || strings.ContainsAny(value, " \t\r\n") {
		return netip.Addr{}, fmt.Errorf("%s=%q contains whitespace: expected one IPv4 address", TunnelAnnotation, value)
	}
	if strings.ContainsAny(value, ",;") {
		return netip.Addr{}, fmt.Errorf("%s=%q lists several values: expected exactly one IPv4 address", TunnelAnnotation, value)
	}
	ip, err := netip.ParseAddr(value)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%s=%q is not an IP address", TunnelAnnotation, value)
	}
	switch {
	case ip.Zone() != "":
		return netip.Addr{}, fmt.Errorf("%s=%q has a zone: expected a plain IPv4 address", TunnelAnnotation, value)
	case ip.Is4In6():
		return netip.Addr{}, fmt.Errorf("%s=%q is an IPv4-mapped IPv6 address: write it as IPv4", TunnelAnnotation, value)
	case !ip.Is4():
		return netip.Addr{}, fmt.Errorf("%s=%q is IPv6: only IPv4 tunnel IPs are supported", TunnelAnnotation, value)
	case ip.IsUnspecified():
		return netip.Addr{}, fmt.Errorf("%s=%q is the unspecified address", TunnelAnnotation, value)
	case ip.IsLoopback():
		return netip.Addr{}, fmt.Errorf("%s=%q is a loopback address", TunnelAnnotation, value)
	case ip.IsLinkLocalUnicast():
		return netip.Addr{}, fmt.Errorf("%s=%q is link-local", TunnelAnnotation, value)
	case ip.IsMulticast():
		return netip.Addr{}, fmt.Errorf("%s=%q is multicast", TunnelAnnotation, value)
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return netip.Addr{}, fmt.Errorf("%s=%q is the broadcast address", TunnelAnnotation, value)
	case ip.As4()[0] >= 240:
		return netip.Addr{}, fmt.Errorf("%s=%q is in the reserved range 240.0.0.0/4", TunnelAnnotation, value)
	case ip.As4()[0] == 0:
		return netip.Addr{}, fmt.Errorf("%s=%q is in 0.0.0.0/8 (this network)", TunnelAnnotation, value)
	}
	return ip, nil
}
