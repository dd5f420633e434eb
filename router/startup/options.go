package startup

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/iptbackend"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/ctsync"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// Options are the tunnel router's command-line options.
type Options struct {
	router.Config
	daemon.Common
	NodeName string
	// Cleanup removes everything the router owns and exits.
	Cleanup bool
	// KernelCheckOnly runs the kernel check (which loads missing modules)
	// and exits; KernelCheck false skips the check.
	KernelCheckOnly, KernelCheck bool
	// WaitAfterCleanup makes a successful Cleanup answer /readyz and wait
	// for SIGTERM.
	WaitAfterCleanup bool
	// CreateDevice makes the router create (and own) its GRE device; when
	// false it uses an existing device of that name.
	CreateDevice bool
	// BGPConfig is the BGP configuration file; empty: no BGP.
	BGPConfig string
	// MetricsAddress is where /metrics, /healthz and /readyz are served; empty: nowhere.
	MetricsAddress string
	// IPTablesBackend is the iptables backend to write rules with, or
	// iptbackend.Auto to detect the node's.
	IPTablesBackend iptbackend.Backend
	// ProcSys is the sysctl directory (--proc-sys).
	ProcSys string
	// SeedSecret is where the seed is kept when --seed is not given
	// (--seed-secret); seedsecret.Ensure creates it on first use.
	SeedSecret seedsecret.Ref
	// StatusNamespace is where the router publishes its status ConfigMap
	// and competes for the events Lease (--status-namespace); empty: no
	// status, and the router records every event itself.
	StatusNamespace string
	// PodName is the router's pod (POD_NAME), recorded in its status.
	PodName string
	// IPv6 makes the router serve IPv6 tunnel IPs too (--ipv6): an IPv6
	// datapath beside the IPv4 one. Without it IPv6 tunnel IPs are
	// refused with a TunnelProgramFailed Warning.
	IPv6 bool
	// ConntrackSync shares the tunnel IPs' conntrack entries with the other
	// routers (conntrackd); off without an interface.
	ConntrackSync ConntrackSyncOptions
	// SeedGiven is true when --seed (or KST_SEED) set Seed.
	SeedGiven bool
	seed      string
}

// ConntrackSyncOptions are the --conntrack-sync-* flags.
type ConntrackSyncOptions struct {
	Interface string
	Group     int
	Refresh   time.Duration
	Dir       string
	Binary    string
	// Peers are the other routers' addresses on Interface, from which
	// alone conntrackd's port takes datagrams (--conntrack-sync-peers).
	Peers []netip.Prefix
}

// DefaultConntrackSyncDir is where the router keeps conntrackd's files.
const DefaultConntrackSyncDir = "/run/kube-service-tunnel/conntrackd"

// DefaultMetricsAddress is the router's default --metrics-address.
const DefaultMetricsAddress = ":9641"

// AddFlags registers the options on fs with their defaults.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	o.Config = router.Config{Config: datapath.DefaultConfig(), ResyncPeriod: router.DefaultResyncPeriod}
	fs.Func("mode", `encapsulation: "gre" or "mpls" (default "gre")`, func(s string) error { o.Mode = encap.Mode(s); return nil })
	fs.StringVar(&o.seed, "seed", "", "HMARK seed shared by every router, decimal or 0x-hex; empty: the seed in --seed-secret, created with a random seed by the first router that finds none")
	o.SeedSecret = seedsecret.Ref{Namespace: seedsecret.DefaultNamespace, Name: seedsecret.DefaultName}
	fs.Func("seed-secret", `Secret holding the HMARK seed (data key "seed") as NAMESPACE/NAME, read at start-up when --seed is not given (default "`+o.SeedSecret.String()+`")`, func(s string) error {
		ns, name, ok := strings.Cut(s, "/")
		if !ok || ns == "" || name == "" {
			return fmt.Errorf("%q: want NAMESPACE/NAME", s)
		}
		o.SeedSecret = seedsecret.Ref{Namespace: ns, Name: name}
		return nil
	})
	fs.IntVar(&o.Buckets, "buckets", o.Buckets, "number of HMARK buckets, each with its own rule and routing table")
	fs.Func("mark-offset", "packet mark of slot 0, decimal or 0x-hex; slot k has mark-offset+k (default 0x1000)", func(s string) error {
		v, err := strconv.ParseUint(s, 0, 32)
		o.MarkOffset = uint32(v)
		return err
	})
	fs.IntVar(&o.Generations, "generations", o.Generations, "routing generations kept so that established flows keep their endpoint while new flows follow a changed table (draining); 1 makes the router stateless (no conntrack)")
	fs.DurationVar(&o.GenerationCheckPeriod, "generation-check-period", o.GenerationCheckPeriod, "how often older generations are looked up in conntrack and removed once no flow uses them")
	fs.IntVar(&o.RulePriority, "rule-priority", o.RulePriority, "first priority of the slot rules (a search tree over the slots, fewer than 2*buckets*generations rules from rule-priority on, after a guard at rule-priority-1)")
	fs.IntVar(&o.TableBase, "table-base", o.TableBase, "routing table of slot 0; slot k uses table-base+k")
	fs.Func("route-protocol", "rtm_protocol number marking the router's routes and rules (default 245)", func(s string) error {
		v, err := strconv.ParseUint(s, 0, 8)
		o.RouteProtocol = uint8(v)
		return err
	})
	fs.StringVar(&o.GREDevice, "gre-device", o.GREDevice, "name of the flow-based GRE device (gre mode)")
	fs.BoolVar(&o.CreateDevice, "gre-device-create", true, "create the flow-based GRE device (with its family's first tunnel IP; deleted with the last); false uses an existing device of that name, which the router never changes or deletes")
	fs.StringVar(&o.Chain, "chain", o.Chain, "iptables chain in the mangle table holding the HMARK rules; also the name of its ipsets")
	fs.BoolVar(&o.IPv6, "ipv6", true, "serve IPv6 tunnel IPs as well: ip6tables chain --chain6, IPv6 rules and routes and, in gre mode, the flow-based ip6gre device --gre6-device; false serves IPv4 tunnel IPs only (for nodes without IPv6)")
	fs.StringVar(&o.Chain6, "chain6", o.Chain6, "ip6tables chain in the mangle table holding the IPv6 HMARK rules; also the name of its ipsets, so it must differ from --chain")
	fs.StringVar(&o.GRE6Device, "gre6-device", o.GRE6Device, "name of the flow-based ip6gre device carrying IPv6 tunnel IPs (gre mode)")
	fs.StringVar(&o.ConntrackSync.Interface, "conntrack-sync-interface", "", "link every router shares (its IPv4 address sends): run conntrackd, which copies each router's conntrack entries for the pools' tunnel IPs, marks included, into the other routers' tables, so that a flow moved to another router (failover) keeps its generation and a draining pod keeps its flows; empty: off (needs --generations > 1 and conntrackd on PATH or --conntrackd)")
	fs.IntVar(&o.ConntrackSync.Group, "conntrack-sync-group", ctsync.DefaultGroup, "UDP port of conntrackd's multicast group "+ctsync.DefaultMulticastAddress.String()+": the same on every router of a cluster, another for another cluster on the same link")
	fs.Func("conntrack-sync-peers", "the other routers' IPv4 addresses on --conntrack-sync-interface, addresses or CIDRs separated by commas (the same list on every router: its own address may be in it): "+
		"the router's nftables table "+ctsync.PortFilterTable+" drops every datagram to conntrackd's port but those from them on that interface; "+
		"empty: from any host on that interface (a warning: any host on the link can write conntrack entries)", func(s string) error {
		peers, err := ctsync.ParsePeers(s)
		o.ConntrackSync.Peers = peers
		return err
	})
	fs.DurationVar(&o.ConntrackSync.Refresh, "conntrack-sync-refresh", ctsync.DefaultRefresh, "how often conntrackd sends its whole cache to the other routers (their copies expire 300 s after a send), and the pools are checked for a change of its filter")
	fs.StringVar(&o.ConntrackSync.Dir, "conntrack-sync-dir", DefaultConntrackSyncDir, "directory of conntrackd's configuration, lock file and control socket")
	fs.StringVar(&o.ConntrackSync.Binary, "conntrackd", "conntrackd", "conntrackd's path (the router's image has it)")
	fs.DurationVar(&o.ResyncPeriod, "resync-period", o.ResyncPeriod, "how often the whole kernel state is compared and repaired (0 disables)")
	daemon.AddPolicyFlags(fs, &o.Policy)
	o.Common.AddFlags(fs)
	fs.StringVar(&o.NodeName, "node-name", "", "name of this node, used as the event source (env NODE_NAME)")
	fs.StringVar(&o.BGPConfig, "bgp-config", "", "BGP configuration file (YAML): announce the served tunnel IPs to these peers; empty disables BGP")
	fs.StringVar(&o.StatusNamespace, "status-namespace", routerstatus.DefaultNamespace, "namespace of the router's status ConfigMap, "+routerstatus.NamePrefix+"NODE, which kubectl tunnel reads, and of the Lease "+router.EventLeaseName+" that lets one router record the Services' events (needs --node-name); empty: no status, and every router records events")
	fs.StringVar(&o.MetricsAddress, "metrics-address", DefaultMetricsAddress, "address serving /metrics, /healthz and /readyz; empty disables")
	daemon.AddProcSysFlag(fs, &o.ProcSys)
	o.IPTablesBackend = iptbackend.Auto
	fs.Func("iptables-backend", `iptables backend for the router's rules: "auto" (the node's: where kubelet's or the router's own chains are, else the one with more rules, else nft), "nft", "legacy", or "system" (the iptables command on PATH) (default "auto")`, func(s string) error {
		b, err := iptbackend.Parse(s)
		o.IPTablesBackend = b
		return err
	})
	fs.BoolVar(&o.Cleanup, "cleanup", false, "remove every rule, route, chain and device the router owns, then exit")
	fs.BoolVar(&o.WaitAfterCleanup, "wait-after-cleanup", false, daemon.WaitAfterCleanupHelp)
	fs.BoolVar(&o.KernelCheckOnly, "kernel-check-only", false, daemon.KernelCheckOnlyHelp)
	fs.BoolVar(&o.KernelCheck, "kernel-check", true, daemon.KernelCheckHelp)
}

// Parse parses args, applies the KST_* environment fallbacks and validates.
func (o *Options) Parse(fs *flag.FlagSet, args []string) error {
	if err := o.Common.Parse(fs, args, &o.NodeName); err != nil {
		return err
	}
	o.PodName = os.Getenv("POD_NAME")
	if o.seed != "" {
		v, err := seedsecret.ParseSeed(o.seed)
		if err != nil {
			return fmt.Errorf("--seed: %w", err)
		}
		o.Seed, o.SeedGiven = v, true
	}
	if o.ResyncPeriod < 0 {
		o.ResyncPeriod = time.Duration(0)
	}
	if o.IPv6 && o.CreateDevice && o.Mode == encap.GRE && o.GRE6Device == o.GREDevice {
		// One device the operator made may carry both families; two the
		// router creates are of two kinds (gre, ip6gre).
		return fmt.Errorf("--gre6-device %q: --gre-device has that name, and the router creates a device of each kind", o.GRE6Device)
	}
	if len(o.ConntrackSync.Peers) > 0 && o.ConntrackSync.Interface == "" && !o.Cleanup && !o.KernelCheckOnly {
		return fmt.Errorf("--conntrack-sync-peers %v: needs --conntrack-sync-interface, the link they are on (without it there is no conntrack sync)", o.ConntrackSync.Peers)
	}
	if o.ConntrackSync.Interface != "" && !o.Cleanup && !o.KernelCheckOnly {
		if o.Generations < 2 {
			return fmt.Errorf("--conntrack-sync-interface %s: needs --generations > 1 (with %d the router keeps no conntrack state to share)", o.ConntrackSync.Interface, o.Generations)
		}
		if o.ConntrackSync.Refresh <= 0 || o.ConntrackSync.Refresh > 4*time.Minute {
			return fmt.Errorf("--conntrack-sync-refresh %v: want more than 0 and at most 4m (the copies expire 300 s after a send)", o.ConntrackSync.Refresh)
		}
	}
	return o.Validate()
}
