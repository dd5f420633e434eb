package runtime

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// The usual sockets of the runtimes, in the order auto-detection tries them.
// Docker comes before cri-dockerd: both find the same sandbox, and Docker's
// own API is the one this package knows best for it.
var (
	containerdSockets = []string{"/run/containerd/containerd.sock", "/var/run/containerd/containerd.sock"}
	crioSockets       = []string{"/run/crio/crio.sock", "/var/run/crio/crio.sock"}
	dockerSockets     = []string{"/run/docker.sock", "/var/run/docker.sock"}
	criDockerdSockets = []string{"/run/cri-dockerd.sock", "/var/run/cri-dockerd.sock"}
)

// Options choose how pods' network namespaces are found.
type Options struct {
	// Runtime is auto, docker, cri or netns.
	Runtime string
	// Endpoint is the runtime's socket as unix:///path; empty means the
	// runtime's usual socket.
	Endpoint string
}

// Open returns the Locator the options ask for. "auto" tries containerd,
// CRI-O, Docker and cri-dockerd at their usual sockets and uses the first that
// answers; every runtime Locator falls back to the search by pod IP when the
// runtime itself fails (not when it answers that the pod has no sandbox).
// With no runtime found, auto uses the search by pod IP alone. describe says
// what was chosen, for the start-up log.
func Open(ctx context.Context, o Options) (loc Locator, describe string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	switch o.Runtime {
	case "netns":
		return NewByIP(), "search by pod IP (--runtime=netns)", nil
	case "docker":
		endpoint := o.Endpoint
		if endpoint == "" {
			endpoint = "unix://" + dockerSockets[1]
		}
		d, err := openDocker(ctx, endpoint)
		if err != nil {
			return nil, "", err
		}
		return WithFallback(d, NewByIP()), "docker at " + endpoint + ", then search by pod IP", nil
	case "cri":
		endpoints := []string{o.Endpoint}
		if o.Endpoint == "" {
			endpoints = unixURLs(existing(containerdSockets, crioSockets, criDockerdSockets))
		}
		var errs []error
		for _, e := range endpoints {
			c, err := NewCRI(ctx, e)
			if err == nil {
				return WithFallback(c, NewByIP()), "cri at " + e + ", then search by pod IP", nil
			}
			errs = append(errs, err)
		}
		if len(endpoints) == 0 {
			errs = append(errs, errors.New("no CRI socket found at the usual paths; set --runtime-endpoint"))
		}
		return nil, "", fmt.Errorf("--runtime=cri: %w", errors.Join(errs...))
	case "auto", "":
		var tried []string
		for _, group := range []struct {
			sockets []string
			docker  bool
		}{{containerdSockets, false}, {crioSockets, false}, {dockerSockets, true}, {criDockerdSockets, false}} {
			for _, path := range existing(group.sockets) {
				endpoint := "unix://" + path
				var loc Locator
				var err error
				if group.docker {
					loc, err = openDocker(ctx, endpoint)
				} else {
					loc, err = NewCRI(ctx, endpoint)
				}
				if err != nil {
					tried = append(tried, fmt.Sprintf("%s (%v)", endpoint, err))
					continue
				}
				return WithFallback(loc, NewByIP()), fmt.Sprintf("%s at %s, then search by pod IP", loc.Name(), endpoint), nil
			}
		}
		d := "no container runtime answered; search by pod IP only"
		if len(tried) > 0 {
			d += "; tried " + strings.Join(tried, ", ")
		}
		return NewByIP(), d, nil
	}
	return nil, "", fmt.Errorf("--runtime %q: must be auto, docker, cri or netns", o.Runtime)
}

func openDocker(ctx context.Context, endpoint string) (*Docker, error) {
	d, err := NewDocker(endpoint)
	if err != nil {
		return nil, err
	}
	if err := d.Ping(ctx); err != nil {
		d.Close()
		return nil, fmt.Errorf("docker at %s: %w", endpoint, err)
	}
	return d, nil
}

// existing returns the paths that exist, in order, without duplicates.
func existing(groups ...[]string) []string {
	var out []string
	seen := map[string]bool{}
	for _, g := range groups {
		for _, p := range g {
			if _, err := os.Stat(p); err == nil && !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return out
}

func unixURLs(paths []string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = "unix://" + p
	}
	return out
}

// fallback asks primary first and secondary only when primary fails. When
// primary answers that the pod has no sandbox, that answer stands: another
// namespace holding the same IP would belong to another pod.
type fallback struct {
	primary, secondary Locator
}

// WithFallback returns a Locator that uses secondary when primary fails with
// an error other than ErrNotFound or ErrHostNetwork.
func WithFallback(primary, secondary Locator) Locator { return fallback{primary, secondary} }

func (f fallback) Name() string { return f.primary.Name() + "+" + f.secondary.Name() }

func (f fallback) Locate(ctx context.Context, pod Pod) (Netns, error) {
	ns, err := f.primary.Locate(ctx, pod)
	if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrHostNetwork) {
		return ns, err
	}
	ns, err2 := f.secondary.Locate(ctx, pod)
	if err2 != nil {
		return Netns{}, fmt.Errorf("%s: %w; %s: %w", f.primary.Name(), err, f.secondary.Name(), err2)
	}
	return ns, nil
}

func (f fallback) Close() error { return errors.Join(f.primary.Close(), f.secondary.Close()) }
