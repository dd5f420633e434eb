package daemon

import (
	"strings"
	"testing"
	"time"
)

type fakeInformer struct{ stopped bool }

func (f *fakeInformer) IsStopped() bool { return f.stopped }

func TestLiveness(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l := &Liveness{StallAfter: time.Minute, now: func() time.Time { return now }}
	services := &fakeInformer{}
	l.Watch("services", services)
	if err := l.Check(); err != nil {
		t.Fatalf("idle controller: %v", err)
	}
	endA := l.Begin("web/a")
	endB := l.Begin("resync")
	now = now.Add(30 * time.Second)
	if err := l.Check(); err != nil {
		t.Fatalf("30 s on an item: %v", err)
	}
	endB()
	now = now.Add(31 * time.Second)
	err := l.Check()
	if err == nil || !strings.Contains(err.Error(), `a worker has been on "web/a" for 1m1s`) || strings.Contains(err.Error(), "resync") {
		t.Fatalf("stuck worker: Check() = %v", err)
	}
	endA()
	if err := l.Check(); err != nil {
		t.Fatalf("after the item ended: %v", err)
	}
	services.stopped = true
	if err := l.Check(); err == nil || !strings.Contains(err.Error(), "the services informer has stopped") {
		t.Fatalf("stopped informer: Check() = %v", err)
	}
	var none *Liveness
	if err := none.Check(); err != nil {
		t.Fatalf("nil Liveness: %v", err)
	}
}
