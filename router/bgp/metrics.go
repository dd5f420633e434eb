package bgp

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the speaker's Prometheus metrics.
type Metrics struct {
	sessionUp   *prometheus.GaugeVec
	transitions *prometheus.CounterVec
	announced   prometheus.Gauge
	updates     *prometheus.CounterVec
	errors      prometheus.Counter
	prefixLimit *prometheus.CounterVec
}

// NewMetrics registers the speaker's metrics on reg (nil: not exported).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		sessionUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_bgp_session_up",
			Help: "1 when the BGP session with the peer is established, 0 otherwise.",
		}, []string{"peer"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_bgp_session_transitions_total",
			Help: "BGP session state changes with the peer, by new state (idle, connect, active, opensent, openconfirm, established).",
		}, []string{"peer", "state"}),
		announced: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kube_service_tunnel_bgp_announced_prefixes",
			Help: "Tunnel IPs this router currently announces (one /32 or /128 each).",
		}),
		updates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_bgp_prefix_updates_total",
			Help: "Tunnel IP announcements and withdrawals handed to the BGP speaker, by operation (announce, withdraw).",
		}, []string{"operation"}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kube_service_tunnel_bgp_errors_total",
			Help: "Failed BGP speaker operations (start, add or remove a peer or a path); each is retried.",
		}),
		prefixLimit: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kube_service_tunnel_bgp_prefix_limit_closes_total",
			Help: "BGP sessions closed because the peer sent more routes of a family than its maxPrefixes; the session stays down until the peer's configuration changes or the router restarts.",
		}, []string{"peer"}),
	}
	if reg != nil {
		reg.MustRegister(m.sessionUp, m.transitions, m.announced, m.updates, m.errors, m.prefixLimit)
	}
	return m
}
