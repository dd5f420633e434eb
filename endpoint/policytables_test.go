package endpoint

import "testing"

// TestNamespaceIPTablesBinary: the IPv6 command of each backend is its
// ip6tables counterpart.
func TestNamespaceIPTablesBinary(t *testing.T) {
	for in, want := range map[string]string{
		"iptables":                   "ip6tables",
		"iptables-nft":               "ip6tables-nft",
		"iptables-legacy":            "ip6tables-legacy",
		"/usr/sbin/iptables-legacy":  "/usr/sbin/ip6tables-legacy",
		"/opt/iptables/bin/iptables": "/opt/iptables/bin/ip6tables",
	} {
		tables := NamespaceIPTables{Binary: in}
		if got := tables.binary(true); got != want {
			t.Errorf("%s: IPv6 command %q, want %q", in, got, want)
		}
		if got := tables.binary(false); got != in {
			t.Errorf("%s: IPv4 command %q", in, got)
		}
	}
}
