package runtime

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ErrAmbiguous means more than one network namespace holds the pod's IP, so
// ByIP cannot tell which is the pod's and refuses to guess.
var ErrAmbiguous = errors.New("pod IP held by several network namespaces")

// ByIP finds a pod's network namespace without asking any container runtime:
// it searches the node's network namespaces for the one that holds the pod's
// addresses (IPv4, IPv6 or both) on interfaces other than lo. It is the
// fallback for runtimes the agent cannot talk to, and needs root
// (CAP_SYS_ADMIN, CAP_SYS_PTRACE) and the host's PID namespace.
type ByIP struct {
	// netnsDirs hold bind-mounted named namespaces (ip netns, CNI).
	netnsDirs []string
	// procRoot is where processes are scanned; empty scans none.
	procRoot string
	// selfNetns and hostNetns are never matched: the agent's own namespace
	// and the host's (PID 1's). The agent's is its calling thread's, not
	// /proc/self's: that is the main thread's, which the Go runtime parks
	// for good, in whatever namespace it was in, when a goroutine locked to
	// it ends after switching namespaces (see internal/nsexec).
	selfNetns, hostNetns string
	// kthreadd is the /proc directory of the kernel's kthreadd, whose
	// namespace is the host's when hostNetns cannot be read; empty for none.
	kthreadd string
}

var _ Locator = (*ByIP)(nil)

// NewByIP returns a locator scanning the named namespaces in /var/run/netns
// and /run/netns and the namespaces of all processes in /proc.
func NewByIP() *ByIP {
	return &ByIP{
		netnsDirs: []string{"/var/run/netns", "/run/netns"},
		procRoot:  "/proc",
		selfNetns: "/proc/thread-self/ns/net",
		hostNetns: "/proc/1/ns/net",
		kthreadd:  "/proc/2",
	}
}

// Name returns "netns".
func (b *ByIP) Name() string { return "netns" }

// Close does nothing: ByIP holds no connection.
func (b *ByIP) Close() error { return nil }

// hostKey identifies the host's network namespace: PID 1's, or, where PID 1
// cannot be inspected (some sandboxes deny it even to root), kthreadd's,
// which is always the kernel's initial namespace.
func (b *ByIP) hostKey() (nsID, error) {
	key, err := nsIDOfPath(b.hostNetns)
	if err == nil {
		return key, nil
	}
	if b.kthreadd != "" {
		if comm, cerr := os.ReadFile(b.kthreadd + "/comm"); cerr == nil && string(comm) == "kthreadd\n" {
			if key, kerr := nsIDOfPath(b.kthreadd + "/ns/net"); kerr == nil {
				return key, nil
			}
		}
	}
	return "", err
}

// nsCandidate is a path through which a namespace may be opened.
type nsCandidate struct {
	path string
	key  nsID
}

// Locate opens the only network namespace, other than the agent's and the
// host's, that holds every address of pod (its IPv4 and its IPv6 address,
// whichever it has) on interfaces other than lo. It returns an error
// wrapping ErrNotFound when none does, and one wrapping ErrAmbiguous,
// naming the namespaces, when several do.
func (b *ByIP) Locate(ctx context.Context, pod Pod) (Netns, error) {
	ips := pod.Addrs()
	if len(ips) == 0 {
		return Netns{}, fmt.Errorf("pod %s: no IP to search network namespaces for", pod)
	}
	what := joinAddrs(ips)
	skip, err := b.ownAndHost()
	if err != nil {
		return Netns{}, fmt.Errorf("pod %s: %w", pod, err)
	}
	var matches []Netns
	defer func() {
		for _, m := range matches {
			m.Close()
		}
	}()
	scanErrs, err := b.each(ctx, skip, func(ns Netns) (bool, error) {
		ok, err := holdsIPs(ns.Handle, ips)
		if err != nil || !ok {
			return false, err
		}
		ns.Via = "netns"
		matches = append(matches, ns)
		return true, nil
	})
	if err != nil {
		return Netns{}, fmt.Errorf("pod %s: searching network namespaces for %s: %w", pod, what, err)
	}

	switch len(matches) {
	case 0:
		if len(scanErrs) > 0 {
			return Netns{}, NotFoundf("pod %s: no network namespace holds %s outside lo (%d could not be searched, first: %v)", pod, what, len(scanErrs), scanErrs[0])
		}
		return Netns{}, NotFoundf("pod %s: no network namespace holds %s outside lo", pod, what)
	case 1:
		found := matches[0]
		matches = nil // the caller owns it now
		return found, nil
	default:
		paths := make([]string, len(matches))
		for i, m := range matches {
			paths[i] = m.Path
		}
		return Netns{}, fmt.Errorf("%w: pod %s: %s is held by %s", ErrAmbiguous, pod, what, strings.Join(paths, ", "))
	}
}

// joinAddrs writes addresses as "10.1.0.5 and fd00::5".
func joinAddrs(ips []netip.Addr) string {
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, " and ")
}

// ownAndHost returns the keys of the namespaces never handed out: the
// agent's own and the host's.
func (b *ByIP) ownAndHost() (map[nsID]bool, error) {
	self, err := nsIDOfPath(b.selfNetns)
	if err != nil {
		return nil, fmt.Errorf("identifying the agent's own network namespace: %w", err)
	}
	host, err := b.hostKey()
	if err != nil {
		return nil, fmt.Errorf("identifying the host's network namespace: %w", err)
	}
	return map[nsID]bool{self: true, host: true}, nil
}

// each opens every candidate namespace not in skip once and calls visit with
// it; visit returns true when it keeps the handle (then it owns it),
// otherwise each closes it. Namespaces that vanish during the scan are
// skipped; the ones that could not be opened or visited are returned as
// scanErrs. err is set only when ctx ends.
func (b *ByIP) each(ctx context.Context, skip map[nsID]bool, visit func(Netns) (keep bool, err error)) (scanErrs []error, err error) {
	for _, c := range b.candidates(skip) {
		if err := ctx.Err(); err != nil {
			return scanErrs, err
		}
		handle, err := netns.GetFromPath(c.path)
		if vanished(err) {
			continue
		}
		if err != nil {
			scanErrs = append(scanErrs, err)
			continue
		}
		// The candidate's key was only for deduplication: a PID may have
		// been reused since, so identify what was actually opened.
		key, err := nsIDOf(handle)
		if err != nil {
			handle.Close()
			scanErrs = append(scanErrs, fmt.Errorf("%s: %w", c.path, err))
			continue
		}
		if skip[key] {
			handle.Close()
			continue
		}
		skip[key] = true
		keep, err := visit(Netns{Handle: handle, Path: c.path})
		if err != nil {
			scanErrs = append(scanErrs, fmt.Errorf("%s: %w", c.path, err))
		}
		if !keep {
			handle.Close()
		}
	}
	return scanErrs, nil
}

// candidates lists the paths of the namespaces to search, one per namespace
// (named ones first, under their names), leaving out the keys in skip. It
// costs one open, fstat and close per process.
func (b *ByIP) candidates(skip map[nsID]bool) []nsCandidate {
	seen := map[nsID]bool{}
	var out []nsCandidate
	add := func(path string) {
		k, err := nsIDOfPath(path)
		if err != nil {
			return // gone, or not a namespace we can see
		}
		if seen[k] || skip[k] {
			return
		}
		seen[k] = true
		out = append(out, nsCandidate{path: path, key: k})
	}
	for _, dir := range b.netnsDirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue // no named namespaces here
		}
		for _, e := range entries {
			path := filepath.Join(dir, e.Name())
			// A file left behind by a failed or undone bind mount is
			// not a namespace.
			var sfs unix.Statfs_t
			if err := unix.Statfs(path, &sfs); err != nil || sfs.Type != unix.NSFS_MAGIC {
				continue
			}
			add(path)
		}
	}
	if b.procRoot == "" {
		return out
	}
	f, err := os.Open(b.procRoot)
	if err != nil {
		return out
	}
	names, _ := f.Readdirnames(-1)
	f.Close()
	// In PID order, so that which path names a namespace does not depend
	// on the order of the directory.
	pids := make([]int, 0, len(names))
	for _, name := range names {
		if pid, err := strconv.Atoi(name); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	self := os.Getpid()
	for _, pid := range pids {
		if pid == self {
			continue // its main thread may be parked in any namespace (see selfNetns)
		}
		add(b.procRoot + "/" + strconv.Itoa(pid) + "/ns/net")
	}
	return out
}

// vanished tells whether opening a namespace failed because its process
// exited or its bind mount went away during the scan.
func vanished(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) || errors.Is(err, unix.ENOENT)
}

// holdsIPs tells whether the namespace has every one of ips on an
// interface other than a loopback one. It reads the addresses of both
// families at once, through a netlink socket bound to the namespace.
func holdsIPs(ns netns.NsHandle, ips []netip.Addr) (bool, error) {
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("netlink socket in namespace: %w", err)
	}
	defer nl.Close()
	family := netlink.FAMILY_ALL
	if len(ips) == 1 && ips[0].Is4() {
		family = netlink.FAMILY_V4
	} else if len(ips) == 1 {
		family = netlink.FAMILY_V6
	}
	addrs, err := nl.AddrList(nil, family)
	if err != nil {
		return false, fmt.Errorf("listing addresses: %w", err)
	}
	loopback := map[int]bool{}
	for _, ip := range ips {
		want := net.IP(ip.AsSlice())
		held := false
		for _, a := range addrs {
			if a.IPNet == nil || !a.IP.Equal(want) {
				continue
			}
			lo, known := loopback[a.LinkIndex]
			if !known {
				link, err := nl.LinkByIndex(a.LinkIndex)
				if err != nil {
					return false, fmt.Errorf("interface %d holding %s: %w", a.LinkIndex, ip, err)
				}
				lo = link.Attrs().Flags&net.FlagLoopback != 0
				loopback[a.LinkIndex] = lo
			}
			if !lo {
				held = true
				break
			}
		}
		if !held {
			return false, nil
		}
	}
	return true, nil
}
