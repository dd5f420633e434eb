package birdconf

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Birdc runs birdc against the control socket with args (for example
// "show", "protocols", "all") and returns its answer without the greeting
// line. The error is set when birdc fails, which it does for BIRD's error
// replies too.
func Birdc(ctx context.Context, socket string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "birdc", append([]string{"-s", socket}, args...)...).CombinedOutput()
	s := string(out)
	if first, rest, ok := strings.Cut(s, "\n"); ok && strings.HasPrefix(first, "BIRD ") && strings.HasSuffix(first, " ready.") {
		s = rest
	}
	if err != nil {
		return s, fmt.Errorf("birdc %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(s))
	}
	return s, nil
}

// ParseProtocol finds the line of protocol name in birdc's answer to
// "show protocols" (Name Proto Table State Since Info...) and returns whether
// it is an established BGP session, and its State and Info columns ("up
// Established", "start Active Socket: Connection refused").
func ParseProtocol(out, name string) (bool, string, error) {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[0] != name {
			continue
		}
		state := strings.Join(append([]string{f[3]}, f[5:]...), " ")
		return f[3] == "up" && len(f) > 5 && f[5] == "Established", state, nil
	}
	return false, "", fmt.Errorf("no protocol %q in birdc's answer: %s", name, strings.TrimSpace(out))
}

// KernelNextHops returns, sorted, the next hops of the kernel route for
// exactly prefix in the main table of h's namespace, one per path of a
// multipath route (such as BIRD installs with "merge paths on"); none when
// there is no such route.
func KernelNextHops(h *netlink.Handle, prefix netip.Prefix) ([]netip.Addr, error) {
	family := netlink.FAMILY_V4
	if prefix.Addr().Is6() {
		family = netlink.FAMILY_V6
	}
	p := prefix.Masked()
	dst := &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
	filter := &netlink.Route{Dst: dst, Table: unix.RT_TABLE_MAIN}
	routes, err := h.RouteListFiltered(family, filter, netlink.RT_FILTER_DST|netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("list kernel routes for %s: %w", prefix, err)
	}
	var hops []netip.Addr
	add := func(gw []byte) {
		if a, ok := netip.AddrFromSlice(gw); ok {
			hops = append(hops, a.Unmap())
		}
	}
	for _, r := range routes {
		add(r.Gw)
		for _, nh := range r.MultiPath {
			add(nh.Gw)
		}
	}
	slices.SortFunc(hops, netip.Addr.Compare)
	return hops, nil
}
