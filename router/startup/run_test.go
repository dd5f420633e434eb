package startup

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
)

// TestClosingTimeoutLeavesOutCloseWait: the restore's bound is the longest
// closing-state timeout but CLOSE_WAIT's, which kube-proxy raises to an
// hour on every node; an established entry's 300 s stays above it.
func TestClosingTimeoutLeavesOutCloseWait(t *testing.T) {
	for _, tc := range []struct {
		name    string
		sysctls map[string]uint32
		want    uint32
		warns   int
	}{
		{"kernel defaults", map[string]uint32{"fin_wait": 120, "close_wait": 60, "last_ack": 30, "time_wait": 120, "close": 10, "unacknowledged": 300, "max_retrans": 300}, 120, 0},
		{"kube-proxy's close_wait", map[string]uint32{"fin_wait": 120, "close_wait": 3600, "last_ack": 30, "time_wait": 120, "close": 10, "unacknowledged": 300, "max_retrans": 300}, 120, 0},
		{"a long time_wait", map[string]uint32{"time_wait": 400, "unacknowledged": 300, "max_retrans": 300}, 400, 2},
		{"conntrack not loaded", nil, 120, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			nf := filepath.Join(dir, "net", "netfilter")
			if err := os.MkdirAll(nf, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, v := range tc.sysctls {
				if err := os.WriteFile(filepath.Join(nf, "nf_conntrack_tcp_timeout_"+name), []byte(strconv.Itoa(int(v))+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			log, hook := test.NewNullLogger()
			if got := closingTimeout(procSys(dir), log); got != tc.want {
				t.Errorf("closingTimeout = %d, want %d", got, tc.want)
			}
			warns := 0
			for _, e := range hook.AllEntries() {
				if e.Level == logrus.WarnLevel {
					warns++
				}
			}
			if warns != tc.warns {
				t.Errorf("%d warnings, want %d: %v", warns, tc.warns, hook.AllEntries())
			}
		})
	}
}
