// Package bgppeer runs a real BGP daemon, BIRD 2 (Debian's bird2), as the
// peer of the code under test inside a test network namespace, so that
// integration tests can check what the router's embedded GoBGP speaker
// announces the way a real upstream router sees it: BGP session state, the
// routes in BIRD's table and the (ECMP) routes BIRD installs in the peer's
// kernel. It is imported only by tests.
//
// Each Peer is one bird process started inside the namespace, with its
// configuration, control socket and log in the test's temporary directory.
// The peer imports every route its neighbors announce, over IPv4 and IPv6
// sessions alike, and exports nothing but the prefixes it is told to
// originate. Its kernel protocols merge equal-cost BGP paths into one
// multipath route ("merge paths on"), so two nodes announcing the same
// prefix show up as one kernel route with two next hops (ip route, or ip -6
// route).
//
// Timers are set for tests rather than for the Internet: BIRD connects one
// second after start (default 5), retries a failed connection every second
// (default 120) and, after a BGP error (hold timer expired, BFD down, an
// error NOTIFICATION), keeps the session idle for 1 to 5 seconds (error wait
// time, default 60 to 300), so a session comes back quickly. A connection
// that is merely closed, as by a restarting speaker, is not such an error.
package bgppeer

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/bgppeer/birdconf"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
	"github.com/vishvananda/netlink"
)

// PollInterval is how often the Wait functions look at the peer; it bounds
// the resolution of the durations they measure.
const PollInterval = 20 * time.Millisecond

// The peer's configuration types live in package birdconf, which renders
// them without importing testing (the lab's VM gateway uses it too).
type (
	Neighbor     = birdconf.Neighbor
	BFDIntervals = birdconf.BFDIntervals
	Config       = birdconf.Config
)

// Route is one route of BIRD's table for a prefix.
type Route struct {
	// NextHop is the BGP NEXT_HOP the neighbor announced, or the gateway
	// for a route that did not come from BGP (invalid when it has none).
	NextHop netip.Addr
	// FromNeighbor is the BIRD protocol the route came from: the
	// Neighbor.Name for BGP routes.
	FromNeighbor string
	// ASPath is BGP.as_path as BIRD prints it ("65001 65002"), empty for
	// a route originated inside the neighbor's AS.
	ASPath string
	// Primary is true for the route BIRD selected as best.
	Primary bool
}

// Peer is a running bird process inside a test namespace.
type Peer struct {
	tb      testing.TB
	ns      *testnetns.NS
	nl      *netlink.Handle
	sock    string
	logFile string
	errFile string
	cmd     *exec.Cmd

	exited  chan struct{} // closed when bird has exited
	waitErr error         // bird's exit status, valid once exited is closed

	mu       sync.Mutex
	stopping bool // Stop or Kill was called: an exit is expected
}

// RequireBird skips the test when BIRD 2 (bird and birdc) is not installed,
// or fails it when KST_REQUIRE_INTEGRATION=1.
func RequireBird(tb testing.TB) {
	tb.Helper()
	for _, bin := range []string{"bird", "birdc"} {
		if _, err := exec.LookPath(bin); err != nil {
			msg := fmt.Sprintf("%s not found (apt-get install bird2, or make deps): %v", bin, err)
			if os.Getenv("KST_REQUIRE_INTEGRATION") == "1" {
				tb.Fatalf("KST_REQUIRE_INTEGRATION=1 but %s", msg)
			}
			tb.Skip(msg)
		}
	}
}

// Start writes a BIRD configuration for cfg into a temporary directory,
// runs bird inside ns and waits until it answers on its control socket.
// Bird is stopped when the test ends; the test fails then if bird exited by
// itself earlier, and bird's log is printed when the test failed. Start
// skips the test like RequireBird.
func Start(tb testing.TB, ns *testnetns.NS, cfg Config) *Peer {
	tb.Helper()
	RequireBird(tb)
	dir := tb.TempDir()
	p := &Peer{
		tb:      tb,
		ns:      ns,
		nl:      ns.Netlink(),
		sock:    filepath.Join(dir, "bird.ctl"),
		logFile: filepath.Join(dir, "bird.log"),
		errFile: filepath.Join(dir, "bird.stderr"),
		exited:  make(chan struct{}),
	}
	if len(p.sock) > 100 { // sun_path holds 108 bytes
		short, err := os.MkdirTemp("", "bgppeer")
		if err != nil {
			tb.Fatalf("bgppeer: control socket dir: %v", err)
		}
		tb.Cleanup(func() { _ = os.RemoveAll(short) })
		p.sock = filepath.Join(short, "bird.ctl")
	}
	conf, err := renderConfig(cfg, p.logFile)
	if err != nil {
		tb.Fatalf("bgppeer: %v", err)
	}
	confFile := filepath.Join(dir, "bird.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o644); err != nil {
		tb.Fatalf("bgppeer: write config: %v", err)
	}
	stderr, err := os.Create(p.errFile)
	if err != nil {
		tb.Fatalf("bgppeer: %v", err)
	}
	defer stderr.Close() // the child has its own copy
	p.cmd = exec.Command("bird", "-f", "-c", confFile, "-s", p.sock)
	p.cmd.Stdout, p.cmd.Stderr = stderr, stderr
	// Pdeathsig fires when the forking thread exits, so the thread that
	// starts bird lives (locked, inside ns) until bird exits: if the test
	// binary dies, bird dies with it instead of lingering.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started := make(chan error, 1)
	go func() {
		_ = ns.Do(func() error {
			if err := p.cmd.Start(); err != nil {
				started <- err
				return err
			}
			started <- nil
			p.waitErr = p.cmd.Wait()
			close(p.exited)
			return nil
		})
	}()
	if err := <-started; err != nil {
		tb.Fatalf("bgppeer: start bird: %v", err)
	}
	tb.Cleanup(p.cleanup)

	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := p.Birdc("show", "status")
		if err == nil && strings.Contains(out, "Daemon is up and running") {
			break
		}
		select {
		case <-p.exited:
			tb.Fatalf("bgppeer: bird exited at start: %v\n%s", p.waitErr, p.logTail())
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("bgppeer: bird not up after 10s: %v: %s\n%s", err, out, p.logTail())
		}
		time.Sleep(PollInterval)
	}
	return p
}

func (p *Peer) cleanup() {
	var crashed error
	select {
	case <-p.exited:
		p.mu.Lock()
		if !p.stopping {
			crashed = fmt.Errorf("bird exited by itself: %v", p.waitErr)
		}
		p.mu.Unlock()
	default:
	}
	p.Stop()
	if crashed != nil {
		p.tb.Errorf("bgppeer: %v", crashed)
	}
	if p.tb.Failed() {
		p.tb.Logf("bgppeer: bird (%s) output:\n%s", p.sock, p.logTail())
	}
}

// Stop shuts bird down gracefully (SIGTERM: it closes its sessions with a
// BGP Cease, so neighbors withdraw its routes at once), killing it if it has
// not exited after 5 seconds. It is safe to call more than once.
func (p *Peer) Stop() { p.signal(syscall.SIGTERM, 5*time.Second) }

// Kill kills bird with SIGKILL, as a crash would: no BGP Cease is sent, but
// the kernel still closes the TCP sessions, so neighbors notice at once. To
// make the peer go silent (hold timer, BFD), take its link down instead.
func (p *Peer) Kill() { p.signal(syscall.SIGKILL, 0) }

func (p *Peer) signal(sig syscall.Signal, grace time.Duration) {
	p.mu.Lock()
	p.stopping = true
	p.mu.Unlock()
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	if grace > 0 {
		select {
		case <-p.exited:
			return
		case <-time.After(grace):
			p.tb.Logf("bgppeer: bird did not exit %v after %v, killing it", sig, grace)
		}
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// logTail returns the end of bird's stderr and log file.
func (p *Peer) logTail() string {
	var b strings.Builder
	for _, f := range []string{p.errFile, p.logFile} {
		data, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintf(&b, "--- %s: %v\n", filepath.Base(f), err)
			continue
		}
		text := strings.TrimRight(string(data), "\n")
		if text == "" {
			continue
		}
		lines := strings.Split(text, "\n")
		if len(lines) > 60 {
			lines = lines[len(lines)-60:]
		}
		fmt.Fprintf(&b, "--- %s (last %d lines):\n%s\n", filepath.Base(f), len(lines), strings.Join(lines, "\n"))
	}
	return b.String()
}

// Birdc runs birdc against the peer with args (for example "show",
// "protocols", "all") and returns its output without the greeting line. The
// error is set when birdc fails, which it does for BIRD's error replies too.
func (p *Peer) Birdc(args ...string) (string, error) {
	return birdconf.Birdc(context.Background(), p.sock, args...)
}

// Established reports whether the BGP session of the neighbor called name
// is established, with BIRD's state and info columns (for example
// "up Established" or "start Active Socket: Connection refused").
func (p *Peer) Established(name string) (bool, string, error) {
	out, err := p.Birdc("show", "protocols", name)
	if err != nil {
		return false, "", err
	}
	return birdconf.ParseProtocol(out, name)
}

// Routes returns the routes of BIRD's table for exactly prefix (not a
// covering one), primary first; none when BIRD knows no such network.
func (p *Peer) Routes(prefix netip.Prefix) ([]Route, error) {
	out, err := p.Birdc("show", "route", prefix.String(), "all")
	if err != nil && !strings.Contains(out, "Network not found") {
		return nil, err
	}
	return parseRoutes(out)
}

// routeHeader matches the first line of a route in "show route ... all":
// "192.0.2.10/32        unicast [a 21:52:50.398] * (100) [AS65001i]", the
// network left out for the second and later routes of a network.
var routeHeader = regexp.MustCompile(`^(\S+)?\s+(unicast|blackhole|unreachable|prohibited)\s+\[(\S+)[^\]]*\]\s*(\*)?`)

// parseRoutes parses the output of birdc "show route PREFIX all".
func parseRoutes(out string) ([]Route, error) {
	routes := []Route{}
	var cur *Route
	var gateway netip.Addr
	finish := func() {
		if cur != nil && !cur.NextHop.IsValid() {
			cur.NextHop = gateway
		}
	}
	for _, line := range strings.Split(out, "\n") {
		trimmed := strings.TrimSpace(line)
		switch {
		case trimmed == "", strings.HasPrefix(trimmed, "Table "), trimmed == "Network not found":
			continue
		case !strings.HasPrefix(line, "\t"):
			m := routeHeader.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("unexpected line in birdc show route output: %q", line)
			}
			finish()
			routes = append(routes, Route{FromNeighbor: m[3], Primary: m[4] == "*"})
			cur, gateway = &routes[len(routes)-1], netip.Addr{}
		case cur == nil:
			return nil, fmt.Errorf("route attribute before any route in birdc output: %q", line)
		case strings.HasPrefix(trimmed, "via "):
			f := strings.Fields(trimmed)
			a, err := netip.ParseAddr(f[1])
			if err != nil {
				return nil, fmt.Errorf("gateway in %q: %w", line, err)
			}
			if !gateway.IsValid() { // the first of a multipath route
				gateway = a
			}
		case strings.HasPrefix(trimmed, "BGP.next_hop:"):
			f := strings.Fields(strings.TrimPrefix(trimmed, "BGP.next_hop:"))
			if len(f) == 0 {
				return nil, fmt.Errorf("empty next hop in %q", line)
			}
			a, err := netip.ParseAddr(f[0])
			if err != nil {
				return nil, fmt.Errorf("next hop in %q: %w", line, err)
			}
			cur.NextHop = a
		case strings.HasPrefix(trimmed, "BGP.as_path:"):
			cur.ASPath = strings.TrimSpace(strings.TrimPrefix(trimmed, "BGP.as_path:"))
		}
	}
	finish()
	return routes, nil
}

// KernelNextHops returns the sorted gateways of the route for exactly
// prefix in the main table of the peer's namespace (the next hops of a
// multipath route); none when there is no such route.
func (p *Peer) KernelNextHops(prefix netip.Prefix) ([]netip.Addr, error) {
	return birdconf.KernelNextHops(p.nl, prefix)
}

// Poll calls cond every PollInterval until it reports done and returns the
// time from start to the end of that call: how long a change made at start
// took to be seen, to within PollInterval plus one call of cond. It fails
// the test with what and cond's last state when start+timeout passes first.
func Poll(tb testing.TB, start time.Time, timeout time.Duration, what string, cond func() (done bool, state string)) time.Duration {
	tb.Helper()
	deadline := start.Add(timeout)
	for {
		done, state := cond()
		if done {
			return time.Since(start)
		}
		if time.Now().After(deadline) {
			tb.Fatalf("bgppeer: %s: not done after %v: %s", what, timeout, state)
		}
		time.Sleep(PollInterval)
	}
}

// WaitEstablished waits until the session of neighbor name is established
// and returns the time since start.
func (p *Peer) WaitEstablished(tb testing.TB, name string, start time.Time, timeout time.Duration) time.Duration {
	tb.Helper()
	return Poll(tb, start, timeout, "session "+name+" established", func() (bool, string) {
		ok, state, err := p.Established(name)
		if err != nil {
			return false, err.Error()
		}
		return ok, state
	})
}

// WaitRoutes waits until BIRD's table holds exactly n routes for prefix
// (n = 0: withdrawn) and returns the time since start.
func (p *Peer) WaitRoutes(tb testing.TB, prefix netip.Prefix, n int, start time.Time, timeout time.Duration) time.Duration {
	tb.Helper()
	return Poll(tb, start, timeout, fmt.Sprintf("%d BGP routes for %s", n, prefix), func() (bool, string) {
		routes, err := p.Routes(prefix)
		if err != nil {
			return false, err.Error()
		}
		return len(routes) == n, fmt.Sprintf("have %+v", routes)
	})
}

// WaitKernelNextHops waits until the kernel route for prefix in the peer's
// namespace has exactly the next hops want (none: no route) and returns the
// time since start.
func (p *Peer) WaitKernelNextHops(tb testing.TB, prefix netip.Prefix, start time.Time, timeout time.Duration, want ...netip.Addr) time.Duration {
	tb.Helper()
	want = slices.Clone(want)
	slices.SortFunc(want, netip.Addr.Compare)
	return Poll(tb, start, timeout, fmt.Sprintf("kernel next hops %v for %s", want, prefix), func() (bool, string) {
		hops, err := p.KernelNextHops(prefix)
		if err != nil {
			return false, err.Error()
		}
		return slices.Equal(hops, want), fmt.Sprintf("have %v", hops)
	})
}

// renderConfig returns the BIRD configuration for cfg, logging to logFile.
func renderConfig(cfg Config, logFile string) (string, error) {
	cfg.Log = logFile
	return birdconf.Render(cfg)
}
