package lab

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab/guest"
)

// Where a cluster run puts things in the VM, and how the guest program
// learns the API server's address: see package guest.
const (
	GuestBinDir  = guest.BinDir
	GuestKubeDir = guest.KubeDir
	GuestProgram = guest.Program
	EnvGuest     = guest.EnvGuest
	EnvAPIAddr   = guest.EnvAPIAddr
)

// ClusterHostBinaries are the host programs RunCluster puts into the VM with
// their shared libraries: BIRD 2 (Debian's bird2), the gateway's BGP daemon
// (topology.EnableBGP), and its control client; conntrackd, which the
// routers run to share their conntrack entries (--conntrack-sync-interface).
var ClusterHostBinaries = []string{"bird", "birdc", "conntrackd"}

// ManifestNamespace is the namespace of tunnel-router.yaml's ServiceAccounts.
const ManifestNamespace = "kube-service-tunnel"

// Daemon service accounts, as in tunnel-router.yaml.
var daemonAccounts = []string{"tunnel-router", "tunnel-endpoint"}

// ClusterOptions describe RunCluster's VM.
type ClusterOptions struct {
	// Assets are the kernel and modules (Require or PrepareAssets).
	Assets Assets
	// Env is a running API server on the host's loopback.
	Env *kubeenv.Env
	// Program is a static Go binary run in the VM as GuestProgram, with
	// Args, from /tmp. Build it with BuildStatic or BuildStaticTest.
	Program string
	Args    []string
	// Files are more host files to put in the VM, by VM path.
	Files map[string]string
	// Output receives the console as it is printed (may be nil).
	Output io.Writer
	// MemoryMB and CPUs of the VM: 0 means 2048 and 2.
	MemoryMB, CPUs int
}

// RunCluster is the lab's whole-cluster run: it applies tunnel-router.yaml to
// the API server (RBAC, ConfigMap, DaemonSets that nothing runs), writes a
// kubeconfig for the admin and for each daemon's own ServiceAccount, builds
// the two daemons statically, and boots the VM with them, the kubeconfigs,
// BIRD (ClusterHostBinaries) and the caller's program, which reaches the API
// server through guestfwd. It returns the console output and the program's
// exit code.
func RunCluster(ctx context.Context, opts ClusterOptions) (output string, exitCode int, err error) {
	if opts.Env == nil || opts.Program == "" {
		return "", -1, fmt.Errorf("lab: ClusterOptions needs Env and Program")
	}
	dir, err := os.MkdirTemp("", "kst-cluster-")
	if err != nil {
		return "", -1, err
	}
	defer os.RemoveAll(dir)

	for _, b := range ClusterHostBinaries {
		if _, err := exec.LookPath(b); err != nil {
			return "", -1, fmt.Errorf("lab: %w (apt-get install bird2 conntrackd, or make deps)", err)
		}
	}
	// conntrackd names the protocols of its filter through /etc/protocols.
	files := map[string]string{GuestProgram: opts.Program, "/etc/protocols": "/etc/protocols"}
	for vmPath, hostPath := range opts.Files {
		files[vmPath] = hostPath
	}
	daemons, err := BuildDaemons(filepath.Join(dir, "bin"))
	if err != nil {
		return "", -1, err
	}
	for name, path := range daemons {
		files[GuestBinDir+"/"+name] = path
	}
	kubeconfigs, err := writeKubeconfigs(ctx, opts.Env, filepath.Join(dir, "kube"))
	if err != nil {
		return "", -1, err
	}
	for name, path := range kubeconfigs {
		files[GuestKubeDir+"/"+name] = path
	}

	apiAddr := strings.TrimPrefix(opts.Env.Host(), "https://")
	_, portText, err := net.SplitHostPort(apiAddr)
	if err != nil {
		return "", -1, fmt.Errorf("lab: API server address: %w", err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		return "", -1, fmt.Errorf("lab: API server port: %w", err)
	}
	script := guestScript(EnvAPIAddr+"="+apiAddr, opts.Args)
	ir, err := BuildInitramfs(InitramfsOptions{Assets: opts.Assets, Output: filepath.Join(dir, "initrd.cpio"), Script: script, Files: files, HostBinaries: ClusterHostBinaries})
	if err != nil {
		return "", -1, err
	}
	mem, cpus := opts.MemoryMB, opts.CPUs
	if mem == 0 {
		mem = 2048
	}
	if cpus == 0 {
		cpus = 2
	}
	return Boot(ctx, ir, BootOptions{Kernel: opts.Assets.Kernel, MemoryMB: mem, CPUs: cpus, ForwardHostPorts: []int{port}, Output: opts.Output})
}

// guestScript is the /lab/run.sh that runs GuestProgram with args from
// /tmp, with EnvGuest=1, env (more NAME=VALUE words, may be empty) and the
// host's KST_E2E_* settings (KST_E2E_DRAIN_FULL, ...) in its environment.
func guestScript(env string, args []string) string {
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	var quoted strings.Builder
	for _, a := range args {
		quoted.WriteString(" " + quote(a))
	}
	var forward strings.Builder
	if env != "" {
		forward.WriteString(" " + env)
	}
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KST_E2E_") {
			forward.WriteString(" " + quote(kv))
		}
	}
	return "#!/bin/sh\n" +
		"export PATH=/usr/sbin:/usr/bin:/sbin:/bin " + EnvGuest + "=1" + forward.String() + "\n" +
		"cd /tmp\n" + GuestProgram + quoted.String() + "\n"
}

// writeKubeconfigs applies tunnel-router.yaml and writes admin.kubeconfig
// plus one kubeconfig per daemon ServiceAccount into dir.
func writeKubeconfigs(ctx context.Context, env *kubeenv.Env, dir string) (map[string]string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	manifest, err := os.ReadFile(filepath.Join(RepoRoot(), "tunnel-router.yaml"))
	if err != nil {
		return nil, err
	}
	if err := env.ApplyYAML(ctx, env.AdminConfig(), manifest, false); err != nil {
		return nil, fmt.Errorf("lab: applying tunnel-router.yaml: %w", err)
	}
	paths := map[string]string{"admin.kubeconfig": filepath.Join(dir, "admin.kubeconfig")}
	if err := env.WriteKubeconfig(paths["admin.kubeconfig"], nil); err != nil {
		return nil, err
	}
	for _, sa := range daemonAccounts {
		cfg, err := env.ServiceAccountConfig(ctx, ManifestNamespace, sa)
		if err != nil {
			return nil, err
		}
		name := sa + ".kubeconfig"
		paths[name] = filepath.Join(dir, name)
		if err := env.WriteKubeconfig(paths[name], cfg); err != nil {
			return nil, err
		}
	}
	return paths, nil
}

// RepoRoot is the repository's top directory.
func RepoRoot() string {
	_, here, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(here), "..", "..")
}

// BuildDaemons builds static, stripped tunnel-router and tunnel-endpoint
// binaries into dir and returns their paths by name.
func BuildDaemons(dir string) (map[string]string, error) {
	bins := map[string]string{}
	for _, name := range []string{"tunnel-router", "tunnel-endpoint"} {
		bins[name] = filepath.Join(dir, name)
		if err := BuildStatic("./cmd/"+name, bins[name]); err != nil {
			return nil, err
		}
	}
	return bins, nil
}

// BuildStatic builds the main package pkg (relative to the repository, e.g.
// "./test/demo/guest") as a static, stripped binary at out.
func BuildStatic(pkg, out string) error {
	return goBuild("build", pkg, out)
}

// BuildStaticTest builds the test binary of pkg statically at out.
func BuildStaticTest(pkg, out string) error {
	return goBuild("test", pkg, out)
}

func goBuild(verb, pkg, out string) error {
	args := []string{verb}
	if verb == "test" {
		args = append(args, "-c")
	}
	args = append(args, "-trimpath", "-ldflags=-s -w", "-o", out, pkg)
	cmd := exec.Command("go", args...)
	cmd.Dir = RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("lab: go %s: %w\n%s", strings.Join(args, " "), err, b)
	}
	return nil
}

// IsGuest reports whether this process is a guest program of RunCluster.
func IsGuest() bool { return os.Getenv(EnvGuest) == "1" }

// goTestResultRE matches go test -v's result lines for subtests.
var goTestResultRE = regexp.MustCompile(`(?m)^\s*--- (PASS|FAIL|SKIP): (\S+) \(([0-9.]+s)\)`)

// RunGuestTests runs the tests of package pkg (e.g. "./test/e2e") that match
// run inside a RunCluster VM, against a real API server started on the host
// for t, and reports each guest (sub)test as a subtest of t with the same
// result. The whole console goes to consoleLog (kept for reading after a
// failure) and, for a failure, its relevant part into t's log.
func RunGuestTests(t *testing.T, pkg, run string, timeout time.Duration, consoleLog string) {
	t.Helper()
	assets := Require(t)
	env := kubeenv.Start(t)
	bin := filepath.Join(t.TempDir(), "guest.test")
	start := time.Now()
	if err := BuildStaticTest(pkg, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s's test binary in %v", pkg, time.Since(start).Round(time.Millisecond))
	logFile, err := os.Create(consoleLog)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	timedFile, err := os.Create(TimedFile(consoleLog))
	if err != nil {
		t.Fatal(err)
	}
	defer timedFile.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start = time.Now()
	watch := WatchBound(t, logFile, timeout)
	defer watch.Stop()
	watch.TimeLinesTo(timedFile)
	out, rc, err := RunCluster(ctx, ClusterOptions{
		Assets: assets, Env: env, Program: bin, Output: watch,
		Args: []string{"-test.run", run, "-test.v", "-test.count=1", "-test.timeout", timeout.String()},
	})
	took := time.Since(start)
	t.Logf("VM ran %s in %v; console: %s (each line timed: %s)", pkg, took.Round(time.Millisecond), consoleLog, TimedFile(consoleLog))
	ReportGuestTests(t, out, rc, err)
	RecordDurations(t, DurationsFile(consoleLog), pkg, out, took)
}

// DurationsFile is where a lab run whose console goes to consoleLog
// writes its DurationReport: /tmp/kst-e2e-console.log gives
// /tmp/kst-e2e-console.durations.txt.
func DurationsFile(consoleLog string) string {
	return strings.TrimSuffix(consoleLog, filepath.Ext(consoleLog)) + ".durations.txt"
}

// RunGuestKernelTests is RunGuestTests without a cluster, for tests that
// program the lab VM's kernel by hand: no API server, no daemons, no BIRD,
// only pkg's test binary (run as GuestProgram, with EnvGuest=1 so that
// IsGuest is true in it) in a VM with the default modules, 2 CPUs and 2 GB.
func RunGuestKernelTests(t *testing.T, pkg, run string, timeout time.Duration, consoleLog string) {
	t.Helper()
	assets := Require(t)
	dir := t.TempDir()
	bin := filepath.Join(dir, "guest.test")
	start := time.Now()
	if err := BuildStaticTest(pkg, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s's test binary in %v", pkg, time.Since(start).Round(time.Millisecond))
	logFile, err := os.Create(consoleLog)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	script := guestScript("", []string{"-test.run", run, "-test.v", "-test.count=1", "-test.timeout", timeout.String()})
	ir, err := BuildInitramfs(InitramfsOptions{Assets: assets, Output: filepath.Join(dir, "initrd.cpio"), Script: script,
		Files: map[string]string{GuestProgram: bin}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start = time.Now()
	watch := WatchBound(t, logFile, timeout)
	defer watch.Stop()
	out, rc, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel, MemoryMB: 2048, CPUs: 2, Output: watch})
	t.Logf("VM ran %s in %v; console: %s", pkg, time.Since(start).Round(time.Millisecond), consoleLog)
	ReportGuestTests(t, out, rc, err)
}

// ReportGuestTests reports each (sub)test a guest test binary printed in
// out (its console, go test -v) as a subtest of t with the same result, and
// fails t when the VM run failed (err, or exit code rc) or printed none.
// The failed tests that have no failed subtest of their own come first:
// their lines say why, and a long report (a parent's diagnostics) after
// them cannot push them out of a log's excerpt.
func ReportGuestTests(t *testing.T, out string, rc int, err error) {
	t.Helper()
	results := guestResults(out)
	for _, r := range results {
		result, name, took := r.result, r.name, r.took
		t.Run(name, func(t *testing.T) {
			switch {
			case result == "FAIL" && r.failedBelow:
				t.Errorf("failed in the VM after %s, in the subtests reported before this:\n%s", took, guestTestLog(out, name))
			case result == "FAIL":
				t.Errorf("failed in the VM after %s:\n%s", took, guestTestLog(out, name))
			case result == "SKIP":
				t.Skipf("skipped in the VM: %s", guestTestLog(out, name))
			default:
				t.Logf("passed in the VM in %s:\n%s", took, guestTestLog(out, name))
			}
		})
	}
	if err != nil || rc != 0 || len(results) == 0 {
		t.Errorf("guest tests: exit code %d, error %v, %d results; console tail:\n%s", rc, err, len(results), LastLines(out, 80))
	}
}

// guestResult is one result line of go test -v.
type guestResult struct {
	result, name, took string
	failedBelow        bool // FAIL, and so is one of its subtests
}

// guestResults are out's result lines, the failed tests without a failed
// subtest first, then the others in the order printed.
func guestResults(out string) []guestResult {
	var all []guestResult
	for _, m := range goTestResultRE.FindAllStringSubmatch(out, -1) {
		all = append(all, guestResult{result: m[1], name: m[2], took: m[3]})
	}
	for i := range all {
		for _, other := range all {
			if all[i].result == "FAIL" && other.result == "FAIL" && strings.HasPrefix(other.name, all[i].name+"/") {
				all[i].failedBelow = true
			}
		}
	}
	var first, rest []guestResult
	for _, r := range all {
		if r.result == "FAIL" && !r.failedBelow {
			first = append(first, r)
		} else {
			rest = append(rest, r)
		}
	}
	return append(first, rest...)
}

// guestTestLog returns the lines go test -v printed for test name: from its
// "=== RUN" (or "=== NAME"/"=== CONT") to the next such header.
func guestTestLog(out, name string) string {
	var b strings.Builder
	in := false
	for _, line := range strings.Split(out, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "=== ") {
			f := strings.Fields(trimmed)
			in = len(f) == 3 && f[2] == name
		}
		if in || strings.HasPrefix(trimmed, "--- FAIL: "+name+" ") {
			b.WriteString(line + "\n")
		}
	}
	return LastLines(b.String(), 200)
}
