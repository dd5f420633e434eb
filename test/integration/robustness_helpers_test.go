package integration

// Helpers of the robustness tests (churn_test.go, apiserver_loss_test.go):
// the router on the real kernel of a test namespace, controllers that can be
// stopped before the test ends (for the goroutine leak check), and clients
// whose connections and writes are accounted for.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/runtime"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// connTracker dials the API server for the clients of one test and can
// close every connection it made: client-go keeps idle connections (and a
// reader goroutine each) in a transport cache that outlives the clients, so
// a leak check must close them first. A config with its own Dial also gets a
// transport of its own, never one another test's client shares.
type connTracker struct {
	mu     sync.Mutex
	conns  []net.Conn
	dialer net.Dialer
	// closed is set by closeAll: a client that still dials afterwards (an
	// Event sent late by a stopped recorder's broadcaster, a reconnect)
	// gets an error, not a connection whose reader goroutine would outlive
	// the leak check.
	closed bool
}

func (c *connTracker) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := c.dialer.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		_ = conn.Close()
		return nil, errors.New("connTracker: the test closed its API connections")
	}
	c.conns = append(c.conns, conn)
	return conn, nil
}

// closeAll closes every connection dialled so far, refuses any later dial,
// and returns the number closed.
func (c *connTracker) closeAll() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	for _, conn := range c.conns {
		_ = conn.Close()
	}
	n := len(c.conns)
	c.conns = nil
	return n
}

// writeCounter counts the API requests that write (every method but GET,
// HEAD and OPTIONS) made through the configs it wrapped.
type writeCounter struct{ n atomic.Int64 }

type countingTransport struct {
	next    http.RoundTripper
	counter *writeCounter
}

func (c countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
	default:
		c.counter.n.Add(1)
	}
	return c.next.RoundTrip(req)
}

// accounted returns a copy of cfg that dials through tracker, counts its
// writes in writes (when not nil) and is not rate limited by the client.
func accounted(cfg *rest.Config, tracker *connTracker, writes *writeCounter) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	cfg.Dial = tracker.dial
	cfg.QPS, cfg.Burst = -1, 0
	if writes != nil {
		cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
			return countingTransport{next: rt, counter: writes}
		}
	}
	return cfg
}

// kernelRouter is a router Datapath on the real kernel of a test namespace.
// The host has no GRE, so a veth stands in for the flow-based GRE device:
// encap ip routes accept any device, and routing decisions are the same.
type kernelRouter struct {
	ns *testnetns.NS
	dp *datapath.Datapath
}

func newKernelRouter(t *testing.T, cfg router.Config) *kernelRouter {
	t.Helper()
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	rc := ns.Routes()
	nl := ns.Netlink()
	ipt := ns.IPTables("iptables")
	chain, err := hmark.NewChain(ipt, ns.IPSets(), cfg.Chain, cfg.HMARKParams(), ipt)
	if err != nil {
		t.Fatal(err)
	}
	dp := datapath.NewDatapath(cfg.Config, rc, nl, chain, &datapath.ExistingDevice{Name: "veth0", Links: nl}, nil, quietLogger())
	return &kernelRouter{ns: ns, dp: dp}
}

// state is what an operator would look at: every IPv4 route, nexthop
// object and rule, every mangle rule and every ipset with its members in
// the namespace (as kernelState in router's privileged tests). Comment lines
// of iptables-save (which carry a timestamp) are left
// out, and so is IPv6, which the router never touches: the veths'
// link-local addresses come from their random MAC addresses.
func (k *kernelRouter) state() string {
	var mangle []string
	for _, l := range strings.Split(k.ns.RunListing("iptables-save", "-t", "mangle"), "\n") {
		if !strings.HasPrefix(l, "#") {
			mangle = append(mangle, l)
		}
	}
	return k.ns.Run("ip", "-4", "route", "show", "table", "all") + k.ns.Run("ip", "nexthop", "show") +
		k.ns.Run("ip", "-4", "rule", "show") + strings.Join(mangle, "\n") + "\n" + k.ns.IPSetState()
}

// withoutNextHopIDs is a state with every nexthop id replaced by "N" and
// the lines sorted: two routers that programmed the same state by
// different paths allocated their nexthop objects' ids in another order,
// while what each route leads to (the object's content, which ip shows
// beside "nhid") must be the same.
func withoutNextHopIDs(state string) string {
	lines := strings.Split(nextHopIDPattern.ReplaceAllString(state, "${1} N"), "\n")
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

var nextHopIDPattern = regexp.MustCompile(`\b(nhid|id) \d{5,}`)

// programmed is the router's part of the kernel state, read back: per
// tunnel IP the next hop of each bucket ("drop" or the GRE destination), the
// bucket rules and the tunnel IPs with an HMARK rule.
type programmed struct {
	routes map[netip.Addr][]string
	rules  int
	hmark  map[netip.Addr]bool // tunnel IPs the HMARK rules hash
	// routeCount is the number of routes in the router's tables.
	routeCount int
}

// read parses the router's routes, rules and HMARK rules out of the
// namespace with iproute2 and iptables, independently of the Datapath.
func (k *kernelRouter) read(t *testing.T, cfg router.Config) programmed {
	t.Helper()
	p := programmed{routes: map[netip.Addr][]string{}, hmark: map[netip.Addr]bool{}}
	proto := strconv.Itoa(int(cfg.RouteProtocol))
	for _, line := range strings.Split(k.ns.Run("ip", "-4", "route", "show", "table", "all", "proto", proto), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		hop := ""
		if f[0] == "blackhole" {
			hop, f = "drop", f[1:]
		}
		vip, err := netip.ParseAddr(f[0])
		if err != nil {
			t.Fatalf("route %q: %v", line, err)
		}
		table := -1
		for i := 1; i+1 < len(f); i++ {
			switch f[i] {
			case "table":
				table, _ = strconv.Atoi(f[i+1])
			case "dst":
				if hop == "" {
					hop = f[i+1]
				}
			}
		}
		b := table - cfg.TableBase
		if b < 0 || b >= cfg.Buckets || hop == "" {
			t.Fatalf("route %q: not a bucket route of the router", line)
		}
		if p.routes[vip] == nil {
			p.routes[vip] = make([]string, cfg.Buckets)
		}
		p.routes[vip][b] = hop
		p.routeCount++
	}
	// Bucket rules: those with a table (not the guard, its goto, nor the
	// guard's nop target).
	for _, line := range strings.Split(k.ns.Run("ip", "rule", "show"), "\n") {
		if strings.Contains(line, "proto "+proto) && strings.Contains(line, " lookup ") {
			p.rules++
		}
	}
	// The tunnel IPs that are hashed: those in the set of all tunnel IPs
	// and in a generation's set that the mangle chain matches.
	mangle := k.ns.RunListing("iptables", "-t", "mangle", "-S", cfg.Chain)
	all, err := ipsetstate.Members(k.ns.IPSets(), cfg.Chain)
	if err != nil {
		t.Fatal(err)
	}
	inAll := map[netip.Addr]bool{}
	for _, vip := range all {
		inAll[vip] = true
	}
	for g := range hmark.MaxGenerations {
		set := fmt.Sprintf("%s-%d", cfg.Chain, g)
		if !strings.Contains(mangle, "--match-set "+set+" dst") {
			continue
		}
		members, err := ipsetstate.Members(k.ns.IPSets(), set)
		if err != nil {
			t.Fatal(err)
		}
		for _, vip := range members {
			if inAll[vip] {
				p.hmark[vip] = true
			}
		}
	}
	return p
}

// diff describes how the programmed state differs from want (tunnel IP ->
// next hop per bucket), at most a few lines; "" when it matches.
func (p programmed) diff(want map[netip.Addr][]string, buckets int) string {
	var out []string
	add := func(format string, args ...any) {
		if len(out) < 8 {
			out = append(out, fmt.Sprintf(format, args...))
		}
	}
	for vip, hops := range want {
		if got := p.routes[vip]; strings.Join(got, ",") != strings.Join(hops, ",") {
			add("%v routes %v, want %v", vip, got, hops)
		}
		if !p.hmark[vip] {
			add("%v has no HMARK rule", vip)
		}
	}
	for vip := range p.routes {
		if _, ok := want[vip]; !ok {
			add("%v has routes but no surviving admitted Service claims it", vip)
		}
	}
	for vip := range p.hmark {
		if _, ok := want[vip]; !ok {
			add("%v has an HMARK rule but no surviving admitted Service claims it", vip)
		}
	}
	if p.rules != buckets {
		add("%d bucket rules, want %d", p.rules, buckets)
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// lateCalls is a router.Programmer that counts the calls made once the
// controller's Run has returned: none should come after that.
// It also counts the resyncs.
type lateCalls struct {
	router.Programmer
	returned atomic.Bool
	calls    atomic.Int64
	resyncs  atomic.Int64
}

func (l *lateCalls) note() {
	if l.returned.Load() {
		l.calls.Add(1)
	}
}

func (l *lateCalls) Resync(ts []datapath.Tunnel) error {
	l.note()
	l.resyncs.Add(1)
	return l.Programmer.Resync(ts)
}

func (l *lateCalls) SetTunnel(t datapath.Tunnel) error {
	l.note()
	return l.Programmer.SetTunnel(t)
}

func (l *lateCalls) RemoveTunnel(vip netip.Addr) error {
	l.note()
	return l.Programmer.RemoveTunnel(vip)
}

// runningRouter is the router's controller running until stop, which the
// test calls itself (before its leak check), or the cleanup does.
type runningRouter struct {
	ctrl    *router.Controller
	dp      *lateCalls
	factory informers.SharedInformerFactory
	cancel  context.CancelFunc
	done    chan struct{} // closed when Run has returned, with err
	err     error
	once    sync.Once
}

// runRouter runs the router's controller with restCfg (the router's
// ServiceAccount) and dp, and waits until its first full sync is done.
func runRouter(t *testing.T, cfg router.Config, restCfg *rest.Config, dp router.Programmer) *runningRouter {
	t.Helper()
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	factory := informers.NewSharedInformerFactory(client, 0)
	late := &lateCalls{Programmer: dp}
	ctrl, err := router.NewController(cfg, client, factory, late, router.NewEventRecorder(ctx, client, "tunnel-router", "test-node"), quietLogger())
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	r := &runningRouter{ctrl: ctrl, dp: late, factory: factory, cancel: cancel, done: make(chan struct{})}
	go func() { r.err = ctrl.Run(ctx); close(r.done) }()
	t.Cleanup(func() { r.stop(t) })
	eventually(t, 60*time.Second, "router ready (first full sync as the tunnel-router ServiceAccount)", func() error {
		if !ctrl.Ready() {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	return r
}

// stop cancels the controller, waits for Run to return and shuts the
// informers down. Datapath calls made after Run returned are counted in
// r.dp.calls.
func (r *runningRouter) stop(t *testing.T) {
	r.once.Do(func() {
		r.cancel()
		<-r.done
		if r.err != nil {
			t.Errorf("router controller: %v", r.err)
		}
		r.dp.returned.Store(true)
		r.factory.Shutdown()
	})
}

// runningAgent is the endpoint agent's controller running until stop.
type runningAgent struct {
	ctrl   *endpoint.Controller
	inf    endpoint.Informers
	cancel context.CancelFunc
	done   chan struct{} // closed when Run has returned, with err
	err    error
	once   sync.Once
}

// runAgent runs the endpoint agent's controller for nodeName with restCfg
// (the tunnel-endpoint ServiceAccount), finding pods' namespaces by their IP
// (runtime.NewByIP) and changing the real pod and node namespaces (a VXLAN
// device stands in for GRE), and waits until it is ready.
func runAgent(t *testing.T, cfg endpoint.Config, restCfg *rest.Config, node *testnetns.NS) *runningAgent {
	t.Helper()
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	inf := endpoint.NewInformers(client, cfg.NodeName)
	pods := endpoint.NewPodNetwork(cfg, node.Handle).WithDevice(testnetns.VXLANDecap{})
	ctrl, err := endpoint.NewController(cfg, inf, runtime.NewByIP(), pods, endpoint.NewNodeNetwork(cfg, node.Handle), quietLogger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	inf.Start(ctx.Done())
	a := &runningAgent{ctrl: ctrl, inf: inf, cancel: cancel, done: make(chan struct{})}
	go func() { a.err = ctrl.Run(ctx); close(a.done) }()
	t.Cleanup(func() { a.stop(t) })
	eventually(t, 60*time.Second, "endpoint agent ready (informers synced as the tunnel-endpoint ServiceAccount)", func() error {
		if !ctrl.Ready() {
			return fmt.Errorf("not ready")
		}
		return nil
	})
	return a
}

func (a *runningAgent) stop(t *testing.T) {
	a.once.Do(func() {
		a.cancel()
		<-a.done
		if a.err != nil {
			t.Errorf("endpoint controller: %v", a.err)
		}
		a.inf.Shutdown()
	})
}

func quietLogger() logrus.FieldLogger {
	l := logrus.New()
	l.Out = io.Discard
	return l
}

// robustRouterCfg is the router configuration of the robustness tests:
// few buckets (moderate kernel state), one generation (stateless, so the
// kernel state depends on the desired state only, never on its history) and
// a short resync period.
func robustRouterCfg(policy tunnelclaim.Policy) router.Config {
	cfg := routerCfg(encap.GRE, 8)
	cfg.Generations = 1
	cfg.ResyncPeriod = 2 * time.Second
	cfg.Policy = policy
	return cfg
}
