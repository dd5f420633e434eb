package metrics

import (
	"io"
	"maps"
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// meteredTunnels returns metrics holding n tunnel IPs of 10 endpoints each
// (one draining), with their traffic counters.
func meteredTunnels(t *testing.T, n int) (*Metrics, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	counters := map[netip.Addr]hmark.Counter{}
	var tunnels []datapath.Tunnel
	for i := range n {
		vip := netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		tun := datapath.Tunnel{VIP: vip}
		for e := range 10 {
			ep := datapath.Endpoint{Addr: netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), byte(e)}), Draining: e == 9}
			tun.Present = append(tun.Present, ep)
			if !ep.Draining {
				for range 7 {
					tun.Table = append(tun.Table, ep)
				}
			}
		}
		tunnels = append(tunnels, tun)
		counters[vip] = hmark.Counter{Packets: uint64(i), Bytes: uint64(i) * 100}
	}
	m.SetTunnels(tunnels)
	m.CollectVIPTraffic(fakeCounters{counters: counters}, seamtest.QuietLog())
	return m, reg
}

// The text families parse as Prometheus parses them and hold every series
// with its value.
func TestWriteTextParses(t *testing.T) {
	m, reg := meteredTunnels(t, 300)
	g := promtest.WithText(reg, m.WriteText)
	eps := promtest.Series(t, g, "kube_service_tunnel_router_tunnel_endpoints")
	buckets := promtest.Series(t, g, "kube_service_tunnel_router_endpoint_buckets")
	packets := promtest.Series(t, g, "kube_service_tunnel_router_vip_packets_total")
	bytes := promtest.Series(t, g, "kube_service_tunnel_router_vip_bytes_total")
	if len(eps) != 600 || len(buckets) != 3000 || len(packets) != 300 || len(bytes) != 300 {
		t.Fatalf("series: %d endpoints, %d buckets, %d packets, %d bytes; want 600, 3000, 300, 300", len(eps), len(buckets), len(packets), len(bytes))
	}
	drops := promtest.Series(t, g, "kube_service_tunnel_router_port_dropped_packets_total")
	if len(drops) != 300 || drops["vip=198.18.1.2"] != float64(int(packets["vip=198.18.1.2"])/2) || packets["vip=198.18.1.2"] < 2 {
		t.Errorf("port drops: %d series, %v for 198.18.1.2 (packets %v); want 300 series, half the packets", len(drops), drops["vip=198.18.1.2"], packets["vip=198.18.1.2"])
	}
	want := map[string]float64{
		"state=ready,vip=198.18.1.2":    9,
		"state=draining,vip=198.18.1.2": 1,
	}
	for k, v := range want {
		if eps[k] != v {
			t.Errorf("%s = %v, want %v", k, eps[k], v)
		}
	}
	if got := buckets["endpoint=10.1.2.3,vip=198.18.1.2"]; got != 7 {
		t.Errorf("buckets of 10.1.2.3 = %v, want 7", got)
	}
	if got, ok := buckets["endpoint=10.1.2.9,vip=198.18.1.2"]; !ok || got != 0 {
		t.Errorf("buckets of the draining 10.1.2.9 = %v (exported %v), want 0", got, ok)
	}
	if got := packets["vip=198.18.1.2"]; got != 258 {
		t.Errorf("packets = %v, want 258", got)
	}
	if got := bytes["vip=198.18.1.2"]; got != 25800 {
		t.Errorf("bytes = %v, want 25800", got)
	}

	// Removed tunnel IPs are gone from the next scrape.
	m.RemoveTunnel(netip.MustParseAddr("198.18.1.2"))
	if got := promtest.Series(t, g, "kube_service_tunnel_router_tunnel_endpoints"); len(got) != 598 || maps.Equal(got, eps) {
		t.Errorf("after a removal: %d endpoint series, want 598", len(got))
	}
}

// The families come out in one order, by tunnel IP: two scrapes of the same
// state are the same text.
func TestWriteTextIsOrdered(t *testing.T) {
	m, _ := meteredTunnels(t, 50)
	var a, b strings.Builder
	if err := m.WriteText(&a); err != nil {
		t.Fatal(err)
	}
	if err := m.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	if a.String() != b.String() {
		t.Fatal("two scrapes of the same state differ")
	}
	first := strings.Index(a.String(), `vip="198.18.0.1"`)
	second := strings.Index(a.String(), `vip="198.18.0.2"`)
	if first < 0 || second < first {
		t.Fatalf("series not ordered by tunnel IP (198.18.0.1 at %d, 198.18.0.2 at %d)", first, second)
	}
}

// A scrape allocates the same whatever the number of series: a copy of
// the tunnel IP list and the counters' map, nothing per series. (Through
// the registry it was two objects per series: about 100 MB per scrape at
// 10,000 tunnel IPs.)
func TestWriteTextAllocationsDoNotGrowWithSeries(t *testing.T) {
	allocs := map[int]float64{}
	for _, n := range []int{10, 1000} {
		m, _ := meteredTunnels(t, n)
		allocs[n] = testing.AllocsPerRun(5, func() {
			if err := m.WriteText(io.Discard); err != nil {
				t.Fatal(err)
			}
		})
	}
	// The fake's map clone and the list copies are one allocation each
	// (a little more as they grow); the series must allocate nothing.
	if allocs[1000] > allocs[10]+5 {
		t.Errorf("a scrape allocates %v times with 10 tunnel IPs, %v with 1,000 (110 vs 11,000 series): something allocates per series", allocs[10], allocs[1000])
	}
	t.Logf("allocations per scrape: %v (10 tunnel IPs), %v (1,000)", allocs[10], allocs[1000])
}
