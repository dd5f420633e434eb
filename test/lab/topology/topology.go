// Package topology builds the lab's cluster inside one Linux kernel (the lab
// VM's): network namespaces for an external client, a gateway standing for
// the datacenter router, two tunnel routers and two worker nodes with their
// pods, the Kubernetes objects a real cluster would have for them, and the
// project's real daemons running in the nodes' namespaces as their own
// ServiceAccounts. The end-to-end tests, the demo and later the BGP tests and
// benchmarks build on it.
//
//	client 198.51.100.10 ── gateway ──┬── router-a 172.20.0.11 ┐ node=tunnel
//	                (routes 192.0.2.0/24 ├── router-b 172.20.0.12 ┘
//	               to the routers)    ├── worker-a 172.20.0.21 ── cni0 10.244.1.1 ── pod-a1 .11, pod-a2 .12
//	                                  └── worker-b 172.20.0.22 ── cni0 10.244.2.1 ── pod-b1 .11, pod-b2 .12
//
// The gateway's "fabric" bridge is the node network; every node's eth0 is a
// port of it. Pod CIDRs are routed (gateway and routers know which worker
// holds which CIDR). Pods answer clients directly: pod -> worker -> gateway
// -> client, never through a router.
//
// Every link is dual-stack. The IPv6 plan mirrors the IPv4 one digit for
// digit, so an address's IPv6 twin reads like it:
//
//	client      198.51.100.10   2001:db8:100::10     (client link 2001:db8:100::/64, gateway ::1)
//	tunnel IPs  192.0.2.0/24    2001:db8:2::/64      (TunnelIP(10) 192.0.2.10, TunnelIP6(10) 2001:db8:2::10)
//	fabric      172.20.0.0/24   fd00:172:20::/64     (gateway ::1, router-a ::11, worker-a ::21, ...)
//	pods        10.244.1.0/24   fd00:10:244:1::/64   (worker-a: cni0 ::1, pod-a1 ::11, pod-a2 ::12)
//	            10.244.2.0/24   fd00:10:244:2::/64   (worker-b: cni0 ::1, pod-b1 ::11, pod-b2 ::12)
//
// IPv6 addresses are usable at once (no duplicate address detection in any
// lab namespace, and every address is added nodad), routers solicit and
// accept no advertisements, and the gateway and every node forward IPv6 as
// they do IPv4. The gateway routes 2001:db8:2::/64 to the routers as it
// routes 192.0.2.0/24.
//
// Every namespace is named (ip netns), so `ip -n NAME ...` shows it, and the
// endpoint agent finds pods with --runtime netns. Up needs root and a kernel
// with GRE or MPLS for the mode asked (the lab VM); it must run in the VM's
// root namespace, where the API server is reachable at Options.Upstream.
package topology

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/vishvananda/netns"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/test/lab/guest"
	"github.com/cmdnu/kube-service-tunnel/test/support/nsrelay"
)

// Addresses of the lab. Tunnel IPs are taken from TunnelNet, IPv6 ones from
// TunnelNet6.
var (
	ClientAddr  = netip.MustParseAddr("198.51.100.10")
	GatewayAddr = netip.MustParseAddr("172.20.0.1")
	TunnelNet   = netip.MustParsePrefix("192.0.2.0/24")
	clientNet   = netip.MustParsePrefix("198.51.100.0/24")
	fabricNet   = netip.MustParsePrefix("172.20.0.0/24")

	ClientAddr6  = netip.MustParseAddr("2001:db8:100::10")
	GatewayAddr6 = netip.MustParseAddr("fd00:172:20::1")
	TunnelNet6   = netip.MustParsePrefix("2001:db8:2::/64")
	clientNet6   = netip.MustParsePrefix("2001:db8:100::/64")
	fabricNet6   = netip.MustParsePrefix("fd00:172:20::/64")

	// syncNet is the routers' own link for conntrackd (Options.ConntrackSync).
	syncNet = netip.MustParsePrefix("172.21.0.0/24")
)

// Names of the lab's namespaces that are not nodes or pods.
const (
	ClientNS  = "client"
	GatewayNS = "gateway"
	// FabricBridge is the gateway's bridge that every node's eth0 joins.
	FabricBridge = "fabric"
	// SyncBridge is the gateway's bridge that every router's SyncLink joins
	// (Options.ConntrackSync): the routers' dedicated link for conntrackd.
	SyncBridge = "ctsync"
	SyncLink   = "sync0"
	// PodBridge is each worker's bridge to its pods.
	PodBridge = "cni0"
)

// Options describe a lab. Zero values take the defaults shown.
type Options struct {
	// Mode is "gre" or "mpls", given to both daemons.
	Mode string
	// Seed and Buckets are the routers' HMARK seed and bucket count
	// (0x5eed1e55, 64).
	Seed    uint32
	Buckets int
	// APIAddr is the API server's address as the kubeconfigs name it
	// ($KST_LAB_API); Upstream is where it is reachable from the calling
	// process's namespace (guest.HostForwardAddr with APIAddr's port). Up
	// relays APIAddr to Upstream in every namespace that talks to it.
	APIAddr, Upstream string
	// KubeDir holds admin.kubeconfig, tunnel-router.kubeconfig and
	// tunnel-endpoint.kubeconfig (/lab/kube); BinDir the daemons (/lab/bin).
	KubeDir, BinDir string
	// WorkDir receives the daemons' logs (/tmp/lab).
	WorkDir string
	// Namespace is the Kubernetes namespace of the pods and Services ("lab").
	Namespace string
	// PodsPerWorker is the number of pods on each worker (2).
	PodsPerWorker int
	// PodLabels label every Pod, and select them in lab Services (app=lab).
	PodLabels map[string]string
	// RouterArgs and EndpointArgs are appended to the daemons' flags.
	RouterArgs, EndpointArgs []string
	// ConntrackSync gives the routers a link of their own (SyncLink, on the
	// gateway's SyncBridge) and runs them with --conntrack-sync-interface
	// on it: conntrackd shares their entries.
	ConntrackSync bool
	// Log receives one line per step (nil: discarded).
	Log io.Writer
}

// setDefaults fills in the zero values; withAPI says whether the lab talks to
// the API server (Up), which then must be named.
func (o *Options) setDefaults(withAPI bool) error {
	if o.Mode == "" {
		o.Mode = "gre"
	}
	if o.Mode != "gre" && o.Mode != "mpls" {
		return fmt.Errorf("topology: mode %q is neither gre nor mpls", o.Mode)
	}
	if o.Seed == 0 {
		o.Seed = 0x5eed1e55
	}
	if o.Buckets == 0 {
		o.Buckets = 64
	}
	if o.APIAddr == "" {
		o.APIAddr = os.Getenv(guest.EnvAPIAddr)
	}
	if o.APIAddr == "" && withAPI {
		return errors.New("topology: no API server address (Options.APIAddr or $" + guest.EnvAPIAddr + ")")
	}
	if o.Upstream == "" && o.APIAddr != "" {
		_, port, _ := strings.Cut(o.APIAddr, ":")
		o.Upstream = guest.HostForwardAddr + ":" + port
	}
	if o.KubeDir == "" {
		o.KubeDir = guest.KubeDir
	}
	if o.BinDir == "" {
		o.BinDir = guest.BinDir
	}
	if o.WorkDir == "" {
		o.WorkDir = "/tmp/lab"
	}
	if o.Namespace == "" {
		o.Namespace = "lab"
	}
	if o.PodsPerWorker == 0 {
		o.PodsPerWorker = 2
	}
	if o.PodLabels == nil {
		o.PodLabels = map[string]string{"app": "lab"}
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	return nil
}

// Host is a network namespace with its main addresses.
type Host struct {
	Name string
	Addr netip.Addr
	// Addr6 is its IPv6 address on the same link.
	Addr6 netip.Addr
}

// NS opens the namespace; the caller closes the handle.
func (h *Host) NS() (netns.NsHandle, error) {
	ns, err := netns.GetFromName(h.Name)
	if err != nil {
		return ns, fmt.Errorf("opening network namespace %s: %w", h.Name, err)
	}
	return ns, nil
}

// Node is a Kubernetes node: a namespace whose eth0 is on the fabric.
type Node struct {
	Host
	// Tunnel nodes carry the label node=tunnel and run the router.
	Tunnel bool
	// PodCIDR is a worker's pod network (invalid on routers), PodCIDR6 its
	// IPv6 one.
	PodCIDR, PodCIDR6 netip.Prefix
	// Router runs on tunnel nodes, Agent (the endpoint agent) on workers.
	Router, Agent *Daemon
}

// Pod is a pod namespace behind a worker's cni0.
type Pod struct {
	Host
	Node *Node
	// UID is the Kubernetes Pod's, once created.
	UID types.UID
}

// Lab is a running topology.
type Lab struct {
	Opts    Options
	Client  *Host
	Gateway *Host
	Routers []*Node
	Workers []*Node
	Pods    []*Pod
	// Kube is an admin client.
	Kube kubernetes.Interface
	// Bird is the gateway's BGP daemon while EnableBGP is in effect.
	Bird *Daemon

	relays     []func()
	birdSocket string
}

// Up builds the namespaces and links, relays the API server into them,
// creates the Nodes and Pods in Kubernetes, and starts a router on each
// tunnel node and an endpoint agent on each worker. Call Down when done,
// also after an error.
func Up(ctx context.Context, opts Options) (*Lab, error) {
	if err := opts.setDefaults(true); err != nil {
		return nil, err
	}
	l, err := upNetwork(ctx, opts)
	if err != nil {
		return l, err
	}
	if err := l.relayAPI(); err != nil {
		return l, err
	}
	if err := l.connectKube(ctx); err != nil {
		return l, err
	}
	l.logf("creating Nodes and Pods in Kubernetes namespace %s", opts.Namespace)
	if err := l.createClusterObjects(ctx); err != nil {
		return l, err
	}
	if err := l.addKubeProxyRules(ctx); err != nil {
		return l, err
	}
	for _, r := range l.Routers {
		r.Router = l.routerDaemon(r)
		if err := r.Router.Start(); err != nil {
			return l, err
		}
	}
	for _, w := range l.Workers {
		w.Agent = l.agentDaemon(w)
		if err := w.Agent.Start(); err != nil {
			return l, err
		}
	}
	l.logf("started %d tunnel routers and %d endpoint agents in %s mode", len(l.Routers), len(l.Workers), opts.Mode)
	return l, nil
}

// UpNetwork builds only the lab's network, as Up does (namespaces, links,
// addresses, routes, sysctls), for tests that program the datapath by hand:
// no API server, no Kubernetes objects, no daemons. Options other than
// PodsPerWorker, WorkDir and Log are not used. Call Down when done, also
// after an error.
func UpNetwork(ctx context.Context, opts Options) (*Lab, error) {
	if err := opts.setDefaults(false); err != nil {
		return nil, err
	}
	return upNetwork(ctx, opts)
}

// upNetwork names the lab's hosts and builds their network.
func upNetwork(ctx context.Context, opts Options) (*Lab, error) {
	l := &Lab{Opts: opts}
	l.Client = &Host{Name: ClientNS, Addr: ClientAddr, Addr6: ClientAddr6}
	l.Gateway = &Host{Name: GatewayNS, Addr: GatewayAddr, Addr6: GatewayAddr6}
	for i, name := range []string{"router-a", "router-b"} {
		l.Routers = append(l.Routers, &Node{Host: Host{Name: name, Addr: fabricAddr(11 + i), Addr6: fabricAddr6(11 + i)}, Tunnel: true})
	}
	for i, name := range []string{"worker-a", "worker-b"} {
		w := &Node{
			Host:     Host{Name: name, Addr: fabricAddr(21 + i), Addr6: fabricAddr6(21 + i)},
			PodCIDR:  netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(1 + i), 0}), 24),
			PodCIDR6: netip.MustParsePrefix(fmt.Sprintf("fd00:10:244:%d::/64", 1+i)),
		}
		l.Workers = append(l.Workers, w)
		for j := range opts.PodsPerWorker {
			// pod-a1 10.244.1.11 fd00:10:244:1::11, pod-a2 10.244.1.12
			// fd00:10:244:1::12, pod-b1 10.244.2.11 fd00:10:244:2::11, ...
			addr := w.PodCIDR.Addr().As4()
			addr[3] = byte(11 + j)
			l.Pods = append(l.Pods, &Pod{Host: Host{
				Name:  fmt.Sprintf("pod-%c%d", 'a'+i, j+1),
				Addr:  netip.AddrFrom4(addr),
				Addr6: mirror6(w.PodCIDR6, 11+j),
			}, Node: w})
		}
	}
	if err := os.MkdirAll(opts.WorkDir, 0o755); err != nil {
		return l, err
	}
	l.logf("building the network: client, gateway, %d routers, %d workers, %d pods", len(l.Routers), len(l.Workers), len(l.Pods))
	if err := l.buildNetwork(ctx); err != nil {
		return l, err
	}
	return l, nil
}

// Down stops the daemons, runs their --cleanup, deletes the Pods and every
// namespace, and stops the API relays. It returns the first error but does
// every step. It is safe on the nil Lab of a failed Up.
func (l *Lab) Down(ctx context.Context) error {
	if l == nil {
		return nil
	}
	var errs []error
	for _, n := range l.Nodes() {
		for _, d := range []*Daemon{n.Router, n.Agent} {
			if d != nil {
				errs = append(errs, d.Stop())
			}
		}
	}
	if l.Bird != nil {
		errs = append(errs, l.Bird.Stop())
	}
	for _, r := range l.Routers {
		if r.Router != nil {
			errs = append(errs, l.cleanup(ctx, r, r.Router))
		}
	}
	for _, w := range l.Workers {
		if w.Agent != nil {
			errs = append(errs, l.cleanup(ctx, w, w.Agent))
		}
	}
	if l.Kube != nil {
		errs = append(errs, l.deleteClusterObjects(ctx))
	}
	for _, stop := range l.relays {
		stop()
	}
	l.relays = nil
	errs = append(errs, l.deleteNamespaces())
	return errors.Join(errs...)
}

// cleanup runs a stopped daemon's --cleanup in its node's namespace.
func (l *Lab) cleanup(ctx context.Context, n *Node, d *Daemon) error {
	args := append([]string{"netns", "exec", n.Name, d.Path, "--cleanup"}, d.cleanupArgs...)
	out, err := exec.CommandContext(ctx, ipPath(), args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s --cleanup on %s: %w: %s", filepath.Base(d.Path), n.Name, err, out)
	}
	return nil
}

// Nodes are the routers, then the workers.
func (l *Lab) Nodes() []*Node { return append(append([]*Node(nil), l.Routers...), l.Workers...) }

// PodByAddr returns the pod with this address (IPv4 or IPv6), or nil.
func (l *Lab) PodByAddr(a netip.Addr) *Pod {
	for _, p := range l.Pods {
		if p.Addr == a || p.Addr6 == a {
			return p
		}
	}
	return nil
}

// PodByName returns the pod of this name, or nil.
func (l *Lab) PodByName(name string) *Pod {
	for _, p := range l.Pods {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// TunnelIP returns the i-th address of TunnelNet (192.0.2.i).
func TunnelIP(i int) netip.Addr {
	b := TunnelNet.Addr().As4()
	b[3] = byte(i)
	return netip.AddrFrom4(b)
}

// TunnelIP6 returns the IPv6 twin of TunnelIP(i): i written in decimal as
// the last group of TunnelNet6 (TunnelIP6(10) is 2001:db8:2::10). i is 1 to
// 9999.
func TunnelIP6(i int) netip.Addr { return mirror6(TunnelNet6, i) }

func fabricAddr(host int) netip.Addr {
	b := fabricNet.Addr().As4()
	b[3] = byte(host)
	return netip.AddrFrom4(b)
}

// fabricAddr6 is fabricAddr's IPv6 twin: fd00:172:20::11 for 172.20.0.11.
func fabricAddr6(host int) netip.Addr { return mirror6(fabricNet6, host) }

// mirror6 returns the address of the /64 network whose last group is n's
// decimal digits read as hexadecimal, so that it reads like the IPv4
// address ending in n: mirror6(fd00:172:20::/64, 11) is fd00:172:20::11.
func mirror6(network netip.Prefix, n int) netip.Addr {
	if n < 0 || n > 9999 {
		panic(fmt.Sprintf("topology: %d has more than 4 digits", n))
	}
	var group uint16
	for _, d := range strconv.Itoa(n) {
		group = group<<4 | uint16(d-'0')
	}
	b := network.Masked().Addr().As16()
	b[14], b[15] = byte(group>>8), byte(group)
	return netip.AddrFrom16(b)
}

func (l *Lab) logf(format string, args ...any) {
	fmt.Fprintf(l.Opts.Log, format+"\n", args...)
}

func (l *Lab) relayAPI() error {
	targets := []string{""} // "": this process's own namespace
	for _, n := range l.Nodes() {
		targets = append(targets, n.Name)
	}
	for _, name := range targets {
		var ns netns.NsHandle
		var err error
		if name == "" {
			ns, err = netns.Get()
		} else {
			ns, err = netns.GetFromName(name)
		}
		if err != nil {
			return fmt.Errorf("relaying the API server into %q: %w", name, err)
		}
		stop, err := nsrelay.Relay(ns, l.Opts.APIAddr, l.Opts.Upstream)
		ns.Close()
		if err != nil {
			return fmt.Errorf("relaying the API server into %q: %w", name, err)
		}
		l.relays = append(l.relays, stop)
	}
	return nil
}

// addKubeProxyRules writes kube-proxy's rule into every worker's namespace,
// in both families, as almost every cluster has it: packets that conntrack
// finds INVALID are dropped in forwarding. A tunneled connection's first
// packet the worker's conntrack sees is the pod's SYN-ACK (the SYN came
// inside the carrier), which it marks INVALID: the pods' replies pass only
// because the agents exempt them from tracking (--untrack-replies).
func (l *Lab) addKubeProxyRules(ctx context.Context) error {
	for _, w := range l.Workers {
		for _, bin := range []string{"iptables", "ip6tables"} {
			if _, err := InNS(ctx, w.Name, bin, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-m", "comment", "--comment", "kube-proxy's rule (lab)", "-j", "DROP"); err != nil {
				return err
			}
		}
	}
	return nil
}
