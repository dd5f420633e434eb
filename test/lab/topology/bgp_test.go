package topology

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/router/bgp"
)

func testLab() *Lab {
	return &Lab{Routers: []*Node{
		{Host: Host{Name: "router-a", Addr: fabricAddr(11), Addr6: fabricAddr6(11)}, Tunnel: true},
		{Host: Host{Name: "router-b", Addr: fabricAddr(12), Addr6: fabricAddr6(12)}, Tunnel: true},
	}}
}

// BIRD itself parses the gateway's configuration (bird -p), when installed.
// Its IPv4 sessions carry IPv6 routes too, which a kernel6 protocol
// installs.
func TestBirdConfigParses(t *testing.T) {
	conf, err := testLab().birdConfig()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"protocol bgp router_a {", "neighbor 172.20.0.12 as 64512;", "merge paths on;", "passive on;", "[ 192.0.2.0/24{32,32} ]",
		"protocol kernel kernel6 {", "\tipv6 { import where net ~ [ 2001:db8:2::/64{128,128} ]; export none; };"} {
		if !strings.Contains(conf, want) {
			t.Errorf("configuration lacks %q:\n%s", want, conf)
		}
	}
	if _, err := exec.LookPath("bird"); err != nil {
		t.Skipf("bird not installed (apt-get install bird2): %v", err)
	}
	path := filepath.Join(t.TempDir(), "bird.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("bird", "-p", "-c", path).CombinedOutput(); err != nil {
		t.Fatalf("bird -p rejects the configuration: %v: %s\n%s", err, out, conf)
	}
}

func TestRouterBGPConfig(t *testing.T) {
	data, err := testLab().routerBGPConfig()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := bgp.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ASN != RouterASN || len(cfg.Peers) != 1 || cfg.Peers[0].Address != GatewayAddr.String() || cfg.Peers[0].ASN != GatewayASN || cfg.WithdrawWait() != BGPWithdrawDelay {
		t.Errorf("unexpected configuration:\n%s", data)
	}
}

func TestParseRouteGets(t *testing.T) {
	vip := netip.MustParseAddr("192.0.2.10")
	const out = `192.0.2.10 from 198.51.100.10 via 172.20.0.11 dev fabric 
    cache iif client 
192.0.2.10 from 198.51.100.10 via 172.20.0.12 dev fabric 
    cache iif client 
`
	got, err := parseRouteGets(out, vip, []uint16{1000, 1001})
	if err != nil {
		t.Fatal(err)
	}
	if got[1000] != netip.MustParseAddr("172.20.0.11") || got[1001] != netip.MustParseAddr("172.20.0.12") {
		t.Errorf("got %v", got)
	}
	if _, err := parseRouteGets(out, vip, []uint16{1000}); err == nil {
		t.Error("two answers for one flow were accepted")
	}
}

func TestFlowsFrom(t *testing.T) {
	vip, other := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("192.0.2.11")
	entries := []ConntrackEntry{
		{Proto: "tcp", Src: ClientAddr, Dst: vip, SrcPort: 48301, DstPort: 80},
		{Proto: "tcp", Src: ClientAddr, Dst: other, SrcPort: 48302, DstPort: 80},
		{Proto: "udp", Src: ClientAddr, Dst: vip, SrcPort: 48303, DstPort: 53},
		{Proto: "tcp", Src: vip, Dst: ClientAddr, SrcPort: 80, DstPort: 48305},
		{Proto: "tcp", Src: ClientAddr, Dst: vip, SrcPort: 48304, DstPort: 80},
		{Proto: "tcp", Src: ClientAddr, Dst: vip, SrcPort: 48306, DstPort: 80, HasCounters: true, Packets: 3},
		// conntrackd's copy of another router's entry: no packet yet
		{Proto: "tcp", Src: ClientAddr, Dst: vip, SrcPort: 48307, DstPort: 80, HasCounters: true},
	}
	got := flowsFrom(entries, ClientAddr, vip)
	if len(got) != 3 || !got[48301] || !got[48304] || !got[48306] {
		t.Errorf("got %v, want ports 48301, 48304 and 48306", got)
	}
}
