package metrics

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// Reasons a Service's tunnel IP claim is not served (label reason of
// kube_service_tunnel_router_refused_claims).
const (
	RefusedInvalid  = "invalid"  // the annotation is not usable (ParseIPs)
	RefusedPolicy   = "refused"  // address pools, node or service networks
	RefusedConflict = "conflict" // an older Service serves the tunnel IP
)

// Reconcile kinds (label kind of the reconcile metrics): the work items of
// the controller's queue.
const (
	ReconcileService  = "service"
	ReconcileResync   = "resync"
	ReconcileNetworks = "networks"
)

// Kernel objects and operations (labels of
// kube_service_tunnel_router_kernel_operations_total).
const (
	objectRoute         = "route"
	objectNextHop       = "nexthop"
	objectRule          = "rule"
	objectIPTablesRule  = "iptables_rule"
	objectIPTablesChain = "iptables_chain"
	objectIPSet         = "ipset"
	objectIPSetMember   = "ipset_member"
)

// Metrics are the router's Prometheus metrics. A nil *Metrics records
// nothing, so that tests and callers without a registry need none.
type Metrics struct {
	reg prometheus.Registerer

	servedVIPs      prometheus.Gauge
	refusedClaims   *prometheus.GaugeVec
	reconcileTime   *prometheus.HistogramVec
	reconcileErrors *prometheus.CounterVec
	kernelOps       *prometheus.CounterVec
	counterErrors   prometheus.Counter

	mu sync.Mutex
	// shares are, per programmed tunnel IP, its endpoints and their
	// buckets, written at scrape time (see WriteText): with 10,000 tunnel
	// IPs of 10 endpoints, 120,000 series that a GaugeVec would keep as
	// objects (tens of MB) are kept as about 200 bytes per tunnel IP.
	shares map[netip.Addr]tunnelShares
	// traffic reads the tunnel IPs' packet and byte counters at each
	// scrape (see CollectVIPTraffic); nil: not exported.
	traffic    vipCounterReader
	trafficLog logrus.FieldLogger
}

// tunnelShares are a tunnel IP's endpoint metrics.
type tunnelShares struct {
	ready, draining int
	endpoints       []endpointShare
}

// endpointShare is an endpoint and the buckets of its tunnel IP's table
// that send new flows to it.
type endpointShare struct {
	addr    netip.Addr
	buckets int
}

// NewMetrics registers the router's metrics on reg (nil: not exported).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		reg: reg,
		servedVIPs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_router_served_tunnel_ips",
			Help: "Tunnel IPs this router programs: claimed by at least one Service whose claim it admits.",
		}),
		refusedClaims: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_router_refused_claims",
			Help: "Claims this router does not serve, by reason: invalid (a Service's annotation is not one IPv4 and/or one IPv6 address), refused (a tunnel IP refused by the address pools, node or service networks), conflict (an older Service serves the tunnel IP). A dual-stack Service makes one claim per tunnel IP.",
		}, []string{"reason"}),
		reconcileTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kube_service_tunnel_router_reconcile_duration_seconds",
			Help:    "Time taken by one reconcile, by kind: service (one Service's tunnel IPs), resync (every tunnel IP), networks (Nodes' addresses and pod ranges).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10), // 0.5 ms .. 131 s
		}, []string{"kind"}),
		reconcileErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_router_reconcile_errors_total",
			Help: "Reconciles that failed and were queued again, by kind (service, resync, networks).",
		}, []string{"kind"}),
		kernelOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_router_kernel_operations_total",
			Help: "Kernel writes that succeeded, by object and operation: route replace/delete, nexthop add/replace/delete (nexthop objects), rule add/delete, iptables_rule insert/delete/restore (rules written by iptables-restore), iptables_chain create/flush/delete/restore, ipset create/destroy, ipset_member add/delete.",
		}, []string{"object", "operation"}),
		counterErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kube_service_tunnel_router_vip_counter_read_errors_total",
			Help: "Scrapes at which the tunnel IPs' packet and byte counters could not be read from the router's ipset.",
		}),
		shares: map[netip.Addr]tunnelShares{},
	}
	if reg != nil {
		reg.MustRegister(m.servedVIPs, m.refusedClaims, m.reconcileTime, m.reconcileErrors, m.kernelOps)
	}
	// Every reason and kind is exported from the start, at 0.
	for _, r := range []string{RefusedInvalid, RefusedPolicy, RefusedConflict} {
		m.refusedClaims.WithLabelValues(r)
	}
	for _, k := range []string{ReconcileService, ReconcileResync, ReconcileNetworks} {
		m.reconcileErrors.WithLabelValues(k)
	}
	return m
}

// reconciled records one reconcile of kind that took d and ended with err.
func (m *Metrics) Reconciled(kind string, d time.Duration, err error) {
	if m == nil {
		return
	}
	m.reconcileTime.WithLabelValues(kind).Observe(d.Seconds())
	if err != nil {
		m.reconcileErrors.WithLabelValues(kind).Inc()
	}
}

// setClaims records how many tunnel IPs are served and how many Services'
// claims are refused, by reason.
func (m *Metrics) SetClaims(served int, refused map[string]int) {
	if m == nil {
		return
	}
	m.servedVIPs.Set(float64(served))
	for _, r := range []string{RefusedInvalid, RefusedPolicy, RefusedConflict} {
		m.refusedClaims.WithLabelValues(r).Set(float64(refused[r]))
	}
}

// SetTunnel records the endpoints and bucket shares of a programmed tunnel
// IP (the endpoints it no longer has are no longer exported).
func (m *Metrics) SetTunnel(t datapath.Tunnel) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.setTunnelLocked(t)
}

func (m *Metrics) setTunnelLocked(t datapath.Tunnel) {
	var s tunnelShares
	index := map[netip.Addr]int{}
	share := func(ep netip.Addr) *endpointShare {
		i, ok := index[ep]
		if !ok {
			i = len(s.endpoints)
			index[ep] = i
			s.endpoints = append(s.endpoints, endpointShare{addr: ep})
		}
		return &s.endpoints[i]
	}
	for _, ep := range t.Present {
		share(ep.Addr) // exported even without a bucket
		if ep.Draining {
			s.draining++
		} else {
			s.ready++
		}
	}
	for _, ep := range t.Table {
		share(ep.Addr).buckets++
	}
	s.endpoints = slices.Clip(s.endpoints)
	m.shares[t.VIP] = s
}

// RemoveTunnel stops exporting the metrics of a tunnel IP no longer served.
func (m *Metrics) RemoveTunnel(vip netip.Addr) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.shares, vip)
}

// SetTunnels replaces the endpoint metrics with those of tunnels, the whole
// programmed state.
func (m *Metrics) SetTunnels(tunnels []datapath.Tunnel) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.shares = make(map[netip.Addr]tunnelShares, len(tunnels))
	for _, t := range tunnels {
		m.setTunnelLocked(t)
	}
}

// wrote counts n kernel writes of object with operation.
func (m *Metrics) wrote(object, operation string, n int) {
	if m == nil || n <= 0 {
		return
	}
	m.kernelOps.WithLabelValues(object, operation).Add(float64(n))
}

// countedRoutes counts the route and nexthop object writes that the kernel
// accepted.
type countedRoutes struct {
	datapath.RouteOps
	m *Metrics
}

// Apply sends ops and counts those that succeeded, by kind: all of them,
// all but the failed ones of an *rtnl.ApplyError, none on another error
// (what was applied is unknown).
func (c countedRoutes) Apply(ops []rtnl.Op) error {
	err := c.RouteOps.Apply(ops)
	var ae *rtnl.ApplyError
	if err != nil && !errors.As(err, &ae) {
		return err
	}
	failed := map[int]bool{}
	if ae != nil {
		for _, f := range ae.Failed {
			failed[f.Index] = true
		}
	}
	byKind := map[kernelOp]int{}
	for i, op := range ops {
		if !failed[i] {
			byKind[opLabel(op.Kind)]++
		}
	}
	for l, n := range byKind {
		c.m.wrote(l.object, l.operation, n)
	}
	return err
}

// kernelOp is the object and operation labels of a kernel write.
type kernelOp struct{ object, operation string }

// opLabel labels a route seam operation: route replace/delete, nexthop
// add/replace/delete.
func opLabel(k rtnl.OpKind) kernelOp {
	switch k {
	case rtnl.Replace:
		return kernelOp{objectRoute, "replace"}
	case rtnl.Delete:
		return kernelOp{objectRoute, "delete"}
	case rtnl.AddNextHop:
		return kernelOp{objectNextHop, "add"}
	case rtnl.ReplaceNextHop:
		return kernelOp{objectNextHop, "replace"}
	case rtnl.DeleteNextHop:
		return kernelOp{objectNextHop, "delete"}
	}
	return kernelOp{objectRoute, k.String()}
}

// countedRules counts the policy-rule writes that succeeded.
type countedRules struct {
	datapath.RuleOps
	m *Metrics
}

func (c countedRules) RuleAdd(r *netlink.Rule) error {
	err := c.RuleOps.RuleAdd(r)
	if err == nil {
		c.m.wrote(objectRule, "add", 1)
	}
	return err
}

func (c countedRules) RuleDel(r *netlink.Rule) error {
	err := c.RuleOps.RuleDel(r)
	if err == nil {
		c.m.wrote(objectRule, "delete", 1)
	}
	return err
}

// countedIPTables counts the iptables writes (hmark.IPTables) that
// succeeded; its restorer is counted by countedRestorer.
type countedIPTables struct {
	hmark.IPTables
	m *Metrics
}

func (c countedIPTables) count(object, op string, err error) error {
	if err == nil {
		c.m.wrote(object, op, 1)
	}
	return err
}

func (c countedIPTables) NewChain(table, chain string) error {
	return c.count(objectIPTablesChain, "create", c.IPTables.NewChain(table, chain))
}

func (c countedIPTables) ClearChain(table, chain string) error {
	return c.count(objectIPTablesChain, "flush", c.IPTables.ClearChain(table, chain))
}

func (c countedIPTables) DeleteChain(table, chain string) error {
	return c.count(objectIPTablesChain, "delete", c.IPTables.DeleteChain(table, chain))
}

func (c countedIPTables) Insert(table, chain string, pos int, rulespec ...string) error {
	return c.count(objectIPTablesRule, "insert", c.IPTables.Insert(table, chain, pos, rulespec...))
}

func (c countedIPTables) Delete(table, chain string, rulespec ...string) error {
	return c.count(objectIPTablesRule, "delete", c.IPTables.Delete(table, chain, rulespec...))
}

// countedRestorer counts the iptables-restore calls that succeeded (one
// chain rewritten each) and the rules they wrote ("-A" lines, with or
// without the "[PACKETS:BYTES]" counters before them); its Save, a read,
// is not counted.
type countedRestorer struct {
	hmark.Restorer
	m *Metrics
}

func (c countedRestorer) Restore(table string, payload []byte) error {
	if err := c.Restorer.Restore(table, payload); err != nil {
		return err
	}
	chains, rules := 0, 0
	for line := range strings.Lines(string(payload)) {
		if strings.HasPrefix(line, "[") {
			if _, rule, ok := strings.Cut(line, "] "); ok {
				line = rule
			}
		}
		switch {
		case strings.HasPrefix(line, ":"):
			chains++
		case strings.HasPrefix(line, "-A "):
			rules++
		}
	}
	c.m.wrote(objectIPTablesChain, "restore", chains)
	c.m.wrote(objectIPTablesRule, "restore", rules)
	return nil
}

// countedIPSets counts the ipset writes (hmark.IPSets) that succeeded.
type countedIPSets struct {
	hmark.IPSets
	m *Metrics
}

func (c countedIPSets) count(object, op string, err error) error {
	if err == nil {
		c.m.wrote(object, op, 1)
	}
	return err
}

func (c countedIPSets) IpsetCreate(setname, typename string, options netlink.IpsetCreateOptions) error {
	return c.count(objectIPSet, "create", c.IPSets.IpsetCreate(setname, typename, options))
}

// countedSizedIPSets is countedIPSets over an IPSets that is also
// hmark.HashSizedSets, which it passes on.
type countedSizedIPSets struct {
	countedIPSets
	sized hmark.HashSizedSets
}

func (c countedSizedIPSets) IpsetCreateHashSize(setname, typename string, options netlink.IpsetCreateOptions, hashSize uint32) error {
	return c.count(objectIPSet, "create", c.sized.IpsetCreateHashSize(setname, typename, options, hashSize))
}

// IpsetSwap is not counted: the set created for it, and destroyed after
// it, are.
func (c countedSizedIPSets) IpsetSwap(setname, othersetname string) error {
	return c.sized.IpsetSwap(setname, othersetname)
}

func (c countedIPSets) IpsetDestroy(setname string) error {
	return c.count(objectIPSet, "destroy", c.IPSets.IpsetDestroy(setname))
}

func (c countedIPSets) IpsetAdd(setname string, entry *netlink.IPSetEntry) error {
	return c.count(objectIPSetMember, "add", c.IPSets.IpsetAdd(setname, entry))
}

func (c countedIPSets) IpsetDel(setname string, entry *netlink.IPSetEntry) error {
	return c.count(objectIPSetMember, "delete", c.IPSets.IpsetDel(setname, entry))
}

// IPSets wraps the ipset seam so that its successful writes are counted.
// It passes hmark.HashSizedSets on when s has it.
func (m *Metrics) IPSets(s hmark.IPSets) hmark.IPSets {
	if sized, ok := s.(hmark.HashSizedSets); ok {
		return countedSizedIPSets{countedIPSets{s, m}, sized}
	}
	return countedIPSets{s, m}
}

// Routes wraps the route seam so that its successful writes are counted.
func (m *Metrics) Routes(r datapath.RouteOps) datapath.RouteOps { return countedRoutes{r, m} }

// Rules wraps the policy-rule seam so that its successful writes are counted.
func (m *Metrics) Rules(r datapath.RuleOps) datapath.RuleOps { return countedRules{r, m} }

// IPTables wraps the iptables seam so that its successful writes are counted.
func (m *Metrics) IPTables(ipt hmark.IPTables) hmark.IPTables { return countedIPTables{ipt, m} }

// Restorer wraps the iptables-restore seam so that the rules and chains it
// writes are counted.
func (m *Metrics) Restorer(r hmark.Restorer) hmark.Restorer { return countedRestorer{r, m} }
