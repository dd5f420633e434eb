// Package bgppeer runs a real BGP daemon, BIRD 2 (Debian's bird2), as the
// peer of the code under test inside a test network namespace, so that
// integration tests can check what the router's embedded GoBGP speaker
// announces the way a real upstream router sees it: BGP session state, the
// routes in BIRD's table and the (ECMP) routes BIRD installs in the peer's
// kernel. It is imported only by tests.
//
// Each Peer is one bird process started inside the namespace, with its
// configuration, control socket and log in the test's temporary directory.
// The peer imports every route its neighbors announce and exports nothing
// but the prefixes it is told to originate. Its kernel protocol merges
// equal-cost BGP paths into one multipath route ("merge paths on"), so two
// nodes announcing the same prefix show up as one kernel route with two next
// hops.
//
// Timers are set for tests rather than for the Internet: BIRD connects one
// second after start (default 5), retries a failed connection every second
// (default 120) and, after a BGP error (hold timer expired, BFD down, an
// error NOTIFICATION), keeps the session idle for 1 to 5 seconds (error wait
// time, default 60 to 300), so a session comes back quickly. A connection
// that is merely closed, as by a restarting speaker, is not such an error.
package bgppeer

import (
	"errors"
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

	"github.com/cmdnu/kube-service-tunnel/internal/testnetns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// PollInterval is how often the Wait functions look at the peer; it bounds
// the resolution of the durations they measure.
const PollInterval = 20 * time.Millisecond

// Neighbor is one BGP session of the peer, a BIRD "protocol bgp".
type Neighbor struct {
	// Name is the BIRD protocol name, used by Established and shown as
	// Route.FromNeighbor: letters, digits and underscores, starting with a
	// letter, and not a BIRD keyword (such as "router", "bgp" or "direct").
	Name string
	// Address is the neighbor's IPv4 address (the code under test).
	Address netip.Addr
	// ASN is the neighbor's AS; equal to Config.ASN makes an iBGP session.
	ASN uint32
	// Password enables TCP MD5 signatures (RFC 2385); it must not contain
	// a double quote or a newline.
	Password string
	// HoldTime and KeepaliveTime are whole seconds; zero keeps BIRD's
	// defaults (240 s and a third of the hold time).
	HoldTime, KeepaliveTime time.Duration
	// Multihop is the session's TTL for a neighbor that is not on a
	// directly connected network; zero means a direct session.
	Multihop int
	// BFD ties the session to a BFD session with Config.BFD's timers.
	BFD bool
	// Passive makes BIRD only accept the neighbor's connection, never
	// open one.
	Passive bool
}

// BFDIntervals are the peer's BFD timers; zero fields keep BIRD's defaults
// (min tx 100 ms, min rx 10 ms, multiplier 5).
type BFDIntervals struct {
	MinTx, MinRx time.Duration
	Multiplier   int
}

// Config describes one BIRD peer. Only IPv4 is supported.
type Config struct {
	// RouterID is the peer's BGP identifier (an IPv4 address).
	RouterID netip.Addr
	// ASN is the peer's own AS.
	ASN       uint32
	Neighbors []Neighbor
	// BFD sets the timers of the sessions of neighbors with BFD set.
	BFD BFDIntervals
	// Originate lists the prefixes the peer announces to every neighbor
	// (as blackhole static routes, which stay out of its own kernel).
	Originate []netip.Prefix
}

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
	out, err := exec.Command("birdc", append([]string{"-s", p.sock}, args...)...).CombinedOutput()
	s := string(out)
	if first, rest, ok := strings.Cut(s, "\n"); ok && strings.HasPrefix(first, "BIRD ") && strings.HasSuffix(first, " ready.") {
		s = rest
	}
	if err != nil {
		return s, fmt.Errorf("birdc %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(s))
	}
	return s, nil
}

// Established reports whether the BGP session of the neighbor called name
// is established, with BIRD's state and info columns (for example
// "up Established" or "start Active Socket: Connection refused").
func (p *Peer) Established(name string) (bool, string, error) {
	out, err := p.Birdc("show", "protocols", name)
	if err != nil {
		return false, "", err
	}
	return parseProtocol(out, name)
}

// parseProtocol finds the line of protocol name in the output of
// "show protocols" and returns whether it is an established session and its
// State and Info columns.
func parseProtocol(out, name string) (bool, string, error) {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		// Name Proto Table State Since Info...
		if len(f) < 5 || f[0] != name {
			continue
		}
		state := strings.Join(append([]string{f[3]}, f[5:]...), " ")
		return f[3] == "up" && len(f) > 5 && f[5] == "Established", state, nil
	}
	return false, "", fmt.Errorf("no protocol %q in birdc output: %s", name, strings.TrimSpace(out))
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
	family := netlink.FAMILY_V4
	if prefix.Addr().Is6() {
		family = netlink.FAMILY_V6
	}
	filter := &netlink.Route{Dst: testnetns.IPNet(prefix.Masked()), Table: unix.RT_TABLE_MAIN}
	routes, err := p.nl.RouteListFiltered(family, filter, netlink.RT_FILTER_DST|netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("list kernel routes for %s: %w", prefix, err)
	}
	var hops []netip.Addr
	add := func(gw []byte) {
		if a, ok := netip.AddrFromSlice(gw); ok {
			hops = append(hops, a.Unmap())
		}
	}
	for _, r := range routes {
		add(r.Gw)
		for _, nh := range r.MultiPath {
			add(nh.Gw)
		}
	}
	slices.SortFunc(hops, netip.Addr.Compare)
	return hops, nil
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

var symbolRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]*$`)

// renderConfig returns the BIRD configuration for cfg, logging to logFile.
func renderConfig(cfg Config, logFile string) (string, error) {
	if !cfg.RouterID.Is4() {
		return "", fmt.Errorf("router id %v: must be an IPv4 address", cfg.RouterID)
	}
	if cfg.ASN == 0 {
		return "", errors.New("ASN must be set")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Written by test/bgppeer.\nlog %q all;\n", logFile)
	b.WriteString("debug protocols { states, events };\n")
	fmt.Fprintf(&b, "router id %s;\n\n", cfg.RouterID)
	b.WriteString("protocol device {}\n\n")
	// Only BGP routes go to the kernel, so the originated blackholes stay
	// out of it; merge paths turns equal BGP routes into a multipath route.
	b.WriteString("protocol kernel {\n\tipv4 { import none; export where source = RTS_BGP; };\n\tmerge paths on;\n}\n")

	export := "none"
	if len(cfg.Originate) > 0 {
		export = "where source = RTS_STATIC"
		b.WriteString("\nprotocol static originated {\n\tipv4;\n")
		for _, p := range cfg.Originate {
			if !p.IsValid() || !p.Addr().Is4() || p.Masked() != p {
				return "", fmt.Errorf("originate %v: must be an IPv4 prefix without host bits", p)
			}
			fmt.Fprintf(&b, "\troute %s blackhole;\n", p)
		}
		b.WriteString("}\n")
	}

	bfd := false
	seen := map[string]bool{"device1": true, "kernel1": true, "originated": true, "bfd1": true}
	for _, n := range cfg.Neighbors {
		if !symbolRE.MatchString(n.Name) || seen[n.Name] {
			return "", fmt.Errorf("neighbor name %q: must be unique, start with a letter and hold only letters, digits and underscores", n.Name)
		}
		seen[n.Name] = true
		if !n.Address.Is4() {
			return "", fmt.Errorf("neighbor %s: address %v must be IPv4", n.Name, n.Address)
		}
		if n.ASN == 0 {
			return "", fmt.Errorf("neighbor %s: ASN must be set", n.Name)
		}
		fmt.Fprintf(&b, "\nprotocol bgp %s {\n\tlocal as %d;\n\tneighbor %s as %d;\n", n.Name, cfg.ASN, n.Address, n.ASN)
		if n.Multihop < 0 || n.Multihop > 255 {
			return "", fmt.Errorf("neighbor %s: multihop %d out of 0..255", n.Name, n.Multihop)
		}
		if n.Multihop == 0 {
			b.WriteString("\tdirect;\n")
		} else {
			fmt.Fprintf(&b, "\tmultihop %d;\n", n.Multihop)
		}
		b.WriteString("\tconnect delay time 1;\n\tconnect retry time 1;\n\terror wait time 1, 5;\n")
		for _, t := range []struct {
			name string
			d    time.Duration
		}{{"hold time", n.HoldTime}, {"keepalive time", n.KeepaliveTime}} {
			if t.d == 0 {
				continue
			}
			if t.d < 0 || t.d%time.Second != 0 {
				return "", fmt.Errorf("neighbor %s: %s %v must be whole seconds", n.Name, t.name, t.d)
			}
			fmt.Fprintf(&b, "\t%s %d;\n", t.name, t.d/time.Second)
		}
		if n.Password != "" {
			if strings.ContainsAny(n.Password, "\"\n") {
				return "", fmt.Errorf("neighbor %s: password must not contain a double quote or a newline", n.Name)
			}
			fmt.Fprintf(&b, "\tpassword \"%s\";\n", n.Password)
		}
		if n.Passive {
			b.WriteString("\tpassive on;\n")
		}
		if n.BFD {
			bfd = true
			b.WriteString("\tbfd on;\n")
		}
		fmt.Fprintf(&b, "\tipv4 { import all; export %s; };\n}\n", export)
	}

	if bfd {
		var timers strings.Builder
		for _, t := range []struct {
			name string
			d    time.Duration
		}{{"min tx interval", cfg.BFD.MinTx}, {"min rx interval", cfg.BFD.MinRx}} {
			if t.d == 0 {
				continue
			}
			if t.d < 0 || t.d%time.Microsecond != 0 {
				return "", fmt.Errorf("BFD %s %v must be whole microseconds", t.name, t.d)
			}
			fmt.Fprintf(&timers, " %s %d us;", t.name, t.d/time.Microsecond)
		}
		if cfg.BFD.Multiplier < 0 || cfg.BFD.Multiplier > 255 {
			return "", fmt.Errorf("BFD multiplier %d out of 0..255", cfg.BFD.Multiplier)
		}
		if cfg.BFD.Multiplier > 0 {
			fmt.Fprintf(&timers, " multiplier %d;", cfg.BFD.Multiplier)
		}
		fmt.Fprintf(&b, "\nprotocol bfd {\n\tinterface \"*\" {%s };\n\tmultihop {%s };\n}\n", timers.String(), timers.String())
	}
	return b.String(), nil
}
