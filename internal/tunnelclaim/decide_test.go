package tunnelclaim

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var decideEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// claimant is a Service of namespace/name, created age before decideEpoch,
// annotated with value ("-" for no annotation).
func claimant(key, value string, age time.Duration) *corev1.Service {
	ns, name, _ := strings.Cut(key, "/")
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(decideEpoch.Add(-age))}}
	if value != "-" {
		svc.Annotations = map[string]string{Annotation: value}
	}
	return svc
}

// summary renders a decision one claim a line, sorted by Service:
// "ns/name won 192.0.2.10", "ns/name lost 192.0.2.10 to ns/other",
// "ns/name invalid: <error>", "ns/name refused 192.0.2.10: <error>".
func (d Decision) summary() string {
	var lines []string
	for _, c := range slices.Concat(slices.Collect(maps.Values(d.Claims))...) {
		line := c.Key() + " " + c.Verdict.String()
		switch c.Verdict {
		case Won:
			line += " " + c.VIP.String()
		case Lost:
			line += fmt.Sprintf(" %v to %s", c.VIP, ServiceKey(c.Winner))
		case Invalid:
			line += ": " + c.Err.Error()
		case Refused:
			line += fmt.Sprintf(" %v: %v", c.VIP, c.Err)
		}
		lines = append(lines, line)
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func TestDecide(t *testing.T) {
	pools, err := ParsePools("192.0.2.0/24;203.0.113.0/28=team-a;2001:db8::/48;2001:db8:1::/64=team-a")
	if err != nil {
		t.Fatal(err)
	}
	known := KnownNetworks([]*corev1.Node{testNode("n2", []string{"10.244.2.0/24", "2001:db8:0:2::/64"},
		corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "192.0.2.200"},
		corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "2001:db8::200"})},
		nil, []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")})
	for _, tc := range []struct {
		name     string
		pools    Pools
		services []*corev1.Service
		want     string
	}{
		{name: "no annotation claims nothing", pools: pools,
			services: []*corev1.Service{claimant("a/web", "-", 0)}},
		{name: "one admitted claim wins", pools: pools,
			services: []*corev1.Service{claimant("a/web", "192.0.2.10", 0)},
			want:     "a/web won 192.0.2.10"},
		{name: "no pool: nothing is served", services: []*corev1.Service{claimant("a/web", "192.0.2.10", 0)},
			want: "a/web refused 192.0.2.10: tunnel IP 192.0.2.10 is not served: no address pool is configured (--pools)"},
		{name: "outside every pool", pools: pools, services: []*corev1.Service{claimant("a/web", "198.51.100.7", 0)},
			want: "a/web refused 198.51.100.7: tunnel IP 198.51.100.7 is in no address pool (--pools 192.0.2.0/24;203.0.113.0/28=team-a;2001:db8::/48;2001:db8:1::/64=team-a)"},
		{name: "a Node's address is refused", pools: pools, services: []*corev1.Service{claimant("a/web", "192.0.2.200", 0)},
			want: "a/web refused 192.0.2.200: tunnel IP 192.0.2.200 is the address of Node n2"},
		{name: "the service network is refused", pools: pools, services: []*corev1.Service{claimant("a/web", "10.96.0.10", 0)},
			want: "a/web refused 10.96.0.10: tunnel IP 10.96.0.10 is inside the service network 10.96.0.0/12 (--service-cidr)"},
		{name: "a bad annotation is invalid", pools: pools, services: []*corev1.Service{claimant("a/web", "192.0.2.10,192.0.2.11", 0)},
			want: `a/web invalid: cmd.nu/tunnel="192.0.2.10,192.0.2.11" lists two IPv4 addresses: expected one IPv4 address, one IPv6 address, or one of each separated by a comma`},
		{name: "one address of each family: both won", pools: pools,
			services: []*corev1.Service{claimant("a/web", "2001:db8::10, 192.0.2.10", 0)},
			want:     "a/web won 192.0.2.10\na/web won 2001:db8::10"},
		{name: "an IPv6 tunnel IP alone", pools: pools,
			services: []*corev1.Service{claimant("a/web", "2001:db8::10", 0)},
			want:     "a/web won 2001:db8::10"},
		{name: "a bad IPv6 address makes the whole annotation invalid", pools: pools,
			services: []*corev1.Service{claimant("a/web", "192.0.2.10, fe80::1", 0)},
			want:     `a/web invalid: cmd.nu/tunnel="192.0.2.10, fe80::1": fe80::1 is link-local`},
		{name: "a refused IPv6 address leaves the IPv4 one served", pools: pools,
			services: []*corev1.Service{claimant("b/web", "192.0.2.10,2001:db8:1::10", 0)},
			want: "b/web refused 2001:db8:1::10: tunnel IP 2001:db8:1::10 is in address pool 2001:db8:1::/64, which only namespaces team-a may use, not b\n" +
				"b/web won 192.0.2.10"},
		{name: "a Node's IPv6 address and pod range are refused", pools: pools,
			services: []*corev1.Service{claimant("a/node", "2001:db8::200", 0), claimant("a/pod", "2001:db8:0:2::9", 0)},
			want: "a/node refused 2001:db8::200: tunnel IP 2001:db8::200 is the address of Node n2\n" +
				"a/pod refused 2001:db8:0:2::9: tunnel IP 2001:db8:0:2::9 is inside the pod network 2001:db8:0:2::/64 (Node n2 spec.podCIDRs)"},
		{name: "a conflict on the IPv6 address leaves the IPv4 one won", pools: pools,
			services: []*corev1.Service{claimant("a/old", "2001:db8::10", time.Hour), claimant("a/new", "192.0.2.10, 2001:db8::10", time.Minute)},
			want:     "a/new lost 2001:db8::10 to a/old\na/new won 192.0.2.10\na/old won 2001:db8::10"},
		{name: "the oldest claimant wins, the others lose to it", pools: pools,
			services: []*corev1.Service{claimant("a/new", "192.0.2.10", time.Minute), claimant("z/old", "192.0.2.10", time.Hour), claimant("b/mid", "192.0.2.10", 10*time.Minute)},
			want:     "a/new lost 192.0.2.10 to z/old\nb/mid lost 192.0.2.10 to z/old\nz/old won 192.0.2.10"},
		{name: "same age: namespace/name decides", pools: pools,
			services: []*corev1.Service{claimant("b/x", "192.0.2.10", time.Hour), claimant("a/z", "192.0.2.10", time.Hour)},
			want:     "a/z won 192.0.2.10\nb/x lost 192.0.2.10 to a/z"},
		{name: "a refused older Service does not beat an admitted newer one", pools: pools,
			services: []*corev1.Service{claimant("team-b/old", "203.0.113.5", time.Hour), claimant("team-a/new", "203.0.113.5", time.Minute)},
			want: "team-a/new won 203.0.113.5\n" +
				"team-b/old refused 203.0.113.5: tunnel IP 203.0.113.5 is in address pool 203.0.113.0/28, which only namespaces team-a may use, not team-b"},
		{name: "an invalid older Service takes no part", pools: pools,
			services: []*corev1.Service{claimant("a/old", "192.0.2.010", time.Hour), claimant("a/new", "192.0.2.10", time.Minute)},
			want:     "a/new won 192.0.2.10\n" + `a/old invalid: cmd.nu/tunnel="192.0.2.010": "192.0.2.010" is not an IP address`},
		{name: "different tunnel IPs do not conflict", pools: pools,
			services: []*corev1.Service{claimant("a/one", "192.0.2.10", time.Hour), claimant("a/two", "192.0.2.11", time.Minute)},
			want:     "a/one won 192.0.2.10\na/two won 192.0.2.11"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.services, tc.pools, known)
			if got := d.summary(); got != tc.want {
				t.Errorf("decision:\n%s\nwant:\n%s", got, tc.want)
			}
			for vip, svc := range d.Winners {
				if !slices.Contains(d.Won(ServiceKey(svc)), vip) {
					t.Errorf("winner of %v is %s, whose claims are %v", vip, ServiceKey(svc), d.Claims[ServiceKey(svc)])
				}
			}
			for key := range d.Claims {
				for _, vip := range d.Won(key) {
					if w := d.Winners[vip]; w == nil || ServiceKey(w) != key {
						t.Errorf("%s wins %v, but the winner of %v is %v", key, vip, vip, w)
					}
				}
			}
		})
	}
}

// Every router and agent lists the Services in its own order: the decision
// must not depend on it.
func TestDecideIgnoresOrder(t *testing.T) {
	pools, err := ParsePools("192.0.2.0/24=a,b;2001:db8::/64=a,c")
	if err != nil {
		t.Fatal(err)
	}
	var svcs []*corev1.Service
	for i := range 40 {
		ns := []string{"a", "b", "c"}[i%3]
		value := fmt.Sprintf("192.0.2.%d", i%5)
		if i%3 == 1 {
			value += fmt.Sprintf(", 2001:db8::%d", i%4)
		}
		svcs = append(svcs, claimant(fmt.Sprintf("%s/s%d", ns, i), value, time.Duration(i%4)*time.Hour))
	}
	want := Decide(svcs, pools, Networks{}).summary()
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		rng.Shuffle(len(svcs), func(i, j int) { svcs[i], svcs[j] = svcs[j], svcs[i] })
		if got := Decide(svcs, pools, Networks{}).summary(); got != want {
			t.Fatalf("shuffled services decide differently:\n%s\nwant:\n%s", got, want)
		}
	}
}
