package image

import "slices"

// Daemon is what one daemon's image holds besides its binary: the Debian
// packages to take files from, and the paths it executes (each with what
// it loads, see Closure).
type Daemon struct {
	Name     string // the binary and the image's name
	Packages []string
	Paths    []string
}

// modprobe is the kernel check's fallback for a missing module (kmod links
// libzstd, liblzma and libcrypto). It loads modules from the node's
// /lib/modules, which the manifest mounts.
var (
	modprobePackages = []string{"libc6", "kmod", "libkmod2", "libzstd1", "liblzma5", "libssl3"}
	modprobePaths    = []string{"/sbin/modprobe"}
)

// iptablesPackages are iptables with the libraries it links, and
// /etc/protocols (netbase), which lets iptables name protocols.
var iptablesPackages = []string{"iptables", "libxtables12", "libip4tc2", "libip6tc2", "libnftnl11", "libmnl0",
	"libnetfilter-conntrack3", "libnfnetlink0", "netbase"}

// conntrackdPackages are conntrackd (--conntrack-sync-interface) and the
// libraries it links that iptables does not.
var conntrackdPackages = []string{"conntrackd", "libnetfilter-cthelper0", "libnetfilter-queue1", "libsystemd0",
	"libcap2", "libgcrypt20", "libgpg-error0", "liblz4-1"}

// Router is the tunnel router's image: iptables (IPv4 and IPv6, nft and
// legacy, each with save and restore, since the router writes rules with
// the backend the node uses) with its match and target extensions,
// conntrackd, which it runs to share its conntrack entries with the other
// routers, and modprobe.
var Router = Daemon{
	Name:     "tunnel-router",
	Packages: slices.Concat(iptablesPackages, conntrackdPackages, modprobePackages),
	Paths:    slices.Concat(iptablesPaths(), []string{"/usr/lib/x86_64-linux-gnu/xtables", "/etc/protocols", "/usr/sbin/conntrackd"}, modprobePaths),
}

// Endpoint is the endpoint agent's image: iptables, as the router's (it
// writes the network policy rules inside pods with the node's backend),
// and modprobe. It talks to the kernel otherwise through netlink and to
// the runtimes through their sockets.
var Endpoint = Daemon{
	Name:     "tunnel-endpoint",
	Packages: slices.Concat(iptablesPackages, modprobePackages),
	Paths:    slices.Concat(iptablesPaths(), []string{"/usr/lib/x86_64-linux-gnu/xtables", "/etc/protocols"}, modprobePaths),
}

func iptablesPaths() []string {
	var paths []string
	for _, family := range []string{"iptables", "ip6tables"} {
		for _, backend := range []string{"nft", "legacy"} {
			for _, tool := range []string{"", "-save", "-restore"} {
				paths = append(paths, "/usr/sbin/"+family+"-"+backend+tool)
			}
		}
	}
	return paths
}

// CopyrightPaths are the Debian copyright files of d's packages, shipped
// with the files taken from them.
func (d Daemon) CopyrightPaths() []string {
	paths := make([]string, len(d.Packages))
	for i, p := range d.Packages {
		paths[i] = "/usr/share/doc/" + p + "/copyright"
	}
	return paths
}
