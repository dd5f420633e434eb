package endpoint

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/bridgeguard"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/replyexempt"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// vxlanFrame builds what a router would send to a pod whose decapsulation
// device is the VXLAN stand-in (VNI 42): a VXLAN header, then an Ethernet
// frame to dstMAC carrying an IPv4/UDP packet from a client to vip with
// payloadLen bytes of payload. It returns the frame and the inner IP
// packet's length.
func vxlanFrame(dstMAC net.HardwareAddr, client, vip netip.Addr, payloadLen int) (frame []byte, ipLen int) {
	ipLen = 20 + 8 + payloadLen
	b := make([]byte, 8+14+ipLen)
	b[0] = 0x08                                       // VXLAN: VNI present
	binary.BigEndian.PutUint32(b[4:8], uint32(42)<<8) // VNI 42
	eth := b[8:]
	copy(eth[0:6], dstMAC)
	copy(eth[6:12], net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01})
	binary.BigEndian.PutUint16(eth[12:14], unix.ETH_P_IP)
	ip := eth[14:]
	ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(ip[2:4], uint16(ipLen))
	src, dst := client.As4(), vip.As4()
	copy(ip[12:16], src[:])
	copy(ip[16:20], dst[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i : i+2]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:12], ^uint16(sum))
	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:2], 40000)
	binary.BigEndian.PutUint16(udp[2:4], 9)
	binary.BigEndian.PutUint16(udp[4:6], uint16(8+payloadLen))
	return b, ipLen
}

// TestDecapCountersFromKernel: a served pod's decapsulation device (the VXLAN
// stand-in: this host has no GRE) counts the packets sent to its tunnel IP,
// and the scrape reports them under the pod and tunnel IP; a device that
// vanished is counted as an error and the scrape still succeeds.
func TestDecapCountersFromKernel(t *testing.T) {
	ip := netip.MustParseAddr("198.18.10.101")
	pod, node := podAndNode(t, ip)
	node.Run("ip", "addr", "add", "198.18.99.1/32", "dev", "lo") // a source address for the "router"
	cfg := testConfig(encap.GRE)
	pn := standInPodNetwork(cfg)
	w := want(vip1)
	w.Pod.IP = ip
	if _, err := pn.Sync(pod.Handle, w); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	m := NewMetrics(reg, pn, nil, false)
	t.Cleanup(m.release)
	fd, err := unix.Dup(int(pod.Handle))
	if err != nil {
		t.Fatal(err)
	}
	if !m.keepNamespace("a/web-1", w, netns.NsHandle(fd)) {
		unix.Close(fd)
		t.Fatal("the metrics did not take the pod's namespace")
	}
	series := "pod=a/web-1,vip=192.0.2.10"
	read := func() (packets, bytes float64) {
		p, ok := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total")[series]
		if !ok {
			t.Fatalf("no packets series %s", series)
		}
		return p, promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_bytes_total")[series]
	}
	packets0, bytes0 := read()

	link, err := pod.Netlink().LinkByName(cfg.Device)
	if err != nil {
		t.Fatal(err)
	}
	const sent = 5
	frame, ipLen := vxlanFrame(link.Attrs().HardwareAddr, netip.MustParseAddr("203.0.113.9"), vip1, 32)
	err = node.Do(func() error {
		conn, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: ip.AsSlice(), Port: 4789})
		if err != nil {
			return err
		}
		defer conn.Close()
		for range sent {
			if _, err := conn.Write(frame); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("sending to the pod: %v", err)
	}
	waitFor(t, "the device to count the packets", func() bool { p, _ := read(); return p-packets0 >= sent })
	packets, bytes := read()
	if packets-packets0 != sent {
		t.Errorf("decap_received_packets_total rose by %v, want %d", packets-packets0, sent)
	}
	// The kernel counts the decapsulated packet, with or without its
	// Ethernet header depending on the device.
	if d := bytes - bytes0; d < sent*float64(ipLen) || d > sent*float64(ipLen+14) {
		t.Errorf("decap_received_bytes_total rose by %v, want %d to %d", d, sent*ipLen, sent*(ipLen+14))
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_counter_errors_total")[""]; n != 0 {
		t.Errorf("decap_counter_errors_total = %v, want 0", n)
	}

	// The device vanishes (removed by hand): the scrape leaves the pod out
	// and counts the failure.
	pod.Run("ip", "link", "del", cfg.Device)
	if s := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_received_packets_total"); len(s) != 0 {
		t.Errorf("series exported for a pod without its device: %v", s)
	}
	if n := promtest.Series(t, reg, "kube_service_tunnel_endpoint_decap_counter_errors_total")[""]; n < 1 {
		t.Errorf("decap_counter_errors_total = %v, want at least 1", n)
	}
}

// TestNodeTableCollectors: the node tables' counters are read from the
// kernel at each scrape, and absent while their table is not there.
func TestNodeTableCollectors(t *testing.T) {
	node := testnetns.New(t)
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewReplyExemptionCollector(node.Handle, logrus.New()), NewBridgeGuardCollector(node.Handle, logrus.New()))
	for _, name := range []string{"kube_service_tunnel_endpoint_untracked_reply_packets_total", "kube_service_tunnel_endpoint_bridge_guard_dropped_packets_total"} {
		if got := promtest.Series(t, reg, name); len(got) != 0 {
			t.Errorf("%s without its table: %v, want absent", name, got)
		}
	}
	if err := replyexempt.Install(node.Handle, replyexempt.Want{Sources: []netip.Addr{netip.MustParseAddr("192.0.2.1")}, Links: []string{"lo"}}, false); err != nil {
		t.Fatal(err)
	}
	if err := bridgeguard.Install(node.Handle, PodLabel, false); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"kube_service_tunnel_endpoint_untracked_reply_packets_total", "kube_service_tunnel_endpoint_bridge_guard_dropped_packets_total"} {
		if got := promtest.Series(t, reg, name); len(got) != 1 || got[""] != 0 {
			t.Errorf("%s with its table, nothing counted: %v, want one series at 0", name, got)
		}
	}
}
