// Package birdconf renders a BIRD 2 configuration for a BGP peer of the
// tunnel routers (IPv4 and IPv6 sessions with test-friendly timers, kernel
// protocols that merge equal BGP paths into one multipath route, optional
// BFD and originated prefixes) and reads what that peer shows: birdc's
// protocol states and the multipath routes it installs in the kernel. It does not
// import testing, so both the integration tests' peer (test/bgppeer) and the
// lab VM's gateway (test/lab/topology) use it.
//
// Timers are set for tests rather than for the Internet: BIRD connects one
// second after start (default 5), retries a failed connection every second
// (default 120) and, after a BGP error (hold timer expired, BFD down, an
// error NOTIFICATION), keeps the session idle for 1 to 5 seconds (error wait
// time, default 60 to 300), so a session comes back quickly.
package birdconf

import (
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Neighbor is one BGP session of the peer, a BIRD "protocol bgp".
type Neighbor struct {
	// Name is the BIRD protocol name, used by Established and shown as
	// Route.FromNeighbor: letters, digits and underscores, starting with a
	// letter, and not a BIRD keyword (such as "router", "bgp" or "direct").
	Name string
	// Address is the neighbor's address (the code under test): IPv4 for a
	// session that carries IPv4 routes, a global IPv6 address for one that
	// carries IPv6 routes.
	Address netip.Addr
	// LocalAddress, when set, is the peer's own address for the session,
	// of Address's family.
	LocalAddress netip.Addr
	// ASN is the neighbor's AS; equal to Config.ASN makes an iBGP session.
	ASN uint32
	// Password enables TCP MD5 signatures (RFC 2385); it must not contain
	// a double quote or a newline.
	Password string
	// HoldTime and KeepaliveTime are whole seconds; zero keeps BIRD's
	// defaults (240 s and a third of the hold time).
	HoldTime, KeepaliveTime time.Duration
	// Multihop is the session's TTL for a neighbor that is not on a
	// directly connected network; zero means a direct session.
	Multihop int
	// BFD ties the session to a BFD session with Config.BFD's timers.
	BFD bool
	// Passive makes BIRD only accept the neighbor's connection, never
	// open one.
	Passive bool
	// CarryIPv6 lets a session with an IPv4 neighbor carry IPv6 routes too
	// (an ipv6 channel beside the ipv4 one: multiprotocol BGP, the routes
	// keeping their IPv6 next hops).
	CarryIPv6 bool
}

// BFDIntervals are the peer's BFD timers; zero fields keep BIRD's defaults
// (min tx 100 ms, min rx 10 ms, multiplier 5).
type BFDIntervals struct {
	MinTx, MinRx time.Duration
	Multiplier   int
}

// Config describes one BIRD peer. Each session carries the routes of its
// neighbor address's family (an ipv4 or an ipv6 channel), and an IPv4 one
// IPv6 routes too with Neighbor.CarryIPv6.
type Config struct {
	// RouterID is the peer's BGP identifier (an IPv4 address).
	RouterID netip.Addr
	// ASN is the peer's own AS.
	ASN       uint32
	Neighbors []Neighbor
	// BFD sets the timers of the sessions of neighbors with BFD set.
	BFD BFDIntervals
	// ImportHostRoutesIn, when set, limits the IPv4 routes the peer accepts
	// to /32s inside it; unset, it accepts every IPv4 route.
	ImportHostRoutesIn netip.Prefix
	// ImportHostRoutesIn6 is ImportHostRoutesIn for IPv6 routes (on IPv6
	// sessions and on IPv4 ones with CarryIPv6): /128s inside it.
	ImportHostRoutesIn6 netip.Prefix
	// Log is the file BIRD logs to; empty logs to stderr.
	Log string
	// Originate lists the prefixes the peer announces to every neighbor of
	// their family (as blackhole static routes, which stay out of its own
	// kernel).
	Originate []netip.Prefix
}

var symbolRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]*$`)

// importFilter is a channel's import clause: every route when p is unset,
// else only host routes inside p, which must be a prefix of the family
// (ipv4 or not) without host bits.
func importFilter(p netip.Prefix, ipv4 bool) (string, error) {
	if !p.IsValid() {
		return "all", nil
	}
	name, family := "importHostRoutesIn", "IPv4"
	if !ipv4 {
		name, family = "importHostRoutesIn6", "IPv6"
	}
	if p.Addr().Is4() != ipv4 || p.Addr().Is4In6() || p.Masked() != p {
		return "", fmt.Errorf("%s %v: must be an %s prefix without host bits", name, p, family)
	}
	return fmt.Sprintf("where net ~ [ %s{%d,%d} ]", p, p.Addr().BitLen(), p.Addr().BitLen()), nil
}

// globalIPv6 reports whether a is an IPv6 address BIRD can peer with
// without naming an interface: not IPv4-mapped, zoned or link-local.
func globalIPv6(a netip.Addr) bool {
	return a.Is6() && !a.Is4In6() && a.Zone() == "" && !a.IsLinkLocalUnicast()
}

// Render returns the BIRD configuration for cfg, or an error naming the
// first field BIRD would not accept.
func Render(cfg Config) (string, error) {
	if !cfg.RouterID.Is4() {
		return "", fmt.Errorf("router id %v: must be an IPv4 address", cfg.RouterID)
	}
	if cfg.ASN == 0 {
		return "", errors.New("ASN must be set")
	}
	var b strings.Builder
	b.WriteString("# Written by test/bgppeer/birdconf.\n")
	if cfg.Log == "" {
		b.WriteString("log stderr all;\n")
	} else {
		fmt.Fprintf(&b, "log %q all;\n", cfg.Log)
	}
	b.WriteString("debug protocols { states, events };\n")
	fmt.Fprintf(&b, "router id %s;\n\n", cfg.RouterID)
	b.WriteString("protocol device {}\n\n")
	// Only BGP routes go to the kernel, so the originated blackholes stay
	// out of it; merge paths turns equal BGP routes into a multipath route.
	// The IPv6 kernel protocol is there only for IPv6 sessions, so that an
	// IPv4-only peer's configuration stays what it was.
	ipv6 := slices.ContainsFunc(cfg.Neighbors, func(n Neighbor) bool { return n.Address.Is6() || n.CarryIPv6 })
	b.WriteString("protocol kernel {\n\tipv4 { import none; export where source = RTS_BGP; };\n\tmerge paths on;\n}\n")
	if ipv6 {
		b.WriteString("protocol kernel kernel6 {\n\tipv6 { import none; export where source = RTS_BGP; };\n\tmerge paths on;\n}\n")
	}

	export := "none"
	if len(cfg.Originate) > 0 {
		export = "where source = RTS_STATIC"
	}
	for _, f := range []struct {
		name, channel string
		is4           bool
	}{{"originated", "ipv4", true}, {"originated6", "ipv6", false}} {
		var routes []netip.Prefix
		for _, p := range cfg.Originate {
			if !p.IsValid() || p.Addr().Is4In6() || p.Addr().Zone() != "" || p.Masked() != p {
				return "", fmt.Errorf("originate %v: must be an IPv4 or IPv6 prefix without host bits", p)
			}
			if p.Addr().Is4() == f.is4 {
				routes = append(routes, p)
			}
		}
		if len(routes) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\nprotocol static %s {\n\t%s;\n", f.name, f.channel)
		for _, p := range routes {
			fmt.Fprintf(&b, "\troute %s blackhole;\n", p)
		}
		b.WriteString("}\n")
	}

	imp, err := importFilter(cfg.ImportHostRoutesIn, true)
	if err != nil {
		return "", err
	}
	imp6, err := importFilter(cfg.ImportHostRoutesIn6, false)
	if err != nil {
		return "", err
	}

	bfd := false
	seen := map[string]bool{"device1": true, "kernel1": true, "kernel6": true, "originated": true, "originated6": true, "bfd1": true}
	for _, n := range cfg.Neighbors {
		if !symbolRE.MatchString(n.Name) || seen[n.Name] {
			return "", fmt.Errorf("neighbor name %q: must be unique, start with a letter and hold only letters, digits and underscores", n.Name)
		}
		seen[n.Name] = true
		if !n.Address.Is4() && !globalIPv6(n.Address) {
			return "", fmt.Errorf("neighbor %s: address %v must be IPv4 or a global IPv6 address", n.Name, n.Address)
		}
		if n.ASN == 0 {
			return "", fmt.Errorf("neighbor %s: ASN must be set", n.Name)
		}
		if n.CarryIPv6 && !n.Address.Is4() {
			return "", fmt.Errorf("neighbor %s: CarryIPv6 is for a session with an IPv4 neighbor", n.Name)
		}
		local := ""
		if n.LocalAddress.IsValid() {
			if n.LocalAddress.Is4() != n.Address.Is4() || (n.LocalAddress.Is6() && !globalIPv6(n.LocalAddress)) {
				return "", fmt.Errorf("neighbor %s: local address %v must be of the neighbor address's family", n.Name, n.LocalAddress)
			}
			local = n.LocalAddress.String() + " "
		}
		fmt.Fprintf(&b, "\nprotocol bgp %s {\n\tlocal %sas %d;\n\tneighbor %s as %d;\n", n.Name, local, cfg.ASN, n.Address, n.ASN)
		if n.Multihop < 0 || n.Multihop > 255 {
			return "", fmt.Errorf("neighbor %s: multihop %d out of 0..255", n.Name, n.Multihop)
		}
		if n.Multihop == 0 {
			b.WriteString("\tdirect;\n")
		} else {
			fmt.Fprintf(&b, "\tmultihop %d;\n", n.Multihop)
		}
		b.WriteString("\tconnect delay time 1;\n\tconnect retry time 1;\n\terror wait time 1, 5;\n")
		for _, t := range []struct {
			name string
			d    time.Duration
		}{{"hold time", n.HoldTime}, {"keepalive time", n.KeepaliveTime}} {
			if t.d == 0 {
				continue
			}
			if t.d < 0 || t.d%time.Second != 0 {
				return "", fmt.Errorf("neighbor %s: %s %v must be whole seconds", n.Name, t.name, t.d)
			}
			fmt.Fprintf(&b, "\t%s %d;\n", t.name, t.d/time.Second)
		}
		if n.Password != "" {
			if strings.ContainsAny(n.Password, "\"\n") {
				return "", fmt.Errorf("neighbor %s: password must not contain a double quote or a newline", n.Name)
			}
			fmt.Fprintf(&b, "\tpassword \"%s\";\n", n.Password)
		}
		if n.Passive {
			b.WriteString("\tpassive on;\n")
		}
		if n.BFD {
			bfd = true
			b.WriteString("\tbfd on;\n")
		}
		if n.Address.Is4() {
			fmt.Fprintf(&b, "\tipv4 { import %s; export %s; };\n", imp, export)
		}
		if n.Address.Is6() || n.CarryIPv6 {
			fmt.Fprintf(&b, "\tipv6 { import %s; export %s; };\n", imp6, export)
		}
		b.WriteString("}\n")
	}

	if bfd {
		var timers strings.Builder
		for _, t := range []struct {
			name string
			d    time.Duration
		}{{"min tx interval", cfg.BFD.MinTx}, {"min rx interval", cfg.BFD.MinRx}} {
			if t.d == 0 {
				continue
			}
			if t.d < 0 || t.d%time.Microsecond != 0 {
				return "", fmt.Errorf("BFD %s %v must be whole microseconds", t.name, t.d)
			}
			fmt.Fprintf(&timers, " %s %d us;", t.name, t.d/time.Microsecond)
		}
		if cfg.BFD.Multiplier < 0 || cfg.BFD.Multiplier > 255 {
			return "", fmt.Errorf("BFD multiplier %d out of 0..255", cfg.BFD.Multiplier)
		}
		if cfg.BFD.Multiplier > 0 {
			fmt.Fprintf(&timers, " multiplier %d;", cfg.BFD.Multiplier)
		}
		fmt.Fprintf(&b, "\nprotocol bfd {\n\tinterface \"*\" {%s };\n\tmultihop {%s };\n}\n", timers.String(), timers.String())
	}
	return b.String(), nil
}
