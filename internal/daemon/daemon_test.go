package daemon

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
	"k8s.io/klog/v2"
)

// client-go logs through klog: those lines must reach the daemon's
// structured log, not klog's own stderr format.
func TestRouteKlog(t *testing.T) {
	var out bytes.Buffer
	log := logrus.New()
	log.Out = &out
	log.Formatter = &logrus.TextFormatter{DisableTimestamp: true}
	RouteKlog(log.WithField("component", "test"))
	t.Cleanup(klog.ClearLogger)
	klog.ErrorS(errors.New("connection refused"), "Failed to watch", "resource", "*v1.Service")
	klog.Flush()
	got := out.String()
	for _, want := range []string{"level=error", `msg="Failed to watch"`, "component=test", "source=client-go", `resource="*v1.Service"`, `error="connection refused"`} {
		if !strings.Contains(got, want) {
			t.Errorf("klog line %q lacks %s", got, want)
		}
	}
}
