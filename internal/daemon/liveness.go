package daemon

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// DefaultStallAfter is how long a worker may spend on one item before the
// daemon is reported unhealthy (/healthz fails, and the kubelet restarts
// it). A full resync of 10,000 tunnel IPs takes well under a minute.
const DefaultStallAfter = 5 * time.Minute

// Stoppable is what Liveness asks of an informer (cache.SharedIndexInformer).
type Stoppable interface {
	IsStopped() bool
}

// Liveness tells whether a controller is alive: every informer it watches
// still runs, and no worker has been on one item for longer than
// StallAfter. Workers wrap each item in Begin and the returned end.
type Liveness struct {
	// StallAfter is how long one item may take; 0 means DefaultStallAfter.
	StallAfter time.Duration

	mu        sync.Mutex
	informers map[string]Stoppable
	busy      map[uint64]work
	next      uint64
	now       func() time.Time // for tests
}

type work struct {
	key   string
	since time.Time
}

// Watch makes Check fail once the informer named name has stopped.
func (l *Liveness) Watch(name string, informer Stoppable) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.informers == nil {
		l.informers = map[string]Stoppable{}
	}
	l.informers[name] = informer
}

// Begin records that a worker started on key; call end when it is done.
func (l *Liveness) Begin(key string) (end func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.busy == nil {
		l.busy = map[uint64]work{}
	}
	l.next++
	token := l.next
	l.busy[token] = work{key: key, since: l.clock()}
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.busy, token)
	}
}

func (l *Liveness) clock() time.Time {
	if l.now != nil {
		return l.now()
	}
	return time.Now()
}

// Check returns nil while the controller is alive, else what is wrong: the
// informers that stopped and the items a worker is stuck on.
func (l *Liveness) Check() error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	stall := l.StallAfter
	if stall <= 0 {
		stall = DefaultStallAfter
	}
	var errs []error
	names := make([]string, 0, len(l.informers))
	for name := range l.informers {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if l.informers[name].IsStopped() {
			errs = append(errs, fmt.Errorf("the %s informer has stopped", name))
		}
	}
	now := l.clock()
	var stuck []work
	for _, w := range l.busy {
		if now.Sub(w.since) > stall {
			stuck = append(stuck, w)
		}
	}
	slices.SortFunc(stuck, func(a, b work) int { return a.since.Compare(b.since) })
	for _, w := range stuck {
		errs = append(errs, fmt.Errorf("a worker has been on %q for %v (more than %v)", w.key, now.Sub(w.since).Round(time.Second), stall))
	}
	return errors.Join(errs...)
}
