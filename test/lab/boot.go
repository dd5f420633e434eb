package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// BootOptions describe the VM Boot runs.
type BootOptions struct {
	// Kernel is the kernel image (Assets.Kernel). Required.
	Kernel string
	// MemoryMB is the VM's memory; 0 means 1024.
	MemoryMB int
	// CPUs is the number of virtual CPUs; 0 means 1.
	CPUs int
	// ForwardHostPorts gives the VM a NIC (eth0, GuestAddr) on a restricted
	// qemu user network where a TCP connection to HostForwardAddr:PORT reaches
	// the host's 127.0.0.1:PORT, for each PORT listed. Nothing else outside
	// the VM is reachable. Empty means no NIC.
	ForwardHostPorts []int
	// Output, when set, receives the serial console as it is printed (with
	// carriage returns removed), e.g. to follow a long boot.
	Output io.Writer
	// QEMU is the qemu binary; empty means qemu-system-x86_64 from PATH.
	QEMU string
	// ExtraArgs are appended to qemu's command line.
	ExtraArgs []string
}

// afterMarker is how long Boot lets qemu power off once the end marker is
// printed before killing it.
const afterMarker = 10 * time.Second

// Boot runs qemu (software emulation: KVM guests hang on these machines) on
// the kernel and the initramfs until /init prints the end marker and powers
// off, and returns the serial console's output and the exit code of
// /lab/run.sh.
//
// It returns an error, with the output so far and exit code -1, when qemu
// cannot start, exits without printing the marker (e.g. a kernel panic), or
// ctx ends first. qemu is killed on every path out; ctx should carry a
// deadline, as a VM whose script hangs runs until ctx ends.
func Boot(ctx context.Context, initramfs Initramfs, opts BootOptions) (output string, exitCode int, err error) {
	if opts.Kernel == "" {
		return "", -1, errors.New("lab: BootOptions.Kernel is empty")
	}
	if initramfs.EndMarker == "" || initramfs.Path == "" {
		return "", -1, errors.New("lab: Boot needs an Initramfs from BuildInitramfs")
	}
	qemu := opts.QEMU
	if qemu == "" {
		qemu = "qemu-system-x86_64"
	}
	console := &consoleWriter{out: opts.Output, marker: initramfs.EndMarker + " rc=", done: make(chan struct{})}
	var stderr bytes.Buffer
	cmd := exec.Command(qemu, qemuArgs(initramfs.Path, opts)...)
	cmd.Stdout, cmd.Stderr = console, &stderr
	// qemu gets its own process group, killed as a whole, and dies with the
	// thread that started it: that thread stays locked (alive) until Boot
	// returns, so the parent-death signal only fires if the test process dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cmd.Start(); err != nil {
		return "", -1, fmt.Errorf("lab: starting %s: %w", qemu, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	kill := func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}

	var waitErr, ctxErr error
	select {
	case waitErr = <-waited:
	case <-console.done:
		select {
		case waitErr = <-waited:
		case <-time.After(afterMarker):
			kill()
			<-waited
		case <-ctx.Done():
			kill()
			<-waited
		}
	case <-ctx.Done():
		ctxErr = ctx.Err()
		kill()
		<-waited
	}

	output = console.String()
	if code, ok := console.exitCode(); ok {
		return output, code, nil
	}
	switch {
	case ctxErr != nil:
		return output, -1, fmt.Errorf("lab: VM did not finish: %w", ctxErr)
	case waitErr != nil:
		return output, -1, fmt.Errorf("lab: qemu failed without the end marker: %w: %s", waitErr, strings.TrimSpace(stderr.String()))
	default:
		return output, -1, fmt.Errorf("lab: qemu exited without the end marker (kernel panic or /init failed?): %s", strings.TrimSpace(stderr.String()))
	}
}

// qemuArgs is qemu's command line for Boot.
func qemuArgs(initrd string, opts BootOptions) []string {
	mem, cpus := opts.MemoryMB, opts.CPUs
	if mem == 0 {
		mem = 1024
	}
	if cpus == 0 {
		cpus = 1
	}
	args := []string{
		"-accel", "tcg",
		"-m", strconv.Itoa(mem), "-smp", strconv.Itoa(cpus),
		"-nodefaults", "-no-user-config",
		"-kernel", opts.Kernel, "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 edd=off quiet",
		"-display", "none", "-serial", "stdio", "-monitor", "none", "-no-reboot",
	}
	if len(opts.ForwardHostPorts) > 0 {
		netdev := "user,id=n0,restrict=on"
		for _, port := range opts.ForwardHostPorts {
			// "cmd:" runs the command once per guest connection, its
			// stdin/stdout being the connection. The "tcp:" form would be a
			// single chardev connection made at start, which only one
			// guest connection can use (client-go's second one hangs).
			netdev += fmt.Sprintf(",guestfwd=tcp:%s:%d-cmd:%s nc 127.0.0.1 %d", HostForwardAddr, port, busyboxPath(), port)
		}
		// romfile= : no PXE option ROM (the ipxe-qemu package is not needed).
		args = append(args, "-netdev", netdev, "-device", "virtio-net-pci,netdev=n0,romfile=")
	}
	return append(args, opts.ExtraArgs...)
}

// consoleWriter collects the serial console, forwards it to out and closes
// done once the end marker's line is complete.
type consoleWriter struct {
	out    io.Writer
	marker string // "EndMarker rc="

	mu     sync.Mutex
	buf    bytes.Buffer
	closed bool
	done   chan struct{}
}

func (c *consoleWriter) Write(p []byte) (int, error) {
	clean := bytes.ReplaceAll(p, []byte("\r"), nil)
	c.mu.Lock()
	defer c.mu.Unlock()
	// Only the new bytes and a marker's length before them can complete it.
	from := max(0, c.buf.Len()-len(c.marker)-32)
	c.buf.Write(clean)
	if c.out != nil {
		_, _ = c.out.Write(clean) // a failing follower must not stop the VM
	}
	if !c.closed {
		if _, ok := parseExitCode(string(c.buf.Bytes()[from:]), c.marker); ok {
			c.closed = true
			close(c.done)
		}
	}
	return len(p), nil
}

// String returns everything printed so far.
func (c *consoleWriter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.String()
}

// exitCode returns the code on the end marker's line, if printed.
func (c *consoleWriter) exitCode() (int, bool) {
	return parseExitCode(c.String(), c.marker)
}

// parseExitCode finds "MARKER rc=CODE\n" in out.
func parseExitCode(out, marker string) (int, bool) {
	i := strings.LastIndex(out, marker)
	if i < 0 {
		return 0, false
	}
	rest := out[i+len(marker):]
	line, _, complete := strings.Cut(rest, "\n")
	if !complete {
		return 0, false
	}
	code, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return 0, false
	}
	return code, true
}

// busyboxPath is the host's busybox (busybox-static), whose nc relays each
// forwarded guest connection.
func busyboxPath() string {
	if p, err := exec.LookPath("busybox"); err == nil {
		return p
	}
	return "/bin/busybox"
}
