package ctsync

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
)

// fakeProcess is a conntrackd that runs until the test ends it or Stop.
type fakeProcess struct {
	exited  chan error
	stopped chan struct{}
	once    sync.Once
}

func (p *fakeProcess) Exited() <-chan error { return p.exited }
func (p *fakeProcess) Stop()                { p.once.Do(func() { close(p.stopped) }) }

// fakeExec records the starts (with the configuration each found) and the
// bulk sends.
type fakeExec struct {
	mu      sync.Mutex
	starts  []string
	procs   []*fakeProcess
	bulks   int
	flushes int
	// flushFails makes that many cache flushes fail.
	flushFails int
	started    chan struct{}
	// guards counts the writes of the port's filter (filters holds what
	// each was asked), guardFails makes that many fail, and dropped is
	// the filter's drop count each returns.
	guards     int
	filters    []PortFilter
	guardFails int
	dropped    uint64
}

func newFakeExec() *fakeExec { return &fakeExec{started: make(chan struct{}, 100)} }

func (f *fakeExec) install(d *Daemon) {
	d.start = func(binary string, args []string, log func(string)) (process, error) {
		conf, err := os.ReadFile(args[len(args)-1])
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(d.Config.LockFile()); err == nil {
			return nil, errors.New("a lock file was left behind")
		}
		p := &fakeProcess{exited: make(chan error, 1), stopped: make(chan struct{})}
		f.mu.Lock()
		if f.guards == 0 {
			f.mu.Unlock()
			return nil, errors.New("conntrackd started before its port's filter was written")
		}
		f.starts = append(f.starts, string(conf))
		f.procs = append(f.procs, p)
		f.mu.Unlock()
		// conntrackd creates its lock file; a killed one leaves it.
		if err := os.WriteFile(d.Config.LockFile(), nil, 0o600); err != nil {
			return nil, err
		}
		f.started <- struct{}{}
		return p, nil
	}
	d.guard = func(pf PortFilter) (PortFilterState, bool, error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.filters = append(f.filters, pf)
		if f.guardFails > 0 {
			f.guardFails--
			return PortFilterState{}, false, errors.New("netlink: operation not supported")
		}
		f.guards++
		return PortFilterState{Present: true, Current: true, Dropped: f.dropped}, f.guards == 1, nil
	}
	d.command = func(ctx context.Context, binary string, args ...string) ([]byte, error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		switch strings.Join(args[len(args)-2:], " ") {
		case "-f internal":
			if len(f.procs) == 0 {
				return nil, errors.New("no conntrackd runs")
			}
			if f.flushFails > 0 {
				f.flushFails--
				return []byte("connect: no such file"), errors.New("exit status 1")
			}
			f.flushes++
		default:
			if args[len(args)-1] == "-B" {
				if f.flushes < len(f.procs) {
					return nil, errors.New("a bulk send before the cache was emptied")
				}
				f.bulks++
			}
		}
		return nil, nil
	}
}

func (f *fakeExec) snapshot() (starts []string, procs []*fakeProcess, bulks int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.starts...), append([]*fakeProcess(nil), f.procs...), f.bulks
}

func (f *fakeExec) waitStart(t *testing.T) {
	t.Helper()
	select {
	case <-f.started:
	case <-time.After(10 * time.Second):
		t.Fatal("conntrackd was not started")
	}
}

// pools is a settable Pools function.
type pools struct {
	mu sync.Mutex
	p  []netip.Prefix
}

func (p *pools) get() []netip.Prefix { p.mu.Lock(); defer p.mu.Unlock(); return p.p }
func (p *pools) set(ps ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.p = nil
	for _, s := range ps {
		p.p = append(p.p, netip.MustParsePrefix(s))
	}
}

func runDaemon(t *testing.T, refresh time.Duration, ps *pools) (*fakeExec, *test.Hook, func()) {
	t.Helper()
	log, hook := test.NewNullLogger()
	log.SetLevel(logrus.DebugLevel)
	cfg := testConfig(t.TempDir())
	d := &Daemon{Binary: "conntrackd", Config: cfg, Pools: ps.get, Refresh: refresh, Log: log}
	f := newFakeExec()
	f.install(d)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	return f, hook, func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
}

func TestDaemonRestartsConntrackdThatExits(t *testing.T) {
	ps := &pools{}
	ps.set("203.0.113.0/24")
	f, hook, stop := runDaemon(t, time.Hour, ps)
	f.waitStart(t)
	_, procs, _ := f.snapshot()
	procs[0].exited <- errors.New("signal: killed")
	f.waitStart(t) // after minBackoff, despite the lock file it left
	stop()
	starts, procs, _ := f.snapshot()
	if len(starts) != 2 || starts[0] != starts[1] {
		t.Fatalf("want 2 starts with one configuration, got %d", len(starts))
	}
	f.mu.Lock()
	flushes := f.flushes
	f.mu.Unlock()
	if flushes != 2 {
		t.Errorf("the cache was emptied %d times after 2 starts, want 2: a restarted conntrackd holds the other routers' copies as its own", flushes)
	}
	select {
	case <-procs[1].stopped:
	default:
		t.Error("the running conntrackd was not stopped when Run returned")
	}
	if !hasLog(hook, "conntrackd exited: restarting it") {
		t.Error("no log line said conntrackd exited")
	}
}

func TestDaemonFollowsThePools(t *testing.T) {
	ps := &pools{}
	f, hook, stop := runDaemon(t, 50*time.Millisecond, ps)
	defer stop()
	// No pool: nothing to share, nothing started, said once.
	time.Sleep(300 * time.Millisecond)
	if starts, _, _ := f.snapshot(); len(starts) != 0 {
		t.Fatalf("conntrackd started without a pool: %v", starts)
	}
	if n := countLogs(hook, "conntrackd not running"); n != 1 {
		t.Errorf("the missing pool was logged %d times, want once", n)
	}
	ps.set("203.0.113.0/24")
	f.waitStart(t)
	// Unchanged pools: bulk sends, no restart.
	deadline := time.Now().Add(10 * time.Second)
	for _, _, bulks := f.snapshot(); bulks < 2; _, _, bulks = f.snapshot() {
		if time.Now().After(deadline) {
			t.Fatal("no bulk send within 10 s at a 50 ms refresh")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ps.set("203.0.113.0/24", "198.51.100.0/24")
	f.waitStart(t)
	starts, procs, _ := f.snapshot()
	if len(starts) != 2 || !strings.Contains(starts[1], "IPv4_address 198.51.100.0/24") || strings.Contains(starts[0], "198.51.100.0/24") {
		t.Fatalf("the pool change did not restart conntrackd with the new filter: %d starts", len(starts))
	}
	select {
	case <-procs[0].stopped:
	default:
		t.Error("the conntrackd of the old pools was not stopped")
	}
}

func TestDaemonStopsConntrackdWhoseCacheCannotBeEmptied(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the cache timeout")
	}
	ps := &pools{}
	ps.set("203.0.113.0/24")
	log, hook := test.NewNullLogger()
	d := &Daemon{Binary: "conntrackd", Config: testConfig(t.TempDir()), Pools: ps.get, Refresh: time.Hour, Log: log}
	f := newFakeExec()
	f.flushFails = 1 << 30 // never answers
	f.install(d)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	f.waitStart(t)
	deadline := time.Now().Add(3 * cacheTimeout)
	for !hasLog(hook, "conntrackd not started: flows will not survive a router failover") {
		if time.Now().After(deadline) {
			t.Fatal("no error logged for a conntrackd whose cache could not be emptied")
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	<-done
	_, procs, _ := f.snapshot()
	select {
	case <-procs[0].stopped:
	default:
		t.Error("the conntrackd whose cache held the other routers' copies was left running")
	}
}

func hasLog(hook *test.Hook, msg string) bool { return countLogs(hook, msg) > 0 }

func countLogs(hook *test.Hook, msg string) int {
	n := 0
	for _, e := range hook.AllEntries() {
		if e.Message == msg {
			n++
		}
	}
	return n
}

func TestLogLinesDropsConntrackdsPrefix(t *testing.T) {
	var got []string
	logLines(strings.NewReader("[Sun Nov 29 16:46:27 2026] (pid=23691) [notice] resync requested\n\nplain\n"), func(s string) { got = append(got, s) })
	if len(got) != 2 || got[0] != "[notice] resync requested" || got[1] != "plain" {
		t.Fatalf("got %q", got)
	}
}

// TestDaemonRunsConntrackdOnlyBehindItsPortFilter: conntrackd starts only
// once the filter of its port is written, with the configuration's
// interface, group and peers; a filter that cannot be written at a
// refresh stops conntrackd until it can; the filter's drops are logged
// when their count grows.
func TestDaemonRunsConntrackdOnlyBehindItsPortFilter(t *testing.T) {
	ps := &pools{}
	ps.set("203.0.113.0/24")
	log, hook := test.NewNullLogger()
	cfg := testConfig(t.TempDir())
	cfg.Peers = []netip.Prefix{netip.MustParsePrefix("10.99.0.2/32")}
	d := &Daemon{Binary: "conntrackd", Config: cfg, Pools: ps.get, Refresh: 50 * time.Millisecond, Log: log}
	f := newFakeExec()
	f.guardFails = 1
	f.install(d)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	f.waitStart(t) // after the back-off of the failed first write
	const notWritten = "conntrackd not running: the filter of its port cannot be written, and conntrackd would take sync messages from anyone"
	if n := countLogs(hook, notWritten); n != 1 {
		t.Errorf("the failed write was logged %d times, want once", n)
	}
	f.mu.Lock()
	if want := (PortFilter{Interface: "sync0", Group: DefaultGroup, Peers: cfg.Peers}); len(f.filters) == 0 || !reflect.DeepEqual(f.filters[0], want) {
		t.Errorf("filter asked for %+v, want %+v", f.filters, want)
	}
	f.dropped = 5
	f.mu.Unlock()
	const droppedMsg = "the filter of conntrackd's port dropped datagrams from outside the peers or the sync link: if a router sent them, add its address on the link to --conntrack-sync-peers (its entries do not get here)"
	waitLog(t, hook, droppedMsg)
	// The count stays: said once.
	f.mu.Lock()
	guards := f.guards
	f.mu.Unlock()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		f.mu.Lock()
		more := f.guards > guards+2
		f.mu.Unlock()
		if more {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no refresh checked the filter within 10 s at a 50 ms refresh")
		}
	}
	if n := countLogs(hook, droppedMsg); n != 1 {
		t.Errorf("5 drops were logged %d times, want once", n)
	}
	for _, e := range hook.AllEntries() {
		if e.Message == droppedMsg && (e.Data["dropped"] != uint64(5) || e.Data["dropped_total"] != uint64(5)) {
			t.Errorf("drops logged with %v", e.Data)
		}
	}
	if hasLog(hook, noPeers) {
		t.Error("the missing peers were logged although the peers are set")
	}

	// A refresh that cannot write the filter stops conntrackd.
	f.mu.Lock()
	f.guardFails = 1
	f.mu.Unlock()
	_, procs, _ := f.snapshot()
	select {
	case <-procs[0].stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("conntrackd kept running after its port's filter could not be written")
	}
	f.waitStart(t) // again, once the filter is written
}

const noPeers = "no --conntrack-sync-peers: any host on the sync link can write conntrack entries, marks included, into this router's table; " +
	"the filter of conntrackd's port keeps out only what arrives on other interfaces (set the other routers' addresses on the link)"

func TestDaemonWarnsWithoutPeers(t *testing.T) {
	ps := &pools{}
	ps.set("203.0.113.0/24")
	f, hook, stop := runDaemon(t, time.Hour, ps)
	f.waitStart(t)
	stop()
	if n := countLogs(hook, noPeers); n != 1 {
		t.Errorf("the missing peers were logged %d times, want once", n)
	}
}

func waitLog(t *testing.T, hook *test.Hook, msg string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !hasLog(hook, msg) {
		if time.Now().After(deadline) {
			t.Fatalf("not logged within 10 s: %q", msg)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
