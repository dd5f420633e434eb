// Package guest is the contract between the lab's host side (package lab,
// which builds and boots the VM) and the programs it runs inside (package
// topology, the e2e tests, the demo): where things are in the VM and which
// environment variables carry what. It has no dependencies, so guest
// programs can import it without the host side's test helpers.
package guest

const (
	// BinDir holds the static tunnel-router and tunnel-endpoint.
	BinDir = "/lab/bin"
	// KubeDir holds one kubeconfig per identity: admin.kubeconfig,
	// tunnel-router.kubeconfig and tunnel-endpoint.kubeconfig. Each names the
	// API server by its address on the host's loopback ($KST_LAB_API), which
	// the guest must make reachable (topology relays it).
	KubeDir = "/lab/kube"
	// Program is the program the VM runs.
	Program = "/lab/program"

	// EnvGuest is set to "1" for that program.
	EnvGuest = "KST_LAB_GUEST"
	// EnvAPIAddr is the API server's HOST:PORT as the kubeconfigs name it
	// (127.0.0.1:PORT); in the VM, HostForwardAddr:PORT reaches it.
	EnvAPIAddr = "KST_LAB_API"

	// HostForwardAddr is the guest address whose TCP ports qemu relays to
	// the host's loopback (guestfwd); nothing else outside the VM is
	// reachable.
	HostForwardAddr = "10.0.2.100"
)
