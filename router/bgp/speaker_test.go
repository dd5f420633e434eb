package bgp

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"
	"github.com/sirupsen/logrus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// loopbackPeer is a GoBGP speaker on a loopback address standing in for a
// datacenter router (the integration tests use a real bird2): on 127.0.0.2,
// peering with 127.0.0.1, or on ::1, peering with ::1.
type loopbackPeer struct {
	s    *server.BgpServer
	addr string
	port int
}

func freePort(t *testing.T, addr string) int {
	ln, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Skipf("%s not usable: %v", addr, err)
	}
	defer ln.Close()
	_, p, _ := net.SplitHostPort(ln.Addr().String())
	port, _ := strconv.Atoi(p)
	return port
}

func newLoopbackPeer(t *testing.T) *loopbackPeer {
	return newLoopbackPeerOn(t, "127.0.0.2", "127.0.0.1")
}

// newLoopbackPeerOn starts a peer listening on addr that accepts a session
// from the speaker at neighbor.
func newLoopbackPeerOn(t *testing.T, addr, neighbor string) *loopbackPeer {
	port := freePort(t, addr)
	s := server.NewBgpServer()
	go s.Serve()
	ctx := context.Background()
	routerID := "127.0.0.2"
	if netip.MustParseAddr(addr).Is6() {
		routerID = "127.0.0.3"
	}
	if err := s.StartBgp(ctx, &api.StartBgpRequest{Global: &api.Global{Asn: 64500, RouterId: routerID,
		ListenPort: int32(port), ListenAddresses: []string{addr}}}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddPeer(ctx, &api.AddPeerRequest{Peer: &api.Peer{
		Conf:      &api.PeerConf{NeighborAddress: neighbor, PeerAsn: 64512},
		Transport: &api.Transport{PassiveMode: true},
	}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.StopBgp(ctx, &api.StopBgpRequest{}) })
	return &loopbackPeer{s: s, addr: addr, port: port}
}

// routes returns the peer's prefixes of both families and their next hops.
func (p *loopbackPeer) routes(t *testing.T) map[string]string {
	out := map[string]string{}
	for _, family := range []bgp.Family{bgp.RF_IPv4_UC, bgp.RF_IPv6_UC} {
		err := p.s.ListPath(apiutil.ListPathRequest{TableType: api.TableType_TABLE_TYPE_GLOBAL, Family: family},
			func(prefix bgp.NLRI, paths []*apiutil.Path) {
				for _, path := range paths {
					for _, a := range path.Attrs {
						switch a := a.(type) {
						case *bgp.PathAttributeNextHop:
							out[prefix.String()] = a.Value.String()
						case *bgp.PathAttributeMpReachNLRI:
							out[prefix.String()] = a.Nexthop.String()
						}
					}
				}
			})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func waitRoutes(t *testing.T, p *loopbackPeer, want map[string]string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := p.routes(t)
		if fmt.Sprint(got) == fmt.Sprint(want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("peer has %v, want %v", got, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestSpeakerAnnouncesWithdrawsAndWithdrawsOnShutdown(t *testing.T) {
	peer := newLoopbackPeer(t)
	log := logrus.New()
	log.Out = io.Discard
	retry := 1
	cfg := Config{ASN: 64512, Peers: []Peer{{Address: "127.0.0.2", ASN: 64500, Port: uint16(peer.port), SourceAddress: "127.0.0.1",
		ConnectRetry: durationOf(time.Duration(retry) * time.Second)}}, WithdrawDelay: durationOf(500 * time.Millisecond)}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	sp := NewSpeaker(cfg, log, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sp.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	vip1, vip2 := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	sp.Announce([]netip.Addr{vip1, vip2})
	time.Sleep(300 * time.Millisecond)
	// No session before the node is known.
	if got := peer.routes(t); len(got) != 0 {
		t.Fatalf("announced before the node was known: %v", got)
	}
	sp.SetNode(Node{Name: "n1", Address: netip.MustParseAddr("198.51.100.7")})
	waitRoutes(t, peer, map[string]string{"192.0.2.1/32": "198.51.100.7", "192.0.2.2/32": "198.51.100.7"})

	sp.Announce([]netip.Addr{vip2})
	waitRoutes(t, peer, map[string]string{"192.0.2.2/32": "198.51.100.7"})
	sp.Announce(nil)
	waitRoutes(t, peer, map[string]string{})
	sp.Announce([]netip.Addr{vip2})
	waitRoutes(t, peer, map[string]string{"192.0.2.2/32": "198.51.100.7"})

	// On shutdown the routes must go while the session is still up (a
	// withdrawal, not the session's end).
	cancel()
	deadline := time.Now().Add(10 * time.Second)
	for len(peer.routes(t)) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("routes not withdrawn on shutdown")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !peer.established(t) {
		t.Fatal("the session closed before the routes were withdrawn")
	}
	<-done
	deadline = time.Now().Add(5 * time.Second)
	for peer.established(t) {
		if time.Now().After(deadline) {
			t.Fatal("the session is still up 5 s after Run returned")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *loopbackPeer) established(t *testing.T) bool {
	up := false
	if err := p.s.ListPeer(context.Background(), &api.ListPeerRequest{}, func(peer *api.Peer) {
		up = up || peer.State.SessionState == api.PeerState_SESSION_STATE_ESTABLISHED
	}); err != nil {
		t.Fatal(err)
	}
	return up
}

func durationOf(d time.Duration) *metav1.Duration { return &metav1.Duration{Duration: d} }

func TestAPIPeerTimersAndBFD(t *testing.T) {
	log := logrus.New()
	log.Out = io.Discard
	cases := []struct {
		name          string
		peer          Peer
		wantRetry     uint64
		wantBFDMicros uint32
	}{
		{name: "defaults", peer: Peer{Address: "192.0.2.1", ASN: 64500}, wantRetry: 5},
		{name: "connectRetry 2s, BFD 300ms", peer: Peer{Address: "192.0.2.1", ASN: 64500, ConnectRetry: durationOf(2 * time.Second),
			BFD: &BFD{MinInterval: durationOf(300 * time.Millisecond), Multiplier: 3}}, wantRetry: 2, wantBFDMicros: 300000},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sp := NewSpeaker(Config{ASN: 64512, Peers: []Peer{tc.peer}}, log, nil)
			conf, err := sp.apiPeer(tc.peer)
			if err != nil {
				t.Fatal(err)
			}
			timers := conf.Timers.Config
			if timers.ConnectRetry != tc.wantRetry || timers.IdleHoldTimeAfterReset != tc.wantRetry {
				t.Errorf("connectRetry %d, idleHoldTimeAfterReset %d; want both %d (a BFD reset must not idle for GoBGP's 30 s)",
					timers.ConnectRetry, timers.IdleHoldTimeAfterReset, tc.wantRetry)
			}
			if got := conf.GetBfd().GetDesiredMinimumTxInterval(); got != tc.wantBFDMicros {
				t.Errorf("BFD tx interval %d µs, want %d", got, tc.wantBFDMicros)
			}
		})
	}
}

// syncBuffer is a log output the test reads while the speaker writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// A dual-stack set of tunnel IPs: each goes to the peer of its family with
// the next hop of its family. Without an IPv6 next hop the IPv6 tunnel IP
// is not announced (said once) while the IPv4 one is; the node's new IPv6
// address re-announces it without restarting BGP; the node's new IPv4
// address, the router ID, restarts BGP.
func TestSpeakerAnnouncesEachFamilyWithItsNextHop(t *testing.T) {
	peer4 := newLoopbackPeer(t)
	peer6 := newLoopbackPeerOn(t, "::1", "::1")
	out := &syncBuffer{}
	log := logrus.New()
	log.Out = out
	retry := durationOf(time.Second)
	cfg := Config{ASN: 64512, Peers: []Peer{
		{Address: "127.0.0.2", ASN: 64500, Port: uint16(peer4.port), SourceAddress: "127.0.0.1", ConnectRetry: retry},
		{Address: "::1", ASN: 64500, Port: uint16(peer6.port), SourceAddress: "::1", ConnectRetry: retry},
	}, WithdrawDelay: durationOf(0)}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	sp := NewSpeaker(cfg, log, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sp.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	sp.Announce([]netip.Addr{v4a, v6a})
	sp.SetNode(Node{Name: "n1", Address: nh4})
	waitRoutes(t, peer4, map[string]string{"192.0.2.1/32": nh4.String()})
	deadline := time.Now().Add(20 * time.Second)
	for !peer6.established(t) {
		if time.Now().After(deadline) {
			t.Fatal("no session with the IPv6 peer")
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	if got := peer6.routes(t); len(got) != 0 {
		t.Fatalf("without an IPv6 next hop the IPv6 peer got %v", got)
	}
	sp.Announce([]netip.Addr{v4a, v4b, v6a}) // another reconcile, same missing next hop
	waitRoutes(t, peer4, map[string]string{"192.0.2.1/32": nh4.String(), "192.0.2.2/32": nh4.String()})
	if n := strings.Count(out.String(), "set nextHopIPv6 in the BGP configuration"); n != 1 {
		t.Errorf("the missing IPv6 next hop was logged %d times, want once:\n%s", n, out.String())
	}

	sp.SetNode(Node{Name: "n1", Address: nh4, AddressIPv6: nh6})
	waitRoutes(t, peer6, map[string]string{"2001:db8:5::1/128": nh6.String()})
	moved6 := netip.MustParseAddr("2001:db8:100::8")
	sp.SetNode(Node{Name: "n1", Address: nh4, AddressIPv6: moved6})
	waitRoutes(t, peer6, map[string]string{"2001:db8:5::1/128": moved6.String()})
	// Each family stays on its own session.
	waitRoutes(t, peer4, map[string]string{"192.0.2.1/32": nh4.String(), "192.0.2.2/32": nh4.String()})
	if n := strings.Count(out.String(), "BGP speaker started"); n != 1 {
		t.Errorf("BGP started %d times, want once: a new IPv6 next hop must not restart it", n)
	}

	moved4 := netip.MustParseAddr("198.51.100.8")
	sp.SetNode(Node{Name: "n1", Address: moved4, AddressIPv6: moved6})
	waitRoutes(t, peer4, map[string]string{"192.0.2.1/32": moved4.String(), "192.0.2.2/32": moved4.String()})
	waitRoutes(t, peer6, map[string]string{"2001:db8:5::1/128": moved6.String()})
	if !strings.Contains(out.String(), "router_id=198.51.100.8") || strings.Count(out.String(), "BGP speaker started") != 2 {
		t.Errorf("a new node IPv4 address (the router ID) must restart BGP with it:\n%s", out.String())
	}

	sp.Announce([]netip.Addr{v4a, v4b})
	waitRoutes(t, peer6, map[string]string{})
	waitRoutes(t, peer4, map[string]string{"192.0.2.1/32": moved4.String(), "192.0.2.2/32": moved4.String()})
}

func TestAPIPeerFamilies(t *testing.T) {
	log := logrus.New()
	log.Out = io.Discard
	for _, tc := range []struct {
		addr string
		gr   bool
		want []string
	}{
		{"192.0.2.1", false, []string{"AFI_IP/SAFI_UNICAST", "AFI_IP6/SAFI_UNICAST"}},
		{"2001:db8::1", false, []string{"AFI_IP6/SAFI_UNICAST"}},
		{"2001:db8::1", true, []string{"AFI_IP6/SAFI_UNICAST+gr"}},
		{"192.0.2.1", true, []string{"AFI_IP/SAFI_UNICAST+gr", "AFI_IP6/SAFI_UNICAST+gr"}},
	} {
		cfg := Config{ASN: 64512, Peers: []Peer{{Address: tc.addr, ASN: 64500}}}
		if tc.gr {
			cfg.GracefulRestart = &GracefulRestart{Enabled: true}
		}
		conf, err := NewSpeaker(cfg, log, nil).apiPeer(cfg.Peers[0])
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, a := range conf.AfiSafis {
			f := a.Config.Family.Afi.String() + "/" + a.Config.Family.Safi.String()
			if a.MpGracefulRestart.GetConfig().GetEnabled() {
				f += "+gr"
			}
			got = append(got, f)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("peer %s (graceful restart %v): families %v, want %v", tc.addr, tc.gr, got, tc.want)
		}
		if tc.gr && !conf.GracefulRestart.GetEnabled() {
			t.Errorf("peer %s: graceful restart not enabled", tc.addr)
		}
	}
}

// The limit of what a peer may send, per family: 1000 by default, none
// with maxPrefixes 0, the given one otherwise.
func TestAPIPeerPrefixLimits(t *testing.T) {
	log := logrus.New()
	log.Out = io.Discard
	zero, fifty := uint32(0), uint32(50)
	for _, tc := range []struct {
		name  string
		limit *uint32
		want  uint32 // 0: no PrefixLimits
	}{{"default", nil, DefaultMaxPrefixes}, {"maxPrefixes 0", &zero, 0}, {"maxPrefixes 50", &fifty, 50}} {
		peer := Peer{Address: "192.0.2.1", ASN: 64500, MaxPrefixes: tc.limit}
		conf, err := NewSpeaker(Config{ASN: 64512, Peers: []Peer{peer}}, log, nil).apiPeer(peer)
		if err != nil {
			t.Fatal(err)
		}
		if len(conf.AfiSafis) != 2 {
			t.Fatalf("%s: %d families, want IPv4 and IPv6", tc.name, len(conf.AfiSafis))
		}
		for _, a := range conf.AfiSafis {
			got := a.GetPrefixLimits().GetMaxPrefixes()
			if got != tc.want || (tc.want == 0) != (a.PrefixLimits == nil) {
				t.Errorf("%s: %v limit %d (set %v), want %d", tc.name, a.Config.Family, got, a.PrefixLimits != nil, tc.want)
			}
			if a.PrefixLimits != nil && a.PrefixLimits.Family.Afi != a.Config.Family.Afi {
				t.Errorf("%s: the limit's family %v is not the channel's %v", tc.name, a.PrefixLimits.Family, a.Config.Family)
			}
		}
	}
}
