package endpoint

import (
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cmdnu/kube-service-tunnel/endpoint/guard"
	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/bridgeguard"
	"github.com/cmdnu/kube-service-tunnel/internal/replyexempt"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Sync kinds: what one pass of the controller converged (the kind label of
// the sync metrics).
const (
	syncKindPod     = "pod"     // one pod's namespace
	syncKindNode    = "node"    // the node's own namespace
	syncKindDesired = "desired" // the desired state of every local pod
	syncKindResync  = "resync"  // the periodic check of every pod and the node
)

// DecapCounters are the receive counters of a pod's decapsulation device:
// every packet it decapsulated, whichever of the pod's tunnel IPs of the
// device's family it was sent to.
type DecapCounters struct {
	Packets, Bytes uint64
}

// DecapCounterReader reads the counters of the IPv6 (ipv6) or IPv4
// decapsulation device in a pod's namespace (*PodNetwork).
type DecapCounterReader interface {
	DecapCounters(ns netns.NsHandle, ipv6 bool) (DecapCounters, error)
}

// RuleCounterReader reads, in a pod's namespace, the counters of what the
// agent's rules dropped, from the IPv6 (ipv6) or the IPv4 tables
// (*PodNetwork).
type RuleCounterReader interface {
	RuleDrops(ns netns.NsHandle, ipv6 bool) (RuleDrops, error)
}

// RuleDrops are the counters of what the agent's rules in one family's
// tables of a pod dropped: each tunnel IP's network policy, and the carrier
// guard by reason (guard.Reasons).
type RuleDrops struct {
	Policy map[netip.Addr]netpol.Counter
	Guard  map[string]guard.Counter
}

// Metrics are the endpoint agent's Prometheus metrics. A nil *Metrics
// records nothing, so the controller runs without them.
type Metrics struct {
	tunnelIPs    prometheus.Gauge
	refused      prometheus.Gauge
	isolated     prometheus.Gauge
	endpoints    *prometheus.GaugeVec
	syncDuration *prometheus.HistogramVec
	syncErrors   *prometheus.CounterVec
	kernelOps    *prometheus.CounterVec
	gatesOpened  prometheus.Counter
	decap        *decapCollector

	mu sync.Mutex
	// vips are the tunnel IPs the endpoints gauge has a series for, so that
	// the series of a tunnel IP no longer served is deleted.
	vips map[netip.Addr]bool
}

// NewMetrics registers the agent's metrics on reg (nil: not exported). The
// decapsulation devices' counters are read through decap at each scrape;
// nil leaves them out (mpls mode has no such device). So are the carrier
// guard's drop counters and, with policy (network policy is on), the
// network policy's, through drops (nil: none of them).
func NewMetrics(reg prometheus.Registerer, decap DecapCounterReader, drops RuleCounterReader, policy bool) *Metrics {
	m := &Metrics{
		tunnelIPs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_endpoint_tunnel_ips",
			Help: "Tunnel IPs served by at least one local pod of this node (desired state).",
		}),
		refused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_endpoint_refused_tunnel_ips",
			Help: "Tunnel IPs of annotated Services that the address pools or the cluster's networks refuse: not served in any pod.",
		}),
		isolated: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_endpoint_isolated_pods",
			Help: "Served pods of this node whose tunneled traffic a NetworkPolicy restricts (desired state).",
		}),
		endpoints: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_endpoint_local_endpoints",
			Help: "Local pods of this node that hold the tunnel IP (desired state).",
		}, []string{"vip"}),
		syncDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kube_service_tunnel_endpoint_sync_duration_seconds",
			Help:    "Time taken by one sync of the controller, by kind: pod (one pod's namespace), node (the node's namespace), desired (recomputing the desired state), resync (the periodic check).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 8),
		}, []string{"kind"}),
		syncErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_endpoint_sync_errors_total",
			Help: "Failed syncs, by kind (pod, node, desired, resync); each is retried with back-off.",
		}, []string{"kind"}),
		kernelOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_endpoint_kernel_operations_total",
			Help: "Kernel changes the agent made, by network namespace (pod, node), object (decap_device, tunnel_ip, sysctl, mpls_route, default_route, bridge_guard, reply_exemption) and operation.",
		}, []string{"netns", "object", "operation"}),
		gatesOpened: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kube_service_tunnel_endpoint_readiness_gates_opened_total",
			Help: "Readiness gates (the pod condition cmd.nu/tunnel-ready) this agent set to True, once a pod listing the gate had its tunnel IPs in place.",
		}),
		vips: map[netip.Addr]bool{},
	}
	m.decap = newDecapCollector(decap, drops)
	m.decap.policyOn = policy
	for _, kind := range []string{syncKindPod, syncKindNode, syncKindDesired, syncKindResync} {
		m.syncErrors.WithLabelValues(kind)
	}
	if reg != nil {
		reg.MustRegister(m.tunnelIPs, m.refused, m.isolated, m.endpoints, m.syncDuration, m.syncErrors, m.kernelOps, m.gatesOpened, m.decap.errors)
		if decap != nil || drops != nil {
			reg.MustRegister(m.decap)
		}
	}
	return m
}

// observeSync records one sync of kind that took d and ended with err.
func (m *Metrics) observeSync(kind string, d time.Duration, err error) {
	if m == nil {
		return
	}
	m.syncDuration.WithLabelValues(kind).Observe(d.Seconds())
	if err != nil {
		m.syncErrors.WithLabelValues(kind).Inc()
	}
}

// gateOpened counts a readiness gate set to True.
func (m *Metrics) gateOpened() {
	if m == nil {
		return
	}
	m.gatesOpened.Inc()
}

// podChanges counts the changes made in a pod's namespace.
func (m *Metrics) podChanges(acts []PodChange) {
	if m == nil {
		return
	}
	for _, a := range acts {
		object, op := a.Operation()
		m.kernelOps.WithLabelValues("pod", object, op).Inc()
	}
}

// nodeChanges counts the changes made in the node's namespace.
func (m *Metrics) nodeChanges(acts []NodeChange) {
	if m == nil {
		return
	}
	for _, a := range acts {
		object, op := a.Operation()
		m.kernelOps.WithLabelValues("node", object, op).Inc()
	}
}

// desiredState sets the gauges from a newly computed desired state and stops
// reading the counters of pods no longer in it.
func (m *Metrics) desiredState(desired map[string]PodTunnels, refused []tunnelclaim.Claim) {
	if m == nil {
		return
	}
	counts := map[netip.Addr]int{}
	isolated := 0
	for _, pt := range desired {
		if pt.Isolated() {
			isolated++
		}
		for _, vip := range pt.TunnelIPs {
			counts[vip]++
		}
	}
	refusedVIPs := map[netip.Addr]bool{}
	for _, r := range refused {
		refusedVIPs[r.VIP] = true
	}
	m.mu.Lock()
	m.tunnelIPs.Set(float64(len(counts)))
	m.refused.Set(float64(len(refusedVIPs)))
	m.isolated.Set(float64(isolated))
	for vip := range m.vips {
		if counts[vip] == 0 {
			m.endpoints.DeleteLabelValues(vip.String())
			delete(m.vips, vip)
		}
	}
	for vip, n := range counts {
		m.endpoints.WithLabelValues(vip.String()).Set(float64(n))
		m.vips[vip] = true
	}
	m.mu.Unlock()
	m.decap.retain(func(pod string) bool { return len(desired[pod].TunnelIPs) > 0 })
}

// keepNamespace hands the namespace of a pod just converged to want to the
// counters' collector, which owns it from then on (and closes the one it
// had for the pod), when it has counters to read there: the decapsulation
// device's (gre mode), or the drops of its carrier guard and policy. It
// reports whether it took it; when not, the caller closes it, and the
// collector stops reading the pod.
func (m *Metrics) keepNamespace(pod string, want PodTunnels, ns netns.NsHandle) bool {
	if m == nil {
		return false
	}
	guarded := m.decap.drops != nil && (want.Guard != nil || want.Guard6 != nil)
	if len(want.TunnelIPs) == 0 || m.decap.reader == nil && !guarded {
		m.forgetPod(pod)
		return false
	}
	m.decap.keep(pod, want, m.decap.drops != nil && m.decap.policyOn, ns)
	return true
}

// forgetPod stops reading the counters of a pod that serves nothing anymore.
func (m *Metrics) forgetPod(pod string) {
	if m == nil {
		return
	}
	m.decap.retain(func(p string) bool { return p != pod })
}

// release closes every namespace the collector holds.
func (m *Metrics) release() {
	if m == nil {
		return
	}
	m.decap.retain(func(string) bool { return false })
}

// decapCollector exports the receive counters of every served pod's
// decapsulation device, and what its network policy dropped, read from the
// kernel at each scrape.
type decapCollector struct {
	reader                 DecapCounterReader
	drops                  RuleCounterReader
	policyOn               bool
	packets, bytes         *prometheus.Desc
	dropPackets, dropBytes *prometheus.Desc
	guardPackets           *prometheus.Desc
	errors                 prometheus.Counter

	// mu guards pods only: a scrape reads through duplicates of the
	// namespaces' handles taken under it, so that the agent's sync path
	// (keep, retain) never waits for a scrape's iptables-save in every
	// isolated pod.
	mu   sync.Mutex
	pods map[string]decapPod

	// gathering is held by the one scrape that reads the kernel: however
	// many scrape at once, one reading runs, and the scrapes that waited
	// for it take the next one's result together (a reading that began
	// after they were asked for).
	gathering sync.Mutex
	started   time.Time // when the last reading began
	last      []prometheus.Metric
	// dup duplicates a namespace handle for one reading.
	dup func(netns.NsHandle) (netns.NsHandle, error)
}

// dupNamespace duplicates ns for a reading that must not depend on the
// handle staying open; a handle that is not open is returned as it is (the
// reading then fails on it and counts an error).
func dupNamespace(ns netns.NsHandle) (netns.NsHandle, error) {
	if !ns.IsOpen() {
		return ns, nil
	}
	fd, err := unix.Dup(int(ns))
	return netns.NsHandle(fd), err
}

// decapPod is a served pod's namespace and, for each family it serves,
// what its counters are read for.
type decapPod struct {
	ns       netns.NsHandle
	families []decapFamily
}

// decapFamily is one family's side of a served pod: the tunnel IPs its
// device holds; policy: a NetworkPolicy isolates them (the drops of that
// family's filter table are read).
type decapFamily struct {
	ipv6   bool
	vip    string
	policy bool
	guard  bool
}

func newDecapCollector(reader DecapCounterReader, drops RuleCounterReader) *decapCollector {
	// A pod's device holds all its tunnel IPs of the device's family and
	// the kernel counts per device: vip is the pod's tunnel IP of that
	// family, or all of them comma-separated when it serves several.
	labels := []string{"vip", "pod"}
	return &decapCollector{
		reader: reader,
		drops:  drops,
		dropPackets: prometheus.NewDesc("kube_service_tunnel_endpoint_policy_dropped_packets_total",
			"Tunneled packets to the tunnel IP that the pod's NetworkPolicies do not admit, dropped in the pod (read from the pod's filter table at scrape time).", []string{"vip", "pod"}, nil),
		dropBytes: prometheus.NewDesc("kube_service_tunnel_endpoint_policy_dropped_bytes_total",
			"Bytes of the tunneled packets the pod's NetworkPolicies dropped (read from the pod's filter table at scrape time).", []string{"vip", "pod"}, nil),
		guardPackets: prometheus.NewDesc("kube_service_tunnel_endpoint_guard_dropped_packets_total",
			"Packets the carrier guard dropped in the pod, by reason: carrier-source (GRE to the pod IP from an address that is not a router node's), inner-destination (a decapsulated packet to an address that is not one of the pod's tunnel IPs), bypass (a packet to a tunnel IP that did not come through the decapsulation path); read from the pod's raw table at scrape time.", []string{"pod", "family", "reason"}, nil),
		packets: prometheus.NewDesc("kube_service_tunnel_endpoint_decap_received_packets_total",
			"Packets the pod's decapsulation device received (gre mode; read from the kernel's link statistics at scrape time).", labels, nil),
		bytes: prometheus.NewDesc("kube_service_tunnel_endpoint_decap_received_bytes_total",
			"Bytes of the decapsulated packets the pod's decapsulation device received (gre mode; read from the kernel's link statistics at scrape time).", labels, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kube_service_tunnel_endpoint_decap_counter_errors_total",
			Help: "Failures to read a pod's decapsulation device counters or network policy drop counters during a scrape; the pod's series is left out of that scrape.",
		}),
		pods: map[string]decapPod{},
		dup:  dupNamespace,
	}
}

// keep reads the counters of the pod converged to want in ns from now on
// (drops: network policy is on).
func (d *decapCollector) keep(pod string, want PodTunnels, drops bool, ns netns.NsHandle) {
	p := decapPod{ns: ns}
	for _, ipv6 := range []bool{false, true} {
		vips := want.TunnelIPsOf(ipv6)
		if len(vips) == 0 {
			continue
		}
		ips := make([]string, len(vips))
		for i, ip := range vips {
			ips[i] = ip.String()
		}
		rules := want.PolicyOf(ipv6)
		p.families = append(p.families, decapFamily{ipv6: ipv6, vip: strings.Join(ips, ","), policy: drops && rules != nil && rules.Isolated, guard: want.GuardOf(ipv6) != nil})
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if old, ok := d.pods[pod]; ok && old.ns != ns {
		old.ns.Close()
	}
	d.pods[pod] = p
}

// retain keeps the pods for which keep is true and closes the others'
// namespaces.
func (d *decapCollector) retain(keep func(pod string) bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for pod, p := range d.pods {
		if !keep(pod) {
			p.ns.Close()
			delete(d.pods, pod)
		}
	}
}

// Describe implements prometheus.Collector.
func (d *decapCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- d.packets
	ch <- d.bytes
	ch <- d.dropPackets
	ch <- d.dropBytes
	ch <- d.guardPackets
}

// Collect implements prometheus.Collector: a pod whose counters cannot be
// read is counted in the errors counter and left out; the scrape goes on.
func (d *decapCollector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range d.gather() {
		ch <- m
	}
}

// gather reads every served pod's counters, or returns what a reading that
// began after this scrape was asked for found.
func (d *decapCollector) gather() []prometheus.Metric {
	requested := time.Now()
	d.gathering.Lock()
	defer d.gathering.Unlock()
	if d.last != nil && !d.started.Before(requested) {
		return d.last
	}
	d.started = time.Now()
	type podNS struct {
		name     string
		ns       netns.NsHandle
		families []decapFamily
	}
	d.mu.Lock()
	var pods []podNS
	for name, p := range d.pods {
		ns, err := d.dup(p.ns)
		if err != nil {
			d.errors.Inc()
			continue
		}
		pods = append(pods, podNS{name, ns, p.families})
	}
	d.mu.Unlock()
	slices.SortFunc(pods, func(a, b podNS) int { return strings.Compare(a.name, b.name) })
	out := []prometheus.Metric{}
	for _, p := range pods {
		for _, f := range p.families {
			out = d.appendFamily(out, p.name, p.ns, f)
		}
		p.ns.Close()
	}
	d.last = out
	return out
}

// appendFamily appends one family's counters of a pod to out.
func (d *decapCollector) appendFamily(out []prometheus.Metric, pod string, ns netns.NsHandle, f decapFamily) []prometheus.Metric {
	if d.reader != nil {
		c, err := d.reader.DecapCounters(ns, f.ipv6)
		if err != nil {
			d.errors.Inc()
		} else {
			out = append(out, prometheus.MustNewConstMetric(d.packets, prometheus.CounterValue, float64(c.Packets), f.vip, pod),
				prometheus.MustNewConstMetric(d.bytes, prometheus.CounterValue, float64(c.Bytes), f.vip, pod))
		}
	}
	policy := f.policy && d.policyOn
	if d.drops == nil || !policy && !f.guard {
		return out
	}
	dropped, err := d.drops.RuleDrops(ns, f.ipv6)
	if err != nil {
		d.errors.Inc()
		return out
	}
	if f.guard {
		family := "IPv4"
		if f.ipv6 {
			family = "IPv6"
		}
		for _, reason := range guard.Reasons {
			out = append(out, prometheus.MustNewConstMetric(d.guardPackets, prometheus.CounterValue, float64(dropped.Guard[reason].Packets), pod, family, reason))
		}
	}
	if policy {
		vips := slices.SortedFunc(maps.Keys(dropped.Policy), netip.Addr.Compare)
		for _, vip := range vips {
			c := dropped.Policy[vip]
			out = append(out, prometheus.MustNewConstMetric(d.dropPackets, prometheus.CounterValue, float64(c.Packets), vip.String(), pod),
				prometheus.MustNewConstMetric(d.dropBytes, prometheus.CounterValue, float64(c.Bytes), vip.String(), pod))
		}
	}
	return out
}

// tableCounterCollector reads one counter of a node table of the agent's
// (the bridge guard, the reply exemption) at each scrape; read reports
// whether the table is there as the agent writes it.
type tableCounterCollector struct {
	desc *prometheus.Desc
	what string
	read func() (value uint64, current bool, err error)
	log  logrus.FieldLogger
}

func (c *tableCounterCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *tableCounterCollector) Collect(ch chan<- prometheus.Metric) {
	v, current, err := c.read()
	if err != nil {
		c.log.WithError(err).Warn("reading " + c.what)
		return
	}
	if current {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(v))
	}
}

// NewReplyExemptionCollector returns the collector of the reply exemption
// in the node namespace ns (package replyexempt).
func NewReplyExemptionCollector(ns netns.NsHandle, log logrus.FieldLogger) prometheus.Collector {
	return &tableCounterCollector{log: log, what: "the reply exemption's counters",
		desc: prometheus.NewDesc("kube_service_tunnel_endpoint_untracked_reply_packets_total",
			"Packets from the served tunnel IPs, arriving on the node's interfaces towards the served pods, that the node's inet table kube-service-tunnel exempted from connection tracking (--untrack-replies); absent while the table is not there.", nil, nil),
		read: func() (uint64, bool, error) {
			st, err := replyexempt.Read(ns)
			return st.Exempted, st.Current, err
		}}
}

// NewBridgeGuardCollector returns the collector of the bridge guard's drop
// counter (mpls mode) in the node namespace ns (package bridgeguard).
func NewBridgeGuardCollector(ns netns.NsHandle, log logrus.FieldLogger) prometheus.Collector {
	return &tableCounterCollector{log: log, what: "the bridge guard's counter",
		desc: prometheus.NewDesc("kube_service_tunnel_endpoint_bridge_guard_dropped_packets_total",
			"MPLS frames with the pods' label that one pod sent another across a bridge of the node (mpls mode), dropped by the node's bridge table kube-service-tunnel; absent while the table is not there.", nil, nil),
		read: func() (uint64, bool, error) {
			st, err := bridgeguard.Read(ns, PodLabel)
			return st.Dropped, st.Current, err
		}}
}
