package hmark

// Privileged test of the IPv6 hash: ip6tables' HMARK marks real IPv6 flows
// in a fresh network namespace, and Params.Mark must predict every mark.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The IPv6 tunnel IPs of the kernel test, on lo, and the prefix the random
// sources are drawn from (a local route on lo; the namespace allows
// binding to any of it). The tunnel IPs fold (xor of their words) below,
// inside and above the sources' range of folds.
var (
	kernelVIPs6 = []netip.Addr{
		netip.MustParseAddr("2001:db8:10::1"),
		netip.MustParseAddr("fd00:6::a"),
		netip.MustParseAddr("2001:db8:0:ffff::ffff:ffff"),
	}
	sourcePrefix6 = netip.MustParsePrefix("2001:db8:5::/64")
)

const (
	udp6FlowsPerParamSet     = 300
	udp6DstOptsFlowsPerSet   = 100
	tcp6FlowsPerParamSet     = 100
	raw6FlowsPerProto        = 50
	ipv6DstOptsPadding       = 8 // bytes of the destination options header the test adds
	protoUnassigned          = 253
	ip6tablesHMARKPrefixFull = "128"
)

// rawProtos6 are the protocols sent from raw IPv6 sockets: ICMPv6 (echo
// requests), an unassigned protocol whose ports the kernel ignores, and
// ESP, whose SPI it hashes in place of the ports.
var rawProtos6 = []uint8{protoICMPv6, protoUnassigned, protoESP}

// TestKernelMarksMatchGoIPv6 sends real IPv6 UDP (also behind a
// destination options header, which the kernel skips to find the ports),
// TCP, ICMPv6, ESP and other flows through an ip6tables HMARK rule with
// each parameter set, and checks that Params.Mark predicts the kernel's
// mark for every one of them (SO_RCVMARK).
func TestKernelMarksMatchGoIPv6(t *testing.T) {
	ns := testnetns.New(t)
	setUpIPv6Lab(t, ns)
	rng := rand.New(rand.NewPCG(20261126, 6))
	total := 0
	for _, params := range kernelParamSets {
		ns.Run("ip6tables", "-t", "mangle", "-F", "PREROUTING")
		for _, vip := range kernelVIPs6 {
			ns.Run("ip6tables", "-t", "mangle", "-A", "PREROUTING", "-d", vip.String()+"/128", "-j", "HMARK",
				"--hmark-src-prefix", ip6tablesHMARKPrefixFull, "--hmark-dst-prefix", ip6tablesHMARKPrefixFull,
				"--hmark-sport-mask", "0xffff", "--hmark-dport-mask", "0xffff", "--hmark-proto-mask", "0xffff",
				"--hmark-rnd", fmt.Sprintf("%#x", params.Seed), "--hmark-mod", fmt.Sprint(params.Buckets),
				"--hmark-offset", fmt.Sprint(params.Offset))
		}
		var all []observation
		err := ns.Do(func() error {
			udp, err := sendUDP6Flows(rng, udp6FlowsPerParamSet, false)
			if err != nil {
				return err
			}
			udpOpts, err := sendUDP6Flows(rng, udp6DstOptsFlowsPerSet, true)
			if err != nil {
				return err
			}
			tcp, err := sendTCP6Flows(rng, tcp6FlowsPerParamSet)
			if err != nil {
				return err
			}
			all = slices.Concat(udp, udpOpts, tcp)
			for _, proto := range rawProtos6 {
				obs, err := sendRaw6Flows(rng, proto, raw6FlowsPerProto)
				if err != nil {
					return err
				}
				all = append(all, obs...)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("send IPv6 flows with %v: %v", params, err)
		}
		want := udp6FlowsPerParamSet + udp6DstOptsFlowsPerSet + tcp6FlowsPerParamSet + len(rawProtos6)*raw6FlowsPerProto
		if len(all) != want {
			t.Fatalf("observed %d IPv6 flows, want %d", len(all), want)
		}
		mismatches := 0
		for _, o := range all {
			if want := params.Mark(o.flow); o.mark != want {
				mismatches++
				if mismatches <= 10 {
					t.Errorf("%v: flow %+v: kernel mark %#x, Go predicts %#x", params, o.flow, o.mark, want)
				}
			}
		}
		if mismatches > 0 {
			t.Fatalf("%v: %d of %d IPv6 flows marked differently from the Go prediction", params, mismatches, len(all))
		}
		total += len(all)
		t.Logf("%v: %d IPv6 flows (UDP, UDP behind destination options, TCP, ICMPv6, protocol 253, ESP), kernel mark == Params.Mark for all; e.g. %+v -> %#x",
			params, len(all), all[0].flow, all[0].mark)
	}
	t.Logf("compared %d kernel-marked IPv6 flows over %d parameter sets", total, len(kernelParamSets))
}

// setUpIPv6Lab puts the tunnel IPs on lo, routes the source prefix to lo
// as local, and lets sockets bind to any address of it.
func setUpIPv6Lab(t *testing.T, ns *testnetns.NS) {
	t.Helper()
	nl := ns.Netlink()
	lo, err := nl.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	for _, vip := range kernelVIPs6 {
		if err := nl.AddrAdd(lo, &netlink.Addr{IPNet: testnetns.IPNet(netip.PrefixFrom(vip, 128)), Flags: unix.IFA_F_NODAD}); err != nil {
			t.Fatalf("add %s to lo: %v", vip, err)
		}
	}
	ns.Run("ip", "-6", "route", "add", "local", sourcePrefix6.String(), "dev", "lo")
	err = ns.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv6/ip_nonlocal_bind", []byte("1"), 0o644)
	})
	if err != nil {
		t.Fatalf("allow binding to the source prefix: %v", err)
	}
}

// randomSource6 returns a random address of sourcePrefix6 and a random
// non-zero port.
func randomSource6(rng *rand.Rand) (netip.Addr, uint16) {
	b := sourcePrefix6.Addr().As16()
	binary.BigEndian.PutUint64(b[8:], rng.Uint64()|1)
	return netip.AddrFrom16(b), uint16(1 + rng.IntN(65535))
}

func sockaddr6(a netip.Addr, port uint16) *unix.SockaddrInet6 {
	return &unix.SockaddrInet6{Addr: a.As16(), Port: int(port)}
}

// markReceivingSocket6 is markReceivingSocket for IPv6.
func markReceivingSocket6(typ, proto int) (int, error) {
	return markReceivingSocketOf(unix.AF_INET6, typ, proto)
}

// sendUDP6Flows sends n datagrams from random sources to random tunnel IPs
// and ports and reads each one's mark where it arrives. With dstOpts each
// datagram carries a destination options header (8 bytes of padding)
// between the IPv6 and UDP headers.
func sendUDP6Flows(rng *rand.Rand, n int, dstOpts bool) ([]observation, error) {
	type dest struct {
		vip  netip.Addr
		port uint16
	}
	receivers := map[dest]int{}
	defer func() {
		for _, fd := range receivers {
			_ = unix.Close(fd)
		}
	}()
	for _, vip := range kernelVIPs6 {
		for _, port := range kernelDstPorts {
			fd, err := markReceivingSocket6(unix.SOCK_DGRAM, 0)
			if err != nil {
				return nil, err
			}
			receivers[dest{vip, port}] = fd
			if err := unix.Bind(fd, sockaddr6(vip, port)); err != nil {
				return nil, fmt.Errorf("bind UDP receiver [%s]:%d: %w", vip, port, err)
			}
		}
	}
	var obs []observation
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := range n {
		d := dest{kernelVIPs6[rng.IntN(len(kernelVIPs6))], kernelDstPorts[rng.IntN(len(kernelDstPorts))]}
		src, sport := randomSource6(rng)
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
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
			err = unix.Bind(fd, sockaddr6(src, sport))
		}
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddr6(d.vip, d.port))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send UDP [%s]:%d -> [%s]:%d: %w", src, sport, d.vip, d.port, err)
		}
		nr, oobn, _, from, err := unix.Recvmsg(receivers[d], buf, oob, 0)
		if err != nil {
			return nil, fmt.Errorf("receive UDP [%s]:%d -> [%s]:%d: %w", src, sport, d.vip, d.port, err)
		}
		if nr != len(payload) || binary.BigEndian.Uint32(buf[:nr]) != uint32(i) {
			return nil, fmt.Errorf("receive UDP on [%s]:%d: got datagram %x, want %x", d.vip, d.port, buf[:nr], payload)
		}
		mark, err := markFromCmsgs(oob[:oobn])
		if err != nil {
			return nil, err
		}
		from6, ok := from.(*unix.SockaddrInet6)
		if !ok || netip.AddrFrom16(from6.Addr) != src || uint16(from6.Port) != sport {
			return nil, fmt.Errorf("receive UDP: came from %v, sent from [%s]:%d", from, src, sport)
		}
		obs = append(obs, observation{flow: Flow{Src: src, Dst: d.vip, SrcPort: sport, DstPort: d.port, Proto: protoUDP}, mark: mark})
	}
	return obs, nil
}

// sendTCP6Flows starts n TCP connections from random sources to random
// tunnel IPs and ports where nothing listens, and reads the mark of each
// SYN on a raw IPv6 TCP socket (which delivers the TCP header, the source
// address in the sender's address).
func sendTCP6Flows(rng *rand.Rand, n int) ([]observation, error) {
	raw, err := markReceivingSocket6(unix.SOCK_RAW, unix.IPPROTO_TCP)
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(raw) }()
	var obs []observation
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for range n {
		vip := kernelVIPs6[rng.IntN(len(kernelVIPs6))]
		dport := kernelDstPorts[rng.IntN(len(kernelDstPorts))]
		src, sport := randomSource6(rng)
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("TCP client socket: %w", err)
		}
		err = unix.Bind(fd, sockaddr6(src, sport))
		if err == nil {
			if err = unix.Connect(fd, sockaddr6(vip, dport)); errors.Is(err, unix.EINPROGRESS) {
				err = nil
			}
		}
		if err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("connect TCP [%s]:%d -> [%s]:%d: %w", src, sport, vip, dport, err)
		}
		want := Flow{Src: src, Dst: vip, SrcPort: sport, DstPort: dport, Proto: protoTCP}
		for {
			nr, oobn, _, from, err := unix.Recvmsg(raw, buf, oob, 0)
			if err != nil {
				_ = unix.Close(fd)
				return nil, fmt.Errorf("receive SYN of %+v: %w", want, err)
			}
			from6, ok := from.(*unix.SockaddrInet6)
			seg := buf[:nr]
			const flagSYN, flagACK = 0x02, 0x10
			if !ok || nr < 14 || netip.AddrFrom16(from6.Addr) != src || binary.BigEndian.Uint16(seg[0:2]) != sport ||
				binary.BigEndian.Uint16(seg[2:4]) != dport || seg[13]&(flagSYN|flagACK) != flagSYN {
				continue // a reset going back, or another packet
			}
			mark, err := markFromCmsgs(oob[:oobn])
			if err != nil {
				_ = unix.Close(fd)
				return nil, err
			}
			obs = append(obs, observation{flow: want, mark: mark})
			break
		}
		_ = unix.Close(fd)
	}
	return obs, nil
}

// sendRaw6Flows sends n packets of protocol proto from raw IPv6 sockets
// bound to random sources to random tunnel IPs, and reads each one's mark
// on a raw socket of that protocol. The flow compared carries the first
// four payload bytes as ports (where ESP has its SPI), so that a
// prediction which used them where the kernel does not would fail.
func sendRaw6Flows(rng *rand.Rand, proto uint8, n int) ([]observation, error) {
	rx, err := markReceivingSocket6(unix.SOCK_RAW, int(proto))
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(rx) }()
	var obs []observation
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4)*4)
	for i := range n {
		vip := kernelVIPs6[rng.IntN(len(kernelVIPs6))]
		src, _ := randomSource6(rng)
		payload := make([]byte, 16)
		for j := range payload {
			payload[j] = byte(rng.Uint32())
		}
		if proto == protoICMPv6 {
			payload[0], payload[1] = 128, 0 // echo request; the kernel fills in the checksum
		}
		binary.BigEndian.PutUint32(payload[12:], uint32(i))
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
		if err != nil {
			return nil, fmt.Errorf("raw IPv6 socket proto %d: %w", proto, err)
		}
		err = unix.Bind(fd, sockaddr6(src, 0))
		if err == nil {
			err = unix.Sendto(fd, payload, 0, sockaddr6(vip, 0))
		}
		_ = unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("send proto %d [%s] -> [%s]: %w", proto, src, vip, err)
		}
		for {
			nr, oobn, _, from, err := unix.Recvmsg(rx, buf, oob, 0)
			if err != nil {
				return nil, fmt.Errorf("receive proto %d [%s] -> [%s]: %w", proto, src, vip, err)
			}
			from6, ok := from.(*unix.SockaddrInet6)
			got := buf[:nr]
			if !ok || netip.AddrFrom16(from6.Addr) != src || len(got) != len(payload) || !slices.Equal(got[4:], payload[4:]) {
				continue // an echo reply, an error, or another packet
			}
			mark, err := markFromCmsgs(oob[:oobn])
			if err != nil {
				return nil, err
			}
			// What arrived: ICMPv6's checksum is the kernel's.
			flow := Flow{Src: src, Dst: vip, Proto: proto, SrcPort: binary.BigEndian.Uint16(got[0:]), DstPort: binary.BigEndian.Uint16(got[2:])}
			obs = append(obs, observation{flow: flow, mark: mark})
			break
		}
	}
	return obs, nil
}
