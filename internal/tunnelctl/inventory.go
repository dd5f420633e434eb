// Package tunnelctl is kubectl tunnel: it answers an operator's questions
// from the API: which tunnel IPs are served, for which Service, by which
// routers, to which pods (status), and where one flow goes (explain). The
// bucket tables come from the same code the routers run (router.NewTunnel,
// tunnelclaim.Decide, the Go copy of HMARK); what is programmed comes only
// from what each router publishes (internal/routerstatus).
package tunnelctl

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/kubeobj"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// ConfigMapName is the configuration the manifest gives both daemons.
const ConfigMapName = "tunnel-config"

// Inventory is what the API says about every claim, plus every router's
// published status.
type Inventory struct {
	// Namespace is the project's namespace (its configuration).
	Namespace string
	// StatusNamespace holds the routers' status ConfigMaps.
	StatusNamespace string
	Mode            encap.Mode
	Buckets         int
	// ConfigFrom says where Mode and Buckets come from.
	ConfigFrom string
	// Policy is what claims are judged with: the pools and ranges the
	// newest router publishes, else the ConfigMap's.
	Policy   tunnelclaim.Policy
	Decision tunnelclaim.Decision
	Routers  []routerstatus.Router
	// Notes are what the caller could not read or what does not add up,
	// in words for the operator.
	Notes []string

	// configRead and routerPolicy say where Policy came from.
	configRead, routerPolicy bool

	client  kubernetes.Interface
	nodes   map[string]*corev1.Node
	drained map[string]map[string]bool // by namespace: drainedPods' answers
}

// Load reads the inventory. Only the Services and Nodes are required; the
// configuration and the routers' status are reported in Notes when missing.
func Load(ctx context.Context, client kubernetes.Interface, namespace, statusNamespace string) (*Inventory, error) {
	inv := &Inventory{Namespace: namespace, StatusNamespace: statusNamespace, client: client, Mode: encap.GRE, Buckets: datapath.DefaultBuckets, ConfigFrom: "defaults", nodes: map[string]*corev1.Node{}, drained: map[string]map[string]bool{}}
	cfg, err := client.CoreV1().ConfigMaps(namespace).Get(ctx, ConfigMapName, metav1.GetOptions{})
	configMissing := false
	switch {
	case err == nil:
		if err := inv.readConfig(cfg); err != nil {
			return nil, err
		}
	case apierrors.IsNotFound(err):
		configMissing = true
	default:
		inv.Notes = append(inv.Notes, fmt.Sprintf("cannot read ConfigMap %s/%s (the address pools): %v", namespace, ConfigMapName, err))
	}
	cms, err := client.CoreV1().ConfigMaps(statusNamespace).List(ctx, metav1.ListOptions{LabelSelector: routerstatus.ComponentLabel + "=" + routerstatus.ComponentValue})
	if err != nil {
		inv.Notes = append(inv.Notes, fmt.Sprintf("cannot read the routers' status (ConfigMaps %s* in %s): %v", routerstatus.NamePrefix, statusNamespace, err))
	} else {
		for i := range cms.Items {
			r, err := routerstatus.Parse(&cms.Items[i])
			if err != nil {
				inv.Notes = append(inv.Notes, err.Error())
				continue
			}
			if inv.routerGone(ctx, r) {
				continue
			}
			inv.Routers = append(inv.Routers, r)
		}
		routerstatus.SortRouters(inv.Routers)
	}
	inv.routerConfig()
	if configMissing && !inv.routerPolicy {
		inv.Notes = append(inv.Notes, fmt.Sprintf("no ConfigMap %s/%s and no router publishing its pools: no address pool known, so no claim is admitted here", namespace, ConfigMapName))
	}
	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing nodes: %w", err)
	}
	nodeList := make([]*corev1.Node, len(nodes.Items))
	for i := range nodes.Items {
		nodeList[i] = &nodes.Items[i]
		inv.nodes[nodes.Items[i].Name] = &nodes.Items[i]
	}
	svcs, err := client.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing services (claims are decided across all namespaces): %w", err)
	}
	var annotated []*corev1.Service
	for i := range svcs.Items {
		if _, ok := svcs.Items[i].Annotations[tunnelclaim.Annotation]; ok {
			annotated = append(annotated, &svcs.Items[i])
		}
	}
	inv.Decision = tunnelclaim.Decide(annotated, inv.Policy.Pools, inv.Policy.Networks(nodeList))
	return inv, nil
}

// readConfig takes the pools, the cluster ranges, the mode and the bucket
// count from the daemons' ConfigMap, parsed by the daemons' own flags.
func (inv *Inventory) readConfig(cm *corev1.ConfigMap) error {
	policy, err := livepolicy.Parse(cm.Data, tunnelclaim.Policy{}, nil)
	if err != nil {
		return fmt.Errorf("ConfigMap %s/%s, %w", cm.Namespace, cm.Name, err)
	}
	inv.Policy, inv.configRead = policy, true
	if v, ok := cm.Data["KST_MODE"]; ok {
		inv.Mode, inv.ConfigFrom = encap.Mode(v), "ConfigMap "+cm.Name
	}
	if v, ok := cm.Data["KST_BUCKETS"]; ok {
		b, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("ConfigMap %s/%s, key KST_BUCKETS: %w", cm.Namespace, cm.Name, err)
		}
		inv.Buckets, inv.ConfigFrom = b, "ConfigMap "+cm.Name
	}
	return nil
}

// routerConfig prefers the mode and bucket count the routers say they run
// with (the router that wrote its status last: a router that is gone
// stops refreshing its status), and notes when they disagree.
func (inv *Inventory) routerConfig() {
	if len(inv.Routers) == 0 {
		return
	}
	first := inv.Routers[0]
	for _, r := range inv.Routers[1:] {
		if r.Updated.After(first.Updated) {
			first = r
		}
	}
	inv.Mode, inv.Buckets, inv.ConfigFrom = first.Mode, first.Buckets, "router "+first.Node
	if p := first.Policy; p != nil {
		// The router's own pools: a flag on its command line wins over
		// the ConfigMap.
		if inv.configRead && !inv.Policy.Equal(*p) {
			inv.Notes = append(inv.Notes, fmt.Sprintf("router %s admits claims with %s, the ConfigMap says %s (a flag on the router's command line wins, or it has not applied the ConfigMap yet): claims are judged with the router's", first.Node, describePolicy(*p), describePolicy(inv.Policy)))
		}
		inv.Policy, inv.routerPolicy = *p, true
	}
	for _, r := range inv.Routers {
		if r.Node == first.Node {
			continue
		}
		if r.Policy != nil && first.Policy != nil && !r.Policy.Equal(*first.Policy) {
			inv.Notes = append(inv.Notes, fmt.Sprintf("routers disagree on the address pools: %s admits claims with %s, %s with %s", first.Node, describePolicy(*first.Policy), r.Node, describePolicy(*r.Policy)))
		}
		if r.Mode != first.Mode || r.Buckets != first.Buckets || r.SeedFingerprint != first.SeedFingerprint || r.Generations != first.Generations {
			inv.Notes = append(inv.Notes, fmt.Sprintf("routers disagree: %s runs %s, %d buckets, %d generations, seed %s; %s runs %s, %d buckets, %d generations, seed %s",
				first.Node, first.Mode, first.Buckets, first.Generations, first.SeedFingerprint, r.Node, r.Mode, r.Buckets, r.Generations, r.SeedFingerprint))
		}
	}
}

// describePolicy renders p as the daemons' flags: --pools, and the ranges
// when set.
func describePolicy(p tunnelclaim.Policy) string {
	s := fmt.Sprintf("--pools %q", p.Pools)
	for _, r := range []struct {
		flag   string
		ranges []netip.Prefix
	}{{"--pod-cidr", p.PodCIDRs}, {"--service-cidr", p.ServiceCIDRs}} {
		if len(r.ranges) > 0 {
			s += fmt.Sprintf(" %s %q", r.flag, tunnelclaim.JoinCIDRs(r.ranges))
		}
	}
	return s
}

// Endpoint is one endpoint of a served tunnel IP.
type Endpoint struct {
	datapath.Endpoint
	// Pod is the endpoint's pod as "namespace/name", when the slice names it.
	Pod string
	// Buckets is how many buckets of the table for new flows it owns.
	Buckets int
}

// Served is one served tunnel IP, computed from the API as the routers do.
type Served struct {
	VIP     netip.Addr
	Service *corev1.Service
	Pool    string
	// Tunnel is the desired state every router computes (bucket table for
	// new flows, present endpoints).
	Tunnel    datapath.Tunnel
	Endpoints []Endpoint
	// Table is routerstatus.TableDigest of Tunnel's table.
	Table    string
	Problems []string
	// eps are the endpoints the table is built from (for TableFor).
	eps []datapath.Endpoint
}

// TableFor is the digest of the table a router with buckets and mode
// computes: a router that runs other settings than Inventory's (during a
// rolling change of them) is compared with its own.
func (s *Served) TableFor(buckets int, mode encap.Mode, inventoryMode encap.Mode) string {
	if buckets == len(s.Tunnel.Table) && mode == inventoryMode {
		return s.Table
	}
	eps := s.eps
	if mode != encap.MPLS {
		eps = make([]datapath.Endpoint, len(s.eps))
		for i, ep := range s.eps {
			ep.NodeIP = netip.Addr{}
			eps[i] = ep
		}
	}
	if buckets < 1 {
		return ""
	}
	return routerstatus.TableDigest(router.TableAddrs(router.NewTunnel(s.VIP, eps, buckets)))
}

// Served computes the desired state of vip, which must have a winner.
func (inv *Inventory) Served(ctx context.Context, vip netip.Addr) (*Served, error) {
	svc := inv.Decision.Winners[vip]
	if svc == nil {
		return nil, fmt.Errorf("tunnel IP %v is not served", vip)
	}
	s := &Served{VIP: vip, Service: svc}
	for _, p := range inv.Policy.Pools {
		if p.Prefix.Contains(vip) {
			s.Pool = p.String()
			break
		}
	}
	slices, err := inv.client.DiscoveryV1().EndpointSlices(svc.Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svc.Name})
	if err != nil {
		return nil, fmt.Errorf("listing the EndpointSlices of Service %s: %w", tunnelclaim.ServiceKey(svc), err)
	}
	esl := make([]*kubeobj.EndpointSlice, len(slices.Items))
	podOf := map[netip.Addr]string{}
	for i := range slices.Items {
		es := kubeobj.NewEndpointSlice(&slices.Items[i])
		esl[i] = es
		for _, ep := range es.Endpoints {
			if a, err := netip.ParseAddr(ep.Address); err == nil && !ep.Pod.IsZero() {
				podOf[a] = ep.Pod.Key()
			}
		}
	}
	drainedPods, err := inv.drainedPods(ctx, svc.Namespace)
	if err != nil {
		s.Problems = append(s.Problems, err.Error())
	}
	eps, problems := router.ServiceEndpoints(esl, router.AddressType(vip), inv.Mode == encap.MPLS, func(ns, name string) bool { return drainedPods[ns+"/"+name] })
	if inv.Mode == encap.MPLS {
		eps, problems = router.WithNodeIPs(eps, problems, func(name string) (*corev1.Node, error) {
			if n, ok := inv.nodes[name]; ok {
				return n, nil
			}
			return nil, fmt.Errorf("not found")
		})
	}
	s.Problems = append(s.Problems, problems...)
	s.eps = eps
	s.Tunnel = router.NewTunnel(vip, eps, inv.Buckets)
	s.Tunnel.ClientAffinity = router.ClientAffinity(svc)
	addrs, nodeIPs := router.TableAddrs(s.Tunnel)
	s.Table = routerstatus.TableDigest(addrs, nodeIPs)
	owned := map[netip.Addr]int{}
	for _, a := range addrs {
		owned[a]++
	}
	for _, ep := range eps {
		s.Endpoints = append(s.Endpoints, Endpoint{Endpoint: ep, Pod: podOf[ep.Addr], Buckets: owned[ep.Addr]})
	}
	return s, nil
}

// drainedPods returns the pods of namespace marked with the drain
// annotation, as "namespace/name"; each namespace is listed once.
func (inv *Inventory) drainedPods(ctx context.Context, namespace string) (map[string]bool, error) {
	if out, ok := inv.drained[namespace]; ok {
		return out, nil
	}
	pods, err := inv.client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("cannot list the pods of namespace %s, so pods drained with the %s annotation show as ready: %v", namespace, router.DrainAnnotation, err)
	}
	out := map[string]bool{}
	for i := range pods.Items {
		if router.Drained(&pods.Items[i]) {
			out[pods.Items[i].Namespace+"/"+pods.Items[i].Name] = true
		}
	}
	inv.drained[namespace] = out
	return out, nil
}

// VIPs returns the served tunnel IPs, sorted.
func (inv *Inventory) VIPs() []netip.Addr {
	var out []netip.Addr
	for vip := range inv.Decision.Winners {
		out = append(out, vip)
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out
}

// routerGone reports whether the pod that wrote r is gone, so that r is a
// status left behind (the router stopped running on that node; its status
// goes only with the Node or the namespace), and says so in Notes. A pod
// that cannot be read counts as there.
func (inv *Inventory) routerGone(ctx context.Context, r routerstatus.Router) bool {
	if r.Pod == "" {
		return false
	}
	_, err := inv.client.CoreV1().Pods(inv.Namespace).Get(ctx, r.Pod, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		return false
	}
	inv.Notes = append(inv.Notes, fmt.Sprintf("left out the status of the router on %s, written by pod %s/%s, which is gone (updated %s)", r.Node, inv.Namespace, r.Pod, r.Updated.UTC().Format(time.RFC3339)))
	return true
}
