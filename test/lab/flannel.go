package lab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// Flannel on a lab node (issue 32): flanneld with its VXLAN backend and the
// kube subnet manager, run as its DaemonSet runs it (in the node's
// namespace, the kubeconfig of the node), and its CNI plugin, which
// delegates to the bridge plugin (cni0) with the node's subnet and MTU from
// /run/flannel/subnet.env. Both are built by test/tools/kube-assets.sh.

// The versions test/tools/kube-assets.sh builds (FLANNEL_VERSION,
// FLANNEL_CNI_VERSION).
const (
	FlannelVersion    = "v0.28.10"
	FlannelCNIVersion = "v0.9.1"
	// FlannelLog is flanneld's log in the VM.
	FlannelLog = "/tmp/flanneld.log"
	// FlannelDevice is flannel's VXLAN device.
	FlannelDevice = "flannel.1"
)

// FlannelModules are the kernel modules flannel needs: its VXLAN backend's,
// and br_netfilter, without which flanneld exits at start (it checks
// net.bridge.bridge-nf-call-iptables, as kubeadm's preflight does).
var FlannelModules = []string{"vxlan", "br_netfilter"}

// FlannelHostBinaries are the CNI plugins kube-flannel.yml's configuration
// names beside flannel's own (which delegates to bridge and host-local).
var FlannelHostBinaries = []string{"/usr/lib/cni/portmap"}

// FlannelCNIConfig is kube-flannel.yml's cni-conf.json.
const FlannelCNIConfig = `{"name":"cbr0","cniVersion":"0.3.1","plugins":[
 {"type":"flannel","delegate":{"hairpinMode":true,"isDefaultGateway":true}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}
`

// flannelNetConfig is kube-flannel.yml's net-conf.json for network.
const flannelNetConfig = `{"Network":%q,"EnableIPv6":false,"Backend":{"Type":"vxlan"}}
`

// FlannelScript starts flanneld in the background once the kubelet is
// started (source it after KubeletScript), with kube-flannel.yml's
// arguments, on iface; it is restarted should it exit (as its pod would
// be). One argument differs: flanneld checks its iptables rules every 5 s
// by default, with a few iptables processes each time, which on the lab's
// emulated CPUs took a core's fifth; it checks every 60 s here.
func FlannelScript(iface string) string {
	return fmt.Sprintf(`mkdir -p /run/flannel
(while true; do
	NODE_NAME="$(cat /lab/kubelet/node-name)" POD_NAME=kube-flannel-lab POD_NAMESPACE=kube-flannel \
		/usr/local/bin/flanneld --ip-masq --kube-subnet-mgr --kubeconfig-file=/lab/kubelet/kubeconfig \
		--iface=%s --net-config-path=/lab/flannel/net-conf.json --iptables-resync=60 >>%s 2>&1
	echo "flanneld exited: $?" >>%[2]s
	sleep 1
done) &
`, iface, FlannelLog)
}

// FlannelFiles writes net-conf.json for network into dir and returns the
// VM files: flanneld, the flannel CNI plugin (both from the assets) and
// the configuration.
func FlannelFiles(dir, network string) (map[string]string, error) {
	assets := kubeenv.AssetsDir()
	files := map[string]string{
		"/usr/local/bin/flanneld": filepath.Join(assets, "flanneld-"+FlannelVersion),
		"/usr/lib/cni/flannel":    filepath.Join(assets, "flannel-cni-"+FlannelCNIVersion),
	}
	for _, p := range files {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("lab: no flannel in the assets (make assets): %w", err)
		}
	}
	p := filepath.Join(dir, "net-conf.json")
	if err := os.WriteFile(p, []byte(fmt.Sprintf(flannelNetConfig, network)), 0o644); err != nil {
		return nil, err
	}
	files["/lab/flannel/net-conf.json"] = p
	return files, nil
}

// CreateNode creates the Node name with its pod range before its kubelet
// registers it (which then only updates it), as a controller-manager that
// allocates node CIDRs would set it: flannel's kube subnet manager reads
// the node's subnet from spec.podCIDR.
func CreateNode(ctx context.Context, admin *rest.Config, name, podCIDR string) error {
	kube, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return err
	}
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}},
		Spec: corev1.NodeSpec{PodCIDR: podCIDR, PodCIDRs: []string{podCIDR}}}
	if _, err := kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("lab: creating node %s with pod range %s: %w", name, podCIDR, err)
	}
	return nil
}
