package startup

import (
	"flag"
	"fmt"
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
		"peers":                          {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-peers", "172.21.0.1,172.21.0.2, 10.0.0.0/24"}, ""},
		"peers without the sync":         {[]string{"--conntrack-sync-peers", "172.21.0.2"}, "--conntrack-sync-peers [172.21.0.2/32]: needs --conntrack-sync-interface"},
		"an IPv6 peer":                   {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-peers", "2001:db8::2"}, `conntrack-sync-peers: "2001:db8::2": not IPv4`},
		"a peer's host bits":             {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-peers", "172.21.0.2/24"}, `conntrack-sync-peers: "172.21.0.2/24": host bits set`},
		"a name as a peer":               {[]string{"--conntrack-sync-interface", "eth1", "--conntrack-sync-peers", "router-b"}, `conntrack-sync-peers: "router-b": not an IPv4 address or CIDR`},
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

func TestConntrackSyncPeersFromTheEnvironment(t *testing.T) {
	t.Setenv("KST_CONNTRACK_SYNC_INTERFACE", "eth1")
	t.Setenv("KST_CONNTRACK_SYNC_PEERS", "172.21.0.2,172.21.0.1")
	var o Options
	fs := flag.NewFlagSet("tunnel-router", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.AddFlags(fs)
	if err := o.Parse(fs, []string{"--node-name", "n1"}); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(o.ConntrackSync.Peers); got != "[172.21.0.1/32 172.21.0.2/32]" {
		t.Errorf("peers from KST_CONNTRACK_SYNC_PEERS: %s", got)
	}
	t.Setenv("KST_CONNTRACK_SYNC_PEERS", "172.21.0.2;172.21.0.1")
	var o2 Options
	fs2 := flag.NewFlagSet("tunnel-router", flag.ContinueOnError)
	fs2.SetOutput(io.Discard)
	o2.AddFlags(fs2)
	if err := o2.Parse(fs2, []string{"--node-name", "n1"}); err == nil || !strings.Contains(err.Error(), "KST_CONNTRACK_SYNC_PEERS") || !strings.Contains(err.Error(), "--conntrack-sync-peers") {
		t.Errorf("a bad KST_CONNTRACK_SYNC_PEERS: %v, want an error naming it and the flag", err)
	}
}
