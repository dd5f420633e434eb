// Package endpoint is the endpoint agent: on every node it enters the network
// namespace of each local endpoint pod of a tunnel Service and adds the tunnel
// IP there with a decapsulation path, so the pod receives the original packet
// with the client's source address and replies to the client directly.
//
//   - gre mode: a GRE device in the pod (local = pod IP, any remote, no key)
//     holding each tunnel IP as a /32, with loose rp_filter on it.
//   - mpls mode: in the pod, MPLS input on the pod's interface, a route that
//     pops label 100 and delivers locally, and the tunnel IP on lo (labelled
//     lo:kst); on the node, a route swapping the pod's label to 100 towards the
//     pod IP.
//
// The agent computes the desired state of every local pod as plain data
// (Desired), compares it with what each pod's namespace holds and applies only
// the difference (PodNetwork.Sync); a restarted agent therefore adopts what it
// finds without a single write.
package endpoint

import (
	"errors"
	"fmt"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/mplslabel"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

// Names and numbers that mark what the agent owns.
const (
	// DefaultDevice is the name of the GRE decapsulation device in a pod. It
	// must not be gre0, which every namespace's fallback device takes.
	DefaultDevice = "kst-decap"
	// DeviceAlias (IFLA_IFALIAS) marks the devices the agent created.
	DeviceAlias = "kube-service-tunnel"
	// LoopbackLabel is the IPv4 address label of the tunnel IPs the agent adds
	// to lo in mpls mode; lo addresses without it are never touched.
	LoopbackLabel = "lo:kst"
	// PodLabel is the label a node swaps to and a pod pops.
	PodLabel = mplslabel.PodLabel
	// podPlatformLabels is the net.mpls.platform_labels a pod needs to accept
	// PodLabel.
	podPlatformLabels = PodLabel + 1
	// DefaultResyncPeriod is how often every local pod's namespace is checked.
	DefaultResyncPeriod = time.Minute
)

// Config is what the endpoint agent needs to know to program pods.
type Config struct {
	Mode encap.Mode
	// NodeName is this node; only endpoints whose nodeName is it are handled.
	NodeName string
	// Device is the GRE device's name inside pods (gre mode).
	Device string
	// RouteProtocol marks the agent's MPLS routes.
	RouteProtocol uint8
	// PodAdvMSS, when not 0, is set as advmss on each served pod's IPv4
	// default route, so that clients send segments that fit the tunnel
	// without relying on path-MTU discovery.
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
	if c.Device == "" || len(c.Device) > 15 || c.Device == "gre0" || c.Device == "lo" {
		errs = append(errs, fmt.Errorf("--device %q: must be 1-15 characters and not gre0 or lo", c.Device))
	}
	if c.PodAdvMSS != 0 && (c.PodAdvMSS < 536 || c.PodAdvMSS > 65495) {
		errs = append(errs, fmt.Errorf("--pod-advmss %d: must be 0 (off) or between 536 and 65495", c.PodAdvMSS))
	}
	if c.Workers < 1 {
		errs = append(errs, fmt.Errorf("--workers %d: must be at least 1", c.Workers))
	}
	return errors.Join(errs...)
}
