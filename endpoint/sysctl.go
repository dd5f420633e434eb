package endpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// Sysctls reads and writes the per-namespace sysctls under /proc/sys/net. It
// is the seam to a namespace's sysctls; names are relative to /proc/sys
// ("net/ipv4/conf/lo/rp_filter").
type Sysctls interface {
	// Read returns the values of names in ns; a missing one reads as "".
	Read(ns netns.NsHandle, names []string) (map[string]string, error)
	// Write sets one value in ns.
	Write(ns netns.NsHandle, name, value string) error
}

// ProcSysctls goes through /proc/sys (or Dir) on a thread that enters the
// namespace and is discarded afterwards (package nsexec): /proc/sys/net, or
// any mount of it, shows the namespace of the thread that opens it.
type ProcSysctls struct {
	// Dir is the sysctl directory (--proc-sys); empty means /proc/sys.
	Dir string
}

func (s ProcSysctls) path(name string) string {
	if s.Dir == "" {
		return "/proc/sys/" + name
	}
	return filepath.Join(s.Dir, name)
}

// Read implements Sysctls.
func (s ProcSysctls) Read(ns netns.NsHandle, names []string) (map[string]string, error) {
	for _, n := range names {
		if err := checkSysctlName(n); err != nil {
			return nil, err
		}
	}
	values := make(map[string]string, len(names))
	err := nsexec.Do(ns, func() error {
		for _, n := range names {
			b, err := os.ReadFile(s.path(n))
			switch {
			case errors.Is(err, fs.ErrNotExist):
				values[n] = ""
			case err != nil:
				return fmt.Errorf("reading sysctl %s: %w", strings.ReplaceAll(n, "/", "."), err)
			default:
				values[n] = strings.TrimSpace(string(b))
			}
		}
		return nil
	})
	return values, err
}

// Write implements Sysctls.
func (s ProcSysctls) Write(ns netns.NsHandle, name, value string) error {
	if err := checkSysctlName(name); err != nil {
		return err
	}
	return nsexec.Do(ns, func() error {
		if err := os.WriteFile(s.path(name), []byte(value), 0o644); err != nil {
			if errors.Is(err, fs.ErrNotExist) && strings.HasPrefix(name, "net/mpls/") {
				return fmt.Errorf("setting sysctl %s: the kernel has no MPLS routing (CONFIG_MPLS_ROUTING, module mpls_router): %w", strings.ReplaceAll(name, "/", "."), err)
			}
			return fmt.Errorf("setting sysctl %s=%s: %w", strings.ReplaceAll(name, "/", "."), value, err)
		}
		return nil
	})
}

// checkSysctlName refuses names that could leave /proc/sys/net: interface
// names come from pods, and "/" or ".." in one must not reach another file.
func checkSysctlName(name string) error {
	if !strings.HasPrefix(name, "net/") || strings.Contains(name, "..") || strings.Contains(name, "//") {
		return fmt.Errorf("refusing sysctl name %q", name)
	}
	return nil
}
