package ctsync

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// nftCounter is a counter as nft lists it.
var nftCounter = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// listedRules are the table's rules as nft lists them, counters and
// comments left out: to compare with PortRule.String.
func listedRules(t *testing.T, ns *testnetns.NS) []string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(ns.Run("nft", "list", "table", "ip", PortFilterTable), "\n") {
		line = strings.TrimSpace(line)
		if !strings.Contains(line, " comment ") {
			continue
		}
		line, _, _ = strings.Cut(line, " comment ")
		out = append(out, nftCounter.ReplaceAllString(line, "counter"))
	}
	return out
}

// TestPortFilterEnsureReadRemove writes the table in a namespace: the
// rules nft lists are the rules computed (the expressions say what the
// comments say); a second Ensure writes nothing; other peers replace the
// rules in one go; a table of that name holding anything else is
// replaced; Remove deletes the table alone, and again finds nothing to
// delete.
func TestPortFilterEnsureReadRemove(t *testing.T) {
	ns := testnetns.New(t)
	ns.Run("nft", "add table ip other; add chain ip other input { type filter hook input priority 0; }; add rule ip other input udp dport 3780 counter")
	f := PortFilter{Interface: "sync0", Group: 3780, Peers: prefixes("172.21.0.2/32", "10.0.0.0/24")}
	if st, changed, err := EnsurePortFilter(ns.Handle, f); err != nil || !changed || !st.Current {
		t.Fatalf("Ensure = %+v, %v, %v; want a write", st, changed, err)
	}
	want := ruleStrings(f)
	if got := listedRules(t, ns); !slices.Equal(got, want) {
		t.Errorf("nft lists\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if !strings.Contains(ns.Run("nft", "list", "table", "ip", PortFilterTable), "type filter hook input priority filter; policy accept;") {
		t.Error("the chain is not a filter chain on the input hook, priority filter, accepting by default")
	}
	st, err := ReadPortFilter(ns.Handle)
	if err != nil || !st.Present || !st.Current || !slices.Equal(st.Rules, want) {
		t.Errorf("Read = %+v, %v; want the rules %q", st, err, want)
	}
	if _, changed, err := EnsurePortFilter(ns.Handle, f); err != nil || changed {
		t.Errorf("Ensure again = %v, %v; want no write", changed, err)
	}
	f2 := PortFilter{Interface: "sync1", Group: 3781}
	if _, changed, err := EnsurePortFilter(ns.Handle, f2); err != nil || !changed {
		t.Errorf("Ensure of another filter = %v, %v; want a write", changed, err)
	}
	if got, want := listedRules(t, ns), ruleStrings(f2); !slices.Equal(got, want) {
		t.Errorf("after the change nft lists\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if _, _, err := EnsurePortFilter(ns.Handle, PortFilter{Interface: "sync0", Group: 3780, Peers: prefixes("2001:db8::/64")}); err == nil {
		t.Error("Ensure wrote a filter with an IPv6 peer")
	}
	if got := listedRules(t, ns); !slices.Equal(got, ruleStrings(f2)) {
		t.Errorf("a refused filter changed the table: %q", got)
	}

	// A table of the router's name with something else in it.
	if err := RemovePortFilter(ns.Handle); err != nil {
		t.Fatal(err)
	}
	ns.Run("nft", "add table ip "+PortFilterTable+"; add chain ip "+PortFilterTable+" "+PortFilterChain+" { type filter hook input priority 0; }; add rule ip "+PortFilterTable+" "+PortFilterChain+" counter")
	if st, err := ReadPortFilter(ns.Handle); err != nil || !st.Present || st.Current {
		t.Errorf("Read of a foreign table of that name = %+v, %v; want present, not current", st, err)
	}
	if _, changed, err := EnsurePortFilter(ns.Handle, f); err != nil || !changed {
		t.Errorf("Ensure over a foreign table = %v, %v; want a write", changed, err)
	}
	if got := listedRules(t, ns); !slices.Equal(got, want) {
		t.Errorf("after replacing the foreign table nft lists %q, want %q", got, want)
	}

	if err := RemovePortFilter(ns.Handle); err != nil {
		t.Fatal(err)
	}
	if st, err := ReadPortFilter(ns.Handle); err != nil || st.Present {
		t.Errorf("Read after Remove = %+v, %v", st, err)
	}
	if err := RemovePortFilter(ns.Handle); err != nil {
		t.Errorf("Remove without the table: %v", err)
	}
	if !strings.Contains(ns.Run("nft", "list", "table", "ip", "other"), "udp dport 3780 counter") {
		t.Error("the namespace's other table was changed")
	}
}
