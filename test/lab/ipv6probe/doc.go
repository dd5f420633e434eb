// Package ipv6probe proves, in the lab VM and without the project's
// daemons, the kernel state an IPv6 tunnel IP needs: it builds the lab's
// dual-stack network (topology.UpNetwork), programs a router, a node and a
// pod by hand with ip and ip6tables, and checks that a client's TCP and UDP
// traffic to the IPv6 tunnel IP reaches a pod, in gre mode (a flow-based
// ip6gre device and nexthop objects with `encap ip6`) and in mpls mode
// (`encap mpls ... via inet6`), and what the alternatives and the paths'
// MTUs are. Every command line is logged as "cmd: ..." when it worked and
// "FAILED: ..." when it did not, and every finding as "RESULT ...", so the
// console log of a run is the record of what this kernel does.
//
// TestIPv6Probe runs on the host: it boots the VM (lab.RunGuestKernelTests),
// which runs TestInVM.
package ipv6probe
