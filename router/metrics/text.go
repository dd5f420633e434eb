package metrics

import (
	"bufio"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strconv"

	"github.com/sirupsen/logrus"

	"github.com/cmdnu/kube-service-tunnel/hmark"
)

// The per tunnel IP families are written at scrape time straight in the
// Prometheus text format (see WriteText) instead of through the registry:
// client_golang builds a metric object, then a protobuf message with its
// label pairs, for every series at every scrape. With 10,000 tunnel IPs of
// 10 endpoints (140,000 series) that was about 100 MB of garbage per
// scrape, and the router's RSS doubled at each one. kube-state-metrics
// writes its families the same way, for the same reason.
var (
	familyEndpoints = family{
		name: "kube_service_tunnel_router_tunnel_endpoints", typ: "gauge",
		help: "Endpoints of each programmed tunnel IP, by state: ready (takes new flows) or draining (keeps its established flows).",
	}
	familyEndpointBuckets = family{
		name: "kube_service_tunnel_router_endpoint_buckets", typ: "gauge",
		help: "Buckets of the tunnel IP's table that send new flows to the endpoint (0: it gets no new flow, e.g. draining or more endpoints than buckets).",
	}
	familyVIPPackets = family{
		name: "kube_service_tunnel_router_vip_packets_total", typ: "counter",
		help: "Packets to the tunnel IP that reached this router, every one of them with or without sticky generations (the counter of the tunnel IP's element in the router's ipset of tunnel IPs, read at scrape time).",
	}
	familyVIPBytes = family{
		name: "kube_service_tunnel_router_vip_bytes_total", typ: "counter",
		help: "Bytes (IP header included) of the packets counted by kube_service_tunnel_router_vip_packets_total.",
	}
	familyPortDrops = family{
		name: "kube_service_tunnel_router_port_dropped_packets_total", typ: "counter",
		help: "Packets to the tunnel IP that this router dropped before encapsulation because their protocol and destination port are not among its Service's spec.ports (only tunnel IPs whose ports are filtered; read at scrape time from the router's ipset of filtered tunnel IPs).",
	}
)

// family is a metric family's name, type and help text.
type family struct{ name, typ, help string }

// vipCounterReader reads the packet and byte counters of every tunnel IP
// (*hmark.Chain).
type vipCounterReader interface {
	Counters() (map[netip.Addr]hmark.Counter, error)
	// PortDrops reads what the port filter dropped, per filtered tunnel
	// IP.
	PortDrops() (map[netip.Addr]hmark.Counter, error)
}

// CounterReaders reads the counters of several chains (one per address
// family) as one: their tunnel IPs never overlap.
type CounterReaders[T vipCounterReader] []T

// Counters implements vipCounterReader: every chain's counters, or the
// first error.
func (rs CounterReaders[T]) Counters() (map[netip.Addr]hmark.Counter, error) {
	all := map[netip.Addr]hmark.Counter{}
	for _, r := range rs {
		counters, err := r.Counters()
		if err != nil {
			return nil, err
		}
		maps.Copy(all, counters)
	}
	return all, nil
}

// PortDrops implements vipCounterReader: every chain's port drops, or the
// first error.
func (rs CounterReaders[T]) PortDrops() (map[netip.Addr]hmark.Counter, error) {
	all := map[netip.Addr]hmark.Counter{}
	for _, r := range rs {
		drops, err := r.PortDrops()
		if err != nil {
			return nil, err
		}
		maps.Copy(all, drops)
	}
	return all, nil
}

// CollectVIPTraffic exports the per tunnel IP packet and byte counters,
// read from chain at each scrape (one netlink dump of the router's set of
// tunnel IPs, see hmark.Chain.Counters): every packet to the tunnel IP that
// reached this router, in either mode. They survive rewrites of the chains
// and generation moves; they restart from 0 when the tunnel IP is
// programmed anew or the router's sets are removed. Read errors are
// counted (kube_service_tunnel_router_vip_counter_read_errors_total) and
// logged at debug level; the scrape goes on without these counters.
func (m *Metrics) CollectVIPTraffic(chain vipCounterReader, log logrus.FieldLogger) {
	if m == nil || m.reg == nil {
		return
	}
	m.reg.MustRegister(m.counterErrors)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.traffic, m.trafficLog = chain, log
}

// sharesOf is one tunnel IP's endpoint metrics, as WriteText copies them.
type sharesOf struct {
	vip netip.Addr
	tunnelShares
}

// WriteText writes the per tunnel IP families to w in the Prometheus text
// exposition format (version 0.0.4), ordered by tunnel IP: the endpoints
// and bucket shares of every programmed tunnel IP and, once
// CollectVIPTraffic was called, the packet and byte counters read now. It
// allocates per scrape a copy of the tunnel IP list, not per series; the
// controller is held up only while that list is copied. The daemon serves
// it before the registry's families (see daemon.Serve), so that a counter
// read error shows in the same scrape. A nil *Metrics writes nothing.
func (m *Metrics) WriteText(w io.Writer) error {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	shares := make([]sharesOf, 0, len(m.shares))
	for vip, s := range m.shares {
		shares = append(shares, sharesOf{vip, s}) // the endpoints slice is replaced, never written in place
	}
	traffic, log := m.traffic, m.trafficLog
	m.mu.Unlock()
	slices.SortFunc(shares, func(a, b sharesOf) int { return a.vip.Compare(b.vip) })

	t := newTextWriter(w)
	t.header(familyEndpoints)
	for _, s := range shares {
		t.sample(familyEndpoints.name, "vip", s.vip, "state", "ready", netip.Addr{}, uint64(s.ready))
		t.sample(familyEndpoints.name, "vip", s.vip, "state", "draining", netip.Addr{}, uint64(s.draining))
	}
	t.header(familyEndpointBuckets)
	for _, s := range shares {
		for _, ep := range s.endpoints {
			t.sample(familyEndpointBuckets.name, "vip", s.vip, "endpoint", "", ep.addr, uint64(ep.buckets))
		}
	}
	if traffic != nil {
		if err := m.writeTraffic(t, traffic); err != nil {
			m.counterErrors.Inc()
			log.WithError(err).Debug("reading the tunnel IPs' packet counters")
		}
	}
	return t.flush()
}

// writeTraffic writes the per tunnel IP counters read from traffic: its
// packets and bytes, and what the port filter dropped. A failed reading
// stops it (one error per scrape).
func (m *Metrics) writeTraffic(t *textWriter, traffic vipCounterReader) error {
	counters, err := traffic.Counters()
	if err != nil {
		return err
	}
	drops, err := traffic.PortDrops()
	if err != nil {
		return err
	}
	vips := make([]netip.Addr, 0, len(counters))
	for vip := range counters {
		vips = append(vips, vip)
	}
	slices.SortFunc(vips, netip.Addr.Compare)
	t.header(familyVIPPackets)
	for _, vip := range vips {
		t.sample(familyVIPPackets.name, "vip", vip, "", "", netip.Addr{}, counters[vip].Packets)
	}
	t.header(familyVIPBytes)
	for _, vip := range vips {
		t.sample(familyVIPBytes.name, "vip", vip, "", "", netip.Addr{}, counters[vip].Bytes)
	}
	vips = vips[:0]
	for vip := range drops {
		vips = append(vips, vip)
	}
	slices.SortFunc(vips, netip.Addr.Compare)
	t.header(familyPortDrops)
	for _, vip := range vips {
		t.sample(familyPortDrops.name, "vip", vip, "", "", netip.Addr{}, drops[vip].Packets)
	}
	return nil
}

// textWriter writes samples through one reused line buffer. The first
// write error sticks; later writes do nothing.
type textWriter struct {
	w    *bufio.Writer
	line []byte
	err  error
}

func newTextWriter(w io.Writer) *textWriter {
	return &textWriter{w: bufio.NewWriterSize(w, 64<<10), line: make([]byte, 0, 256)}
}

// header writes a family's HELP and TYPE lines. The help texts are ours:
// they hold no backslash or newline to escape.
func (t *textWriter) header(f family) {
	b := append(append(t.line[:0], "# HELP "...), f.name...)
	b = append(append(append(b, ' '), f.help...), "\n# TYPE "...)
	b = append(append(append(b, f.name...), ' '), f.typ...)
	t.write(append(b, '\n'))
}

// sample writes one series: name{label1="vip",label2="value2"} value, where
// value2 is text, or the address addr2 when text is empty, and label2 is
// left out when empty. Addresses and our state names need no escaping.
func (t *textWriter) sample(name, label1 string, vip netip.Addr, label2, text string, addr2 netip.Addr, value uint64) {
	b := append(append(append(append(t.line[:0], name...), '{'), label1...), `="`...)
	b = vip.AppendTo(b)
	b = append(b, '"')
	if label2 != "" {
		b = append(append(append(b, ','), label2...), `="`...)
		if text != "" {
			b = append(b, text...)
		} else {
			b = addr2.AppendTo(b)
		}
		b = append(b, '"')
	}
	b = strconv.AppendUint(append(b, "} "...), value, 10)
	t.write(append(b, '\n'))
}

func (t *textWriter) write(b []byte) {
	t.line = b[:0]
	if t.err == nil {
		_, t.err = t.w.Write(b)
	}
}

func (t *textWriter) flush() error {
	if t.err != nil {
		return t.err
	}
	return t.w.Flush()
}
