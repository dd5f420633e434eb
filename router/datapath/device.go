package datapath

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DeviceAlias is set on the devices the router creates; a device without it is
// never modified or deleted.
const DeviceAlias = "kube-service-tunnel"

// linkOps is the link seam (*netlink.Handle).
type linkOps interface {
	LinkByName(name string) (netlink.Link, error)
	LinkAdd(netlink.Link) error
	LinkSetAlias(netlink.Link, string) error
	LinkSetUp(netlink.Link) error
	LinkDel(netlink.Link) error
}

// GREDevice is the one flow-based ("external") GRE device of a router's
// family: kind gre for IPv4 (outer IPv4), ip6gre for IPv6 (outer IPv6).
// Routes carry the outer destination in their IP encapsulation, so no
// interface per endpoint is needed.
type GREDevice struct {
	Name string
	// Family is the outer header's family: IPv4 (the zero value) makes a
	// gre device, IPv6 an ip6gre device.
	Family Family
	Links  linkOps
}

// kind is the device kind of g's family.
func (g *GREDevice) kind() string {
	if g.Family == IPv6 {
		return "ip6gre"
	}
	return "gre"
}

// Ensure creates the device if it is missing and brings it up.
func (g *GREDevice) Ensure() (int, error) {
	link, err := g.Links.LinkByName(g.Name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		// Local is never sent for a flow-based device, but the library
		// derives the kind from it: an IPv4 Local asks for "gre", any
		// other for "ip6gre" (EOPNOTSUPP without the ip6_gre module; found
		// in the lab).
		local := net.IPv4zero
		if g.Family == IPv6 {
			local = net.IPv6zero
		}
		dev := &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: g.Name}, FlowBased: true, Local: local}
		if err := g.Links.LinkAdd(dev); err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) {
				module := "CONFIG_NET_IPGRE, module ip_gre"
				if g.Family == IPv6 {
					module = "CONFIG_IPV6_GRE, module ip6_gre"
				}
				return 0, fmt.Errorf("creating flow-based %s device %s: the kernel has no %s support (%s): %w", g.kind(), g.Name, g.kind(), module, err)
			}
			return 0, fmt.Errorf("creating flow-based %s device %s: %w", g.kind(), g.Name, err)
		}
		if link, err = g.Links.LinkByName(g.Name); err != nil {
			return 0, fmt.Errorf("reading back GRE device %s: %w", g.Name, err)
		}
		if err := g.Links.LinkSetAlias(link, DeviceAlias); err != nil {
			return 0, fmt.Errorf("marking GRE device %s as ours: %w", g.Name, err)
		}
	case err != nil:
		return 0, fmt.Errorf("looking up GRE device %s: %w", g.Name, err)
	default:
		gre, ok := link.(*netlink.Gretun)
		if !ok || !gre.FlowBased || link.Attrs().Alias != DeviceAlias || !g.ofFamily(gre) {
			choose := "choose another --gre-device"
			if g.Family == IPv6 {
				choose = "choose another name for the IPv6 gre device"
			}
			return 0, fmt.Errorf("device %s exists but is not a flow-based %s device created by kube-service-tunnel (type %s, alias %q); %s", g.Name, g.kind(), link.Type(), link.Attrs().Alias, choose)
		}
	}
	if link.Attrs().Flags&unix.IFF_UP == 0 {
		if err := g.Links.LinkSetUp(link); err != nil {
			return 0, fmt.Errorf("bringing up GRE device %s: %w", g.Name, err)
		}
	}
	return link.Attrs().Index, nil
}

// ofFamily reports whether a listed GRE device is of g's kind, as far as
// its local address tells (the kernel reports a gre device's as IPv4, an
// ip6gre device's as IPv6, a flow-based one's unspecified); a listing
// without one is not held against the device.
func (g *GREDevice) ofFamily(dev *netlink.Gretun) bool {
	if dev.Local == nil {
		return true
	}
	return (dev.Local.To4() != nil) == (g.Family == IPv4)
}

// Remove deletes the device, if it exists and carries the router's alias.
func (g *GREDevice) Remove() error {
	link, err := g.Links.LinkByName(g.Name)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("looking up GRE device %s: %w", g.Name, err)
	}
	if link.Attrs().Alias != DeviceAlias {
		return nil
	}
	if err := g.Links.LinkDel(link); err != nil {
		return fmt.Errorf("deleting GRE device %s: %w", g.Name, err)
	}
	return nil
}

// NoDevice is the tunnel device of mpls mode: routes leave through the
// interface towards each node, so there is nothing to create.
type NoDevice struct{}

// Ensure does nothing.
func (NoDevice) Ensure() (int, error) { return 0, nil }

// Remove does nothing.
func (NoDevice) Remove() error { return nil }

// ExistingDevice is a flow-based device the operator created and owns
// (--gre-device-create=false): the router routes through it but never creates,
// changes or deletes it.
type ExistingDevice struct {
	Name  string
	Links linkOps
}

// Ensure returns the device's index; it must exist.
func (e *ExistingDevice) Ensure() (int, error) {
	link, err := e.Links.LinkByName(e.Name)
	if err != nil {
		return 0, fmt.Errorf("device %s (--gre-device-create=false, so it must exist): %w", e.Name, err)
	}
	return link.Attrs().Index, nil
}

// Remove does nothing: the device is not the router's.
func (e *ExistingDevice) Remove() error { return nil }
