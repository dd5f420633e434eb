package tunnelclaim

import (
	"fmt"
	"net/netip"
	"strings"
)

// Annotation on a Service names the tunnel IPs it is served on.
const Annotation = "cmd.nu/tunnel"

// expected is what the annotation may hold, as every parse error ends.
const expected = "expected one IPv4 address, one IPv6 address, or one of each separated by a comma"

// ParseIPs validates the value of the cmd.nu/tunnel annotation: one IPv4
// address, one IPv6 address, or one of each separated by a comma
// ("192.0.2.10, 2001:db8::10"), each written plainly and routable to a
// host. Blanks around an address are ignored. The addresses are returned
// IPv4 first. Any bad address makes the whole value invalid: the error says
// what is wrong in words meant for the Service's owner, naming the
// annotation and the address.
func ParseIPs(value string) ([]netip.Addr, error) {
	if strings.TrimSpace(value) == "" {
		return nil, fmt.Errorf("%s is empty: %s", Annotation, expected)
	}
	if strings.ContainsAny(value, ";\n") {
		return nil, fmt.Errorf("%s=%q: separate the addresses with a comma: %s", Annotation, value, expected)
	}
	entries := strings.Split(value, ",")
	if len(entries) > 2 {
		return nil, fmt.Errorf("%s=%q lists %d values: %s", Annotation, value, len(entries), expected)
	}
	ips := make([]netip.Addr, 0, len(entries))
	for _, entry := range entries {
		ip, err := parseIP(strings.TrimSpace(entry))
		if err != nil {
			return nil, fmt.Errorf("%s=%q: %w", Annotation, value, err)
		}
		ips = append(ips, ip)
	}
	if len(ips) == 2 {
		if ips[0].Is4() == ips[1].Is4() {
			return nil, fmt.Errorf("%s=%q lists two %s addresses: %s", Annotation, value, Family(ips[0]), expected)
		}
		if ips[1].Is4() {
			ips[0], ips[1] = ips[1], ips[0]
		}
	}
	return ips, nil
}

// Family names an address's family as the Kubernetes API does: "IPv4" or
// "IPv6".
func Family(ip netip.Addr) string {
	if ip.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

// parseIP validates one address of the annotation.
func parseIP(s string) (netip.Addr, error) {
	if s == "" {
		return netip.Addr{}, fmt.Errorf("an empty value: %s", expected)
	}
	ip, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%q is not an IP address", s)
	}
	switch {
	case ip.Zone() != "":
		return netip.Addr{}, fmt.Errorf("%s has a zone: write the address alone", s)
	case ip.Is4In6():
		return netip.Addr{}, fmt.Errorf("%s is an IPv4-mapped IPv6 address: write it as IPv4", s)
	case ip.IsUnspecified():
		return netip.Addr{}, fmt.Errorf("%s is the unspecified address", s)
	case ip.IsLoopback():
		return netip.Addr{}, fmt.Errorf("%s is a loopback address", s)
	case ip.IsLinkLocalUnicast():
		return netip.Addr{}, fmt.Errorf("%s is link-local", s)
	case ip.IsMulticast():
		return netip.Addr{}, fmt.Errorf("%s is multicast", s)
	case ip.Is6():
		return ip, nil
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return netip.Addr{}, fmt.Errorf("%s is the broadcast address", s)
	case ip.As4()[0] >= 240:
		return netip.Addr{}, fmt.Errorf("%s is in the reserved range 240.0.0.0/4", s)
	case ip.As4()[0] == 0:
		return netip.Addr{}, fmt.Errorf("%s is in 0.0.0.0/8 (this network)", s)
	}
	return ip, nil
}
