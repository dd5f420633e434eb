// Command demo is `make demo`: the project's main job, end to end, on a
// fresh machine. It starts a real kube-apiserver and etcd on this host's
// loopback, boots the lab VM (Debian's kernel under qemu: real GRE, MPLS and
// HMARK, which this host lacks) with the real tunnel-router and
// tunnel-endpoint binaries, deploys examples/echo.yaml and shows a client
// reaching the pods through the tunnel IP (the VM part is ./guest). It needs
// root, takes a few minutes, and leaves nothing running.
package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
	"github.com/cmdnu/kube-service-tunnel/test/lab"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) {
	fmt.Printf("\n==> "+format+"\n", args...)
}

func run() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root (qemu, network namespaces in the VM, test assets)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	start := time.Now()

	step("Preparing the lab: Debian's kernel and modules (downloaded once, then cached)")
	assets, err := lab.PrepareAssets(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("    kernel %s\n", assets.KernelVersion)

	step("Starting a real kube-apiserver and etcd on 127.0.0.1")
	env, err := kubeenv.New()
	if err != nil {
		return err
	}
	defer env.Stop()
	fmt.Printf("    API server %s ready in %v\n", env.Host(), env.StartupDuration().Round(time.Millisecond))

	step("Building tunnel-router, tunnel-endpoint and the demo's VM program (static Go binaries)")
	dir, err := os.MkdirTemp("", "kst-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	guest := filepath.Join(dir, "guest")
	if err := lab.BuildStatic("./test/demo/guest", guest); err != nil {
		return err
	}

	step("Booting the VM: tunnel-router.yaml applied, each daemon with its own ServiceAccount's token")
	fmt.Println("    (qemu with software emulation; the API server is reached through qemu's guestfwd)")
	console, wait := consoleFilter(os.Stdout)
	out, code, err := lab.RunCluster(ctx, lab.ClusterOptions{
		Assets: assets, Env: env, Program: guest,
		Files:  map[string]string{"/lab/examples/echo.yaml": filepath.Join(lab.RepoRoot(), "examples", "echo.yaml")},
		Output: console,
	})
	wait()
	if err != nil {
		return fmt.Errorf("%w\n%s", err, out)
	}
	if code != 0 {
		return fmt.Errorf("the demo failed inside the VM (exit code %d)", code)
	}
	if err := env.Stop(); err != nil {
		return err
	}
	step("Done in %v: the VM is off and the API server stopped; nothing is left running", time.Since(start).Round(time.Second))
	return nil
}

// consoleFilter passes the guest program's lines to w and drops the
// kernel's; wait flushes it once the VM is off.
func consoleFilter(w io.Writer) (console io.Writer, wait func()) {
	r, pw := io.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		s := bufio.NewScanner(r)
		for s.Scan() {
			line := s.Text()
			if strings.HasPrefix(line, "[") || strings.HasPrefix(line, "KST-LAB-END") {
				continue
			}
			fmt.Fprintln(w, line)
		}
	}()
	return pw, func() {
		pw.Close()
		<-done
	}
}
