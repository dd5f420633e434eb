package endpoint

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// blockingCounters is a decapsulation counter reader that holds every read
// until release is closed, and records what it saw.
type blockingCounters struct {
	entered  chan netns.NsHandle
	release  chan struct{}
	inFlight atomic.Int32
	maxIn    atomic.Int32
	reads    atomic.Int32
	// stillOpen is whether each read's handle was open when released.
	mu        sync.Mutex
	stillOpen []bool
}

func newBlockingCounters() *blockingCounters {
	return &blockingCounters{entered: make(chan netns.NsHandle, 16), release: make(chan struct{})}
}

func (b *blockingCounters) DecapCounters(ns netns.NsHandle, _ bool) (DecapCounters, error) {
	n := b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	for {
		m := b.maxIn.Load()
		if n <= m || b.maxIn.CompareAndSwap(m, n) {
			break
		}
	}
	b.reads.Add(1)
	b.entered <- ns
	<-b.release
	var st unix.Stat_t
	b.mu.Lock()
	b.stillOpen = append(b.stillOpen, unix.Fstat(int(ns), &st) == nil)
	b.mu.Unlock()
	return DecapCounters{Packets: 1, Bytes: 100}, nil
}

func collectAll(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 100)
	go func() { c.Collect(ch); close(ch) }()
	n := 0
	for range ch {
		n++
	}
	return n
}

// openNamespace opens this process's network namespace: a real handle,
// which needs no privilege.
func openNamespace(t *testing.T) netns.NsHandle {
	t.Helper()
	ns, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

var webTunnels = PodTunnels{TunnelIPs: []netip.Addr{netip.MustParseAddr("192.0.2.10")}}

// A scrape that reads a slow pod never holds up the agent's sync path: it
// gives a pod its namespace (keep) and forgets pods (retain) while the
// scrape reads, and the scrape's reading goes on on its own duplicate of
// the namespace handle, which retain closed meanwhile.
func TestScrapeDoesNotHoldUpTheSyncPath(t *testing.T) {
	reader := newBlockingCounters()
	d := newDecapCollector(reader, nil)
	original := openNamespace(t)
	d.keep("a/web-1", webTunnels, false, original)
	scraped := make(chan int)
	go func() { scraped <- collectAll(d) }()
	got := <-reader.entered
	if got == original {
		t.Errorf("the scrape reads through the pod's own handle %d, not a duplicate", original)
	}
	synced := make(chan struct{})
	go func() {
		d.keep("a/web-2", webTunnels, false, openNamespace(t))
		d.retain(func(pod string) bool { return pod == "a/web-2" }) // closes a/web-1's handle
		close(synced)
	}()
	select {
	case <-synced:
	case <-time.After(30 * time.Second):
		t.Fatal("keep and retain waited for the scrape's kernel reads (30 s)")
	}
	close(reader.release)
	if n := <-scraped; n != 2 {
		t.Errorf("the scrape exported %d series, want a/web-1's 2 (packets, bytes)", n)
	}
	reader.mu.Lock()
	defer reader.mu.Unlock()
	if len(reader.stillOpen) != 1 || !reader.stillOpen[0] {
		t.Errorf("the scrape's namespace handle was open after the pod was forgotten: %v, want [true]", reader.stillOpen)
	}
	d.retain(func(string) bool { return false })
}

// However many scrape at once, one reading of the kernel runs; the scrapes
// that waited for it share the next reading.
func TestConcurrentScrapesShareOneReading(t *testing.T) {
	reader := newBlockingCounters()
	d := newDecapCollector(reader, nil)
	d.keep("a/web-1", webTunnels, false, openNamespace(t))
	defer d.retain(func(string) bool { return false })
	first := make(chan int)
	go func() { first <- collectAll(d) }()
	<-reader.entered // the first reading is under way
	const waiting = 5
	results := make(chan int, waiting)
	for range waiting {
		go func() { results <- collectAll(d) }()
	}
	// Give them time to queue behind the first reading (if one did not,
	// it starts its own reading later, which the counts below allow).
	time.Sleep(200 * time.Millisecond)
	go func() {
		for range reader.entered {
		}
	}()
	close(reader.release)
	if n := <-first; n != 2 {
		t.Errorf("first scrape: %d series, want 2", n)
	}
	for range waiting {
		if n := <-results; n != 2 {
			t.Errorf("a waiting scrape got %d series, want 2", n)
		}
	}
	if m := reader.maxIn.Load(); m != 1 {
		t.Errorf("%d readings of the kernel at once, want 1", m)
	}
	if r := reader.reads.Load(); r > 1+waiting || r < 2 {
		t.Errorf("%d readings for %d scrapes", r, 1+waiting)
	}
	t.Logf("%d scrapes, %d readings of the kernel", 1+waiting, reader.reads.Load())
}
