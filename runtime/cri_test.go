package runtime

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/cmdnu/kube-service-tunnel/test/support/testcri"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// Samples of PodSandboxStatusResponse.Info["info"], trimmed to the fields
// that matter and the ones around them, in the shapes the runtimes write
// (see criSandboxInfo for the source files).
const (
	// containerd 1.6/1.7 (pkg/cri/server/sandbox_status.go), pod network.
	criInfoContainerd = `{"pid":4242,"processStatus":"running","netNamespaceClosed":false,
		"image":"registry.k8s.io/pause:3.9","snapshotKey":"abc","snapshotter":"overlayfs",
		"runtimeHandler":"","runtimeType":"io.containerd.runc.v2","runtimeOptions":{"systemd_cgroup":true},
		"config":{"metadata":{"name":"web-0","uid":"u1","namespace":"default"},
			"linux":{"cgroup_parent":"kubepods-besteffort.slice","security_context":{"namespace_options":{"pid":1}}}},
		"runtimeSpec":{"ociVersion":"1.0.2-dev","process":{"args":["/pause"]},
			"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"uts"},{"type":"mount"},
				{"type":"network","path":"/var/run/netns/cni-8b2a1d6e-7c55-4c3a-1d2e-3f4a5b6c7d8e"}]}},
		"cniResult":{"Interfaces":{"eth0":{"IPConfigs":[{"IP":"10.244.1.7","Gateway":"10.244.1.1"}]}}}}`
	// containerd 2.x (internal/cri/server/podsandbox/types/sandbox_info.go)
	// adds sandboxMetadata; the spec is where it was.
	criInfoContainerd2 = `{"pid":77,"processStatus":"running","netNamespaceClosed":false,
		"config":{"metadata":{"name":"web-0","uid":"u1","namespace":"default"}},
		"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/var/run/netns/cni-1234"}]}},
		"sandboxMetadata":{"Version":"v1","Metadata":{"ID":"abc","NetNSPath":"/var/run/netns/cni-1234"}}}`
	// containerd, hostNetwork: true. The spec has no network namespace and
	// the config says NODE (2).
	criInfoContainerdHost = `{"pid":4243,"processStatus":"running","netNamespaceClosed":false,
		"config":{"metadata":{"name":"agent","uid":"u2","namespace":"kube-system"},
			"linux":{"security_context":{"namespace_options":{"network":2,"pid":1}}}},
		"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"uts"},{"type":"mount"}]}}}`
	// containerd, sandbox being torn down.
	criInfoContainerdClosed = `{"pid":0,"processStatus":"deleted","netNamespaceClosed":true,
		"runtimeSpec":{"linux":{"namespaces":[{"type":"network","path":"/var/run/netns/cni-gone"}]}}}`
	// CRI-O (server/sandbox_status.go, createSandboxInfo) with an infra
	// container: image, pid and runtimeSpec; the namespace is CRI-O's pinned one.
	criInfoCRIO = `{"image":"registry.k8s.io/pause:3.9","pid":5151,
		"runtimeSpec":{"ociVersion":"1.0.2-dev","linux":{"namespaces":[{"type":"pid"},
			{"type":"network","path":"/var/run/netns/0e3b8f3c-5b0e-4f9a-9c1e-2f4d6a8b0c1d"},
			{"type":"ipc","path":"/var/run/ipcns/0e3b8f3c"},{"type":"uts","path":"/var/run/utsns/0e3b8f3c"}]}}}`
	// CRI-O with the infra container dropped (the default): a spoofed
	// container, only runtimeSpec.
	criInfoCRIODropped = `{"runtimeSpec":{"linux":{"namespaces":[{"type":"network","path":"/var/run/netns/5d7c"},{"type":"ipc"}]}}}`
	// CRI-O, hostNetwork: no network namespace in the spec.
	criInfoCRIOHost = `{"image":"registry.k8s.io/pause:3.9","pid":5152,
		"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"ipc","path":"/var/run/ipcns/x"}]}}}`
)

func TestCRINetnsPath(t *testing.T) {
	tests := []struct {
		name     string
		info     map[string]string
		want     string
		wantErr  string // substring; "" means success
		notFound bool
		host     bool
	}{
		{name: "containerd", info: map[string]string{"info": criInfoContainerd}, want: "/var/run/netns/cni-8b2a1d6e-7c55-4c3a-1d2e-3f4a5b6c7d8e"},
		{name: "containerd 2", info: map[string]string{"info": criInfoContainerd2}, want: "/var/run/netns/cni-1234"},
		{name: "cri-o with infra container", info: map[string]string{"info": criInfoCRIO}, want: "/var/run/netns/0e3b8f3c-5b0e-4f9a-9c1e-2f4d6a8b0c1d"},
		{name: "cri-o without infra container", info: map[string]string{"info": criInfoCRIODropped}, want: "/var/run/netns/5d7c"},
		{name: "network namespace without path uses the pid",
			info: map[string]string{"info": `{"pid":99,"runtimeSpec":{"linux":{"namespaces":[{"type":"network"}]}}}`},
			want: "/proc/99/ns/net"},
		{name: "no runtime spec uses the pid", info: map[string]string{"info": `{"pid":1234}`}, want: "/proc/1234/ns/net"},
		{name: "containerd host network", info: map[string]string{"info": criInfoContainerdHost}, wantErr: "host network", host: true},
		{name: "cri-o host network", info: map[string]string{"info": criInfoCRIOHost}, wantErr: "host network", host: true},
		{name: "host network by config even with a path",
			info: map[string]string{"info": `{"pid":5,"config":{"linux":{"security_context":{"namespace_options":{"network":2}}}},
				"runtimeSpec":{"linux":{"namespaces":[{"type":"network","path":"/var/run/netns/x"}]}}}`},
			wantErr: "host network", host: true},
		{name: "closed namespace", info: map[string]string{"info": criInfoContainerdClosed}, wantErr: "already closed", notFound: true},
		{name: "malformed JSON", info: map[string]string{"info": `{"pid": 12, "runtimeSpec": {`}, wantErr: "parsing verbose sandbox info"},
		{name: "wrong type", info: map[string]string{"info": `{"pid":"12"}`}, wantErr: "parsing verbose sandbox info"},
		{name: "no info key", info: map[string]string{"other": "{}"}, wantErr: "no verbose sandbox info"},
		{name: "nil map", info: nil, wantErr: "no verbose sandbox info"},
		{name: "neither path nor pid", info: map[string]string{"info": `{"image":"x"}`}, wantErr: "neither a network namespace path nor a sandbox pid"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := criNetnsPath(tt.info)
			if tt.wantErr == "" {
				if err != nil || got != tt.want {
					t.Fatalf("criNetnsPath = %q, %v; want %q", got, err, tt.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("criNetnsPath = %q, %v; want an error containing %q", got, err, tt.wantErr)
			}
			if errors.Is(err, ErrNotFound) != tt.notFound {
				t.Errorf("errors.Is(%v, ErrNotFound) = %v, want %v", err, !tt.notFound, tt.notFound)
			}
			if errors.Is(err, ErrHostNetwork) != tt.host {
				t.Errorf("errors.Is(%v, ErrHostNetwork) = %v, want %v", err, !tt.host, tt.host)
			}
		})
	}
}

func TestCRINewestReady(t *testing.T) {
	sb := func(id, uid string, state runtimeapi.PodSandboxState, created int64) *runtimeapi.PodSandbox {
		return &runtimeapi.PodSandbox{Id: id, State: state, CreatedAt: created, Labels: map[string]string{criPodUIDLabel: uid}}
	}
	ready, notReady := runtimeapi.PodSandboxState_SANDBOX_READY, runtimeapi.PodSandboxState_SANDBOX_NOTREADY
	tests := []struct {
		name  string
		items []*runtimeapi.PodSandbox
		want  string
	}{
		{name: "none", want: ""},
		{name: "one", items: []*runtimeapi.PodSandbox{sb("a", "u1", ready, 10)}, want: "a"},
		{name: "newest wins", items: []*runtimeapi.PodSandbox{sb("a", "u1", ready, 10), sb("b", "u1", ready, 30), sb("c", "u1", ready, 20)}, want: "b"},
		{name: "not ready is skipped", items: []*runtimeapi.PodSandbox{sb("a", "u1", ready, 10), sb("b", "u1", notReady, 30)}, want: "a"},
		{name: "other pod is skipped", items: []*runtimeapi.PodSandbox{sb("a", "u2", ready, 30), sb("b", "u1", ready, 10)}, want: "b"},
		{name: "only other pods", items: []*runtimeapi.PodSandbox{sb("a", "u2", ready, 30)}, want: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := criNewestReady(tt.items, "u1").GetId(); got != tt.want {
				t.Errorf("criNewestReady = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestCRITarget(t *testing.T) {
	for in, want := range map[string]string{
		"unix:///run/containerd/containerd.sock": "unix:///run/containerd/containerd.sock",
		"/run/crio/crio.sock":                    "unix:///run/crio/crio.sock",
		"tcp://127.0.0.1:1234":                   "",
		"unix://":                                "",
		"":                                       "",
	} {
		got, err := criTarget(in)
		if got != want || (err == nil) != (want != "") {
			t.Errorf("criTarget(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

func TestNewCRIDeadSocket(t *testing.T) {
	endpoint := "unix://" + filepath.Join(t.TempDir(), "nobody.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	c, err := NewCRI(ctx, endpoint)
	if err == nil {
		c.Close()
		t.Fatal("NewCRI on a missing socket succeeded")
	}
	if !strings.Contains(err.Error(), endpoint) || !strings.Contains(err.Error(), "Version") {
		t.Errorf("error %q should name the endpoint and the failed Version call", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("NewCRI took %v to notice the dead socket", d)
	}
}

// fakeCRI is a CRI runtime service that serves a fixed set of sandboxes, for
// the Locate paths that need no real runtime. The real thing is exercised by
// TestCRIContainerd.
type fakeCRI struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	mu        sync.Mutex
	sandboxes []fakeCRISandbox
	// ignoreFilter makes ListPodSandbox return everything, as a buggy
	// runtime might.
	ignoreFilter bool
}

type fakeCRISandbox struct {
	sb      *runtimeapi.PodSandbox
	netMode runtimeapi.NamespaceMode
	info    string
}

func (f *fakeCRI) Version(context.Context, *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	return &runtimeapi.VersionResponse{Version: "0.1.0", RuntimeName: "fake", RuntimeVersion: "0", RuntimeApiVersion: "v1"}, nil
}

func (f *fakeCRI) ListPodSandbox(_ context.Context, req *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var items []*runtimeapi.PodSandbox
next:
	for _, s := range f.sandboxes {
		if !f.ignoreFilter {
			if st := req.GetFilter().GetState(); st != nil && st.GetState() != s.sb.GetState() {
				continue
			}
			for k, v := range req.GetFilter().GetLabelSelector() {
				if s.sb.GetLabels()[k] != v {
					continue next
				}
			}
		}
		items = append(items, s.sb)
	}
	return &runtimeapi.ListPodSandboxResponse{Items: items}, nil
}

func (f *fakeCRI) PodSandboxStatus(_ context.Context, req *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.sandboxes {
		if s.sb.GetId() != req.GetPodSandboxId() {
			continue
		}
		resp := &runtimeapi.PodSandboxStatusResponse{Status: &runtimeapi.PodSandboxStatus{
			Id: s.sb.GetId(), State: s.sb.GetState(), CreatedAt: s.sb.GetCreatedAt(), Labels: s.sb.GetLabels(),
			Linux: &runtimeapi.LinuxPodSandboxStatus{Namespaces: &runtimeapi.Namespace{
				Options: &runtimeapi.NamespaceOption{Network: s.netMode},
			}},
		}}
		if req.GetVerbose() {
			resp.Info = map[string]string{"info": s.info}
		}
		return resp, nil
	}
	return nil, fmt.Errorf("sandbox %q not found", req.GetPodSandboxId())
}

// startFakeCRI serves f on a unix socket and returns a CRI locator on it.
func startFakeCRI(t *testing.T, f *fakeCRI) *CRI {
	t.Helper()
	dir, err := os.MkdirTemp("", "kcrifake")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "cri.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, f)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := NewCRI(ctx, "unix://"+sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func criReady(id, uid string, created int64) *runtimeapi.PodSandbox {
	return &runtimeapi.PodSandbox{Id: id, State: runtimeapi.PodSandboxState_SANDBOX_READY, CreatedAt: created,
		Labels: map[string]string{criPodUIDLabel: uid}}
}

func criInfoWithPath(path string) string {
	return fmt.Sprintf(`{"pid":1,"runtimeSpec":{"linux":{"namespaces":[{"type":"network","path":%q}]}}}`, path)
}

// TestCRILocateRefusals covers the answers Locate must give without opening
// any pod namespace; it needs no root.
func TestCRILocateRefusals(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f := &fakeCRI{sandboxes: []fakeCRISandbox{
		// hostNetwork pod: the status says NODE, the info points at the
		// host's namespace.
		{sb: criReady("host", "u-host", 1), netMode: runtimeapi.NamespaceMode_NODE, info: criInfoContainerdHost},
		// A runtime that claims a pod network but names our own namespace.
		{sb: criReady("liar", "u-liar", 1), info: criInfoWithPath("/proc/thread-self/ns/net")},
		{sb: criReady("broken", "u-broken", 1), info: `{"pid":`},
		// A path the agent cannot see (no /run/netns mount).
		{sb: criReady("unmounted", "u-unmounted", 1), info: criInfoWithPath("/nonexistent/kst/netns/cni-1")},
		{sb: criReady("other", "u-other", 1), info: criInfoWithPath("/proc/thread-self/ns/net")},
		{sb: &runtimeapi.PodSandbox{Id: "dead", State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY, Labels: map[string]string{criPodUIDLabel: "u-dead"}}},
	}}
	loc := startFakeCRI(t, f)
	if loc.Name() != "cri" {
		t.Errorf("Name() = %q", loc.Name())
	}
	pod := func(uid string) Pod { return Pod{Namespace: "ns", Name: "p-" + uid, UID: uid} }

	tests := []struct {
		uid      string
		wantErr  string
		notFound bool
	}{
		{uid: "u-missing", wantErr: "no ready sandbox for pod ns/p-u-missing", notFound: true},
		{uid: "u-dead", wantErr: "no ready sandbox", notFound: true},
		{uid: "u-host", wantErr: "host network"},
		{uid: "u-liar", wantErr: "host network"},
		{uid: "u-broken", wantErr: "parsing verbose sandbox info"},
		{uid: "u-unmounted", wantErr: "HostToContainer"},
		{uid: "", wantErr: "no UID"},
	}
	for _, tt := range tests {
		t.Run("uid "+tt.uid, func(t *testing.T) {
			n, err := loc.Locate(ctx, pod(tt.uid))
			if err == nil {
				n.Close()
				t.Fatalf("Locate succeeded with %s; want an error containing %q", n.Path, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), loc.endpoint) {
				t.Errorf("error %q should contain %q and the endpoint", err, tt.wantErr)
			}
			if errors.Is(err, ErrNotFound) != tt.notFound {
				t.Errorf("errors.Is(%v, ErrNotFound) = %v, want %v", err, !tt.notFound, tt.notFound)
			}
		})
	}

	// A runtime that ignores the label filter must not make Locate hand
	// out another pod's sandbox.
	f.mu.Lock()
	f.ignoreFilter = true
	f.mu.Unlock()
	if n, err := loc.Locate(ctx, pod("u-missing")); !errors.Is(err, ErrNotFound) {
		n.Close()
		t.Errorf("Locate with a runtime ignoring the filter = %v, %v; want ErrNotFound", n.Path, err)
	}
}

// TestCRILocateFake locates real namespaces the test made, through a server
// speaking the CRI API, and checks that the newest sandbox wins.
func TestCRILocateFake(t *testing.T) {
	older, newer := testnetns.New(t), testnetns.New(t)
	path := func(ns *testnetns.NS) string { return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(ns.Handle)) }
	loc := startFakeCRI(t, &fakeCRI{sandboxes: []fakeCRISandbox{
		{sb: criReady("old", "u1", 100), info: criInfoWithPath(path(older))},
		{sb: criReady("new", "u1", 200), info: criInfoWithPath(path(newer))},
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := loc.Locate(ctx, Pod{Namespace: "ns", Name: "p", UID: "u1"})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if !n.Handle.Equal(newer.Handle) || n.Handle.Equal(older.Handle) {
		t.Errorf("Locate opened %s (%s), want the newer sandbox's namespace %s", n.Path, n.Handle, newer.Handle)
	}
	if n.Via != "cri" || n.Path != path(newer) {
		t.Errorf("Locate = {Path %q, Via %q}, want {%q, cri}", n.Path, n.Via, path(newer))
	}
}

// TestCRIContainerd runs real pod sandboxes in a private containerd through
// its CRI plugin, as the kubelet does, and checks that Locate opens exactly
// the namespace containerd made for each, that the newest sandbox of a pod
// wins, that a hostNetwork sandbox is refused and that a removed sandbox is
// ErrNotFound.
func TestCRIContainerd(t *testing.T) {
	ctr := testcri.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	loc, err := NewCRI(ctx, ctr.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer loc.Close()
	// Not /proc/self/ns/net: other tests may have left the main thread in
	// one of their namespaces (see criStartNetns).
	if criStartNetnsErr != nil {
		t.Fatal(criStartNetnsErr)
	}
	hostID := criStartNetns

	pod := Pod{Namespace: "default", Name: "web-0", UID: "0b3c9c1e-kst-web-0"}
	if n, err := loc.Locate(ctx, pod); !errors.Is(err, ErrNotFound) {
		n.Close()
		t.Fatalf("Locate before any sandbox = %v, %v; want ErrNotFound", n.Path, err)
	}

	first := ctr.RunSandbox(ctx, testcri.Sandbox{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID})
	firstID := checkCRISandbox(t, ctx, ctr, loc, pod, first, hostID)

	// The kubelet replaces a dead sandbox with a new attempt; while both are
	// ready, the newer one is the pod's.
	second := ctr.RunSandbox(ctx, testcri.Sandbox{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID, Attempt: 1})
	secondID := checkCRISandbox(t, ctx, ctr, loc, pod, second, hostID)
	if firstID == secondID {
		t.Fatalf("two sandboxes share namespace %v", firstID)
	}

	// A hostNetwork pod is refused, both by the status and by the verbose
	// info containerd gives for it.
	hostPod := Pod{Namespace: "kube-system", Name: "agent", UID: "5e6f-kst-agent"}
	hostSB := ctr.RunSandbox(ctx, testcri.Sandbox{Namespace: hostPod.Namespace, Name: hostPod.Name, UID: hostPod.UID, HostNetwork: true})
	if n, err := loc.Locate(ctx, hostPod); err == nil || errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "host network") {
		n.Close()
		t.Errorf("Locate of a hostNetwork sandbox = %v, %v; want a host network refusal", n.Path, err)
	} else if !strings.Contains(err.Error(), hostSB) || !strings.Contains(err.Error(), hostPod.String()) {
		t.Errorf("error %q should name the sandbox and the pod", err)
	}
	st, err := ctr.Runtime.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: hostSB, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if p, err := criNetnsPath(st.GetInfo()); !errors.Is(err, ErrHostNetwork) {
		t.Errorf("criNetnsPath(containerd's info of a hostNetwork sandbox) = %q, %v; want a host network refusal\ninfo: %s", p, err, st.GetInfo()["info"])
	}

	// Removing the newer sandbox leaves the older; removing that too
	// leaves nothing.
	ctr.RemoveSandbox(ctx, second)
	n, err := loc.Locate(ctx, pod)
	if err != nil {
		t.Fatalf("Locate after removing the newer sandbox: %v", err)
	}
	if got := idOfHandle(t, n.Handle); got != firstID {
		t.Errorf("after removing the newer sandbox Locate opened %v, want the older %v", got, firstID)
	}
	n.Close()
	ctr.RemoveSandbox(ctx, first)
	if n, err := loc.Locate(ctx, pod); !errors.Is(err, ErrNotFound) {
		n.Close()
		t.Fatalf("Locate after RemovePodSandbox = %v, %v; want ErrNotFound", n.Path, err)
	}
	ctr.RemoveSandbox(ctx, hostSB)
}

// checkCRISandbox locates pod, expects sandbox id's namespace, and returns
// its identity.
func checkCRISandbox(t *testing.T, ctx context.Context, ctr *testcri.Containerd, loc *CRI, pod Pod, id string, hostID nsID) nsID {
	t.Helper()
	n, err := loc.Locate(ctx, pod)
	if err != nil {
		t.Fatalf("Locate(%s) with sandbox %s running: %v\ncontainerd log:\n%s", pod, id, err, ctr.LogTail(20))
	}
	defer n.Close()
	got := idOfHandle(t, n.Handle)

	// The path containerd reports for this very sandbox...
	st, err := ctr.Runtime.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	reported, err := criNetnsPath(st.GetInfo())
	if err != nil {
		t.Fatalf("criNetnsPath(containerd's own info): %v\ninfo: %s", err, st.GetInfo()["info"])
	}
	if n.Path != reported || n.Via != "cri" {
		t.Errorf("Locate = {Path %q, Via %q}, want {%q, cri}", n.Path, n.Via, reported)
	}
	if !strings.HasPrefix(reported, ctr.Dir+"/") || !strings.Contains(reported, "/netns/cni-") {
		t.Errorf("containerd reported netns %q, expected a cni-* mount under %s", reported, ctr.Dir)
	}
	// ...and its sandbox process's namespace are the one Locate opened.
	pid := ctr.SandboxPid(ctx, id)
	for what, want := range map[string]nsID{
		"path containerd reports (" + reported + ")":               idOfPath(t, reported),
		fmt.Sprintf("/proc/%d/ns/net of the sandbox process", pid): idOfPath(t, fmt.Sprintf("/proc/%d/ns/net", pid)),
	} {
		if got != want {
			t.Errorf("Locate opened namespace %v, but the %s is %v", got, what, want)
		}
	}
	if got == hostID {
		t.Fatalf("Locate opened the host's network namespace")
	}
	// It is the namespace the CNI plugin set up: eth0 with the pod's IP.
	nl, err := netlink.NewHandleAt(n.Handle, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	eth0, err := nl.LinkByName("eth0")
	if err != nil {
		t.Fatalf("no eth0 in the located namespace: %v", err)
	}
	addrs, err := nl.AddrList(eth0, netlink.FAMILY_V4)
	if err != nil || len(addrs) != 1 || addrs[0].IP.String() != "10.253.0.2" {
		t.Errorf("eth0 addresses in the located namespace = %v, %v; want 10.253.0.2", addrs, err)
	}
	return got
}
