// Command tunnel-endpoint runs on every node. It enters the network namespace
// of each local endpoint pod of a tunnel Service and adds the tunnel IP there
// with a GRE or MPLS decapsulation path. See docs/flags.md for every flag.
package main

import (
	"fmt"
	"os"
	"runtime"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
)

// The main goroutine keeps the main thread for itself. Code that enters
// another network namespace runs on a locked thread that is thrown away
// afterwards (internal/nsexec); Go cannot throw the main thread away, so were
// such code ever scheduled on it, the thread would stay in that namespace for
// the life of the process (and keep a gone pod's namespace alive).
func init() { runtime.LockOSThread() }

func main() {
	if err := endpoint.Main(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "tunnel-endpoint:", err)
		os.Exit(1)
	}
}
