package runtime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netns"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// criPodUIDLabel is the label the kubelet puts on every pod sandbox it asks a
// CRI runtime for; its value is the pod's metadata.uid.
const criPodUIDLabel = "io.kubernetes.pod.uid"

// criMaxMsgSize bounds a CRI response. A busy node's ListPodSandbox can exceed
// gRPC's 4 MiB default; the kubelet allows 16 MiB too.
const criMaxMsgSize = 16 << 20

// CRI is a Locator for runtimes that speak the Kubernetes Container Runtime
// Interface (containerd, CRI-O). It asks the runtime for the pod's ready
// sandbox and opens that sandbox's network namespace.
type CRI struct {
	endpoint string
	conn     *grpc.ClientConn
	client   runtimeapi.RuntimeServiceClient
}

var _ Locator = (*CRI)(nil)

// NewCRI connects to the CRI runtime service at endpoint, a unix socket given
// as "unix:///run/containerd/containerd.sock" (a bare absolute path is
// accepted too). It calls Version, so a wrong or dead socket fails here, with
// the endpoint in the error, rather than on the first pod.
func NewCRI(ctx context.Context, endpoint string) (*CRI, error) {
	target, err := criTarget(endpoint)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(criMaxMsgSize)),
	)
	if err != nil {
		return nil, fmt.Errorf("cri %s: %w", endpoint, err)
	}
	c := &CRI{endpoint: endpoint, conn: conn, client: runtimeapi.NewRuntimeServiceClient(conn)}
	// A runtime that answers the v1 Version call speaks CRI v1.
	if _, err := c.client.Version(ctx, &runtimeapi.VersionRequest{}); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("cri %s: runtime does not answer CRI v1 Version (is it running, and is this its CRI socket?): %w", endpoint, err)
	}
	return c, nil
}

// criTarget turns a CRI endpoint into a gRPC target. Only unix sockets are
// accepted: a CRI runtime on Linux listens on nothing else.
func criTarget(endpoint string) (string, error) {
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		if len(endpoint) == len("unix://") {
			return "", fmt.Errorf("cri endpoint %q has no socket path", endpoint)
		}
		return endpoint, nil
	case strings.HasPrefix(endpoint, "/"):
		return "unix://" + endpoint, nil
	default:
		return "", fmt.Errorf("cri endpoint %q: want unix:///path/to/socket", endpoint)
	}
}

// Name returns "cri".
func (c *CRI) Name() string { return "cri" }

// Close closes the connection to the runtime.
func (c *CRI) Close() error { return c.conn.Close() }

// Locate opens the network namespace of the pod's newest ready sandbox. It
// returns an error wrapping ErrNotFound when the runtime has no ready sandbox
// for pod.UID, and refuses a sandbox that runs in the host's network
// namespace.
func (c *CRI) Locate(ctx context.Context, pod Pod) (Netns, error) {
	if pod.UID == "" {
		return Netns{}, fmt.Errorf("cri %s: pod %s: no UID to look its sandbox up by", c.endpoint, pod)
	}
	list, err := c.client.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{
		Filter: &runtimeapi.PodSandboxFilter{
			State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
			LabelSelector: map[string]string{criPodUIDLabel: pod.UID},
		},
	})
	if err != nil {
		return Netns{}, fmt.Errorf("cri %s: pod %s: listing sandboxes: %w", c.endpoint, pod, err)
	}
	sb := criNewestReady(list.GetItems(), pod.UID)
	if sb == nil {
		return Netns{}, NotFoundf("cri %s: no ready sandbox for pod %s (uid %s)", c.endpoint, pod, pod.UID)
	}
	wrap := func(err error) error {
		return fmt.Errorf("cri %s: pod %s sandbox %s: %w", c.endpoint, pod, sb.GetId(), err)
	}

	st, err := c.client.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sb.GetId(), Verbose: true})
	if status.Code(err) == codes.NotFound {
		// Removed between the list and the status call.
		return Netns{}, wrap(NotFoundf("sandbox is gone: %v", err))
	}
	if err != nil {
		return Netns{}, wrap(fmt.Errorf("sandbox status: %w", err))
	}
	if s := st.GetStatus().GetState(); s != runtimeapi.PodSandboxState_SANDBOX_READY {
		return Netns{}, wrap(NotFoundf("sandbox is %s", s))
	}
	if st.GetStatus().GetLinux().GetNamespaces().GetOptions().GetNetwork() == runtimeapi.NamespaceMode_NODE {
		return Netns{}, wrap(ErrHostNetwork)
	}
	path, err := criNetnsPath(st.GetInfo())
	if err != nil {
		return Netns{}, wrap(err)
	}
	h, err := openHostPath(path)
	if errors.Is(err, os.ErrNotExist) {
		// Not ErrNotFound: the runtime says the sandbox is ready, so a
		// missing path is more likely a deployment error than a race.
		return Netns{}, wrap(fmt.Errorf("opening network namespace %s: %w (the agent needs the host's /run/netns, /var/run/netns mounted with HostToContainer propagation, and hostPID for /proc/PID paths)", path, err))
	}
	if err != nil {
		return Netns{}, wrap(fmt.Errorf("opening network namespace %s: %w", path, err))
	}
	// Last line of defence: whatever the runtime said, never hand out the
	// namespace this process runs in (the agent runs with hostNetwork).
	if err := criRefuseOwnNetns(h); err != nil {
		_ = h.Close()
		return Netns{}, wrap(fmt.Errorf("%s: %w", path, err))
	}
	return Netns{Handle: h, Path: path, Via: c.Name()}, nil
}

// criNewestReady picks, among sandboxes the runtime returned, the newest
// ready one labelled with uid. The runtime was asked to filter already; this
// checks again so a runtime that ignores the filter cannot hand out another
// pod's sandbox. Several ready sandboxes for one pod happen briefly while the
// kubelet replaces a dead sandbox; the newest is the one that will live.
func criNewestReady(items []*runtimeapi.PodSandbox, uid string) *runtimeapi.PodSandbox {
	var newest *runtimeapi.PodSandbox
	for _, sb := range items {
		if sb.GetState() != runtimeapi.PodSandboxState_SANDBOX_READY || sb.GetLabels()[criPodUIDLabel] != uid {
			continue
		}
		if newest == nil || sb.GetCreatedAt() > newest.GetCreatedAt() {
			newest = sb
		}
	}
	return newest
}

// criSandboxInfo is the part of PodSandboxStatusResponse.Info["info"] (a JSON
// document, returned when Verbose is set) that names the sandbox's network
// namespace. The field names are the runtimes' own:
//
//   - containerd 1.x, pkg/cri/server/sandbox_status.go (SandboxInfo), and 2.x,
//     internal/cri/server/podsandbox/types/sandbox_info.go: "pid",
//     "netNamespaceClosed", "config" (the CRI PodSandboxConfig) and
//     "runtimeSpec" (the OCI spec of the sandbox container, whose
//     linux.namespaces holds {"type": "network", "path": "/var/run/netns/cni-..."}).
//   - CRI-O, server/sandbox_status.go (createSandboxInfo): "image", "pid" and
//     "runtimeSpec"; with the infra container dropped (the default) only
//     "runtimeSpec", whose network namespace path is CRI-O's pinned namespace.
type criSandboxInfo struct {
	Pid                int  `json:"pid"`
	NetNamespaceClosed bool `json:"netNamespaceClosed"`
	Config             *struct {
		Linux *struct {
			SecurityContext *struct {
				NamespaceOptions *struct {
					Network runtimeapi.NamespaceMode `json:"network"`
				} `json:"namespace_options"`
			} `json:"security_context"`
		} `json:"linux"`
	} `json:"config"`
	RuntimeSpec *struct {
		Linux *struct {
			Namespaces []struct {
				Type string `json:"type"`
				Path string `json:"path"`
			} `json:"namespaces"`
		} `json:"linux"`
	} `json:"runtimeSpec"`
}

// criNetnsPath reads the verbose info of a sandbox status and returns the path
// of the sandbox's network namespace: the path in the OCI runtime spec when
// there is one, else /proc/PID/ns/net of the sandbox's process. It refuses a
// sandbox that shares the host's network namespace, and reports a closed
// namespace as ErrNotFound.
func criNetnsPath(info map[string]string) (string, error) {
	raw, ok := info["info"]
	if !ok || strings.TrimSpace(raw) == "" {
		return "", errors.New(`runtime returned no verbose sandbox info (Info["info"] is empty)`)
	}
	var si criSandboxInfo
	if err := json.Unmarshal([]byte(raw), &si); err != nil {
		return "", fmt.Errorf(`parsing verbose sandbox info (Info["info"]) as JSON: %w`, err)
	}
	if c := si.Config; c != nil && c.Linux != nil && c.Linux.SecurityContext != nil &&
		c.Linux.SecurityContext.NamespaceOptions != nil &&
		c.Linux.SecurityContext.NamespaceOptions.Network == runtimeapi.NamespaceMode_NODE {
		return "", ErrHostNetwork
	}
	if si.NetNamespaceClosed {
		return "", NotFoundf("the sandbox's network namespace is already closed")
	}
	if si.RuntimeSpec != nil && si.RuntimeSpec.Linux != nil {
		for _, ns := range si.RuntimeSpec.Linux.Namespaces {
			if ns.Type != "network" {
				continue
			}
			if ns.Path != "" {
				return ns.Path, nil
			}
			// A network namespace without a path is one the OCI runtime
			// created for the sandbox process: reach it through the process.
			return criProcNetns(si.Pid)
		}
		// An OCI spec that lists namespaces but no network namespace runs
		// the sandbox in the runtime's own, that is the host's, namespace.
		return "", ErrHostNetwork
	}
	return criProcNetns(si.Pid)
}

func criProcNetns(pid int) (string, error) {
	if pid <= 0 {
		return "", errors.New("verbose sandbox info has neither a network namespace path nor a sandbox pid")
	}
	return "/proc/" + strconv.Itoa(pid) + "/ns/net", nil
}

// criStartNetns identifies the network namespace this process started in.
// It is read while the package initialises, on the main thread, before any
// code can move a thread elsewhere. Reading /proc/self/ns/net later is not
// the same: it names the main thread's namespace, and the Go runtime never
// terminates the main thread, so a goroutine that locked it and switched it
// into another namespace (see internal/nsexec) leaves it there for good.
var criStartNetns, criStartNetnsErr = nsIDOfPath("/proc/thread-self/ns/net")

// criRefuseOwnNetns returns ErrHostNetwork when h is the network namespace
// this process started in, or PID 1's (the host's, when the agent sees the
// host's processes) when that can be read.
func criRefuseOwnNetns(h netns.NsHandle) error {
	if criStartNetnsErr != nil {
		return fmt.Errorf("cannot tell the host's network namespace apart: %w", criStartNetnsErr)
	}
	id, err := nsIDOf(h)
	if err != nil {
		return fmt.Errorf("the opened namespace: %w", err)
	}
	if id == criStartNetns {
		return ErrHostNetwork
	}
	if init, err := nsIDOfPath("/proc/1/ns/net"); err == nil && id == init {
		return ErrHostNetwork
	}
	return nil
}

// openHostPath opens a network namespace by the path a runtime gave, as the
// node names it. The runtimes name /var/run/netns/cni-...; on the node
// /var/run is /run, but in the agent's image /var/run is a directory of its
// own (the kubelet mounts the ServiceAccount token under it, which must not
// land in the node's /run, mounted read-only), so such a path is also
// tried under /run.
func openHostPath(path string) (netns.NsHandle, error) {
	h, err := netns.GetFromPath(path)
	if rest, ok := strings.CutPrefix(path, "/var/run/"); ok && errors.Is(err, os.ErrNotExist) {
		if h2, err2 := netns.GetFromPath("/run/" + rest); err2 == nil {
			return h2, nil
		}
	}
	return h, err
}
