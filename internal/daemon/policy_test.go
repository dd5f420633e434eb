package daemon

import (
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/flagenv"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

func TestPolicyFlags(t *testing.T) {
	parse := func(args ...string) (tunnelclaim.Policy, error) {
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		var p tunnelclaim.Policy
		AddPolicyFlags(fs, &p)
		if err := fs.Parse(args); err != nil {
			return p, err
		}
		return p, flagenv.Apply(fs, EnvPrefix)
	}
	p, err := parse("--pools", "192.0.2.0/24;203.0.113.0/28=team-a", "--pod-cidr", "10.244.0.0/16", "--service-cidr", "10.96.0.0/12")
	if err != nil || p.Pools.String() != "192.0.2.0/24;203.0.113.0/28=team-a" || len(p.PodCIDRs) != 1 || len(p.ServiceCIDRs) != 1 {
		t.Fatalf("parsed %+v, %v", p, err)
	}
	if _, err := parse("--pools", "192.0.2.0/24;127.0.0.0/8"); err == nil || !strings.Contains(err.Error(), `pool "127.0.0.0/8"`) {
		t.Fatalf("a reserved pool: error %v, want one naming the pool", err)
	}
	t.Setenv("KST_POOLS", "10.0.0.1/8")
	if _, err := parse(); err == nil || !strings.Contains(err.Error(), "KST_POOLS") || !strings.Contains(err.Error(), `pool "10.0.0.1/8"`) {
		t.Fatalf("a bad KST_POOLS: error %v, want one naming the variable and the pool", err)
	}
	t.Setenv("KST_POOLS", "192.0.2.0/24")
	if p, err := parse(); err != nil || p.Pools.String() != "192.0.2.0/24" {
		t.Fatalf("KST_POOLS: %+v, %v", p, err)
	}
}
