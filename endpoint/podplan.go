package endpoint

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	"github.com/cmdnu/kube-service-tunnel/endpoint/guard"
	"github.com/cmdnu/kube-service-tunnel/endpoint/netpol"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
)

// podState is what one pod's network namespace holds of the agent's, and what
// the agent must know about it. observe reads it from the kernel; planPod
// compares it with the desired state. The IPv6 fields are read only for a
// pod with an IPv6 address (and by Cleanup).
type podState struct {
	// PodLink is the interface holding the pod's IPv4 address, PodLink6
	// the one holding its IPv6 address (never assumed to be eth0).
	PodLink, PodLink6 string
	// Device is the agent's GRE device and Device6 its ip6gre device, when
	// they exist.
	Device, Device6 *deviceState
	// ForeignDevice (ForeignDevice6) is set when a device of the GRE
	// (ip6gre) device's name exists that the agent did not create; the
	// agent then refuses to touch the pod (to serve IPv6 tunnel IPs).
	ForeignDevice, ForeignDevice6 bool
	// DeviceIPs and Device6IPs are the addresses on the agent's devices
	// (gre mode); the kernel's link-local addresses are left out.
	DeviceIPs, Device6IPs []netip.Addr
	// LoopbackIPs are the IPv4 addresses on lo labelled LoopbackLabel, and
	// LoopbackIPs6 the IPv6 ones with the agent's address protocol (mpls
	// mode). OtherLoopbackIPs6 are lo's other IPv6 addresses: never
	// touched, and never served as the agent's.
	LoopbackIPs, LoopbackIPs6, OtherLoopbackIPs6 []netip.Addr
	// PopRoute reports the agent's MPLS route popping PodLabel to lo.
	PopRoute bool
	// Sysctls holds the values of the sysctls planPod looks at, by name
	// relative to /proc/sys (net/ipv4/conf/lo/rp_filter); "" when missing.
	Sysctls map[string]string
	// DefaultRoute is the pod's IPv4 default route in the main table, when it
	// has one, with its advmss (0 = unset); DefaultRoute6 and AdvMSS6 the
	// same of its IPv6 default route.
	DefaultRoute  bool
	AdvMSS        int
	DefaultRoute6 bool
	AdvMSS6       int
	// TablesRead: the pod's filter table was read, into Policy (what it
	// holds of the agent's policy rules) or PolicyErr (why it could not
	// be). Without it planPod plans no policy change (planPolicy does).
	// Tables6Read, Policy6 and PolicyErr6 are the same of its IPv6 filter
	// table (ip6tables).
	TablesRead  bool
	Policy      netpol.Observed
	PolicyErr   error
	Tables6Read bool
	Policy6     netpol.Observed
	PolicyErr6  error
	// Guard and Guard6 are what the IPv4 and IPv6 raw tables hold of the
	// carrier guard (read with the filter tables).
	Guard, Guard6 guard.Observed
}

// device returns the state of the IPv6 device (ipv6) or of the IPv4 one.
func (s podState) device(ipv6 bool) *deviceState {
	if ipv6 {
		return s.Device6
	}
	return s.Device
}

// deviceState describes one of the agent's decapsulation devices in a pod.
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
	actSyncGuard
)

// PodChange is one change to a pod's namespace, as planned and made.
type PodChange struct {
	Kind podActionKind
	Addr netip.Addr // actCreateDevice: local address; actAdd/DelTunnelIP: the tunnel IP
	// IPv6: the change is to the IPv6 side (actCreate/Delete/Mark,
	// SetDeviceUp: the ip6gre device; actSetAdvMSS: the IPv6 default route;
	// actSyncPolicy: the ip6tables filter table). A tunnel IP's family is
	// its own.
	IPv6 bool
	// Loopback: actAdd/DelTunnelIP act on lo (mpls mode) rather than the device.
	Loopback bool
	Sysctl   string // actSetSysctl: name relative to /proc/sys
	Value    string // actSetSysctl: value
	MSS      int    // actSetAdvMSS: 0 removes it
	// Payload is actSyncPolicy's (actSyncGuard's) iptables-restore input;
	// Digest names the policy (guard) it writes ("" when it removes the
	// agent's rules).
	Payload []byte
	Digest  string
}

func (a PodChange) String() string {
	switch a.Kind {
	case actCreateDevice:
		return "create " + a.device() + ", local " + a.Addr.String()
	case actDeleteDevice:
		return "delete " + a.device()
	case actSetDeviceUp:
		return "set " + a.device() + " up"
	case actMarkDevice:
		return "set " + a.device() + " alias " + DeviceAlias
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
		return a.family() + "default route advmss " + strconv.Itoa(a.MSS)
	case actSyncPolicy:
		if a.Digest == "" {
			return "remove " + a.family() + "network policy rules"
		}
		return "write " + a.family() + "network policy rules " + a.Digest
	case actSyncGuard:
		if a.Digest == "" {
			return "remove " + a.family() + "carrier guard"
		}
		return "write " + a.family() + "carrier guard " + a.Digest
	}
	return fmt.Sprintf("action %d", a.Kind)
}

// family prefixes the IPv6 side's descriptions.
func (a PodChange) family() string {
	if a.IPv6 {
		return "IPv6 "
	}
	return ""
}

// device names the decapsulation device a change acts on.
func (a PodChange) device() string { return a.family() + "device" }

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
	case actSyncGuard:
		if a.Digest == "" {
			return "carrier_guard", "remove"
		}
		return "carrier_guard", "restore"
	}
	return "unknown", strconv.Itoa(int(a.Kind))
}

func (a PodChange) where() string {
	switch {
	case a.Loopback:
		return " on lo"
	case a.Addr.Is6():
		return " on IPv6 device"
	}
	return " on device"
}

// Sysctl names, relative to /proc/sys.
const (
	sysctlIPForward      = "net/ipv4/ip_forward"
	sysctlPlatformLabels = "net/mpls/platform_labels"
	// sysctlIPv6Forwarding is read on the node, never written (see planNode).
	sysctlIPv6Forwarding = "net/ipv6/conf/all/forwarding"
)

func rpFilterSysctl(dev string) string    { return "net/ipv4/conf/" + dev + "/rp_filter" }
func forwardingSysctl(dev string) string  { return "net/ipv4/conf/" + dev + "/forwarding" }
func mplsInputSysctl(dev string) string   { return "net/mpls/conf/" + dev + "/input" }
func disableIPv6Sysctl(dev string) string { return "net/ipv6/conf/" + dev + "/disable_ipv6" }

// podSysctls lists the sysctls planPod reads in a pod; ipv6: the pod has an
// IPv6 address.
func podSysctls(cfg Config, st podState, ipv6 bool) []string {
	if cfg.Mode == encap.GRE {
		// A new device takes the namespace's default.
		names := []string{rpFilterSysctl(cfg.Device), forwardingSysctl(cfg.Device), disableIPv6Sysctl(cfg.Device), disableIPv6Sysctl("default")}
		if ipv6 {
			names = append(names, disableIPv6Sysctl(cfg.IPv6Device()))
		}
		return names
	}
	names := []string{sysctlPlatformLabels}
	for _, l := range podLinks(st.PodLink, st.PodLink6) {
		names = append(names, mplsInputSysctl(l))
	}
	names = append(names, rpFilterSysctl("lo"), forwardingSysctl("lo"))
	if ipv6 {
		names = append(names, disableIPv6Sysctl("lo"))
	}
	return names
}

// podLinks lists the pod interfaces given, without empty names and
// duplicates.
func podLinks(links ...string) []string {
	var out []string
	for _, l := range links {
		if l != "" && !slices.Contains(out, l) {
			out = append(out, l)
		}
	}
	return out
}

// planPod returns the changes that turn have into want, in a safe order:
// when adding, the decapsulation path comes before the tunnel IPs; when
// removing, the tunnel IPs go first. What the other mode would have left
// (after a change of --mode) is removed. Each family is planned on its own:
// a pod serving only IPv6 tunnel IPs holds nothing of the agent's IPv4
// side, and the reverse. It is pure.
//
// Sysctls are only ever raised to what the datapath needs, never lowered or
// restored: rp_filter goes from strict (1) to loose (2) and is left alone when
// already off (0) or loose; disable_ipv6 goes from 1 to 0 on the device or
// lo that must receive IPv6 tunneled packets, and nowhere else.
//
// The one exception is IPv4 forwarding on the interface that receives the
// decapsulated IPv4 packets (the GRE device, or lo in mpls mode): it is
// turned off before that interface can receive any, and is not restored.
// A new network namespace copies the node's IPv4 settings, so on a
// Kubernetes node a pod forwards. A packet decapsulated for a tunnel IP the
// pod does not hold (not yet: the router sends to a new pod as soon as it
// is ready, which can be before the agent added the address; or no longer)
// would then go out to the pod's default gateway, the node, which has no
// route for it and answers the client with ICMP net unreachable: a client
// that is connecting gives up at once. Without forwarding there the pod
// drops the packet, and the client retransmits its SYN.
func planPod(cfg Config, want PodTunnels, have podState) ([]PodChange, error) {
	if have.ForeignDevice {
		return nil, fmt.Errorf("a device named %q exists that kube-service-tunnel did not create (its alias is not %q); rename it or choose another --device", cfg.Device, DeviceAlias)
	}
	v4, v6 := want.TunnelIPsOf(false), want.TunnelIPsOf(true)
	if len(v6) > 0 && !want.Pod.IPv6.IsValid() || len(v4) > 0 && !want.Pod.IP.IsValid() {
		return nil, fmt.Errorf("pod %s has no address of the family of its tunnel IPs %v", want.Pod, want.TunnelIPs)
	}
	var wantDev4, wantDev6, wantLo4, wantLo6 []netip.Addr
	switch cfg.Mode {
	case encap.GRE:
		wantDev4, wantDev6 = v4, v6
		if len(v6) > 0 && have.ForeignDevice6 {
			return nil, fmt.Errorf("a device named %q exists that kube-service-tunnel did not create (its alias is not %q): the pod's IPv6 tunnel IPs need that name; rename it or choose another --device", cfg.IPv6Device(), DeviceAlias)
		}
	case encap.MPLS:
		wantLo4, wantLo6 = v4, v6
		for _, ip := range v6 {
			if slices.Contains(have.OtherLoopbackIPs6, ip) {
				return nil, fmt.Errorf("tunnel IP %v is on lo without kube-service-tunnel's address protocol %d: someone else added it, or this kernel does not keep address protocols (IFA_PROTO, Linux 5.18 or later); it is left alone, and not served", ip, cfg.RouteProtocol)
			}
		}
	}
	addDev4, delDev4 := diffAddrs(wantDev4, have.DeviceIPs)
	addDev6, delDev6 := diffAddrs(wantDev6, have.Device6IPs)
	addLo4, delLo4 := diffAddrs(wantLo4, have.LoopbackIPs)
	addLo6, delLo6 := diffAddrs(wantLo6, have.LoopbackIPs6)

	var acts []PodChange
	for _, ipv6 := range []bool{false, true} {
		if d := have.device(ipv6); d != nil && d.Unmarked {
			acts = append(acts, PodChange{Kind: actMarkDevice, IPv6: ipv6})
		}
	}
	// Removals first: addresses, then the paths that no longer serve any.
	for _, ip := range slices.Concat(delDev4, delDev6) {
		acts = append(acts, PodChange{Kind: actDelTunnelIP, Addr: ip})
	}
	for _, ip := range slices.Concat(delLo4, delLo6) {
		acts = append(acts, PodChange{Kind: actDelTunnelIP, Addr: ip, Loopback: true})
	}
	dev, dev6 := have.Device, have.Device6
	if dev != nil && (len(wantDev4) == 0 || dev.Local != want.Pod.IP) {
		// Not wanted, or the pod got a new address in the same namespace.
		acts = append(acts, PodChange{Kind: actDeleteDevice})
		dev, addDev4 = nil, wantDev4 // a new device starts without addresses
	}
	if dev6 != nil && (len(wantDev6) == 0 || dev6.Local != want.Pod.IPv6) {
		acts = append(acts, PodChange{Kind: actDeleteDevice, IPv6: true})
		dev6, addDev6 = nil, wantDev6
	}
	if have.PopRoute && len(wantLo4)+len(wantLo6) == 0 {
		acts = append(acts, PodChange{Kind: actDelPopRoute})
	}
	// The carrier guard and the policy rules change after the tunnel IPs
	// that leave and before the decapsulation paths and tunnel IPs that
	// come, so that no tunnel IP is ever served unguarded or unfiltered.
	guards, err := planGuard(want, have)
	if err != nil {
		return nil, err
	}
	acts = append(acts, guards...)
	policy, err := planPolicy(want, have)
	if err != nil {
		return nil, err
	}
	acts = append(acts, policy...)
	// An advmss is removed only when it is the agent's value.
	if cfg.PodAdvMSS != 0 && len(v4) == 0 && have.DefaultRoute && have.AdvMSS == cfg.PodAdvMSS {
		acts = append(acts, PodChange{Kind: actSetAdvMSS, MSS: 0})
	}
	if len(v6) == 0 && have.DefaultRoute6 && have.AdvMSS6 != 0 && slices.Contains(cfg.podAdvMSS6Values(), have.AdvMSS6) {
		acts = append(acts, PodChange{Kind: actSetAdvMSS, IPv6: true, MSS: 0})
	}
	if len(want.TunnelIPs) == 0 {
		return acts, nil
	}

	switch cfg.Mode {
	case encap.GRE:
		if len(v4) > 0 {
			if dev == nil {
				acts = append(acts, PodChange{Kind: actCreateDevice, Addr: want.Pod.IP}, PodChange{Kind: actMarkDevice})
			}
			// Off before the device is up (see above).
			if dev == nil || have.Sysctls[forwardingSysctl(cfg.Device)] != "0" {
				acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: forwardingSysctl(cfg.Device), Value: "0"})
			}
			// The IPv4 device carries IPv4 only: IPv6 inside IPv4 GRE
			// would reach the device's link-local address and the
			// multicast groups it joins, which no guard rule covers in a
			// pod without an IPv6 address (a kernel without IPv6 has no
			// such sysctl).
			disabled := have.Sysctls[disableIPv6Sysctl(cfg.Device)]
			if dev == nil {
				disabled = have.Sysctls[disableIPv6Sysctl("default")]
			}
			if disabled != "" && disabled != "1" {
				acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: disableIPv6Sysctl(cfg.Device), Value: "1"})
			}
			if dev == nil || !dev.Up {
				acts = append(acts, PodChange{Kind: actSetDeviceUp})
			}
			// The device's own sysctl exists only once the device does.
			if dev == nil || have.Sysctls[rpFilterSysctl(cfg.Device)] != "2" {
				acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: rpFilterSysctl(cfg.Device), Value: "2"})
			}
		}
		if len(v6) > 0 {
			if dev6 == nil {
				acts = append(acts, PodChange{Kind: actCreateDevice, Addr: want.Pod.IPv6, IPv6: true}, PodChange{Kind: actMarkDevice, IPv6: true})
			}
			// A new device takes the namespace's default: IPv6 must be on
			// for it to hold the tunnel IPs and receive their packets.
			disabled := have.Sysctls[disableIPv6Sysctl(cfg.IPv6Device())]
			if dev6 == nil {
				disabled = have.Sysctls[disableIPv6Sysctl("default")]
			}
			if disabled == "1" {
				acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: disableIPv6Sysctl(cfg.IPv6Device()), Value: "0"})
			}
			if dev6 == nil || !dev6.Up {
				acts = append(acts, PodChange{Kind: actSetDeviceUp, IPv6: true})
			}
		}
	case encap.MPLS:
		var links []string
		if len(v4) > 0 {
			if have.PodLink == "" {
				return nil, fmt.Errorf("no interface holds the pod IP %v", want.Pod.IP)
			}
			links = append(links, have.PodLink)
		}
		if len(v6) > 0 {
			if have.PodLink6 == "" {
				return nil, fmt.Errorf("no interface holds the pod IP %v", want.Pod.IPv6)
			}
			links = append(links, have.PodLink6)
		}
		if v, _ := strconv.Atoi(have.Sysctls[sysctlPlatformLabels]); v < podPlatformLabels {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: sysctlPlatformLabels, Value: strconv.Itoa(podPlatformLabels)})
		}
		for _, l := range podLinks(links...) {
			if have.Sysctls[mplsInputSysctl(l)] != "1" {
				acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: mplsInputSysctl(l), Value: "1"})
			}
		}
		if len(v4) > 0 && have.Sysctls[rpFilterSysctl("lo")] == "1" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: rpFilterSysctl("lo"), Value: "2"})
		}
		// Off before the pop route (see above).
		if len(v4) > 0 && have.Sysctls[forwardingSysctl("lo")] != "0" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: forwardingSysctl("lo"), Value: "0"})
		}
		// The popped IPv6 packets are received on lo.
		if len(v6) > 0 && have.Sysctls[disableIPv6Sysctl("lo")] == "1" {
			acts = append(acts, PodChange{Kind: actSetSysctl, Sysctl: disableIPv6Sysctl("lo"), Value: "0"})
		}
		if !have.PopRoute {
			acts = append(acts, PodChange{Kind: actAddPopRoute})
		}
	}
	// An advmss someone else set is theirs: left alone, and never removed.
	if cfg.PodAdvMSS != 0 && len(v4) > 0 && have.DefaultRoute && have.AdvMSS == 0 {
		acts = append(acts, PodChange{Kind: actSetAdvMSS, MSS: cfg.PodAdvMSS})
	}
	if mss6 := cfg.PodAdvMSS6(); mss6 != 0 && len(v6) > 0 && have.DefaultRoute6 && have.AdvMSS6 != mss6 &&
		(have.AdvMSS6 == 0 || slices.Contains(cfg.podAdvMSS6Values(), have.AdvMSS6)) {
		acts = append(acts, PodChange{Kind: actSetAdvMSS, IPv6: true, MSS: mss6})
	}
	for _, ip := range slices.Concat(addDev4, addDev6) {
		acts = append(acts, PodChange{Kind: actAddTunnelIP, Addr: ip})
	}
	for _, ip := range slices.Concat(addLo4, addLo6) {
		acts = append(acts, PodChange{Kind: actAddTunnelIP, Addr: ip, Loopback: true})
	}
	return acts, nil
}

// planPolicy returns the changes that make the pod's filter tables hold
// want's policy rules: the IPv4 table's, then the IPv6 one's, each only
// when it was read and differs. An isolated family whose table could not
// be read is an error (its tunnel IPs must not be served unfiltered);
// another one goes without connection tracking.
func planPolicy(want PodTunnels, have podState) ([]PodChange, error) {
	var acts []PodChange
	for _, f := range []struct {
		ipv6 bool
		read bool
		have netpol.Observed
		err  error
	}{{false, have.TablesRead, have.Policy, have.PolicyErr}, {true, have.Tables6Read, have.Policy6, have.PolicyErr6}} {
		if !f.read {
			continue
		}
		rules := want.PolicyOf(f.ipv6)
		if f.err != nil {
			if rules != nil && rules.Isolated {
				return nil, fmt.Errorf("reading the pod's %sfilter table for its network policy: %w", PodChange{IPv6: f.ipv6}.family(), f.err)
			}
			continue
		}
		payload := netpol.Update(rules, f.have)
		if payload == nil {
			continue
		}
		a := PodChange{Kind: actSyncPolicy, IPv6: f.ipv6, Payload: payload}
		if rules != nil {
			a.Digest = rules.Digest
		}
		acts = append(acts, a)
	}
	return acts, nil
}

// planGuard returns the changes that make the pod's raw tables hold want's
// carrier guard: the IPv4 table's, then the IPv6 one's, each only when it
// was read and differs. A guarded family whose table could not be read is
// an error: its tunnel IPs must not be served unguarded.
func planGuard(want PodTunnels, have podState) ([]PodChange, error) {
	var acts []PodChange
	for _, f := range []struct {
		ipv6 bool
		read bool
		have guard.Observed
		err  error
	}{{false, have.TablesRead, have.Guard, have.PolicyErr}, {true, have.Tables6Read, have.Guard6, have.PolicyErr6}} {
		if !f.read {
			continue
		}
		rules := want.GuardOf(f.ipv6)
		if f.err != nil {
			if rules != nil {
				return nil, fmt.Errorf("reading the pod's %sraw table for its carrier guard: %w", PodChange{IPv6: f.ipv6}.family(), f.err)
			}
			continue
		}
		payload := guard.Update(rules, f.have)
		if payload == nil {
			continue
		}
		a := PodChange{Kind: actSyncGuard, IPv6: f.ipv6, Payload: payload}
		if rules != nil {
			a.Digest = rules.Digest
		}
		acts = append(acts, a)
	}
	return acts, nil
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
