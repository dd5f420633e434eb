package hmark

import (
	"testing"

	"golang.org/x/sys/unix"
)

// The port filter is complete before a tunnel IP joins the sets that make
// it live, and a tunnel IP leaves them before its filter goes: Sync and
// Update write in that order, and the rule and sets come with the first
// filtered tunnel IP and go with the last.
func TestPortFilterOrder(t *testing.T) {
	f := newFakeIPTables(t)
	c := newTestChain(t, f, testParams)
	web := Port{Protocol: unix.IPPROTO_TCP, Number: 80}
	dns := Port{Protocol: unix.IPPROTO_UDP, Number: 53}
	if _, err := c.Sync(targetsOf(vipA)); err != nil {
		t.Fatal(err)
	}

	f.writes = nil
	filtered := []Target{{VIP: vipA}, {VIP: vipB, FilterPorts: true, Ports: []Port{dns, web, web}}}
	if _, err := c.Update(filtered); err != nil {
		t.Fatal(err)
	}
	// The first filtered tunnel IP: a Sync (a rule comes).
	checkWrites(t, "first filtered tunnel IP", f, []string{
		"ipset create KST-HMARK-f", "ipset create KST-HMARK-p",
		"ipset add KST-HMARK-p 10.96.0.20,6:80", "ipset add KST-HMARK-p 10.96.0.20,17:53",
		"ipset add KST-HMARK-f 10.96.0.20",
		"ipset add KST-HMARK 10.96.0.20", "ipset add KST-HMARK-0 10.96.0.20",
		"restore mangle",
	})

	f.writes = nil
	more := append(filtered, Target{VIP: vipC, FilterPorts: true, Ports: []Port{web}})
	if _, err := c.Update(more); err != nil {
		t.Fatal(err)
	}
	checkWrites(t, "another filtered tunnel IP (Update)", f, []string{
		"ipset add KST-HMARK-p 10.96.0.30,6:80", "ipset add KST-HMARK-f 10.96.0.30",
		"ipset add KST-HMARK 10.96.0.30", "ipset add KST-HMARK-0 10.96.0.30",
	})

	f.writes = nil
	more[1].Ports = []Port{web}
	if _, err := c.Update(more); err != nil {
		t.Fatal(err)
	}
	checkWrites(t, "a port less", f, []string{"ipset del KST-HMARK-p 10.96.0.20,17:53"})

	f.writes = nil
	if _, err := c.Update(more[:2]); err != nil {
		t.Fatal(err)
	}
	checkWrites(t, "a filtered tunnel IP removed", f, []string{
		"ipset del KST-HMARK-0 10.96.0.30", "ipset del KST-HMARK 10.96.0.30",
		"ipset del KST-HMARK-f 10.96.0.30", "ipset del KST-HMARK-p 10.96.0.30,6:80",
	})

	f.writes = nil
	if _, err := c.Update(targetsOf(vipA, vipB)); err != nil {
		t.Fatal(err)
	}
	checkWrites(t, "no tunnel IP filtered: the rule, then the sets go", f, []string{
		"restore mangle", "ipset destroy KST-HMARK-f", "ipset destroy KST-HMARK-p",
	})
	if changed, err := c.Sync(targetsOf(vipA, vipB)); err != nil || changed != 0 {
		t.Errorf("Sync after: changed %d, %v; want nothing", changed, err)
	}

	f.writes = nil
	if _, err := c.Update([]Target{{VIP: vipA, FilterPorts: true, Ports: []Port{{Protocol: unix.IPPROTO_GRE, Number: 1}}}}); err == nil {
		t.Error("a GRE port was accepted: a hash:ip,port set stores it as port 0")
	}
}
