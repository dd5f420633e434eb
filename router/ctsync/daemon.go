package ctsync

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
)

// DefaultRefresh is how often the router makes conntrackd send its whole
// cache. The router's entries for flows it sees only one way live
// nf_conntrack_tcp_timeout_unacknowledged (300 s) after their last packet,
// and a copy gets the timeout its entry had when it was sent, so the
// refresh must come well within that.
const DefaultRefresh = 60 * time.Second

// Restart back-off after conntrackd exits on its own.
const (
	minBackoff = time.Second
	maxBackoff = 30 * time.Second
)

// stopTimeout is how long Stop waits after SIGTERM before SIGKILL.
const stopTimeout = 5 * time.Second

// Daemon keeps conntrackd running with the configuration of the current
// pools.
//
// conntrackd keeps a cache of the entries it sends (its internal cache),
// and fills it at start by reading the whole kernel table: the copies of
// the other routers' entries included, which it would then treat as this
// router's own (send them again with every bulk send, long after their
// flows ended, and send their expiry as the end of the flow, deleting the
// live entry on the router that owns it). So right after each start, once
// conntrackd answers, Daemon empties that cache (conntrackd -f internal);
// the entries of this router come back into it with their next event (a
// new flow, a change of TCP state), the copies never do (conntrackd
// ignores the events of its own writes). If the cache cannot be emptied,
// conntrackd is stopped and started again later.
//
// conntrackd takes sync messages from anyone who reaches its port, and
// writes what they say into the kernel table. So before each start, and
// at every refresh, Daemon makes sure the namespace holds the filter of
// that port (EnsurePortFilter: the port's datagrams from the peers on the
// sync link only), and conntrackd runs only behind it: when the filter
// cannot be written, conntrackd is stopped and the filter tried again
// later. The filter stays when Run returns: a restarted router finds it
// current and keeps its counters; the router removes it when it runs
// without sync, and at --cleanup (RemovePortFilter).
type Daemon struct {
	// Binary is conntrackd's path or name.
	Binary string
	// Config is the sync link and directory; its Prefixes are replaced by
	// Pools at every start and refresh.
	Config Config
	// Pools returns the current address pools.
	Pools func() []netip.Prefix
	// Refresh is the period of the bulk send and of the pools' check.
	Refresh time.Duration
	Log     logrus.FieldLogger

	// start and command are the process seams (exec by default).
	start   func(binary string, args []string, log func(string)) (process, error)
	command func(ctx context.Context, binary string, args ...string) ([]byte, error)
	// enter, when set, runs on the thread that forks conntrackd before it
	// does (tests: enter a network namespace); that thread is then thrown
	// away with the process.
	enter func() error
	// guard writes the filter of conntrackd's port (EnsurePortFilter in
	// the router's namespace by default).
	guard func(PortFilter) (PortFilterState, bool, error)
}

// process is a started conntrackd.
type process interface {
	// Exited receives Wait's result once.
	Exited() <-chan error
	// Stop ends the process (SIGTERM, then SIGKILL) and waits for it.
	Stop()
}

// Run keeps conntrackd running until ctx ends, then stops it. It returns
// at once, with an error, if the configuration can never run.
func (d *Daemon) Run(ctx context.Context) error {
	if err := d.Config.Validate(); err != nil {
		return err
	}
	if d.Refresh <= 0 {
		d.Refresh = DefaultRefresh
	}
	if d.start == nil {
		d.start = func(binary string, args []string, log func(string)) (process, error) {
			return startExec(binary, args, log, d.enter)
		}
	}
	if d.command == nil {
		d.command = runExec
	}
	if d.guard == nil {
		d.guard = func(f PortFilter) (PortFilterState, bool, error) { return EnsurePortFilter(netns.None(), f) }
	}
	if len(d.Config.Peers) == 0 {
		d.Log.WithField("interface", d.Config.Interface).Warn("no --conntrack-sync-peers: any host on the sync link can write conntrack entries, marks included, into this router's table; " +
			"the filter of conntrackd's port keeps out only what arrives on other interfaces (set the other routers' addresses on the link)")
	}
	if err := os.MkdirAll(d.Config.Dir, 0o700); err != nil {
		return fmt.Errorf("ctsync: %w", err)
	}
	var (
		proc      process
		exited    <-chan error
		running   string // the configuration proc runs with
		backoff   = minBackoff
		retry     = time.NewTimer(0) // start at once
		refresh   = time.NewTicker(d.Refresh)
		noPoolAt  string
		startedAt time.Time
		// backingOff is true while retry is armed after a failure.
		backingOff = true // the first start, at once
	)
	defer refresh.Stop()
	defer retry.Stop()
	stop := func() {
		if proc != nil {
			proc.Stop()
			proc, exited, running = nil, nil, ""
		}
	}
	defer stop()
	// retryLater logs why conntrackd does not run, and when it is tried
	// again.
	retryLater := func(err error, msg string) {
		d.Log.WithError(err).WithField("retry_in", backoff).Error(msg)
		retry.Reset(backoff)
		backingOff = true
		backoff = min(2*backoff, maxBackoff)
	}
	// launch starts conntrackd with conf, or explains why not and when it
	// tries again.
	launch := func(conf string) {
		if err := d.prepare(conf); err != nil {
			retryLater(err, "conntrackd not started: flows will not survive a router failover")
			return
		}
		p, err := d.start(d.Binary, []string{"-C", d.Config.ConfigFile()}, d.logLine)
		if err == nil {
			if err = d.emptyCache(ctx); err != nil {
				p.Stop()
			}
		}
		if err != nil {
			retryLater(err, "conntrackd not started: flows will not survive a router failover")
			return
		}
		proc, exited, running, startedAt = p, p.Exited(), conf, time.Now()
		d.Log.WithFields(logrus.Fields{"interface": d.Config.Interface, "address": d.Config.Address, "group": d.Config.Group,
			"pools": d.prefixes()}).Info("conntrackd started: sharing the tunnel IPs' conntrack entries with the other routers")
	}
	// ensureFilter makes sure the filter of conntrackd's port is there,
	// and says when it dropped datagrams; when it cannot, it stops
	// conntrackd and returns false.
	var dropped uint64 // the filter's count at its last check
	ensureFilter := func() bool {
		st, changed, err := d.guard(d.Config.PortFilter())
		if err != nil {
			stop()
			retryLater(err, "conntrackd not running: the filter of its port cannot be written, and conntrackd would take sync messages from anyone")
			return false
		}
		if changed {
			d.Log.WithField("rules", st.Rules).Info("wrote the filter of conntrackd's port (nftables table ip " + PortFilterTable + "): sync messages only from the peers on the sync link")
			dropped = 0
		}
		if st.Dropped > dropped {
			d.Log.WithFields(logrus.Fields{"dropped": st.Dropped - dropped, "dropped_total": st.Dropped, "peers": d.Config.Peers, "interface": d.Config.Interface}).
				Warn("the filter of conntrackd's port dropped datagrams from outside the peers or the sync link: if a router sent them, add its address on the link to --conntrack-sync-peers (its entries do not get here)")
		}
		dropped = st.Dropped
		return true
	}
	// converge starts, restarts or stops conntrackd for the current pools.
	converge := func() {
		conf, err := d.render()
		if err != nil {
			if msg := err.Error(); msg != noPoolAt {
				d.Log.WithError(err).Warn("conntrackd not running")
				noPoolAt = msg
			}
			stop()
			return
		}
		noPoolAt = ""
		if !ensureFilter() {
			return
		}
		switch {
		case proc == nil:
			launch(conf)
		case conf != running:
			d.Log.Info("the pools changed: restarting conntrackd with the new filter")
			stop()
			launch(conf)
		default:
			ctx, cancel := context.WithTimeout(ctx, d.Refresh)
			out, err := d.command(ctx, d.Binary, "-C", d.Config.ConfigFile(), "-B")
			cancel()
			if err != nil {
				d.Log.WithError(err).WithField("output", strings.TrimSpace(string(out))).Warn("conntrackd bulk send failed: the other routers' copies may expire")
			}
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-retry.C:
			backingOff = false
			if proc == nil {
				converge()
			}
		case <-refresh.C:
			if proc == nil && backingOff {
				break // the retry timer starts it, after its back-off
			}
			converge()
			if proc != nil && time.Since(startedAt) >= d.Refresh {
				backoff = minBackoff // it ran a whole period
			}
		case err := <-exited:
			proc, exited, running = nil, nil, ""
			d.Log.WithError(err).WithField("retry_in", backoff).Error("conntrackd exited: restarting it")
			retry.Reset(backoff)
			backingOff = true
			backoff = min(2*backoff, maxBackoff)
		}
	}
}

// cacheTimeout bounds the wait for a started conntrackd to answer.
const cacheTimeout = 10 * time.Second

// emptyCache empties the internal cache of the conntrackd just started
// (see Daemon), retrying until it answers on its socket.
func (d *Daemon) emptyCache(ctx context.Context) error {
	deadline := time.Now().Add(cacheTimeout)
	for {
		cctx, cancel := context.WithTimeout(ctx, cacheTimeout)
		out, err := d.command(cctx, d.Binary, "-C", d.Config.ConfigFile(), "-f", "internal")
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("ctsync: empty the cache of the conntrackd just started (conntrackd -f internal): %w: %s", err, strings.TrimSpace(string(out)))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// logLine logs a line of conntrackd's output at its own level.
func (d *Daemon) logLine(line string) {
	log := d.Log.WithField("conntrackd", line)
	switch {
	case strings.HasPrefix(line, "[ERROR]"):
		log.Error("conntrackd")
	case strings.HasPrefix(line, "[WARNING]"), strings.HasPrefix(line, "[warning]"):
		log.Warn("conntrackd")
	default:
		log.Info("conntrackd")
	}
}

func (d *Daemon) prefixes() []netip.Prefix {
	if d.Pools == nil {
		return nil
	}
	return d.Pools()
}

func (d *Daemon) render() (string, error) {
	c := d.Config
	c.Prefixes = d.prefixes()
	return Render(c)
}

// prepare writes the configuration and removes what a conntrackd that was
// killed left behind: its lock file would keep the next one from starting.
func (d *Daemon) prepare(conf string) error {
	if err := os.WriteFile(d.Config.ConfigFile(), []byte(conf), 0o600); err != nil {
		return fmt.Errorf("ctsync: write the configuration: %w", err)
	}
	for _, f := range []string{d.Config.LockFile(), d.Config.SocketPath()} {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("ctsync: remove %s: %w", f, err)
		}
	}
	return nil
}

// execProcess is conntrackd run by exec.
type execProcess struct {
	cmd    *exec.Cmd
	exited chan error
	done   chan struct{} // closed once Wait returned
}

func (p *execProcess) Exited() <-chan error { return p.exited }

func (p *execProcess) Stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// startExec starts conntrackd in the foreground (its console mode logs to
// stdout), each line of its output passed to log. The thread that forks it
// stays locked until it exits: Pdeathsig fires when that thread ends, and
// then conntrackd dies with the router instead of lingering (a restarted
// router starts its own).
func startExec(binary string, args []string, log func(string), enter func() error) (process, error) {
	cmd := exec.Command(binary, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = cmd.Stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &execProcess{cmd: cmd, exited: make(chan error, 1), done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if enter == nil {
			defer runtime.UnlockOSThread()
		} else if err := enter(); err != nil {
			started <- fmt.Errorf("ctsync: start %s: %w", binary, err)
			return
		}
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("ctsync: start %s: %w", binary, err)
			return
		}
		started <- nil
		logLines(out, log)
		err := cmd.Wait()
		close(p.done)
		p.exited <- err
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return p, nil
}

// conntrackdPrefix is the timestamp and pid conntrackd starts its lines
// with; the structured log has both.
var conntrackdPrefix = regexp.MustCompile(`^\[[^]]*\] \(pid=\d+\) `)

// logLines passes each line of r to log, without conntrackd's own
// timestamp and pid, until r ends.
func logLines(r io.Reader, log func(string)) {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 0, 4096), 1<<20)
	for s.Scan() {
		if line := strings.TrimSpace(conntrackdPrefix.ReplaceAllString(s.Text(), "")); line != "" {
			log(line)
		}
	}
	// A line longer than the buffer stops the scanner: keep reading, so
	// that conntrackd never blocks on a full pipe.
	_, _ = io.Copy(io.Discard, r)
}

func runExec(ctx context.Context, binary string, args ...string) ([]byte, error) {
	return exec.CommandContext(ctx, binary, args...).CombinedOutput()
}
