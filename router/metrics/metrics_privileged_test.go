package metrics

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/support/promtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// kernelRouter is a Datapath on the real kernel of a test namespace whose
// seams are wrapped as the router's start-up wraps them, with counting seams
// beneath them to compare with.
type kernelRouter struct {
	dp     *datapath.Datapath
	routes *seamtest.CountingRoutes
	rules  *seamtest.CountingRules
	ipt    *testnetns.IPTables
	sets   *countingSets
}

// countingSets counts the ipset writes that succeeded.
type countingSets struct {
	hmark.IPSets
	writes int
}

func (c *countingSets) count(err error) error {
	if err == nil {
		c.writes++
	}
	return err
}

func (c *countingSets) IpsetCreate(name, typ string, o netlink.IpsetCreateOptions) error {
	return c.count(c.IPSets.IpsetCreate(name, typ, o))
}
func (c *countingSets) IpsetDestroy(name string) error { return c.count(c.IPSets.IpsetDestroy(name)) }
func (c *countingSets) IpsetAdd(name string, e *netlink.IPSetEntry) error {
	return c.count(c.IPSets.IpsetAdd(name, e))
}
func (c *countingSets) IpsetDel(name string, e *netlink.IPSetEntry) error {
	return c.count(c.IPSets.IpsetDel(name, e))
}

// meteredKernelRouter builds a kernelRouter in ns.
func meteredKernelRouter(t *testing.T, ns *testnetns.NS, cfg datapath.Config, m *Metrics) (*kernelRouter, *hmark.Chain) {
	t.Helper()
	rc := ns.Routes()
	nl := ns.Netlink()
	ipt := ns.IPTables("iptables")
	sets := &countingSets{IPSets: ns.IPSets()}
	chain, err := hmark.NewChain(countedIPTables{ipt, m}, countedIPSets{sets, m}, cfg.Chain,
		cfg.HMARKParams(), countedRestorer{ipt, m})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Generations > 1 {
		if err := chain.SetSticky(cfg.Sticky()); err != nil {
			t.Fatal(err)
		}
	}
	k := &kernelRouter{routes: &seamtest.CountingRoutes{Client: rc}, rules: &seamtest.CountingRules{Handle: nl}, ipt: ipt, sets: sets}
	k.dp = datapath.NewDatapath(cfg, countedRoutes{k.routes, m}, countedRules{k.rules, m}, chain, &datapath.ExistingDevice{Name: "veth0", Links: nl}, nil, seamtest.QuietLog())
	return k, chain
}

// sendUDP sends one datagram of payload bytes to vip:9 from each of the
// source ports, count times each, inside ns. The tunnel IP is on lo, so the
// datagrams come back in through lo and mangle PREROUTING, like forwarded
// packets, and a bound socket receives them (no ICMP error goes back).
func sendUDP(t *testing.T, ns *testnetns.NS, vip netip.Addr, ports []int, count, payload int) {
	t.Helper()
	err := ns.Do(func() error {
		rx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer func() { _ = unix.Close(rx) }()
		if err := unix.Bind(rx, &unix.SockaddrInet4{Addr: vip.As4(), Port: 9}); err != nil {
			return err
		}
		for _, port := range ports {
			tx, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer func() { _ = unix.Close(tx) }()
			if err := unix.Bind(tx, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: port}); err != nil {
				return err
			}
			for range count {
				if err := unix.Sendto(tx, make([]byte, payload), 0, &unix.SockaddrInet4{Addr: vip.As4(), Port: 9}); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("send datagrams to %s: %v", vip, err)
	}
}

func TestMetricsInNetns(t *testing.T) {
	t.Run("stateless: every packet is counted", func(t *testing.T) { testMetricsInNetns(t, 1) })
	t.Run("sticky: every packet is counted", func(t *testing.T) { testMetricsInNetns(t, 4) })
}

func testMetricsInNetns(t *testing.T, generations int) {
	vip, quiet := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	ns := testnetns.New(t, netip.PrefixFrom(vip, 32), netip.PrefixFrom(quiet, 32))
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	cfg := testConfig()
	cfg.Generations = generations
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	k, chain := meteredKernelRouter(t, ns, cfg, m)
	m.CollectVIPTraffic(chain, seamtest.QuietLog())
	g := promtest.WithText(reg, m.WriteText)

	if err := k.dp.Resync([]datapath.Tunnel{tunnel(cfg, vip.String(), "10.244.1.5", "10.244.2.6"), tunnel(cfg, quiet.String(), "10.244.3.7")}); err != nil {
		t.Fatal(err)
	}
	if err := k.dp.SetTunnel(tunnel(cfg, quiet.String(), "10.244.3.7", "10.244.4.8")); err != nil {
		t.Fatal(err)
	}

	t.Run("kernel operations are the writes the kernel seams saw", func(t *testing.T) {
		ops := kernelOps(t, reg)
		var routes, rules, ipt, sets float64
		for key, n := range ops {
			switch {
			case key == "iptables_rule/restore":
				// Rules written by a restore: the restore itself is the
				// one write iptables saw (iptables_chain/restore).
			case strings.HasPrefix(key, "route/"), strings.HasPrefix(key, "nexthop/"):
				routes += n // one seam for both
			case strings.HasPrefix(key, "rule/"):
				rules += n
			case strings.HasPrefix(key, "ipset"):
				sets += n
			default:
				ipt += n
			}
		}
		if routes != float64(k.routes.Writes) || rules != float64(k.rules.Writes) || ipt != float64(k.ipt.Writes) || sets != float64(k.sets.writes) {
			t.Errorf("metrics count %v routes, %v rules, %v iptables writes, %v ipset writes; the seams saw %d, %d, %d, %d (%v)",
				routes, rules, ipt, sets, k.routes.Writes, k.rules.Writes, k.ipt.Writes, k.sets.writes, ops)
		}
		if routes == 0 || rules == 0 || ipt == 0 || sets == 0 || ops["iptables_rule/restore"] == 0 || ops["nexthop/add"] == 0 {
			t.Errorf("some kind of write is missing, the comparison proves little: %v", ops)
		}
	})

	packets := func() map[string]float64 {
		return promtest.Series(t, g, "kube_service_tunnel_router_vip_packets_total")
	}
	bytes := func() map[string]float64 {
		return promtest.Series(t, g, "kube_service_tunnel_router_vip_bytes_total")
	}
	key := "vip=" + vip.String()
	p0, b0 := packets(), bytes()
	if _, ok := p0[key]; !ok {
		t.Fatalf("no counter for %s before any packet: %v", vip, p0)
	}

	const perFlow, payload = 5, 100
	ports := []int{40001, 40002, 40003}
	sendUDP(t, ns, vip, ports, perFlow, payload)
	p1, b1 := packets(), bytes()
	// Every datagram counts, in sticky mode too, where only each flow's
	// first one is hashed: the later ones restore the flow's decision.
	sent := float64(len(ports) * perFlow)
	if got := p1[key] - p0[key]; got != sent {
		t.Errorf("%s: %v packets counted for %v sent in %d flows, want %v", vip, got, sent, len(ports), sent)
	}
	if got, want := b1[key]-b0[key], sent*(20+8+payload); got != want {
		t.Errorf("%s: %v bytes counted, want %v", vip, got, want)
	}
	if got := p1["vip="+quiet.String()] - p0["vip="+quiet.String()]; got != 0 {
		t.Errorf("%s got %v packets, sent none", quiet, got)
	}
	t.Logf("generations %d: %v datagrams sent in %d flows, packets %v, bytes %v", generations, sent, len(ports), p1, b1)

	// A tunnel IP removed is gone from the counters at the next scrape;
	// it leaves the sets (see the kernel operations), and the tunnel IP
	// that stays keeps its counters.
	deletesBefore := kernelOps(t, reg)["ipset_member/delete"]
	if err := k.dp.RemoveTunnel(quiet); err != nil {
		t.Fatal(err)
	}
	p2, b2 := packets(), bytes()
	if _, ok := p2["vip="+quiet.String()]; ok {
		t.Errorf("removed %s still has counters: %v", quiet, p2)
	}
	if deletes := kernelOps(t, reg)["ipset_member/delete"] - deletesBefore; deletes != 2 {
		t.Errorf("removing %s deleted %v set members, want 2 (its generation's set and the set of all)", quiet, deletes)
	}
	if p2[key] != p1[key] || b2[key] != b1[key] {
		t.Errorf("%s after removing %s: %v packets, %v bytes; want them kept: %v, %v", vip, quiet, p2[key], b2[key], p1[key], b1[key])
	}

	// Counters gone with the chain and its sets: no series, no error.
	// Unreadable (a set of the router's name that is not the router's):
	// the scrape goes on, the error is counted.
	if err := chain.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := packets(); len(got) != 0 {
		t.Errorf("counters of a missing set: %v", got)
	}
	if err := ns.IPSets().IpsetCreate(cfg.Chain, "hash:net", netlink.IpsetCreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := packets(); len(got) != 0 {
		t.Errorf("counters of a foreign set: %v", got)
	}
	// Each scrape reads once: the one above and this one.
	if got := promtest.Series(t, g, "kube_service_tunnel_router_vip_counter_read_errors_total")[""]; got != 2 {
		t.Errorf("read errors %v, want 2", got)
	}
}
