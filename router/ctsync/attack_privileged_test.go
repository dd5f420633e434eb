package ctsync

import (
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The attack lab's addresses: router R, its peer P and the attacker X on
// the sync link (10.99.0.0/24), and the attacker U on another link of R
// (10.98.0.0/24: its uplink, or a pod's veth).
const (
	labR, labP, labX = "10.99.0.1", "10.99.0.2", "10.99.0.66"
	upR, upU         = "10.98.0.1", "10.98.0.2"
)

// syncLab is the attack lab: a sync link (a bridge in a namespace of its
// own) joining R, P and X, and a veth joining R and U. R and P run the
// Daemon; X and U run conntrackd as attackers do (see attack).
type syncLab struct {
	r, p, x, u *syncRouter
}

// newSyncLab makes the lab: R runs with the filter of its port, for the
// peers peers, unless noFilter; P with its filter, R its peer.
func newSyncLab(t *testing.T, noFilter bool, peers []netip.Prefix) *syncLab {
	requireConntrackd(t)
	link := testnetns.New(t)
	l := &syncLab{r: &syncRouter{ns: testnetns.New(t), noFilter: noFilter}, p: &syncRouter{ns: testnetns.New(t)},
		x: &syncRouter{ns: testnetns.New(t)}, u: &syncRouter{ns: testnetns.New(t)}}
	// No IGMP snooping: the bridge floods the group to every port, as a
	// switch without a querier does.
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}, MulticastSnooping: new(bool)}
	if err := link.Netlink().LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	if err := link.Netlink().LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	for _, end := range []struct {
		r          *syncRouter
		name, addr string
	}{{l.r, "sync-r", labR}, {l.p, "sync-p", labP}, {l.x, "sync-x", labX}} {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "br-" + end.name, MasterIndex: br.Attrs().Index}, PeerName: end.name, PeerNamespace: netlink.NsFd(end.r.ns.Handle)}
		if err := link.Netlink().LinkAdd(veth); err != nil {
			t.Fatal(err)
		}
		if err := link.Netlink().LinkSetUp(veth); err != nil {
			t.Fatal(err)
		}
		linkUp(t, end.r.ns, end.name, end.addr+"/24")
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up-r"}, PeerName: "up-u", PeerNamespace: netlink.NsFd(l.u.ns.Handle)}
	if err := l.r.ns.Netlink().LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	linkUp(t, l.r.ns, "up-r", upR+"/24")
	linkUp(t, l.u.ns, "up-u", upU+"/24")
	// U reaches R's sync address through R's uplink; R takes a source of
	// the sync link from the uplink (no reverse path filter), as a node
	// whose routes do not forbid it does.
	l.u.ns.Run("ip", "route", "add", labR+"/32", "via", upR)
	l.r.ns.Run("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.up-r.rp_filter=0")
	for _, r := range []*syncRouter{l.r, l.p, l.x, l.u} {
		r.nl = r.ns.IPSets()
	}
	l.r.cfg = Config{Interface: "sync-r", Address: netip.MustParseAddr(labR), Group: DefaultGroup, Dir: t.TempDir(), Peers: peers}
	l.p.cfg = Config{Interface: "sync-p", Address: netip.MustParseAddr(labP), Group: DefaultGroup, Dir: t.TempDir(), Peers: prefixes(labR + "/32")}
	startSync(t, l.r)
	startSync(t, l.p)
	// The attackers hear no sync message: conntrackd then never learns
	// that R heard its hello, and flags every message it sends as a
	// hello, which R takes whatever its sequence number (an attacker who
	// writes the messages himself does the same). Their datagrams to the
	// port are counted: all of them, and those carrying the attack's
	// entry (its client and tunnel IP, as conntrackd writes them).
	for _, a := range []*syncRouter{l.x, l.u} {
		a.ns.Run("iptables", "-A", "INPUT", "-p", "udp", "--dport", strconv.Itoa(DefaultGroup), "-j", "DROP")
		a.ns.Run("iptables", "-A", "OUTPUT", "-p", "udp", "--dport", strconv.Itoa(DefaultGroup), "-m", "string", "--algo", "bm", "--hex-string", "|c0000242cb007142|")
		a.ns.Run("iptables", "-A", "OUTPUT", "-p", "udp", "--dport", strconv.Itoa(DefaultGroup))
	}
	return l
}

func linkUp(t *testing.T, ns *testnetns.NS, name, addr string) {
	t.Helper()
	h := ns.Netlink()
	l, err := h.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: testnetns.IPNet(netip.MustParsePrefix(addr))}); err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
}

// The attack's entry: a client's flow to a tunnel IP of the pools, with a
// mark of the attacker's choosing.
var (
	attackClient = netip.MustParseAddr("192.0.2.66")
	attackVIP    = netip.MustParseAddr("203.0.113.66")
)

const attackMark = 0x1066

// attackPath is a way to R's conntrackd: conntrackd run in the attacker's
// namespace, sending from address src on iface, by multicast to the group
// (transport empty) or by the Sync block transport.
type attackPath struct {
	name       string
	attacker   func(*syncLab) *syncRouter
	src, iface string
	transport  string
}

func udpTransport(local, dest, iface string) string {
	return fmt.Sprintf("\tUDP {\n\t\tIPv4_address %s\n\t\tIPv4_Destination_Address %s\n\t\tPort %d\n\t\tInterface %s\n\t\tChecksum on\n\t}\n", local, dest, DefaultGroup, iface)
}

var (
	fromX = func(l *syncLab) *syncRouter { return l.x }
	fromU = func(l *syncLab) *syncRouter { return l.u }
	// The paths conntrackd 1.4.7's socket (0.0.0.0, the group's port)
	// takes besides its group on the sync link; multicast to the group
	// from another interface is not among them (that interface has not
	// joined it), multicast to a group every interface joins is.
	syncLinkMulticast = attackPath{name: "multicast to the group on the sync link", attacker: fromX, src: labX, iface: "sync-x"}
	syncLinkUnicast   = attackPath{name: "unicast to R's sync address on the sync link", attacker: fromX, src: labX, iface: "sync-x", transport: udpTransport(labX, labR, "sync-x")}
	uplinkUnicast     = attackPath{name: "unicast to R's uplink address from the uplink", attacker: fromU, src: upU, iface: "up-u", transport: udpTransport(upU, upR, "up-u")}
	uplinkAsPeer      = attackPath{name: "unicast to R's sync address from the uplink, from the peer's address", attacker: fromU, src: labP, iface: "up-u", transport: udpTransport(labP, labR, "up-u")}
	uplinkAllHosts    = attackPath{name: "multicast to 224.0.0.1 (all hosts) from the uplink", attacker: fromU, src: upU, iface: "up-u",
		transport: fmt.Sprintf("\tMulticast {\n\t\tIPv4_address 224.0.0.1\n\t\tGroup %d\n\t\tIPv4_interface %s\n\t\tInterface up-u\n\t}\n", DefaultGroup, upU)}
	// What no filter by address keeps out: the peer's address spoofed on
	// the sync link.
	syncLinkAsPeer = attackPath{name: "multicast to the group on the sync link, from the peer's address", attacker: fromX, src: labP, iface: "sync-x"}
)

// multicastBlock is the Multicast block of a configuration Render wrote.
var multicastBlock = regexp.MustCompile(`(?s)\tMulticast \{.*?\n\t\}\n`)

// outputCounts reads the attacker's counts of its datagrams to the port:
// those carrying the attack's entry, and all.
func outputCounts(t *testing.T, a *syncRouter) (entry, all uint64) {
	t.Helper()
	var counts []uint64
	for _, line := range strings.Split(a.ns.Run("iptables", "-S", "OUTPUT", "-v"), "\n") {
		if !strings.HasPrefix(line, "-A OUTPUT") {
			continue
		}
		_, c, ok := strings.Cut(line, " -c ")
		packets, err := strconv.ParseUint(strings.Fields(c)[0], 10, 64)
		if !ok || err != nil {
			t.Fatalf("no count in %q", line)
		}
		counts = append(counts, packets)
	}
	if len(counts) != 2 {
		t.Fatalf("want 2 counting rules in the attacker's OUTPUT, got %v", counts)
	}
	return counts[0], counts[1]
}

func (l *syncLab) dropped(t *testing.T) uint64 {
	t.Helper()
	st, err := ReadPortFilter(l.r.ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	return st.Dropped
}

// attack runs conntrackd as an attacker on path, makes the attack's entry
// (client port sport) in the attacker's table, and waits until a
// datagram carrying it has left. When gotIn, it then waits (30 s at most)
// for the entry in R's table, with the attacker's mark; otherwise it stops
// the attacker and waits until R's filter dropped as many datagrams as
// the attacker sent, then asserts the entry is not in R's table. It
// returns whether the entry got in.
func (l *syncLab) attack(t *testing.T, path attackPath, sport uint16, wantIn bool) {
	t.Helper()
	a := path.attacker(l)
	if path.src != upU && path.src != labX {
		linkAddr(t, a.ns, path.iface, path.src+"/32")
	}
	cfg := Config{Interface: path.iface, Address: netip.MustParseAddr(path.src), Group: DefaultGroup, Dir: t.TempDir(), Prefixes: syncPools}
	conf, err := Render(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if path.transport != "" {
		conf = multicastBlock.ReplaceAllString(conf, path.transport)
	}
	if err := os.WriteFile(cfg.ConfigFile(), []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	entryBefore, allBefore := outputCounts(t, a)
	droppedBefore := uint64(0)
	if !l.r.noFilter {
		droppedBefore = l.dropped(t)
	}
	proc, err := startExec("conntrackd", []string{"-C", cfg.ConfigFile()}, func(string) {}, func() error { return netns.Set(a.ns.Handle) })
	if err != nil {
		t.Fatal(err)
	}
	defer proc.Stop()
	d := &Daemon{Binary: "conntrackd", Config: cfg, command: runExec}
	if err := d.emptyCache(t.Context()); err != nil {
		t.Fatal(err)
	}
	a.create(t, tcpFlow(attackClient, attackVIP, sport, attackMark))
	waitUntil(t, path.name+": the attacker sent the entry", func() bool { n, _ := outputCounts(t, a); return n > entryBefore })
	k := key(attackVIP, sport)
	if wantIn {
		waitUntil(t, path.name+": the attack's entry in R's table", func() bool { return l.r.entries(t)[k] != nil })
		if got := l.r.entries(t)[k].Mark; got != attackMark {
			t.Errorf("%s: the attack's entry in R has mark %#x, want the attacker's %#x", path.name, got, attackMark)
		}
		t.Logf("%s: got in, mark %#x included", path.name, uint32(attackMark))
		return
	}
	proc.Stop()
	_, all := outputCounts(t, a)
	sent := all - allBefore
	waitUntil(t, fmt.Sprintf("%s: R's filter dropped the attacker's %d datagrams", path.name, sent), func() bool { return l.dropped(t)-droppedBefore >= sent })
	if e := l.r.entries(t)[k]; e != nil {
		t.Errorf("%s: the attack's entry is in R's table (mark %#x) although R's filter dropped the attacker's datagrams", path.name, e.Mark)
		return
	}
	t.Logf("%s: kept out (%d datagrams sent, %d dropped by R's filter)", path.name, sent, l.dropped(t)-droppedBefore)
}

func linkAddr(t *testing.T, ns *testnetns.NS, name, addr string) {
	t.Helper()
	h := ns.Netlink()
	l, err := h.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrReplace(l, &netlink.Addr{IPNet: testnetns.IPNet(netip.MustParsePrefix(addr))}); err != nil {
		t.Fatal(err)
	}
}

// waitUntil polls check for 30 s at most.
func waitUntil(t *testing.T, what string, check func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !check() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30 s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// peerEntryArrives makes an entry on P and waits for it on R.
func (l *syncLab) peerEntryArrives(t *testing.T, sport uint16) {
	t.Helper()
	vip := netip.MustParseAddr("203.0.113.10")
	l.p.create(t, tcpFlow(netip.MustParseAddr("192.0.2.1"), vip, sport, 0x1045))
	waitUntil(t, "the peer's entry on R", func() bool { return l.r.entries(t)[key(vip, sport)] != nil })
	if got := l.r.entries(t)[key(vip, sport)].Mark; got != 0x1045 {
		t.Errorf("the peer's entry on R has mark %#x, want 0x1045", got)
	}
}

// TestSyncAttackWithoutPortFilter is the attack without the filter of
// conntrackd's port: from the sync link and from another interface of the
// router, by each path conntrackd's socket takes, an attacker's
// conntrackd writes an entry for a tunnel IP, with its mark, into R's
// table. (It shows what TestSyncPortFilterKeepsAttackersOut keeps out.)
func TestSyncAttackWithoutPortFilter(t *testing.T) {
	l := newSyncLab(t, true, nil)
	l.peerEntryArrives(t, 40000)
	for i, path := range []attackPath{syncLinkMulticast, syncLinkUnicast, uplinkUnicast, uplinkAsPeer, uplinkAllHosts} {
		l.attack(t, path, uint16(50000+i), true)
	}
}

// TestSyncPortFilterKeepsAttackersOut is the attack on a router whose
// filter names its peer: every path from the attacker's own address, on
// the sync link or not, and every path from another interface, even from
// the peer's address, is dropped, the attack's entry never in R's table,
// while the peer's entries arrive, none of its datagrams dropped.
// conntrackd listens on IPv4 alone, so the filter has no IPv6 rule. What
// it cannot keep out: the peer's address spoofed on the sync link.
func TestSyncPortFilterKeepsAttackersOut(t *testing.T) {
	l := newSyncLab(t, false, prefixes(labP+"/32"))
	l.peerEntryArrives(t, 40000)
	if st, err := ReadPortFilter(l.r.ns.Handle); err != nil || !st.Current || st.Dropped != 0 || st.Accepted == 0 {
		t.Fatalf("R's filter after the peer's entry: %+v, %v; want current, the peer's datagrams accepted, none dropped", st, err)
	}
	for _, sock := range l.conntrackdSockets(t) {
		if !strings.HasPrefix(sock, "0.0.0.0:") {
			t.Errorf("conntrackd listens on %s: the filter, IPv4 alone, does not guard it", sock)
		}
	}
	for i, path := range []attackPath{syncLinkMulticast, syncLinkUnicast, uplinkUnicast, uplinkAsPeer, uplinkAllHosts} {
		l.attack(t, path, uint16(50000+i), false)
	}
	l.peerEntryArrives(t, 40001)
	// Last: an accepted attacker may upset R's tracking of the peer's
	// sequence numbers.
	l.attack(t, syncLinkAsPeer, 50010, true)
	t.Log("the peer's address spoofed on the sync link gets in: conntrackd's messages are not authenticated")
}

// TestSyncPortFilterWithoutPeers: without peers the filter keeps the
// other interfaces out, and lets anyone on the sync link in.
func TestSyncPortFilterWithoutPeers(t *testing.T) {
	l := newSyncLab(t, false, nil)
	l.peerEntryArrives(t, 40000)
	for i, path := range []attackPath{uplinkUnicast, uplinkAsPeer, uplinkAllHosts} {
		l.attack(t, path, uint16(50000+i), false)
	}
	l.peerEntryArrives(t, 40001)
	l.attack(t, syncLinkUnicast, 50010, true)
}

// conntrackdSockets lists the local addresses of R's UDP sockets on the
// group's port.
func (l *syncLab) conntrackdSockets(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(l.r.ns.Run("ss", "-H", "-u", "-a", "-n"), "\n") {
		fields := strings.Fields(line)
		if len(fields) >= 4 && strings.HasSuffix(fields[3], ":"+strconv.Itoa(DefaultGroup)) {
			out = append(out, fields[3])
		}
	}
	if len(out) == 0 {
		t.Fatal("ss lists no socket on the group's port in R")
	}
	return out
}
