package daemon

import (
	"flag"

	"github.com/sirupsen/logrus"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// AddPolicyFlags registers the flags of the address pools and the cluster's
// ranges on fs. Both daemons take them, with the same KST_* fallbacks, so
// that they admit the same tunnel IPs.
func AddPolicyFlags(fs *flag.FlagSet, p *tunnelclaim.Policy) {
	fs.Func("pools", `address pools tunnel IPs are served from: IPv4 or IPv6 CIDRs separated by ";", each optionally limited to namespaces with "=ns,ns", e.g. "192.0.2.0/24;203.0.113.0/28=team-a,team-b;2001:db8:2::/64" (default: none, so nothing is served)`, func(s string) error {
		pools, err := tunnelclaim.ParsePools(s)
		p.Pools = pools
		return err
	})
	fs.Func("pod-cidr", "comma-separated pod ranges no tunnel IP may be in, besides the Nodes' spec.podCIDRs (e.g. the cluster CIDR)", func(s string) error {
		cidrs, err := tunnelclaim.ParseCIDRs(s)
		p.PodCIDRs = cidrs
		return err
	})
	fs.Func("service-cidr", "comma-separated Service ranges no tunnel IP may be in (the API server's --service-cluster-ip-range)", func(s string) error {
		cidrs, err := tunnelclaim.ParseCIDRs(s)
		p.ServiceCIDRs = cidrs
		return err
	})
}

// LogPolicy says at start which tunnel IPs the daemon serves; with no pool,
// plainly that it serves none.
func LogPolicy(log logrus.FieldLogger, p tunnelclaim.Policy) {
	if len(p.Pools) == 0 {
		log.WithField("flag", "--pools").Warn("no address pool is configured: no tunnel IP is served; set --pools (KST_POOLS), e.g. 192.0.2.0/24")
		return
	}
	log.WithFields(logrus.Fields{"pools": p.Pools.String(), "pod_cidrs": p.PodCIDRs, "service_cidrs": p.ServiceCIDRs}).Info("serving tunnel IPs from these address pools")
}
