// Command tunnel-endpoint runs on every node. It enters the network namespace
// of each local endpoint pod of a tunnel Service and adds the tunnel IP there
// with a GRE or MPLS decapsulation path. See README.md for every flag.
package main

import (
	"fmt"
	"os"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
)

func main() {
	if err := endpoint.Main(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "tunnel-endpoint:", err)
		os.Exit(1)
	}
}
