package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/sirupsen/logrus"
)

// NewRegistry returns a Prometheus registry with the Go runtime and process
// collectors.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// PortWait is how long a daemon waits for its --metrics-address port
// while another process holds it. The port is the node's lock for a daemon
// of its kind (both run in the host's network namespace): a DaemonSet
// starts a deleted pod's replacement while the old pod still terminates
// (the manifest's grace period is 30 s), and two routers, or two agents,
// must not write one node's kernel at once. So each daemon takes its port
// before it touches any kernel state and, finding it in use, waits for it
// rather than failing at once into the kubelet's growing restart back-off.
const PortWait = 90 * time.Second

// Listen listens on addr for ServeHTTP. While the port is in use it tries
// again every second, up to wait (0: not at all), logging why it waits;
// then the port in use is the error.
func Listen(ctx context.Context, addr string, wait time.Duration, log logrus.FieldLogger) (net.Listener, error) {
	began := time.Now()
	var lastLog time.Time
	for {
		ln, err := net.Listen("tcp", addr)
		if err == nil {
			if waited := time.Since(began); waited > time.Second {
				log.WithFields(logrus.Fields{"address": addr, "waited": waited.Round(time.Second).String()}).Info("the port is free: the other process released it")
			}
			return ln, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) || time.Since(began) >= wait {
			return nil, fmt.Errorf("--metrics-address %s: %w", addr, err)
		}
		if time.Since(lastLog) >= 10*time.Second {
			lastLog = time.Now()
			log.WithFields(logrus.Fields{"address": addr, "waited": time.Since(began).Round(time.Second).String(), "wait": wait.String()}).
				Warn("the port is in use, waiting for it before touching the kernel: another daemon of this kind runs on the node (the pod this one replaces, still terminating?)")
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("--metrics-address %s: in use until the daemon stopped: %w", addr, ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// ServeHTTP serves /metrics (see MetricsHandler), /healthz (healthy()
// returns nil: the controllers are alive) and /readyz (ready() is true) on
// ln (from Listen) until ctx ends, and returns at once.
func ServeHTTP(ctx context.Context, ln net.Listener, reg *prometheus.Registry, stream TextWriter, ready func() bool, healthy func() error, log logrus.FieldLogger) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", MetricsHandler(reg, stream, log))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := healthy(); err != nil {
			http.Error(w, "unhealthy: "+err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not ready: the first full sync has not succeeded yet", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.WithError(err).Error("metrics and health server stopped")
		}
	}()
	go func() {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
	}()
	log.WithField("address", ln.Addr().String()).Info("serving /metrics, /healthz and /readyz")
}

// Serve is Listen (not waiting for a port in use) and ServeHTTP, returning
// the address it listens on, so that a caller (a test) can give port 0 and
// learn the port the kernel picked.
func Serve(ctx context.Context, addr string, reg *prometheus.Registry, stream TextWriter, ready func() bool, healthy func() error, log logrus.FieldLogger) (net.Addr, error) {
	ln, err := Listen(ctx, addr, 0, log)
	if err != nil {
		return nil, err
	}
	ServeHTTP(ctx, ln, reg, stream, ready, healthy, log)
	return ln.Addr(), nil
}

// WaitAfterCleanup is --wait-after-cleanup once --cleanup succeeded: the
// process stays until ctx ends (SIGTERM), answering /readyz and /healthz
// with 200 on addr (nowhere when empty), so that the uninstall DaemonSet's
// readiness probe sees the node clean. A port already in use is an error:
// a daemon still running there must not answer for the cleanup.
func WaitAfterCleanup(ctx context.Context, addr string, log logrus.FieldLogger) error {
	if addr != "" {
		if _, err := Serve(ctx, addr, NewRegistry(), nil, func() bool { return true }, func() error { return nil }, log); err != nil {
			return err
		}
	}
	log.Info("node clean: waiting for SIGTERM (--wait-after-cleanup)")
	<-ctx.Done()
	return nil
}

// KernelCheckOnlyHelp is both daemons' --kernel-check-only usage.
const KernelCheckOnlyHelp = "run the start-up kernel check, loading any missing kernel module with modprobe, then exit: the DaemonSet's init container, the one container granted SYS_MODULE (the daemon then starts with --kernel-check=false)"

// KernelCheckHelp is both daemons' --kernel-check usage.
const KernelCheckHelp = "check the kernel's features at start-up, before touching any state (false: skip it; the manifest's daemon containers do, as their init container checked the same kernel with --kernel-check-only just before)"

// WaitAfterCleanupHelp is both daemons' --wait-after-cleanup usage.
const WaitAfterCleanupHelp = "with --cleanup: once done, answer /readyz with 200 on --metrics-address and wait for SIGTERM instead of exiting (the uninstall DaemonSet's pods turn Ready once their node is clean)"
