package integration

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/test/bgppeer"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The second datacenter router of TestBGPRouterIsNoTransit, in its own AS
// on the same bridge:
//
//	peer A 198.51.100.1 (AS 64500) ── br0 ──┬── router a 198.51.100.2 (AS 64512)
//	peer B 198.51.100.4 (AS 64501) ─────────┘
var bgpPeerB = netip.MustParseAddr("198.51.100.4")

const bgpPeerBASN = 64501

// floodRoutes are n host routes of 10.64.0.0/16 and 203.0.113.0/24: what
// a datacenter router sending its whole table, or a hostile one, sends.
func floodRoutes(n int) []netip.Prefix {
	routes := []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}
	for i := range n {
		routes = append(routes, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 64, byte(i >> 8), byte(i)}), 32))
	}
	return routes
}

// TestBGPRouterIsNoTransit: router a peers with two BIRD 2 routers in
// different ASes. Peer A sends 10,001 routes; peer B must learn nothing
// from router a but the tunnel IP, whatever A sends (GoBGP, like any BGP
// speaker, re-advertises what it learns unless a policy says otherwise),
// and router a's memory must not grow with what A sends: with the default
// maxPrefixes (1000) the session with A closes at the limit. Without a
// limit (maxPrefixes: 0) the router keeps A's routes in its Adj-RIB-In,
// rejected by its import policy; the test prints both RSS figures.
func TestBGPRouterIsNoTransit(t *testing.T) {
	const sent = 10_000
	lab := newBGPLab(t, peerOptions{originate: floodRoutes(sent)}, "192.0.2.62", nil)
	vip, pool := lab.vip, netip.MustParsePrefix("192.0.2.0/24") // bgpPools' IPv4 pool
	peerB := startSecondPeer(t, lab)
	lab.setEndpoint(t, "10.244.1.5", true)
	peers := fmt.Sprintf("- address: %v\n  asn: %d\n  holdTime: 3s\n  keepaliveTime: 1s\n  connectRetry: 1s\n", bgpPeerB, bgpPeerBASN)

	rss := map[string]string{}
	for _, run := range []struct{ name, limit string }{
		{"no limit", "  maxPrefixes: 0\n"},
		{"default limit", ""},
	} {
		start := time.Now()
		a := lab.startRouterProcess(t, "a", routerBGPConfig("")+run.limit+peers)
		peerB.WaitKernelNextHops(t, vip, start, 30*time.Second, bgpRouterA)
		if run.limit != "" {
			// A's 10,001 routes arrive; wait until router a holds them.
			bgppeer.Poll(t, start, time.Minute, "peer A's routes sent to router a", func() (bool, string) {
				n, err := protocolStat(lab.peer, "router_a", "Export updates:")
				return err == nil && n >= sent, fmt.Sprintf("%d exported (%v)", n, err)
			})
			time.Sleep(2 * time.Second) // what router a would re-advertise, it has
		} else {
			bgppeer.Poll(t, start, time.Minute, "router a closing the session with peer A at its limit", func() (bool, string) {
				m := a.metrics(t)
				v := metric(m, fmt.Sprintf(`kube_service_tunnel_bgp_prefix_limit_closes_total{peer="%v"}`, bgpPeerAddr))
				return v != "" && v != "0", grepLines(m, "kube_service_tunnel_bgp_")
			})
			up, state, err := lab.peer.Established("router_a")
			if err != nil || up {
				t.Errorf("peer A's session with router a: up %v (%s, %v), want closed by router a's prefix limit", up, state, err)
			}
			t.Logf("%s: peer A's session with router a: %s", run.name, state)
			if !strings.Contains(a.log.String(), "peers[].maxPrefixes") {
				t.Errorf("router a did not log the prefix limit naming the field:\n%s", lastLines(a.log.String(), 20))
			}
		}
		rss[run.name] = processRSS(t, a.cmd.Process.Pid)
		// B learned tunnel IPs from router a (this test's, and those of
		// the other tests' Services on the same API server), each once,
		// and nothing else, ever.
		received, err := protocolStat(peerB, "router_a", "Import updates:")
		if err != nil {
			t.Fatal(err)
		}
		held, out := routesFrom(t, peerB, "router_a")
		if received != len(held) || !slices.Contains(held, vip) {
			t.Errorf("%s: peer B received %d route updates from router a and holds %d routes from it, want each of its tunnel IPs (%v among them) once; its routes from router a:\n%s", run.name, received, len(held), vip, out)
		}
		for _, p := range held {
			if !pool.Contains(p.Addr()) || !p.IsSingleIP() {
				t.Errorf("%s: peer B holds %v from router a, not a tunnel IP of its pool %v", run.name, p, pool)
			}
		}
		for _, p := range []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("10.64.0.1/32")} {
			if routes, err := peerB.Routes(p); err != nil || len(routes) != 0 {
				t.Errorf("%s: peer B learned %v from peer A through router a: %v %v", run.name, p, routes, err)
			}
		}
		t.Logf("%s: peer A sent %d routes; peer B received %d from router a, each a tunnel IP; router a's RSS %s", run.name, sent+1, received, rss[run.name])
		if err := a.stop(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("router a's RSS with a peer sending %d routes: %s without a limit, %s with the default maxPrefixes (1000)", sent+1, rss["no limit"], rss["default limit"])
}

// startSecondPeer starts peer B: BIRD in its own namespace on the lab's
// bridge, peering with router a only, importing all it is sent.
func startSecondPeer(t *testing.T, lab *bgpLab) *bgppeer.Peer {
	t.Helper()
	ns := testnetns.New(t)
	nl := lab.peerNS.Netlink()
	port := lab.peerNS.AddVeth("port_pb", "eth_pb", netip.Prefix{})
	l, err := nl.LinkByIndex(port)
	if err != nil {
		t.Fatal(err)
	}
	br, err := nl.LinkByName("br0")
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetMaster(l, br.(*netlink.Bridge)); err != nil {
		t.Fatal(err)
	}
	moveLink(t, lab.peerNS, ns, "eth_pb", netip.PrefixFrom(bgpPeerB, 24))
	return bgppeer.Start(t, ns, bgppeer.Config{RouterID: bgpPeerB, ASN: bgpPeerBASN, Neighbors: []bgppeer.Neighbor{{
		Name: "router_a", Address: bgpRouterA, ASN: bgpRouterASN, HoldTime: 3 * time.Second, KeepaliveTime: time.Second,
	}}})
}

// protocolStat reads, from BIRD's "show protocols all NAME", the first
// column of the IPv4 channel's row that starts with row: for "Import
// updates:" the updates received from the neighbour, for "Export
// updates:" those the table offered to it.
func protocolStat(p *bgppeer.Peer, name, row string) (int, error) {
	out, err := p.Birdc("show", "protocols", "all", name)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), row); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			return strconv.Atoi(f[0])
		}
	}
	return 0, fmt.Errorf("no %q row in:\n%s", row, out)
}

// routesFrom returns the prefixes BIRD holds from protocol name, and the
// listing they came from.
func routesFrom(t *testing.T, p *bgppeer.Peer, name string) ([]netip.Prefix, string) {
	t.Helper()
	out, err := p.Birdc("show", "route", "protocol", name)
	if err != nil {
		t.Fatal(err)
	}
	var held []netip.Prefix
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			if prefix, err := netip.ParsePrefix(f[0]); err == nil {
				held = append(held, prefix)
			}
		}
	}
	return held, out
}

// processRSS is a process's resident set, as /proc reports it.
func processRSS(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}
