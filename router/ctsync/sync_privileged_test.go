package ctsync

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// requireConntrackd skips the test when conntrackd is not installed, or
// fails it when KST_REQUIRE_INTEGRATION=1.
func requireConntrackd(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("conntrackd"); err != nil {
		msg := fmt.Sprintf("conntrackd not found (apt-get install conntrackd, or make deps): %v", err)
		if os.Getenv("KST_REQUIRE_INTEGRATION") == "1" {
			t.Fatalf("KST_REQUIRE_INTEGRATION=1 but %s", msg)
		}
		t.Skip(msg)
	}
}

// syncRouter is one router's namespace with its conntrackd.
type syncRouter struct {
	ns   *testnetns.NS
	nl   *netlink.Handle // netfilter netlink, for conntrack
	cfg  Config
	stop func()
	// noFilter runs conntrackd without the filter of its port.
	noFilter bool
}

var syncPools = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("2001:db8:7::/64")}

// startSync runs a Daemon for r (real conntrackd, started inside r's
// namespace) and waits until the Daemon says conntrackd runs: after it
// emptied conntrackd's cache, which would otherwise lose the entries the
// test makes meanwhile (their ends then never sent).
func startSync(t *testing.T, r *syncRouter) {
	t.Helper()
	log := logrus.New()
	log.SetOutput(os.Stderr)
	hook := test.NewLocal(log)
	d := &Daemon{Binary: "conntrackd", Config: r.cfg, Pools: func() []netip.Prefix { return syncPools }, Refresh: time.Hour,
		Log: log.WithField("router", r.cfg.Interface), enter: func() error { return netns.Set(r.ns.Handle) },
		guard: func(f PortFilter) (PortFilterState, bool, error) {
			if r.noFilter {
				return PortFilterState{}, false, nil
			}
			return EnsurePortFilter(r.ns.Handle, f)
		}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		if err := d.Run(ctx); err != nil {
			t.Error(err)
		}
		close(done)
	}()
	r.stop = func() { cancel(); <-done }
	t.Cleanup(r.stop)
	deadline := time.Now().Add(30 * time.Second)
	for !hasLog(hook, "conntrackd started: sharing the tunnel IPs' conntrack entries with the other routers") {
		if time.Now().After(deadline) {
			t.Fatalf("the Daemon of %s did not start conntrackd within 30 s", r.cfg.Interface)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// newSyncPair makes two namespaces joined by a veth pair (the sync link)
// and starts a conntrackd in each, each the other's peer.
func newSyncPair(t *testing.T) (a, b *syncRouter) {
	a = &syncRouter{ns: testnetns.New(t)}
	b = &syncRouter{ns: testnetns.New(t)}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "sync-a"}, PeerName: "sync-b", PeerNamespace: netlink.NsFd(b.ns.Handle)}
	if err := a.ns.Netlink().LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	for i, r := range []*syncRouter{a, b} {
		name := []string{"sync-a", "sync-b"}[i]
		addr := netip.AddrFrom4([4]byte{10, 99, 0, byte(i + 1)})
		h := r.ns.Netlink()
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(netip.PrefixFrom(addr, 24))}); err != nil {
			t.Fatal(err)
		}
		if err := h.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		r.nl = r.ns.IPSets() // a NETLINK_NETFILTER handle in the namespace
		peer := netip.AddrFrom4([4]byte{10, 99, 0, byte(2 - i)})
		r.cfg = Config{Interface: name, Address: addr, Group: DefaultGroup, Dir: t.TempDir(), Peers: []netip.Prefix{netip.PrefixFrom(peer, 32)}}
	}
	startSync(t, a)
	startSync(t, b)
	return a, b
}

// tcpFlow is an entry of a client's flow to a tunnel IP, as the router's
// conntrack holds it: the client's direction only seen, a mark.
func tcpFlow(client, vip netip.Addr, sport uint16, mark uint32) *netlink.ConntrackFlow {
	family := uint8(unix.AF_INET)
	if vip.Is6() {
		family = unix.AF_INET6
	}
	return &netlink.ConntrackFlow{
		FamilyType: family,
		Forward:    netlink.IPTuple{SrcIP: net.IP(client.AsSlice()), DstIP: net.IP(vip.AsSlice()), SrcPort: sport, DstPort: 80, Protocol: unix.IPPROTO_TCP},
		Reverse:    netlink.IPTuple{SrcIP: net.IP(vip.AsSlice()), DstIP: net.IP(client.AsSlice()), SrcPort: 80, DstPort: sport, Protocol: unix.IPPROTO_TCP},
		Mark:       mark, TimeOut: 300,
		ProtoInfo: &netlink.ProtoInfoTCP{State: 3}, // ESTABLISHED
	}
}

func (r *syncRouter) create(t *testing.T, f *netlink.ConntrackFlow) {
	t.Helper()
	if err := r.nl.ConntrackCreate(netlink.ConntrackTable, netlink.InetFamily(f.FamilyType), f); err != nil {
		t.Fatalf("create %s: %v", f.Forward.SrcIP, err)
	}
}

// endFlow deletes the namespace's one IPv4 TCP entry from client port
// sport, as the end of its flow would.
func (r *syncRouter) endFlow(t *testing.T, sport uint16) {
	t.Helper()
	filter := &netlink.ConntrackFilter{}
	if err := filter.AddProtocol(unix.IPPROTO_TCP); err != nil {
		t.Fatal(err)
	}
	if err := filter.AddPort(netlink.ConntrackOrigSrcPort, sport); err != nil {
		t.Fatal(err)
	}
	if n, err := r.nl.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, filter); err != nil || n != 1 {
		t.Fatalf("end the flow from port %d on %s: %d entries deleted, %v", sport, r.cfg.Interface, n, err)
	}
}

// entries lists the namespace's TCP entries by client port, with their
// marks and timeouts.
func (r *syncRouter) entries(t *testing.T) map[string]*netlink.ConntrackFlow {
	t.Helper()
	out := map[string]*netlink.ConntrackFlow{}
	for _, family := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
		flows, err := r.nl.ConntrackTableList(netlink.ConntrackTable, family)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range flows {
			if f.Forward.Protocol == unix.IPPROTO_TCP {
				out[net.JoinHostPort(f.Forward.DstIP.String(), strconv.Itoa(int(f.Forward.SrcPort)))] = f
			}
		}
	}
	return out
}

// waitFor polls until check holds, or fails after 10 s; it returns how
// long it took.
func waitFor(t *testing.T, what string, check func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !check() {
		if time.Since(start) > 10*time.Second {
			t.Fatalf("%s: not within 10 s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return time.Since(start)
}

func key(vip netip.Addr, sport uint16) string {
	return net.JoinHostPort(vip.String(), strconv.Itoa(int(sport)))
}

// TestSyncSharesTheTunnelIPsEntries: a flow's entry made on router A (with
// its generation's mark) appears on router B with that mark, in both
// families; an entry of another address does not; an end on A ends the
// copy; a restarted conntrackd on B gets A's entries back at once (its
// resync at start); a bulk send renews B's copies.
func TestSyncSharesTheTunnelIPsEntries(t *testing.T) {
	requireConntrackd(t)
	a, b := newSyncPair(t)
	client4, client6 := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8:1::1")
	vip4, vip6 := netip.MustParseAddr("203.0.113.10"), netip.MustParseAddr("2001:db8:7::10")
	other := netip.MustParseAddr("198.51.100.10")

	a.create(t, tcpFlow(client4, other, 40000, 0x1001))
	a.create(t, tcpFlow(client4, vip4, 40001, 0x1045))
	a.create(t, tcpFlow(client6, vip6, 40002, 0x1046))
	took := waitFor(t, "A's entries for the tunnel IPs on B", func() bool {
		e := b.entries(t)
		return e[key(vip4, 40001)] != nil && e[key(vip6, 40002)] != nil
	})
	t.Logf("an entry made on A was on B %v later", took.Round(time.Millisecond))
	time.Sleep(200 * time.Millisecond) // the other entry's message, were it sent, is there by now
	e := b.entries(t)
	if got := e[key(vip4, 40001)].Mark; got != 0x1045 {
		t.Errorf("IPv4 copy on B has mark %#x, want 0x1045 (the generation)", got)
	}
	if got := e[key(vip6, 40002)].Mark; got != 0x1046 {
		t.Errorf("IPv6 copy on B has mark %#x, want 0x1046", got)
	}
	if e[key(other, 40000)] != nil {
		t.Errorf("the entry to %s, outside the pools, was shared", other)
	}

	// An entry that ends on A ends on B.
	a.endFlow(t, 40001)
	waitFor(t, "the IPv4 copy gone from B after its entry ended on A", func() bool { return b.entries(t)[key(vip4, 40001)] == nil })

	// A restarted conntrackd on B asks A for what it holds.
	b.stop()
	if err := b.nl.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
		t.Fatal(err)
	}
	a.create(t, tcpFlow(client4, vip4, 40003, 0x1047)) // while B's conntrackd is down
	startSync(t, b)
	took = waitFor(t, "A's entries on B after B's conntrackd restarted", func() bool {
		e := b.entries(t)
		return e[key(vip4, 40003)] != nil && e[key(vip6, 40002)] != nil
	})
	t.Logf("a restarted conntrackd had A's entries %v after it answered", took.Round(time.Millisecond))

	// A bulk send renews the copies' timeouts.
	time.Sleep(2 * time.Second)
	before := b.entries(t)[key(vip4, 40003)].TimeOut
	if out, err := exec.Command("conntrackd", "-C", a.cfg.ConfigFile(), "-B").CombinedOutput(); err != nil {
		t.Fatalf("conntrackd -B: %v: %s", err, out)
	}
	waitFor(t, "the copy's timeout renewed by A's bulk send", func() bool { return b.entries(t)[key(vip4, 40003)].TimeOut > before })
}

// TestSyncCost creates entries on A at about 1,000 a second, then as fast
// as netlink allows (a flood of spoofed flows makes entries like that),
// and prints what sharing them cost: bytes on the sync link, conntrackd's
// CPU on both sides, how many reached B and how soon. It asserts only that
// the paced flows all reached B.
func TestSyncCost(t *testing.T) {
	requireConntrackd(t)
	a, b := newSyncPair(t)
	vip := netip.MustParseAddr("203.0.113.20")
	client := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{192, 0, 2, byte(1 + i/60000)}) }
	phase := func(name string, n, first int, pace time.Duration) {
		txBefore := linkTX(t, a, "sync-a")
		cpuA, cpuB := conntrackdCPU(t, a.cfg), conntrackdCPU(t, b.cfg)
		start := time.Now()
		for i := range n {
			j := first + i
			a.create(t, tcpFlow(client(j), vip, uint16(1024+j%60000), 0x1000+uint32(j%64)))
			if pace > 0 {
				if d := time.Until(start.Add(time.Duration(i+1) * pace)); d > 0 {
					time.Sleep(d)
				}
			}
		}
		made := time.Since(start)
		// Wait for B to hold them (or for the count to stop growing).
		var onB, last int
		settled := time.Now()
		for {
			onB = len(b.entries(t)) - first
			if onB >= n {
				break
			}
			if onB != last {
				last, settled = onB, time.Now()
			} else if time.Since(settled) > 3*time.Second {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		all := time.Since(start)
		bytes := linkTX(t, a, "sync-a") - txBefore
		usedA, usedB := conntrackdCPU(t, a.cfg)-cpuA, conntrackdCPU(t, b.cfg)-cpuB
		rate := float64(n) / made.Seconds()
		t.Logf("%s: %d entries made on A in %v (%.0f/s); %d on B after %v; sync link %d bytes (%.0f per entry, %.0f KB/s per 1,000 entries/s); conntrackd CPU A %v, B %v (%.1f%%, %.1f%% of a core per 1,000 entries/s)",
			name, n, made.Round(time.Millisecond), rate, onB, all.Round(time.Millisecond), bytes, float64(bytes)/float64(n),
			float64(bytes)/float64(n)*1000/1024, usedA, usedB,
			100*usedA.Seconds()/made.Seconds()*1000/rate, 100*usedB.Seconds()/made.Seconds()*1000/rate)
		if pace > 0 && onB < n {
			t.Errorf("%s: %d of %d paced entries reached B", name, onB, n)
		}
	}
	phase("paced", 3000, 0, time.Millisecond)
	phase("flood", 20000, 3000, 0)
}

// linkTX is a link's transmitted bytes in r's namespace.
func linkTX(t *testing.T, r *syncRouter, name string) int64 {
	t.Helper()
	l, err := r.ns.Netlink().LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	return int64(l.Attrs().Statistics.TxBytes)
}

// conntrackdCPU is the user and system time of the conntrackd that runs
// with cfg's configuration file.
func conntrackdCPU(t *testing.T, cfg Config) time.Duration {
	t.Helper()
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range dirs {
		cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
		if err != nil || !strings.Contains(string(cmdline), cfg.ConfigFile()) || strings.Contains(string(cmdline), "\x00-s") {
			continue
		}
		stat, err := os.ReadFile(filepath.Join(dir, "stat"))
		if err != nil {
			continue
		}
		// Fields after the command's ")": state is field 3; utime and
		// stime are fields 14 and 15.
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		utime, _ := strconv.ParseInt(fields[11], 10, 64)
		stime, _ := strconv.ParseInt(fields[12], 10, 64)
		return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
	}
	t.Fatalf("no conntrackd runs with %s", cfg.ConfigFile())
	return 0
}

// TestSyncRestartDoesNotResendCopies: a conntrackd restarted on A reads
// the kernel table, B's copies included, into the cache of A's own
// entries; the Daemon empties that cache, so when B's flow ends, A's bulk
// send does not bring it back to life on B (it did before: the ended flow
// came back with its old mark and state, again at every bulk send).
func TestSyncRestartDoesNotResendCopies(t *testing.T) {
	requireConntrackd(t)
	a, b := newSyncPair(t)
	client, vip := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("203.0.113.30")
	b.create(t, tcpFlow(client, vip, 41000, 0x1041))
	waitFor(t, "B's entry copied to A", func() bool { return a.entries(t)[key(vip, 41000)] != nil })

	a.stop()
	startSync(t, a) // A's kernel still holds the copy
	b.endFlow(t, 41000)
	waitFor(t, "the copy gone from A after the flow ended on B", func() bool { return a.entries(t)[key(vip, 41000)] == nil })
	if out, err := exec.Command("conntrackd", "-C", a.cfg.ConfigFile(), "-B").CombinedOutput(); err != nil {
		t.Fatalf("conntrackd -B on A: %v: %s", err, out)
	}
	time.Sleep(500 * time.Millisecond)
	if e := b.entries(t)[key(vip, 41000)]; e != nil {
		t.Fatalf("A's bulk send brought B's ended flow back on B (mark %#x, timeout %d): the restarted conntrackd sent a copy as its own", e.Mark, e.TimeOut)
	}
}
