package kubeenv

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// launcher starts child processes from one goroutine locked to one OS thread.
// Setpdeathsig fires when the thread that forked the child exits, not when
// the process exits; pinning the forks to a thread that lives until Stop
// makes the signal mean "the test binary died".
type launcher struct {
	reqs chan launchReq
	quit chan struct{}
}

type launchReq struct {
	cmd    *exec.Cmd
	result chan error
}

// newLauncher starts the launcher goroutine; call close to end it.
func newLauncher() *launcher {
	l := &launcher{reqs: make(chan launchReq), quit: make(chan struct{})}
	go l.loop()
	return l
}

func (l *launcher) loop() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for {
		select {
		case r := <-l.reqs:
			r.result <- r.cmd.Start()
		case <-l.quit:
			return
		}
	}
}

// start runs cmd.Start on the launcher's thread.
func (l *launcher) start(cmd *exec.Cmd) error {
	r := launchReq{cmd: cmd, result: make(chan error, 1)}
	l.reqs <- r
	return <-r.result
}

// close ends the launcher goroutine. Call it after every child is gone.
func (l *launcher) close() { close(l.quit) }

// process is a running child (etcd or kube-apiserver) logging to a file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	logFile *os.File
	done    chan struct{} // closed once the process has been reaped
	waitErr error
}

// startProcess starts path with args through l, sending its stdout and
// stderr to logPath. The child gets SIGKILL when the test binary dies and
// runs in its own process group.
func startProcess(l *launcher, name, path, logPath string, args []string) (*process, error) {
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("create %s log: %w", name, err)
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := l.start(cmd); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, logFile: logFile, done: make(chan struct{})}
	go p.wait()
	return p, nil
}

func (p *process) wait() {
	p.waitErr = p.cmd.Wait()
	p.logFile.Close()
	close(p.done)
}

// pid returns the child's process id.
func (p *process) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// errExited describes an early exit, with the tail of the log.
func (p *process) errExited() error {
	return fmt.Errorf("%s exited early (%v); log %s:\n%s", p.name, p.waitErr, p.logPath, p.logTail())
}

// kill sends SIGKILL to the child's process group and waits until it has
// been reaped (at most 10 s).
func (p *process) kill() error {
	if p == nil || p.exited() {
		return nil
	}
	if err := syscall.Kill(-p.pid(), syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill %s (pid %d): %w", p.name, p.pid(), err)
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s (pid %d) did not exit after SIGKILL", p.name, p.pid())
	}
}

// logTail returns the last lines of the process log.
func (p *process) logTail() string {
	return tailFile(p.logPath, 40, 8<<10)
}

// tailFile returns at most maxLines lines and maxBytes bytes from the end of
// a file.
func tailFile(path string, maxLines int, maxBytes int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > maxBytes {
		if _, err := f.Seek(-maxBytes, io.SeekEnd); err != nil {
			return fmt.Sprintf("(cannot read log: %v)", err)
		}
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	lines := strings.Split(string(bytes.TrimRight(data, "\n")), "\n")
	if len(lines) > maxLines {
		lines = lines[len(lines)-maxLines:]
	}
	return strings.Join(lines, "\n")
}
