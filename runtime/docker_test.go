package runtime

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testdocker"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

func TestNewestRunningSandbox(t *testing.T) {
	t0 := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	sb := func(id string, running bool, pid int, started time.Time) dockerSandbox {
		return dockerSandbox{id: id, running: running, pid: pid, startedAt: started}
	}
	tests := []struct {
		name   string
		in     []dockerSandbox
		wantID string // "" for none
	}{
		{"none", nil, ""},
		{"one running", []dockerSandbox{sb("a", true, 10, t0)}, "a"},
		{"stopped is never chosen", []dockerSandbox{sb("a", false, 10, t0)}, ""},
		{"running without a process is never chosen", []dockerSandbox{sb("a", true, 0, t0)}, ""},
		{"newest start wins", []dockerSandbox{
			sb("new", true, 11, t0.Add(time.Nanosecond)), sb("old", true, 10, t0),
		}, "new"},
		{"newest start wins in any order", []dockerSandbox{
			sb("old", true, 10, t0), sb("new", true, 11, t0.Add(time.Nanosecond)),
		}, "new"},
		{"a newer stopped one loses to a running one", []dockerSandbox{
			sb("old", true, 10, t0), sb("dead", false, 11, t0.Add(time.Hour)),
		}, "old"},
		{"equal start: highest ID, whatever the order", []dockerSandbox{
			sb("b", true, 10, t0), sb("c", true, 11, t0), sb("a", true, 12, t0),
		}, "c"},
		{"unknown start time loses", []dockerSandbox{
			sb("zzz", true, 10, time.Time{}), sb("a", true, 11, t0),
		}, "a"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := newestRunningSandbox(tt.in)
			if tt.wantID == "" {
				if ok {
					t.Fatalf("chose %q, want none", got.id)
				}
				return
			}
			if !ok || got.id != tt.wantID {
				t.Fatalf("chose %q (found %v), want %q", got.id, ok, tt.wantID)
			}
		})
	}
}

// fakeDocker is a daemon in memory. ContainerList ignores the filters (and
// records them) so the test sees that Locate checks the labels itself.
type fakeDocker struct {
	containers []fakeContainer
	listErr    error
	lists      []container.ListOptions
	inspects   map[string]int
	// afterFirstInspect, if set, changes a container after it was first
	// inspected (a sandbox dying while its namespace is opened).
	afterFirstInspect func(c *fakeContainer)
}

type fakeContainer struct {
	id      string
	labels  map[string]string
	running bool
	pid     int
	started time.Time
	gone    bool // removed after the list
}

func (f *fakeDocker) ContainerList(_ context.Context, opts container.ListOptions) ([]container.Summary, error) {
	f.lists = append(f.lists, opts)
	if f.listErr != nil {
		return nil, f.listErr
	}
	var out []container.Summary
	for _, c := range f.containers {
		out = append(out, container.Summary{ID: c.id, Labels: c.labels})
	}
	return out, nil
}

func (f *fakeDocker) ContainerInspect(_ context.Context, id string) (container.InspectResponse, error) {
	if f.inspects == nil {
		f.inspects = map[string]int{}
	}
	f.inspects[id]++
	for i := range f.containers {
		c := &f.containers[i]
		if c.id != id {
			continue
		}
		if f.inspects[id] == 2 && f.afterFirstInspect != nil {
			f.afterFirstInspect(c)
		}
		if c.gone {
			break
		}
		return container.InspectResponse{ContainerJSONBase: &container.ContainerJSONBase{
			ID: c.id,
			State: &container.State{
				Running:   c.running,
				Pid:       c.pid,
				StartedAt: c.started.Format(time.RFC3339Nano),
			},
		}}, nil
	}
	return container.InspectResponse{}, fmt.Errorf("no such container: %s: %w", id, cerrdefs.ErrNotFound)
}

func (f *fakeDocker) Ping(context.Context) (types.Ping, error) { return types.Ping{}, nil }
func (f *fakeDocker) Close() error                             { return nil }

func sandboxLabels(kind, uid string) map[string]string {
	return testdocker.PodLabels(kind, uid, "default", "web")
}

// noSuchPID is above the kernel's PID_MAX_LIMIT, so no process has it.
const noSuchPID = 1 << 30

func TestDockerLocateWithFakeDaemon(t *testing.T) {
	self := os.Getpid() // a process whose namespace a test may open without root
	t0 := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	pod := Pod{Namespace: "default", Name: "web", UID: "uid-1"}
	selfPath := fmt.Sprintf("/proc/%d/ns/net", self)

	t.Run("opens the sandbox's namespace, ignoring other containers", func(t *testing.T) {
		f := &fakeDocker{containers: []fakeContainer{
			{id: "app", labels: sandboxLabels("container", "uid-1"), running: true, pid: noSuchPID, started: t0.Add(time.Hour)},
			{id: "other-pod", labels: sandboxLabels("podsandbox", "uid-2"), running: true, pid: noSuchPID, started: t0.Add(time.Hour)},
			{id: "sandbox", labels: sandboxLabels("podsandbox", "uid-1"), running: true, pid: self, started: t0},
		}}
		d := &Docker{api: f, endpoint: "fake", procRoot: "/proc"}
		ns, err := d.Locate(context.Background(), pod)
		if err != nil {
			t.Fatalf("Locate: %v", err)
		}
		defer ns.Close()
		if ns.Path != selfPath || ns.Via != "docker" {
			t.Errorf("got path %q via %q, want %q via docker", ns.Path, ns.Via, selfPath)
		}
		if got, want := idOfHandle(t, ns.Handle), idOfPath(t, "/proc/self/ns/net"); got != want {
			t.Errorf("opened namespace %v, want %v", got, want)
		}
		if f.inspects["app"] != 0 || f.inspects["other-pod"] != 0 {
			t.Errorf("inspected containers that are not the pod's sandbox: %v", f.inspects)
		}
		if len(f.lists) != 1 {
			t.Fatalf("listed %d times, want 1", len(f.lists))
		}
		args := f.lists[0].Filters
		for _, kv := range [][2]string{
			{"label", "io.kubernetes.docker.type=podsandbox"},
			{"label", "io.kubernetes.pod.uid=uid-1"},
			{"status", "running"},
		} {
			if !args.ExactMatch(kv[0], kv[1]) {
				t.Errorf("list filters %v lack %s=%s", args, kv[0], kv[1])
			}
		}
	})

	t.Run("no sandbox: ErrNotFound naming the pod", func(t *testing.T) {
		f := &fakeDocker{containers: []fakeContainer{
			{id: "app", labels: sandboxLabels("container", "uid-1"), running: true, pid: self, started: t0},
		}}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), pod)
		if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "default/web") {
			t.Fatalf("got %v, want ErrNotFound naming default/web", err)
		}
	})

	t.Run("sandbox removed after the list: ErrNotFound", func(t *testing.T) {
		f := &fakeDocker{containers: []fakeContainer{
			{id: "sandbox", labels: sandboxLabels("podsandbox", "uid-1"), gone: true},
		}}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), pod)
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("got %v, want ErrNotFound", err)
		}
	})

	t.Run("process gone before the open: ErrNotFound", func(t *testing.T) {
		f := &fakeDocker{containers: []fakeContainer{
			{id: "sandbox", labels: sandboxLabels("podsandbox", "uid-1"), running: true, pid: noSuchPID, started: t0},
		}}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), pod)
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("got %v, want ErrNotFound", err)
		}
	})

	t.Run("sandbox restarted while opening: ErrNotFound, not someone else's namespace", func(t *testing.T) {
		f := &fakeDocker{
			containers: []fakeContainer{
				{id: "sandbox", labels: sandboxLabels("podsandbox", "uid-1"), running: true, pid: self, started: t0},
			},
			afterFirstInspect: func(c *fakeContainer) { c.pid = noSuchPID },
		}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), pod)
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("got %v, want ErrNotFound", err)
		}
		if f.inspects["sandbox"] != 2 {
			t.Errorf("inspected the sandbox %d times, want 2 (before and after opening)", f.inspects["sandbox"])
		}
	})

	t.Run("daemon error: wrapped with the pod, not ErrNotFound", func(t *testing.T) {
		boom := errors.New("connection refused")
		f := &fakeDocker{listErr: boom}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), pod)
		if !errors.Is(err, boom) || errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "default/web") {
			t.Fatalf("got %v, want the daemon's error with the pod's name", err)
		}
	})

	t.Run("no UID: an error, never a search for every sandbox", func(t *testing.T) {
		f := &fakeDocker{}
		_, err := (&Docker{api: f, procRoot: "/proc"}).Locate(context.Background(), Pod{Namespace: "default", Name: "web"})
		if err == nil || errors.Is(err, ErrNotFound) || len(f.lists) != 0 {
			t.Fatalf("got %v after %d lists, want an error before any list", err, len(f.lists))
		}
	})
}

// TestDockerEngine runs the locator against a real dockerd with containers
// labelled as dockershim labels them.
func TestDockerEngine(t *testing.T) {
	eng := testdocker.Start(t)
	d, err := NewDocker(eng.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if d.Name() != "docker" {
		t.Errorf("Name() = %q", d.Name())
	}
	if err := d.Ping(t.Context()); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	pod := func(uid string) Pod { return Pod{Namespace: "default", Name: "web-" + uid, UID: uid} }
	netnsPath := func(pid int) string { return fmt.Sprintf("/proc/%d/ns/net", pid) }

	t.Run("a host-network sandbox is refused, never handed out", func(t *testing.T) {
		const uid = "8d0f3c2e-0001-4c55-9a0e-0000000000ff"
		eng.RunNetwork(t, "host", testdocker.PodLabels("podsandbox", uid, "default", "web-"+uid))
		ns, err := d.Locate(t.Context(), pod(uid))
		if err == nil {
			ns.Close()
			t.Fatal("Locate handed out a host-network sandbox's namespace")
		}
		if !errors.Is(err, ErrHostNetwork) {
			t.Fatalf("err = %v, want ErrHostNetwork", err)
		}
	})

	t.Run("finds the sandbox's namespace, not the app container's", func(t *testing.T) {
		const uid = "8d0f3c2e-0001-4c55-9a0e-000000000001"
		sandboxID, sandboxPID := eng.RunSandbox(t, uid, "default", "web-"+uid)
		appID, appPID := eng.Run(t, testdocker.PodLabels("container", uid, "default", "web-"+uid))
		// Started after the sandbox: were the type label ignored, the
		// newest-wins rule would pick it.
		ns, err := d.Locate(t.Context(), pod(uid))
		if err != nil {
			t.Fatalf("Locate: %v", err)
		}
		defer ns.Close()
		if ns.Path != netnsPath(sandboxPID) || ns.Via != "docker" {
			t.Errorf("got %s via %s, want %s via docker", ns.Path, ns.Via, netnsPath(sandboxPID))
		}
		got := idOfHandle(t, ns.Handle)
		if want := idOfPath(t, netnsPath(sandboxPID)); got != want {
			t.Fatalf("opened namespace %v, sandbox's is %v", got, want)
		}
		if app := idOfPath(t, netnsPath(appPID)); got == app {
			t.Fatalf("the app container shares the namespace %v: the test cannot tell them apart", app)
		}

		// An address added through the handle shows inside the sandbox
		// and not in the app container.
		nl, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_ROUTE)
		if err != nil {
			t.Fatal(err)
		}
		defer nl.Close()
		lo, err := nl.LinkByName("lo")
		if err != nil {
			t.Fatal(err)
		}
		addr := netip.MustParsePrefix("198.19.202.1/32")
		if err := nl.AddrAdd(lo, &netlink.Addr{IPNet: testnetns.IPNet(addr)}); err != nil {
			t.Fatal(err)
		}
		if out := eng.Docker(t, "exec", sandboxID, "/bin/ip", "-4", "addr", "show", "dev", "lo"); !strings.Contains(out, addr.String()) {
			t.Errorf("sandbox's lo lacks %s:\n%s", addr, out)
		}
		if out := eng.Docker(t, "exec", appID, "/bin/ip", "-4", "addr", "show", "dev", "lo"); strings.Contains(out, addr.Addr().String()) {
			t.Errorf("app container's lo has %s:\n%s", addr, out)
		}
	})

	t.Run("the newest of two sandboxes wins", func(t *testing.T) {
		const uid = "8d0f3c2e-0002-4c55-9a0e-000000000002"
		_, oldPID := eng.RunSandbox(t, uid, "default", "web-"+uid)
		_, newPID := eng.RunSandbox(t, uid, "default", "web-"+uid)
		ns, err := d.Locate(t.Context(), pod(uid))
		if err != nil {
			t.Fatalf("Locate: %v", err)
		}
		defer ns.Close()
		got := idOfHandle(t, ns.Handle)
		if want := idOfPath(t, netnsPath(newPID)); got != want {
			t.Fatalf("opened %v, want the newer sandbox's %v (older: %v)", got, want, idOfPath(t, netnsPath(oldPID)))
		}
	})

	t.Run("only an app container: ErrNotFound", func(t *testing.T) {
		const uid = "8d0f3c2e-0003-4c55-9a0e-000000000003"
		eng.Run(t, testdocker.PodLabels("container", uid, "default", "web-"+uid))
		if _, err := d.Locate(t.Context(), pod(uid)); !errors.Is(err, ErrNotFound) {
			t.Fatalf("got %v, want ErrNotFound", err)
		}
	})

	t.Run("unknown UID: ErrNotFound", func(t *testing.T) {
		_, err := d.Locate(t.Context(), pod("8d0f3c2e-0004-4c55-9a0e-000000000004"))
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("got %v, want ErrNotFound", err)
		}
	})

	t.Run("killed, then removed sandbox: ErrNotFound", func(t *testing.T) {
		const uid = "8d0f3c2e-0005-4c55-9a0e-000000000005"
		id, _ := eng.RunSandbox(t, uid, "default", "web-"+uid)
		ns, err := d.Locate(t.Context(), pod(uid))
		if err != nil {
			t.Fatalf("Locate while running: %v", err)
		}
		ns.Close()
		eng.Docker(t, "kill", id)
		if _, err := d.Locate(t.Context(), pod(uid)); !errors.Is(err, ErrNotFound) {
			t.Fatalf("after docker kill: got %v, want ErrNotFound", err)
		}
		eng.Remove(t, id)
		if _, err := d.Locate(t.Context(), pod(uid)); !errors.Is(err, ErrNotFound) {
			t.Fatalf("after docker rm -f: got %v, want ErrNotFound", err)
		}
	})
}

func TestDockerPingFailsWithoutDaemon(t *testing.T) {
	d, err := NewDocker("unix://" + t.TempDir() + "/no.sock")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Ping(t.Context()); err == nil || !strings.Contains(err.Error(), "no.sock") {
		t.Fatalf("Ping of a missing socket: %v, want an error naming it", err)
	}
}
