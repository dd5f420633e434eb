package routerstatus

import (
	"context"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	r := Router{
		Node: "router-a", Pod: "tunnel-router-x", Version: "v1.2.3", Mode: encap.MPLS, Buckets: 64, Generations: 4,
		MarkOffset: 0x1000, TableBase: 7600, SeedFingerprint: "abc123", BGP: true,
		Updated: time.Date(2026, 11, 26, 10, 0, 0, 0, time.UTC),
		Policy: &tunnelclaim.Policy{
			Pools: tunnelclaim.Pools{
				{Prefix: netip.MustParsePrefix("192.0.2.0/24")},
				{Prefix: netip.MustParsePrefix("2001:db8:2::/64"), Namespaces: []string{"team-a", "team-b"}},
			},
			PodCIDRs:     []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:10:244::/56")},
			ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")},
		},
		Tunnels: []Tunnel{
			{VIP: netip.MustParseAddr("192.0.2.20"), Generation: 2, Table: "deadbeef", Endpoints: 3, Draining: 1, Announced: true, ClientAffinity: true},
			{VIP: netip.MustParseAddr("192.0.2.3"), Generation: 0},
		},
	}
	cm := r.ConfigMap("kube-service-tunnel", nil)
	if cm.Name != "tunnel-router-status-router-a" || cm.Labels[ComponentLabel] != ComponentValue {
		t.Errorf("name %s labels %v", cm.Name, cm.Labels)
	}
	got, err := Parse(cm)
	if err != nil {
		t.Fatal(err)
	}
	want := r
	want.Tunnels = []Tunnel{r.Tunnels[1], r.Tunnels[0]} // sorted by address
	if !reflect.DeepEqual(got, want) {
		t.Errorf("round trip:\n got %+v\nwant %+v\n%s", got, want, cm.Data)
	}
	if tun, ok := got.Tunnel(netip.MustParseAddr("192.0.2.20")); !ok || tun.Generation != 2 {
		t.Errorf("Tunnel(192.0.2.20) = %+v, %t", tun, ok)
	}
	if _, ok := got.Tunnel(netip.MustParseAddr("192.0.2.4")); ok {
		t.Error("Tunnel found an address the router does not hold")
	}
	if got.Slot(2, 5) != 133 {
		t.Errorf("Slot(2, 5) = %d with 64 buckets", got.Slot(2, 5))
	}
}

func TestParseNamesBadLine(t *testing.T) {
	cm := Router{Node: "r"}.ConfigMap("ns", nil)
	cm.Data[TunnelsKey] = "192.0.2.1 generation=0\n192.0.2.x generation=1\n"
	if _, err := Parse(cm); err == nil || !strings.Contains(err.Error(), `"tunnels" line 2`) {
		t.Errorf("Parse of a bad address: %v", err)
	}
	cm.Data[TunnelsKey] = "192.0.2.1 generation=zero\n"
	if _, err := Parse(cm); err == nil || !strings.Contains(err.Error(), "generation") {
		t.Errorf("Parse of a bad generation: %v", err)
	}
	cm = Router{Node: "r"}.ConfigMap("ns", nil)
	if r, err := Parse(cm); err != nil || r.Policy != nil {
		t.Errorf("Parse of a status without pools: policy %+v, %v; want none (an older router's)", r.Policy, err)
	}
	cm.Data[RouterKey] += "pools: 127.0.0.0/8\n"
	if _, err := Parse(cm); err == nil || !strings.Contains(err.Error(), `"router" line`) {
		t.Errorf("Parse of a bad pool: %v", err)
	}
}

func TestTruncatedPastLimit(t *testing.T) {
	r := Router{Node: "r"}
	for i := range 20000 {
		r.Tunnels = append(r.Tunnels, Tunnel{VIP: netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), Table: "0123abcd", Endpoints: 10})
	}
	cm := r.ConfigMap("ns", nil)
	if len(cm.Data[TunnelsKey]) > MaxTunnelsBytes {
		t.Errorf("tunnels key holds %d bytes, limit %d", len(cm.Data[TunnelsKey]), MaxTunnelsBytes)
	}
	got, err := Parse(cm)
	if err != nil {
		t.Fatal(err)
	}
	if got.Truncated == 0 || len(got.Tunnels)+got.Truncated != 20000 {
		t.Errorf("%d listed + %d truncated, want 20000 in all, some truncated", len(got.Tunnels), got.Truncated)
	}
	t.Logf("%d of 20,000 tunnel IPs fit in %d bytes", len(got.Tunnels), len(cm.Data[TunnelsKey]))
}

func TestTableDigest(t *testing.T) {
	a := TableDigest(addrs("10.0.0.1", "10.0.0.2"), nil)
	if a == "" || a != TableDigest(addrs("10.0.0.1", "10.0.0.2"), nil) {
		t.Fatalf("digest %q is not stable", a)
	}
	for name, other := range map[string]string{
		"buckets swapped": TableDigest(addrs("10.0.0.2", "10.0.0.1"), nil),
		"another pod":     TableDigest(addrs("10.0.0.1", "10.0.0.3"), nil),
		"with nodes":      TableDigest(addrs("10.0.0.1", "10.0.0.2"), addrs("172.16.0.1", "172.16.0.1")),
	} {
		if other == a {
			t.Errorf("%s: same digest %s", name, a)
		}
	}
	if TableDigest(nil, nil) != "" {
		t.Error("an empty table has a digest")
	}
}

func TestPublisherWritesAndTakesOver(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	old := Router{Node: "n1"}.ConfigMap("kst", &metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: "old", UID: "old-uid"})
	client := fake.NewClientset(old)
	p := NewPublisher(client, "kst", Router{Node: "n1", Buckets: 8}, "new", func() types.UID { return "node-uid" }, logrus.New())
	go p.Run(ctx)
	vip := netip.MustParseAddr("192.0.2.1")
	p.Set(Tunnel{VIP: vip, Table: "aa"})
	p.Announce(vip, true)
	read := func() Router {
		cm, err := client.CoreV1().ConfigMaps("kst").Get(ctx, Name("n1"), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		r, err := Parse(cm)
		if err != nil {
			t.Fatal(err)
		}
		if len(cm.OwnerReferences) != 1 || cm.OwnerReferences[0].UID != "node-uid" || cm.OwnerReferences[0].Kind != "Node" || cm.OwnerReferences[0].Name != "n1" {
			r.Pod = fmt.Sprintf("owned by %v", cm.OwnerReferences)
		}
		return r
	}
	waitFor(t, func() string {
		r := read()
		if len(r.Tunnels) != 1 || !r.Tunnels[0].Announced || r.Pod != "new" || r.Buckets != 8 {
			return fmt.Sprintf("%+v (want the new pod as the only owner)", r)
		}
		return ""
	})
	p.Remove(vip)
	waitFor(t, func() string {
		if r := read(); len(r.Tunnels) != 0 {
			return fmt.Sprintf("%+v", r)
		}
		return ""
	})
	p.Replace([]Tunnel{{VIP: vip}, {VIP: netip.MustParseAddr("192.0.2.2")}})
	waitFor(t, func() string {
		if r := read(); len(r.Tunnels) != 2 {
			return fmt.Sprintf("%+v", r)
		}
		return ""
	})
}

func waitFor(t *testing.T, check func() string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		msg := check()
		if msg == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not published: %s", msg)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
