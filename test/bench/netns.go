package main

import (
	"fmt"
	"io"
	"os/exec"
	"runtime"
	"strings"

	"github.com/coreos/go-iptables/iptables"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// namespace is a named network namespace the benchmark created (ip netns),
// so that its commands can also run there with `ip -n` and `ip netns exec`.
type namespace struct {
	name   string
	handle netns.NsHandle
}

// newEmptyNamespace creates the namespace name (replacing a leftover one)
// with lo up.
func newEmptyNamespace(name string) (*namespace, error) {
	_ = exec.Command("ip", "netns", "del", name).Run()
	if err := ipCmd("netns", "add", name); err != nil {
		return nil, err
	}
	if err := ipCmd("-n", name, "link", "set", "lo", "up"); err != nil {
		return nil, err
	}
	h, err := netns.GetFromName(name)
	if err != nil {
		return nil, err
	}
	return &namespace{name: name, handle: h}, nil
}

// newNamespace creates a namespace with a veth pair in it (veth0
// 192.168.50.1/24, veth1), both up: veth0 stands in for the GRE device.
func newNamespace(name string) (*namespace, error) {
	ns, err := newEmptyNamespace(name)
	if err != nil {
		return nil, err
	}
	for _, args := range [][]string{
		{"-n", name, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"},
		{"-n", name, "addr", "add", "192.168.50.1/24", "dev", "veth0"},
		{"-n", name, "link", "set", "veth0", "up"},
		{"-n", name, "link", "set", "veth1", "up"},
	} {
		if err := ipCmd(args...); err != nil {
			ns.close()
			return nil, err
		}
	}
	return ns, nil
}

func (n *namespace) close() {
	n.handle.Close()
	_ = exec.Command("ip", "netns", "del", n.name).Run()
}

// run runs a command inside the namespace and returns its combined output.
func (n *namespace) run(name string, args ...string) (string, error) {
	out, err := exec.Command("ip", append([]string{"netns", "exec", n.name, name}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s in netns %s: %v: %s", name, strings.Join(args, " "), n.name, err, out)
	}
	return string(out), nil
}

func ipCmd(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// nsThread is one OS thread inside a namespace that runs the functions
// handed to it. The router's code runs on it as it runs in the router
// process: its netlink sockets open in the thread's namespace and the
// commands it starts (iptables, iptables-restore, and whatever else the
// HMARK chain may run) inherit that namespace. The thread is never switched
// back; the runtime discards it after close.
type nsThread struct{ jobs chan func() }

func startNSThread(ns *namespace) (*nsThread, error) {
	t := &nsThread{jobs: make(chan func())}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread is discarded
		if err := netns.Set(ns.handle); err != nil {
			errc <- fmt.Errorf("entering netns %s: %w", ns.name, err)
			return
		}
		errc <- nil
		for fn := range t.jobs {
			fn()
		}
	}()
	return t, <-errc
}

// do runs fn on the thread and waits for it.
func (t *nsThread) do(fn func() error) error {
	errc := make(chan error, 1)
	t.jobs <- func() { errc <- fn() }
	return <-errc
}

func (t *nsThread) close() { close(t.jobs) }

// routerDatapath is the router's datapath wired as router/startup wires it
// (openDatapath): netlink handles (routes, ipsets) and an rtnetlink client of the calling
// thread's namespace, go-iptables' iptables.New() with the iptables-restore
// restorer, the sticky chain with several generations, and device as the
// flow-based GRE device, which must exist (this host has no GRE). Call it,
// and every method of the datapath, on an nsThread.
type routerDatapath struct {
	*datapath.Datapath
	close func()
}

func openRouterDatapath(cfg datapath.Config) (*routerDatapath, error) {
	return openRouterDatapathWith(cfg, "iptables")
}

// openRouterDatapathWith is openRouterDatapath writing the chains with the
// iptables binary named (iptables, iptables-legacy, iptables-nft).
func openRouterDatapathWith(cfg datapath.Config, iptablesBinary string) (*routerDatapath, error) {
	handle, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink handle: %w", err)
	}
	routes, err := rtnl.Open(netns.None())
	if err != nil {
		handle.Close()
		return nil, err
	}
	sets, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		routes.Close()
		handle.Close()
		return nil, fmt.Errorf("netfilter netlink handle (ipsets): %w", err)
	}
	closeAll := func() { routes.Close(); handle.Close(); sets.Close() }
	path, err := exec.LookPath(iptablesBinary)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("%s (apt-get install -y iptables): %w", iptablesBinary, err)
	}
	ipt, err := iptables.New(iptables.Path(path))
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("iptables (apt-get install -y iptables): %w", err)
	}
	chain, err := hmark.NewChain(ipt, sets, cfg.Chain, cfg.HMARKParams(), hmark.NewExecRestorer(iptablesBinary))
	if err != nil {
		closeAll()
		return nil, err
	}
	if cfg.Generations > 1 {
		if err := chain.SetSticky(cfg.Sticky()); err != nil {
			closeAll()
			return nil, err
		}
	}
	log := logrus.New()
	log.Out = io.Discard
	dp := datapath.NewDatapath(cfg, routes, handle, chain, &datapath.ExistingDevice{Name: cfg.GREDevice, Links: handle}, nil, log)
	return &routerDatapath{Datapath: dp, close: closeAll}, nil
}

// sysctls sets sysctls (name=value, with dots) inside the namespace.
func (n *namespace) sysctls(kv ...string) error {
	_, err := n.run("sysctl", append([]string{"-q", "-w"}, kv...)...)
	return err
}

func sh(name string, args ...string) string {
	out, _ := exec.Command(name, args...).CombinedOutput()
	return string(out)
}

func hostKernel() string { return strings.TrimSpace(sh("uname", "-r")) }
