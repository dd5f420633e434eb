// Package testdocker runs a private Docker engine for tests of the runtime
// lookup. It is imported only by _test.go files.
//
// The engine (dockerd, which starts its own containerd) keeps everything in a
// fresh directory under /tmp: data, state, socket, pid file and a config file
// that keeps it away from /etc/docker. It leaves the host's iptables, links
// and sysctls alone (--iptables=false --ip-forward=false --bridge=none), so
// containers run with --network none. No registry is reachable, so the only
// image is lab/busybox:1, imported from the host's static busybox.
//
// One engine for the tests of a package (it takes a few seconds to start):
//
//	func TestDocker(t *testing.T) {
//		eng := testdocker.Start(t)
//		t.Run("case", func(t *testing.T) {
//			id, pid := eng.RunSandbox(t, uid, "default", "web")
//			...
//		})
//	}
package testdocker

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/support/leftover"
	"github.com/docker/docker/client"
	"golang.org/x/sys/unix"
)

const (
	// Image is the image every container runs: a static busybox with sh,
	// sleep and ip.
	Image = "lab/busybox:1"

	// EnvRequireIntegration names the environment variable that, when "1",
	// turns a missing dockerd (or docker CLI, or busybox) into a test
	// failure instead of a skip.
	EnvRequireIntegration = "KST_REQUIRE_INTEGRATION"
	// EnvSkipPrivileged names the environment variable that, when set, skips
	// every test needing root.
	EnvSkipPrivileged = "KST_SKIP_PRIVILEGED"

	readyTimeout = 60 * time.Second
	stopTimeout  = 60 * time.Second
)

// ErrUnavailable is returned (wrapped) by New when a Docker engine cannot run
// here: not root, privileged tests disabled, or dockerd missing while
// KST_REQUIRE_INTEGRATION is not "1". Tests skip on it.
var ErrUnavailable = errors.New("testdocker: no Docker engine for tests")

// Engine is a running private dockerd. Create it with New or Start; end it
// with Stop (Start does that on cleanup).
type Engine struct {
	// Dir holds the engine's data, state, socket and log.
	Dir string
	// Host is the engine's API endpoint, unix://DIR/docker.sock, for
	// runtime.NewDocker and the docker CLI's -H.
	Host string

	dockerCLI string
	cmd       *exec.Cmd
	exited    chan struct{} // closed when dockerd has exited

	stopOnce sync.Once
	stopErr  error
}

// Start is New for a test: it skips tb when no engine can run here, fails it
// on any other error, and stops the engine when the test ends.
func Start(tb testing.TB) *Engine {
	tb.Helper()
	e, err := New()
	if errors.Is(err, ErrUnavailable) {
		tb.Skip(err)
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := e.Stop(); err != nil {
			tb.Errorf("testdocker: stop: %v", err)
		}
	})
	return e
}

// New starts a private dockerd, waits until it answers and imports Image.
// The caller must call Stop. It returns an error wrapping ErrUnavailable
// when tests needing it should be skipped.
func New() (*Engine, error) {
	if os.Getenv(EnvSkipPrivileged) != "" {
		return nil, fmt.Errorf("%w: %s is set", ErrUnavailable, EnvSkipPrivileged)
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: needs root", ErrUnavailable)
	}
	var bins [3]string
	for i, name := range []string{"dockerd", "docker", "busybox"} {
		path, err := exec.LookPath(name)
		if err != nil {
			if os.Getenv(EnvRequireIntegration) == "1" {
				return nil, fmt.Errorf("testdocker: %s=1 but %s is missing (apt-get install -y docker.io busybox-static): %w", EnvRequireIntegration, name, err)
			}
			return nil, fmt.Errorf("%w: %s is missing (apt-get install -y docker.io busybox-static): %v", ErrUnavailable, name, err)
		}
		bins[i] = path
	}
	dockerd, dockerCLI, busybox := bins[0], bins[1], bins[2]

	// Short: the socket path must fit in a sockaddr_un (108 bytes), which a
	// test's TempDir may not.
	dir, err := os.MkdirTemp("/tmp", "kstd-")
	if err != nil {
		return nil, fmt.Errorf("testdocker: %w", err)
	}
	e := &Engine{
		Dir:       dir,
		Host:      "unix://" + filepath.Join(dir, "docker.sock"),
		dockerCLI: dockerCLI,
		exited:    make(chan struct{}),
	}
	if err := e.start(dockerd); err != nil {
		err = fmt.Errorf("testdocker: start dockerd: %w", err)
		return nil, errors.Join(err, e.Stop())
	}
	if err := e.importImage(busybox); err != nil {
		return nil, errors.Join(fmt.Errorf("testdocker: %w", err), e.Stop())
	}
	return e, nil
}

func (e *Engine) start(dockerd string) error {
	// dockerd 20.10 otherwise creates /etc/docker/key.json.
	config, err := json.Marshal(map[string]any{"deprecated-key-path": filepath.Join(e.Dir, "key.json")})
	if err != nil {
		return err
	}
	configPath := filepath.Join(e.Dir, "daemon.json")
	if err := os.WriteFile(configPath, config, 0o600); err != nil {
		return err
	}
	logFile, err := os.Create(filepath.Join(e.Dir, "dockerd.log"))
	if err != nil {
		return err
	}
	defer logFile.Close() // the child has its own copy
	e.cmd = exec.Command(dockerd,
		"--config-file", configPath,
		"--data-root", filepath.Join(e.Dir, "root"),
		"--exec-root", filepath.Join(e.Dir, "exec"),
		"-H", e.Host,
		"--pidfile", filepath.Join(e.Dir, "docker.pid"),
		"--iptables=false", "--ip-forward=false", "--ip-masq=false",
		"--bridge=none",
	)
	e.cmd.Stdout, e.cmd.Stderr = logFile, logFile
	// If the test binary dies, so does dockerd (and, with it, containerd).
	// Pdeathsig follows the thread that forks: Start must not be called from
	// a goroutine locked to a thread that exits.
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := e.cmd.Start(); err != nil {
		close(e.exited)
		return err
	}
	go func() {
		_ = e.cmd.Wait()
		close(e.exited)
	}()

	cli, err := client.NewClientWithOpts(client.WithHost(e.Host), client.WithAPIVersionNegotiation())
	if err != nil {
		return err
	}
	defer cli.Close()
	deadline := time.Now().Add(readyTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := cli.Ping(ctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-e.exited:
			return fmt.Errorf("dockerd exited (%v): %s", e.cmd.ProcessState, e.logTail())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("dockerd did not answer within %s: %v: %s", readyTimeout, err, e.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// importImage imports Image: a root file system holding only busybox and
// links to it, built in memory.
func (e *Engine) importImage(busybox string) error {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdrs := []*tar.Header{
		{Typeflag: tar.TypeDir, Name: "bin/", Mode: 0o755},
		{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777},
		{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(bin))},
	}
	for _, applet := range []string{"sh", "sleep", "ip", "cat", "ls"} {
		hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + applet, Linkname: "busybox", Mode: 0o777})
	}
	for _, h := range hdrs {
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if h.Name == "bin/busybox" {
			if _, err := tw.Write(bin); err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	cmd := exec.Command(e.dockerCLI, "-H", e.Host, "import", "-", Image)
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("docker import %s: %w: %s", Image, err, out)
	}
	return nil
}

// Docker runs the docker CLI against the engine and returns its standard
// output, trimmed; it fails the test on error.
func (e *Engine) Docker(tb testing.TB, args ...string) string {
	tb.Helper()
	out, err := e.docker(args...)
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

func (e *Engine) docker(args ...string) (string, error) {
	cmd := exec.Command(e.dockerCLI, append([]string{"-H", e.Host}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("docker %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(stdout.String()), nil
}

// Run starts a detached container of Image with no network and the given
// labels, running sleep, and returns its ID and the host PID of its process.
// The container is removed when the test ends.
func (e *Engine) Run(tb testing.TB, labels map[string]string) (containerID string, pid int) {
	tb.Helper()
	return e.RunNetwork(tb, "none", labels)
}

// RunNetwork is Run with docker's --network set to network ("host" for a
// host-network pod's sandbox).
func (e *Engine) RunNetwork(tb testing.TB, network string, labels map[string]string) (containerID string, pid int) {
	tb.Helper()
	args := []string{"run", "-d", "--network", network}
	for k, v := range labels {
		args = append(args, "--label", k+"="+v)
	}
	args = append(args, Image, "/bin/sleep", "3600")
	id := e.Docker(tb, args...)
	tb.Cleanup(func() {
		// Already gone when the test removed it itself.
		_, _ = e.docker("rm", "-f", id)
	})
	pid, err := strconv.Atoi(e.Docker(tb, "inspect", "-f", "{{.State.Pid}}", id))
	if err != nil || pid <= 0 {
		tb.Fatalf("container %s: no PID (%d, %v)", id, pid, err)
	}
	return id, pid
}

// RunSandbox starts a container labelled as the sandbox of a pod, as
// dockershim and cri-dockerd label it, and returns its ID and host PID.
func (e *Engine) RunSandbox(tb testing.TB, uid, namespace, name string) (containerID string, pid int) {
	tb.Helper()
	return e.Run(tb, PodLabels("podsandbox", uid, namespace, name))
}

// PodLabels returns the labels dockershim puts on a pod's containers; kind
// is "podsandbox" for the sandbox and "container" for the others.
func PodLabels(kind, uid, namespace, name string) map[string]string {
	return map[string]string{
		"io.kubernetes.docker.type":   kind,
		"io.kubernetes.pod.uid":       uid,
		"io.kubernetes.pod.namespace": namespace,
		"io.kubernetes.pod.name":      name,
	}
}

// Remove removes a container at once (docker rm -f).
func (e *Engine) Remove(tb testing.TB, containerID string) {
	tb.Helper()
	e.Docker(tb, "rm", "-f", containerID)
}

// Stop removes all containers, stops dockerd with SIGTERM (it stops its
// containerd), kills any process of the engine left behind, unmounts what
// it left mounted and deletes Dir. It reports what it had to clean up by
// force as an error. Calling it again returns the first result.
func (e *Engine) Stop() error {
	e.stopOnce.Do(func() { e.stopErr = e.stop() })
	return e.stopErr
}

func (e *Engine) stop() error {
	var errs []error
	running := e.cmd != nil && e.cmd.Process != nil
	if running {
		select {
		case <-e.exited:
			running = false
		default:
		}
	}
	if running {
		// A container whose PID 1 ignores SIGTERM (sleep does, as PID 1)
		// would make dockerd's shutdown wait: remove them all first.
		if ids, err := e.docker("ps", "-aq"); err != nil {
			errs = append(errs, err)
		} else if ids != "" {
			if _, err := e.docker(append([]string{"rm", "-f"}, strings.Fields(ids)...)...); err != nil {
				errs = append(errs, err)
			}
		}
		_ = e.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-e.exited:
		case <-time.After(stopTimeout):
			_ = e.cmd.Process.Kill()
			<-e.exited
			errs = append(errs, fmt.Errorf("dockerd did not stop within %s of SIGTERM; killed", stopTimeout))
		}
	}
	if pids := leftover.ProcessesMentioning(e.Dir + "/"); len(pids) > 0 {
		for _, pid := range pids {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		errs = append(errs, fmt.Errorf("processes of the engine left running, killed: %v", pids))
	}
	if mounts := leftover.MountsUnder(e.Dir); len(mounts) > 0 {
		var leaked []string
		for _, m := range mounts { // deepest first
			_ = unix.Unmount(m, unix.MNT_DETACH)
			// dockerd 20.10 bind-mounts the host's namespace there for
			// --network host containers and never unmounts it on exit.
			if !strings.HasSuffix(m, "/exec/netns/default") {
				leaked = append(leaked, m)
			}
		}
		if len(leaked) > 0 {
			errs = append(errs, fmt.Errorf("mounts of the engine left behind, detached: %v", leaked))
		}
	}
	if err := os.RemoveAll(e.Dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (e *Engine) logTail() string {
	b, _ := os.ReadFile(filepath.Join(e.Dir, "dockerd.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}
