package bgp

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"
	"github.com/sirupsen/logrus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestDiff(t *testing.T) {
	a, b, c := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("192.0.2.3")
	announce, withdraw := Diff(map[netip.Addr]bool{a: true, b: true}, map[netip.Addr]bool{b: true, c: true})
	if !slices.Equal(announce, []netip.Addr{a}) || !slices.Equal(withdraw, []netip.Addr{c}) {
		t.Fatalf("announce %v withdraw %v", announce, withdraw)
	}
	if x, y := Diff(map[netip.Addr]bool{a: true}, map[netip.Addr]bool{a: true}); len(x)+len(y) != 0 {
		t.Fatalf("no change gave %v %v", x, y)
	}
}

// loopbackPeer is a GoBGP speaker on 127.0.0.2 standing in for a datacenter
// router (the integration tests use a real bird2).
type loopbackPeer struct {
	s    *server.BgpServer
	port int
}

func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("127.0.0.2 not usable: %v", err)
	}
	defer ln.Close()
	_, p, _ := net.SplitHostPort(ln.Addr().String())
	port, _ := strconv.Atoi(p)
	return port
}

func newLoopbackPeer(t *testing.T) *loopbackPeer {
	port := freePort(t)
	s := server.NewBgpServer()
	go s.Serve()
	ctx := context.Background()
	if err := s.StartBgp(ctx, &api.StartBgpRequest{Global: &api.Global{Asn: 64500, RouterId: "127.0.0.2",
		ListenPort: int32(port), ListenAddresses: []string{"127.0.0.2"}}}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddPeer(ctx, &api.AddPeerRequest{Peer: &api.Peer{
		Conf:      &api.PeerConf{NeighborAddress: "127.0.0.1", PeerAsn: 64512},
		Transport: &api.Transport{PassiveMode: true},
	}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.StopBgp(ctx, &api.StopBgpRequest{}) })
	return &loopbackPeer{s: s, port: port}
}

// routes returns the peer's prefixes and their next hops.
func (p *loopbackPeer) routes(t *testing.T) map[string]string {
	out := map[string]string{}
	err := p.s.ListPath(apiutil.ListPathRequest{TableType: api.TableType_TABLE_TYPE_GLOBAL, Family: bgp.RF_IPv4_UC},
		func(prefix bgp.NLRI, paths []*apiutil.Path) {
			for _, path := range paths {
				for _, a := range path.Attrs {
					if nh, ok := a.(*bgp.PathAttributeNextHop); ok {
						out[prefix.String()] = nh.Value.String()
					}
				}
			}
		})
	if err != nil {
		t.Fatal(err)
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
