// Package testcri runs a private, real containerd with its CRI plugin for
// tests of the CRI locator, and makes real pod sandboxes in it through the
// CRI API, as the kubelet would. It is imported only by _test.go files.
//
// Nothing it does touches the host's links, routes or iptables: containerd
// gets its own root, state and socket in a short temporary folder, its CNI
// configuration holds only a test plugin (written here) that puts an eth0
// inside the sandbox's new namespace, and the sandbox image is built
// locally from a static busybox (no registry is reachable in the lab).
// Everything is torn down when the test ends, and leftovers (shims, mounts)
// fail the test.
package testcri

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/leftover"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// SandboxImage is the reference under which the locally built sandbox image
// is imported and configured as containerd's sandbox_image.
const SandboxImage = "docker.io/kst-test/pause:1"

// PodUIDLabel is the label the kubelet sets on a sandbox to the pod's UID.
const PodUIDLabel = "io.kubernetes.pod.uid"

// cniPlugin is the only CNI plugin of the private containerd. containerd's
// CRI plugin insists on an eth0 with an IP in the CNI result, and every
// Debian CNI plugin that makes one (bridge, ptp, macvlan, ...) also changes
// the host. This one creates eth0 inside the new namespace only: a veth pair
// with both ends there (this lab's kernel has no dummy driver), the peer
// named kst-peer.
const cniPlugin = `#!/bin/sh
# kst-veth: test CNI plugin written by test/support/testcri. It gives the pod
# sandbox an eth0 with a fixed address (a veth pair with both ends inside the
# sandbox's own network namespace); it never touches the host namespace.
set -e
case "$CNI_COMMAND" in
VERSION)
	echo '{"cniVersion":"0.4.0","supportedVersions":["0.3.0","0.3.1","0.4.0"]}'
	;;
ADD)
	cat >/dev/null
	nsenter --net="$CNI_NETNS" ip link add "$CNI_IFNAME" type veth peer name kst-peer
	nsenter --net="$CNI_NETNS" ip link set kst-peer up
	nsenter --net="$CNI_NETNS" ip addr add 10.253.0.2/32 dev "$CNI_IFNAME"
	nsenter --net="$CNI_NETNS" ip link set "$CNI_IFNAME" up
	printf '{"cniVersion":"0.4.0","interfaces":[{"name":"%s","sandbox":"%s"}],"ips":[{"version":"4","address":"10.253.0.2/32","interface":0}]}\n' "$CNI_IFNAME" "$CNI_NETNS"
	;;
DEL)
	cat >/dev/null
	if [ -n "$CNI_NETNS" ] && [ -e "$CNI_NETNS" ]; then
		nsenter --net="$CNI_NETNS" ip link del "$CNI_IFNAME" 2>/dev/null || true
	fi
	;;
*)
	cat >/dev/null
	;;
esac
`

const cniConflist = `{"cniVersion":"0.4.0","name":"kst-test","plugins":[{"type":"kst-veth"}]}
`

// configTemplate is a containerd 1.6 (config version 2) configuration. %[1]s
// is the private folder. The netns of each sandbox is mounted under the state
// folder rather than /var/run/netns, so nothing of it lands on the host's
// usual paths and leftovers are easy to find.
const configTemplate = `version = 2
root = "%[1]s/root"
state = "%[1]s/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.tracing",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "%[1]s/c.sock"
[ttrpc]
  address = "%[1]s/c.sock.ttrpc"
[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "%[1]s/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "%[2]s"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  disable_apparmor = true
  # The sandbox asks for oom_score_adj -998; lowering it needs
  # CAP_SYS_RESOURCE, which a root in a container may lack (runc then dies
  # with "can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "%[1]s/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "%[1]s/cni/bin"
    conf_dir = "%[1]s/cni/conf"
`

// Containerd is a private containerd daemon with its CRI plugin enabled. Its
// methods report failures to the test given to Start.
type Containerd struct {
	// Dir holds its configuration, root, state, sockets and log.
	Dir string
	// Endpoint is its CRI endpoint, "unix://DIR/c.sock".
	Endpoint string
	// Runtime is a CRI runtime service client, as the kubelet uses.
	Runtime runtimeapi.RuntimeServiceClient

	tb     testing.TB
	socket string
	// cgroupParent holds every sandbox's cgroup (runc creates it in each
	// hierarchy); removed when the test ends.
	cgroupParent string
	cmd          *exec.Cmd
	exited       chan struct{}
	conn         *grpc.ClientConn
	image        runtimeapi.ImageServiceClient
}

// requirement is a binary the private containerd needs.
type requirement struct{ name, why string }

var requirements = []requirement{
	{"containerd", "the daemon (apt-get install containerd)"},
	{"containerd-shim-runc-v2", "containerd's runc shim"},
	{"ctr", "to import the sandbox image"},
	{"runc", "the OCI runtime"},
	{"nsenter", "used by the test CNI plugin"},
	{"ip", "used by the test CNI plugin"},
}

// loopbackPaths are where the standard loopback CNI plugin may live; the
// CRI plugin always runs it to bring lo up in a new sandbox.
var loopbackPaths = []string{"/usr/lib/cni/loopback", "/opt/cni/bin/loopback"}

// Start starts a private containerd with its CRI plugin, imports the sandbox
// image and waits until the CRI plugin reports its network ready. It stops
// everything when the test ends. It skips the test when not root or when
// KST_SKIP_PRIVILEGED is set, and when containerd, runc, a static busybox or
// the loopback CNI plugin is missing, unless KST_REQUIRE_INTEGRATION=1, which
// makes a missing piece a failure.
func Start(tb testing.TB) *Containerd {
	tb.Helper()
	if os.Getenv("KST_SKIP_PRIVILEGED") != "" {
		tb.Skip("KST_SKIP_PRIVILEGED is set")
	}
	if os.Geteuid() != 0 {
		tb.Skip("needs root to run containerd")
	}
	missing := func(format string, args ...any) {
		tb.Helper()
		msg := fmt.Sprintf(format, args...)
		if os.Getenv("KST_REQUIRE_INTEGRATION") == "1" {
			tb.Fatalf("KST_REQUIRE_INTEGRATION=1 but %s", msg)
		}
		tb.Skip(msg)
	}
	for _, r := range requirements {
		if _, err := exec.LookPath(r.name); err != nil {
			missing("%s not found: %s", r.name, r.why)
		}
	}
	busybox, err := findStaticBusybox()
	if err != nil {
		missing("%v", err)
	}
	loopback := ""
	for _, p := range loopbackPaths {
		if _, err := os.Stat(p); err == nil {
			loopback = p
			break
		}
	}
	if loopback == "" {
		missing("no loopback CNI plugin in %v (apt-get install containernetworking-plugins)", loopbackPaths)
	}

	// A short folder: the socket path must fit in sun_path (108 bytes),
	// which t.TempDir()'s long names can exceed.
	dir, err := os.MkdirTemp("", "kcri")
	if err != nil {
		tb.Fatal(err)
	}
	c := &Containerd{Dir: dir, tb: tb, socket: filepath.Join(dir, "c.sock"), exited: make(chan struct{}),
		cgroupParent: "/kst-test-" + filepath.Base(dir)}
	c.Endpoint = "unix://" + c.socket
	tb.Cleanup(c.stop)

	for _, d := range []string{"cni/bin", "cni/conf", "logs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	files := []struct {
		path string
		data string
		mode os.FileMode
	}{
		{"cni/bin/kst-veth", cniPlugin, 0o755},
		{"cni/conf/10-kst.conflist", cniConflist, 0o644},
		{"config.toml", fmt.Sprintf(configTemplate, dir, SandboxImage), 0o644},
	}
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(dir, f.path), []byte(f.data), f.mode); err != nil {
			tb.Fatal(err)
		}
	}
	if err := os.Symlink(loopback, filepath.Join(dir, "cni/bin/loopback")); err != nil {
		tb.Fatal(err)
	}
	if err := writeSandboxImage(filepath.Join(dir, "pause.tar"), SandboxImage, busybox); err != nil {
		tb.Fatalf("building the sandbox image: %v", err)
	}

	logf, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		tb.Fatal(err)
	}
	defer logf.Close()
	c.cmd = exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	// Should the test binary die, containerd goes with it. Pdeathsig fires
	// when the forking *thread* exits, so the goroutine that starts it stays
	// locked to its thread until containerd has exited.
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started := make(chan error)
	go func() {
		goruntime.LockOSThread()
		defer goruntime.UnlockOSThread()
		if err := c.cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = c.cmd.Wait()
		close(c.exited)
	}()
	if err := <-started; err != nil {
		c.cmd = nil
		tb.Fatalf("starting containerd: %v", err)
	}

	conn, err := grpc.NewClient(c.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	c.conn = conn
	c.Runtime = runtimeapi.NewRuntimeServiceClient(conn)
	c.image = runtimeapi.NewImageServiceClient(conn)

	c.waitFor("the CRI socket to answer Version", func(ctx context.Context) (bool, error) {
		_, err := c.Runtime.Version(ctx, &runtimeapi.VersionRequest{})
		return err == nil, err
	})
	out, err := exec.Command("ctr", "-a", c.socket, "-n", "k8s.io", "images", "import",
		"--snapshotter", "native", filepath.Join(dir, "pause.tar")).CombinedOutput()
	if err != nil {
		tb.Fatalf("ctr images import: %v\n%s", err, out)
	}
	c.waitFor("the CRI plugin to see the sandbox image", func(ctx context.Context) (bool, error) {
		st, err := c.image.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: SandboxImage}})
		return err == nil && st.GetImage() != nil, err
	})
	c.waitFor("the CRI plugin to load the CNI configuration", func(ctx context.Context) (bool, error) {
		st, err := c.Runtime.Status(ctx, &runtimeapi.StatusRequest{})
		if err != nil {
			return false, err
		}
		for _, cond := range st.GetStatus().GetConditions() {
			if cond.GetType() == runtimeapi.NetworkReady {
				return cond.GetStatus(), fmt.Errorf("%s: %s", cond.GetReason(), cond.GetMessage())
			}
		}
		return false, nil
	})
	return c
}

// waitFor polls check for up to 30 s, failing the test with the last error
// and the tail of containerd's log if it never holds or containerd exits.
func (c *Containerd) waitFor(what string, check func(context.Context) (bool, error)) {
	c.tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		select {
		case <-c.exited:
			c.tb.Fatalf("containerd exited while waiting for %s:\n%s", what, c.LogTail(40))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		ok, err := check(ctx)
		cancel()
		if ok {
			return
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	c.tb.Fatalf("timed out waiting for %s (last error: %v); containerd log:\n%s", what, last, c.LogTail(40))
}

// LogTail returns the last n lines of containerd's log, for failure messages.
func (c *Containerd) LogTail(n int) string {
	data, _ := os.ReadFile(filepath.Join(c.Dir, "containerd.log"))
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Sandbox describes a pod sandbox to run, as the kubelet would ask for it.
type Sandbox struct {
	// Namespace, Name and UID are the pod's; UID also goes into the
	// io.kubernetes.pod.uid label, as the kubelet does.
	Namespace, Name, UID string
	// Attempt distinguishes successive sandboxes of one pod.
	Attempt uint32
	// HostNetwork runs the sandbox in the node's network namespace.
	HostNetwork bool
}

// RunSandbox runs a pod sandbox through the CRI API and returns its ID. It is
// removed when the test ends if the test has not removed it.
func (c *Containerd) RunSandbox(ctx context.Context, s Sandbox) string {
	c.tb.Helper()
	netMode, hostname := runtimeapi.NamespaceMode_POD, s.Name
	if s.HostNetwork {
		// Like the kubelet, no hostname: the sandbox shares the node's UTS
		// namespace too, and runc refuses to set a hostname there.
		netMode, hostname = runtimeapi.NamespaceMode_NODE, ""
	}
	resp, err := c.Runtime.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: s.Name, Namespace: s.Namespace, Uid: s.UID, Attempt: s.Attempt},
		Hostname: hostname,
		Labels: map[string]string{
			PodUIDLabel:                   s.UID,
			"io.kubernetes.pod.name":      s.Name,
			"io.kubernetes.pod.namespace": s.Namespace,
		},
		LogDirectory: filepath.Join(c.Dir, "logs", s.UID),
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: c.cgroupParent,
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{Network: netMode},
			},
		},
	}})
	if err != nil {
		c.tb.Fatalf("RunPodSandbox %s/%s: %v\ncontainerd log:\n%s", s.Namespace, s.Name, err, c.LogTail(30))
	}
	return resp.GetPodSandboxId()
}

// RemoveSandbox stops and removes a sandbox, as the kubelet does when a pod
// goes away.
func (c *Containerd) RemoveSandbox(ctx context.Context, id string) {
	c.tb.Helper()
	if _, err := c.Runtime.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
		c.tb.Fatalf("StopPodSandbox %s: %v", id, err)
	}
	if _, err := c.Runtime.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
		c.tb.Fatalf("RemovePodSandbox %s: %v", id, err)
	}
}

// SandboxPid returns the host PID of the sandbox's process, from the verbose
// status containerd gives.
func (c *Containerd) SandboxPid(ctx context.Context, id string) int {
	c.tb.Helper()
	st, err := c.Runtime.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		c.tb.Fatalf("PodSandboxStatus %s: %v", id, err)
	}
	var info struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal([]byte(st.GetInfo()["info"]), &info); err != nil || info.Pid <= 0 {
		c.tb.Fatalf("no pid in sandbox %s's verbose info (%v): %.300s", id, err, st.GetInfo()["info"])
	}
	return info.Pid
}

// stop removes every sandbox still there, stops containerd, and fails the
// test for any shim process or mount left behind (after removing them).
func (c *Containerd) stop() {
	tb := c.tb
	if c.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		list, err := c.Runtime.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			tb.Logf("cleanup: ListPodSandbox: %v", err)
		}
		for _, sb := range list.GetItems() {
			if _, err := c.Runtime.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.GetId()}); err != nil {
				tb.Errorf("cleanup: StopPodSandbox %s: %v", sb.GetId(), err)
			}
			if _, err := c.Runtime.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.GetId()}); err != nil {
				tb.Errorf("cleanup: RemovePodSandbox %s: %v", sb.GetId(), err)
			}
		}
		cancel()
		_ = c.conn.Close()
	}
	if c.cmd != nil && c.cmd.Process != nil {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.exited:
		case <-time.After(15 * time.Second):
			tb.Errorf("cleanup: containerd ignored SIGTERM for 15 s; killing it")
			_ = c.cmd.Process.Kill()
			<-c.exited
		}
	}
	// Shims outlive containerd by design; with every sandbox removed they
	// exit by themselves, shortly after.
	var shims []int
	for range 50 {
		if shims = leftover.ProcessesMentioning(c.socket); len(shims) == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(shims) > 0 {
		tb.Errorf("cleanup: processes still running with %s on their command line: %v; killing them", c.socket, shims)
		runcRoot := filepath.Join(c.Dir, "runc", "k8s.io")
		entries, _ := os.ReadDir(runcRoot)
		for _, e := range entries {
			_ = exec.Command("runc", "--root", runcRoot, "delete", "--force", e.Name()).Run()
		}
		for _, pid := range shims {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if mounts := leftover.MountsUnder(c.Dir); len(mounts) > 0 {
		tb.Errorf("cleanup: mounts left under %s: %v; unmounting them", c.Dir, mounts)
		for _, m := range mounts {
			_ = syscall.Unmount(m, syscall.MNT_DETACH)
		}
	}
	// runc removes each sandbox's cgroup but not the parent it made.
	cgroups, _ := filepath.Glob("/sys/fs/cgroup/*" + c.cgroupParent)
	if _, err := os.Stat("/sys/fs/cgroup" + c.cgroupParent); err == nil {
		cgroups = append(cgroups, "/sys/fs/cgroup"+c.cgroupParent)
	}
	for _, cg := range cgroups {
		if err := os.Remove(cg); err != nil {
			tb.Errorf("cleanup: cgroup left: %v", err)
		}
	}
	if err := os.RemoveAll(c.Dir); err != nil {
		tb.Errorf("cleanup: %v", err)
	}
}

// Ctr runs containerd's ctr client against this containerd, in the
// kubelet's namespace k8s.io, and returns its combined output; it fails
// the test on error.
func (c *Containerd) Ctr(args ...string) string {
	c.tb.Helper()
	out, err := c.CtrCommand(args...).CombinedOutput()
	if err != nil {
		c.tb.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// CtrCommand is the ctr command Ctr runs, for callers that start it
// themselves (a container in the foreground).
func (c *Containerd) CtrCommand(args ...string) *exec.Cmd {
	return exec.Command("ctr", append([]string{"-a", c.socket, "-n", "k8s.io"}, args...)...)
}

// ImageStatus is the CRI's view of an image reference, as the kubelet asks
// it before pulling one with imagePullPolicy IfNotPresent: nil when the
// runtime does not have it.
func (c *Containerd) ImageStatus(ctx context.Context, ref string) *runtimeapi.Image {
	c.tb.Helper()
	st, err := c.image.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil {
		c.tb.Fatalf("CRI ImageStatus %s: %v", ref, err)
	}
	return st.GetImage()
}
