package kernelcheck

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// rtEvent is one rtnetlink notification: what the kernel created or
// deleted, of which family, with which encapsulation or device kind.
type rtEvent struct {
	typ   uint16
	ipv6  bool
	encap uint16 // LWTUNNEL_ENCAP_*; 0 for none
	kind  string // a device's
}

func (e rtEvent) String() string {
	return fmt.Sprintf("{type %d ipv6 %v encap %d kind %q}", e.typ, e.ipv6, e.encap, e.kind)
}

// rtWatch is a socket in a namespace subscribed to its routes, rules,
// nexthop objects and devices of both families.
type rtWatch struct{ fd int }

func watchNamespace(t *testing.T, ns netns.NsHandle) *rtWatch {
	t.Helper()
	w := &rtWatch{fd: -1}
	err := nsexec.Do(ns, func() error {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		var groups uint32
		for _, g := range []uint{unix.RTNLGRP_LINK, unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_IPV6_ROUTE,
			unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_IPV6_RULE, unix.RTNLGRP_NEXTHOP} {
			groups |= 1 << (g - 1)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups}); err != nil {
			unix.Close(fd)
			return err
		}
		w.fd = fd
		return nil
	})
	if err != nil {
		t.Fatalf("subscribing to rtnetlink: %v", err)
	}
	t.Cleanup(func() { unix.Close(w.fd) })
	return w
}

// drain returns the notifications received so far. The kernel sends them
// before it acknowledges the request that caused them, so a probe's are
// all there when it returns.
func (w *rtWatch) drain(t *testing.T) []rtEvent {
	t.Helper()
	var events []rtEvent
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(w.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) {
			return events
		}
		if err != nil {
			t.Fatalf("reading rtnetlink notifications: %v", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			t.Fatalf("parsing rtnetlink notifications: %v", err)
		}
		for _, m := range msgs {
			events = append(events, decodeEvent(t, m))
		}
	}
}

func decodeEvent(t *testing.T, m syscall.NetlinkMessage) rtEvent {
	t.Helper()
	e := rtEvent{typ: m.Header.Type}
	if len(m.Data) > 0 {
		e.ipv6 = m.Data[0] == unix.AF_INET6
	}
	var encapType []byte
	switch m.Header.Type {
	case unix.RTM_NEWROUTE, unix.RTM_DELROUTE:
		encapType = rtAttrs(m.Data, unix.SizeofRtMsg)[unix.RTA_ENCAP_TYPE]
	case unix.RTM_NEWNEXTHOP, unix.RTM_DELNEXTHOP:
		encapType = rtAttrs(m.Data, 8)[unix.NHA_ENCAP_TYPE] // struct nhmsg
	case unix.RTM_NEWLINK, unix.RTM_DELLINK:
		link, err := netlink.LinkDeserialize(&unix.NlMsghdr{Type: m.Header.Type}, m.Data)
		if err != nil {
			t.Fatalf("decoding a device notification: %v", err)
		}
		e.kind = link.Type()
		e.ipv6 = strings.HasPrefix(e.kind, "ip6")
	}
	if len(encapType) == 2 {
		e.encap = binary.NativeEndian.Uint16(encapType)
	}
	return e
}

// rtAttrs indexes the attributes of a message whose fixed header is hdr
// bytes long.
func rtAttrs(b []byte, hdr int) map[uint16][]byte {
	out := map[uint16][]byte{}
	if len(b) < hdr {
		return out
	}
	for b = b[hdr:]; len(b) >= unix.SizeofRtAttr; {
		l := int(binary.NativeEndian.Uint16(b))
		if l < unix.SizeofRtAttr || l > len(b) {
			break
		}
		out[binary.NativeEndian.Uint16(b[2:])&^unix.NLA_F_NESTED] = b[unix.SizeofRtAttr:l]
		b = b[min((l+3)&^3, len(b)):]
	}
	return out
}

// TestEachViewProbesItsOwnFamily watches what the probes create in their
// namespace: the IPv6 view's must be IPv6 rules, routes (encap ip6 for the
// IP encapsulation), inet6 nexthop objects and ip6gre devices, the IPv4
// probes' IPv4 ones; a probe that succeeds must have created something. The
// comparison with the commands cannot tell this where the kernel has both
// families. A probe failing for want of a module (here GRE, ip6gre, MPLS)
// creates nothing.
func TestEachViewProbesItsOwnFamily(t *testing.T) {
	requirePrivileged(t)
	p, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if !p.Scratch() {
		t.Fatal("as root the probes should run in a throwaway namespace")
	}
	watch := watchNamespace(t, p.ns)
	for _, tc := range []struct {
		name  string
		probe func(Kernel) error
		// encap is the IP encapsulation of each family, when the probe
		// makes one.
		encap, encap6 uint16
	}{
		{"PolicyRouting", Kernel.PolicyRouting, 0, 0},
		{"EncapIPRoute", Kernel.EncapIPRoute, unix.LWTUNNEL_ENCAP_IP, unix.LWTUNNEL_ENCAP_IP6},
		{"EncapIPNextHop", Kernel.EncapIPNextHop, unix.LWTUNNEL_ENCAP_IP, unix.LWTUNNEL_ENCAP_IP6},
		{"EncapMPLSRoute", Kernel.EncapMPLSRoute, unix.LWTUNNEL_ENCAP_MPLS, unix.LWTUNNEL_ENCAP_MPLS},
		{"FlowBasedGRE", Kernel.FlowBasedGRE, 0, 0},
		{"GRE", Kernel.GRE, 0, 0},
	} {
		for _, ipv6 := range []bool{false, true} {
			k, encap := Kernel(p), tc.encap
			if ipv6 {
				k, encap = p.IPv6(), tc.encap6
			}
			watch.drain(t)
			err := tc.probe(k)
			events := watch.drain(t)
			t.Logf("%s (IPv6 %v): %v, notifications %v", tc.name, ipv6, err, events)
			if err == nil && len(events) == 0 {
				t.Errorf("%s (IPv6 %v) succeeded without creating anything", tc.name, ipv6)
			}
			sawEncap := false
			for _, e := range events {
				if e.ipv6 != ipv6 {
					t.Errorf("%s (IPv6 %v) made %v", tc.name, ipv6, e)
				}
				if e.encap != 0 && e.encap != encap {
					t.Errorf("%s (IPv6 %v) made encapsulation %d, want %d: %v", tc.name, ipv6, e.encap, encap, e)
				}
				sawEncap = sawEncap || e.encap == encap
			}
			if err == nil && encap != 0 && !sawEncap {
				t.Errorf("%s (IPv6 %v) succeeded without an encapsulation %d: %v", tc.name, ipv6, encap, events)
			}
		}
	}

	// ip6tables' tables appear in the namespace through the IPv6 view's
	// chains, iptables' through the others'.
	saves := func() (string, string) {
		var v4, v6 []byte
		_ = nsexec.Do(p.ns, func() error {
			v4, _ = exec.Command("iptables-save").CombinedOutput()
			v6, _ = exec.Command("ip6tables-save").CombinedOutput()
			return nil
		})
		return string(v4), string(v6)
	}
	if _, err := exec.LookPath("ip6tables-save"); err != nil {
		t.Skip("needs ip6tables-save")
	}
	for _, tc := range []struct {
		k     Kernel
		table string
		ipv6  bool
	}{{p.IPv6(), "raw", true}, {p, "filter", false}} {
		v4, v6 := saves()
		if strings.Contains(v4, "*"+tc.table) || strings.Contains(v6, "*"+tc.table) {
			t.Logf("table %s there before the probe (a legacy backend's?): not checked", tc.table)
			continue
		}
		if err := tc.k.IPTablesChain(tc.table); err != nil {
			t.Fatalf("chain in %s (IPv6 %v): %v", tc.table, tc.ipv6, err)
		}
		v4, v6 = saves()
		if strings.Contains(v6, "*"+tc.table) != tc.ipv6 || strings.Contains(v4, "*"+tc.table) == tc.ipv6 {
			t.Errorf("after a chain in %s (IPv6 %v):\niptables-save:\n%s\nip6tables-save:\n%s", tc.table, tc.ipv6, v4, v6)
		}
	}
	if err := p.Close(); err != nil {
		t.Errorf("left behind: %v", err)
	}
}
