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

// GREDevice is the one flow-based ("external") GRE device of a router. Routes
// carry the outer destination in their IP encapsulation, so no interface per
// endpoint is needed.
type GREDevice struct {
	Name  string
	Links linkOps
}

// Ensure creates the device if it is missing and brings it up.
func (g *GREDevice) Ensure() (int, error) {
	link, err := g.Links.LinkByName(g.Name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		// Local is never sent for a flow-based device, but the library
		// derives the kind from it: without an IPv4 Local it asks for
		// "ip6gre" (EOPNOTSUPP without the ip6_gre module; found in the lab).
		dev := &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: g.Name}, FlowBased: true, Local: net.IPv4zero}
		if err := g.Links.LinkAdd(dev); err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) {
				return 0, fmt.Errorf("creating flow-based GRE device %s: the kernel has no GRE support (CONFIG_NET_IPGRE, module ip_gre): %w", g.Name, err)
			}
			return 0, fmt.Errorf("creating flow-based GRE device %s: %w", g.Name, err)
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
		if !ok || !gre.FlowBased || link.Attrs().Alias != DeviceAlias {
			return 0, fmt.Errorf("device %s exists but is not a flow-based GRE device created by kube-service-tunnel (type %s, alias %q); choose another --gre-device", g.Name, link.Type(), link.Attrs().Alias)
		}
	}
	if link.Attrs().Flags&unix.IFF_UP == 0 {
		if err := g.Links.LinkSetUp(link); err != nil {
			return 0, fmt.Errorf("bringing up GRE device %s: %w", g.Name, err)
		}
	}
	return link.Attrs().Index, nil
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
