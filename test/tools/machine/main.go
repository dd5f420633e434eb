// Command machine prints what this machine is, so that a slow test run can
// be told from a regression: the CPU model, cores, memory and kernel, a CPU
// figure (SHA-256 over 256 MiB, one core), and, when the lab's assets are
// prepared, the lab VM's boot time under TCG: qemu started to the end of an
// empty /lab/run.sh. The lab's durations scale with that boot time
// (docs/testing.md, "Time budget").
//
//	go run ./test/tools/machine              # everything
//	go run ./test/tools/machine -vm=false    # the host only
//	go run ./test/tools/machine -host=false  # the VM boot only
package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/test/lab"
)

func main() {
	host := flag.Bool("host", true, "report the host: CPU, cores, memory, kernel and a hashing speed")
	vm := flag.Bool("vm", true, "boot the lab VM once and report its boot time (needs root and make assets)")
	flag.Parse()
	if *host {
		fmt.Printf("machine: cpu %q, %d cores, %s memory, kernel %s\n", cpuModel(), runtime.NumCPU(), memTotal(), kernelRelease())
		fmt.Printf("machine: sha256 of 256 MiB on one core: %v\n", hashSpeed().Round(time.Millisecond))
	}
	if !*vm {
		return
	}
	took, err := bootTime()
	if err != nil {
		fmt.Printf("machine: lab VM boot not measured: %v\n", err)
		return
	}
	fmt.Printf("machine: lab VM boot (qemu TCG, 2 vCPUs, to the end of an empty script): %v\n", took.Round(100*time.Millisecond))
}

// cpuModel is /proc/cpuinfo's first "model name".
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if k, v, ok := strings.Cut(s.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// memTotal is /proc/meminfo's MemTotal, in GiB.
func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		var kb int64
		if _, err := fmt.Sscanf(line, "MemTotal: %d kB", &kb); err == nil {
			return fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
		}
	}
	return "unknown"
}

func kernelRelease() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

// hashSpeed is how long one core takes to hash 256 MiB: a rough figure of
// the host CPU's speed, free of the VM.
func hashSpeed() time.Duration {
	buf := make([]byte, 1<<20)
	h := sha256.New()
	start := time.Now()
	for range 256 {
		h.Write(buf)
	}
	_ = h.Sum(nil)
	return time.Since(start)
}

// bootTime boots the lab VM (the assets' kernel, the default modules, 2
// vCPUs, 2 GB, as the kernel tests' VM) with an empty script.
func bootTime() (time.Duration, error) {
	if os.Geteuid() != 0 {
		return 0, fmt.Errorf("not root")
	}
	assets, err := lab.FindAssets()
	if err != nil {
		return 0, err
	}
	dir, err := os.MkdirTemp("", "kst-machine-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	ir, err := lab.BuildInitramfs(lab.InitramfsOptions{Assets: assets, Output: filepath.Join(dir, "initrd.cpio"), Script: "#!/bin/sh\nexit 0\n"})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	out, rc, err := lab.Boot(ctx, ir, lab.BootOptions{Kernel: assets.Kernel, MemoryMB: 2048, CPUs: 2})
	if err != nil || rc != 0 {
		return 0, fmt.Errorf("boot: exit code %d, %v\n%s", rc, err, lab.LastLines(out, 20))
	}
	return time.Since(start), nil
}
