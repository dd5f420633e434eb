// Package e2e is the end-to-end lab: the project's real daemons, a real
// kube-apiserver and etcd, and a real Linux datapath (GRE, MPLS, HMARK) in
// the lab VM, driven through the scenarios of docs/testing.md ("The end-to-end lab") in both
// encapsulation modes.
//
// TestE2E runs on the host: it starts the API server, builds this package's
// test binary statically and boots the VM, which runs TestInVM. Each guest
// subtest shows up as a subtest of TestE2E.
package e2e

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// guestTimeout bounds the whole VM run: about twice what it takes on the
// slowest machine of CI's kind known (docs/testing.md, "Time budget").
const guestTimeout = 45 * time.Minute

func TestE2E(t *testing.T) {
	if lab.IsGuest() {
		t.Skip("TestE2E boots the VM; it does not run inside it")
	}
	if testing.Short() {
		t.Skip("-short: the end-to-end lab takes minutes")
	}
	consoleLog := filepath.Join(os.TempDir(), "kst-e2e-console.log")
	run := "^TestInVM$"
	if only := os.Getenv("KST_E2E_RUN"); only != "" {
		run += "/" + only // e.g. KST_E2E_RUN=gre/3_ runs one scenario in one mode
	}
	lab.RunGuestTests(t, "./test/e2e", run, guestTimeout, consoleLog)
}

// TestInVM runs every scenario in gre and then mpls mode, each mode on a
// fresh topology. Each scenario serves one dual-stack Service on a tunnel
// IP of each family and checks both families' flows at once; scenario 15
// alone is single-family (an IPv6 tunnel IP of an IPv4-only Service).
func TestInVM(t *testing.T) {
	if !lab.IsGuest() {
		t.Skip("runs inside the lab VM; TestE2E boots it")
	}
	for _, mode := range []string{"gre", "mpls"} {
		t.Run(mode, func(t *testing.T) {
			e := up(t, mode)
			for _, sc := range scenarios {
				if sc.only != "" && sc.only != mode {
					continue
				}
				start, ran := time.Now(), false
				if !t.Run(sc.name, func(t *testing.T) { ran = true; sc.run(t, e) }) {
					t.Logf("daemon logs after %s:\n%s", sc.name, e.Logs(40))
				}
				// go test -v prints a subtest's result line only when its
				// parent ends: this one shows in the console at once.
				if ran {
					t.Logf("%s took %v; %s", sc.name, time.Since(start).Round(100*time.Millisecond), lab.SoftnetReport())
				}
			}
			// Where the emulated cores went (the lab is CPU-bound): the
			// running daemons since their last start, this test binary,
			// and under it the ip and iptables processes it ran and the
			// daemons it restarted.
			t.Logf("CPU time in the VM after %s mode:\n%s", mode, lab.CPUByProcess(12))
		})
	}
}

type scenario struct {
	name string
	run  func(t *testing.T, e *env)
	// only is the one mode the scenario runs in ("": both), for one whose
	// subject does not depend on the encapsulation (make test's budget).
	only string
}

// env is one mode's lab, with a server in every pod and the client's
// namespace open.
type env struct {
	*topology.Lab
	client netns.NsHandle
	// servers are the pods' servers by pod name.
	servers map[string]*workload.Server
	// conntrackEvents record the TCP conntrack events of the gateway and
	// of each node and pod, by host name, for traceFlow.
	conntrackEvents map[string]*topology.ConntrackRecorder
}

// tunnelIPs are the scenario's tunnel IPs number i: one of each family,
// IPv4 first (192.0.2.i, 2001:db8:2::i).
func tunnelIPs(i int) []netip.Addr {
	return []netip.Addr{topology.TunnelIP(i), topology.TunnelIP6(i)}
}

// annotation is the cmd.nu/tunnel value serving vips.
func annotation(vips []netip.Addr) string {
	parts := make([]string, len(vips))
	for i, v := range vips {
		parts[i] = v.String()
	}
	return strings.Join(parts, ", ")
}

// familyName names vip's family in logs and failures.
func familyName(vip netip.Addr) string {
	if vip.Is4() {
		return "ipv4"
	}
	return "ipv6"
}

// podAddrs are the pods' addresses of vip's family.
func podAddrs(pods []*topology.Pod, vip netip.Addr) []netip.Addr {
	out := make([]netip.Addr, len(pods))
	for i, p := range pods {
		out[i] = topology.PodAddr(p, vip)
	}
	return out
}

// service is s as a dual-stack Service, with an EndpointSlice per family.
func (e *env) service(s topology.Service) topology.Service {
	s.Families = topology.DualStack
	return s
}

// applyEndpoints replaces the endpoints of the dual-stack Service name in
// both families' EndpointSlices with eps.
func (e *env) applyEndpoints(ctx context.Context, name string, eps []topology.Endpoint) error {
	return e.ApplyEndpointSlices(ctx, name, topology.DualStack, eps)
}

// inFamilies runs step for each of vips (one tunnel IP per family) at
// once, in goroutines, and returns when every step has. A step reports
// through its own t: its errors and logs are the scenario's, prefixed
// with its family; its cleanups are the scenario's; Fatal ends the step,
// and the scenario once every step has returned.
func inFamilies(t *testing.T, vips []netip.Addr, step func(t testing.TB, i int, vip netip.Addr)) {
	t.Helper()
	var wg sync.WaitGroup
	var fatal atomic.Bool
	for i, vip := range vips {
		wg.Add(1)
		go func() {
			defer wg.Done()
			step(&familyT{TB: t, prefix: familyName(vip) + ": ", fatal: &fatal}, i, vip)
		}()
	}
	wg.Wait()
	if fatal.Load() {
		t.FailNow()
	}
}

// familyT is the testing.TB of one family's step in inFamilies. Its
// Fatal and FailNow end the step's goroutine (runtime.Goexit) after
// failing the scenario, which inFamilies then stops.
type familyT struct {
	testing.TB
	prefix string
	fatal  *atomic.Bool
}

// Each method marks itself a helper, so that a line names its caller.

func (f *familyT) Errorf(format string, args ...any) {
	f.TB.Helper()
	f.TB.Errorf(f.prefix+format, args...)
}

func (f *familyT) Error(args ...any) {
	f.TB.Helper()
	f.TB.Error(append([]any{f.prefix}, args...)...)
}

func (f *familyT) Logf(format string, args ...any) {
	f.TB.Helper()
	f.TB.Logf(f.prefix+format, args...)
}

func (f *familyT) Log(args ...any) {
	f.TB.Helper()
	f.TB.Log(append([]any{f.prefix}, args...)...)
}

func (f *familyT) Fatalf(format string, args ...any) {
	f.TB.Helper()
	f.TB.Errorf(f.prefix+format, args...)
	f.FailNow()
}

func (f *familyT) Fatal(args ...any) {
	f.TB.Helper()
	f.TB.Error(append([]any{f.prefix}, args...)...)
	f.FailNow()
}

func (f *familyT) FailNow() {
	f.TB.Fail()
	f.fatal.Store(true)
	runtime.Goexit()
}

func up(t *testing.T, mode string) *env {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	// With KST_E2E_CTSYNC set, the routers share their conntrack entries
	// (conntrackd on a link of their own), as docs/draining.md advises for
	// a failover while a pod drains (scenario 9). Off by default while new
	// connections fail with it on (docs/draining.md, limits).
	l, err := topology.Up(ctx, topology.Options{Mode: mode, Log: testWriter{t}, ConntrackSync: os.Getenv("KST_E2E_CTSYNC") != ""})
	t.Cleanup(func() {
		if err := l.Down(context.Background()); err != nil {
			t.Errorf("tearing the lab down: %v", err)
		}
	})
	if err != nil {
		t.Fatalf("lab up: %v\n%s", err, l.Logs(30))
	}
	servers := map[string]*workload.Server{}
	for _, p := range l.Pods {
		ns, err := p.NS()
		if err != nil {
			t.Fatal(err)
		}
		srv, err := workload.Serve(ns, p.Name, []int{topology.TCPPort}, []int{topology.UDPPort})
		ns.Close()
		if err != nil {
			t.Fatalf("server in %s: %v", p.Name, err)
		}
		t.Cleanup(func() { _ = srv.Close() })
		servers[p.Name] = srv
	}
	client, err := l.Client.NS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	recorders := map[string]*topology.ConntrackRecorder{}
	if os.Getenv("KST_E2E_TRACE") == "" {
		// Listening to every namespace's conntrack events costs the
		// emulated CPUs a netlink message per event: on request only.
		t.Logf("lab up in %s mode in %v", mode, time.Since(start).Round(time.Millisecond))
		return &env{Lab: l, client: client, servers: servers}
	}
	hosts := []*topology.Host{l.Gateway}
	for _, n := range append(slices.Clone(l.Routers), l.Workers...) {
		hosts = append(hosts, &n.Host)
	}
	for _, p := range l.Pods {
		hosts = append(hosts, &p.Host)
	}
	for _, h := range hosts {
		ns, err := h.NS()
		if err != nil {
			t.Fatal(err)
		}
		rec, err := topology.RecordConntrack(ns)
		ns.Close()
		if err != nil {
			t.Fatalf("%s: %v", h.Name, err)
		}
		t.Cleanup(rec.Close)
		recorders[h.Name] = rec
	}
	t.Logf("lab up in %s mode in %v", mode, time.Since(start).Round(time.Millisecond))
	return &env{Lab: l, client: client, servers: servers, conntrackEvents: recorders}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
