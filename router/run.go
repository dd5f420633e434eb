package router

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/coreos/go-iptables/iptables"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"k8s.io/client-go/informers"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
)

// Main runs the tunnel router with command-line arguments args.
func Main(args []string) error {
	fs := flag.NewFlagSet("tunnel-router", flag.ContinueOnError)
	var o Options
	o.AddFlags(fs)
	if err := o.Parse(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	entry, err := o.Logger("tunnel-router")
	if err != nil {
		return err
	}

	dp, closeKernel, err := openDatapath(o.Config, o.CreateDevice, entry)
	if err != nil {
		return err
	}
	defer closeKernel()
	if o.Cleanup {
		if err := dp.Cleanup(); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		entry.Info("removed everything the router owned")
		return nil
	}
	entry.WithFields(logrus.Fields{
		"mode": o.Mode, "buckets": o.Buckets, "seed_fingerprint": hmark.SeedFingerprint(o.Seed),
		"mark_offset": fmt.Sprintf("%#x", o.MarkOffset), "rule_priorities": fmt.Sprintf("%d-%d", o.Priority(0), o.Priority(o.Buckets-1)),
		"tables": fmt.Sprintf("%d-%d", o.Table(0), o.Table(o.Buckets-1)), "route_protocol": o.RouteProtocol, "chain": o.Chain,
	}).Info("starting tunnel router")
	warnIfNotForwarding(entry)

	// client-go's default (5 QPS, burst 10) throttles the paged initial LISTs
	// of large clusters and the events of a full resync.
	client, err := o.KubeClient("tunnel-router", 50, 100)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	factory := informers.NewSharedInformerFactory(client, 0)
	recorder := NewEventRecorder(ctx, client, "tunnel-router", o.NodeName)
	ctrl, err := NewController(o.Config, client, factory, dp, recorder, entry)
	if err != nil {
		return err
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	// The datapath stays as it is on exit: a restarted router adopts it, and
	// traffic keeps flowing meanwhile. Use --cleanup to remove it.
	return ctrl.Run(ctx)
}

// openDatapath opens the kernel seams of the current network namespace.
func openDatapath(cfg Config, createDevice bool, log logrus.FieldLogger) (*Datapath, func(), error) {
	handle, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, fmt.Errorf("netlink handle: %w", err)
	}
	routes, err := rtnl.Open(netns.None())
	if err != nil {
		handle.Close()
		return nil, nil, fmt.Errorf("rtnetlink client: %w", err)
	}
	closeAll := func() { routes.Close(); handle.Close() }
	ipt, err := iptables.New()
	if err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("iptables (is the iptables package installed?): %w", err)
	}
	chain, err := hmark.NewChain(ipt, cfg.Chain, hmark.Params{Buckets: uint32(cfg.Buckets), Offset: cfg.MarkOffset, Seed: cfg.Seed})
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	var device tunnelDevice = NoDevice{}
	switch {
	case cfg.Mode == ModeGRE && createDevice:
		device = &GREDevice{Name: cfg.GREDevice, Links: handle}
	case cfg.Mode == ModeGRE:
		device = &ExistingDevice{Name: cfg.GREDevice, Links: handle}
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
	return NewDatapath(cfg, routes, handle, chain, device, nodeLink, log), closeAll, nil
}

// warnIfNotForwarding logs when the node would not forward tunnelled packets.
// The router does not change host-wide sysctls itself.
func warnIfNotForwarding(log logrus.FieldLogger) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	if err == nil && strings.TrimSpace(string(b)) != "1" {
		log.Warn("net.ipv4.ip_forward is 0: this node will not forward tunnel traffic (set it to 1)")
	}
}
