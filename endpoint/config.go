// Package endpoint is the endpoint agent: on every node it enters the network
// namespace of each local endpoint pod of a tunnel Service and adds the tunnel
// IP there with a decapsulation path, so the pod receives the original packet
// with the client's source address and replies to the client directly.
//
//   - gre mode: a GRE device in the pod (local = pod IP, any remote, no key)
//     holding each tunnel IP as a /32, with loose rp_filter on it; for IPv6
//     tunnel IPs, an ip6gre device (local = the pod's IPv6 address, any
//     remote) named after it with a 6 suffix, holding each as a /128.
//   - mpls mode: in the pod, MPLS input on the pod's interface, a route that
//     pops label 100 and delivers locally (IPv4 or IPv6, by the payload's
//     version), and the tunnel IP on lo (an IPv4 one labelled lo:kst, an IPv6
//     one carrying the address protocol --route-protocol); on the node, a
//     route swapping the label of each pod address to 100 towards it.
//
// A tunnel IP of one family goes to the endpoints of that family only: an
// IPv4 tunnel IP to the Service's IPv4 EndpointSlices, an IPv6 one to its
// IPv6 ones, and each is decapsulated in the pod towards the pod's address
// of that family (status.podIPs).
//
// The agent computes the desired state of every local pod as plain data
// (Desired), compares it with what each pod's namespace holds and applies only
// the difference (PodNetwork.Sync); a restarted agent therefore adopts what it
// finds without a single write.
package endpoint

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// Names and numbers that mark what the agent owns.
const (
	// DefaultDevice is the name of the GRE decapsulation device in a pod. It
	// must not be gre0, which every namespace's fallback device takes.
	DefaultDevice = "kst-decap"
	// IPv6DeviceSuffix makes the name of the ip6gre decapsulation device
	// of IPv6 tunnel IPs from the GRE device's (kst-decap6).
	IPv6DeviceSuffix = "6"
	// DeviceAlias (IFLA_IFALIAS) marks the devices the agent created.
	DeviceAlias = "kube-service-tunnel"
	// LoopbackLabel is the IPv4 address label of the tunnel IPs the agent adds
	// to lo in mpls mode; lo addresses without it are never touched. IPv6
	// addresses have no label: the agent's carry the address protocol
	// (IFA_PROTO) Config.RouteProtocol instead, and lo's IPv6 addresses
	// without it are never touched.
	LoopbackLabel = "lo:kst"
	// PodLabel is the label a node swaps to and a pod pops.
	PodLabel = mplslabel.PodLabel
	// podPlatformLabels is the net.mpls.platform_labels a pod needs to accept
	// PodLabel.
	podPlatformLabels = PodLabel + 1
	// minRouteProtocol is the lowest RouteProtocol: RTPROT_STATIC (4) is
	// what ip route add writes, and 0-3 are the kernel's.
	minRouteProtocol = 5
	// DefaultResyncPeriod is how often every local pod's namespace is checked.
	DefaultResyncPeriod = time.Minute
)

// Config is what the endpoint agent needs to know to program pods.
type Config struct {
	Mode encap.Mode
	// NodeName is this node; only endpoints whose nodeName is it are handled.
	NodeName string
	// Device is the GRE device's name inside pods (gre mode); the ip6gre
	// device of IPv6 tunnel IPs is IPv6Device.
	Device string
	// RouteProtocol marks the agent's MPLS routes (rtm_protocol) and its
	// IPv6 addresses on lo (the address protocol, IFA_PROTO).
	RouteProtocol uint8
	// PodAdvMSS, when not 0, is set as advmss on the IPv4 default route of
	// each pod serving an IPv4 tunnel IP, so that clients send segments
	// that fit the tunnel without relying on path-MTU discovery. A pod
	// serving an IPv6 tunnel IP gets PodAdvMSS6 on its IPv6 default route.
	PodAdvMSS int
	// MPLSInputInterfaces are the node's interfaces on which routers' MPLS
	// packets arrive (mpls mode). Empty means the interface holding the
	// node's address.
	MPLSInputInterfaces []string
	// ResyncPeriod is how often every local pod is checked and repaired.
	ResyncPeriod time.Duration
	// Workers is how many pods are configured in parallel.
	Workers int
	// Policy decides which Services may have their tunnel IP (the address
	// pools); it must be the routers' one.
	Policy tunnelclaim.Policy
	// ProcSys is the sysctl directory (--proc-sys); empty means /proc/sys.
	ProcSys string
	// NetworkPolicy enforces the ingress NetworkPolicies of each served
	// pod on its tunneled traffic, in the pod's filter table.
	NetworkPolicy bool
	// UntrackReplies exempts the served pods' replies from their tunnel
	// IPs from the node's connection tracking (package replyexempt), so
	// that conntrack INVALID drops (kube-proxy's) do not drop them.
	UntrackReplies bool
	// RouterNodes selects the router nodes (their Nodes' labels): each
	// served pod accepts the carrier only from their addresses (every
	// InternalIP and ExternalIP), kept current as they come and go. nil
	// means DefaultRouterNodes.
	RouterNodes labels.Selector
	// CarrierSources are further addresses each served pod accepts the
	// carrier from (--carrier-sources), beside the router nodes'.
	CarrierSources []netip.Addr
}

// DefaultRouterNodes is the label of the router nodes (tunnel-router.yaml's
// node selector).
const DefaultRouterNodes = "node=tunnel"

// routerNodes returns RouterNodes, or the default selector.
func (c Config) routerNodes() labels.Selector {
	if c.RouterNodes == nil {
		sel, _ := labels.Parse(DefaultRouterNodes)
		return sel
	}
	return c.RouterNodes
}

// IPv6Device is the name of the ip6gre decapsulation device of IPv6
// tunnel IPs in pods (gre mode): Device with IPv6DeviceSuffix.
func (c Config) IPv6Device() string { return c.Device + IPv6DeviceSuffix }

// Bytes by which an IPv6 packet's headers exceed an IPv4 one's, for the
// IPv6 counterpart of PodAdvMSS.
const (
	// ipv6HeaderGrowth: the IPv6 header is 40 bytes, the IPv4 one 20.
	ipv6HeaderGrowth = 40 - 20
	// greIPv6OuterGrowth: in gre mode an IPv6 tunnel IP's packets travel
	// in an outer IPv6 header (40 + 4 bytes of GRE), an IPv4 one's in an
	// outer IPv4 header (20 + 4); MPLS adds the same label to both.
	greIPv6OuterGrowth = (40 + 4) - (20 + 4)
)

// PodAdvMSS6 is the advmss set on the IPv6 default route of each pod
// serving an IPv6 tunnel IP (0: none): PodAdvMSS less what IPv6 adds, so
// that an IPv6 segment of that size fits the tunnel as an IPv4 segment of
// PodAdvMSS does. It is 20 bytes less in mpls mode (the inner IPv6
// header) and 40 in gre mode (the inner and the outer one).
func (c Config) PodAdvMSS6() int {
	if c.PodAdvMSS == 0 {
		return 0
	}
	if c.Mode == encap.MPLS {
		return c.PodAdvMSS - ipv6HeaderGrowth
	}
	return c.PodAdvMSS - ipv6HeaderGrowth - greIPv6OuterGrowth
}

// podAdvMSS6Values are the IPv6 advmss values the agent may have set in
// either mode: each is the agent's to replace or remove, so that a
// change of --mode leaves no stale value.
func (c Config) podAdvMSS6Values() []int {
	if c.PodAdvMSS == 0 {
		return nil
	}
	return []int{c.PodAdvMSS - ipv6HeaderGrowth, c.PodAdvMSS - ipv6HeaderGrowth - greIPv6OuterGrowth}
}

// Validate checks the configuration for mistakes an operator can make.
func (c Config) Validate() error {
	var errs []error
	if err := c.Mode.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--%w", err))
	}
	if c.NodeName == "" {
		errs = append(errs, errors.New("--node-name (or env NODE_NAME) is required: the agent handles the endpoints of its own node"))
	}
	// The ip6gre device's name adds a character, and names are 15 at most.
	if c.Device == "" || len(c.Device)+len(IPv6DeviceSuffix) > 15 || c.Device == "gre0" || c.Device == "lo" {
		errs = append(errs, fmt.Errorf("--device %q: must be 1-14 characters (the IPv6 device adds %q) and not gre0 or lo", c.Device, IPv6DeviceSuffix))
	}
	// 0-4 are the kernel's own and iproute2's defaults, for routes and
	// addresses alike (lo's ::1 has address protocol 1): the agent would
	// take theirs for its own.
	if c.RouteProtocol < minRouteProtocol {
		errs = append(errs, fmt.Errorf("--route-protocol %d: must be %d-255 (lower values mark the kernel's and iproute2's routes and addresses)", c.RouteProtocol, minRouteProtocol))
	}
	if c.PodAdvMSS != 0 && (c.PodAdvMSS < 536 || c.PodAdvMSS > 65495) {
		errs = append(errs, fmt.Errorf("--pod-advmss %d: must be 0 (off) or between 536 and 65495", c.PodAdvMSS))
	}
	if c.Workers < 1 {
		errs = append(errs, fmt.Errorf("--workers %d: must be at least 1", c.Workers))
	}
	return errors.Join(errs...)
}
