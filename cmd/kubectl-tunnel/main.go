// Command kubectl-tunnel is the kubectl plugin of kube-service-tunnel: put
// it on PATH and run kubectl tunnel status or kubectl tunnel explain.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := tunnelctl.Main(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
