package lab

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"k8s.io/client-go/rest"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// A real node in the VM: Debian's containerd (with its CRI plugin), runc and
// CNI plugins (bridge, host-local, loopback), and a real kubelet built like
// kube-apiserver (test/tools/kube-assets.sh), registering with the API server
// on the host through guestfwd. It is the first piece of the lab cluster a
// kubelet runs (issue 16); see TestLabKubelet for its figures.

// KubeletHostBinaries are the host programs a kubelet node needs in the VM
// (install them with make deps).
// util-linux's mount makes /run a shared mount (busybox's cannot).
var KubeletHostBinaries = []string{
	"/usr/bin/containerd", "/usr/bin/containerd-shim-runc-v2", "/usr/sbin/runc", "/usr/bin/ctr",
	"/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/lib/cni/loopback", "/usr/bin/mount",
}

// KubeletModules are DefaultModules plus NAT, for KubernetesServiceDNAT,
// and overlay, for containerd's overlayfs snapshotter.
var KubeletModules = append(slices.Clone(DefaultModules), "nf_nat", "nft_chain_nat", "xt_nat", "iptable_nat", "overlay",
	// iptables-legacy's filter tables (the agents' policy chains), as a node has them
	// on disk: the cluster runs one mode on that backend.
	"iptable_filter", "ip6table_filter")

// SandboxImage is the image containerd uses as every pod's sandbox (no
// registry can give the pause image): a static busybox whose entrypoint
// sleeps. Pods may run it too.
const SandboxImage = "lab/busybox:1"

// KubeletOptions describe one kubelet node.
type KubeletOptions struct {
	// NodeName is the Node's name; NodeIP its address (the VM's eth0).
	NodeName, NodeIP string
	// PodCIDR is the range the CNI bridge gives pods.
	PodCIDR string
	// CNIConfig is the node's CNI configuration list; empty: the bridge
	// plugin with host-local addresses from PodCIDR.
	CNIConfig string
	// Admin is a configuration of the API server on the host's loopback;
	// the kubelet reaches it through guestfwd, as admin.
	Admin *rest.Config
	// Images are more image archives (make image's) imported into the
	// node's containerd before the kubelet starts.
	Images []string
	// LateImages are imported after Images, in the background, for pods
	// that start minutes later (the uninstall's on a worker): the two VMs
	// share the host's cores, so an import one node does not need yet
	// slows the other node's start-up.
	LateImages []string
}

// containerdConfig is containerd 1.6's: the overlayfs snapshotter (on a
// tmpfs: overlayfs cannot use the initramfs as its upper layer) and runc
// without pivot_root (the VM's root is the initramfs, which pivot_root
// cannot leave). The native snapshotter it replaced copies an image's whole
// tree for every container, which under TCG took seconds per pod.
const containerdConfig = `version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/%s"
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        NoPivotRoot = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
`

const cniConfig = `{"cniVersion":"0.4.0","name":"lab","plugins":[
 {"type":"bridge","bridge":"cni0","isGateway":true,"ipMasq":false,
  "ipam":{"type":"host-local","ranges":[[{"subnet":"%s"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}
`

// kubeletConfig turns off what needs a full OS: QoS cgroups, node
// allocatable enforcement, evictions, image garbage collection, resolv.conf.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
resolvConf: ""
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
cgroupsPerQOS: false
enforceNodeAllocatable: []
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
`

// KubeletScript starts containerd, imports the sandbox image, starts the
// kubelet in the background (it registers the node meanwhile) and imports
// the other images, all at once; it prints "T NAME SECONDS" lines (seconds since the
// VM's boot) for the figures. Source it from /lab/run.sh: what follows it
// runs once every image but the late ones is there; those are imported
// meanwhile.
//
// /run is made a shared mount, as systemd makes every mount: a container's
// mountPropagation HostToContainer needs it (the endpoint agent's /run).
const KubeletScript = `up() { cut -d' ' -f1 /proc/uptime; }
/usr/bin/mount --make-rshared /run || echo "FAIL mount --make-rshared /run"
mount -t cgroup2 none /sys/fs/cgroup
echo "+cpuset +cpu +io +memory +pids" > /sys/fs/cgroup/cgroup.subtree_control
mkdir -p /var/lib/containerd /etc/cni/net.d /var/lib/kubelet /var/log/pods
mount -t tmpfs tmpfs /var/lib/containerd || echo "FAIL mount tmpfs /var/lib/containerd"
cp /lab/kubelet/10-lab.conflist /etc/cni/net.d/
hostname "$(cat /lab/kubelet/node-name)"
echo 0123456789abcdef0123456789abcdef > /etc/machine-id
containerd --config /lab/kubelet/containerd.toml > /tmp/containerd.log 2>&1 &
until ctr version >/dev/null 2>&1; do sleep 0.2; done
echo "T containerd-up $(up)"
import_image() {
	ctr -n k8s.io images import --snapshotter overlayfs "$1" >/dev/null || echo "FAIL import $1"
	echo "T imported-$(basename "$1" .tar) $(up)"
}
import_image /lab/kubelet/images/sandbox.tar
/usr/local/bin/kubelet --config /lab/kubelet/kubelet.yaml --kubeconfig /lab/kubelet/kubeconfig \
	--hostname-override "$(cat /lab/kubelet/node-name)" --node-ip "$(cat /lab/kubelet/node-ip)" --v=1 > /tmp/kubelet.log 2>&1 &
echo "T kubelet-started $(up)"
imports=""
for a in /lab/kubelet/images/*.tar; do
	[ "$a" = /lab/kubelet/images/sandbox.tar ] && continue
	import_image "$a" &
	imports="$imports $!"
done
# A bare wait would wait for containerd and the kubelet too.
[ -z "$imports" ] || wait $imports
echo "T images-imported $(up)"
for a in /lab/kubelet/late-images/*.tar; do
	[ -e "$a" ] && import_image "$a" &
done
`

// KubernetesServiceDNAT stands in for kube-proxy (which only the lab
// cluster runs, beside this rule) for
// the one Service the daemons use, default/kubernetes (10.96.0.1:443, the
// first address of kubeenv's range): a route for the Service range and a
// DNAT rule to the API server on the host, reached through guestfwd on
// apiPort. Pods' in-cluster configuration then works as on a real node.
func KubernetesServiceDNAT(apiPort int) string {
	return fmt.Sprintf(`/sbin/ip route add %s dev eth0
iptables -t nat -A OUTPUT -d 10.96.0.1/32 -p tcp --dport 443 -j DNAT --to-destination %s:%d || echo "FAIL kubernetes Service DNAT"
`, kubeenv.ServiceClusterIPRange, HostForwardAddr, apiPort)
}

// KubeletFiles writes the node's configuration and sandbox image into dir
// and returns the VM files for InitramfsOptions.Files (the kubelet binary
// from the assets included).
func KubeletFiles(dir string, o KubeletOptions) (map[string]string, error) {
	kubelet := filepath.Join(kubeenv.AssetsDir(), "kubelet")
	if _, err := os.Stat(kubelet); err != nil {
		return nil, fmt.Errorf("lab: no kubelet in the assets (make assets): %w", err)
	}
	files := map[string]string{"/usr/local/bin/kubelet": kubelet}
	sandbox := filepath.Join(dir, "sandbox.tar")
	if err := writeSandboxImage(sandbox); err != nil {
		return nil, err
	}
	files["/lab/kubelet/images/sandbox.tar"] = sandbox
	for _, a := range o.Images {
		files["/lab/kubelet/images/"+filepath.Base(a)] = a
	}
	for _, a := range o.LateImages {
		files["/lab/kubelet/late-images/"+filepath.Base(a)] = a
	}
	kc := rest.CopyConfig(o.Admin)
	kc.Host = "https://" + HostForwardAddr + ":" + o.Admin.Host[strings.LastIndex(o.Admin.Host, ":")+1:]
	kc.Insecure, kc.CAData, kc.CAFile = true, nil, ""
	config := kubeconfigFile(kc)
	cni := o.CNIConfig
	if cni == "" {
		cni = fmt.Sprintf(cniConfig, o.PodCIDR)
	}
	for name, data := range map[string]string{
		"containerd.toml": fmt.Sprintf(containerdConfig, SandboxImage),
		"10-lab.conflist": cni,
		"kubelet.yaml":    kubeletConfig,
		"node-name":       o.NodeName,
		"node-ip":         o.NodeIP,
		"kubeconfig":      config,
	} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			return nil, err
		}
		files["/lab/kubelet/"+name] = p
	}
	return files, nil
}

// kubeconfigFile is a kubeconfig for cfg's server and bearer token.
func kubeconfigFile(cfg *rest.Config) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: lab, cluster: {server: %q, insecure-skip-tls-verify: true}}]
users: [{name: lab, user: {token: %q}}]
contexts: [{name: lab, context: {cluster: lab, user: lab}}]
current-context: lab
`, cfg.Host, cfg.BearerToken)
}

// writeSandboxImage writes SandboxImage: the host's static busybox, run as
// "busybox sleep" for ever.
func writeSandboxImage(path string) error {
	return WriteBusyboxImage(path, SandboxImage, []string{"sleep", "2147483647"})
}

// BusyboxApplets are the commands a lab busybox image has in /bin.
var BusyboxApplets = []string{"sh", "nc", "cat", "echo", "hostname", "sleep", "ls", "ip", "wget"}

// ExampleImage is the image examples/echo.yaml names. No registry can give
// it in the lab, so the lab imports a busybox image of that name built from
// the host's static busybox (BusyboxApplets in /bin).
const ExampleImage = "busybox:1.36"

// WriteBusyboxImage writes an image archive named ref holding the host's
// static busybox with BusyboxApplets linked in /bin, whose default command
// is cmd.
func WriteBusyboxImage(path, ref string, cmd []string) error {
	busybox := busyboxPath()
	links := image.Tree{"/bin": {Path: "/bin", Mode: fs.ModeDir | 0o755}}
	for _, a := range BusyboxApplets {
		links["/bin/"+a] = image.Entry{Path: "/bin/" + a, Target: "/usr/local/bin/" + filepath.Base(busybox), Mode: fs.ModeSymlink | 0o777}
	}
	img, err := image.Build(image.Spec{Ref: ref, Binary: busybox, Runtime: links, Created: time.Unix(0, 0)})
	if err != nil {
		return err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.Config.Cmd = cmd
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return err
	}
	return image.WriteArchive(path, ref, img, time.Unix(0, 0))
}
