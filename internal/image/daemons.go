package image

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

// Router is the tunnel router's image: iptables (IPv4 and IPv6, nft and
// legacy, each with save and restore, since the router writes rules with
// the backend the node uses) with its match and target extensions, and
// modprobe. /etc/protocols lets iptables name protocols.
var Router = Daemon{
	Name: "tunnel-router",
	Packages: append([]string{"iptables", "libxtables12", "libip4tc2", "libip6tc2", "libnftnl11", "libmnl0",
		"libnetfilter-conntrack3", "libnfnetlink0", "netbase"}, modprobePackages...),
	Paths: append(iptablesPaths(), append([]string{"/usr/lib/x86_64-linux-gnu/xtables", "/etc/protocols"}, modprobePaths...)...),
}

// Endpoint is the endpoint agent's image: iptables, as the router's (it
// writes the network policy rules inside pods with the node's backend),
// and modprobe. It talks to the kernel otherwise through netlink and to
// the runtimes through their sockets.
var Endpoint = Daemon{
	Name:     "tunnel-endpoint",
	Packages: Router.Packages,
	Paths:    Router.Paths,
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
