package endpoint

import (
	"flag"
	"io"
	"testing"
)

// parseOptions parses args as the agent does, with NODE_NAME set.
func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	t.Setenv("NODE_NAME", "n1")
	fs := flag.NewFlagSet("tunnel-endpoint", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var o Options
	o.AddFlags(fs)
	if err := o.Parse(fs, args); err != nil {
		t.Fatal(err)
	}
	return o
}

// --metrics-address defaults to its own port (not the router's, which runs
// in the same network namespace on tunnel nodes), falls back to
// KST_METRICS_ADDRESS like every flag, and the command line wins.
func TestMetricsAddressFlag(t *testing.T) {
	if o := parseOptions(t); o.MetricsAddress != DefaultMetricsAddress || DefaultMetricsAddress != ":9642" {
		t.Errorf("default --metrics-address %q (DefaultMetricsAddress %q), want :9642", o.MetricsAddress, DefaultMetricsAddress)
	}
	t.Setenv("KST_METRICS_ADDRESS", "127.0.0.1:19642")
	if o := parseOptions(t); o.MetricsAddress != "127.0.0.1:19642" {
		t.Errorf("with KST_METRICS_ADDRESS: %q, want 127.0.0.1:19642", o.MetricsAddress)
	}
	if o := parseOptions(t, "--metrics-address="); o.MetricsAddress != "" {
		t.Errorf("--metrics-address= on the command line: %q, want empty (disabled)", o.MetricsAddress)
	}
}
