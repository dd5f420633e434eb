package runtime

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Labels that dockershim and cri-dockerd put on the containers of a pod. The
// sandbox (the "pause" container) owns the pod's network namespace.
const (
	dockerLabelType   = "io.kubernetes.docker.type"
	dockerTypeSandbox = "podsandbox"
	dockerLabelPodUID = "io.kubernetes.pod.uid"
)

// dockerAPI is the part of the Docker Engine API client the locator uses; a
// fake in the tests stands in for a daemon.
type dockerAPI interface {
	ContainerList(ctx context.Context, options container.ListOptions) ([]container.Summary, error)
	ContainerInspect(ctx context.Context, containerID string) (container.InspectResponse, error)
	Ping(ctx context.Context) (types.Ping, error)
	Close() error
}

// Docker finds a pod's network namespace through the Docker Engine API, for
// nodes whose kubelet runs pods on Docker (dockershim or cri-dockerd): the
// namespace is that of the pod's sandbox container.
type Docker struct {
	api      dockerAPI
	endpoint string
	procRoot string
}

var _ Locator = (*Docker)(nil)

// NewDocker returns a locator talking to the Docker daemon at endpoint, such as
// "unix:///var/run/docker.sock". The API version is negotiated with the daemon
// on the first request, so older daemons (API 1.41, Docker 20.10) work. It
// does not contact the daemon; use Ping to check that one answers.
func NewDocker(endpoint string) (*Docker, error) {
	cli, err := client.NewClientWithOpts(client.WithHost(endpoint), client.WithAPIVersionNegotiation())
	if err != nil {
		return nil, fmt.Errorf("docker client for %s: %w", endpoint, err)
	}
	return &Docker{api: cli, endpoint: endpoint, procRoot: "/proc"}, nil
}

// Name returns "docker".
func (d *Docker) Name() string { return "docker" }

// Ping checks that the Docker daemon answers, to detect the runtime of a node.
func (d *Docker) Ping(ctx context.Context) error {
	if _, err := d.api.Ping(ctx); err != nil {
		return fmt.Errorf("docker daemon at %s: %w", d.endpoint, err)
	}
	return nil
}

// Close closes the connection to the daemon.
func (d *Docker) Close() error { return d.api.Close() }

// Locate opens the network namespace of the pod's running sandbox container,
// through /proc/PID/ns/net of the sandbox's process. When several sandboxes of
// the pod run (a restart in progress), the most recently started wins. It
// returns an error wrapping ErrNotFound when no sandbox of the pod runs.
func (d *Docker) Locate(ctx context.Context, pod Pod) (Netns, error) {
	if pod.UID == "" {
		return Netns{}, fmt.Errorf("pod %s: no UID to look its docker sandbox up by", pod)
	}
	list, err := d.api.ContainerList(ctx, container.ListOptions{Filters: filters.NewArgs(
		filters.Arg("label", dockerLabelType+"="+dockerTypeSandbox),
		filters.Arg("label", dockerLabelPodUID+"="+pod.UID),
		filters.Arg("status", "running"),
	)})
	if err != nil {
		return Netns{}, fmt.Errorf("pod %s: listing docker sandbox containers: %w", pod, err)
	}
	var sandboxes []dockerSandbox
	for _, c := range list {
		// The filters above already select these; checking again costs
		// nothing and never trusts a daemon that ignored a filter.
		if c.Labels[dockerLabelType] != dockerTypeSandbox || c.Labels[dockerLabelPodUID] != pod.UID {
			continue
		}
		sb, err := d.inspect(ctx, c.ID)
		if cerrdefs.IsNotFound(err) {
			continue // removed since the list
		}
		if err != nil {
			return Netns{}, fmt.Errorf("pod %s: %w", pod, err)
		}
		sandboxes = append(sandboxes, sb)
	}
	sb, ok := newestRunningSandbox(sandboxes)
	if !ok {
		return Netns{}, NotFoundf("pod %s (uid %s): no running docker sandbox container", pod, pod.UID)
	}
	if sb.hostNetwork {
		return Netns{}, fmt.Errorf("pod %s: sandbox container %s: %w", pod, shortID(sb.id), ErrHostNetwork)
	}
	path := fmt.Sprintf("%s/%d/ns/net", d.procRoot, sb.pid)
	handle, err := netns.GetFromPath(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) {
		return Netns{}, NotFoundf("pod %s: sandbox container %s exited (pid %d gone)", pod, shortID(sb.id), sb.pid)
	}
	if err != nil {
		return Netns{}, fmt.Errorf("pod %s: opening network namespace of sandbox container %s: %w", pod, shortID(sb.id), err)
	}
	// The process may have died between inspect and open, and its PID been
	// reused by another process (in the host's namespace, say). Ask again
	// now that the namespace is held open: if the container still runs with
	// the same PID, the handle is its namespace.
	again, err := d.inspect(ctx, sb.id)
	switch {
	case cerrdefs.IsNotFound(err):
		handle.Close()
		return Netns{}, NotFoundf("pod %s: sandbox container %s removed while opening its namespace", pod, shortID(sb.id))
	case err != nil:
		handle.Close()
		return Netns{}, fmt.Errorf("pod %s: %w", pod, err)
	case !again.running || again.pid != sb.pid:
		handle.Close()
		return Netns{}, NotFoundf("pod %s: sandbox container %s stopped while opening its namespace", pod, shortID(sb.id))
	}
	return Netns{Handle: handle, Path: path, Via: "docker"}, nil
}

func (d *Docker) inspect(ctx context.Context, id string) (dockerSandbox, error) {
	info, err := d.api.ContainerInspect(ctx, id)
	if err != nil {
		return dockerSandbox{}, fmt.Errorf("inspecting docker container %s: %w", shortID(id), err)
	}
	return sandboxFromInspect(info), nil
}

// dockerSandbox is what the locator needs to know of a sandbox container.
type dockerSandbox struct {
	id          string
	running     bool
	pid         int
	startedAt   time.Time
	hostNetwork bool
}

func sandboxFromInspect(info container.InspectResponse) dockerSandbox {
	sb := dockerSandbox{}
	if info.ContainerJSONBase == nil {
		return sb
	}
	sb.id = info.ID
	if hc := info.HostConfig; hc != nil {
		sb.hostNetwork = hc.NetworkMode.IsHost()
	}
	if st := info.State; st != nil {
		sb.running = st.Running && !st.Paused && !st.Restarting
		sb.pid = st.Pid
		// An unparsable time stays zero and loses against any real one.
		sb.startedAt, _ = time.Parse(time.RFC3339Nano, st.StartedAt)
	}
	return sb
}

// newestRunningSandbox picks the sandbox a pod's namespace is taken from: of
// those running with a process, the one started last; equal start times are
// broken by container ID so the choice never depends on the daemon's order.
func newestRunningSandbox(sandboxes []dockerSandbox) (dockerSandbox, bool) {
	var best dockerSandbox
	found := false
	for _, sb := range sandboxes {
		if !sb.running || sb.pid <= 0 {
			continue
		}
		if !found || sb.startedAt.After(best.startedAt) ||
			(sb.startedAt.Equal(best.startedAt) && sb.id > best.id) {
			best, found = sb, true
		}
	}
	return best, found
}

func shortID(id string) string {
	id = strings.TrimPrefix(id, "sha256:")
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
