package lab

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"text/template"

	"github.com/cmdnu/kube-service-tunnel/test/lab/guest"
)

// DefaultModules are the kernel modules /init loads when
// InitramfsOptions.Modules is nil: the tunnels (GRE over IPv4 and over
// IPv6, IPIP), MPLS, iptables and ip6tables (legacy and nft) with HMARK and
// ipset matches, veth and bridge, and the virtio NIC used for guestfwd.
//
// IPv6 itself is built into Debian's kernel, and so are its policy routing
// and nexthop objects. ip6_gre brings ip6_tunnel and tunnel6 (and gre, which
// ip_gre needs too); ip6_tables, ip6table_mangle and ip6table_raw are what
// ip6tables-legacy needs (the nft backend needs only nf_tables and
// nft_compat); xt_HMARK, the xt_* matches and nf_conntrack (which brings
// nf_defrag_ipv6) serve both families. Loading ip6_gre and ip6_tunnel adds
// the fallback devices ip6gre0 and ip6tnl0 to every namespace.
var DefaultModules = []string{
	"veth", "bridge", "ip_gre", "ipip", "ip6_gre", "mpls_router", "mpls_iptunnel",
	"x_tables", "xt_HMARK", "xt_mark", "xt_tcpudp", "xt_comment", "ip_tables", "iptable_mangle",
	"ip6_tables", "ip6table_mangle", "ip6table_raw",
	"nf_conntrack", "nf_conntrack_netlink", "xt_conntrack", "xt_connmark", "xt_CT", "iptable_raw",
	"ip_set", "ip_set_hash_ip", "ip_set_hash_ipport", "ip_set_hash_ipportip", "xt_set",
	"nf_tables", "nft_compat", "nft_ct", "virtio_pci", "virtio_net",
}

// RunScript is where the caller's script lives in the VM; /init runs it with
// /bin/sh and reports its exit code.
const RunScript = "/lab/run.sh"

// Guest network addresses, when Boot is given ForwardHostPorts: /init puts
// GuestAddr on eth0, and a TCP connection to HostForwardAddr:PORT reaches the
// host's 127.0.0.1:PORT. Nothing else outside the VM is reachable.
const (
	GuestAddr       = "10.0.2.15/24"
	HostForwardAddr = guest.HostForwardAddr
)

// xtablesPluginDir is where iptables looks for its extensions (libxt_HMARK.so
// and friends), on the host and in the VM.
const xtablesPluginDir = "/usr/lib/x86_64-linux-gnu/xtables"

// InitramfsOptions describe the VM's root filesystem.
type InitramfsOptions struct {
	// Assets give the kernel version and modules (from Require or
	// PrepareAssets).
	Assets Assets
	// Output is the path of the cpio archive to write.
	Output string
	// Modules are the kernel modules /init loads, with their dependencies;
	// nil means DefaultModules.
	Modules []string
	// Script is the content of /lab/run.sh. It may instead be given in Files.
	Script string
	// Files maps paths in the VM to host files copied there with their
	// permission bits: static Go binaries (CGO_ENABLED=0), scripts, data.
	Files map[string]string
	// HostBinaries are more dynamically linked host programs to copy to the
	// same path in the VM, with the shared libraries ldd lists for them.
	// iproute2's ip and iptables (every name of the xtables multi-call
	// binaries: ip6tables, ip6tables-restore, ip6tables-legacy, ...) are
	// always included.
	HostBinaries []string
}

// Initramfs is an archive written by BuildInitramfs.
type Initramfs struct {
	// Path is the cpio archive, given to qemu as -initrd.
	Path string
	// Size is its size in bytes.
	Size int64
	// EndMarker starts the line /init prints once /lab/run.sh has exited,
	// followed by " rc=CODE"; it is random, so a script cannot print it by
	// accident.
	EndMarker string
	// Modules are the module files /init loads, in order.
	Modules []Module
}

// Module is a kernel module file /init loads.
type Module struct {
	// Path is the file in the VM.
	Path string
	// Requested is true for the modules named in InitramfsOptions.Modules,
	// false for their dependencies. /init reports a requested module that
	// fails to load; a dependency may fail quietly (crc32c-intel needs
	// SSE4.2, which qemu's default CPU lacks; crc32c_generic stands in).
	Requested bool
}

// BuildInitramfs writes an uncompressed cpio archive holding a static busybox (its
// applets in /bin, /sbin, /usr/bin, /usr/sbin), iproute2's /sbin/ip, the
// iptables binaries (nft and legacy) with their extensions, the shared
// libraries those need, the kernel modules, the caller's files and an /init.
//
// /init mounts /proc, /sys, /dev, a tmpfs on /run (/var/run links there, as
// `ip netns` needs) and on /tmp, loads the modules (a failure is printed, not
// fatal, and printed only for requested modules), sets lo up (and eth0 to GuestAddr when there is one), runs
// `/bin/sh /lab/run.sh` with its output on the serial console, prints
// "EndMarker rc=CODE" and powers the VM off.
//
// Debian's busybox sh runs its own `ip` applet rather than searching PATH, so
// scripts must call iproute2 as /sbin/ip.
func BuildInitramfs(opts InitramfsOptions) (Initramfs, error) {
	if opts.Output == "" {
		return Initramfs{}, errors.New("lab: InitramfsOptions.Output is empty")
	}
	if opts.Assets.KernelVersion == "" || opts.Assets.ModulesRoot == "" {
		return Initramfs{}, errors.New("lab: InitramfsOptions.Assets is empty (use Require or PrepareAssets)")
	}
	tree := fsTree{}
	if err := addBusybox(tree); err != nil {
		return Initramfs{}, err
	}
	if err := addNetTools(tree, opts.HostBinaries); err != nil {
		return Initramfs{}, err
	}
	modNames := opts.Modules
	if modNames == nil {
		modNames = DefaultModules
	}
	modules, err := addModules(tree, opts.Assets, modNames)
	if err != nil {
		return Initramfs{}, err
	}

	for _, dir := range []string{"proc", "sys", "dev", "run", "tmp", "etc", "root", "lab"} {
		tree.addDir(dir)
	}
	tree.addSymlink("var/run", "/run")
	tree.add("dev/console", fsEntry{mode: modeCharDev | 0o600, rdevMaj: 5, rdevMin: 1})
	tree.addData("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n"))
	tree.addData("etc/group", 0o644, []byte("root:x:0:\n"))
	tree.addData("etc/hosts", 0o644, []byte("127.0.0.1 localhost\n"))

	if opts.Script != "" {
		if _, ok := opts.Files[RunScript]; ok {
			return Initramfs{}, fmt.Errorf("lab: both Script and Files[%q] are set", RunScript)
		}
		tree.addData(RunScript, 0o755, []byte(opts.Script))
	}
	for vmPath, hostPath := range opts.Files {
		if err := tree.addHostFile(vmPath, hostPath); err != nil {
			return Initramfs{}, fmt.Errorf("lab: caller's file: %w", err)
		}
	}
	if _, ok := tree[canonical(RunScript)]; !ok {
		return Initramfs{}, fmt.Errorf("lab: no %s: set InitramfsOptions.Script or Files", RunScript)
	}

	nonce := make([]byte, 8)
	if _, err := rand.Read(nonce); err != nil {
		return Initramfs{}, fmt.Errorf("lab: end marker: %w", err)
	}
	ir := Initramfs{Path: opts.Output, EndMarker: "KST-LAB-END-" + hex.EncodeToString(nonce), Modules: modules}
	var init bytes.Buffer
	if err := initTemplate.Execute(&init, ir); err != nil {
		return Initramfs{}, fmt.Errorf("lab: rendering /init: %w", err)
	}
	tree.addData("init", 0o755, init.Bytes())

	size, err := writeCPIO(tree, opts.Output)
	if err != nil {
		return Initramfs{}, err
	}
	ir.Size = size
	return ir, nil
}

// writeCPIO writes the tree to path, uncompressed, and returns the
// archive's size. Not gzip: under TCG the guest's kernel inflated a lab
// cluster node's 160 MB archive for seconds of every boot, and copying the
// larger plain archive costs the host and qemu next to nothing.
func writeCPIO(tree fsTree, path string) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, fmt.Errorf("lab: creating initramfs: %w", err)
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 1<<20)
	if err := tree.writeCPIO(bw); err != nil {
		return 0, fmt.Errorf("lab: writing %s: %w", path, err)
	}
	if err := bw.Flush(); err != nil {
		return 0, fmt.Errorf("lab: writing %s: %w", path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("lab: writing %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return 0, fmt.Errorf("lab: writing %s: %w", path, err)
	}
	return fi.Size(), nil
}

// addBusybox adds the host's busybox as /bin/busybox with a link for each of
// its applets.
func addBusybox(tree fsTree) error {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("lab: %w (install busybox-static)", err)
	}
	out, err := exec.Command(bb, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("lab: busybox --list-full: %w", err)
	}
	if err := addWithLibraries(tree, []string{bb}, map[string]string{bb: "/bin/busybox"}); err != nil {
		return err
	}
	for _, applet := range strings.Fields(string(out)) {
		if canonical(applet) != canonical("bin/busybox") {
			tree.addSymlink(applet, "/bin/busybox")
		}
	}
	return nil
}

// addNetTools adds iproute2's ip, the iptables multi-call binaries with a link
// for each name that points at them on the host (iptables, iptables-legacy,
// ip6tables-save, ...), the iptables extensions, the caller's extra host
// binaries, and every shared library they need.
func addNetTools(tree fsTree, extra []string) error {
	ip, err := exec.LookPath("ip")
	if err != nil {
		return fmt.Errorf("lab: %w (install iproute2)", err)
	}
	bins := []string{ip}
	vmPaths := map[string]string{ip: "/sbin/ip"}
	for _, b := range extra {
		abs, err := exec.LookPath(b)
		if err != nil {
			return fmt.Errorf("lab: host binary: %w", err)
		}
		bins = append(bins, abs)
	}

	iptables, err := exec.LookPath("iptables")
	if err != nil {
		return fmt.Errorf("lab: %w (install iptables)", err)
	}
	sbin := filepath.Dir(iptables)
	names, err := os.ReadDir(sbin)
	if err != nil {
		return fmt.Errorf("lab: listing %s: %w", sbin, err)
	}
	multi := map[string]bool{}
	for _, n := range names {
		if !strings.Contains(n.Name(), "tables") {
			continue
		}
		target, err := filepath.EvalSymlinks(filepath.Join(sbin, n.Name()))
		if err != nil || !strings.HasPrefix(filepath.Base(target), "xtables-") || !strings.HasSuffix(target, "-multi") {
			continue // dangling alternatives, iptables-apply (a script), ...
		}
		if !multi[target] {
			multi[target] = true
			bins = append(bins, target)
			vmPaths[target] = "/usr/sbin/" + filepath.Base(target)
		}
		if n.Name() != filepath.Base(target) {
			tree.addSymlink("/usr/sbin/"+n.Name(), filepath.Base(target))
		}
	}
	if len(multi) == 0 {
		return fmt.Errorf("lab: no xtables-*-multi binary behind the names in %s", sbin)
	}

	plugins, err := filepath.Glob(filepath.Join(xtablesPluginDir, "*.so"))
	if err != nil || len(plugins) == 0 {
		return fmt.Errorf("lab: no iptables extensions in %s (install iptables)", xtablesPluginDir)
	}
	for _, p := range plugins {
		vmPaths[p] = p
	}
	return addWithLibraries(tree, append(bins, plugins...), vmPaths)
}

// lddLine matches the lines of ldd's output that name a library file:
// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and
// "/lib64/ld-linux-x86-64.so.2 (0x...)".
var lddLine = regexp.MustCompile(`^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$`)

// addWithLibraries adds host files at vmPaths[file] (or their own path) and
// the shared libraries ldd lists for them at the paths ldd prints, which are
// the ones the dynamic loader searches in the VM too.
func addWithLibraries(tree fsTree, files []string, vmPaths map[string]string) error {
	for _, f := range files {
		vmPath := vmPaths[f]
		if vmPath == "" {
			vmPath = f
		}
		real, err := filepath.EvalSymlinks(f)
		if err != nil {
			return fmt.Errorf("lab: %w", err)
		}
		if err := tree.addHostFile(vmPath, real); err != nil {
			return fmt.Errorf("lab: %w", err)
		}
	}
	// ldd exits 1 when one of the files is static ("not a dynamic
	// executable" on stderr); its output still lists the others' libraries.
	var stderr bytes.Buffer
	cmd := exec.Command("ldd", files...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil && !strings.Contains(stderr.String(), "not a dynamic executable") {
		return fmt.Errorf("lab: ldd %s: %w: %s", strings.Join(files, " "), err, strings.TrimSpace(stderr.String()))
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "not found") {
			return fmt.Errorf("lab: ldd: missing shared library: %s", strings.TrimSpace(line))
		}
		m := lddLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		if _, ok := tree[canonical(m[1])]; ok {
			continue
		}
		real, err := filepath.EvalSymlinks(m[1])
		if err != nil {
			return fmt.Errorf("lab: shared library: %w", err)
		}
		if err := tree.addHostFile(m[1], real); err != nil {
			return fmt.Errorf("lab: shared library: %w", err)
		}
	}
	return nil
}

// addModules adds the named modules and their dependencies, in load order as
// `modprobe --show-depends` gives them (the named module last), and returns
// them in that order. Modules built into the kernel are skipped.
func addModules(tree fsTree, a Assets, names []string) ([]Module, error) {
	root := filepath.Clean(a.ModulesRoot)
	var order []Module
	index := map[string]int{} // VM path -> position in order
	for _, name := range names {
		out, err := exec.Command("modprobe", "-d", root, "-S", a.KernelVersion, "--show-depends", name).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("lab: modprobe --show-depends %s: %w: %s", name, err, strings.TrimSpace(string(out)))
		}
		last := ""
		for _, line := range strings.Split(string(out), "\n") {
			fields := strings.Fields(line)
			if len(fields) < 2 || fields[0] != "insmod" {
				continue // "builtin NAME" or empty
			}
			hostPath := fields[1]
			vmPath := strings.TrimPrefix(hostPath, root)
			if vmPath == hostPath {
				return nil, fmt.Errorf("lab: modprobe --show-depends %s: %s is outside %s", name, hostPath, root)
			}
			last = vmPath
			if _, ok := index[vmPath]; ok {
				continue
			}
			if strings.HasSuffix(vmPath, ".xz") || strings.HasSuffix(vmPath, ".zst") || strings.HasSuffix(vmPath, ".gz") {
				return nil, fmt.Errorf("lab: module %s is compressed (lab-assets.sh decompresses them: rerun it)", hostPath)
			}
			if err := tree.addHostFile(vmPath, hostPath); err != nil {
				return nil, fmt.Errorf("lab: module %s: %w", name, err)
			}
			index[vmPath] = len(order)
			order = append(order, Module{Path: vmPath})
		}
		if last != "" {
			order[index[last]].Requested = true
		}
	}
	return order, nil
}

// initTemplate renders /init; its data is the Initramfs being built.
var initTemplate = template.Must(template.New("init").Parse(`#!/bin/sh
# /init of a kube-service-tunnel lab VM (test/lab).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
# Every veth hop of the lab's namespaces queues its packet on the sending
# CPU's backlog, which holds net.core.netdev_max_backlog (1000) packets. On
# two emulated cores a burst of the e2e lab's flows filled it: one run
# dropped 2% of all its packets there (76k of 3.9M, /proc/net/softnet_stat),
# so flows lost SYNs and segments the product never saw.
echo 10000 > /proc/sys/net/core/netdev_max_backlog || echo "lab: cannot raise netdev_max_backlog"
{{- range .Modules}}
{{- if .Requested}}
insmod {{.Path}} || echo "lab: insmod {{.Path}} failed"
{{- else}}
insmod {{.Path}} 2>/dev/null
{{- end}}
{{- end}}
/sbin/ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
	/sbin/ip link set eth0 up && /sbin/ip addr add ` + GuestAddr + ` dev eth0
fi
cd /lab
/bin/sh ` + RunScript + ` </dev/null >/dev/console 2>&1
rc=$?
echo "{{.EndMarker}} rc=$rc" >/dev/console
sync
poweroff -f
`))
