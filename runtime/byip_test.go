package runtime

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// The tests of this file use addresses from 198.19.201.0/24 (benchmark
// range), one per test, so that tests of other packages running at the same
// time, which also create namespaces, never hold them.

func podWithIP(ip string) Pod {
	return Pod{Namespace: "default", Name: "web", UID: "uid-1", IP: netip.MustParseAddr(ip)}
}

// vethNS returns a fresh namespace with ip/24 on one end of a veth pair.
func vethNS(t *testing.T, ip string, loAddrs ...netip.Prefix) *testnetns.NS {
	t.Helper()
	ns := testnetns.New(t, loAddrs...)
	ns.AddVeth("eth0", "peer0", netip.PrefixFrom(netip.MustParseAddr(ip), 24))
	return ns
}

// processIn starts a sleep inside ns, so that a scan of /proc finds the
// namespace, and returns its PID; it is killed when the test ends.
func processIn(t *testing.T, ns *testnetns.NS) int {
	t.Helper()
	var cmd *exec.Cmd
	// Forked from the thread inside ns, sleep inherits ns. The thread ends
	// right after, so no Pdeathsig: it would kill sleep at once.
	err := ns.Do(func() error {
		cmd = exec.Command("sleep", "600")
		return cmd.Start()
	})
	if err != nil {
		t.Fatalf("start a process in the test netns: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd.Process.Pid
}

// bindNS bind-mounts ns at dir/name, as ip netns add does in /run/netns.
func bindNS(t *testing.T, ns *testnetns.NS, dir, name string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", int(ns.Handle)), path, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount the test netns at %s: %v", path, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(path, unix.MNT_DETACH) })
	return path
}

func procNetns(pid int) string { return fmt.Sprintf("/proc/%d/ns/net", pid) }

func TestByIPFindsAProcessNamespace(t *testing.T) {
	const ip = "198.19.201.1"
	ns := vethNS(t, ip)
	pid := processIn(t, ns)

	b := NewByIP()
	if b.Name() != "netns" {
		t.Errorf("Name() = %q", b.Name())
	}
	got, err := b.Locate(context.Background(), podWithIP(ip))
	if err != nil {
		t.Fatalf("Locate: %v", err)
	}
	defer got.Close()
	if got.Path != procNetns(pid) || got.Via != "netns" {
		t.Errorf("got %s via %s, want %s via netns", got.Path, got.Via, procNetns(pid))
	}
	if !got.Handle.Equal(ns.Handle) {
		t.Fatalf("opened namespace %v, want the test's %v", got.Handle, ns.Handle)
	}
}

func TestByIPFindsANamedNamespaceOnce(t *testing.T) {
	const ip = "198.19.201.2"
	ns := vethNS(t, ip)
	dir := t.TempDir()
	// Three ways to the same namespace: two names and a process. Counting
	// them as three would make the pod ambiguous.
	first := bindNS(t, ns, dir, "a-pod")
	bindNS(t, ns, dir, "b-pod")
	processIn(t, ns)

	b := NewByIP()
	b.netnsDirs = []string{dir}
	got, err := b.Locate(context.Background(), podWithIP(ip))
	if err != nil {
		t.Fatalf("Locate: %v", err)
	}
	defer got.Close()
	if got.Path != first {
		t.Errorf("got %s, want the name %s (names come first)", got.Path, first)
	}
	if !got.Handle.Equal(ns.Handle) {
		t.Fatalf("opened namespace %v, want the test's %v", got.Handle, ns.Handle)
	}
}

func TestByIPIgnoresAnAddressOnLoopback(t *testing.T) {
	const onLo, onVeth = "198.19.201.3", "198.19.201.4"
	ns := vethNS(t, onVeth, netip.MustParsePrefix(onLo+"/32"))
	processIn(t, ns)

	b := NewByIP()
	if _, err := b.Locate(context.Background(), podWithIP(onLo)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("address on lo only: got %v, want ErrNotFound", err)
	}
	// The same namespace is found by its veth address: it was searched.
	got, err := b.Locate(context.Background(), podWithIP(onVeth))
	if err != nil {
		t.Fatalf("address on the veth: %v", err)
	}
	got.Close()
}

func TestByIPRefusesToGuessBetweenTwoNamespaces(t *testing.T) {
	const ip = "198.19.201.5"
	dir := t.TempDir()
	named := bindNS(t, vethNS(t, ip), dir, "pod-a")
	pid := processIn(t, vethNS(t, ip))

	b := NewByIP()
	b.netnsDirs = []string{dir}
	_, err := b.Locate(context.Background(), podWithIP(ip))
	if !errors.Is(err, ErrAmbiguous) || errors.Is(err, ErrNotFound) {
		t.Fatalf("got %v, want ErrAmbiguous", err)
	}
	for _, path := range []string{named, procNetns(pid)} {
		if !strings.Contains(err.Error(), path) {
			t.Errorf("error %q does not name %s", err, path)
		}
	}
}

func TestByIPUnknownAddress(t *testing.T) {
	testnetns.RequireRoot(t)
	_, err := NewByIP().Locate(context.Background(), podWithIP("198.19.201.250"))
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "default/web") {
		t.Fatalf("got %v, want ErrNotFound naming the pod", err)
	}
}

func TestByIPNeverMatchesTheHostOrItsOwnNamespace(t *testing.T) {
	const ip = "198.19.201.6"
	dir := t.TempDir()
	named := bindNS(t, vethNS(t, ip), dir, "pod")

	b := NewByIP()
	b.netnsDirs, b.procRoot = []string{dir}, ""
	got, err := b.Locate(context.Background(), podWithIP(ip))
	if err != nil {
		t.Fatalf("control, as a pod's namespace: %v", err)
	}
	got.Close()

	// The same namespace, when it is the host's (PID 1's) or the agent's.
	for _, role := range []string{"host", "self"} {
		b := NewByIP()
		b.netnsDirs, b.procRoot = []string{dir}, ""
		if role == "host" {
			b.hostNetns = named
		} else {
			b.selfNetns = named
		}
		if _, err := b.Locate(context.Background(), podWithIP(ip)); !errors.Is(err, ErrNotFound) {
			t.Errorf("as the %s's namespace: got %v, want ErrNotFound", role, err)
		}
	}
}

// TestByIPCandidates checks, without root, which paths a scan would open:
// one per namespace, processes that are gone and files that are not
// namespaces left out.
func TestByIPCandidates(t *testing.T) {
	proc := t.TempDir()
	for pid, target := range map[string]string{
		"42":   "/proc/self/ns/net",
		"43":   "/proc/self/ns/net",                    // the same namespace again
		"44":   filepath.Join(proc, "no-such-process"), // exited during the scan
		"self": "/proc/self/ns/net",                    // not a PID
	} {
		if err := os.MkdirAll(filepath.Join(proc, pid, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(proc, pid, "ns", "net")); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(proc, "45"), 0o755); err != nil { // no ns directory
		t.Fatal(err)
	}
	named := t.TempDir()
	if err := os.WriteFile(filepath.Join(named, "stale"), nil, 0o444); err != nil { // an undone bind mount
		t.Fatal(err)
	}

	b := &ByIP{netnsDirs: []string{named, filepath.Join(named, "missing")}, procRoot: proc}
	got := b.candidates(nil)
	if len(got) != 1 || got[0].path != filepath.Join(proc, "42", "ns", "net") {
		t.Fatalf("candidates %v, want only %s", got, filepath.Join(proc, "42", "ns", "net"))
	}
	if want := idOfPath(t, "/proc/self/ns/net"); got[0].key != want {
		t.Errorf("candidate key %v, want %v", got[0].key, want)
	}
	if got := b.candidates(map[nsID]bool{idOfPath(t, "/proc/self/ns/net"): true}); len(got) != 0 {
		t.Errorf("candidates %v, want none when the only namespace is left out", got)
	}
}

func TestByIPWithoutAnIP(t *testing.T) {
	_, err := NewByIP().Locate(context.Background(), Pod{Namespace: "default", Name: "web"})
	if err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("got %v, want an error that is not ErrNotFound", err)
	}
}

// TestByIPHostKeyFallsBackToKthreadd checks, without root, where the host's
// namespace is taken from when PID 1's cannot be read.
func TestByIPHostKeyFallsBackToKthreadd(t *testing.T) {
	want := idOfPath(t, "/proc/thread-self/ns/net")
	fake := func(t *testing.T, comm string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "comm"), []byte(comm), 0o444); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("/proc/thread-self/ns/net", filepath.Join(dir, "ns", "net")); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	unreadable := filepath.Join(t.TempDir(), "pid1-net")

	b := &ByIP{hostNetns: unreadable, kthreadd: fake(t, "kthreadd\n")}
	if got, err := b.hostKey(); err != nil || got != want {
		t.Errorf("with kthreadd: got %v, %v; want %v", got, err, want)
	}
	b = &ByIP{hostNetns: unreadable, kthreadd: fake(t, "sleep\n")}
	if _, err := b.hostKey(); err == nil {
		t.Error("PID 2 is not kthreadd (no host PID namespace): got a key, want an error")
	}
	b = &ByIP{hostNetns: "/proc/thread-self/ns/net", kthreadd: fake(t, "sleep\n")}
	if got, err := b.hostKey(); err != nil || got != want {
		t.Errorf("PID 1 readable: got %v, %v; want %v", got, err, want)
	}
}

// TestByIPDualStack: a dual-stack pod's namespace is the one holding both
// its addresses; an IPv6-only pod's is found by its IPv6 address. Named
// namespaces only, so that the test's three are the whole search.
func TestByIPDualStack(t *testing.T) {
	const v4, v4Other = "198.19.201.7", "198.19.201.8"
	v6 := netip.MustParseAddr("2001:2:0:201::7")
	dir := t.TempDir()
	both := vethNS(t, v4)
	both.Run("ip", "-6", "addr", "add", v6.String()+"/64", "dev", "eth0", "nodad")
	// Holds the pod's IPv4 address but not its IPv6 one (a stale sandbox,
	// say): a search by the IPv4 address alone would be ambiguous.
	onlyV4 := vethNS(t, v4)
	// Holds the IPv6 address, with another IPv4 address.
	onlyV6 := vethNS(t, v4Other)
	onlyV6.Run("ip", "-6", "addr", "add", v6.String()+"/64", "dev", "eth0", "nodad")
	bindNS(t, both, dir, "a-both")
	bindNS(t, onlyV4, dir, "b-only-v4")
	bindNS(t, onlyV6, dir, "c-only-v6")

	b := NewByIP()
	b.netnsDirs, b.procRoot = []string{dir}, ""
	locate := func(pod Pod) (Netns, error) { return b.Locate(context.Background(), pod) }

	pod := podWithIP(v4)
	if _, err := locate(pod); !errors.Is(err, ErrAmbiguous) {
		t.Fatalf("by the IPv4 address alone: got %v, want ErrAmbiguous (the control)", err)
	}
	pod.IPv6 = v6
	got, err := locate(pod)
	if err != nil {
		t.Fatalf("dual-stack pod: %v", err)
	}
	if !got.Handle.Equal(both.Handle) {
		t.Errorf("dual-stack pod: opened %s, want the namespace holding both addresses", got.Path)
	}
	got.Close()

	// No namespace holds this pair: each holds one of the two.
	pod.IP = netip.MustParseAddr("198.19.201.9")
	if _, err := locate(pod); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "198.19.201.9 and 2001:2:0:201::7") {
		t.Fatalf("addresses split across namespaces: got %v, want ErrNotFound naming both", err)
	}

	v6only := Pod{Namespace: "default", Name: "web6", UID: "uid-6", IPv6: netip.MustParseAddr("2001:2:0:201::8")}
	onlyV6.Run("ip", "-6", "addr", "add", "2001:2:0:201::8/64", "dev", "eth0", "nodad")
	got, err = locate(v6only)
	if err != nil {
		t.Fatalf("IPv6-only pod: %v", err)
	}
	if !got.Handle.Equal(onlyV6.Handle) {
		t.Errorf("IPv6-only pod: opened %s, want c-only-v6", got.Path)
	}
	got.Close()
	// An IPv6 address on lo does not count, as an IPv4 one does not.
	both.Run("ip", "-6", "addr", "add", "2001:2:0:201::9/128", "dev", "lo")
	if _, err := locate(Pod{Name: "lo6", IPv6: netip.MustParseAddr("2001:2:0:201::9")}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("IPv6 address on lo only: got %v, want ErrNotFound", err)
	}
}

func TestPodAddrs(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00::5")
	for _, tc := range []struct {
		pod  Pod
		want string
	}{
		{Pod{}, "[]"},
		{Pod{IP: v4}, "[10.1.0.5]"},
		{Pod{IPv6: v6}, "[fd00::5]"},
		{Pod{IP: v4, IPv6: v6}, "[10.1.0.5 fd00::5]"},
	} {
		if got := fmt.Sprint(tc.pod.Addrs()); got != tc.want {
			t.Errorf("%+v.Addrs() = %s, want %s", tc.pod, got, tc.want)
		}
	}
	if p := (Pod{IP: v4, IPv6: v6}); p.Addr(false) != v4 || p.Addr(true) != v6 {
		t.Errorf("Addr picks the wrong family")
	}
}
