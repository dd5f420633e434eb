package hmark

// Privileged test of the hash: the kernel's HMARK target marks real flows
// in a fresh network namespace (see test/support/testnetns), and Params.Mark
// must predict every mark. It skips when not root or when iptables is
// missing.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"golang.org/x/sys/unix"
)

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
		chain, err := NewChain(ipt, ns.IPSets(), "", params, restorer)
		if err != nil {
			t.Fatalf("NewChain(%v): %v", params, err)
		}
		restorer.Calls = 0
		changed, err := chain.Sync(targetsOf(kernelVIPs...))
		if err != nil {
			t.Fatalf("Sync with %v: %v", params, err)
		}
		wantChanged, wantRestores := 2, 1 // the HMARK rule replaced: the sets stay
		if i == 0 {
			// Two sets with every tunnel IP, chain, jump, exit and HMARK rules.
			wantChanged = 2 + 2*len(kernelVIPs) + 1 + 1 + 2
		} else if params == kernelParamSets[i-1] {
			wantChanged, wantRestores = 0, 0
		}
		if changed != wantChanged || restorer.Calls != wantRestores {
			t.Errorf("Sync with %v: changed = %d with %d restores, want %d with %d", params, changed, restorer.Calls, wantChanged, wantRestores)
		}

		var udp, tcp, other []observation
		err = ns.Do(func() error {
			var err error
			if udp, err = sendUDPFlows(ipv4Flows, rng, udpFlowsPerParamSet, false); err != nil {
				return err
			}
			if tcp, err = sendTCPFlows(ipv4Flows, rng, tcpFlowsPerParamSet); err != nil {
				return err
			}
			for _, proto := range rawProtos {
				obs, err := sendRawFlows(ipv4Flows, rng, proto, rawFlowsPerProto)
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

// flowFamily is what the kernel tests of one address family send flows
// with: the socket family, the tunnel IPs (on lo) and a source drawer.
type flowFamily struct {
	af     int
	vips   []netip.Addr
	source func(*rand.Rand) (netip.Addr, uint16)
}

var ipv4Flows = flowFamily{af: unix.AF_INET, vips: kernelVIPs, source: randomSource}

// sockaddrOf is the socket address of a and port, of a's family.
func sockaddrOf(a netip.Addr, port uint16) unix.Sockaddr {
	if a.Is4() {
		return sockaddr(a, port)
	}
	return sockaddr6(a, port)
}

// addrPortOf reads an IPv4 or IPv6 socket address.
func addrPortOf(sa unix.Sockaddr) (netip.AddrPort, bool) {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)), true
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port)), true
	}
	return netip.AddrPort{}, false
}

// sendUDPFlows sends n datagrams, each from a new socket bound to a random
// source address and port of fam, to random tunnel IPs and ports, and
// reads the mark of each one on a UDP socket bound to the destination.
// With dstOpts (IPv6 only) each datagram carries a destination options
// header (8 bytes of padding) between the IPv6 and UDP headers, which the
// kernel skips to find the ports. It must run inside the test netns.
func sendUDPFlows(fam flowFamily, rng *rand.Rand, n int, dstOpts bool) ([]observation, error) {
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
	for _, vip := range fam.vips {
		for _, port := range kernelDstPorts {
			fd, err := markReceivingSocket(fam.af, unix.SOCK_DGRAM, 0)
			if err != nil {
				return nil, err
			}
			receivers[dest{vip, port}] = fd
			if err := unix.Bind(fd, sockaddrOf(vip, port)); err != nil {
				return nil, fmt.Errorf("bind UDP receiver %s: %w", netip.AddrPortFrom(vip, port), err)
			}
		}
	}

	var obs []observation
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := 0; i < n; i++ {
		d := dest{fam.vips[rng.IntN(len(fam.vips))], kernelDstPorts[rng.IntN(len(kernelDstPorts))]}
		src, sport := fam.source(rng)
		from, to := netip.AddrPortFrom(src, sport), netip.AddrPortFrom(d.vip, d.port)
		fd, err := unix.Socket(fam.af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("UDP sender socket: %w", err)
		}
		payload := binary.BigEndian.AppendUint32(nil, uint32(i))
		if dstOpts {
			// Next header (set by the kernel), length 0 (8 bytes), PadN
			// of 4 bytes.
			err = unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, string([]byte{0, 0, 1, 4, 0, 0, 0, 0}))
		}
		if err == nil {
			err = unix.Bind(fd, sockaddrOf(src, sport))
		}
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddrOf(d.vip, d.port))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send UDP %s -> %s: %w", from, to, err)
		}

		nr, oobn, _, sa, err := unix.Recvmsg(receivers[d], buf, oob, 0)
		if err != nil {
			return nil, fmt.Errorf("receive UDP %s -> %s: %w", from, to, err)
		}
		if nr != len(payload) || binary.BigEndian.Uint32(buf[:nr]) != uint32(i) {
			return nil, fmt.Errorf("receive UDP on %s: got datagram %x, want %x", to, buf[:nr], payload)
		}
		mark, err := markFromCmsgs(oob[:oobn])
		if err != nil {
			return nil, fmt.Errorf("receive UDP %s -> %s: %w", from, to, err)
		}
		came, ok := addrPortOf(sa)
		if !ok || came != from {
			return nil, fmt.Errorf("receive UDP: came from %v, sent from %s", sa, from)
		}
		obs = append(obs, observation{flow: Flow{Src: src, Dst: d.vip, SrcPort: sport, DstPort: d.port, Proto: protoUDP}, mark: mark})
	}
	return obs, nil
}

// sendTCPFlows starts n TCP connections, each from a random source address
// and port of fam, to random tunnel IPs and ports where nothing listens,
// and reads the mark of each SYN on a raw TCP socket (the kernel answers
// with a reset, which is not marked by the tunnel IP rules). It must run
// inside the test netns.
func sendTCPFlows(fam flowFamily, rng *rand.Rand, n int) ([]observation, error) {
	raw, err := markReceivingSocket(fam.af, unix.SOCK_RAW, unix.IPPROTO_TCP)
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(raw) }()

	var obs []observation
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := 0; i < n; i++ {
		vip := fam.vips[rng.IntN(len(fam.vips))]
		dport := kernelDstPorts[rng.IntN(len(kernelDstPorts))]
		src, sport := fam.source(rng)
		fd, err := unix.Socket(fam.af, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("TCP client socket: %w", err)
		}
		err = unix.Bind(fd, sockaddrOf(src, sport))
		if err == nil {
			err = unix.Connect(fd, sockaddrOf(vip, dport))
			if errors.Is(err, unix.EINPROGRESS) {
				err = nil
			}
		}
		if err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("connect TCP %s -> %s: %w", netip.AddrPortFrom(src, sport), netip.AddrPortFrom(vip, dport), err)
		}
		want := Flow{Src: src, Dst: vip, SrcPort: sport, DstPort: dport, Proto: protoTCP}
		// Read until this connection's SYN; resets going back and any
		// other packet are skipped.
		for {
			nr, oobn, _, sa, err := unix.Recvmsg(raw, buf, oob, 0)
			if err != nil {
				_ = unix.Close(fd)
				return nil, fmt.Errorf("receive SYN of %+v: %w", want, err)
			}
			seg, ok := rawPayload(buf[:nr], sa, protoTCP, src, vip)
			const flagSYN, flagACK = 0x02, 0x10
			if !ok || len(seg) < 14 || binary.BigEndian.Uint16(seg[0:2]) != sport || binary.BigEndian.Uint16(seg[2:4]) != dport ||
				seg[13]&(flagSYN|flagACK) != flagSYN {
				continue
			}
			mark, err := markFromCmsgs(oob[:oobn])
			if err != nil {
				_ = unix.Close(fd)
				return nil, fmt.Errorf("receive SYN of %+v: %w", want, err)
			}
			obs = append(obs, observation{flow: want, mark: mark})
			break
		}
		_ = unix.Close(fd)
	}
	return obs, nil
}

// sendRawFlows sends n packets of protocol proto from raw sockets bound to
// random source addresses of fam to random tunnel IPs, and reads the mark
// of each one on a raw socket of that protocol. The flow compared is built
// as if the kernel read ports from the payload (at the offset where ESP and
// AH carry their SPI), so that a prediction which used them where the
// kernel does not would fail. ICMP packets are echo requests, not errors
// (whose embedded header the kernel would hash). It must run inside the
// test netns.
func sendRawFlows(fam flowFamily, rng *rand.Rand, proto uint8, n int) ([]observation, error) {
	rx, err := markReceivingSocket(fam.af, unix.SOCK_RAW, int(proto))
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
		vip := fam.vips[rng.IntN(len(fam.vips))]
		src, _ := fam.source(rng)
		payload := make([]byte, 16)
		for j := range payload {
			payload[j] = byte(rng.Uint32())
		}
		switch proto {
		case protoICMP:
			payload[0], payload[1] = 8, 0 // echo request
			payload[2], payload[3] = 0, 0
			binary.BigEndian.PutUint16(payload[2:], inetChecksum(payload))
		case protoICMPv6:
			payload[0], payload[1] = 128, 0 // echo request; the kernel writes the checksum (bytes 2-3)
		}
		binary.BigEndian.PutUint32(payload[12:], uint32(i))
		want := Flow{
			Src: src, Dst: vip, Proto: proto,
			SrcPort: binary.BigEndian.Uint16(payload[portsAt:]),
			DstPort: binary.BigEndian.Uint16(payload[portsAt+2:]),
		}

		fd, err := unix.Socket(fam.af, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
		if err != nil {
			return nil, fmt.Errorf("raw socket proto %d: %w", proto, err)
		}
		err = unix.Bind(fd, sockaddrOf(src, 0))
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddrOf(vip, 0))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send proto %d %s -> %s: %w", proto, src, vip, err)
		}
		for {
			nr, oobn, _, sa, err := unix.Recvmsg(rx, buf, oob, 0)
			if err != nil {
				return nil, fmt.Errorf("receive proto %d %s -> %s: %w", proto, src, vip, err)
			}
			got, ok := rawPayload(buf[:nr], sa, proto, src, vip)
			if !ok || !samePayload(got, payload, proto) {
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

// sendMixedFlows sends, inside ns, nUDP UDP flows, nTCP TCP flows and nRaw
// flows of each protocol of rawProtos, in that order, and returns their
// observations in the same order.
func sendMixedFlows(ns *testnetns.NS, fam flowFamily, rng *rand.Rand, nUDP, nTCP int, rawProtos []uint8, nRaw int) ([]observation, error) {
	var all []observation
	err := ns.Do(func() error {
		udp, err := sendUDPFlows(fam, rng, nUDP, false)
		if err != nil {
			return err
		}
		tcp, err := sendTCPFlows(fam, rng, nTCP)
		if err != nil {
			return err
		}
		all = slices.Concat(udp, tcp)
		for _, proto := range rawProtos {
			obs, err := sendRawFlows(fam, rng, proto, nRaw)
			if err != nil {
				return err
			}
			all = append(all, obs...)
		}
		return nil
	})
	return all, err
}

// rawPayload is the payload of a packet a raw socket received, when it is
// a packet of proto from src to vip. An IPv4 raw socket delivers the IP
// header too; an IPv6 one only the payload, with the source in the
// sender's address (the destination is not given: any tunnel IP will do,
// the payload names the packet).
func rawPayload(pkt []byte, sa unix.Sockaddr, proto uint8, src, vip netip.Addr) ([]byte, bool) {
	if src.Is6() {
		from, ok := addrPortOf(sa)
		return pkt, ok && from.Addr() == src
	}
	if len(pkt) < 20 || pkt[0]>>4 != 4 {
		return nil, false
	}
	ihl := int(pkt[0]&0x0f) * 4
	if ihl < 20 || len(pkt) < ihl || pkt[9] != proto || netip.AddrFrom4([4]byte(pkt[16:20])) != vip ||
		netip.AddrFrom4([4]byte(pkt[12:16])) != src {
		return nil, false
	}
	return pkt[ihl:], true
}

// samePayload reports whether got is the payload sent, but for ICMPv6's
// checksum, which the kernel wrote.
func samePayload(got, sent []byte, proto uint8) bool {
	if proto == protoICMPv6 && len(got) == len(sent) && len(got) >= 4 {
		return slices.Equal(got[:2], sent[:2]) && slices.Equal(got[4:], sent[4:])
	}
	return slices.Equal(got, sent)
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

// markReceivingSocket opens a socket of the address family that reports
// each packet's mark (SO_RCVMARK) and gives up reading after a few seconds.
func markReceivingSocket(family, typ, proto int) (int, error) {
	fd, err := unix.Socket(family, typ|unix.SOCK_CLOEXEC, proto)
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

// TestKernelClientAffinityMarksMatchGo: with client affinity, the kernel's
// HMARK (port and protocol masks 0) marks every flow as Params.Mark of its
// ClientFlow, so all flows of one client to one tunnel IP share a bucket;
// a second Sync finds the rules it wrote and writes nothing.
func TestKernelClientAffinityMarksMatchGo(t *testing.T) {
	ns := testnetns.New(t, prefixesOf(vipBelow, vipAbove)...)
	ipt := ns.IPTables("iptables")
	restorer := newNSRestorer(ns, "iptables")
	rng := rand.New(rand.NewPCG(20261126, 2))
	var targets []Target
	for _, vip := range kernelVIPs {
		targets = append(targets, Target{VIP: vip, ClientAffinity: true})
	}
	for _, params := range kernelParamSets[:2] {
		chain, err := NewChain(ipt, ns.IPSets(), "", params, restorer)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := chain.Sync(targets); err != nil {
			t.Fatalf("Sync with %v: %v", params, err)
		}
		if changed, err := chain.Sync(targets); err != nil || changed != 0 {
			t.Errorf("second Sync with %v: changed %d, %v; want nothing to change", params, changed, err)
		}
		all, err := sendMixedFlows(ns, ipv4Flows, rng, udpFlowsPerParamSet, tcpFlowsPerParamSet, rawProtos, rawFlowsPerProto)
		if err != nil {
			t.Fatal(err)
		}
		// With 2^31 buckets the mark shows almost the whole hash: had the
		// kernel hashed a port or the protocol, the prediction from the
		// addresses alone would miss.
		mismatches := 0
		for _, o := range all {
			if want := params.Mark(ClientFlow(o.flow)); o.mark != want {
				mismatches++
				if mismatches <= 10 {
					t.Errorf("%v: flow %+v: kernel mark %#x, Go predicts %#x for the client's address alone", params, o.flow, o.mark, want)
				}
			}
		}
		if mismatches > 0 {
			t.Fatalf("%v: %d of %d flows marked differently from the Go prediction", params, mismatches, len(all))
		}
		t.Logf("%v, client affinity: %d UDP, TCP, ICMP, ESP, AH and other flows, kernel mark == Params.Mark(ClientFlow) for all", params, len(all))
	}
}
