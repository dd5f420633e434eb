package topology

import (
	"context"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	vnl "github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// netfilterHandle opens a NETLINK_NETFILTER handle in ns, closed when the
// test ends.
func netfilterHandle(t *testing.T, ns *testnetns.NS) *vnl.Handle {
	t.Helper()
	h, err := vnl.NewHandleAt(ns.Handle, unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

// createEntry adds a conntrack entry through ctnetlink, as the kernel makes
// one for a flow's first packet.
func createEntry(t *testing.T, h *vnl.Handle, proto uint8, src, dst netip.Addr, sport, dport uint16, mark, timeout uint32) {
	t.Helper()
	family := vnl.InetFamily(unix.AF_INET)
	if dst.Is6() {
		family = unix.AF_INET6
	}
	f := &vnl.ConntrackFlow{FamilyType: uint8(family), Mark: mark, TimeOut: timeout}
	f.Forward = vnl.IPTuple{Protocol: proto, SrcIP: net.IP(src.AsSlice()), DstIP: net.IP(dst.AsSlice()), SrcPort: sport, DstPort: dport}
	f.Reverse = vnl.IPTuple{Protocol: proto, SrcIP: net.IP(dst.AsSlice()), DstIP: net.IP(src.AsSlice()), SrcPort: dport, DstPort: sport}
	if proto == unix.IPPROTO_TCP {
		f.ProtoInfo = &vnl.ProtoInfoTCP{State: 3} // ESTABLISHED
	}
	if err := h.ConntrackCreate(vnl.ConntrackTable, family, f); err != nil {
		t.Fatalf("creating a conntrack entry: %v", err)
	}
}

// TestConntrackInReadsTheKernelsEntries: the entries ctnetlink holds in a
// namespace come back with their tuple, protocol, TCP state, mark, timeout
// and status, both families, and no entry of another namespace.
func TestConntrackInReadsTheKernelsEntries(t *testing.T) {
	ns, other := testnetns.New(t), testnetns.New(t)
	h, hOther := netfilterHandle(t, ns), netfilterHandle(t, other)
	client, vip := netip.MustParseAddr("198.51.100.10"), netip.MustParseAddr("192.0.2.10")
	client6, vip6 := netip.MustParseAddr("2001:db8:100::10"), netip.MustParseAddr("2001:db8:2::10")
	createEntry(t, h, unix.IPPROTO_TCP, client, vip, 21284, 7, 4141, 296)
	createEntry(t, h, unix.IPPROTO_UDP, client6, vip6, 48303, 53, 4097, 29)
	createEntry(t, hOther, unix.IPPROTO_TCP, client, vip, 21285, 7, 4141, 296)

	got, err := ConntrackIn(context.Background(), ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("read %d entries, want 2: %v", len(got), got)
	}
	tcp, udp := got[0], got[1]
	if tcp.Proto != "tcp" {
		tcp, udp = udp, tcp
	}
	if tcp.Proto != "tcp" || tcp.Src != client || tcp.Dst != vip || tcp.SrcPort != 21284 || tcp.DstPort != 7 ||
		tcp.State != "ESTABLISHED" || tcp.Mark != 4141 || tcp.Timeout < 280 || tcp.Timeout > 296 ||
		!slices.Equal(tcp.Flags, []string{"UNREPLIED"}) || tcp.HasCounters {
		t.Errorf("TCP entry %v, want tcp %v:21284 -> %v:7 ESTABLISHED, mark 0x102d, timeout 280-296 s, [UNREPLIED], no counters", tcp, client, vip)
	}
	if udp.Proto != "udp" || udp.Src != client6 || udp.Dst != vip6 || udp.SrcPort != 48303 || udp.DstPort != 53 || udp.Mark != 4097 || udp.State != "" || udp.Timeout > 29 {
		t.Errorf("UDP entry %v", udp)
	}
}

// TestConntrackInSkipsNoEntryWhileOthersComeAndGo reads a namespace's 300
// entries again and again while other entries of the namespace are added
// and removed all the time: every read has all 300. It logs how often
// reading /proc/net/nf_conntrack (a page per read, each read finding its
// place again by counting entries from the start of the hash table) missed
// one in the same churn: never, on this host's kernel so far; the e2e BGP
// scenario, which read that file, once saw 3 of 200 live flows in neither
// router's table for 5 s.
func TestConntrackInSkipsNoEntryWhileOthersComeAndGo(t *testing.T) {
	ns := testnetns.New(t)
	// The churn has a handle of its own: it writes from another goroutine.
	h, hChurn := netfilterHandle(t, ns), netfilterHandle(t, ns)
	client, vip := netip.MustParseAddr("198.51.100.10"), netip.MustParseAddr("192.0.2.10")
	const flows = 300
	for i := range flows {
		createEntry(t, h, unix.IPPROTO_TCP, client, vip, uint16(40000+i), 7, 4100, 300)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		other := netip.MustParseAddr("203.0.113.1")
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			src := netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
			f := &vnl.ConntrackFlow{FamilyType: unix.AF_INET, TimeOut: 60}
			f.Forward = vnl.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: net.IP(src.AsSlice()), DstIP: net.IP(other.AsSlice()), SrcPort: 5000, DstPort: 53}
			f.Reverse = vnl.IPTuple{Protocol: unix.IPPROTO_UDP, SrcIP: net.IP(other.AsSlice()), DstIP: net.IP(src.AsSlice()), SrcPort: 53, DstPort: 5000}
			_ = hChurn.ConntrackCreate(vnl.ConntrackTable, unix.AF_INET, f)
			if i%64 == 63 {
				filter := &vnl.ConntrackFilter{}
				_ = filter.AddIP(vnl.ConntrackOrigDstIP, net.IP(other.AsSlice()))
				_, _ = hChurn.ConntrackDeleteFilters(vnl.ConntrackTable, unix.AF_INET, filter)
			}
		}
	}()
	defer func() { close(stop); wg.Wait() }()

	short, procShort := 0, 0
	const reads = 100
	for range reads {
		got, err := ConntrackIn(context.Background(), ns.Handle)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(flowsFrom(got, client, vip)); n != flows {
			short++
			t.Errorf("a dump read %d of the %d entries", n, flows)
		}
		var proc string
		if err := ns.Do(func() error {
			out, err := readProcConntrack()
			proc = out
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if n := countProcFlows(proc, client); n != flows {
			procShort++
		}
	}
	t.Logf("%d of %d dumps missed an entry; %d of %d reads of /proc/net/nf_conntrack did", short, reads, procShort, reads)
}

// readProcConntrack reads the calling thread's namespace's
// /proc/net/nf_conntrack as cat does.
func readProcConntrack() (string, error) {
	b, err := os.ReadFile("/proc/thread-self/net/nf_conntrack")
	return string(b), err
}

// countProcFlows counts the TCP lines from client in a
// /proc/net/nf_conntrack text.
func countProcFlows(table string, client netip.Addr) int {
	n := 0
	for _, line := range strings.Split(table, "\n") {
		if strings.Contains(line, " tcp ") && strings.Contains(line, " src="+client.String()+" ") {
			n++
		}
	}
	return n
}
