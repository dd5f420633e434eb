// Package routerstatus is what each tunnel router publishes about what it
// programmed: one ConfigMap per router, tunnel-router-status-NODE in the
// router's namespace, which kubectl tunnel reads with ordinary RBAC (get and
// list ConfigMaps in that namespace).
//
// A ConfigMap, not a custom resource: it needs no CRD installed before the
// routers, every cluster's RBAC knows it, and kubectl get shows it as it
// is. It is owned by the router's pod, so the garbage collector removes it
// when the pod goes; the next pod on the node takes it over.
//
// Its "router" key holds the router's settings (among them the address pools
// and cluster ranges it admits claims with, which kubectl tunnel prefers to
// the ConfigMap's: a flag may override them), its "tunnels" key one line
// per programmed tunnel IP:
//
//	192.0.2.10 generation=1 table=5f1c09a2 endpoints=3 draining=1 announced=yes [affinity=client]
//
// table is TableDigest of the bucket table new flows follow, so that a
// reader can tell whether the router programmed the table the API's state
// gives now, or an older one.
package routerstatus

import (
	"bufio"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

const (
	// DefaultNamespace holds the routers' status ConfigMaps and the events
	// Lease, apart from the configuration (tunnel-config, the seed Secret):
	// the router may write every ConfigMap of this namespace, since RBAC
	// cannot name objects not yet created, and nothing else.
	DefaultNamespace = "kube-service-tunnel-status"
	// NamePrefix prefixes the node's name in the ConfigMap's name.
	NamePrefix = "tunnel-router-status-"
	// ComponentLabel labels every router status ConfigMap, for listing them.
	ComponentLabel = "app.kubernetes.io/component"
	// ComponentValue is ComponentLabel's value.
	ComponentValue = "tunnel-router-status"
	// RouterKey and TunnelsKey are the ConfigMap's data keys.
	RouterKey  = "router"
	TunnelsKey = "tunnels"
	// MaxTunnelsBytes bounds the tunnels key, under the API server's object
	// size limit (about 1.5 MB in etcd); past it the router lists fewer
	// tunnel IPs and says so (Router.Truncated). About 15,000 tunnel IPs fit.
	MaxTunnelsBytes = 900 << 10
)

// Name returns the status ConfigMap name of the router on node.
func Name(node string) string { return NamePrefix + node }

// Router is one router's status.
type Router struct {
	Node        string
	Pod         string
	Version     string
	Mode        encap.Mode
	Buckets     int
	Generations int
	MarkOffset  uint32
	// TableBase is the routing table of slot 0 (generation 0, bucket 0).
	TableBase int
	// SeedFingerprint is hmark.SeedFingerprint of the router's seed: every
	// router of a cluster must show the same.
	SeedFingerprint string
	// BGP is true when the router announces tunnel IPs over BGP.
	BGP bool
	// Policy is the address pools and cluster ranges the router admits
	// claims with now (its flags, else its ConfigMap); nil in the status of
	// a router that does not publish it (older versions).
	Policy *tunnelclaim.Policy
	// Updated is when the router last wrote this status.
	Updated time.Time
	// Truncated is the number of tunnel IPs left out (MaxTunnelsBytes).
	Truncated int
	Tunnels   []Tunnel
}

// Tunnel is what the router programmed for one tunnel IP.
type Tunnel struct {
	VIP netip.Addr
	// Generation is the routing generation new flows are hashed into.
	Generation int
	// Table is TableDigest of the bucket table of Generation; empty when the
	// tunnel IP has no table (no endpoint: its traffic is dropped).
	Table string
	// Endpoints is the number of endpoints owning buckets of that table;
	// Draining the number of endpoints that only keep established flows.
	Endpoints, Draining int
	// Announced is true when the router announces the tunnel IP (BGP).
	Announced bool
	// ClientAffinity: the router hashes the client's address alone.
	ClientAffinity bool
}

// TableDigest is a short digest of a bucket table: per bucket, the
// endpoint's address and, in mpls mode, its node's address (nodeIPs may be
// nil). Routers and readers compute it alike.
func TableDigest(addrs, nodeIPs []netip.Addr) string {
	if len(addrs) == 0 {
		return ""
	}
	h := sha256.New()
	for i, a := range addrs {
		b, _ := a.MarshalBinary()
		h.Write([]byte{byte(len(b))})
		h.Write(b)
		if i < len(nodeIPs) {
			n, _ := nodeIPs[i].MarshalBinary()
			h.Write([]byte{byte(len(n))})
			h.Write(n)
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:4])
}

// ConfigMap renders r in namespace ns, owned by owner when not nil.
func (r Router) ConfigMap(ns string, owner *metav1.OwnerReference) *corev1.ConfigMap {
	tunnels := slices.Clone(r.Tunnels)
	slices.SortFunc(tunnels, func(a, b Tunnel) int { return a.VIP.Compare(b.VIP) })
	var lines strings.Builder
	for i, t := range tunnels {
		line := t.line()
		if lines.Len()+len(line) > MaxTunnelsBytes {
			r.Truncated = len(tunnels) - i
			break
		}
		lines.WriteString(line)
	}
	header := fmt.Sprintf("node: %s\npod: %s\nversion: %s\nmode: %s\nbuckets: %d\ngenerations: %d\nmarkOffset: %#x\ntableBase: %d\nseedFingerprint: %s\nbgp: %t\nupdated: %s\ntunnelIPs: %d\ntruncated: %d\n",
		r.Node, r.Pod, r.Version, r.Mode, r.Buckets, r.Generations, r.MarkOffset, r.TableBase, r.SeedFingerprint, r.BGP,
		r.Updated.UTC().Format(time.RFC3339), len(tunnels), r.Truncated)
	if p := r.Policy; p != nil {
		header += fmt.Sprintf("pools: %s\npodCIDRs: %s\nserviceCIDRs: %s\n", p.Pools, tunnelclaim.JoinCIDRs(p.PodCIDRs), tunnelclaim.JoinCIDRs(p.ServiceCIDRs))
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns, Name: Name(r.Node),
			Labels: map[string]string{ComponentLabel: ComponentValue, "app.kubernetes.io/part-of": "kube-service-tunnel"},
		},
		Data: map[string]string{RouterKey: header, TunnelsKey: lines.String()},
	}
	if owner != nil {
		cm.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return cm
}

func (t Tunnel) line() string {
	table := t.Table
	if table == "" {
		table = "none"
	}
	announced := "no"
	if t.Announced {
		announced = "yes"
	}
	affinity := ""
	if t.ClientAffinity {
		affinity = " affinity=client"
	}
	return fmt.Sprintf("%s generation=%d table=%s endpoints=%d draining=%d announced=%s%s\n", t.VIP, t.Generation, table, t.Endpoints, t.Draining, announced, affinity)
}

// Parse reads a router's status back from its ConfigMap.
func Parse(cm *corev1.ConfigMap) (Router, error) {
	var r Router
	fail := func(key string, line int, err error) (Router, error) {
		return Router{}, fmt.Errorf("router status %s/%s, key %q line %d: %w", cm.Namespace, cm.Name, key, line, err)
	}
	sc := bufio.NewScanner(strings.NewReader(cm.Data[RouterKey]))
	for n := 1; sc.Scan(); n++ {
		k, v, ok := strings.Cut(sc.Text(), ": ")
		if !ok {
			continue
		}
		var err error
		switch k {
		case "node":
			r.Node = v
		case "pod":
			r.Pod = v
		case "version":
			r.Version = v
		case "mode":
			r.Mode = encap.Mode(v)
		case "buckets":
			r.Buckets, err = strconv.Atoi(v)
		case "generations":
			r.Generations, err = strconv.Atoi(v)
		case "markOffset":
			var m uint64
			m, err = strconv.ParseUint(v, 0, 32)
			r.MarkOffset = uint32(m)
		case "tableBase":
			r.TableBase, err = strconv.Atoi(v)
		case "seedFingerprint":
			r.SeedFingerprint = v
		case "bgp":
			r.BGP, err = strconv.ParseBool(v)
		case "updated":
			r.Updated, err = time.Parse(time.RFC3339, v)
		case "truncated":
			r.Truncated, err = strconv.Atoi(v)
		case "pools":
			r.policy().Pools, err = tunnelclaim.ParsePools(v)
		case "podCIDRs":
			r.policy().PodCIDRs, err = tunnelclaim.ParseCIDRs(v)
		case "serviceCIDRs":
			r.policy().ServiceCIDRs, err = tunnelclaim.ParseCIDRs(v)
		}
		if err != nil {
			return fail(RouterKey, n, err)
		}
	}
	sc = bufio.NewScanner(strings.NewReader(cm.Data[TunnelsKey]))
	sc.Buffer(make([]byte, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		var t Tunnel
		var err error
		if t.VIP, err = netip.ParseAddr(fields[0]); err != nil {
			return fail(TunnelsKey, n, err)
		}
		for _, f := range fields[1:] {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "generation":
				t.Generation, err = strconv.Atoi(v)
			case "table":
				if v != "none" {
					t.Table = v
				}
			case "endpoints":
				t.Endpoints, err = strconv.Atoi(v)
			case "draining":
				t.Draining, err = strconv.Atoi(v)
			case "announced":
				t.Announced = v == "yes"
			case "affinity":
				t.ClientAffinity = v == "client"
			}
			if err != nil {
				return fail(TunnelsKey, n, fmt.Errorf("%s: %w", k, err))
			}
		}
		r.Tunnels = append(r.Tunnels, t)
	}
	slices.SortFunc(r.Tunnels, func(a, b Tunnel) int { return a.VIP.Compare(b.VIP) })
	return r, nil
}

// policy returns r.Policy, allocated on first use.
func (r *Router) policy() *tunnelclaim.Policy {
	if r.Policy == nil {
		r.Policy = &tunnelclaim.Policy{}
	}
	return r.Policy
}

// Slot returns the slot of bucket b in generation g: its mark is
// MarkOffset+slot and its routing table TableBase+slot.
func (r Router) Slot(g, b int) int { return g*r.Buckets + b }

// Tunnel returns the router's status of vip.
func (r Router) Tunnel(vip netip.Addr) (Tunnel, bool) {
	i, ok := slices.BinarySearchFunc(r.Tunnels, vip, func(t Tunnel, v netip.Addr) int { return t.VIP.Compare(v) })
	if !ok {
		return Tunnel{}, false
	}
	return r.Tunnels[i], true
}

// SortRouters orders routers by node name.
func SortRouters(rs []Router) {
	slices.SortFunc(rs, func(a, b Router) int { return cmp.Compare(a.Node, b.Node) })
}
