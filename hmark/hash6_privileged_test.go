package hmark

// Privileged test of the IPv6 hash: ip6tables' HMARK marks real IPv6 flows
// in a fresh network namespace, and Params.Mark must predict every mark.

import (
	"encoding/binary"
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
	ipv6Flows     = flowFamily{af: unix.AF_INET6, vips: kernelVIPs6, source: randomSource6}
)

const (
	udp6FlowsPerParamSet     = 300
	udp6DstOptsFlowsPerSet   = 100
	tcp6FlowsPerParamSet     = 100
	raw6FlowsPerProto        = 50
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
			udp, err := sendUDPFlows(ipv6Flows, rng, udp6FlowsPerParamSet, false)
			if err != nil {
				return err
			}
			udpOpts, err := sendUDPFlows(ipv6Flows, rng, udp6DstOptsFlowsPerSet, true)
			if err != nil {
				return err
			}
			tcp, err := sendTCPFlows(ipv6Flows, rng, tcp6FlowsPerParamSet)
			if err != nil {
				return err
			}
			all = slices.Concat(udp, udpOpts, tcp)
			for _, proto := range rawProtos6 {
				obs, err := sendRawFlows(ipv6Flows, rng, proto, raw6FlowsPerProto)
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
