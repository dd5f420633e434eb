package lab

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// Calico on a lab node (issue 32): calico-node run as its DaemonSet's
// container runs it (calico-vxlan.yaml: the startup, the tunnel-address
// allocator and Felix with its iptables dataplane; VXLAN between the nodes,
// so no BGP daemon), in the node's namespace, and Calico's CNI and IPAM
// plugins. All of it is built by test/tools/kube-assets.sh from the module
// proxy; the CRDs come from the same commit's manifests/crds.yaml. The lab
// gives calico-node and the CNI plugin the node's admin kubeconfig
// instead of the manifest's ServiceAccounts (the lab tests the product's
// grants, not Calico's), and runs no calico-kube-controllers (it only
// garbage-collects).

// CalicoVersion is the release test/tools/kube-assets.sh builds
// (CALICO_VERSION).
const CalicoVersion = "v3.31.0"

const (
	// CalicoLog is calico-node's log in the VM (startup, the tunnel-address
	// allocator and Felix).
	CalicoLog = "/tmp/calico-node.log"
	// CalicoDevice is Calico's VXLAN device.
	CalicoDevice = "vxlan.calico"
	// CalicoHealthPort serves Felix's /readiness (on every address of the
	// node in the lab, FELIX_HEALTHHOST=0.0.0.0, so that the other node
	// can ask): ready once Felix has programmed its dataplane.
	CalicoHealthPort = 9099
	// CalicoCNILog is the CNI plugin's log.
	CalicoCNILog = "/var/log/calico/cni/cni.log"
)

// CalicoModules are the kernel modules Felix's iptables dataplane and the
// VXLAN backend need beyond a kubelet node's: ipsets and their iptables
// match, the reverse-path match of Felix's workload source check, and
// VXLAN.
var CalicoModules = []string{"vxlan", "ip_set", "ip_set_hash_ip", "ip_set_hash_net", "ip_set_hash_ipport", "ip_set_hash_netport",
	"ip_set_hash_ipportip", "ip_set_hash_netnet", "ip_set_bitmap_port", "xt_set", "ipt_rpfilter", "ip6t_rpfilter", "xt_mark", "xt_multiport"}

// CalicoHostBinaries are the host programs Felix runs (ipset, Debian's
// ipset package) and the portmap plugin its CNI configuration names.
var CalicoHostBinaries = []string{"/usr/sbin/ipset", "/usr/lib/cni/portmap"}

// CalicoCNIConfig is calico-vxlan.yaml's cni_network_config as its
// install-cni container writes it: the node name from the file
// calico-node's startup writes, the MTU Felix detects (0), the lab's
// kubeconfig.
const CalicoCNIConfig = `{"name":"k8s-pod-network","cniVersion":"0.3.1","plugins":[
 {"type":"calico","log_level":"info","log_file_path":"` + CalicoCNILog + `","datastore_type":"kubernetes","mtu":0,
  "ipam":{"type":"calico-ipam"},"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":"/lab/kubelet/kubeconfig"}},
 {"type":"portmap","snat":true,"capabilities":{"portMappings":true}}]}
`

// CalicoScript starts calico-node in the background once the kubelet is
// started (source it after KubeletScript), with calico-vxlan.yaml's
// environment: a VXLAN pool of network, the node's address from iface.
// One switch differs: calico-node is built without cgo here, so its libbpf
// is a stub that panics; with the iptables dataplane Felix calls it only to
// remove the connect-time load balancer of an earlier BPF dataplane, which
// never ran here, and FELIX_DebugSkipCTLBCleanup (Calico's own switch for
// its functional tests) skips that. Its startup runs until it succeeds; the tunnel-address allocator and
// Felix are restarted should they exit (as runit restarts them in the
// image).
func CalicoScript(iface, network string) string {
	return fmt.Sprintf(`mkdir -p /var/run/calico /var/lib/calico /var/log/calico/cni
ln -sf calico /usr/lib/cni/calico-ipam
(export DATASTORE_TYPE=kubernetes KUBECONFIG=/lab/kubelet/kubeconfig NODENAME="$(cat /lab/kubelet/node-name)" \
	CLUSTER_TYPE=k8s CALICO_NETWORKING_BACKEND=vxlan IP=autodetect IP_AUTODETECTION_METHOD=interface=%s \
	CALICO_IPV4POOL_CIDR=%s CALICO_IPV4POOL_VXLAN=Always CALICO_IPV4POOL_IPIP=Never \
	CALICO_DISABLE_FILE_LOGGING=true FELIX_DEFAULTENDPOINTTOHOSTACTION=ACCEPT FELIX_IPV6SUPPORT=false \
	FELIX_HEALTHENABLED=true FELIX_HEALTHHOST=0.0.0.0 FELIX_LOGSEVERITYSCREEN=info FELIX_DebugSkipCTLBCleanup=true
export FELIX_FELIXHOSTNAME="$NODENAME"
until /usr/local/bin/calico-node -startup; do echo "calico-node -startup exited: $?"; sleep 2; done
(while true; do /usr/local/bin/calico-node -allocate-tunnel-addrs; echo "allocate-tunnel-addrs exited: $?"; sleep 1; done) &
while true; do /usr/local/bin/calico-node -felix; echo "felix exited: $?"; sleep 1; done) >>%s 2>&1 &
`, iface, network, CalicoLog)
}

// CalicoFiles returns the VM files: calico-node and the CNI plugin (from
// the assets).
func CalicoFiles() (map[string]string, error) {
	assets := kubeenv.AssetsDir()
	files := map[string]string{
		"/usr/local/bin/calico-node": filepath.Join(assets, "calico-node-"+CalicoVersion),
		"/usr/lib/cni/calico":        filepath.Join(assets, "calico-cni-"+CalicoVersion),
	}
	for _, p := range files {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("lab: no calico in the assets (make assets): %w", err)
		}
	}
	return files, nil
}

// CalicoCRDs is Calico's manifests/crds.yaml of the same commit, which
// test/tools/kube-assets.sh copies into the assets.
func CalicoCRDs() ([]byte, error) {
	b, err := os.ReadFile(filepath.Join(kubeenv.AssetsDir(), "calico-crds-"+CalicoVersion+".yaml"))
	if err != nil {
		return nil, fmt.Errorf("lab: no calico CRDs in the assets (make assets): %w", err)
	}
	return b, nil
}
