// Package metrics holds the tunnel router's Prometheus metrics: claims,
// endpoints and buckets per tunnel IP, reconciles, the kernel writes counted
// at the datapath's seams (Routes, Rules, IPTables, Restorer wrap them), and
// the per tunnel IP packet and byte counters read from iptables at scrape.
package metrics
