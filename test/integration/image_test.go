package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
	"github.com/cmdnu/kube-service-tunnel/internal/iptbackend"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
	"github.com/cmdnu/kube-service-tunnel/test/support/testcri"
	"github.com/cmdnu/kube-service-tunnel/test/support/testdocker"
	"github.com/cmdnu/kube-service-tunnel/test/support/testimages"
	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// imageBudget is each image's compressed size budget.
const imageBudget = 40e6

// TestImages builds both images as make image does, then loads them into
// a real Docker engine and a real containerd (where the CRI, as kubelet
// asks it, must find them by the manifest's name), copies them with skopeo,
// runs what each executes, and runs the router's image in containerd on a
// node whose rules are in either iptables backend.
func TestImages(t *testing.T) {
	testnetns.RequireRoot(t)
	version := fmt.Sprintf("it-%d", time.Now().Unix())
	dir := t.TempDir()
	results := testimages.Build(t, dir, "kst-it", version)

	t.Run("within budget and reproducible", func(t *testing.T) {
		again := testimages.Build(t, t.TempDir(), "kst-it", version)
		for name, r := range results {
			t.Logf("%s: %.1f MB compressed, %d runtime files", r.Ref, float64(r.Size)/1e6, r.RuntimeFiles)
			if r.Size > imageBudget {
				t.Errorf("%s: %.1f MB compressed, over the %.0f MB budget", r.Ref, float64(r.Size)/1e6, imageBudget/1e6)
			}
			a, b := readFile(t, r.Archive), readFile(t, again[name].Archive)
			if string(a) != string(b) || r.Digest != again[name].Digest {
				t.Errorf("%s: a second build differs (digest %s, then %s)", name, r.Digest, again[name].Digest)
			}
		}
	})

	t.Run("the manifests name the built images", func(t *testing.T) {
		want := map[string]bool{}
		for _, r := range results {
			want[r.Ref] = true
		}
		for name, src := range map[string][]byte{"tunnel-router.yaml": repoFile(t, "tunnel-router.yaml"), "tunnel-uninstall.yaml": image.Uninstall} {
			rendered, err := image.RenderManifest(src, "kst-it", version)
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]bool{}
			for _, ds := range decodeManifest(t, rendered).daemonSets {
				for _, c := range append(ds.Spec.Template.Spec.InitContainers, ds.Spec.Template.Spec.Containers...) {
					got[c.Image] = true
				}
			}
			if !maps.Equal(got, want) {
				t.Errorf("%s rendered by make manifest names %v, make image built %v", name, slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want)))
			}
		}
	})

	t.Run("docker load", func(t *testing.T) {
		e := testdocker.Start(t)
		for _, r := range results {
			if out := e.Docker(t, "load", "-i", r.Archive); !strings.Contains(out, r.Ref) {
				t.Errorf("docker load %s: %q, want it to name %s", r.Archive, out, r.Ref)
			}
			runs := map[string]string{"": r.Daemon.Name + " " + version, "/sbin/modprobe": "kmod version"}
			if r.Daemon.Name == image.Router.Name {
				for _, cmd := range []string{"iptables", "ip6tables"} {
					runs["/usr/sbin/"+cmd+"-nft"] = "(nf_tables)"
					runs["/usr/sbin/"+cmd+"-legacy"] = "(legacy)"
					runs["/usr/sbin/"+cmd+"-nft-save"] = "v1.8"
					runs["/usr/sbin/"+cmd+"-legacy-restore"] = "v1.8"
				}
				runs["/usr/sbin/conntrackd"] = "userspace daemon v1.4"
			}
			for entrypoint, want := range runs {
				args := []string{"run", "--rm", "--network", "none"}
				if entrypoint != "" {
					args = append(args, "--entrypoint", entrypoint)
				}
				if out := e.Docker(t, append(args, r.Ref, "--version")...); !strings.Contains(out, want) {
					t.Errorf("%s %s --version: %q, want %q", r.Ref, entrypoint, out, want)
				}
			}
		}
	})

	t.Run("skopeo copy", func(t *testing.T) {
		if _, err := exec.LookPath("skopeo"); err != nil {
			if kubeenv.IntegrationRequired() {
				t.Fatal("KST_REQUIRE_INTEGRATION=1 but skopeo is not installed (make deps)")
			}
			t.Skip("skopeo is not installed")
		}
		for _, r := range results {
			out, err := exec.Command("skopeo", "inspect", "oci-archive:"+r.Archive).Output()
			if err != nil {
				t.Fatalf("skopeo inspect %s: %v", r.Archive, err)
			}
			var info struct {
				Digest string
				Labels map[string]string
			}
			if err := json.Unmarshal(out, &info); err != nil {
				t.Fatal(err)
			}
			if info.Digest != r.Digest || info.Labels["org.opencontainers.image.version"] != version {
				t.Errorf("skopeo sees %s version %q, want %s version %s", info.Digest, info.Labels["org.opencontainers.image.version"], r.Digest, version)
			}
			dst := t.TempDir()
			if out, err := exec.Command("skopeo", "copy", "oci-archive:"+r.Archive, "docker-archive:"+filepath.Join(dst, "copy.tar")+":"+r.Ref).CombinedOutput(); err != nil {
				t.Errorf("skopeo copy %s: %v\n%s", r.Archive, err, out)
			}
		}
	})

	c := testcri.Start(t)
	ctx := context.Background()
	t.Run("ctr import, found by the CRI", func(t *testing.T) {
		for _, r := range results {
			t.Logf("ctr images import %s: %s", r.Archive, c.Ctr("images", "import", "--snapshotter", "native", r.Archive))
			img := c.ImageStatus(ctx, r.Ref)
			if img == nil {
				t.Fatalf("the CRI does not find %s after ctr import: kubelet would pull it; containerd has:\n%s", r.Ref, c.Ctr("images", "ls", "-q"))
			}
			if want := "docker.io/" + r.Ref; !contains(img.GetRepoTags(), want) {
				t.Errorf("CRI tags %v, want %s", img.GetRepoTags(), want)
			}
		}
	})

	router := results[image.Router.Name]
	for _, backend := range []iptbackend.Backend{iptbackend.Legacy, iptbackend.NFT} {
		t.Run("the router in a container writes with the node's backend/"+string(backend), func(t *testing.T) {
			if c.ImageStatus(ctx, router.Ref) == nil {
				t.Skip("the router's image was not imported")
			}
			containerisedRouter(t, c, "docker.io/"+router.Ref, backend) // ctr does not normalise names
		})
	}
}

// containerisedRouter runs the router's image in containerd, in a network
// namespace of its own standing for a node whose kubelet uses backend
// (kubelet's hint chain is there, and more rules in the other backend, so
// that only the hint can point to backend). The router must write its rules
// in backend only, and its --cleanup, from the same image, must leave the
// namespace exactly as it was.
func containerisedRouter(t *testing.T, c *testcri.Containerd, ref string, backend iptbackend.Backend) {
	other := iptbackend.NFT
	if backend == iptbackend.NFT {
		other = iptbackend.Legacy
	}
	ctx := context.Background()
	ns := fmt.Sprintf("kst-it-img-%s-%d", backend, time.Now().UnixNano()%1e6)
	run := func(name string, args ...string) string {
		t.Helper()
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("ip", "netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	in := func(args ...string) string { return run("ip", append([]string{"netns", "exec", ns}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	// Without DAD the veths' link-local addresses, and their local routes,
	// exist as soon as the links are up: the snapshot below sees them.
	in("sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0")
	in("ip", "link", "add", "veth0", "type", "veth", "peer", "name", "veth0p")
	in("ip", "link", "set", "veth0", "up")
	in("ip", "link", "set", "veth0p", "up")
	in("ip", "addr", "add", "10.99.0.1/24", "dev", "veth0")
	in(backend.Binary("iptables"), "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
	for i := 1; i <= 3; i++ {
		in(other.Binary("iptables"), "-A", "INPUT", "-s", fmt.Sprintf("198.51.100.%d", i), "-j", "ACCEPT")
	}
	before, err := kstate.Snapshot(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}

	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig, routerConfig(t)); err != nil {
		t.Fatal(err)
	}
	handle, err := netns.GetFromName(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer handle.Close()
	stopRelay, err := testnetns.ForwardLoopback(handle, strings.TrimPrefix(env.Host(), "https://"))
	if err != nil {
		t.Fatal(err)
	}
	defer stopRelay()
	lock, err := os.OpenFile("/run/xtables.lock", os.O_CREATE|os.O_RDONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	lock.Close()
	// What the manifest gives the router: the node's network, the xtables
	// lock, NET_ADMIN (and NET_RAW, in containerd's defaults).
	ctrRun := func(id string, args ...string) *exec.Cmd {
		return c.CtrCommand(append([]string{"run", "--rm", "--snapshotter", "native",
			"--with-ns", "network:/run/netns/" + ns,
			"--mount", "type=bind,src=" + kubeconfig + ",dst=/etc/kst/kubeconfig,options=rbind:ro",
			"--mount", "type=bind,src=/run/xtables.lock,dst=/run/xtables.lock,options=rbind:rw",
			"--cap-add", "CAP_NET_ADMIN", ref, id, "/usr/local/bin/tunnel-router"}, args...)...)
	}
	id := "kst-it-router-" + string(backend)
	logPath := filepath.Join(t.TempDir(), "router.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := ctrRun(id, "--kubeconfig", "/etc/kst/kubeconfig", "--seed", "0x5eed", "--gre-device", "veth0",
		"--gre6-device", "veth0", "--gre-device-create=false", "--metrics-address", "", "--pools", "192.0.2.0/24;2001:db8:2::/64")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stopped := false
	defer func() {
		if !stopped {
			_ = c.CtrCommand("task", "kill", "-s", "SIGKILL", id).Run()
			<-exited
		}
	}()

	chainDecl := ":" + datapath.DefaultChain + " "
	deadline := time.Now().Add(90 * time.Second)
	for {
		if out, err := exec.Command("ip", "netns", "exec", ns, backend.Binary("iptables")+"-save", "-t", "mangle").Output(); err == nil && strings.Contains(string(out), chainDecl) &&
			strings.Contains(readLog(logPath), "resynced datapath") {
			break
		}
		select {
		case err := <-exited:
			stopped = true
			t.Fatalf("the containerised router exited (%v):\n%s", err, readLog(logPath))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no chain %s in %s after 90 s; router log:\n%s", datapath.DefaultChain, backend, readLog(logPath))
		}
		time.Sleep(300 * time.Millisecond)
	}
	// The image's ip6tables of the same backend holds the IPv6 chain.
	if out, err := exec.Command("ip", "netns", "exec", ns, backend.Binary("ip6tables")+"-save", "-t", "mangle").CombinedOutput(); err != nil ||
		!strings.Contains(string(out), ":"+datapath.DefaultChain6+" ") {
		t.Errorf("no chain %s in %s's ip6tables (%v):\n%s\nrouter log:\n%s", datapath.DefaultChain6, backend, err, out, readLog(logPath))
	}
	chosen := ""
	for _, line := range strings.Split(readLog(logPath), "\n") {
		if strings.Contains(line, "iptables backend chosen") {
			chosen = line
		}
	}
	if !strings.Contains(chosen, "backend="+string(backend)) {
		t.Errorf("router log %q, want backend=%s", chosen, backend)
	}
	running, err := kstate.Snapshot(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	otherSection := "iptables/"
	if other == iptbackend.Legacy {
		otherSection = "iptables-legacy/"
	}
	for section, lines := range running.Sections {
		if strings.HasPrefix(section, otherSection) && strings.Join(lines, "\n") != strings.Join(before.Sections[section], "\n") {
			t.Errorf("the router changed %s, the backend the node does not use:\n%s", section, strings.Join(lines, "\n"))
		}
	}

	c.Ctr("task", "kill", "-s", "SIGTERM", id)
	select {
	case <-exited:
		stopped = true
	case <-time.After(30 * time.Second):
		t.Fatalf("the router did not stop on SIGTERM; log:\n%s", readLog(logPath))
	}
	if out, err := ctrRun(id+"-cleanup", "--cleanup").CombinedOutput(); err != nil {
		t.Fatalf("tunnel-router --cleanup in its image: %v\n%s", err, out)
	}
	after, err := kstate.Snapshot(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	if d := kstate.Diff(before, after); d != "" {
		t.Errorf("after --cleanup the node is not as before the router:\n%s", d)
	}
}

func readLog(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
