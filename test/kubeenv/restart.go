package kubeenv

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// StopAPIServer kills kube-apiserver (SIGKILL, as a crash or a lost control
// plane node would) and waits until it has exited. etcd keeps running, and
// so do the clients: they see refused connections until StartAPIServer.
// Stopping a stopped API server does nothing.
//
// The Env is shared by a package's tests: a test that stops the API server
// must not run in parallel with others and must restart it before it ends.
func (e *Env) StopAPIServer() error {
	p := e.currentAPIServer()
	if err := p.kill(); err != nil {
		return fmt.Errorf("kubeenv: stop API server: %w", err)
	}
	return nil
}

// StartAPIServer starts kube-apiserver again after StopAPIServer: on the
// same address, with the same etcd (so every object is still there), the
// same admin token and service account keys (so every config and token
// handed out before still authenticates) and the same serving certificate
// (kube-apiserver reuses the one it wrote into --cert-dir), and waits until
// /readyz answers ok. Its log goes to kube-apiserver-N.log, N counting the
// restarts. It fails when the API server is running, or when another socket
// holds the port for ten seconds.
func (e *Env) StartAPIServer() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.apiserver != nil && !e.apiserver.exited() {
		return errors.New("kubeenv: start API server: it is running")
	}
	var err error
	for attempt := range restartAttempts {
		if attempt > 0 {
			time.Sleep(time.Second)
		}
		if err = e.restartAPIServer(); !errors.Is(err, errPortInUse) {
			return err
		}
	}
	return err
}

// restartAttempts bounds how often StartAPIServer tries again, a second
// apart, while the port is held by another socket.
const restartAttempts = 10

func (e *Env) restartAPIServer() error {
	e.restarts++
	name := "kube-apiserver-" + strconv.Itoa(e.restarts)
	p, err := startProcess(e.launcher, "kube-apiserver", e.apiserverBin, e.logPath(name), e.apiserverCmd)
	if err != nil {
		return fmt.Errorf("kubeenv: restart API server: %w", err)
	}
	e.apiserver = p
	if err := waitReady(p, e.probeAPIServer); err != nil {
		return fmt.Errorf("kubeenv: restart API server: %w", e.failedStart(p, err))
	}
	return nil
}

// currentAPIServer returns the running (or last) kube-apiserver process.
func (e *Env) currentAPIServer() *process {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.apiserver
}
