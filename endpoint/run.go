package endpoint

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/daemon"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/iptbackend"
	"github.com/cmdnu/kube-service-tunnel/internal/kernelcheck"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/version"
	"github.com/cmdnu/kube-service-tunnel/runtime"
)

// Main runs the endpoint agent with command-line arguments args.
func Main(args []string) error {
	var o Options
	ctx, stop, entry, help, err := daemon.Start("tunnel-endpoint", &o, args)
	if help || err != nil {
		return err
	}
	defer stop()

	nodeNS, err := netns.Get()
	if err != nil {
		return fmt.Errorf("opening this node's network namespace: %w", err)
	}
	defer nodeNS.Close()
	backend, err := iptbackend.Choose(o.IPTablesBackend, "", iptbackend.Host)
	if err != nil {
		return err
	}
	tables := NamespaceIPTables{Binary: backend.Backend.Binary("iptables")}
	entry.WithFields(logrus.Fields{"backend": backend.Backend, "iptables": tables.Binary, "why": backend.Reason}).Info("iptables backend chosen for the network policy rules in pods")
	if o.Cleanup {
		if err := Cleanup(o.Config, tables, nodeNS, entry); err != nil || !o.WaitAfterCleanup {
			return err
		}
		return daemon.WaitAfterCleanup(ctx, o.MetricsAddress, entry)
	}
	// Before any kernel state is touched; cleanup must work on any kernel.
	if o.KernelCheck || o.KernelCheckOnly {
		if err := kernelcheck.Verify(kernelcheck.EndpointChecks(kernelcheck.EndpointParams{Mode: o.Mode, NetworkPolicy: o.NetworkPolicy, UntrackReplies: o.UntrackReplies}), entry, kernelcheck.WithProcSys(o.ProcSys), kernelcheck.WithIPTables(tables.Binary)); err != nil {
			return fmt.Errorf("kernel check (--mode %s): %w", o.Mode, err)
		}
	}
	if o.KernelCheckOnly {
		entry.WithField("mode", o.Mode).Info("kernel check passed (--kernel-check-only): every module the agent needs is loaded")
		return nil
	}

	// The metrics port first: it is this node's agent lock (daemon.PortWait).
	var metricsListener net.Listener
	if o.MetricsAddress != "" {
		if metricsListener, err = daemon.Listen(ctx, o.MetricsAddress, daemon.PortWait, entry); err != nil {
			return err
		}
		defer metricsListener.Close()
	}

	locator, how, err := runtime.Open(ctx, runtime.Options{Runtime: o.Runtime, Endpoint: o.RuntimeEndpoint})
	if err != nil {
		return err
	}
	defer locator.Close()
	entry.WithFields(logrus.Fields{
		"version": version.String(), "mode": o.Mode, "node": o.NodeName, "runtime": how, "device": o.Device,
		"pod_advmss": o.PodAdvMSS, "route_protocol": o.RouteProtocol, "network_policy": o.NetworkPolicy, "untrack_replies": o.UntrackReplies,
	}).Info("starting endpoint agent")
	daemon.LogPolicy(entry, o.Policy)

	client, err := o.KubeClient("tunnel-endpoint", 20, 40)
	if err != nil {
		return err
	}
	inf := NewInformers(client, o.NodeName)
	// The filter tables are read even with network policy off, so that the
	// rules of an earlier run are removed.
	podNet := NewPodNetwork(o.Config, nodeNS).WithPolicyTables(tables)
	ctrl, err := NewController(o.Config, inf, locator, podNet, NewNodeNetwork(o.Config, nodeNS), entry)
	if err != nil {
		return err
	}
	// Pods that list the readiness gate cmd.nu/tunnel-ready become ready
	// once their tunnel IPs are in place (pods/status, patch).
	ctrl.SetConditionWriter(APIConditionWriter{Client: client})
	if o.ConfigMap.Name != "" {
		// The pools change without a restart.
		stopWatch, err := livepolicy.Start(ctx, client, livepolicy.Ref(o.ConfigMap), ctrl, o.CommandLine, entry.WithField("component", "config"))
		if err != nil {
			return err
		}
		defer stopWatch()
	}
	reg := daemon.NewRegistry()
	// Only gre mode has a decapsulation device (and its counters) per pod;
	// in mpls mode the routers' counters cover the tunnel IPs.
	var decap DecapCounterReader
	if o.Mode == encap.GRE {
		decap = podNet
	}
	ctrl.SetMetrics(NewMetrics(reg, decap, podNet, o.NetworkPolicy))
	if o.Mode == encap.MPLS {
		reg.MustRegister(NewBridgeGuardCollector(nodeNS, entry.WithField("component", "metrics")))
	}
	if o.UntrackReplies {
		reg.MustRegister(NewReplyExemptionCollector(nodeNS, entry.WithField("component", "metrics")))
	}
	if metricsListener != nil {
		daemon.ServeHTTP(ctx, metricsListener, reg, nil, ctrl.Ready, ctrl.Healthy, entry)
	}
	inf.Start(ctx.Done())
	defer inf.Shutdown()
	// Pods keep what they have on exit: a restarted agent adopts it, and
	// established connections keep flowing. Use --cleanup to remove it.
	return ctrl.Run(ctx)
}

// Cleanup removes everything the agent created on this node: in every
// network namespace it can find (pods' included, whether or not their pods
// still exist; network policy rules through tables), and the MPLS routes
// in the node's own namespace nodeNS. It needs no API server. Sysctls it
// raised are left as they are.
func Cleanup(cfg Config, tables PolicyTables, nodeNS netns.NsHandle, log logrus.FieldLogger) error {
	all, err := runtime.AllNamespaces()
	if err != nil {
		return err
	}
	defer func() {
		for _, ns := range all {
			ns.Close()
		}
	}()
	return CleanupNamespaces(cfg, tables, all, nodeNS, log)
}

// CleanupNamespaces removes what the agent owns from the given namespaces and
// from the node's. A namespace that cannot be cleaned (a foreign device of
// the agent's name) is reported; the others are still cleaned.
func CleanupNamespaces(cfg Config, tables PolicyTables, namespaces []runtime.Netns, nodeNS netns.NsHandle, log logrus.FieldLogger) error {
	pn := NewPodNetwork(cfg, nodeNS).WithPolicyTables(tables)
	var errs []error
	for _, ns := range namespaces {
		acts, err := pn.Cleanup(ns.Handle)
		for _, a := range acts {
			log.WithFields(logrus.Fields{"netns": ns.Path, "change": a.String()}).Info("removed")
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("netns %s: %w", ns.Path, err))
		}
	}
	acts, err := NewNodeNetwork(cfg, nodeNS).Sync(nil, netip.Addr{})
	for _, a := range acts {
		log.WithFields(logrus.Fields{"netns": "node", "change": a.String()}).Info("removed")
	}
	if err != nil {
		errs = append(errs, fmt.Errorf("node namespace: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	log.WithField("namespaces", len(namespaces)).Info("removed everything the endpoint agent owned")
	return nil
}
