package topology

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
)

// Daemon is one of the project's daemons running in a node's namespace, or
// the gateway's BIRD (ip netns exec NS BINARY FLAGS...), its output appended
// to LogPath.
type Daemon struct {
	// Name is e.g. "tunnel-router@router-a".
	Name    string
	NS      string
	Path    string
	Args    []string
	LogPath string
	// cleanupArgs are the flags --cleanup needs (the same mode and names).
	cleanupArgs []string
	// startedLine, when set, is what the daemon logs once it handles
	// SIGTERM; Start waits for it, so that a Stop right after a Start ends
	// the daemon cleanly rather than killing it in its package init.
	startedLine string

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	starts  int
	offset  int64 // where the last start's output begins in LogPath
	waitErr error
}

// readyLine is what both daemons log once their first full sync is done
// (when /readyz turns 200).
const readyLine = "ready: the first full sync is done"

// WaitReady waits until the daemon, since its last start, has logged that
// its first full sync is done: it has read the cluster and made the
// kernel match it (or found that it did).
func (d *Daemon) WaitReady() error {
	d.mu.Lock()
	offset, exited := d.offset, d.exited
	d.mu.Unlock()
	if exited == nil {
		return fmt.Errorf("%s was never started", d.Name)
	}
	return d.waitLogged(offset, exited, readyLine)
}

// waitLogged waits until the log after offset holds line, up to
// startedTimeout.
func (d *Daemon) waitLogged(offset int64, exited chan struct{}, line string) error {
	for deadline := time.Now().Add(startedTimeout); ; {
		if b, err := os.ReadFile(d.LogPath); err == nil && int64(len(b)) > offset && bytes.Contains(b[offset:], []byte(line)) {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited before it logged %q:\n%s", d.Name, line, d.LogTail(20))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not log %q within %v:\n%s", d.Name, line, startedTimeout, d.LogTail(20))
		}
	}
}

// stopTimeout is how long Stop waits after SIGTERM before SIGKILL.
const stopTimeout = 15 * time.Second

func (l *Lab) routerDaemon(n *Node) *Daemon {
	common := []string{"--mode", l.Opts.Mode}
	args := append([]string{
		"--kubeconfig", filepath.Join(l.Opts.KubeDir, "tunnel-router.kubeconfig"),
		"--node-name", n.Name,
		// The seed comes from its Secret (writeSeedSecret), as in a cluster.
		"--buckets", fmt.Sprint(l.Opts.Buckets),
		// The lab's tunnel IPs; without a pool nothing would be served.
		"--pools", labPools(),
	}, common...)
	if l.Opts.ConntrackSync {
		args = append(args, "--conntrack-sync-interface", SyncLink,
			"--conntrack-sync-dir", filepath.Join(l.Opts.WorkDir, "conntrackd@"+n.Name),
			// Only the other routers' datagrams reach conntrackd.
			"--conntrack-sync-peers", l.syncPeers(n))
	}
	return l.daemon("tunnel-router", n, append(args, l.Opts.RouterArgs...), common)
}

func (l *Lab) agentDaemon(n *Node) *Daemon {
	common := []string{"--mode", l.Opts.Mode, "--runtime", "netns"}
	args := append([]string{
		"--kubeconfig", filepath.Join(l.Opts.KubeDir, "tunnel-endpoint.kubeconfig"),
		"--node-name", n.Name,
		// Client segments must fit the tunnel without relying on ICMP.
		"--pod-advmss", "1400",
		// The same pools as the routers': both must admit the same tunnel IPs.
		"--pools", labPools(),
	}, common...)
	return l.daemon("tunnel-endpoint", n, append(args, l.Opts.EndpointArgs...), common)
}

// labPools is the daemons' --pools: the lab's IPv4 and IPv6 tunnel IPs.
func labPools() string { return TunnelNet.String() + ";" + TunnelNet6.String() }

func (l *Lab) daemon(binary string, n *Node, args, cleanupArgs []string) *Daemon {
	name := binary + "@" + n.Name
	return &Daemon{
		Name: name, NS: n.Name, Path: filepath.Join(l.Opts.BinDir, binary), Args: args,
		LogPath: filepath.Join(l.Opts.WorkDir, name+".log"), cleanupArgs: cleanupArgs,
		startedLine: map[string]string{"tunnel-router": "starting tunnel router", "tunnel-endpoint": "starting endpoint agent"}[binary],
	}
}

// startedTimeout bounds Start's wait for the daemon's startedLine.
const startedTimeout = time.Minute

// Start starts the daemon and waits until it logs its startedLine; it fails
// if the daemon is already running or exits before that.
func (d *Daemon) Start() error {
	offset, exited, err := d.start()
	if err != nil || d.startedLine == "" {
		return err
	}
	return d.waitLogged(offset, exited, d.startedLine)
}

// start starts the process; offset is where its output begins in LogPath.
func (d *Daemon) start() (offset int64, exited chan struct{}, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd != nil {
		return 0, nil, fmt.Errorf("%s is already running", d.Name)
	}
	logFile, err := os.OpenFile(d.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, nil, err
	}
	defer logFile.Close()
	d.starts++
	fmt.Fprintf(logFile, "=== lab: start #%d: %s %s\n", d.starts, d.Path, strings.Join(d.Args, " "))
	if offset, err = logFile.Seek(0, io.SeekEnd); err != nil {
		return 0, nil, err
	}
	cmd := exec.Command(ipPath(), append([]string{"netns", "exec", d.NS, d.Path}, d.Args...)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		return 0, nil, fmt.Errorf("starting %s: %w", d.Name, err)
	}
	d.cmd, d.exited, d.offset = cmd, make(chan struct{}), offset
	go func(exited chan struct{}) {
		err := cmd.Wait()
		d.mu.Lock()
		d.waitErr = err
		d.mu.Unlock()
		close(exited)
	}(d.exited)
	return offset, d.exited, nil
}

// Running reports whether the daemon was started and has not exited.
func (d *Daemon) Running() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil {
		return false
	}
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

// Stop sends SIGTERM and waits for the exit (SIGKILL after 15 s). It
// returns an error if the daemon exited with a failure; stopping a daemon
// that is not running does nothing.
func (d *Daemon) Stop() error { return d.stop(syscall.SIGTERM) }

// Kill stops the daemon with SIGKILL, as a crash would.
func (d *Daemon) Kill() error { return d.stop(syscall.SIGKILL) }

func (d *Daemon) stop(sig syscall.Signal) error {
	d.mu.Lock()
	cmd, exited := d.cmd, d.exited
	d.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-exited:
	case <-time.After(stopTimeout):
		_ = cmd.Process.Kill()
		<-exited
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cmd = nil
	err := d.waitErr
	var exitErr *exec.ExitError
	if sig == syscall.SIGKILL && errors.As(err, &exitErr) {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("%s exited: %w", d.Name, err)
	}
	return nil
}

// Restart stops the daemon with SIGTERM and starts it again.
func (d *Daemon) Restart() error {
	if err := d.Stop(); err != nil {
		return err
	}
	return d.Start()
}

// restartWithFlag stops the daemon, sets its flag name to value (value ""
// removes the flag) and starts it again.
func (d *Daemon) restartWithFlag(name, value string) error {
	if err := d.Stop(); err != nil {
		return err
	}
	d.mu.Lock()
	args := make([]string, 0, len(d.Args)+2)
	for i := 0; i < len(d.Args); i++ {
		if d.Args[i] == name && i+1 < len(d.Args) {
			i++
			continue
		}
		args = append(args, d.Args[i])
	}
	if value != "" {
		args = append(args, name, value)
	}
	d.Args = args
	d.mu.Unlock()
	return d.Start()
}

// LogTail returns the last n lines of the daemon's log.
func (d *Daemon) LogTail(n int) string {
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return err.Error()
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// Logs returns the last n lines of every daemon's log, for a failure report.
func (l *Lab) Logs(n int) string {
	var b strings.Builder
	daemons := []*Daemon{}
	for _, node := range l.Nodes() {
		daemons = append(daemons, node.Router, node.Agent)
	}
	for _, d := range append(daemons, l.Bird) {
		if d != nil {
			fmt.Fprintf(&b, "----- %s (last %d lines)\n%s\n", d.Name, n, d.LogTail(n))
		}
	}
	return b.String()
}

// RSS returns the daemon's resident memory in KiB (VmRSS), read from
// /proc: ip netns exec runs the daemon in its own process.
func (d *Daemon) RSS() (int64, error) {
	d.mu.Lock()
	cmd := d.cmd
	d.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return 0, fmt.Errorf("%s is not running", d.Name)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kib int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kib); err != nil {
				return 0, fmt.Errorf("%s: VmRSS %q: %w", d.Name, v, err)
			}
			return kib, nil
		}
	}
	return 0, fmt.Errorf("%s: no VmRSS in /proc/%d/status", d.Name, cmd.Process.Pid)
}

// LoggedSince returns the times of the daemon's log lines that contain
// every one of words and were logged at or after since (the daemons log
// milliseconds: daemon.LogTimeFormat). Reading the log asks nothing of the
// daemon, so that a test can time what it does without scraping it.
func (d *Daemon) LoggedSince(since time.Time, words ...string) ([]time.Time, error) {
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return nil, err
	}
	var times []time.Time
	for _, line := range strings.Split(string(b), "\n") {
		if !containsAll(line, words) {
			continue
		}
		i := strings.Index(line, `time="`)
		if i < 0 {
			continue
		}
		rest := line[i+len(`time="`):]
		j := strings.IndexByte(rest, '"')
		if j < 0 {
			continue
		}
		at, err := time.Parse(daemon.LogTimeFormat, rest[:j])
		if err != nil {
			return nil, fmt.Errorf("%s log: %w", d.Name, err)
		}
		if !at.Before(since) {
			times = append(times, at)
		}
	}
	return times, nil
}

func containsAll(s string, words []string) bool {
	for _, w := range words {
		if !strings.Contains(s, w) {
			return false
		}
	}
	return true
}
