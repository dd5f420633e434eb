package endpoint

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// podState is what one pod's network namespace holds of the agent's, and what
// the agent must know about it. observePod reads it from the kernel; planPod
// compares it with the desired state.
type podState struct {
	// PodLink is the interface holding the pod IP (never assumed to be eth0).
	PodLink string
	// Device is the agent's GRE device, when it exists.
	Device *deviceState
	// ForeignDevice is set when a device of the agent's name exists that the
	// agent did not create; the agent then refuses to touch the pod.
	ForeignDevice bool
	// DeviceIPs are the addresses on the agent's device (gre mode).
	DeviceIPs []netip.Addr
	// LoopbackIPs are the addresses on lo labelled LoopbackLabel (mpls mode).
	LoopbackIPs []netip.Addr
	// PopRoute reports the agent's MPLS route popping PodLabel to lo.
	PopRoute bool
	// Sysctls holds the values of the sysctls planPod looks at, by name
	// relative to /proc/sys (net/ipv4/conf/lo/rp_filter); "" when missing.
	Sysctls map[string]string
	// DefaultRoute is the pod's IPv4 default route in the main table, when it
	// has one, with its advmss (0 = unset).
	DefaultRoute bool
	AdvMSS       int
	// TablesRead: the pod's filter table was read, into Policy (what it
	// holds of the agent's policy rules) or PolicyErr (why it could not
	// be). Without it planPod plans no policy change (planPolicy does).
	TablesRead bool
	Policy     netpol.Observed
	PolicyErr  error
}

// deviceState describes the agent's GRE device in a pod.
type deviceState struct {
	Local netip.Addr
	Up    bool
	// Unmarked: the device lacks the agent's alias. The kernel ignores an
	// alias given at creation, so it is set just after; an agent that died in
	// between leaves a device of its name, kind and local address without it.
	Unmarked bool
}

// podActionKind names one change to a pod's namespace.
type podActionKind int

const (
	actCreateDevice podActionKind = iota
	actDeleteDevice
	actSetDeviceUp
	actMarkDevice
	actAddTunnelIP
	actDelTunnelIP
	actSetSysctl
	actAddPopRoute
	actDelPopRoute
	actSetAdvMSS
	actSyncPolicy
)

// PodChange is one change to a pod's namespace, as planned and made.
type PodChange struct {
	Kind podActionKind
	Addr netip.Addr // actCreateDevice: local address; actAdd/DelTunnelIP: the tunnel IP
	// Loopback: actAdd/DelTunnelIP act on lo (mpls mode) rather than the device.
	Loopback bool
	Sysctl   string // actSetSysctl: name relative to /proc/sys
	Value    string // actSetSysctl: value
	MSS      int    // actSetAdvMSS: 0 removes it
	// Payload is actSyncPolicy's iptables-restore input; Digest names the
	// policy it writes ("" when it removes the agent's rules).
	Payload []byte
	Digest  string
}

func (a PodChange) String() string {
	switch a.Kind {
	case actCreateDevice:
		return "create device, local " + a.Addr.String()
	case actDeleteDevice:
		return "delete device"
	case actSetDeviceUp:
		return "set device up"
	case actMarkDevice:
		return "set device alias " + DeviceAlias
	case actAddTunnelIP:
		return "add tunnel IP " + a.Addr.String() + a.where()
	case actDelTunnelIP:
		return "remove tunnel IP " + a.Addr.String() + a.where()
	case actSetSysctl:
		return "sysctl " + a.Sysctl + "=" + a.Value
	case actAddPopRoute:
		return "add mpls route " + strconv.Itoa(PodLabel) + " dev lo"
	case actDelPopRoute:
		return "remove mpls route " + strconv.Itoa(PodLabel) + " dev lo"
	case actSetAdvMSS:
		return "default route advmss " + strconv.Itoa(a.MSS)
	case actSyncPolicy:
		if a.Digest == "" {
			return "remove network policy rules"
		}
		return "write network policy rules " + a.Digest
	}
	return fmt.Sprintf("action %d", a.Kind)
}

// Operation names the kernel object a change acts on and what it does to
// it, for the kernel operations metric.
func (a PodChange) Operation() (object, operation string) {
	switch a.Kind {
	case actCreateDevice:
		return "decap_device", "create"
	case actDeleteDevice:
		return "decap_device", "delete"
	case actSetDeviceUp:
		return "decap_device", "set_up"
	case actMarkDevice:
		return "decap_device", "set_alias"
	case actAddTunnelIP:
		return "tunnel_ip", "add"
	case actDelTunnelIP:
		return "tunnel_ip", "delete"
	case actSetSysctl:
		return "sysctl", "set"
	case actAddPopRoute:
		return "mpls_route", "add"
	case actDelPopRoute:
		return "mpls_route", "delete"
	case actSetAdvMSS:
		return "default_route", "set_advmss"
	case actSyncPolicy:
		if a.Digest == "" {
			return "policy_rules", "remove"
		}
		return "policy_rules", "restore"
	}
	return "unknown", strconv.Itoa(int(a.Kind))
}

func (a PodChange) where() string {
	if a.Loopback {
		return " on lo"
	}
	return " on device"
}

// Sysctl names, relative to /proc/sys.
const (
	sysctlIPForward      = "net/ipv4/ip_forward"
	sysctlPlatformLabels = "net/mpls/platform_labels"
)

func rpFilterSysctl(dev string) string  { return "net/ipv4/conf/" + dev + "/rp_filter" }
func mplsInputSysctl(dev string) string { return "net/mpls/conf/" + dev + "/input" }

// podSysctls lists the sysctls planPod reads in a pod.
func podSysctls(cfg Config, podLink string) []string {
	if cfg.Mode == encap.GRE {
		return []string{rpFilterSysctl(cfg.Device)}
	}
	return []string{sysctlPlatformLabels, mplsInputSysctl(podLink), rpFilterSysctl("lo")}
}

// planPod returns the changes that turn have into want, in a safe order:
// when adding, the decapsulation path comes before the tunnel IPs; when
// removing, the tunnel IPs go first. What the other mode would have left
// (after a change of --mode) is removed. It is pure.
//
// Sysctls are only ever raised to what the datapath needs, never lowered or
// restored: rp_filter goes from strict (1) to loose (2) and is left alone when
// already off (0) or loose.
func planPod(cfg Config, want PodTunnels, have podState) ([]PodChange, error) {
	if have.ForeignDevice {
		return nil, fmt.Errorf("a device named %q exists that kube-service-tunnel did not create (its alias is not %q); rename it or choose another --device", cfg.Device, DeviceAlias)
	}
	serve := len(want.TunnelIPs) > 0
	var wantDevice, wantLoopback []netip.Addr
	switch {
	case serve && cfg.Mode == encap.GRE:
		wantDevice = want.TunnelIPs
	case serve && cfg.Mode == encap.MPLS:
		wantLoopback = want.TunnelIPs
	}
	addDev, delDev := diffAddrs(wantDevice, have.DeviceIPs)
	addLo, delLo := diffAddrs(wantLoopback, have.LoopbackIPs)

	var acts []PodChange
	if have.Device != nil && have.Device.Unmarked {
		acts = append(acts, PodChange{Kind: actMarkDevice})
	}
	// Removals first: addresses, then the paths that no longer serve any.
	for _, ip := range delDev {
		acts = append(acts, PodChange{Kind: actDelTunnelIP, Addr: ip})
	}
	for _, ip := range delLo {
		acts = append(acts, PodChange{Kind: actDelTunnelIP, Addr: ip, Loopback: true})
	}
	dev := have.Device
	if dev != nil && (len(wantDevice) == 0 || dev.Local != want.Pod.IP) {
		// Not wanted, or the pod got a new address in the same namespace.
		acts = append(acts, PodChange{Kind: actDeleteDevice})
		dev, addDev = nil, wantDevice // a new device starts without addresses
	}
	if have.PopRoute && len(wantLoopback) == 0 {
		acts = append(acts, PodChange{Kind: actDelPopRoute})
	}
	// The policy rules change after the tunnel IPs that leave and before
	// those that come, so that no tunnel IP is ever served unfiltered.
	if have.TablesRead {
		a, err := planPolicy(want, have)
		if err != nil {
			return nil, err
		}
		if a != nil {
			acts = append(acts, *a)
		}
	}
	if !serve {
		if cfg.PodAdvMSS != 0 && have.DefaultRoute && have.AdvMSS == cfg.PodAdvMSS {
			acts = append(acts, PodChange{Kind: actSetAdvMSS, MSS: 0})
		}
		return acts, nil
	}

	switch cfg.Mode {
	case encap.GRE:
		if dev == nil {
			acts = append(acts, PodChange{Kind: actCreateDevice, Addr: want.Pod.IP}, PodChange{Kind: actMarkDevice})
		}
		if dev == nil || !dev.Up {
			acts = append(acts, PodChange{Kind: actSetDeviceUp})
		}
		// The device's own sysctl exists only once the device does.
		if dev == nil || have.Sysctls[rpFilterSysctl(cfg.Device)] != "2" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: rpFilterSysctl(cfg.Device), Value: "2"})
		}
	case encap.MPLS:
		if have.PodLink == "" {
			return nil, fmt.Errorf("no interface holds the pod IP %v", want.Pod.IP)
		}
		if v, _ := strconv.Atoi(have.Sysctls[sysctlPlatformLabels]); v < podPlatformLabels {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: sysctlPlatformLabels, Value: strconv.Itoa(podPlatformLabels)})
		}
		if have.Sysctls[mplsInputSysctl(have.PodLink)] != "1" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: mplsInputSysctl(have.PodLink), Value: "1"})
		}
		if have.Sysctls[rpFilterSysctl("lo")] == "1" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: rpFilterSysctl("lo"), Value: "2"})
		}
		if !have.PopRoute {
			acts = append(acts, PodChange{Kind: actAddPopRoute})
		}
	}
	// An advmss someone else set is theirs: left alone, and never removed.
	if cfg.PodAdvMSS != 0 && have.DefaultRoute && have.AdvMSS == 0 {
		acts = append(acts, PodChange{Kind: actSetAdvMSS, MSS: cfg.PodAdvMSS})
	}
	for _, ip := range addDev {
		acts = append(acts, PodChange{Kind: actAddTunnelIP, Addr: ip})
	}
	for _, ip := range addLo {
		acts = append(acts, PodChange{Kind: actAddTunnelIP, Addr: ip, Loopback: true})
	}
	return acts, nil
}

// planPolicy returns the change that makes the pod's filter table hold
// want's policy rules (nil: none needed). An isolated pod whose table could
// not be read is an error (it must not get its tunnel IPs unfiltered);
// another one goes without connection tracking.
func planPolicy(want PodTunnels, have podState) (*PodChange, error) {
	if have.PolicyErr != nil {
		if want.Isolated() {
			return nil, fmt.Errorf("reading the pod's filter table for its network policy: %w", have.PolicyErr)
		}
		return nil, nil
	}
	payload := netpol.Update(want.Policy, have.Policy)
	if payload == nil {
		return nil, nil
	}
	a := &PodChange{Kind: actSyncPolicy, Payload: payload}
	if want.Policy != nil {
		a.Digest = want.Policy.Digest
	}
	return a, nil
}

// diffAddrs returns what is in want and not in have, and the reverse.
func diffAddrs(want, have []netip.Addr) (add, del []netip.Addr) {
	for _, ip := range want {
		if !slices.Contains(have, ip) {
			add = append(add, ip)
		}
	}
	for _, ip := range have {
		if !slices.Contains(want, ip) {
			del = append(del, ip)
		}
	}
	return add, del
}
