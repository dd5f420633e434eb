// Package testnetns gives privileged tests a fresh network namespace of their
// own. It is imported only by _test.go files.
//
// How code runs inside a namespace: NS.Do runs a function on a new goroutine
// locked to its own OS thread, switches that thread into the namespace and
// never switches back nor unlocks it, so the Go runtime terminates the thread
// when the goroutine ends and no other goroutine ever runs in the namespace
// by accident. Whatever the function forks (iptables, ip) inherits the
// namespace of that thread; sockets it opens belong to the namespace for their
// whole life and can be used from any thread. Netlink uses handles bound to
// the namespace and never switches a thread at all.
package testnetns

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/test/support/ipsetstate"
	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// RequireRoot skips the test unless it runs as root (and KST_SKIP_PRIVILEGED
// is not set), with iproute2 installed.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Getenv("KST_SKIP_PRIVILEGED") != "" {
		tb.Skip("KST_SKIP_PRIVILEGED is set")
	}
	if os.Geteuid() != 0 {
		tb.Skip("needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) to create network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		tb.Skip("needs iproute2's ip")
	}
}

// NS is a fresh network namespace owned by one test.
type NS struct {
	Handle netns.NsHandle
	tb     testing.TB
}

// New creates a network namespace with lo up and the given addresses on lo;
// it is closed when the test ends. It skips the test when not root.
func New(tb testing.TB, loAddrs ...netip.Prefix) *NS {
	tb.Helper()
	RequireRoot(tb)
	var handle netns.NsHandle
	err := RunOnDiscardedThread(func() error {
		h, err := netns.New()
		if err != nil {
			return fmt.Errorf("unshare network namespace: %w", err)
		}
		handle = h
		return nil
	})
	if err != nil {
		tb.Fatalf("create test netns: %v", err)
	}
	tb.Cleanup(func() { _ = handle.Close() })
	ns := &NS{Handle: handle, tb: tb}
	nl := ns.Netlink()
	lo, err := nl.LinkByName("lo")
	if err != nil {
		tb.Fatalf("find lo in test netns: %v", err)
	}
	if err := nl.LinkSetUp(lo); err != nil {
		tb.Fatalf("set lo up in test netns: %v", err)
	}
	for _, p := range loAddrs {
		if err := nl.AddrAdd(lo, &netlink.Addr{IPNet: IPNet(p)}); err != nil {
			tb.Fatalf("add %s to lo in test netns: %v", p, err)
		}
	}
	return ns
}

// Netlink returns a netlink handle bound to the namespace, closed when the
// test ends.
func (n *NS) Netlink() *netlink.Handle {
	n.tb.Helper()
	return n.handle(unix.NETLINK_ROUTE, "netlink")
}

// IPSets returns a netfilter netlink handle bound to the namespace, for its
// ipsets, closed when the test ends.
func (n *NS) IPSets() *netlink.Handle {
	n.tb.Helper()
	return n.handle(unix.NETLINK_NETFILTER, "netfilter netlink")
}

// handle opens a netlink handle of family bound to the namespace, closed
// when the test ends.
func (n *NS) handle(family int, what string) *netlink.Handle {
	n.tb.Helper()
	h, err := netlink.NewHandleAt(n.Handle, family)
	if err != nil {
		n.tb.Fatalf("%s handle in test netns: %v", what, err)
	}
	n.tb.Cleanup(h.Close)
	return h
}

// IPSetState lists the namespace's ipsets and their members, one line each
// (see ipsetstate.Lines).
func (n *NS) IPSetState() string {
	n.tb.Helper()
	lines, err := ipsetstate.Lines(n.IPSets())
	if err != nil {
		n.tb.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// Routes returns an rtnetlink route client bound to the namespace, closed
// when the test ends.
func (n *NS) Routes() *rtnl.Client {
	n.tb.Helper()
	c, err := rtnl.Open(n.Handle)
	if err != nil {
		n.tb.Fatalf("rtnetlink client in test netns: %v", err)
	}
	n.tb.Cleanup(func() { c.Close() })
	return c
}

// Do runs fn with its goroutine's thread inside the namespace.
func (n *NS) Do(fn func() error) error {
	return RunOnDiscardedThread(func() error {
		if err := netns.Set(n.Handle); err != nil {
			return fmt.Errorf("enter test netns: %w", err)
		}
		return fn()
	})
}

// Run runs a command inside the namespace, as an operator would, and returns
// its combined output; it fails the test on error.
func (n *NS) Run(name string, args ...string) string {
	n.tb.Helper()
	out, err := n.Output(name, args...)
	if err != nil {
		n.tb.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// RunListing is Run for an iptables listing (iptables-save, iptables -S)
// while a router may end a generation: a listing that a vanishing set
// failed is run again (see ipsetstate.ListRules).
func (n *NS) RunListing(name string, args ...string) string {
	n.tb.Helper()
	out, err := ipsetstate.ListRules(func() (string, error) {
		out, err := n.Output(name, args...)
		if err != nil {
			return out, fmt.Errorf("%w: %s", err, out)
		}
		return out, nil
	})
	if err != nil {
		n.tb.Fatalf("%s %s: %v", name, strings.Join(args, " "), err)
	}
	return out
}

// Output runs a command inside the namespace and returns its combined output
// and error.
func (n *NS) Output(name string, args ...string) (string, error) {
	var out []byte
	err := n.Do(func() error {
		var err error
		out, err = exec.Command(name, args...).CombinedOutput()
		return err
	})
	return string(out), err
}

// AddVeth creates a veth pair inside the namespace, with addr on the first
// end, both ends up, and returns the first end's index.
func (n *NS) AddVeth(name, peer string, addr netip.Prefix) int {
	n.tb.Helper()
	nl := n.Netlink()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer}
	if err := nl.LinkAdd(veth); err != nil {
		n.tb.Fatalf("add veth %s: %v", name, err)
	}
	for _, ifname := range []string{name, peer} {
		l, err := nl.LinkByName(ifname)
		if err != nil {
			n.tb.Fatalf("find %s: %v", ifname, err)
		}
		if err := nl.LinkSetUp(l); err != nil {
			n.tb.Fatalf("set %s up: %v", ifname, err)
		}
	}
	l, err := nl.LinkByName(name)
	if err != nil {
		n.tb.Fatalf("find %s: %v", name, err)
	}
	if addr.IsValid() {
		if err := nl.AddrAdd(l, &netlink.Addr{IPNet: IPNet(addr)}); err != nil {
			n.tb.Fatalf("add %s to %s: %v", addr, name, err)
		}
	}
	return l.Attrs().Index
}

// RunOnDiscardedThread runs fn on a new goroutine locked to its OS thread and
// waits for it; the thread is discarded afterwards (see package nsexec).
func RunOnDiscardedThread(fn func() error) error { return nsexec.OnDiscardedThread(fn) }

// IPNet converts a prefix to the net package's form.
func IPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// IPTables runs go-iptables inside a namespace and counts the write and
// read calls it sees, independently of what the code under test reports.
type IPTables struct {
	handle netns.NsHandle
	ipt    *iptables.IPTables
	binary string
	// Writes counts the calls that write, Reads those that read (each
	// one process).
	Writes, Reads int
}

// IPTables returns go-iptables driving binary ("iptables" for the nft
// backend, "iptables-legacy") inside the namespace. It skips the test when
// the binary is missing.
func (n *NS) IPTables(binary string) *IPTables {
	n.tb.Helper()
	if _, err := exec.LookPath(binary); err != nil {
		n.tb.Skipf("%s not installed (apt-get install -y iptables): %v", binary, err)
	}
	ipt, err := NewIPTables(n.Handle, binary)
	if err != nil {
		n.tb.Fatal(err)
	}
	return ipt
}

// NewIPTables returns go-iptables driving binary inside the namespace of
// handle (for programs such as the benchmark, which have no testing.TB).
func NewIPTables(handle netns.NsHandle, binary string) (*IPTables, error) {
	ipt, err := iptables.New(iptables.Path(binary))
	if err != nil {
		return nil, fmt.Errorf("go-iptables for %s: %w", binary, err)
	}
	return &IPTables{handle: handle, ipt: ipt, binary: binary}, nil
}

func (w *IPTables) do(fn func() error) error {
	return RunOnDiscardedThread(func() error {
		if err := netns.Set(w.handle); err != nil {
			return fmt.Errorf("enter netns: %w", err)
		}
		return fn()
	})
}

func (w *IPTables) read(fn func() error) error {
	w.Reads++
	return w.do(fn)
}

func (w *IPTables) write(fn func() error) error {
	w.Writes++
	return w.do(fn)
}

// ChainExists is iptables.IPTables.ChainExists inside the namespace.
func (w *IPTables) ChainExists(table, chain string) (ok bool, err error) {
	err = w.read(func() (err error) { ok, err = w.ipt.ChainExists(table, chain); return err })
	return ok, err
}

// NewChain is iptables.IPTables.NewChain inside the namespace.
func (w *IPTables) NewChain(table, chain string) error {
	return w.write(func() error { return w.ipt.NewChain(table, chain) })
}

// ClearChain is iptables.IPTables.ClearChain inside the namespace.
func (w *IPTables) ClearChain(table, chain string) error {
	return w.write(func() error { return w.ipt.ClearChain(table, chain) })
}

// DeleteChain is iptables.IPTables.DeleteChain inside the namespace.
func (w *IPTables) DeleteChain(table, chain string) error {
	return w.write(func() error { return w.ipt.DeleteChain(table, chain) })
}

// List is iptables.IPTables.List inside the namespace.
func (w *IPTables) List(table, chain string) (lines []string, err error) {
	err = w.read(func() (err error) { lines, err = w.ipt.List(table, chain); return err })
	return lines, err
}

// ListWithCounters is iptables.IPTables.ListWithCounters inside the namespace.
func (w *IPTables) ListWithCounters(table, chain string) (lines []string, err error) {
	err = w.read(func() (err error) { lines, err = w.ipt.ListWithCounters(table, chain); return err })
	return lines, err
}

// Append is iptables.IPTables.Append inside the namespace.
func (w *IPTables) Append(table, chain string, rulespec ...string) error {
	return w.write(func() error { return w.ipt.Append(table, chain, rulespec...) })
}

// Insert is iptables.IPTables.Insert inside the namespace.
func (w *IPTables) Insert(table, chain string, pos int, rulespec ...string) error {
	return w.write(func() error { return w.ipt.Insert(table, chain, pos, rulespec...) })
}

// Delete is iptables.IPTables.Delete inside the namespace.
func (w *IPTables) Delete(table, chain string, rulespec ...string) error {
	return w.write(func() error { return w.ipt.Delete(table, chain, rulespec...) })
}

// DeleteById is iptables.IPTables.DeleteById inside the namespace.
func (w *IPTables) DeleteById(table, chain string, id int) error {
	return w.write(func() error { return w.ipt.DeleteById(table, chain, id) })
}

// Restore runs BINARY-restore --noflush --counters --wait inside the namespace with
// payload on stdin (hmark.Restorer), counted as one write.
func (w *IPTables) Restore(table string, payload []byte) error {
	return w.write(func() error {
		cmd := exec.Command(w.binary+"-restore", "--noflush", "--counters", "--wait")
		cmd.Stdin = bytes.NewReader(payload)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s-restore (table %s): %w: %s", w.binary, table, err, out)
		}
		return nil
	})
}

// Save runs BINARY-save -t table inside the namespace and returns what it
// prints (hmark.Restorer), counted as one read.
func (w *IPTables) Save(table string) (out []byte, err error) {
	err = w.read(func() error {
		cmd := exec.Command(w.binary+"-save", "-t", table)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if out, err = cmd.Output(); err != nil {
			return fmt.Errorf("%s-save -t %s: %w: %s", w.binary, table, err, stderr.Bytes())
		}
		return nil
	})
	return out, err
}

// ServeTCP listens on addr (network "tcp", or "tcp4"/"tcp6") inside the
// namespace and runs handle on each accepted connection in its own
// goroutine; handle must close it. The listener closes when the test ends.
func (n *NS) ServeTCP(network string, addr netip.AddrPort, handle func(net.Conn)) {
	n.tb.Helper()
	var l net.Listener
	if err := n.Do(func() (err error) { l, err = net.Listen(network, addr.String()); return err }); err != nil {
		n.tb.Fatalf("listen on %v in test netns: %v", addr, err)
	}
	n.tb.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
}
