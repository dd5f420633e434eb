package rtnl

import (
	"bufio"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestCompareWithIPBatch measures Apply against "ip -batch" adding the same
// IP-encap routes into two fresh namespaces, in the same run. It only runs
// when RTNL_COMPARE_VIPS is set; each VIP gets one route in each of 64
// tables, pointing at one of 4 endpoints drawn from a pool of
// RTNL_COMPARE_PODS pods (default 64). With RTNL_COMPARE_NEXTHOPS=1 both
// tools first create one nexthop object per pod and the routes use them.
//
//	RTNL_COMPARE_VIPS=10000 go test -run CompareWithIPBatch -v -timeout 1h ./internal/rtnl/
//
// The kernel compares each new inline encap next hop with every distinct one
// already on the device, so large pods pools slow both tools down alike
// unless nexthop objects are used.
func TestCompareWithIPBatch(t *testing.T) {
	vips, _ := strconv.Atoi(os.Getenv("RTNL_COMPARE_VIPS"))
	if vips <= 0 {
		t.Skip("set RTNL_COMPARE_VIPS to run the measurement")
	}
	pods, _ := strconv.Atoi(os.Getenv("RTNL_COMPARE_PODS"))
	if pods <= 0 {
		pods = 64
	}
	useNextHops := os.Getenv("RTNL_COMPARE_NEXTHOPS") == "1"
	ipNS, applyNS := newTestNS(t), newTestNS(t)
	ops := benchOps(vips, 64, pods, applyNS.veth, useNextHops)

	batch := writeIPBatch(t, ops)
	start := time.Now()
	runIP(t, "-n", ipNS.name, "-batch", batch)
	ipTime := time.Since(start)

	c := applyNS.open(t)
	start = time.Now()
	if err := c.Apply(ops); err != nil {
		t.Fatalf("Apply: %v", err)
	}
	applyTime := time.Since(start)

	start = time.Now()
	listed, err := c.List(ListFilter{Tables: TableRange{7600, 7663}, Protocol: benchProtocol})
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	listTime := time.Since(start)
	routes := vips * 64
	if len(listed) != routes {
		t.Errorf("listed %d routes, want %d", len(listed), routes)
	}
	t.Logf("%d routes, %d pods, nexthop objects %v: ip -batch %v (%.0f routes/s), Apply %v (%.0f routes/s), ratio %.2f; List %v",
		routes, pods, useNextHops, ipTime, rate(routes, ipTime), applyTime, rate(routes, applyTime),
		applyTime.Seconds()/ipTime.Seconds(), listTime)
}

const benchProtocol = 200

// benchOps models the router: vips tunnel IPs, one route per bucket table,
// each bucket pointing at one of 4 endpoints of its VIP; endpoints are
// drawn from a pool of pods. With nexthops, nexthop objects 1..pods come
// first and routes refer to them.
func benchOps(vips, tables, pods, link int, nexthops bool) []Op {
	const endpointsPerVIP = 4
	podAddr := func(p int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(p >> 8), byte(p)}) }
	var ops []Op
	if nexthops {
		for p := range pods {
			ops = append(ops, Op{Kind: ReplaceNextHop, NextHop: NextHop{
				ID: uint32(p + 1), Protocol: benchProtocol, LinkIndex: link,
				IPEncap: &IPEncap{Dst: podAddr(p), TTL: 64},
			}})
		}
	}
	for t := range tables {
		for v := range vips {
			pod := (v*endpointsPerVIP + t%endpointsPerVIP) % pods
			r := Route{
				Table:    uint32(7600 + t),
				Dst:      netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 96, byte(v >> 8), byte(v)}), 32),
				Type:     Unicast,
				Protocol: benchProtocol,
			}
			if nexthops {
				r.NextHopID = uint32(pod + 1)
			} else {
				r.LinkIndex, r.IPEncap = link, &IPEncap{Dst: podAddr(pod), TTL: 64}
			}
			ops = append(ops, Op{Kind: Replace, Route: r})
		}
	}
	return ops
}

// writeIPBatch writes the same changes as an "ip -batch" file.
func writeIPBatch(t *testing.T, ops []Op) string {
	path := filepath.Join(t.TempDir(), "routes.batch")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(f)
	for _, op := range ops {
		switch r, n := op.Route, op.NextHop; {
		case op.Kind == ReplaceNextHop:
			fmt.Fprintf(w, "nexthop add id %d encap ip id 0 dst %s ttl 64 dev veth0 proto %d\n", n.ID, n.IPEncap.Dst, n.Protocol)
		case r.NextHopID != 0:
			fmt.Fprintf(w, "route add %s nhid %d table %d proto %d\n", r.Dst, r.NextHopID, r.Table, r.Protocol)
		default:
			fmt.Fprintf(w, "route add %s encap ip id 0 dst %s ttl 64 dev veth0 table %d proto %d\n",
				r.Dst, r.IPEncap.Dst, r.Table, r.Protocol)
		}
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func rate(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }
