// Package lab boots a throwaway qemu VM running Debian's kernel, so tests can
// exercise a real Linux datapath (GRE, IPIP, MPLS, iptables HMARK, network
// namespaces) that the host's kernel lacks.
//
// The flow is: Require (or PrepareAssets) finds the kernel and its modules
// prepared by test/tools/lab-assets.sh; BuildInitramfs packs busybox,
// iproute2, iptables, the modules and the caller's files (static Go binaries,
// a /lab/run.sh script) into an uncompressed cpio; Boot runs qemu on it, returns what
// the VM printed on its serial console and the exit code of /lab/run.sh.
//
// Nothing leaves the VM except, when asked for, TCP connections from the guest
// to 10.0.2.100:PORT, which qemu forwards to the host's 127.0.0.1:PORT.
package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const (
	// EnvAssetsDir names the environment variable that points at the assets
	// folder shared with test/tools/kube-assets.sh; the lab uses its "lab"
	// subfolder.
	EnvAssetsDir = "KST_ASSETS_DIR"
	// EnvRequireIntegration names the environment variable that, when "1",
	// turns a missing lab piece into a test failure instead of a skip (CI).
	EnvRequireIntegration = "KST_REQUIRE_INTEGRATION"
	// EnvSkipPrivileged names the environment variable that, when set, skips
	// every test needing root.
	EnvSkipPrivileged = "KST_SKIP_PRIVILEGED"
)

// ErrNoAssets is wrapped by the errors of FindAssets and PrepareAssets when
// the kernel, its modules or a host tool is missing, so callers can tell
// "not prepared here" from a real failure.
var ErrNoAssets = errors.New("lab: assets missing (run test/tools/lab-assets.sh)")

// hostTools are the host programs the lab reads or runs, with the Debian
// package that provides each (lab-assets.sh installs them).
var hostTools = []struct{ name, pkg string }{
	{"qemu-system-x86_64", "qemu-system-x86"},
	{"modprobe", "kmod"},
	{"ldd", "libc-bin"},
	{"busybox", "busybox-static"},
	{"ip", "iproute2"},
	{"iptables", "iptables"},
}

// Assets are the host files a lab VM is made of.
type Assets struct {
	// Dir is the lab's cache folder (see LabDir).
	Dir string
	// Kernel is the kernel image qemu boots (-kernel).
	Kernel string
	// KernelVersion is the kernel's release, e.g. "6.1.0-56-amd64".
	KernelVersion string
	// ModulesRoot holds lib/modules/KernelVersion with depmod's indexes; it is
	// the root given to `modprobe -d`.
	ModulesRoot string
}

// LabDir returns the lab's cache folder: $KST_ASSETS_DIR/lab, or
// $HOME/.cache/kube-service-tunnel/assets/lab (lab-assets.sh's default).
func LabDir() string {
	dir := os.Getenv(EnvAssetsDir)
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = os.TempDir()
		}
		dir = filepath.Join(home, ".cache", "kube-service-tunnel", "assets")
	}
	return filepath.Join(dir, "lab")
}

// IntegrationRequired reports whether KST_REQUIRE_INTEGRATION=1 is set, in
// which case lab tests must fail rather than skip when a piece is missing.
func IntegrationRequired() bool {
	return os.Getenv(EnvRequireIntegration) == "1"
}

// FindAssets looks for the assets in LabDir and for the host tools, without
// installing or downloading anything. A missing piece yields an error
// wrapping ErrNoAssets.
func FindAssets() (Assets, error) {
	dir := LabDir()
	a := Assets{
		Dir:         dir,
		Kernel:      filepath.Join(dir, "vmlinuz"),
		ModulesRoot: filepath.Join(dir, "root"),
	}
	if _, err := os.Stat(filepath.Join(dir, "ready")); err != nil {
		return a, fmt.Errorf("%w: no kernel prepared in %s", ErrNoAssets, dir)
	}
	kver, err := os.ReadFile(filepath.Join(dir, "kernel-version"))
	if err != nil {
		return a, fmt.Errorf("%w: reading kernel version: %v", ErrNoAssets, err)
	}
	a.KernelVersion = strings.TrimSpace(string(kver))
	for _, p := range []string{a.Kernel, filepath.Join(a.ModulesRoot, "lib", "modules", a.KernelVersion, "modules.dep")} {
		if _, err := os.Stat(p); err != nil {
			return a, fmt.Errorf("%w: %v", ErrNoAssets, err)
		}
	}
	var missing []string
	for _, tool := range hostTools {
		if _, err := exec.LookPath(tool.name); err != nil {
			missing = append(missing, fmt.Sprintf("%s (package %s)", tool.name, tool.pkg))
		}
	}
	if len(missing) > 0 {
		return a, fmt.Errorf("%w: host tools not found: %s", ErrNoAssets, strings.Join(missing, ", "))
	}
	return a, nil
}

// AssetsScript returns the path of test/tools/lab-assets.sh in this source
// tree.
func AssetsScript() string {
	_, here, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(here), "..", "tools", "lab-assets.sh")
}

// PrepareAssets runs test/tools/lab-assets.sh (which installs missing host
// tools with apt-get, and downloads and unpacks the kernel unless it is
// cached; both need root the first time), then returns FindAssets' result.
// A failing script yields an error wrapping ErrNoAssets that quotes its
// output.
func PrepareAssets(ctx context.Context) (Assets, error) {
	script := AssetsScript()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "bash", script)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return Assets{}, fmt.Errorf("%w: %s: %v\n%s", ErrNoAssets, script, err, LastLines(stderr.String(), 20))
	}
	return FindAssets()
}

// Require prepares the assets for a test, or skips it: when not root, when
// KST_SKIP_PRIVILEGED is set, or when the assets cannot be prepared. With
// KST_REQUIRE_INTEGRATION=1 assets that cannot be prepared fail the test.
func Require(tb testing.TB) Assets {
	tb.Helper()
	if os.Getenv(EnvSkipPrivileged) != "" {
		tb.Skip(EnvSkipPrivileged + " is set")
	}
	if os.Geteuid() != 0 {
		tb.Skip("needs root to install the lab's tools and kernel")
	}
	a, err := PrepareAssets(context.Background())
	if err != nil {
		if IntegrationRequired() {
			tb.Fatalf("%s=1 but the lab is not available: %v", EnvRequireIntegration, err)
		}
		tb.Skipf("lab not available: %v", err)
	}
	return a
}

// LastLines returns at most n final lines of s.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
