// Package datapath owns a tunnel router's kernel state: one policy rule and
// one routing table per slot (generation x bucket), one route per tunnel IP
// in each slot table in use, naming the nexthop object of its endpoint (one
// per endpoint: GRE or MPLS encapsulation towards it), the HMARK rules
// (package hmark) and the flow-based GRE device. It plans the
// routing generations that keep established flows on a draining endpoint and
// collects the older ones once conntrack shows no flow uses them.
//
// A Datapath serves one address family (Config.Family): an IPv4 tunnel IP's
// buckets reach IPv4 endpoints, an IPv6 one's IPv6 endpoints (through the
// flow-based ip6gre device, or labels towards the nodes' IPv6 addresses).
// Families hands a dual-stack router's tunnels to the Datapath of their
// family; each reads and writes only its own family's rules, routes,
// nexthop objects and conntrack entries.
//
// It computes the desired state as plain data, diffs it against what the
// kernel holds and applies only the difference, through small interfaces at
// the kernel seams (RouteOps, RuleOps, the HMARK chain, TunnelDevice).
package datapath
