package hmark

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPortFilterInNetns drives the port filter against the real iptables
// and ip6tables of each backend: datagrams to a filtered tunnel IP's port
// that its Service does not list are dropped before they are marked and
// counted per tunnel IP; a listed port passes, and so does every port of a
// tunnel IP that is not filtered; a rule the router reads back as it wrote
// it (no rewrite on the next Sync); Update opens a port; the sets and the
// rule go with the last filtered tunnel IP, and Cleanup leaves nothing.
func TestPortFilterInNetns(t *testing.T) { forEachBackend(t, testPortFilterInNetns) }

func testPortFilterInNetns(t *testing.T, nf netnsFamily, binary string) {
	ns := nf.newNS(t)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	chain := nf.newChain(t, ns, ipt, restorer, Params{Buckets: 16, Offset: 0x100, Seed: 0xc0ffee})
	listed, unlisted, open := nf.vips[0], nf.vips[1], nf.vips[2]
	udp := func(n uint16) Port { return Port{Protocol: unix.IPPROTO_UDP, Number: n} }
	targets := func(unlistedPorts ...Port) []Target {
		return []Target{
			{VIP: listed, FilterPorts: true, Ports: []Port{udp(9), {Protocol: unix.IPPROTO_TCP, Number: 80}}},
			{VIP: unlisted, FilterPorts: true, Ports: unlistedPorts},
			{VIP: open},
		}
	}
	if _, err := chain.Sync(targets(udp(10))); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	t.Logf("%s prints the router's rules as:\n%s", binary, ns.Run(binary, "-t", "mangle", "-S", chain.Name()))
	if changed, err := chain.Sync(targets(udp(10))); err != nil || changed != 0 {
		t.Fatalf("second Sync: changed %d, %v; want nothing: the rule or sets do not read back as written", changed, err)
	}

	// sendDatagrams sends to port 9.
	sendDatagrams(t, ns, nf.loopback, listed, 3)
	sendDatagrams(t, ns, nf.loopback, unlisted, 2)
	sendDatagrams(t, ns, nf.loopback, open, 1)
	drops, err := chain.PortDrops()
	if err != nil {
		t.Fatalf("PortDrops: %v", err)
	}
	two := Counter{Packets: 2, Bytes: 2 * (nf.headers + 8)}
	if drops[listed].Packets != 0 || drops[unlisted] != two || len(drops) != 2 {
		t.Errorf("PortDrops = %v, want %v for %v alone (and 0 for %v; %v not filtered)", drops, two, unlisted, listed, open)
	}
	counters, err := chain.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if counters[unlisted].Packets != 2 || counters[listed].Packets != 3 || counters[open].Packets != 1 {
		t.Errorf("Counters = %v: every packet that reached the router counts, dropped or not", counters)
	}

	// Port 9 listed for the second tunnel IP too: no more drops.
	if _, err := chain.Update(targets(udp(10), udp(9))); err != nil {
		t.Fatalf("Update: %v", err)
	}
	sendDatagrams(t, ns, nf.loopback, unlisted, 2)
	if drops, err := chain.PortDrops(); err != nil || drops[unlisted] != two {
		t.Errorf("after opening port 9: PortDrops = %v, %v; want still %v", drops, err, two)
	}
	if changed, err := chain.Sync(targets(udp(10), udp(9))); err != nil || changed != 0 {
		t.Errorf("Sync after Update: changed %d, %v; want nothing", changed, err)
	}

	// No tunnel IP filtered: the rule and the sets go.
	if _, err := chain.Update(targetsOf(listed, unlisted, open)); err != nil {
		t.Fatalf("Update without filters: %v", err)
	}
	if rules, sets := ns.Run(binary, "-t", "mangle", "-S", chain.Name()), ns.IPSetState(); strings.Contains(rules, "DROP") || strings.Contains(sets, chain.Name()+"-p") || strings.Contains(sets, chain.Name()+"-f") {
		t.Errorf("without a filtered tunnel IP the drop rule or the filter's sets remain:\n%s\n%s", rules, sets)
	}
	if _, err := chain.Sync(targets(udp(10))); err != nil {
		t.Fatal(err)
	}
	if err := chain.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if sets := ns.IPSetState(); strings.Contains(sets, chain.Name()) {
		t.Errorf("after Cleanup the sets are\n%s", sets)
	}
}
