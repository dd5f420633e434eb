// Package rtnl programs IPv4 and IPv6 routes through rtnetlink, fast enough
// for hundreds of thousands of routes.
//
// It owns what the tunnel router needs and vishvananda/netlink does not give
// it:
//
//   - IPEncap, the LWTUNNEL_ENCAP_IP encapsulation ("encap ip ... dst POD"),
//     or LWTUNNEL_ENCAP_IP6 with IPv6 addresses ("encap ip6 ... dst POD6"),
//     usable on its own with netlink.RouteAdd;
//   - a Client bound to one network namespace that lists one family's
//     routes with a single streamed dump, decoding IP, IP6 and MPLS
//     encapsulations;
//   - Client.Apply, which pipelines many acknowledged requests per sendmsg
//     and maps every kernel error back to the route that caused it;
//   - nexthop objects (NextHop, Route.NextHopID) of both families (IPv6
//     routes only take AF_INET6 ones): created without ever replacing
//     another owner's (AddNextHop), replaced, deleted, and listed by
//     protocol (ListNextHops).
//
// A kernel cost to know about: before inserting a route with an inline next
// hop, the kernel compares it with every distinct next hop already in use on
// the same device (its fib_info hash ignores the encapsulation), so adding
// routes with inline encaps to N distinct pods costs O(N) each. On Linux
// 6.18 that is about 4,000 routes/s with 2,000 pods against about 100,000
// with 64. Routes that name a nexthop object (one per pod) skip this.
package rtnl
