// Command tunnel-router runs on every node labelled node=tunnel. It marks each
// packet for a tunnel IP with iptables HMARK and routes each bucket of flows
// to one endpoint pod over GRE or MPLS. See README.md for every flag.
package main

import (
	"fmt"
	"os"

	"github.com/cmdnu/kube-service-tunnel/router"
)

func main() {
	if err := router.Main(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "tunnel-router:", err)
		os.Exit(1)
	}
}
