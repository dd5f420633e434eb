package lab

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// GuestDuration is how long one guest (sub)test took, as go test -v
// printed it.
type GuestDuration struct {
	Name   string
	Result string // PASS, FAIL or SKIP
	Took   time.Duration
}

// GuestDurations are the results in out (a guest's console, go test -v)
// whose names have exactly depth parts ("TestInVM/gre/1_reach" has 3), the
// failed ones without a failed subtest first (as ReportGuestTests reports
// them), then in the order printed.
func GuestDurations(out string, depth int) []GuestDuration {
	var ds []GuestDuration
	for _, r := range guestResults(out) {
		if strings.Count(r.name, "/")+1 != depth {
			continue
		}
		secs, err := strconv.ParseFloat(strings.TrimSuffix(r.took, "s"), 64)
		if err != nil {
			continue
		}
		ds = append(ds, GuestDuration{Name: r.name, Result: r.result, Took: time.Duration(secs * float64(time.Second))})
	}
	return ds
}

// DurationReport is the table a lab run leaves in CI's log: the run's
// total, each part's (depth 2: a mode), and the slowest n tests at depth 3
// (the scenarios, or the lab cluster's steps), slowest first.
func DurationReport(title, out string, total time.Duration, n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "== %s: %v in all\n", title, total.Round(time.Second))
	for _, d := range GuestDurations(out, 2) {
		fmt.Fprintf(&b, "  %-60s %7.1f s  %s\n", d.Name, d.Took.Seconds(), d.Result)
	}
	scenarios := GuestDurations(out, 3)
	slices.SortStableFunc(scenarios, func(a, b GuestDuration) int { return int(b.Took - a.Took) })
	fmt.Fprintf(&b, "== %s: the slowest %d of %d\n", title, min(n, len(scenarios)), len(scenarios))
	for _, d := range scenarios[:min(n, len(scenarios))] {
		fmt.Fprintf(&b, "  %-60s %7.1f s  %s\n", d.Name, d.Took.Seconds(), d.Result)
	}
	return b.String()
}

// RecordDurations logs DurationReport and writes it to path, which make
// test prints after the phase (test/tools/phase.sh, KST_PHASE_SHOW), so
// that a run's slowest scenarios show in CI's log whether it passed or
// not.
func RecordDurations(t *testing.T, path, title, out string, total time.Duration) {
	t.Helper()
	report := DurationReport(title, out, total, 10)
	t.Log("\n" + report)
	if err := os.WriteFile(path, []byte(report), 0o644); err != nil {
		t.Logf("writing %s: %v", path, err)
	}
}

// BoundWatch follows a guest's console (as the Output of a VM run) for the
// test it runs now, and warns once the run has used three quarters of its
// time bound, naming that test: a run that nears its bound says where it
// is slow.
type BoundWatch struct {
	out io.Writer

	start time.Time

	mu      sync.Mutex
	partial []byte    // the console's unfinished last line
	running string    // the last "=== RUN" test
	timed   io.Writer // receives each whole line after its time since start
	timer   *time.Timer
}

// WatchBound returns a BoundWatch forwarding to out (may be nil) that
// logs to t when 3/4 of bound have passed; Stop it when the run ends.
func WatchBound(t *testing.T, out io.Writer, bound time.Duration) *BoundWatch {
	w := &BoundWatch{out: out, start: time.Now()}
	w.timer = time.AfterFunc(bound*3/4, func() {
		w.mu.Lock()
		running := w.running
		w.mu.Unlock()
		t.Logf("WARNING: the VM has run for %v of its %v bound; running now: %s", time.Since(w.start).Round(time.Second), bound, running)
	})
	return w
}

// TimeLinesTo makes the watch also write each whole console line to timed,
// after the seconds since the watch began ("  123.4 line"): where a
// scenario spends its time, step by step, without a clock in the guest's
// own log.
func (w *BoundWatch) TimeLinesTo(timed io.Writer) {
	w.mu.Lock()
	w.timed = timed
	w.mu.Unlock()
}

// TimedFile is where the timed copy of a lab run's console consoleLog
// goes: /tmp/kst-e2e-console.log gives /tmp/kst-e2e-console.timed.log.
func TimedFile(consoleLog string) string {
	return strings.TrimSuffix(consoleLog, filepath.Ext(consoleLog)) + ".timed.log"
}

func (w *BoundWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.partial = append(w.partial, p...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		if line := strings.TrimSpace(string(w.partial[:i])); strings.HasPrefix(line, "=== RUN") {
			w.running = strings.TrimSpace(strings.TrimPrefix(line, "=== RUN"))
		}
		if w.timed != nil {
			_, _ = fmt.Fprintf(w.timed, "%7.1f %s\n", time.Since(w.start).Seconds(), strings.TrimRight(string(w.partial[:i]), "\r"))
		}
		w.partial = w.partial[i+1:]
	}
	w.mu.Unlock()
	if w.out == nil {
		return len(p), nil
	}
	return w.out.Write(p)
}

// Stop ends the watch.
func (w *BoundWatch) Stop() { w.timer.Stop() }
