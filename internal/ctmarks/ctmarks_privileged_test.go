package ctmarks

import (
	"net"
	"net/netip"
	"runtime"
	"testing"

	vnl "github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestListsOnlyTheMarksAsked fills a namespace's conntrack table with a
// flood (entries to a tunnel IP with the current generation's marks, and
// entries with no mark, as traffic that is not for a tunnel IP makes) and a
// few draining flows with an older generation's marks, then lists the
// older generation's marks: exactly the draining flows come back. It
// prints what a dump of the whole table (vishvananda/netlink's, which the
// router used before) and the filtered ones allocate.
func TestListsOnlyTheMarksAsked(t *testing.T) {
	ns := testnetns.New(t)
	h, err := vnl.NewHandleAt(ns.Handle, unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	const (
		offset  = 0x1000 // the router's default mark offset
		buckets = 64
		flood   = 5000
	)
	vip := netip.MustParseAddr("192.0.2.10")
	vip6 := netip.MustParseAddr("2001:db8:2::10")
	create := func(src, dst netip.Addr, port uint16, mark uint32) {
		t.Helper()
		family := vnl.InetFamily(unix.AF_INET)
		if dst.Is6() {
			family = unix.AF_INET6
		}
		f := &vnl.ConntrackFlow{FamilyType: uint8(family), Mark: mark, TimeOut: 120}
		f.Forward = vnl.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: net.IP(src.AsSlice()), DstIP: net.IP(dst.AsSlice()), SrcPort: port, DstPort: 53}
		f.Reverse = vnl.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: net.IP(dst.AsSlice()), DstIP: net.IP(src.AsSlice()), SrcPort: 53, DstPort: port}
		if err := h.ConntrackCreate(vnl.ConntrackTable, family, f); err != nil {
			t.Fatalf("creating a conntrack entry: %v", err)
		}
	}
	for i := range flood {
		src := netip.AddrFrom4([4]byte{198, 51, byte(i >> 8), byte(i)})
		create(src, vip, 4000, offset+1*buckets+uint32(i%buckets)) // generation 1, the current one
		create(src, netip.MustParseAddr("203.0.113.1"), 4000, 0)   // not for a tunnel IP
	}
	draining := map[uint32]bool{}
	for i := range 5 {
		mark := offset + uint32(i*7) // generation 0, older
		create(netip.AddrFrom4([4]byte{198, 18, 0, byte(i)}), vip, 5000, mark)
		draining[mark] = true
	}
	create(netip.MustParseAddr("2001:db8:100::1"), vip6, 5000, offset+3) // IPv6, generation 0

	lister := Lister{NetNS: int(ns.Handle)}
	gen0 := []Range{{First: offset, Count: buckets}}
	var got []vnl.ConntrackFlow
	filteredBytes := allocatedBy(func() {
		if err := lister.EachMarked(unix.AF_INET, gen0, func(f *vnl.ConntrackFlow) { got = append(got, *f) }); err != nil {
			t.Fatal(err)
		}
	})
	if len(got) != len(draining) {
		t.Errorf("listed %d IPv4 entries of generation 0, want %d", len(got), len(draining))
	}
	for _, f := range got {
		if !draining[f.Mark] || !f.Forward.DstIP.Equal(vip.AsSlice()) || f.Forward.Protocol != unix.IPPROTO_UDP ||
			f.Forward.SrcPort != 5000 || f.Forward.DstPort != 53 || f.TimeOut == 0 || f.TimeOut > 120 {
			t.Errorf("listed %+v, not one of the draining flows", f)
		}
	}
	var got6 []vnl.ConntrackFlow
	if err := lister.EachMarked(unix.AF_INET6, gen0, func(f *vnl.ConntrackFlow) { got6 = append(got6, *f) }); err != nil || len(got6) != 1 || !got6[0].Forward.DstIP.Equal(vip6.AsSlice()) {
		t.Errorf("IPv6 entries of generation 0: %v, %v; want the one to %v", got6, err, vip6)
	}
	// What each way holds at once: the whole dump keeps every entry until
	// it returns; the filtered one one buffer and one entry (measured
	// after a GC every 1,000 entries, while it runs).
	base := liveHeap()
	all, err := h.ConntrackTableList(vnl.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	wholeHeld := liveHeap() - base
	runtime.KeepAlive(all)
	if len(all) < 2*flood {
		t.Errorf("the whole table has %d IPv4 entries, want at least %d: the flood was not created", len(all), 2*flood)
	}
	wholeEntries := len(all)
	all = nil
	// Every mark of the router (4 generations), the flood included.
	ours := 0
	base = liveHeap()
	var oursHeld int64
	if err := lister.EachMarked(unix.AF_INET, []Range{{First: offset, Count: 4 * buckets}}, func(*vnl.ConntrackFlow) {
		if ours++; ours%1000 == 0 {
			oursHeld = max(oursHeld, liveHeap()-base)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if ours != flood+len(draining) {
		t.Errorf("listed %d IPv4 entries with the router's marks, want %d", ours, flood+len(draining))
	}
	t.Logf("%d IPv4 entries in the table: a dump of the whole table (vishvananda/netlink, the router's before) holds %d KiB at its end; the filtered dump of the router's marks (%d entries) holds at most %d KiB while it runs, and the one of generation 0 (%d entries) allocates %d KiB in all",
		wholeEntries, wholeHeld/1024, ours, oursHeld/1024, len(got), filteredBytes/1024)
}

// liveHeap returns the bytes live on the heap after a collection.
func liveHeap() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// allocatedBy returns the bytes fn allocates.
func allocatedBy(fn func()) uint64 {
	var a, b runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&a)
	fn()
	runtime.ReadMemStats(&b)
	return b.TotalAlloc - a.TotalAlloc
}
