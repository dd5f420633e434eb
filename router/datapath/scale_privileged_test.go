package datapath

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestRulesDoNotGrowWithTunnelIPs programs 10, then 1,000 tunnel IPs with
// the router's default generations (sticky chains) on this host's kernel:
// the rules in the router's chains, in both tables, are the same, so the
// number of rules a packet walks does not depend on the number of tunnel
// IPs; only the sets grow.
func TestRulesDoNotGrowWithTunnelIPs(t *testing.T) {
	ns := testnetns.New(t)
	ns.AddVeth("veth0", "veth1", netip.MustParsePrefix("192.168.50.1/24"))
	cfg := DefaultConfig()
	cfg.Buckets, cfg.Seed = 4, 1
	nl := ns.Netlink()
	ipt := ns.IPTables("iptables")
	chain, err := hmark.NewChain(ipt, ns.IPSets(), cfg.Chain, cfg.HMARKParams(), ipt)
	if err != nil {
		t.Fatal(err)
	}
	if err := chain.SetSticky(cfg.Sticky()); err != nil {
		t.Fatal(err)
	}
	dp := NewDatapath(cfg, ns.Routes(), nl, chain, &ExistingDevice{Name: "veth0", Links: nl}, nil, seamtest.QuietLog())

	tunnels := func(n int) []Tunnel {
		var ts []Tunnel
		for i := range n {
			vip := fmt.Sprintf("198.18.%d.%d", i/250, i%250+1)
			ts = append(ts, tunnel(cfg, vip, "10.244.1.5", "10.244.2.6"))
		}
		return ts
	}
	rules := func() (string, int) {
		out := ns.Run("iptables", "-t", "mangle", "-S", cfg.Chain) + ns.Run("iptables", "-t", "raw", "-S", cfg.Chain) +
			ns.Run("iptables", "-t", "raw", "-S", cfg.Chain+"-SYN")
		return out, strings.Count(out, "-A ")
	}
	if err := dp.Resync(tunnels(10)); err != nil {
		t.Fatal(err)
	}
	few, nFew := rules()
	if err := dp.Resync(tunnels(1000)); err != nil {
		t.Fatal(err)
	}
	many, nMany := rules()
	t.Logf("rules in the router's chains: %d with 10 tunnel IPs, %d with 1,000:\n%s", nFew, nMany, many)
	if many != few {
		t.Errorf("the rules changed between 10 and 1,000 tunnel IPs:\n%s\nwith 10:\n%s", many, few)
	}
	if nFew == 0 || !strings.Contains(few, "--match-set "+cfg.Chain+"-0 dst") {
		t.Errorf("no set rule in the chains:\n%s", few)
	}
	if err := dp.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if sets := ns.IPSetState(); sets != "" {
		t.Errorf("sets after Cleanup:\n%s", sets)
	}
}
