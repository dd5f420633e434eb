// Package ctsync shares the routers' conntrack entries for tunnel IPs, so
// that a flow that moves to another router (its router died, ECMP changed)
// keeps the routing generation it started in: a draining endpoint keeps its
// flows across a router failover.
//
// The work is done by conntrackd (conntrack-tools), run by the router as a
// child process in FT-FW mode with its external cache disabled: each
// router multicasts the creation, change and end of its entries for the
// tunnel IPs' pools over a link every router shares, and every other
// router writes them straight into its kernel table, mark included (the
// mark holds the flow's generation). The router writes conntrackd's
// configuration (Render), restarts it when it exits or when the pools
// change, and makes it send its whole cache every refresh period (conntrackd
// -B), because conntrackd otherwise sends an entry only when its state
// changes and a copy would expire on the other routers while the flow
// lives on.
package ctsync

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
)

// DefaultGroup is conntrackd's default multicast group (its UDP port).
const DefaultGroup = 3780

// DefaultMulticastAddress is where the sync messages go (conntrackd's own
// default); Group tells clusters on one segment apart.
var DefaultMulticastAddress = netip.MustParseAddr("225.0.0.50")

// Config is what conntrackd needs from the router.
type Config struct {
	// Interface is the link the routers share for the sync messages, and
	// Address this router's IPv4 address on it.
	Interface string
	Address   netip.Addr
	// Group is the multicast group (UDP port): routers of one cluster use
	// the same, two clusters on one segment different ones.
	Group int
	// Prefixes are the pools: only entries whose reply comes from one of
	// them (a flow to a tunnel IP) are shared.
	Prefixes []netip.Prefix
	// Dir holds the configuration file, conntrackd's lock file and its
	// control socket.
	Dir string
	// Peers are the other routers' addresses on Interface (the router's
	// own may be among them): the filter of conntrackd's port lets the
	// sync messages in from them alone; empty, from anyone on the link
	// (see PortFilter).
	Peers []netip.Prefix
}

// PortFilter is the filter of conntrackd's port for c.
func (c Config) PortFilter() PortFilter {
	return PortFilter{Interface: c.Interface, Group: c.Group, Peers: c.Peers}
}

// ConfigFile, LockFile and SocketPath are the files conntrackd uses in Dir.
func (c Config) ConfigFile() string { return filepath.Join(c.Dir, "conntrackd.conf") }
func (c Config) LockFile() string   { return filepath.Join(c.Dir, "conntrackd.lock") }
func (c Config) SocketPath() string { return filepath.Join(c.Dir, "conntrackd.ctl") }

// Validate reports the first setting conntrackd cannot run with, naming
// the flag an operator sets.
func (c Config) Validate() error {
	switch {
	case c.Interface == "":
		return errors.New("--conntrack-sync-interface is empty")
	case !c.Address.Is4() || c.Address.IsUnspecified():
		return fmt.Errorf("--conntrack-sync-interface %s: no IPv4 address to send the sync messages from (conntrackd's multicast here is IPv4; got %q)", c.Interface, c.Address)
	case c.Group <= 0 || c.Group > 65535:
		return fmt.Errorf("--conntrack-sync-group %d: want a UDP port, 1-65535", c.Group)
	case !filepath.IsAbs(c.Dir):
		return fmt.Errorf("--conntrack-sync-dir %q: want an absolute path", c.Dir)
	case strings.ContainsAny(c.Interface, " \t\n{}#\""):
		return fmt.Errorf("--conntrack-sync-interface %q: not an interface name", c.Interface)
	case strings.ContainsAny(c.Dir, " \t\n{}#\""):
		return fmt.Errorf("--conntrack-sync-dir %q: conntrackd's configuration cannot name a path with blanks, quotes, braces or #", c.Dir)
	}
	return c.PortFilter().Validate()
}

// Render returns conntrackd's configuration for c: FT-FW mode (every
// message acknowledged, lost ones resent), the external cache disabled
// (a peer's entries go straight into the kernel table), a resync asked of
// the peers at start (a restarted router gets the flows they hold), and
// only TCP entries of the pools shared. UDP is not: the router's one-way
// UDP entries live nf_conntrack_udp_timeout (30 s) after an event, so
// their copies would lapse between two bulk sends. No resync from the
// kernel after lost events (NetlinkOverrunResync Off): it would read the
// peers' copies into the cache of this router's own entries (see Daemon).
// Errors name the setting at fault; with no prefix there is nothing to
// share and Render refuses.
func Render(c Config) (string, error) {
	if err := c.Validate(); err != nil {
		return "", err
	}
	if len(c.Prefixes) == 0 {
		return "", errors.New("no address pool: no flow to share")
	}
	prefixes := slices.Clone(c.Prefixes)
	slices.SortFunc(prefixes, func(a, b netip.Prefix) int {
		if n := a.Addr().Compare(b.Addr()); n != 0 {
			return n
		}
		return a.Bits() - b.Bits()
	})
	var filter strings.Builder
	for _, p := range prefixes {
		key := "IPv4_address"
		if p.Addr().Is6() {
			key = "IPv6_address"
		}
		fmt.Fprintf(&filter, "\t\t\t%s %s\n", key, p.Masked())
	}
	return fmt.Sprintf(`# Written by tunnel-router (--conntrack-sync-interface); rewritten at
# every start and when the pools change.
Sync {
	Mode FTFW {
		DisableExternalCache On
		StartupResync On
	}
	Multicast {
		IPv4_address %s
		Group %d
		IPv4_interface %s
		Interface %s
		SndSocketBuffer 1249280
		RcvSocketBuffer 1249280
		Checksum on
	}
}
General {
	Systemd off
	HashSize 32768
	HashLimit 262144
	LogFile off
	Syslog off
	LockFile %s
	UNIX {
		Path %s
	}
	NetlinkBufferSize 2097152
	NetlinkBufferSizeMaxGrowth 8388608
	NetlinkOverrunResync Off
	Filter From Userspace {
		Protocol Accept {
			TCP
		}
		Address Accept {
%s		}
	}
}
`, DefaultMulticastAddress, c.Group, c.Address, c.Interface, c.LockFile(), c.SocketPath(), filter.String()), nil
}

// InterfaceAddress returns the first global IPv4 address of the link name,
// the address conntrackd sends from.
func InterfaceAddress(name string) (netip.Addr, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("--conntrack-sync-interface %s: %w", name, err)
	}
	addrs, err := netlink.AddrList(link, netlink.FAMILY_V4)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("--conntrack-sync-interface %s: list its addresses: %w", name, err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok && a.Scope == int(netlink.SCOPE_UNIVERSE) {
			return ip, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("--conntrack-sync-interface %s: no global IPv4 address to send the sync messages from", name)
}
