package hmark

// Privileged tests: each runs in a fresh network namespace of its own (see
// test/support/testnetns), with the real iptables binaries and the kernel's HMARK
// target. They skip when not root or when iptables is missing.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"golang.org/x/sys/unix"
)

// Chain's seam is satisfied by go-iptables itself and by the test wrapper.
var (
	_ IPTables = (*iptables.IPTables)(nil)
	_ IPTables = (*testnetns.IPTables)(nil)
	_ Restorer = (*ExecRestorer)(nil)
	_ Restorer = (*nsRestorer)(nil)
)

// nsRestorer runs the iptables-restore matching an iptables binary inside
// a test namespace, and counts its calls independently of what the code
// under test reports.
type nsRestorer struct {
	ns    *testnetns.NS
	exec  *ExecRestorer
	Calls int
}

func newNSRestorer(ns *testnetns.NS, iptablesBinary string) *nsRestorer {
	return &nsRestorer{ns: ns, exec: NewExecRestorer(iptablesBinary)}
}

// Restore is ExecRestorer.Restore inside the namespace.
func (r *nsRestorer) Restore(table string, payload []byte) error {
	r.Calls++
	return r.ns.Do(func() error { return r.exec.Restore(table, payload) })
}

// lineChanges is the number of lines that differ between two outputs of
// `iptables -S`, counted as a multiset: what was added plus what was
// removed. It measures a Sync's changes independently of its count.
func lineChanges(before, after string) int {
	count := make(map[string]int)
	for _, l := range strings.Split(before, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(after, "\n") {
		count[l]--
	}
	n := 0
	for _, c := range count {
		n += max(c, -c)
	}
	return n
}

// Tunnel IPs of the kernel test, all on lo: one inside 127/8 (sources on
// both sides of it), one below every 127.x source, one above.
var (
	vipLoopback = netip.MustParseAddr("127.10.0.1")
	vipBelow    = netip.MustParseAddr("10.200.0.1")
	vipAbove    = netip.MustParseAddr("192.0.2.10")
	kernelVIPs  = []netip.Addr{vipLoopback, vipBelow, vipAbove}
	// Destination ports on both sides of the random source ports.
	kernelDstPorts = []uint16{1, 53, 8080, 40000, 65535}
)

// kernelParamSets covers small and huge moduli (0xffffffff exposes the
// whole 32-bit hash in the mark), offsets and seeds, including seed 0.
var kernelParamSets = []Params{
	{Buckets: 64, Offset: 1000, Seed: 0xdeadbeef},
	{Buckets: 0x7fffffff, Offset: 0, Seed: 0x12345678},
	{Buckets: 0xffffffff, Offset: 0, Seed: 0},
	{Buckets: 0xfffffff0, Offset: 0x0f, Seed: 0xffffffff},
	{Buckets: 3, Offset: 0x10000, Seed: 0x9e3779b9},
	{Buckets: 1, Offset: 7, Seed: 42},
}

const (
	udpFlowsPerParamSet = 1500
	tcpFlowsPerParamSet = 300
	rawFlowsPerProto    = 100
)

// rawProtos are the protocols sent from raw sockets: ICMP and an
// unassigned protocol (253) whose ports the kernel ignores, ESP and AH
// whose SPI it hashes in place of the ports.
var rawProtos = []uint8{protoICMP, 253, protoESP, protoAH}

// observation is one packet the kernel marked: the flow as it arrived and
// the skb mark the socket reported.
type observation struct {
	flow Flow
	mark uint32
}

// TestKernelMarksMatchGo sends real UDP and TCP flows through the kernel's
// HMARK rules, installed by Chain.Sync, and checks that Params.Mark
// predicts the kernel's mark for every one of them. The marks come back in
// SO_MARK control messages (SO_RCVMARK, Linux 5.19+): from UDP sockets bound
// to the tunnel IPs, and for TCP from a raw socket that sees each SYN.
// Changing the parameters between sets also exercises Sync replacing rules
// in the kernel.
func TestKernelMarksMatchGo(t *testing.T) {
	ns := testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
	ipt := ns.IPTables("iptables")
	restorer := newNSRestorer(ns, "iptables")
	rng := rand.New(rand.NewPCG(20261121, 1))

	totalFlows := 0
	for i, params := range kernelParamSets {
		chain, err := NewChainWithRestorer(ipt, "", params, restorer)
		if err != nil {
			t.Fatalf("NewChain(%v): %v", params, err)
		}
		restorer.Calls = 0
		changed, err := chain.Sync(targetsOf(kernelVIPs...))
		if err != nil {
			t.Fatalf("Sync with %v: %v", params, err)
		}
		wantChanged, wantRestores := 2*len(kernelVIPs), 1 // each tunnel IP's rule replaced
		if i == 0 {
			wantChanged = 1 + 1 + len(kernelVIPs) // chain, jump, rules
		} else if params == kernelParamSets[i-1] {
			wantChanged, wantRestores = 0, 0
		}
		if changed != wantChanged || restorer.Calls != wantRestores {
			t.Errorf("Sync with %v: changed = %d with %d restores, want %d with %d", params, changed, restorer.Calls, wantChanged, wantRestores)
		}

		var udp, tcp, other []observation
		err = ns.Do(func() error {
			var err error
			if udp, err = sendUDPFlows(rng, udpFlowsPerParamSet); err != nil {
				return err
			}
			if tcp, err = sendTCPFlows(rng, tcpFlowsPerParamSet); err != nil {
				return err
			}
			for _, proto := range rawProtos {
				obs, err := sendRawFlows(rng, proto, rawFlowsPerProto)
				if err != nil {
					return err
				}
				other = append(other, obs...)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("send flows with %v: %v", params, err)
		}
		if len(udp) != udpFlowsPerParamSet || len(tcp) != tcpFlowsPerParamSet || len(other) != len(rawProtos)*rawFlowsPerProto {
			t.Fatalf("observed %d UDP, %d TCP and %d other flows, want %d, %d and %d", len(udp), len(tcp), len(other),
				udpFlowsPerParamSet, tcpFlowsPerParamSet, len(rawProtos)*rawFlowsPerProto)
		}
		all := slices.Concat(udp, tcp, other)
		mismatches := 0
		for _, o := range all {
			if want := params.Mark(o.flow); o.mark != want {
				mismatches++
				if mismatches <= 10 {
					t.Errorf("%v: flow %+v: kernel mark %#x, Go predicts %#x", params, o.flow, o.mark, want)
				}
			}
			if o.mark-params.Offset >= params.Buckets {
				t.Errorf("%v: flow %+v: kernel mark %#x outside the bucket range", params, o.flow, o.mark)
			}
		}
		if mismatches > 0 {
			t.Fatalf("%v: %d of %d flows marked differently from the Go prediction", params, mismatches, len(all))
		}
		totalFlows += len(all)
		t.Logf("%v: %d UDP + %d TCP + %d ICMP/ESP/AH/other flows, kernel mark == Params.Mark for all; e.g.",
			params, len(udp), len(tcp), len(other))
		for _, o := range []observation{udp[0], tcp[0], other[0], other[rawFlowsPerProto], other[2*rawFlowsPerProto], other[3*rawFlowsPerProto]} {
			t.Logf("  %+v -> %#x", o.flow, o.mark)
		}
	}
	t.Logf("compared %d kernel-marked flows over %d parameter sets", totalFlows, len(kernelParamSets))
}

// randomSource returns a random local source address in 127/8 (not the
// network or broadcast address) and a random non-zero port.
func randomSource(rng *rand.Rand) (netip.Addr, uint16) {
	src := netip.AddrFrom4([4]byte{127, byte(1 + rng.IntN(254)), byte(1 + rng.IntN(254)), byte(1 + rng.IntN(254))})
	return src, uint16(1 + rng.IntN(65535))
}

// sendUDPFlows sends n datagrams, each from a new socket bound to a random
// 127/8 source address and port, to random tunnel IPs and ports, and reads
// the mark of each one on a UDP socket bound to the destination. It must
// run inside the test netns.
func sendUDPFlows(rng *rand.Rand, n int) ([]observation, error) {
	type dest struct {
		vip  netip.Addr
		port uint16
	}
	receivers := make(map[dest]int)
	defer func() {
		for _, fd := range receivers {
			_ = unix.Close(fd)
		}
	}()
	for _, vip := range kernelVIPs {
		for _, port := range kernelDstPorts {
			fd, err := markReceivingSocket(unix.SOCK_DGRAM, 0)
			if err != nil {
				return nil, err
			}
			receivers[dest{vip, port}] = fd
			if err := unix.Bind(fd, sockaddr(vip, port)); err != nil {
				return nil, fmt.Errorf("bind UDP receiver %s:%d: %w", vip, port, err)
			}
		}
	}

	var obs []observation
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := 0; i < n; i++ {
		d := dest{kernelVIPs[rng.IntN(len(kernelVIPs))], kernelDstPorts[rng.IntN(len(kernelDstPorts))]}
		src, sport := randomSource(rng)
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("UDP sender socket: %w", err)
		}
		payload := binary.BigEndian.AppendUint32(nil, uint32(i))
		err = unix.Bind(fd, sockaddr(src, sport))
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddr(d.vip, d.port))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send UDP %s:%d -> %s:%d: %w", src, sport, d.vip, d.port, err)
		}

		nr, oobn, _, from, err := unix.Recvmsg(receivers[d], buf, oob, 0)
		if err != nil {
			return nil, fmt.Errorf("receive UDP %s:%d -> %s:%d: %w", src, sport, d.vip, d.port, err)
		}
		if nr != len(payload) || binary.BigEndian.Uint32(buf[:nr]) != uint32(i) {
			return nil, fmt.Errorf("receive UDP on %s:%d: got datagram %x, want %x", d.vip, d.port, buf[:nr], payload)
		}
		mark, err := markFromCmsgs(oob[:oobn])
		if err != nil {
			return nil, fmt.Errorf("receive UDP %s:%d -> %s:%d: %w", src, sport, d.vip, d.port, err)
		}
		from4, ok := from.(*unix.SockaddrInet4)
		if !ok {
			return nil, fmt.Errorf("receive UDP: sender address %T", from)
		}
		flow := Flow{Src: netip.AddrFrom4(from4.Addr), Dst: d.vip, SrcPort: uint16(from4.Port), DstPort: d.port, Proto: protoUDP}
		if flow.Src != src || flow.SrcPort != sport {
			return nil, fmt.Errorf("receive UDP: came from %s:%d, sent from %s:%d", flow.Src, flow.SrcPort, src, sport)
		}
		obs = append(obs, observation{flow: flow, mark: mark})
	}
	return obs, nil
}

// sendTCPFlows starts n TCP connections, each from a random 127/8 source
// address and port, to random tunnel IPs and ports where nothing listens,
// and reads the mark of each SYN on a raw TCP socket (the kernel answers
// with a reset, which is not marked by the tunnel IP rules). It must run
// inside the test netns.
func sendTCPFlows(rng *rand.Rand, n int) ([]observation, error) {
	raw, err := markReceivingSocket(unix.SOCK_RAW, unix.IPPROTO_TCP)
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(raw) }()

	var obs []observation
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := 0; i < n; i++ {
		vip := kernelVIPs[rng.IntN(len(kernelVIPs))]
		dport := kernelDstPorts[rng.IntN(len(kernelDstPorts))]
		src, sport := randomSource(rng)
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("TCP client socket: %w", err)
		}
		err = unix.Bind(fd, sockaddr(src, sport))
		if err == nil {
			err = unix.Connect(fd, sockaddr(vip, dport))
			if errors.Is(err, unix.EINPROGRESS) {
				err = nil
			}
		}
		if err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("connect TCP %s:%d -> %s:%d: %w", src, sport, vip, dport, err)
		}
		want := Flow{Src: src, Dst: vip, SrcPort: sport, DstPort: dport, Proto: protoTCP}
		// Read until this connection's SYN; resets going back and any
		// other packet are skipped.
		for {
			nr, oobn, _, _, err := unix.Recvmsg(raw, buf, oob, 0)
			if err != nil {
				_ = unix.Close(fd)
				return nil, fmt.Errorf("receive SYN of %+v: %w", want, err)
			}
			flow, syn, ok := parseIPv4TCP(buf[:nr])
			if !ok || !syn || flow != want {
				continue
			}
			mark, err := markFromCmsgs(oob[:oobn])
			if err != nil {
				_ = unix.Close(fd)
				return nil, fmt.Errorf("receive SYN of %+v: %w", want, err)
			}
			obs = append(obs, observation{flow: flow, mark: mark})
			break
		}
		_ = unix.Close(fd)
	}
	return obs, nil
}

// sendRawFlows sends n packets of protocol proto from raw sockets bound to
// random 127/8 source addresses to random tunnel IPs, and reads the mark of
// each one on a raw socket of that protocol. The flow compared is built as
// if the kernel read ports from the payload (at the offset where ESP and AH
// carry their SPI), so that a prediction which used them where the kernel
// does not would fail. ICMP packets are echo requests, not errors (whose
// embedded header the kernel would hash). It must run inside the test netns.
func sendRawFlows(rng *rand.Rand, proto uint8, n int) ([]observation, error) {
	rx, err := markReceivingSocket(unix.SOCK_RAW, int(proto))
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(rx) }()

	portsAt := 0
	if proto == protoAH {
		portsAt = 4 // the SPI follows next header, length and reserved
	}
	var obs []observation
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := 0; i < n; i++ {
		vip := kernelVIPs[rng.IntN(len(kernelVIPs))]
		src, _ := randomSource(rng)
		payload := make([]byte, 16)
		for j := range payload {
			payload[j] = byte(rng.Uint32())
		}
		if proto == protoICMP {
			payload[0], payload[1] = 8, 0 // echo request
			payload[2], payload[3] = 0, 0
			binary.BigEndian.PutUint16(payload[2:], inetChecksum(payload))
		}
		binary.BigEndian.PutUint32(payload[12:], uint32(i))
		want := Flow{
			Src: src, Dst: vip, Proto: proto,
			SrcPort: binary.BigEndian.Uint16(payload[portsAt:]),
			DstPort: binary.BigEndian.Uint16(payload[portsAt+2:]),
		}

		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
		if err != nil {
			return nil, fmt.Errorf("raw socket proto %d: %w", proto, err)
		}
		err = unix.Bind(fd, sockaddr(src, 0))
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddr(vip, 0))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send proto %d %s -> %s: %w", proto, src, vip, err)
		}
		for {
			nr, oobn, _, _, err := unix.Recvmsg(rx, buf, oob, 0)
			if err != nil {
				return nil, fmt.Errorf("receive proto %d %s -> %s: %w", proto, src, vip, err)
			}
			pkt := buf[:nr]
			if len(pkt) < 20 || pkt[0]>>4 != 4 {
				continue
			}
			ihl := int(pkt[0]&0x0f) * 4
			if len(pkt) < ihl || pkt[9] != proto || netip.AddrFrom4([4]byte(pkt[16:20])) != vip ||
				netip.AddrFrom4([4]byte(pkt[12:16])) != src || !slices.Equal(pkt[ihl:], payload) {
				continue // an echo reply, an ICMP error, or another packet
			}
			mark, err := markFromCmsgs(oob[:oobn])
			if err != nil {
				return nil, fmt.Errorf("receive proto %d %s -> %s: %w", proto, src, vip, err)
			}
			obs = append(obs, observation{flow: want, mark: mark})
			break
		}
	}
	return obs, nil
}

// inetChecksum is the Internet checksum (RFC 1071) of b.
func inetChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// markReceivingSocket opens an IPv4 socket that reports each packet's mark
// (SO_RCVMARK) and gives up reading after a few seconds.
func markReceivingSocket(typ, proto int) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return -1, fmt.Errorf("socket type %d proto %d: %w", typ, proto, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVMARK, 1); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("set SO_RCVMARK (Linux 5.19+): %w", err)
	}
	tv := unix.NsecToTimeval((3 * time.Second).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("set SO_RCVTIMEO: %w", err)
	}
	return fd, nil
}

// markFromCmsgs returns the mark from the SO_MARK control message.
func markFromCmsgs(oob []byte) (uint32, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return 0, fmt.Errorf("parse control messages: %w", err)
	}
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SO_MARK && len(m.Data) >= 4 {
			return binary.NativeEndian.Uint32(m.Data), nil
		}
	}
	return 0, fmt.Errorf("no SO_MARK control message among %d", len(msgs))
}

// parseIPv4TCP reads the flow of an IPv4 TCP packet as a raw socket
// delivers it (IP header included), and whether it is a SYN without ACK.
func parseIPv4TCP(pkt []byte) (flow Flow, syn, ok bool) {
	if len(pkt) < 20 || pkt[0]>>4 != 4 {
		return Flow{}, false, false
	}
	ihl := int(pkt[0]&0x0f) * 4
	if ihl < 20 || len(pkt) < ihl+14 || pkt[9] != protoTCP {
		return Flow{}, false, false
	}
	tcp := pkt[ihl:]
	flow = Flow{
		Src:     netip.AddrFrom4([4]byte(pkt[12:16])),
		Dst:     netip.AddrFrom4([4]byte(pkt[16:20])),
		SrcPort: binary.BigEndian.Uint16(tcp[0:2]),
		DstPort: binary.BigEndian.Uint16(tcp[2:4]),
		Proto:   protoTCP,
	}
	const flagSYN, flagACK = 0x02, 0x10
	return flow, tcp[13]&(flagSYN|flagACK) == flagSYN, true
}

func sockaddr(a netip.Addr, port uint16) *unix.SockaddrInet4 {
	return &unix.SockaddrInet4{Addr: a.As4(), Port: int(port)}
}

func prefixesOf(addrs ...netip.Addr) []netip.Prefix {
	var out []netip.Prefix
	for _, a := range addrs {
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return out
}

// iptablesBinaries are the two backends: nft, and legacy.
var iptablesBinaries = []string{"iptables", "iptables-legacy"}

// TestSyncInNetns drives Chain against the real iptables of each backend in
// a fresh namespace: creation, adoption by a new Chain with no write,
// repair of a rule deleted by hand, removal of a rule added by hand to the
// chain, rules of other chains left alone, counters, and Cleanup. It does
// so with iptables-restore, and without a restorer (rule by rule).
// withoutRestore hides an IPTables' Restore method, so that NewChain takes
// the one-rule-at-a-time path.
type withoutRestore struct{ IPTables }

func TestSyncInNetns(t *testing.T) {
	for _, binary := range iptablesBinaries {
		t.Run(binary, func(t *testing.T) { testSyncInNetns(t, binary, true) })
		t.Run(binary+"/one-by-one", func(t *testing.T) { testSyncInNetns(t, binary, false) })
	}
}

func testSyncInNetns(t *testing.T, binary string, restore bool) {
	ns := testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	params := Params{Buckets: 16, Offset: 0x100, Seed: 0xc0ffee}
	vips := kernelVIPs
	mangleS := func() string { return ns.Run(binary, "-t", "mangle", "-S") }
	newChain := func() *Chain {
		t.Helper()
		var c *Chain
		var err error
		if restore {
			c, err = NewChainWithRestorer(ipt, "", params, restorer)
		} else {
			c, err = NewChain(withoutRestore{ipt}, "", params) // hides the wrapper's Restore
		}
		if err != nil {
			t.Fatalf("NewChain: %v", err)
		}
		if (c.restorer != nil) != restore {
			t.Fatalf("NewChain: restorer %v, want one: %v", c.restorer, restore)
		}
		return c
	}

	// Rules of others, in another chain of mangle and in PREROUTING itself.
	ns.Run(binary, "-t", "mangle", "-N", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "OPERATOR", "-d", "10.1.1.1/32", "-j", "MARK", "--set-mark", "5")
	ns.Run(binary, "-t", "mangle", "-A", "FORWARD", "-j", "OPERATOR")
	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-m", "comment", "--comment", "someone else", "-j", "MARK", "--set-mark", "9")
	before := mangleS()
	othersUntouched := func(step string) {
		t.Helper()
		if got := withoutChain(mangleS(), DefaultChainName); got != before {
			t.Errorf("%s: rules outside %s changed:\n got: %s\nwant: %s", step, DefaultChainName, got, before)
		}
	}

	chain := newChain()
	// syncExpect syncs and checks the changes Sync reports against the
	// lines that changed in `iptables -S`, and the writes iptables and
	// iptables-restore saw: wantIPT of the changes go through go-iptables
	// (chain and jump) and the rest through at most one restore, or all
	// through go-iptables without a restorer.
	syncExpect := func(step string, c *Chain, want, wantIPT int) {
		t.Helper()
		ipt.Writes, restorer.Calls = 0, 0
		before := mangleS()
		changed, err := c.Sync(targetsOf(vips...))
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		wantRestores := 0
		if !restore {
			wantIPT = want
		} else if want > wantIPT {
			wantRestores = 1
		}
		if diff := lineChanges(before, mangleS()); changed != want || diff != want {
			t.Errorf("%s: Sync changed = %d (%d lines of iptables -S changed), want %d", step, changed, diff, want)
		}
		if ipt.Writes != wantIPT || restorer.Calls != wantRestores {
			t.Errorf("%s: iptables saw %d writes and iptables-restore %d calls, want %d and %d",
				step, ipt.Writes, restorer.Calls, wantIPT, wantRestores)
		}
		assertKernelChain(t, step, ipt, params, vips)
		othersUntouched(step)
	}

	syncExpect("first sync", chain, 1+1+len(vips), 2)
	t.Logf("%s prints the router's rules as:\n%s", binary, ns.Run(binary, "-t", "mangle", "-S", DefaultChainName))

	adopter := newChain()
	syncExpect("adoption by a new Chain", adopter, 0, 0)

	ns.Run(binary, "-t", "mangle", "-D", DefaultChainName, "2")
	syncExpect("rule deleted by hand", adopter, 1, 0)

	ns.Run(binary, "-t", "mangle", "-I", DefaultChainName, "2", "-j", "MARK", "--set-mark", "3")
	ns.Run(binary, "-t", "mangle", "-A", DefaultChainName, "-d", vips[0].String()+"/32",
		"-j", "HMARK", "--hmark-tuple", "src,dst", "--hmark-mod", "16", "--hmark-offset", "256", "--hmark-rnd", "0xc0ffee")
	syncExpect("foreign rules added by hand to the chain", adopter, 2, 0)

	ns.Run(binary, "-t", "mangle", "-A", "PREROUTING", "-i", "lo", "-j", DefaultChainName)
	syncExpect("second jump added by hand", adopter, 1, 1)

	// One datagram to a tunnel IP shows up in the counters.
	sendDatagrams(t, ns, vipAbove, 1)
	counters, err := adopter.Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	if len(counters) != len(vips) {
		t.Errorf("Counters has %d tunnel IPs, want %d: %v", len(counters), len(vips), counters)
	}
	if c := counters[vipAbove]; c.Packets != 1 || c.Bytes != 28+8 {
		t.Errorf("Counters[%s] = %+v, want 1 packet of 36 bytes", vipAbove, c)
	}
	if c := counters[vipBelow]; c.Packets != 0 {
		t.Errorf("Counters[%s] = %+v, want no packet", vipBelow, c)
	}

	// Another tunnel IP removed, then added back, then the chain repaired
	// (each a restore with a restorer): the tunnel IP's counters stay.
	all := vips
	vips = []netip.Addr{vipLoopback, vipAbove}
	syncExpect("a tunnel IP removed", adopter, 1, 0)
	assertCounter(t, "a tunnel IP removed", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})
	vips = all
	syncExpect("the tunnel IP added back", adopter, 1, 0)
	assertCounter(t, "the tunnel IP added back", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})
	ns.Run(binary, "-t", "mangle", "-I", DefaultChainName, "1", "-j", "MARK", "--set-mark", "3")
	syncExpect("foreign rule removed", adopter, 1, 0)
	assertCounter(t, "foreign rule removed", adopter, vipAbove, Counter{Packets: 1, Bytes: 36})

	if err := adopter.Cleanup(); err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if got := mangleS(); got != before {
		t.Errorf("after Cleanup, mangle is\n%s\nwant what it was before the router:\n%s", got, before)
	}
	if err := chain.Cleanup(); err != nil {
		t.Errorf("second Cleanup (nothing left): %v", err)
	}
}

// sendDatagrams sends n datagrams of 8 bytes (36 with the headers) from
// 127.0.0.1 to vip:9 inside ns, where a socket bound to vip receives them
// (so that no ICMP error goes back to the same address). Sent over lo,
// they come back in through PREROUTING.
func sendDatagrams(t *testing.T, ns *testnetns.NS, vip netip.Addr, n int) {
	t.Helper()
	err := ns.Do(func() error {
		rx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(rx) }()
		if err := unix.Bind(rx, sockaddr(vip, 9)); err != nil {
			return err
		}
		tx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(tx) }()
		if err := unix.Bind(tx, sockaddr(netip.MustParseAddr("127.0.0.1"), 0)); err != nil {
			return err
		}
		for range n {
			if err := unix.Sendto(tx, []byte("count me"), 0, sockaddr(vip, 9)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("send %d datagrams to %s: %v", n, vip, err)
	}
}

// assertCounter checks one tunnel IP's counters as Counters reads them.
func assertCounter(t *testing.T, step string, c *Chain, vip netip.Addr, want Counter) {
	t.Helper()
	counters, err := c.Counters()
	if err != nil {
		t.Fatalf("%s: Counters: %v", step, err)
	}
	if got := counters[vip]; got != want {
		t.Errorf("%s: Counters[%s] = %+v, want %+v (all: %v)", step, vip, got, want, counters)
	}
}

// TestSyncManyVIPsInNetns syncs 10,000 tunnel IPs into a fresh namespace
// with each backend: one iptables-restore writes them all, a restarted
// Chain writes nothing, and swapping one tunnel IP for another changes 2.
func TestSyncManyVIPsInNetns(t *testing.T) {
	for _, binary := range iptablesBinaries {
		t.Run(binary, func(t *testing.T) { testSyncManyVIPsInNetns(t, binary) })
	}
}

func testSyncManyVIPsInNetns(t *testing.T, binary string) {
	const n = 10000
	ns := testnetns.New(t)
	ipt := ns.IPTables(binary)
	restorer := newNSRestorer(ns, binary)
	params := Params{Buckets: 64, Offset: 0x100, Seed: 0xc0ffee}
	vips := manyVIPs(n)
	sync := func(step string, vips []netip.Addr, want, wantIPT, wantRestores int) {
		t.Helper()
		chain, err := NewChainWithRestorer(ipt, "", params, restorer)
		if err != nil {
			t.Fatalf("NewChain: %v", err)
		}
		ipt.Writes, restorer.Calls = 0, 0
		start := time.Now()
		changed, err := chain.Sync(targetsOf(vips...))
		took := time.Since(start)
		if err != nil {
			t.Fatalf("%s: Sync: %v", step, err)
		}
		t.Logf("%s: %s: Sync of %d tunnel IPs took %v (changed %d)", binary, step, len(vips), took, changed)
		if changed != want || ipt.Writes != wantIPT || restorer.Calls != wantRestores {
			t.Errorf("%s: Sync changed = %d with %d iptables writes and %d restores, want %d with %d and %d",
				step, changed, ipt.Writes, restorer.Calls, want, wantIPT, wantRestores)
		}
		out := ns.Run(binary, "-t", "mangle", "-S", DefaultChainName)
		if got := strings.Count(out, " -j HMARK "); got != len(vips) {
			t.Errorf("%s: %s -t mangle -S %s has %d HMARK rules, want %d", step, binary, DefaultChainName, got, len(vips))
		}
		assertKernelChain(t, step, ipt, params, vips)
	}

	sync("first sync", vips, 1+1+n, 2, 1)
	sync("adoption by a new Chain", vips, 0, 0, 0)
	swapped := slices.Concat(vips[1:], []netip.Addr{netip.MustParseAddr("10.200.0.1")})
	sync("one tunnel IP removed, one added", swapped, 2, 0, 1)
}

// assertKernelChain checks the chain in the kernel: one parsed rule per
// tunnel IP with params, nothing else, and one jump from PREROUTING.
func assertKernelChain(t *testing.T, step string, ipt IPTables, params Params, vips []netip.Addr) {
	t.Helper()
	lines, err := ipt.List(Table, DefaultChainName)
	if err != nil {
		t.Fatalf("%s: list chain: %v", step, err)
	}
	var got []netip.Addr
	for _, line := range lines {
		r, ok, err := parseRule(line, DefaultChainName, false)
		if err != nil || !ok {
			continue
		}
		vip, p, ok := r.vipRule()
		if !ok || p != params {
			t.Errorf("%s: unexpected rule in chain: %s", step, line)
			continue
		}
		got = append(got, vip)
	}
	slices.SortFunc(got, netip.Addr.Compare)
	want := slices.SortedFunc(slices.Values(vips), netip.Addr.Compare)
	if !slices.Equal(got, want) {
		t.Errorf("%s: chain has rules for %v, want %v", step, got, want)
	}
	pre, err := ipt.List(Table, ParentChain)
	if err != nil {
		t.Fatalf("%s: list %s: %v", step, ParentChain, err)
	}
	jumps := 0
	for _, line := range pre {
		if strings.Contains(line, "-j "+DefaultChainName) {
			jumps++
		}
	}
	if jumps != 1 {
		t.Errorf("%s: %d jumps to %s in %s, want 1:\n%s", step, jumps, DefaultChainName, ParentChain, strings.Join(pre, "\n"))
	}
}

// withoutChain drops from `iptables -S` output every line that creates,
// fills or jumps to chain.
func withoutChain(s, chain string) string {
	var keep []string
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, " "+chain) && (strings.HasPrefix(line, "-N "+chain) ||
			strings.HasPrefix(line, "-A "+chain+" ") || strings.HasSuffix(line, "-j "+chain)) {
			continue
		}
		keep = append(keep, line)
	}
	return strings.Join(keep, "\n")
}
