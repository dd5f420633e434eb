package startup

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/coreos/go-iptables/iptables"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/carrierexempt"
	"github.com/cmdnu/kube-service-tunnel/internal/ctmarks"
	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/iptbackend"
	"github.com/cmdnu/kube-service-tunnel/internal/kernelcheck"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/internal/version"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/bgp"
	"github.com/cmdnu/kube-service-tunnel/router/ctsync"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/router/metrics"
)

// Main runs the tunnel router with command-line arguments args.
func Main(args []string) error {
	var o Options
	ctx, stop, entry, help, err := daemon.Start("tunnel-router", &o, args)
	if help || err != nil {
		return err
	}
	defer stop()
	var bgpCfg *bgp.Config
	if o.BGPConfig != "" && !o.Cleanup {
		if bgpCfg, err = bgp.Load(o.BGPConfig); err != nil {
			return err
		}
		if o.NodeName == "" && (bgpCfg.RouterID == "" || bgpCfg.NextHop == "") {
			return fmt.Errorf("BGP needs the node's address for its router ID and next hop: set --node-name (NODE_NAME), or routerID and nextHop in %s", o.BGPConfig)
		}
	}
	backend, err := iptbackend.Choose(o.IPTablesBackend, o.Chain, iptbackend.Host)
	if err != nil {
		return err
	}
	iptablesBinary := backend.Backend.Binary("iptables")
	entry.WithFields(logrus.Fields{"backend": backend.Backend, "iptables": iptablesBinary, "why": backend.Reason}).Info("iptables backend chosen")
	// Before any kernel state is touched; cleanup must work on any kernel.
	if !o.Cleanup && (o.KernelCheck || o.KernelCheckOnly) {
		checks := kernelcheck.Router(kernelcheck.RouterParams{Mode: o.Mode, CreateGREDevice: o.CreateDevice, Generations: o.Generations, IPv6: o.IPv6})
		if err := kernelcheck.Verify(checks, entry, kernelcheck.WithIPTables(iptablesBinary),
			kernelcheck.WithIP6Tables(backend.Backend.Binary("ip6tables")), kernelcheck.WithProcSys(o.ProcSys)); err != nil {
			if o.IPv6 {
				return fmt.Errorf("kernel check (--mode %s, --ipv6): %w (--ipv6=false serves IPv4 tunnel IPs only)", o.Mode, err)
			}
			return fmt.Errorf("kernel check (--mode %s): %w", o.Mode, err)
		}
		if o.KernelCheckOnly {
			entry.WithField("mode", o.Mode).Info("kernel check passed (--kernel-check-only): every module the router needs is loaded")
			return nil
		}
	}

	// The metrics port first: it is this node's router lock (daemon.PortWait).
	var metricsListener net.Listener
	if !o.Cleanup && o.MetricsAddress != "" {
		if metricsListener, err = daemon.Listen(ctx, o.MetricsAddress, daemon.PortWait, entry); err != nil {
			return err
		}
		defer metricsListener.Close()
	}

	// client-go's default (5 QPS, burst 10) throttles the paged initial LISTs
	// of large clusters and the events of a full resync.
	var client kubernetes.Interface
	if !o.Cleanup {
		if client, err = o.KubeClient("tunnel-router", 50, 100); err != nil {
			return err
		}
		if err := o.chooseSeed(ctx, client, entry); err != nil {
			return err
		}
	}

	if !o.Cleanup && o.Mode == encap.GRE {
		if o.EncapSources, err = encapSources(ctx, client, o.NodeName, o.IPv6, entry); err != nil {
			return err
		}
	}

	reg := daemon.NewRegistry()
	meter := metrics.NewMetrics(reg)
	dp, chains, closeKernel, err := openDatapath(o.Config.Config, o.IPv6, o.CreateDevice, backend.Backend, procSys(o.ProcSys), meter, entry)
	if err != nil {
		return err
	}
	defer closeKernel()
	if o.Cleanup {
		if err := dp.Cleanup(); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		if err := carrierexempt.Remove(netns.None()); err != nil {
			return fmt.Errorf("cleanup: the carrier's conntrack exemption: %w", err)
		}
		if err := ctsync.RemovePortFilter(netns.None()); err != nil {
			return fmt.Errorf("cleanup: the filter of conntrackd's port: %w", err)
		}
		entry.Info("removed everything the router owned")
		if o.WaitAfterCleanup {
			return daemon.WaitAfterCleanup(ctx, o.MetricsAddress, entry)
		}
		return nil
	}
	first, last := o.NextHopIDs()
	entry.WithFields(logrus.Fields{
		"version": version.String(), "mode": o.Mode, "buckets": o.Buckets, "seed_fingerprint": hmark.SeedFingerprint(o.Seed),
		"generations": o.Generations, "mark_offset": fmt.Sprintf("%#x", o.MarkOffset),
		"rule_priorities": func() string {
			guard, target := o.GuardRules()
			return fmt.Sprintf("%d-%d", guard.Priority, target.Priority)
		}(),
		"tables": fmt.Sprintf("%d-%d", o.Table(0), o.Table(o.Slots()-1)), "route_protocol": o.RouteProtocol, "chain": o.Chain,
		"nexthop_ids": fmt.Sprintf("%#x-%#x", first, last),
	}).Info("starting tunnel router: bucket routes name one nexthop object per endpoint")
	daemon.LogPolicy(entry, o.Policy)
	if err := exemptCarrier(o, entry); err != nil {
		return err
	}
	sysctls := procSys(o.ProcSys)
	warnIfNotForwarding(sysctls, o.IPv6, entry)
	if o.Generations > 1 {
		warnIfNoPickup(sysctls, entry)
	}

	factory := informers.NewSharedInformerFactory(client, 0)
	recorder := router.NewEventRecorder(ctx, client, "tunnel-router", o.NodeName)
	var gate *router.EventGate
	if o.StatusNamespace != "" && o.NodeName != "" {
		// One router records the Services' events; every router logs them.
		gate = router.NewEventGate(entry.WithField("component", "events"))
		recorder = gate.Recorder(recorder)
	}
	ctrl, err := router.NewController(o.Config, client, factory, dp, recorder, entry)
	if err != nil {
		return err
	}
	if gate != nil {
		// On exit the gate releases its Lease first, so that another router
		// records the events at once.
		gateCtx, stopGate := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { gate.Run(gateCtx, client, o.StatusNamespace, o.NodeName, ctrl.Ready); close(done) }()
		defer func() { stopGate(); <-done }()
	}
	if o.ConfigMap.Name != "" {
		// The pools change without a restart.
		stopWatch, err := livepolicy.Start(ctx, client, livepolicy.Ref(o.ConfigMap), ctrl, o.CommandLine, entry.WithField("component", "config"))
		if err != nil {
			return err
		}
		defer stopWatch()
	}
	if o.ConntrackSync.Interface != "" {
		stopSync, err := startConntrackSync(ctx, o.ConntrackSync, ctrl.Policy(), entry.WithField("component", "conntrack-sync"))
		if err != nil {
			return err
		}
		defer stopSync()
	} else if err := ctsync.RemovePortFilter(netns.None()); err != nil {
		// An earlier run's filter only drops datagrams that nothing
		// listens for now.
		entry.WithError(err).WithField("table", "ip "+ctsync.PortFilterTable).Warn("cannot remove the filter of conntrackd's port that a run with --conntrack-sync-interface left")
	}
	ctrl.SetMetrics(meter)
	ctrl.SetAfterResync(debug.FreeOSMemory)
	meter.CollectVIPTraffic(metrics.CounterReaders[*hmark.Chain](chains), entry.WithField("component", "metrics"))
	var speaker *bgp.Speaker
	if bgpCfg != nil {
		speaker = bgp.NewSpeaker(*bgpCfg, entry.WithField("component", "bgp"), bgp.NewMetrics(reg))
		ctrl.SetAnnouncer(speaker)
		// A change of the file (kubelet refreshes the mounted ConfigMap)
		// applies without a restart.
		go bgp.WatchFile(ctx, o.BGPConfig, bgp.ConfigWatchPeriod, speaker.SetConfig, entry.WithField("component", "bgp"))
		if err := followNode(factory, o.NodeName, speaker); err != nil {
			return err
		}
	} else {
		entry.Info("BGP is off (no --bgp-config): the tunnel IPs must be routed to the tunnel nodes by other means")
	}
	if o.StatusNamespace != "" && o.NodeName != "" {
		publisher := routerstatus.NewPublisher(client, o.StatusNamespace, routerstatus.Router{
			Node: o.NodeName, Version: version.String(), Mode: o.Mode, Buckets: o.Buckets, Generations: o.Generations,
			MarkOffset: o.MarkOffset, TableBase: o.TableBase, SeedFingerprint: hmark.SeedFingerprint(o.Seed), BGP: bgpCfg != nil,
		}, o.PodName, nodeUID(factory, o.NodeName), entry.WithField("component", "status"))
		ctrl.SetStatusPublisher(publisher)
		go publisher.Run(ctx)
	} else {
		entry.Info("no status ConfigMap (--status-namespace or --node-name empty): kubectl tunnel will not see this router")
	}
	if metricsListener != nil {
		daemon.ServeHTTP(ctx, metricsListener, reg, meter.WriteText, ctrl.Ready, ctrl.Healthy, entry)
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if speaker != nil {
		done := make(chan struct{})
		go func() { speaker.Run(ctx); close(done) }()
		// On SIGTERM the speaker withdraws every tunnel IP and waits for
		// the withdrawals to reach the peers before Main returns.
		defer func() { <-done }()
	}
	if o.Generations > 1 {
		// Conntrack's sysctls exist once the chain's rules loaded it. (The
		// controller's worker collects unused generations: it alone writes
		// to the kernel.)
		liberalCtx, done := context.WithCancel(ctx)
		go wait.Until(func() {
			if ensureLiberalTCP(sysctls, entry) {
				done()
			}
		}, o.GenerationCheckPeriod, liberalCtx.Done())
	}
	go wait.Until(rulesAheadWarner(chains, entry), rulesAheadPeriod, ctx.Done())
	// The datapath stays as it is on exit: a restarted router adopts it, and
	// traffic keeps flowing meanwhile. Use --cleanup to remove it.
	return ctrl.Run(ctx)
}

// startConntrackSync runs conntrackd (router/ctsync) with the pools of the
// live policy; the returned function stops it.
func startConntrackSync(ctx context.Context, o ConntrackSyncOptions, policy *livepolicy.Policy, log logrus.FieldLogger) (stop func(), err error) {
	addr, err := ctsync.InterfaceAddress(o.Interface)
	if err != nil {
		return nil, err
	}
	d := &ctsync.Daemon{
		Binary: o.Binary,
		Config: ctsync.Config{Interface: o.Interface, Address: addr, Group: o.Group, Dir: o.Dir, Peers: o.Peers},
		Pools: func() []netip.Prefix {
			pools := policy.Get().Pools
			out := make([]netip.Prefix, len(pools))
			for i, p := range pools {
				out[i] = p.Prefix
			}
			return out
		},
		Refresh: o.Refresh,
		Log:     log,
	}
	if err := d.Config.Validate(); err != nil {
		return nil, err
	}
	if _, err := exec.LookPath(o.Binary); err != nil {
		return nil, fmt.Errorf("--conntrackd %s: %w", o.Binary, err)
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("--conntrack-sync-dir: %w", err)
	}
	// conntrackd outlives the signal: it stops when Main returns, after
	// the BGP withdrawals, while traffic still crosses this router.
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := d.Run(ctx); err != nil {
			log.WithError(err).Error("conntrack sync stopped")
		}
	}()
	return func() { cancel(); <-done }, nil
}

// rulesAheadPeriod is how often the router looks for rules ahead of its
// jump in mangle PREROUTING.
const rulesAheadPeriod = time.Minute

// rulesAheadWarner returns a check that logs a warning, once until they
// change, naming the rules of mangle PREROUTING ahead of a chain's jump
// (hmark.Chain.RulesAhead): one that accepts packets (Calico's Felix in its
// default chainInsertMode accepts every established connection's there)
// keeps them from the router's marking, and they are routed as if no
// tunnel IP were served: every connection breaks after its handshake.
func rulesAheadWarner(chains []*hmark.Chain, log logrus.FieldLogger) func() {
	last := map[string]string{}
	return func() {
		for _, c := range chains {
			ahead, err := c.RulesAhead()
			if err != nil {
				log.WithError(err).WithField("chain", c.Name()).Warn("cannot read mangle PREROUTING")
				continue
			}
			key := strings.Join(ahead, "\n")
			if key == last[c.Name()] {
				continue
			}
			last[c.Name()] = key
			if len(ahead) == 0 {
				log.WithField("chain", c.Name()).Info("the router's jump is the first rule of mangle PREROUTING")
				continue
			}
			log.WithFields(logrus.Fields{"chain": c.Name(), "rules_ahead": ahead}).Warn("rules in mangle PREROUTING come before the router's jump: one that accepts packets keeps them from the tunnel's marking, " +
				"and their connections break after the handshake. Under Calico, set chainInsertMode: Append in the FelixConfiguration of the tunnel nodes (docs/network-plugins.md#calico)")
		}
	}
}

// exemptCarrier keeps, in gre mode, the router's GRE out of its node's
// connection tracking, so that no NAT of the node (Flannel's masquerade)
// rewrites the source the pods' carrier guard checks
// (internal/carrierexempt); in mpls mode, whose carrier is not IP, it
// removes the table of an earlier gre run. A kernel without nf_tables (or
// nft_ct) gets a warning, not a failure: the router worked there before,
// and only a node that NATs its own traffic to pods needs the table.
func exemptCarrier(o Options, log logrus.FieldLogger) error {
	if o.Mode != encap.GRE {
		if err := carrierexempt.Remove(netns.None()); err != nil {
			return fmt.Errorf("removing the carrier's conntrack exemption of gre mode: %w", err)
		}
		return nil
	}
	block, mask := o.Config.Config.MarkBlock()
	changed, err := carrierexempt.Ensure(netns.None(), block, mask)
	if err != nil {
		log.WithError(err).WithField("table", "inet "+carrierexempt.Table).
			Warn("the router's GRE carrier is tracked by the node's conntrack: a NAT of the node that rewrites its source (Flannel's --ip-masq) makes the pods drop it")
		return nil
	}
	if changed {
		log.WithFields(logrus.Fields{"table": "inet " + carrierexempt.Table, "mark": fmt.Sprintf("%#x/%#x", block, mask)}).
			Info("the router's GRE carrier is exempted from the node's connection tracking, so that no NAT of the node rewrites its source")
	}
	return nil
}

// seedTimeout bounds the wait for the seed Secret at start-up (the API
// server may be starting too); the router exits after it, and its restart
// tries again. Nothing in the kernel is touched before the seed is known.
const seedTimeout = 2 * time.Minute

// chooseSeed sets the HMARK seed: --seed when given, else the one in
// --seed-secret, which the first router of a cluster creates with a random
// seed. It logs where the seed came from and its fingerprint, never the seed.
func (o *Options) chooseSeed(ctx context.Context, client kubernetes.Interface, log logrus.FieldLogger) error {
	if o.SeedGiven {
		log.WithField("seed_fingerprint", hmark.SeedFingerprint(o.Seed)).Info("HMARK seed from --seed; the seed Secret is not read")
		return nil
	}
	seed, source, err := seedsecret.Ensure(ctx, client, o.SeedSecret, seedTimeout)
	if err != nil {
		return fmt.Errorf("HMARK seed (--seed-secret %s; or set --seed): %w", o.SeedSecret, err)
	}
	o.Seed = seed
	log.WithFields(logrus.Fields{"secret": o.SeedSecret.String(), "source": source, "seed_fingerprint": hmark.SeedFingerprint(seed)}).Info("HMARK seed from its Secret")
	return nil
}

// followNode hands the speaker this node's IPv4 and IPv6 addresses and
// labels, now and whenever they change (a peer's nodeSelector may start or
// stop matching; an address is a default next hop).
func followNode(factory informers.SharedInformerFactory, name string, speaker *bgp.Speaker) error {
	if name == "" { // routerID, nextHop and nextHopIPv6 are configured
		speaker.SetNode(bgp.Node{})
		return nil
	}
	set := func(obj any) {
		if n, ok := obj.(*corev1.Node); ok && n.Name == name {
			speaker.SetNode(bgp.Node{Name: n.Name, Address: kubeobj.NodeAddress(n), AddressIPv6: kubeobj.NodeAddressOf(n, false), Labels: n.Labels})
		}
	}
	_, err := factory.Core().V1().Nodes().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    set,
		UpdateFunc: func(_, obj any) { set(obj) },
	})
	if err != nil {
		return fmt.Errorf("watching node %s: %w", name, err)
	}
	return nil
}

// encapSources returns the outer sources of gre mode's packets: the node's
// address of each family served (its first InternalIP, else ExternalIP),
// which the endpoint agents accept the carrier from, when it is an address
// of this host. The endpoint agents drop GRE from any other source, so a
// family without one is logged as an error (its pods will refuse the
// router's packets) but does not stop the router: the kernel then chooses
// the source.
func encapSources(ctx context.Context, client kubernetes.Interface, nodeName string, ipv6 bool, log logrus.FieldLogger) ([]netip.Addr, error) {
	if nodeName == "" {
		log.Error("no --node-name (NODE_NAME): the GRE packets' source is left to the kernel, and the endpoint agents accept GRE only from the router nodes' addresses")
		return nil, nil
	}
	var node *corev1.Node
	err := wait.PollUntilContextTimeout(ctx, time.Second, encapSourceTimeout, true, func(ctx context.Context) (bool, error) {
		// A list by name needs only the grant the informers use.
		l, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + nodeName})
		if err == nil && len(l.Items) == 0 {
			err = fmt.Errorf("node %s not found", nodeName)
		}
		if err != nil {
			log.WithError(err).WithField("node", nodeName).Warn("reading this node's addresses for the GRE packets' source; retrying")
			return false, nil
		}
		node = &l.Items[0]
		return true, nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading node %s for the GRE packets' source address: %w", nodeName, err)
	}
	local, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("listing this host's addresses: %w", err)
	}
	isLocal := func(a netip.Addr) bool {
		for _, l := range local {
			if p, ok := l.(*net.IPNet); ok {
				if b, ok := netip.AddrFromSlice(p.IP); ok && b.Unmap() == a {
					return true
				}
			}
		}
		return false
	}
	var out []netip.Addr
	for _, v4 := range []bool{true, false} {
		if !v4 && !ipv6 {
			continue
		}
		a := kubeobj.NodeAddressOf(node, v4)
		fields := logrus.Fields{"node": nodeName, "family": datapath.IPv4, "address": a}
		if !v4 {
			fields["family"] = datapath.IPv6
		}
		switch {
		case !a.IsValid():
			log.WithFields(fields).Error("the node has no InternalIP or ExternalIP of this family in status.addresses: the GRE packets' source is left to the kernel, and the endpoint agents drop GRE from any address but the router nodes'")
		case !isLocal(a):
			log.WithFields(fields).Error("the node's address is not on any interface of this host: the GRE packets' source is left to the kernel, and the endpoint agents drop GRE from any address but the router nodes'")
		default:
			log.WithFields(fields).Info("GRE packets leave from the node's address (the endpoint agents accept the carrier only from the router nodes' addresses)")
			out = append(out, a)
		}
	}
	return out, nil
}

// encapSourceTimeout bounds the wait for this node's Node object.
const encapSourceTimeout = 2 * time.Minute

// openDatapath opens the kernel seams of the current network namespace;
// metrics counts the writes that go through them. It returns the datapath
// of each family served (IPv6 only with ipv6), dispatched by tunnel IP, and
// the HMARK chains, whose tunnel IPs' counters are read at each scrape.
func openDatapath(cfg datapath.Config, ipv6, createDevice bool, backend iptbackend.Backend, sysctls procSys, meter *metrics.Metrics, log logrus.FieldLogger) (*datapath.Families, []*hmark.Chain, func(), error) {
	handle, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("netlink handle: %w", err)
	}
	routes, err := rtnl.Open(netns.None())
	if err != nil {
		handle.Close()
		return nil, nil, nil, fmt.Errorf("rtnetlink client: %w", err)
	}
	sets, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		routes.Close()
		handle.Close()
		return nil, nil, nil, fmt.Errorf("netfilter netlink handle (ipsets): %w", err)
	}
	closeAll := func() { routes.Close(); handle.Close(); sets.Close() }
	// The router's own conntrack entries, filtered by mark in the kernel
	// (one netlink socket per listing).
	var conntrack *ctmarks.Lister
	if cfg.Generations > 1 {
		conntrack = &ctmarks.Lister{}
	}
	nodeLink := func(ip netip.Addr) (int, error) {
		rs, err := handle.RouteGet(ip.AsSlice())
		if err != nil {
			return 0, err
		}
		if len(rs) == 0 || rs[0].LinkIndex == 0 {
			return 0, fmt.Errorf("no route to %v", ip)
		}
		return rs[0].LinkIndex, nil
	}
	// open builds one family's chain and datapath over the shared handles.
	open := func(family datapath.Family) (*datapath.Datapath, *hmark.Chain, error) {
		fcfg := cfg.ForFamily(family)
		binary, hfamily := backend.Binary("iptables"), hmark.IPv4
		if family == datapath.IPv6 {
			binary, hfamily = backend.Binary("ip6tables"), hmark.IPv6
		}
		ipt, err := iptables.New(iptables.Path(binary))
		if err != nil {
			return nil, nil, fmt.Errorf("%s (is the iptables package installed?): %w", binary, err)
		}
		// Rules are read with binary and written with its restore
		// command: the same backend.
		chain, err := hmark.NewChainFamily(hfamily, meter.IPTables(ipt), meter.IPSets(hmark.KernelSets{Handle: sets}), fcfg.ChainName(),
			fcfg.HMARKParams(), meter.Restorer(hmark.NewExecRestorer(binary)))
		if err != nil {
			return nil, nil, err
		}
		if fcfg.Generations > 1 {
			if err := chain.SetSticky(fcfg.Sticky()); err != nil {
				return nil, nil, err
			}
		}
		var device datapath.TunnelDevice = datapath.NoDevice{}
		switch {
		case fcfg.Mode == encap.GRE && createDevice:
			device = &datapath.GREDevice{Name: fcfg.GREDeviceName(), Family: family, Links: handle}
		case fcfg.Mode == encap.GRE:
			device = &datapath.ExistingDevice{Name: fcfg.GREDeviceName(), Links: handle}
		}
		dp := datapath.NewDatapath(fcfg, meter.Routes(routes), meter.Rules(handle), chain, device, nodeLink, log.WithField("family", family.String()))
		if conntrack != nil {
			dp.EnableGenerationCollection(conntrack)
		}
		return dp, chain, nil
	}
	dp4, chain4, err := open(datapath.IPv4)
	if err != nil {
		closeAll()
		return nil, nil, nil, err
	}
	chains := []*hmark.Chain{chain4}
	var dp6 *datapath.Datapath
	if ipv6 {
		var chain6 *hmark.Chain
		if dp6, chain6, err = open(datapath.IPv6); err != nil {
			closeAll()
			return nil, nil, nil, fmt.Errorf("IPv6 datapath (--ipv6=false serves IPv4 only): %w", err)
		}
		chains = append(chains, chain6)
	}
	families, err := datapath.NewFamilies(dp4, dp6)
	if err != nil {
		closeAll()
		return nil, nil, nil, err
	}
	return families, chains, closeAll, nil
}

// procSys is the directory of the sysctls the router reads and sets
// (--proc-sys); names are relative to it ("net/ipv4/ip_forward").
type procSys string

func (d procSys) path(name string) string { return filepath.Join(string(d), name) }

// read reads a numeric sysctl.
func (d procSys) read(name string) (uint32, error) {
	b, err := os.ReadFile(d.path(name))
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
	return uint32(v), err
}

// beLiberal is the sysctl that stops conntrack's TCP window tracking from
// ignoring or invalidating packets it cannot check.
const beLiberal = "net/netfilter/nf_conntrack_tcp_be_liberal"

// ensureLiberalTCP sets nf_conntrack_tcp_be_liberal=1, as kube-proxy's
// --conntrack-tcp-be-liberal does. The router sees only the client's half of
// each flow, so conntrack cannot track the window: on Linux 6.1 it then
// ignores most of the client's packets (the entry is not refreshed, a RST
// does not end it) and sometimes marks one INVALID, which then loses its
// saved generation and reaches another pod. The lab found it.
// It returns true once done, or once it has warned that it cannot.
func ensureLiberalTCP(sysctls procSys, log logrus.FieldLogger) bool {
	v, err := sysctls.read(beLiberal)
	if os.IsNotExist(err) {
		return false // nf_conntrack not loaded yet
	}
	if err == nil && v == 1 {
		return true
	}
	if err := os.WriteFile(sysctls.path(beLiberal), []byte("1\n"), 0o644); err != nil {
		log.WithError(err).Warn("cannot set net.netfilter.nf_conntrack_tcp_be_liberal=1: established TCP flows may lose their endpoint while it drains (set it on this node)")
		return true
	}
	log.Info("set net.netfilter.nf_conntrack_tcp_be_liberal=1: the router sees one direction of each flow, which strict TCP window tracking cannot follow")
	return true
}

// warnIfNoPickup logs when conntrack would not pick up TCP flows mid-stream:
// the router untracks SYNs (it never sees replies), so established flows are
// tracked from their second packet on, which needs nf_conntrack_tcp_loose.
func warnIfNoPickup(sysctls procSys, log logrus.FieldLogger) {
	if v, err := sysctls.read("net/netfilter/nf_conntrack_tcp_loose"); err == nil && v == 0 {
		log.Warn("net.netfilter.nf_conntrack_tcp_loose is 0: TCP flows are not tracked, so they do not keep their endpoint while it drains (set it to 1)")
	}
}

// warnIfNotForwarding logs when the node would not forward tunnelled packets
// (of IPv6 tunnel IPs too, with ipv6). The router does not change host-wide
// sysctls itself.
func warnIfNotForwarding(sysctls procSys, ipv6 bool, log logrus.FieldLogger) {
	if v, err := sysctls.read("net/ipv4/ip_forward"); err == nil && v != 1 {
		log.Warn("net.ipv4.ip_forward is 0: this node will not forward tunnel traffic (set it to 1)")
	}
	if !ipv6 {
		return
	}
	if v, err := sysctls.read("net/ipv6/conf/all/forwarding"); err == nil && v != 1 {
		log.Warn("net.ipv6.conf.all.forwarding is 0: this node will not forward the traffic of IPv6 tunnel IPs (set it to 1, or run with --ipv6=false)")
	}
}

// nodeUID returns the UID of the Node name as the informers know it, or ""
// until they do: the router status's owner.
func nodeUID(factory informers.SharedInformerFactory, name string) func() types.UID {
	nodes := factory.Core().V1().Nodes().Lister()
	return func() types.UID {
		node, err := nodes.Get(name)
		if err != nil {
			return ""
		}
		return node.UID
	}
}
