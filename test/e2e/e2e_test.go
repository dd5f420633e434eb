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
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
	"github.com/cmdnu/kube-service-tunnel/test/lab/workload"
)

// guestTimeout bounds the whole VM run.
const guestTimeout = 35 * time.Minute

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
		run += "/" + only // e.g. KST_E2E_RUN=gre/4_ runs one scenario in one mode
	}
	lab.RunGuestTests(t, "./test/e2e", run, guestTimeout, consoleLog)
}

// TestInVM runs every scenario in gre and then mpls mode, each mode on a
// fresh topology.
func TestInVM(t *testing.T) {
	if !lab.IsGuest() {
		t.Skip("runs inside the lab VM; TestE2E boots it")
	}
	for _, mode := range []string{"gre", "mpls"} {
		t.Run(mode, func(t *testing.T) {
			e := up(t, mode)
			for _, sc := range scenarios {
				if !t.Run(sc.name, func(t *testing.T) { sc.run(t, e) }) {
					t.Logf("daemon logs after %s:\n%s", sc.name, e.Logs(40))
				}
			}
			// The same lab again, for IPv6 tunnel IPs carried to the pods'
			// IPv6 addresses.
			t.Run("ipv6", func(t *testing.T) {
				e6 := *e
				e6.ipv6 = true
				for _, sc := range ipv6Scenarios {
					if !t.Run(sc.name, func(t *testing.T) { sc.run(t, &e6) }) {
						t.Logf("daemon logs after ipv6/%s:\n%s", sc.name, e.Logs(40))
					}
				}
			})
		})
	}
}

type scenario struct {
	name string
	run  func(t *testing.T, e *env)
}

// env is one mode's lab, with a server in every pod and the client's
// namespace open.
type env struct {
	*topology.Lab
	client netns.NsHandle
	// servers are the pods' servers by pod name.
	servers map[string]*workload.Server
	// ipv6 makes the family-generic scenarios use IPv6 tunnel IPs, carried
	// to the pods' IPv6 addresses of dual-stack Services, and the client's
	// IPv6 address (see tunnelIP, podAddr, service).
	ipv6 bool
}

// tunnelIP is the scenario's tunnel IP number i of the env's family.
func (e *env) tunnelIP(i int) netip.Addr {
	if e.ipv6 {
		return topology.TunnelIP6(i)
	}
	return topology.TunnelIP(i)
}

// clientAddr is the client's address of the env's family.
func (e *env) clientAddr() netip.Addr {
	if e.ipv6 {
		return topology.ClientAddr6
	}
	return topology.ClientAddr
}

// podAddr is p's address of the env's family: where its tunnel IPs are
// carried.
func (e *env) podAddr(p *topology.Pod) netip.Addr {
	if e.ipv6 {
		return p.Addr6
	}
	return p.Addr
}

// podAddrs are the pods' addresses of the env's family.
func (e *env) podAddrs(pods []*topology.Pod) []netip.Addr {
	out := make([]netip.Addr, len(pods))
	for i, p := range pods {
		out[i] = e.podAddr(p)
	}
	return out
}

// service is s as the env's family needs it: for IPv6, a dual-stack
// Service, whose IPv6 EndpointSlice carries the pods' IPv6 addresses.
func (e *env) service(s topology.Service) topology.Service {
	if e.ipv6 {
		s.Families = topology.DualStack
	}
	return s
}

// applyEndpoints replaces the endpoints of Service name, created by
// e.service, with eps.
func (e *env) applyEndpoints(ctx context.Context, name string, eps []topology.Endpoint) error {
	if e.ipv6 {
		return e.ApplyEndpointSlices(ctx, name, topology.DualStack, eps)
	}
	return e.ApplyEndpoints(ctx, name, eps)
}

func up(t *testing.T, mode string) *env {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	l, err := topology.Up(ctx, topology.Options{Mode: mode, Log: testWriter{t}})
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
	t.Logf("lab up in %s mode in %v", mode, time.Since(start).Round(time.Millisecond))
	return &env{Lab: l, client: client, servers: servers}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
