package datapath

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

func TestAddrTableInternsAndSweeps(t *testing.T) {
	at := newAddrTable()
	a, b := netip.MustParseAddr("fd00:244::1"), netip.MustParseAddr("10.244.0.1")
	ia, ib := at.intern(a), at.intern(b)
	if ia == 0 || ib == 0 || ia == ib || at.intern(a) != ia || at.addr(ia) != a || at.addr(ib) != b || at.intern(netip.Addr{}) != 0 {
		t.Fatalf("interned %v as %d and %v as %d", a, ia, b, ib)
	}
	// Only a is held: b's index is freed and given to the next address.
	at.sweep(func(mark func(nextHop)) { mark(nextHop{kind: hopGRE, addr: ia}) })
	if at.addr(ia) != a || at.addr(ib).IsValid() || at.kept != 1 {
		t.Fatalf("after the sweep: %v %v (kept %d)", at.addr(ia), at.addr(ib), at.kept)
	}
	c := netip.MustParseAddr("fd00:244::3")
	if ic := at.intern(c); ic != ib || at.addr(ic) != c || at.intern(a) != ia {
		t.Errorf("%v got index %d, want the freed %d", c, ic, ib)
	}
}

// TestAddrTableStaysBounded: endpoints that come and go (a rolling update,
// over and over) leave the interned addresses bounded by those in use, and
// the kernel as a fresh router would program it.
func TestAddrTableStaysBounded(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	cfg.Generations = 1
	k := seamtest.NewKernel()
	d := newTestDatapath(cfg, k)
	if err := d.Resync(nil); err != nil {
		t.Fatal(err)
	}
	var last Tunnel
	for round := range 200 {
		pods := []string{fmt.Sprintf("fd00:244::%x", 2*round+1), fmt.Sprintf("fd00:244::%x", 2*round+2)}
		last = tunnel6(cfg, "2001:db8::1", pods...)
		if err := d.SetTunnel(last); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(d.addrs.index); n > 2*2+64 {
		t.Errorf("%d interned addresses after 400 pods came and went, 2 in use", n)
	}
	writes := k.Writes
	if err := d.Resync([]Tunnel{last}); err != nil || k.Writes != writes {
		t.Errorf("resync after the churn: %v, %d writes; want none", err, k.Writes-writes)
	}
	if !sameAddrs(kernelTable(cfg, k, last.VIP, 0), addrsOf(last)) {
		t.Errorf("kernel table %v, want %v", kernelTable(cfg, k, last.VIP, 0), addrsOf(last))
	}
}
