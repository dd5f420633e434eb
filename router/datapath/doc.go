// Package datapath owns a tunnel router's kernel state: one policy rule and
// one routing table per slot (generation x bucket), one route per tunnel IP
// in each slot table in use, naming the nexthop object of its endpoint (one
// per endpoint: GRE or MPLS encapsulation towards it), the HMARK rules
// (package hmark) and the flow-based GRE device. It plans the
// routing generations that keep established flows on a draining endpoint and
// collects the older ones once conntrack shows no flow uses them.
//
// It computes the desired state as plain data, diffs it against what the
// kernel holds and applies only the difference, through small interfaces at
// the kernel seams (RouteOps, RuleOps, the HMARK chain, TunnelDevice).
package datapath
