package daemon

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"runtime/debug"
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

type startOptions struct {
	Common
	name string
}

func (o *startOptions) AddFlags(fs *flag.FlagSet) {
	o.Common.AddFlags(fs)
	fs.StringVar(&o.name, "name", "", "a name")
}

func (o *startOptions) Parse(fs *flag.FlagSet, args []string) error {
	var node string
	return o.Common.Parse(fs, args, &node)
}

func TestStart(t *testing.T) {
	var o startOptions
	ctx, stop, log, help, err := Start("test-daemon", &o, []string{"-name", "x", "-log-level", "debug"})
	if err != nil || help {
		t.Fatalf("Start = help %v, %v", help, err)
	}
	defer stop()
	if o.name != "x" || log.Data["component"] != "test-daemon" || log.Logger.GetLevel() != logrus.DebugLevel || ctx.Err() != nil {
		t.Fatalf("name %q, component %v, level %v, ctx %v", o.name, log.Data["component"], log.Logger.GetLevel(), ctx.Err())
	}
	if _, _, _, help, err := Start("test-daemon", &startOptions{}, []string{"-h"}); !help || err != nil {
		t.Fatalf("-h: help %v, err %v; want help and no error", help, err)
	}
	if _, _, _, _, err := Start("test-daemon", &startOptions{}, []string{"-nope"}); err == nil {
		t.Fatal("an unknown flag was accepted")
	}
	if _, _, _, _, err := Start("test-daemon", &startOptions{}, []string{"-log-level", "loud"}); err == nil || !strings.Contains(err.Error(), "--log-level") {
		t.Fatalf("bad log level: %v", err)
	}
}

// --gc-percent sets the collector's target; an explicit GOGC wins over its
// default, not over the flag (or KST_GC_PERCENT) given.
func TestGCPercent(t *testing.T) {
	t.Cleanup(func() { debug.SetGCPercent(100) })
	for _, tc := range []struct {
		name       string
		args       []string
		env        map[string]string
		want       int
		wantChange bool
	}{
		{name: "default", want: DefaultGCPercent, wantChange: true},
		{name: "flag", args: []string{"-gc-percent", "70"}, want: 70, wantChange: true},
		{name: "KST_GC_PERCENT", env: map[string]string{"KST_GC_PERCENT": "55"}, want: 55, wantChange: true},
		{name: "GOGC over the default", env: map[string]string{"GOGC": "200"}, wantChange: false},
		{name: "flag over GOGC", args: []string{"-gc-percent", "30"}, env: map[string]string{"GOGC": "200"}, want: 30, wantChange: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var c Common
			var node string
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			c.AddFlags(fs)
			debug.SetGCPercent(123)
			if err := c.Parse(fs, tc.args, &node); err != nil {
				t.Fatal(err)
			}
			got := debug.SetGCPercent(100)
			switch {
			case tc.wantChange && got != tc.want:
				t.Errorf("GC percent %d, want %d", got, tc.want)
			case !tc.wantChange && got != 123:
				t.Errorf("GC percent changed to %d although GOGC chose it", got)
			}
		})
	}
	var c Common
	var node string
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.AddFlags(fs)
	if err := c.Parse(fs, []string{"-gc-percent", "0"}, &node); err == nil || !strings.Contains(err.Error(), "--gc-percent 0") {
		t.Errorf("--gc-percent 0: %v, want an error naming the flag", err)
	}
}

// --version answers before any validation: the router's missing --seed or a
// bad --gc-percent must not hide it.
func TestVersionFlagStopsBeforeValidation(t *testing.T) {
	var c Common
	var node string
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.AddFlags(fs)
	if err := c.Parse(fs, []string{"--version", "--gc-percent", "0"}, &node); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("--version: %v, want flag.ErrHelp (printed, exit 0)", err)
	}
}
