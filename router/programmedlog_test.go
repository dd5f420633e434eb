package router

import (
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
)

// A table change that an informer event led to is logged ("table
// written") with where its time went: queued_ms from the event to the start of its sync, sync_ms
// from there to the kernel write. A change that the full resync makes
// (no event) is not logged, nor a sync that changes nothing.
func TestControllerLogsWhereAChangesTimeWent(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24")
	log, hook := logtest.NewNullLogger()
	tc.log = log
	svc := tunnelSvc("web", "a", "192.0.2.10", time.Hour)
	tc.add(t, svc, oneEndpoint("web", "a", "10.244.1.5"))
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if n := len(programmedLines(hook)); n != 0 {
		t.Fatalf("the resync logged %d programmed lines, want none", n)
	}

	second := oneEndpoint("web", "a", "10.244.1.6") // a second slice of web/a
	second.Name = "a-2"
	tc.add(t, second)
	tc.listing.Store(true)
	tc.enqueueObject(svc)
	const queued = 30 * time.Millisecond
	time.Sleep(queued)
	tc.processNext()
	tc.enqueueObject(svc) // nothing changed since
	tc.processNext()

	lines := programmedLines(hook)
	if len(lines) != 1 {
		t.Fatalf("logged %d programmed lines, want 1: %v", len(lines), lines)
	}
	e := lines[0]
	if e.Data["vip"].(interface{ String() string }).String() != "192.0.2.10" || e.Data["service"] != "web/a" ||
		!strings.HasPrefix(e.Data["event"].(string), "tunnel IP 192.0.2.10 programmed: 2 endpoints") {
		t.Errorf("logged %v, want vip 192.0.2.10, service web/a, the event of 2 endpoints", e.Data)
	}
	if q, ok := e.Data["queued_ms"].(int64); !ok || q < queued.Milliseconds() {
		t.Errorf("queued_ms %v, want at least %d", e.Data["queued_ms"], queued.Milliseconds())
	}
	if s, ok := e.Data["sync_ms"].(int64); !ok || s < 0 {
		t.Errorf("sync_ms %v", e.Data["sync_ms"])
	}
}

// programmedLines are the "table written" lines logged.
func programmedLines(hook *logtest.Hook) []*logrus.Entry {
	var out []*logrus.Entry
	for _, e := range hook.AllEntries() {
		if e.Message == "table written" {
			out = append(out, e)
		}
	}
	return out
}
