package tunnelctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

const (
	ns   = "kube-service-tunnel"
	seed = 0x5eed1e55
)

var (
	vip     = netip.MustParseAddr("192.0.2.10")
	podIPs  = []string{"10.244.1.5", "10.244.2.7", "10.244.2.8"}
	created = metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	now     = time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
)

func service(name, ip string, age time.Duration) *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "web", Name: name, CreationTimestamp: metav1.NewTime(created.Add(-age)),
		Annotations: map[string]string{tunnelclaim.Annotation: ip}},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Protocol: corev1.ProtocolTCP, Port: 80}, {Protocol: corev1.ProtocolUDP, Port: 80}}}}
}

func ptr[T any](v T) *T { return &v }

// cluster is a Service "web/echo" on vip with three pods on two nodes, the
// third one drained by annotation, one router that programmed the current
// table and one that holds an older one, in mode.
func cluster(t *testing.T, mode encap.Mode) (*fake.Clientset, []netip.Addr) {
	t.Helper()
	objs := []runtime.Object{
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: ConfigMapName},
			Data: map[string]string{"KST_MODE": string(mode), "KST_BUCKETS": "16", "KST_POOLS": "192.0.2.0/24"}},
		seedsecret.New(seedsecret.Ref{Namespace: ns, Name: seedsecret.DefaultName}, seed),
		service("echo", vip.String(), time.Hour),
		service("late", vip.String(), 0),
		service("bad", "not-an-ip", 0),
		service("outside", "198.51.100.1", 0),
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "web", Name: "echo-1", Labels: map[string]string{discoveryv1.LabelServiceName: "echo"}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for i, ip := range podIPs {
		node := []string{"worker-1", "worker-2", "worker-2"}[i]
		name := []string{"echo-a", "echo-b", "echo-c"}[i]
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{ip}, NodeName: ptr(node),
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "web", Name: name}})
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "web", Name: name}}
		if name == "echo-c" {
			pod.Annotations = map[string]string{router.DrainAnnotation: "true"}
		}
		objs = append(objs, pod)
	}
	objs = append(objs, slice)
	for i, n := range []string{"worker-1", "worker-2"} {
		objs = append(objs, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n},
			Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: []string{"172.16.0.11", "172.16.0.12"}[i]}}}})
	}
	// The table every router computes: the two ready pods.
	ready := []netip.Addr{netip.MustParseAddr(podIPs[0]), netip.MustParseAddr(podIPs[1])}
	nodeIP := map[string]netip.Addr{"worker-1": netip.MustParseAddr("172.16.0.11"), "worker-2": netip.MustParseAddr("172.16.0.12")}
	digest := func(pods []netip.Addr) string {
		var eps []datapath.Endpoint
		for i, p := range pods {
			ep := datapath.Endpoint{Addr: p, NodeName: []string{"worker-1", "worker-2"}[i]}
			if mode == encap.MPLS {
				ep.NodeIP = nodeIP[ep.NodeName]
			}
			eps = append(eps, ep)
		}
		return routerstatus.TableDigest(router.TableAddrs(router.NewTunnel(vip, eps, 16)))
	}
	for _, r := range []routerstatus.Router{
		{Node: "router-a", Mode: mode, Buckets: 16, Generations: 4, MarkOffset: 0x1000, TableBase: 7600, SeedFingerprint: hmark.SeedFingerprint(seed), BGP: true, Updated: now.Add(-5 * time.Second),
			Tunnels: []routerstatus.Tunnel{{VIP: vip, Generation: 1, Table: digest(ready), Endpoints: 2, Draining: 1, Announced: true}}},
		{Node: "router-b", Mode: mode, Buckets: 16, Generations: 4, MarkOffset: 0x1000, TableBase: 7600, SeedFingerprint: hmark.SeedFingerprint(seed), BGP: true, Updated: now.Add(-time.Minute),
			Tunnels: []routerstatus.Tunnel{{VIP: vip, Generation: 0, Table: digest(ready[:1]), Endpoints: 1}}},
	} {
		objs = append(objs, r.ConfigMap(ns, nil))
	}
	return fake.NewClientset(objs...), ready
}

func TestStatus(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	inv, err := Load(context.Background(), client, ns, ns)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := inv.Status(context.Background(), StatusFilter{Namespace: "web"})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Tunnels) != 1 {
		t.Fatalf("tunnels %+v", rep.Tunnels)
	}
	ts := rep.Tunnels[0]
	if ts.Service != "web/echo" || ts.Pool != "192.0.2.0/24" || ts.Buckets != 16 || ts.Mode != "gre" {
		t.Errorf("tunnel %+v", ts)
	}
	states := map[string]string{}
	buckets := 0
	for _, ep := range ts.Endpoints {
		states[ep.Pod] = ep.State
		buckets += ep.Buckets
	}
	if states["web/echo-a"] != "ready" || states["web/echo-c"] != "draining" || buckets != 16 {
		t.Errorf("endpoints %+v: want echo-c draining, 16 buckets over the ready ones", ts.Endpoints)
	}
	if len(ts.Routers) != 2 || !ts.Routers[0].Current() || ts.Routers[1].Table != "outdated" || ts.Routers[0].Generation != 1 {
		t.Errorf("routers %+v: want router-a current in generation 1, router-b outdated", ts.Routers)
	}
	verdicts := map[string]string{}
	for _, c := range rep.Claims {
		verdicts[c.Service] = c.Verdict
	}
	if verdicts["web/late"] != "lost" || verdicts["web/bad"] != "invalid" || verdicts["web/outside"] != "refused" {
		t.Errorf("unserved claims %+v", rep.Claims)
	}
	if rep, err := inv.Status(context.Background(), StatusFilter{Namespace: "other"}); err != nil || len(rep.Tunnels)+len(rep.Claims) != 0 {
		t.Errorf("namespace other: %+v, %v", rep, err)
	}
	if _, err := inv.Status(context.Background(), StatusFilter{Namespace: "web", Target: "nothing"}); err == nil || !strings.Contains(err.Error(), "web/nothing") {
		t.Errorf("status of an unknown Service: %v", err)
	}
	if rep, err := inv.Status(context.Background(), StatusFilter{Target: vip.String()}); err != nil || len(rep.Tunnels) != 1 || len(rep.Claims) != 1 {
		t.Errorf("status by tunnel IP: %+v, %v; want the tunnel and its losing claimant", rep, err)
	}
}

// explain's endpoint is the one the bucket table built like the routers'
// gives the flow's HMARK bucket, computed with the seed from the Secret.
func TestExplain(t *testing.T) {
	for _, mode := range []encap.Mode{encap.GRE, encap.MPLS} {
		t.Run(string(mode), func(t *testing.T) {
			client, ready := cluster(t, mode)
			inv, err := Load(context.Background(), client, ns, ns)
			if err != nil {
				t.Fatal(err)
			}
			s, err := readSeed(context.Background(), client, "", seedsecret.Ref{Namespace: ns, Name: seedsecret.DefaultName})
			if err != nil || s.Value != seed {
				t.Fatalf("seed %#x, %v", s.Value, err)
			}
			params := hmark.Params{Buckets: 16, Seed: seed}
			reached := map[string]bool{}
			for port := uint16(40000); port < 40040; port++ {
				f, err := ParseFlow(vip.String()+":80", "198.51.100.7:"+strconv.Itoa(int(port)), "tcp")
				if err != nil {
					t.Fatal(err)
				}
				ex, err := inv.Explain(context.Background(), f, s)
				if err != nil {
					t.Fatal(err)
				}
				b := params.Bucket(hmark.Flow{Src: f.Client.Addr(), Dst: vip, SrcPort: port, DstPort: 80, Proto: 6})
				tun := router.NewTunnel(vip, []datapath.Endpoint{{Addr: ready[0]}, {Addr: ready[1]}}, 16)
				want := tun.Table[b].Addr.String()
				if ex.Bucket != int(b) || ex.Endpoint.Address != want {
					t.Fatalf("port %d: bucket %d endpoint %s, want bucket %d endpoint %s", port, ex.Bucket, ex.Endpoint.Address, b, want)
				}
				reached[ex.Endpoint.Pod] = true
				switch mode {
				case encap.GRE:
					if ex.Encapsulation.GREDestination != want {
						t.Errorf("GRE destination %s, want %s", ex.Encapsulation.GREDestination, want)
					}
				case encap.MPLS:
					label, _ := mplslabel.ForEndpoint(netip.MustParseAddr(want))
					if ex.Encapsulation.MPLSLabel != label || ex.Encapsulation.NextHop != ex.Endpoint.NodeAddress || ex.Endpoint.NodeAddress == "" {
						t.Errorf("mpls %+v for endpoint %+v", ex.Encapsulation, ex.Endpoint)
					}
				}
				a, b2 := ex.Routers[0], ex.Routers[1]
				slot := 1*16 + int(b)
				if !a.Carries || a.Table != 7600+slot || a.Mark != "0x"+strconv.FormatInt(int64(0x1000+slot), 16) || b2.Carries || !strings.Contains(b2.Why, "another table") {
					t.Fatalf("routers %+v: want router-a carrying it in generation 1 (slot %d), router-b not (outdated)", ex.Routers, slot)
				}
			}
			if len(reached) != 2 || reached["web/echo-c"] {
				t.Errorf("40 flows reached %v: want both ready pods, never the drained one", reached)
			}
		})
	}
}

func TestParseFlow(t *testing.T) {
	for _, c := range []struct{ vip, from, proto, err string }{
		{"192.0.2.10:80", "198.51.100.7:4000", "tcp", ""},
		{"192.0.2.10", "198.51.100.7", "icmp", ""},
		{"192.0.2.10", "198.51.100.7", "47", ""},
		{"192.0.2.10", "198.51.100.7:4000", "udp", "both ports"},
		{"192.0.2.10:80", "", "tcp", "--from"},
		{"192.0.2.10:80", "client", "tcp", "--from"},
		{"web", "198.51.100.7:1", "tcp", "tunnel IP"},
		{"192.0.2.10:80", "198.51.100.7:1", "gre2", "--proto"},
		{"192.0.2.10:80", "[2001:db8::7]:4000", "tcp", "different address families"},
		{"[2001:db8::10]:80", "[2001:db8::7]:4000", "tcp", ""},
		{"192.0.2.10:80", "[::ffff:198.51.100.7]:4000", "tcp", ""}, // an IPv4 client
	} {
		f, err := ParseFlow(c.vip, c.from, c.proto)
		if (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("ParseFlow(%q, %q, %q) = %v, want error containing %q", c.vip, c.from, c.proto, err, c.err)
		}
		if err == nil && f.Client.Addr().Is4In6() {
			t.Errorf("ParseFlow(%q, %q, %q): client %v left mapped", c.vip, c.from, c.proto, f.Client)
		}
	}
}

// A caller who may not read the seed is told so, with what to ask for.
func TestExplainSeedForbidden(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, seedsecret.DefaultName, errors.New("RBAC"))
	})
	_, err := readSeed(context.Background(), client, "", seedsecret.Ref{Namespace: ns, Name: seedsecret.DefaultName})
	if err == nil || !strings.Contains(err.Error(), "you may not read the HMARK seed") || !strings.Contains(err.Error(), `"get" on secret kube-service-tunnel/tunnel-hmark-seed`) {
		t.Errorf("forbidden seed: %v", err)
	}
	if s, err := readSeed(context.Background(), client, "0x2a", seedsecret.Ref{}); err != nil || s.Value != 42 || s.From != "--seed" {
		t.Errorf("--seed: %+v, %v", s, err)
	}
}

// Every output format of both commands: text and wide are for people, json
// and yaml decode back into the report.
func TestOutputFormats(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	inv, err := Load(context.Background(), client, ns, ns)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := inv.Status(context.Background(), StatusFilter{Namespace: "web"})
	if err != nil {
		t.Fatal(err)
	}
	text := func(output string, detailed bool) string {
		var b bytes.Buffer
		if err := PrintStatus(&b, rep, output, detailed, now); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	table := text(OutputText, false)
	for _, want := range []string{"TUNNEL IP", "192.0.2.10", "web/echo", "1/2 (router-b:outdated)", "1/2", "not served: web/late (192.0.2.10) lost", "not served: web/bad (-) invalid"} {
		if !strings.Contains(table, want) {
			t.Errorf("status table lacks %q:\n%s", want, table)
		}
	}
	if wide := text(OutputWide, false); !strings.Contains(wide, "echo-a=") || !strings.Contains(wide, "192.0.2.0/24") {
		t.Errorf("wide status lacks buckets per endpoint or the pool:\n%s", wide)
	}
	details := text(OutputText, true)
	for _, want := range []string{"Tunnel IP:  192.0.2.10", "web/echo-c", "draining", "router-a", "current", "5s ago", "outdated", "1m0s ago"} {
		if !strings.Contains(details, want) {
			t.Errorf("detailed status lacks %q:\n%s", want, details)
		}
	}
	var fromJSON, fromYAML StatusReport
	if err := json.Unmarshal([]byte(text(OutputJSON, false)), &fromJSON); err != nil || len(fromJSON.Tunnels) != 1 || fromJSON.Tunnels[0].Routers[1].Table != "outdated" {
		t.Errorf("json: %+v, %v", fromJSON, err)
	}
	if err := yaml.Unmarshal([]byte(text(OutputYAML, false)), &fromYAML); err != nil || len(fromYAML.Tunnels) != 1 || fromYAML.Tunnels[0].Service != "web/echo" {
		t.Errorf("yaml: %+v, %v", fromYAML, err)
	}

	f, _ := ParseFlow("192.0.2.10:80", "198.51.100.7:40000", "tcp")
	ex, err := inv.Explain(context.Background(), f, Seed{Value: seed, From: "test"})
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := PrintExplanation(&b, ex, OutputText); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Flow:       tcp 198.51.100.7:40000 -> 192.0.2.10:80", "Bucket:     ", "of 16", "Encap:      GRE to 10.244.", "router-a  yes", "router-b  no", "NEW flow"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("explain text lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	if err := PrintExplanation(&b, ex, OutputJSON); err != nil {
		t.Fatal(err)
	}
	var back Explanation
	if err := json.Unmarshal(b.Bytes(), &back); err != nil || back.Endpoint.Address != ex.Endpoint.Address || back.Bucket != ex.Bucket {
		t.Errorf("explain json: %+v, %v", back, err)
	}
	if err := ValidOutput("table"); err == nil {
		t.Error("-o table accepted")
	}
}

// The command line: a missing command, an unknown one, and version.
func TestMainArguments(t *testing.T) {
	var out, errOut bytes.Buffer
	if err := Main(context.Background(), nil, &out, &errOut); err == nil || !strings.Contains(errOut.String(), "kubectl tunnel status") {
		t.Errorf("no command: %v, usage %q", err, errOut.String())
	}
	if err := Main(context.Background(), []string{"version"}, &out, &errOut); err != nil || !strings.HasPrefix(out.String(), "kubectl-tunnel ") {
		t.Errorf("version: %v, %q", err, out.String())
	}
	if err := Main(context.Background(), []string{"-o", "xml", "status"}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "-o") {
		t.Errorf("-o xml: %v", err)
	}
}

// With sessionAffinity ClientIP every flow of a client gets the bucket of
// its address alone; routers that published a table without affinity are
// not current.
func TestExplainClientAffinity(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	ctx := context.Background()
	svc, err := client.CoreV1().Services("web").Get(ctx, "echo", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	svc.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
	if _, err := client.CoreV1().Services("web").Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	inv, err := Load(ctx, client, ns, ns)
	if err != nil {
		t.Fatal(err)
	}
	params := hmark.Params{Buckets: 16, Seed: seed}
	buckets := map[int]bool{}
	for port := uint16(40000); port < 40020; port++ {
		f, _ := ParseFlow(vip.String()+":80", "198.51.100.7:"+strconv.Itoa(int(port)), "tcp")
		ex, err := inv.Explain(ctx, f, Seed{Value: seed})
		if err != nil {
			t.Fatal(err)
		}
		if !ex.ClientAffinity || ex.Routers[0].Carries {
			t.Errorf("explain %+v: want client affinity, and router-a (which published no affinity) not carrying it", ex)
		}
		buckets[ex.Bucket] = true
	}
	want := int(params.Bucket(hmark.ClientFlow(hmark.Flow{Src: netip.MustParseAddr("198.51.100.7"), Dst: vip})))
	if len(buckets) != 1 || !buckets[want] {
		t.Errorf("20 flows of one client got buckets %v, want only %d", buckets, want)
	}
}

// A router running another bucket count than the inventory's (a rolling
// change of --buckets) is compared with the table its own count gives.
func TestRouterComparedWithItsOwnSettings(t *testing.T) {
	client, ready := cluster(t, encap.GRE)
	ctx := context.Background()
	eps := []datapath.Endpoint{{Addr: ready[0], NodeName: "worker-1"}, {Addr: ready[1], NodeName: "worker-2"}}
	r := routerstatus.Router{Node: "router-c", Mode: encap.GRE, Buckets: 32, Generations: 4, MarkOffset: 0x1000, TableBase: 7600,
		SeedFingerprint: hmark.SeedFingerprint(seed), Updated: now.Add(-time.Hour),
		Tunnels: []routerstatus.Tunnel{{VIP: vip, Table: routerstatus.TableDigest(router.TableAddrs(router.NewTunnel(vip, eps, 32)))}}}
	if _, err := client.CoreV1().ConfigMaps(ns).Create(ctx, r.ConfigMap(ns, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	inv, err := Load(ctx, client, ns, ns)
	if err != nil {
		t.Fatal(err)
	}
	if inv.Buckets != 16 {
		t.Errorf("inventory took %d buckets from the router that wrote its status longest ago", inv.Buckets)
	}
	rep, err := inv.Status(ctx, StatusFilter{Target: vip.String()})
	if err != nil {
		t.Fatal(err)
	}
	for _, rt := range rep.Tunnels[0].Routers {
		if rt.Router == "router-c" && !rt.Current() {
			t.Errorf("router-c, with 32 buckets and the table they give, shows %+v", rt)
		}
	}
}

// explain says when the routers' port filter drops the flow: a port the
// Service does not list, unless it opted into every port; ICMP passes.
func TestExplainPortFilter(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	ctx := context.Background()
	explain := func(to, proto string) *Explanation {
		t.Helper()
		inv, err := Load(ctx, client, ns, ns)
		if err != nil {
			t.Fatal(err)
		}
		f, err := ParseFlow(to, "198.51.100.7:40000", proto)
		if err != nil {
			t.Fatal(err)
		}
		ex, err := inv.Explain(ctx, f, Seed{Value: seed})
		if err != nil {
			t.Fatal(err)
		}
		return ex
	}
	dropsIt := func(ex *Explanation) bool {
		return strings.Contains(strings.Join(ex.Notes, "\n"), "the routers drop this flow") && !ex.Routers[0].Carries
	}
	if ex := explain(vip.String()+":80", "tcp"); dropsIt(ex) {
		t.Errorf("tcp/80 is in spec.ports, but explain says %+v", ex)
	}
	if ex := explain(vip.String()+":8080", "tcp"); !dropsIt(ex) || !strings.Contains(ex.Routers[0].Why, "spec.ports") {
		t.Errorf("tcp/8080: %+v %+v, want the routers to drop it", ex.Notes, ex.Routers)
	}
	if ex := explain(vip.String(), "icmp"); dropsIt(ex) {
		t.Errorf("icmp is dropped: %+v", ex.Notes)
	}
	svc, err := client.CoreV1().Services("web").Get(ctx, "echo", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	svc.Annotations[router.PortsAnnotation] = router.AllPorts
	if _, err := client.CoreV1().Services("web").Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if ex := explain(vip.String()+":8080", "tcp"); dropsIt(ex) {
		t.Errorf("with %s: %s, tcp/8080 is still dropped: %+v", router.PortsAnnotation, router.AllPorts, ex.Notes)
	}
}

// explain judges the flow against the endpoint pod's NetworkPolicies, as
// the endpoint agent does.
func TestExplainNetworkPolicy(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	ctx := context.Background()
	explain := func(from, proto string) *PolicyVerdict {
		t.Helper()
		inv, err := Load(ctx, client, ns, ns)
		if err != nil {
			t.Fatal(err)
		}
		f, err := ParseFlow(vip.String()+":80", from, proto)
		if err != nil {
			t.Fatal(err)
		}
		ex, err := inv.Explain(ctx, f, Seed{Value: seed})
		if err != nil {
			t.Fatal(err)
		}
		if ex.Policy == nil {
			t.Fatalf("no policy verdict in %+v", ex)
		}
		return ex.Policy
	}
	if v := explain("198.51.100.7:40000", "tcp"); v.Verdict != PolicyNotIsolated {
		t.Errorf("no policy: %+v, want %q", v, PolicyNotIsolated)
	}
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(80)
	office := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "web", Name: "office"},
		Spec: networkingv1.NetworkPolicySpec{Ingress: []networkingv1.NetworkPolicyIngressRule{{
			From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "198.51.100.0/24", Except: []string{"198.51.100.128/25"}}}},
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
		}}}}
	if _, err := client.NetworkingV1().NetworkPolicies("web").Create(ctx, office, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		from, proto, want string
	}{
		{"198.51.100.7:40000", "tcp", PolicyAdmitted},
		{"198.51.100.200:40000", "tcp", PolicyRefused}, // in the except range
		{"203.0.113.9:40000", "tcp", PolicyRefused},
		{"198.51.100.7:40000", "udp", PolicyRefused},
	} {
		v := explain(c.from, c.proto)
		if v.Verdict != c.want || len(v.Policies) != 1 || v.Policies[0] != "web/office" {
			t.Errorf("%s %s: %+v, want %q by web/office", c.proto, c.from, v, c.want)
		}
	}
	// Without the right to read policies, the verdict says so.
	client.PrependReactor("list", "networkpolicies", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Group: "networking.k8s.io", Resource: "networkpolicies"}, "", errors.New("RBAC"))
	})
	if v := explain("198.51.100.7:40000", "tcp"); v.Verdict != PolicyUnknown || !strings.Contains(v.Why, "forbidden") {
		t.Errorf("forbidden: %+v, want %q with the reason", v, PolicyUnknown)
	}
}

// Claims are judged with the pools the newest router publishes, which a
// flag on its command line may have set instead of the ConfigMap: the
// override, and routers that disagree, are noted.
func TestPoolsFromTheRouters(t *testing.T) {
	ctx := context.Background()
	outside := "web/outside" // claims 198.51.100.1: in no pool of the ConfigMap
	for _, tc := range []struct {
		name      string
		a, b      string // the routers' published pools ("": none published)
		noConfig  bool
		wantWon   bool
		wantNotes []string
	}{
		{name: "older routers publish none", wantWon: false},
		{name: "the newest router's pools win", a: "192.0.2.0/24;198.51.100.0/24", b: "192.0.2.0/24", wantWon: true,
			wantNotes: []string{`router router-a admits claims with --pools "192.0.2.0/24;198.51.100.0/24", the ConfigMap says --pools "192.0.2.0/24" (a flag on the router's command line wins`,
				`routers disagree on the address pools: router-a admits claims with --pools "192.0.2.0/24;198.51.100.0/24", router-b with --pools "192.0.2.0/24"`}},
		{name: "no ConfigMap", a: "198.51.100.0/24", noConfig: true, wantWon: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, _ := cluster(t, encap.GRE)
			if tc.noConfig {
				if err := client.CoreV1().ConfigMaps(ns).Delete(ctx, ConfigMapName, metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			for node, pools := range map[string]string{"router-a": tc.a, "router-b": tc.b} {
				if pools == "" {
					continue
				}
				cm, err := client.CoreV1().ConfigMaps(ns).Get(ctx, routerstatus.Name(node), metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				r, err := routerstatus.Parse(cm)
				if err != nil {
					t.Fatal(err)
				}
				p, err := tunnelclaim.ParsePools(pools)
				if err != nil {
					t.Fatal(err)
				}
				r.Policy = &tunnelclaim.Policy{Pools: p}
				if _, err := client.CoreV1().ConfigMaps(ns).Update(ctx, r.ConfigMap(ns, nil), metav1.UpdateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			inv, err := Load(ctx, client, ns, ns)
			if err != nil {
				t.Fatal(err)
			}
			if won := len(inv.Decision.Won(outside)) == 1; won != tc.wantWon {
				t.Errorf("%s wins its claim: %t, want %t (pools %s)", outside, won, tc.wantWon, inv.Policy.Pools)
			}
			if len(inv.Decision.Won("web/echo")) != 1 && !tc.noConfig {
				t.Errorf("web/echo lost its claim with pools %s", inv.Policy.Pools)
			}
			notes := strings.Join(inv.Notes, "\n")
			for _, want := range tc.wantNotes {
				if !strings.Contains(notes, want) {
					t.Errorf("notes lack %q:\n%s", want, notes)
				}
			}
			if strings.Contains(notes, "no address pool known") {
				t.Errorf("notes say no pool is known, while a router publishes its pools or the ConfigMap is there:\n%s", notes)
			}
		})
	}
}

// TestStatusLeavesOutARouterWhosePodIsGone: a status ConfigMap outlives
// its router's pod (it goes with the Node or the namespace), so kubectl
// tunnel reads it only while the pod that wrote it exists.
func TestStatusLeavesOutARouterWhosePodIsGone(t *testing.T) {
	client, _ := cluster(t, encap.GRE)
	ctx := context.Background()
	live := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tunnel-router-live"}}
	if _, err := client.CoreV1().Pods(ns).Create(ctx, live, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for node, pod := range map[string]string{"router-c": "tunnel-router-live", "router-d": "tunnel-router-gone"} {
		cm := routerstatus.Router{Node: node, Pod: pod, Mode: encap.GRE, Buckets: 16, Updated: time.Now()}.ConfigMap(ns, nil)
		if _, err := client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	inv, err := Load(ctx, client, ns, ns)
	if err != nil {
		t.Fatal(err)
	}
	var nodes []string
	for _, r := range inv.Routers {
		nodes = append(nodes, r.Node)
	}
	if want := []string{"router-a", "router-b", "router-c"}; !slices.Equal(nodes, want) {
		t.Errorf("routers %v, want %v (router-d's pod is gone)", nodes, want)
	}
	if !slices.ContainsFunc(inv.Notes, func(n string) bool {
		return strings.Contains(n, "router-d") && strings.Contains(n, "tunnel-router-gone")
	}) {
		t.Errorf("notes %q do not name the status left out", inv.Notes)
	}
}
