package endpoint

import (
	"flag"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/iptbackend"
)

// Options are the endpoint agent's command-line options.
type Options struct {
	Config
	daemon.Common
	// Runtime forces a container runtime: auto, docker, cri or netns.
	Runtime string
	// RuntimeEndpoint is the runtime's socket (unix:///path); empty means
	// the runtime's usual one.
	RuntimeEndpoint string
	// Cleanup removes everything the agent created on this node and exits.
	Cleanup bool
	// KernelCheckOnly runs the kernel check (which loads missing modules)
	// and exits; KernelCheck false skips the check.
	KernelCheckOnly, KernelCheck bool
	// WaitAfterCleanup makes a successful Cleanup answer /readyz and wait
	// for SIGTERM.
	WaitAfterCleanup bool
	// IPTablesBackend writes the network policy rules (auto, nft, legacy
	// or system).
	IPTablesBackend iptbackend.Backend
	// MetricsAddress is where /metrics, /healthz and /readyz are served; empty: nowhere.
	MetricsAddress string
}

// DefaultMetricsAddress is the endpoint agent's default --metrics-address
// (the router's is :9641; both run on tunnel nodes, in the node's network
// namespace).
const DefaultMetricsAddress = ":9642"

// AddFlags registers the options on fs with their defaults.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	o.Config = Config{
		Mode: encap.GRE, Device: DefaultDevice, RouteProtocol: encap.DefaultRouteProtocol,
		ResyncPeriod: DefaultResyncPeriod, Workers: 4, NetworkPolicy: true, UntrackReplies: true,
	}
	o.IPTablesBackend = iptbackend.Auto
	fs.Func("mode", `encapsulation the routers use: "gre" or "mpls" (default "gre")`, func(s string) error { o.Mode = encap.Mode(s); return nil })
	fs.StringVar(&o.NodeName, "node-name", "", "name of this node: only its endpoints are handled (env NODE_NAME)")
	fs.StringVar(&o.Device, "device", o.Device, "name of the GRE decapsulation device created in each pod (gre mode), at most 14 characters: the pod's ip6gre device for IPv6 tunnel IPs is this name followed by 6")
	fs.Func("route-protocol", "rtm_protocol number marking the agent's MPLS routes (default 245)", func(s string) error {
		v, err := strconv.ParseUint(s, 0, 8)
		o.RouteProtocol = uint8(v)
		return err
	})
	fs.IntVar(&o.PodAdvMSS, "pod-advmss", 0, "set this advmss on each served pod's default route so clients' segments fit the tunnel without path-MTU discovery (0: leave the route alone; 1400 suits GRE and MPLS on a 1500-byte network)")
	fs.Func("mpls-input-interfaces", "comma-separated node interfaces on which routers' MPLS packets arrive (mpls mode; default: the interface holding the node's address)", func(s string) error {
		o.MPLSInputInterfaces = nil
		for _, name := range strings.Split(s, ",") {
			if name = strings.TrimSpace(name); name != "" {
				o.MPLSInputInterfaces = append(o.MPLSInputInterfaces, name)
			}
		}
		return nil
	})
	fs.DurationVar(&o.ResyncPeriod, "resync-period", o.ResyncPeriod, "how often every local pod's namespace is checked and repaired (0 disables)")
	fs.IntVar(&o.Workers, "workers", o.Workers, "pods configured in parallel")
	daemon.AddPolicyFlags(fs, &o.Policy)
	fs.BoolVar(&o.NetworkPolicy, "network-policy", o.NetworkPolicy, "enforce each served pod's ingress NetworkPolicies on its tunneled traffic, with iptables rules in the pod's network namespace (false: tunneled traffic bypasses them, and rules of an earlier run are removed)")
	fs.BoolVar(&o.UntrackReplies, "untrack-replies", o.UntrackReplies, "exempt the served pods' packets from their tunnel IPs, on the node's interfaces towards them, from the node's connection tracking (an nftables table in the node's namespace): the node's conntrack never saw the clients' packets, which came inside the carrier, so it marks the replies INVALID, and kube-proxy drops INVALID packets (false: no table, and one of an earlier run is removed)")
	fs.Func("router-nodes", "label selector of the router nodes: each served pod accepts the carrier (GRE) only from their InternalIP and ExternalIP addresses (default \""+DefaultRouterNodes+"\")", func(s string) error {
		sel, err := labels.Parse(s)
		if err != nil {
			return fmt.Errorf("--router-nodes %q: %w", s, err)
		}
		if sel.Empty() {
			return fmt.Errorf("--router-nodes %q: selects every node, whose addresses would all be trusted to speak through the tunnel", s)
		}
		o.RouterNodes = sel
		return nil
	})
	fs.Func("carrier-sources", "comma-separated further addresses each served pod accepts the carrier (GRE) from, beside the router nodes' (for a router whose packets leave from another address)", func(s string) error {
		o.CarrierSources = nil
		for _, f := range strings.Split(s, ",") {
			if f = strings.TrimSpace(f); f == "" {
				continue
			}
			a, err := netip.ParseAddr(f)
			if err != nil || a.Zone() != "" {
				return fmt.Errorf("--carrier-sources: %q is not an IP address", f)
			}
			o.CarrierSources = append(o.CarrierSources, a.Unmap())
		}
		return nil
	})
	fs.Func("iptables-backend", `iptables backend for the network policy rules in pods: "auto" (the node's, as the router chooses it), "nft", "legacy", or "system" (the iptables command on PATH) (default "auto")`, func(s string) error {
		b, err := iptbackend.Parse(s)
		o.IPTablesBackend = b
		return err
	})
	fs.StringVar(&o.Runtime, "runtime", "auto", "how pods' network namespaces are found: auto, docker, cri (containerd, CRI-O) or netns (search by pod IP)")
	fs.StringVar(&o.RuntimeEndpoint, "runtime-endpoint", "", "runtime socket, e.g. unix:///run/containerd/containerd.sock (default: the runtime's usual socket)")
	o.Common.AddFlags(fs)
	daemon.AddProcSysFlag(fs, &o.ProcSys)
	fs.StringVar(&o.MetricsAddress, "metrics-address", DefaultMetricsAddress, "address serving /metrics, /healthz and /readyz; empty disables")
	fs.BoolVar(&o.Cleanup, "cleanup", false, "remove everything the agent created in this node's pods and namespace, then exit")
	fs.BoolVar(&o.WaitAfterCleanup, "wait-after-cleanup", false, daemon.WaitAfterCleanupHelp)
	fs.BoolVar(&o.KernelCheckOnly, "kernel-check-only", false, daemon.KernelCheckOnlyHelp)
	fs.BoolVar(&o.KernelCheck, "kernel-check", true, daemon.KernelCheckHelp)
}

// Parse parses args, applies the KST_* environment fallbacks and validates.
func (o *Options) Parse(fs *flag.FlagSet, args []string) error {
	if err := o.Common.Parse(fs, args, &o.NodeName); err != nil {
		return err
	}
	if o.ResyncPeriod < 0 {
		o.ResyncPeriod = 0
	}
	if o.Cleanup && o.NodeName == "" {
		o.NodeName = "(cleanup)" // cleanup needs no API server
	}
	return o.Validate()
}
