package workload

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

var (
	tunnelIP   = netip.MustParseAddr("192.0.2.10")
	clientAddr = netip.MustParsePrefix("10.99.0.1/24")
	serverAddr = netip.MustParsePrefix("10.99.0.2/24")

	tunnelIP6   = netip.MustParseAddr("2001:db8:2::10")
	clientAddr6 = netip.MustParsePrefix("fd99::1/64")
	serverAddr6 = netip.MustParsePrefix("fd99::2/64")
)

const (
	tcpPort = 8080
	udpPort = 5353
)

// lab is a client namespace and a pod namespace joined by a veth; the pod
// has the tunnel IP on lo and the client routes it via the pod's veth
// address, so (as with a tunnel) the tunnel IP is not the address the pod
// would pick as its source. The same holds in IPv6 (tunnelIP6 via
// serverAddr6), with addresses that skip duplicate address detection.
type lab struct {
	client, pod *testnetns.NS
}

func newLab(t *testing.T) lab {
	t.Helper()
	pod := testnetns.New(t, netip.PrefixFrom(tunnelIP, 32))
	client := testnetns.New(t)
	client.AddVeth("c0", "p0", clientAddr)
	cnl, pnl := client.Netlink(), pod.Netlink()
	peer, err := cnl.LinkByName("p0")
	if err != nil {
		t.Fatal(err)
	}
	if err := cnl.LinkSetNsFd(peer, int(pod.Handle)); err != nil {
		t.Fatalf("move p0 into the pod: %v", err)
	}
	if peer, err = pnl.LinkByName("p0"); err != nil {
		t.Fatal(err)
	}
	if err := pnl.AddrAdd(peer, &netlink.Addr{IPNet: testnetns.IPNet(serverAddr)}); err != nil {
		t.Fatal(err)
	}
	if err := pnl.LinkSetUp(peer); err != nil {
		t.Fatal(err)
	}
	c0, err := cnl.LinkByName("c0")
	if err != nil {
		t.Fatal(err)
	}
	route := &netlink.Route{
		LinkIndex: c0.Attrs().Index,
		Dst:       testnetns.IPNet(netip.PrefixFrom(tunnelIP, 32)),
		Gw:        serverAddr.Addr().AsSlice(),
	}
	if err := cnl.RouteAdd(route); err != nil {
		t.Fatalf("route to the tunnel IP: %v", err)
	}
	lo, err := pnl.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []struct {
		h    *netlink.Handle
		link netlink.Link
		addr netip.Prefix
	}{{pnl, lo, netip.PrefixFrom(tunnelIP6, 128)}, {pnl, peer, serverAddr6}, {cnl, c0, clientAddr6}} {
		if err := a.h.AddrAdd(a.link, &netlink.Addr{IPNet: testnetns.IPNet(a.addr), Flags: unix.IFA_F_NODAD}); err != nil {
			t.Fatalf("address %v: %v", a.addr, err)
		}
	}
	route6 := &netlink.Route{
		LinkIndex: c0.Attrs().Index,
		Dst:       testnetns.IPNet(netip.PrefixFrom(tunnelIP6, 128)),
		Gw:        serverAddr6.Addr().AsSlice(),
	}
	if err := cnl.RouteAdd(route6); err != nil {
		t.Fatalf("route to the IPv6 tunnel IP: %v", err)
	}
	return lab{client: client, pod: pod}
}

func (l lab) serve(t *testing.T, name string) *Server {
	t.Helper()
	s, err := Serve(l.pod.Handle, name, []int{tcpPort}, []int{udpPort})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func timeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestWhoReportsPodPeerAndTunnelIP(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	for _, tc := range []struct {
		network     string
		port        uint16
		vip, client netip.Addr
	}{
		{"tcp", tcpPort, tunnelIP, clientAddr.Addr()},
		{"udp", udpPort, tunnelIP, clientAddr.Addr()},
		{"tcp", tcpPort, tunnelIP6, clientAddr6.Addr()},
		{"udp", udpPort, tunnelIP6, clientAddr6.Addr()},
	} {
		dst := netip.AddrPortFrom(tc.vip, tc.port)
		id, err := Who(timeout(t, 5*time.Second), l.client.Handle, tc.network, dst, 0)
		if err != nil {
			t.Fatal(err)
		}
		if id.Pod != "pod-a" || id.Local != dst || id.Peer.Addr() != tc.client || id.Peer.Port() == 0 {
			t.Errorf("%s: got %v, want pod=pod-a peer=%s:* local=%s", tc.network, id, tc.client, dst)
		}
	}
}

func TestUDPReplyComesFromTheTunnelIP(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	for _, vip := range []netip.Addr{tunnelIP, tunnelIP6} {
		// An unconnected socket sees whatever source the reply has.
		var c *net.UDPConn
		if err := l.client.Do(func() (err error) {
			c, err = net.ListenUDP(family("udp", vip), &net.UDPAddr{})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		dst := netip.AddrPortFrom(vip, udpPort)
		if _, err := c.WriteToUDPAddrPort([]byte("WHO"), dst); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 1500)
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Fatal(err)
		}
		if unmap(from) != dst {
			t.Errorf("reply %q came from %s, want %s", buf[:n], from, dst)
		}
	}
}

func TestWhoWithFixedSourcePortBackToBack(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	start := time.Now()
	for _, tc := range []struct {
		network string
		port    uint16
	}{{"tcp", tcpPort}, {"udp", udpPort}} {
		for i := range 20 {
			id, err := Who(timeout(t, 3*time.Second), l.client.Handle, tc.network, netip.AddrPortFrom(tunnelIP, tc.port), 40000)
			if err != nil {
				t.Fatalf("%s flow %d: %v", tc.network, i, err)
			}
			if id.Peer != netip.AddrPortFrom(clientAddr.Addr(), 40000) {
				t.Fatalf("%s flow %d: peer %s, want source port 40000", tc.network, i, id.Peer)
			}
		}
	}
	// A TIME_WAIT or a SYN retransmission would cost a second per flow.
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("40 flows took %v", d)
	}
}

func TestWhoWithoutListenerFails(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	for _, network := range []string{"tcp", "udp"} {
		_, err := Who(timeout(t, time.Second), l.client.Handle, network, netip.AddrPortFrom(tunnelIP, 9), 0)
		if err == nil {
			t.Errorf("%s WHO to a closed port succeeded", network)
		} else {
			t.Logf("%s: %v", network, err)
		}
	}
}

func TestUploadAndDownload(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	for _, vip := range []netip.Addr{tunnelIP, tunnelIP6} {
		dst := netip.AddrPortFrom(vip, tcpPort)
		id, err := Upload(timeout(t, 10*time.Second), l.client.Handle, dst, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if id.Pod != "pod-a" || id.Local != dst {
			t.Errorf("upload taken by %v", id)
		}
		if err := Download(timeout(t, 10*time.Second), l.client.Handle, dst, 1<<20); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDownloadDetectsBadData serves a corrupted and a truncated payload.
func TestDownloadDetectsBadData(t *testing.T) {
	l := newLab(t)
	const n = 100000
	for _, tc := range []struct {
		name    string
		mangle  func([]byte) []byte
		wantErr string
	}{
		{"corrupted", func(b []byte) []byte { b[n/2] ^= 1; return b }, "differs"},
		{"truncated", func(b []byte) []byte { return b[:n-1] }, "got 99999 bytes"},
		{"longer", func(b []byte) []byte { return append(b, 0) }, "more than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln := listenIn(t, l.pod.Handle)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				_, _ = c.Read(make([]byte, 64))
				b, _ := io.ReadAll(Payload(n))
				_, _ = c.Write(tc.mangle(b))
			}()
			dst := netip.AddrPortFrom(tunnelIP, uint16(ln.Addr().(*net.TCPAddr).Port))
			err := Download(timeout(t, 5*time.Second), l.client.Handle, dst, n)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("got %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}

func listenIn(t *testing.T, ns netns.NsHandle) net.Listener {
	t.Helper()
	var ln net.Listener
	if err := testnetns.RunOnDiscardedThread(func() error {
		if err := netns.Set(ns); err != nil {
			return err
		}
		var err error
		ln, err = net.Listen("tcp4", ":0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

func TestStreamEchoesEverything(t *testing.T) {
	l := newLab(t)
	srv := l.serve(t, "pod-a")
	s, err := StartStream(l.client.Handle, netip.AddrPortFrom(tunnelIP, tcpPort), 40001, StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if st := s.Stats(); st.Err != nil || st.Verified == 0 {
		t.Errorf("while running: %+v", st)
	}
	if want := netip.AddrPortFrom(clientAddr.Addr(), 40001); !slices.Equal(srv.Peers(), []netip.AddrPort{want}) {
		t.Errorf("server peers while streaming: %v, want [%v]", srv.Peers(), want)
	}
	st, err := s.Stop(timeout(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	// Stop's RST ends the server's side at once.
	for deadline := time.Now().Add(2 * time.Second); len(srv.Peers()) > 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if peers := srv.Peers(); len(peers) > 0 {
		t.Errorf("server peers after Stop: %v, want none", peers)
	}
	t.Logf("sent %d, verified %d", st.Sent, st.Verified)
	if st.Sent < 50<<10 || st.Verified != st.Sent {
		t.Errorf("got %+v, want ~100 KiB all verified", st)
	}
	// The same 4-tuple is usable again right away.
	if _, err := Who(timeout(t, 3*time.Second), l.client.Handle, "tcp", netip.AddrPortFrom(tunnelIP, tcpPort), 40001); err != nil {
		t.Fatal(err)
	}
}

func TestStreamFailsWhenServerCloses(t *testing.T) {
	l := newLab(t)
	srv := l.serve(t, "pod-a")
	s, err := StartStream(l.client.Handle, netip.AddrPortFrom(tunnelIP, tcpPort), 0, StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if st := s.Stats(); st.Err == nil {
		t.Errorf("Stats after the server closed: %+v, want an error", st)
	}
	st, err := s.Stop(timeout(t, 2*time.Second))
	if err == nil {
		t.Fatalf("Stop succeeded after the server closed: %+v", st)
	}
	t.Logf("%v", err)
}

// StopWithFIN ends the connection with both FINs, no RST: the client is
// left with a TIME_WAIT socket for the 4-tuple (a RST leaves none), and a
// connection from the same bound port opens again at once all the same.
func TestStreamStopWithFINLeavesTimeWaitAndThePortReusable(t *testing.T) {
	l := newLab(t)
	l.serve(t, "pod-a")
	dst := netip.AddrPortFrom(tunnelIP, tcpPort)
	for i := range 3 {
		s, err := StartStream(l.client.Handle, dst, 40002, StreamOptions{})
		if err != nil {
			t.Fatalf("connection %d on the same 4-tuple: %v", i, err)
		}
		time.Sleep(100 * time.Millisecond)
		st, err := s.StopWithFIN(timeout(t, 5*time.Second))
		if err != nil || st.Verified == 0 || st.Verified != st.Sent {
			t.Fatalf("connection %d: StopWithFIN = %+v, %v", i, st, err)
		}
		var table []byte
		if err := l.client.Do(func() error {
			var err error
			table, err = os.ReadFile("/proc/thread-self/net/tcp")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		// local_address :9C42 (40002), st 06 (TIME_WAIT).
		if !regexp.MustCompile(`(?m)^\s*\d+: [0-9A-F]{8}:9C42 [0-9A-F]{8}:[0-9A-F]{4} 06 `).Match(table) {
			t.Fatalf("connection %d: no TIME_WAIT socket from port 40002 after StopWithFIN:\n%s", i, table)
		}
	}
}
