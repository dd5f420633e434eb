package startup

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func parseRouterArgs(args ...string) error {
	var o Options
	fs := flag.NewFlagSet("tunnel-router", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.AddFlags(fs)
	return o.Parse(fs, append([]string{"--node-name", "n1"}, args...))
}

func TestConntrackSyncFlags(t *testing.T) {
	for name, tc := range map[string]struct {
		args []string
		want string // "" when the arguments are valid
	}{
		"off":                            {nil, ""},
		"on":                             {[]string{"--conntrack-sync-interface", "eth1"}, ""},
		"stateless":                      {[]string{"--conntrack-sync-interface", "eth1", "--generations", "1"}, "needs --generations > 1"},
		"refresh 0":                      {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-refresh", "0s"}, "--conntrack-sync-refresh 0s"},
		"refresh beyond the copies' end": {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-refresh", "5m"}, "at most 4m"},
		"refresh without the sync":       {[]string{"--conntrack-sync-refresh", "0s"}, ""},
		"cleanup ignores it":             {[]string{"--conntrack-sync-interface", "eth1", "--generations", "1", "--cleanup"}, ""},
	} {
		t.Run(name, func(t *testing.T) {
			err := parseRouterArgs(tc.args...)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Parse(%q): %v", tc.args, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Parse(%q): got %v, want an error with %q", tc.args, err, tc.want)
			}
		})
	}
}
