// Command tunnel-router runs on every node labelled node=tunnel. It marks each
// packet for a tunnel IP with iptables HMARK and routes each bucket of flows
// to one endpoint pod over GRE or MPLS. See docs/flags.md for every flag.
package main

import (
	"fmt"
	"os"
	"runtime"

	"github.com/cmdnu/kube-service-tunnel/router/startup"
)

// The main goroutine keeps the main thread for itself. Code that enters
// another network namespace runs on a locked thread that is thrown away
// afterwards (internal/nsexec); Go cannot throw the main thread away, so were
// such code ever scheduled on it, the thread would stay in that namespace for
// the life of the process (and keep a gone pod's namespace alive).
func init() { runtime.LockOSThread() }

func main() {
	if err := startup.Main(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "tunnel-router:", err)
		os.Exit(1)
	}
}
