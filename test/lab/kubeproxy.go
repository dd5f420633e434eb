package lab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// A real kube-proxy on a lab node (issue 32): the binary built from the
// same Kubernetes release as the kubelet (test/tools/kube-assets.sh), run
// as its DaemonSet would run it (in the node's namespace, as root), in
// iptables or nftables mode. KubeProxyStart (re)starts it in a mode; the
// switch is kube-proxy's own: started in one mode, it removes the other
// mode's rules (cmd/kube-proxy/app platformCleanup).

// KubeProxyModes are the proxy modes the lab runs.
var KubeProxyModes = []string{"iptables", "nftables"}

// KubeProxyModules are the kernel modules kube-proxy's iptables and
// nftables modes load on a node (KubeletModules has the rest): the
// iptables matches and targets of its chains, the nfacct counter of its
// INVALID drop, and nftables' NAT, reject, fib and numgen expressions.
var KubeProxyModules = []string{
	"xt_statistic", "xt_MASQUERADE", "xt_addrtype", "xt_multiport", "xt_nfacct", "nfnetlink_acct",
	"ipt_REJECT", "ip6t_REJECT", "ip6table_nat", "ip6table_filter",
	"nft_nat", "nft_masq", "nft_reject", "nft_reject_inet", "nft_reject_ipv4", "nft_reject_ipv6", "nft_fib", "nft_fib_inet", "nft_fib_ipv4", "nft_fib_ipv6", "nft_numgen", "nft_limit",
}

// KubeProxyHostBinaries are the host programs kube-proxy needs in the VM:
// its nftables mode runs nftables' nft (Debian's nftables package).
var KubeProxyHostBinaries = []string{"/usr/sbin/nft"}

// KubeProxyMetricsPort serves kube-proxy's /metrics and /proxyMode on every
// address of the node; KubeProxyHealthzPort its /healthz.
const (
	KubeProxyMetricsPort = 10249
	KubeProxyHealthzPort = 10256
	// KubeProxyStart is the VM's script that (re)starts kube-proxy:
	// "KubeProxyStart MODE".
	KubeProxyStart = "/lab/kube-proxy/start"
	// KubeProxyLog is kube-proxy's log in the VM.
	KubeProxyLog = "/tmp/kube-proxy.log"
)

// kubeProxyConfig is a node's KubeProxyConfiguration: the kubelet's
// kubeconfig (admin), the pods' range, and conntrack's limits left as the
// node has them.
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: /lab/kubelet/kubeconfig
hostnameOverride: %s
mode: %s
clusterCIDR: %s
metricsBindAddress: 0.0.0.0:%d
healthzBindAddress: 0.0.0.0:%d
conntrack:
  maxPerCore: 0
`

// kubeProxyStartScript stops the running kube-proxy, if any, and starts
// one with the mode's configuration in the background.
const kubeProxyStartScript = `#!/bin/sh
set -e
[ -f "/lab/kube-proxy/$1.yaml" ] || { echo "no kube-proxy mode $1" >&2; exit 2; }
if [ -f /tmp/kube-proxy.pid ]; then
	pid=$(cat /tmp/kube-proxy.pid)
	kill "$pid" 2>/dev/null || true
	while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
fi
echo "== kube-proxy --config /lab/kube-proxy/$1.yaml" >>` + KubeProxyLog + `
/usr/local/bin/kube-proxy --config "/lab/kube-proxy/$1.yaml" --v=1 >>` + KubeProxyLog + ` 2>&1 </dev/null &
echo $! >/tmp/kube-proxy.pid
`

// KubeProxyFiles writes kube-proxy's configuration for every mode and its
// start script into dir, and returns the VM files (the binary from the
// assets included). The node's kubelet files hold the kubeconfig.
func KubeProxyFiles(dir, nodeName, clusterCIDR string) (map[string]string, error) {
	bin := filepath.Join(kubeenv.AssetsDir(), "kube-proxy")
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("lab: no kube-proxy in the assets (make assets): %w", err)
	}
	files := map[string]string{"/usr/local/bin/kube-proxy": bin}
	contents := map[string]string{"start": kubeProxyStartScript}
	for _, mode := range KubeProxyModes {
		contents[mode+".yaml"] = fmt.Sprintf(kubeProxyConfig, nodeName, mode, clusterCIDR, KubeProxyMetricsPort, KubeProxyHealthzPort)
	}
	for name, data := range contents {
		p := filepath.Join(dir, "kube-proxy-"+name)
		if err := os.WriteFile(p, []byte(data), 0o755); err != nil {
			return nil, err
		}
		files[filepath.Dir(KubeProxyStart)+"/"+name] = p
	}
	return files, nil
}

// ServeKubernetesService gives the Service default/kubernetes the
// EndpointSlice the API server would reconcile, had kubeenv not turned its
// reconciler off: the API server on the host, as the VMs reach it through
// guestfwd (HostForwardAddr, apiPort). kube-proxy then forwards the
// Service's address there, where without it its nftables mode would reject
// the Service's connections (no endpoints).
func ServeKubernetesService(ctx context.Context, admin *rest.Config, apiPort int) error {
	kube, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return err
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "kubernetes", Namespace: metav1.NamespaceDefault, Labels: map[string]string{
			discoveryv1.LabelServiceName: "kubernetes", discoveryv1.LabelManagedBy: "lab.kube-service-tunnel",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{HostForwardAddr}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("https"), Port: ptr.To(int32(apiPort)), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	_, err = kube.DiscoveryV1().EndpointSlices(metav1.NamespaceDefault).Create(ctx, slice, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("lab: the kubernetes Service's EndpointSlice (port %s): %w", strconv.Itoa(apiPort), err)
	}
	return nil
}
