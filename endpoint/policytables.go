package endpoint

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// PolicyTables reads and writes the filter table of a pod's network
// namespace: the seam to iptables for the network policy rules.
type PolicyTables interface {
	// Save returns iptables-save's output, with counters.
	Save(ns netns.NsHandle) (string, error)
	// Restore feeds payload to iptables-restore --noflush.
	Restore(ns netns.NsHandle, payload []byte) error
}

// NamespaceIPTables runs the iptables commands of one backend inside pod
// namespaces: Binary is "iptables", "iptables-nft" or "iptables-legacy"
// (iptbackend.Backend.Binary), with "-save" and "-restore" added.
type NamespaceIPTables struct {
	Binary string
}

// iptablesTimeout bounds one command: a wedged xtables lock must not hold
// a worker for ever.
const iptablesTimeout = 30 * time.Second

func (t NamespaceIPTables) run(ns netns.NsHandle, stdin []byte, name string, args ...string) (string, error) {
	var out string
	err := nsexec.Do(ns, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), iptablesTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
		}
		out = stdout.String()
		return nil
	})
	return out, err
}

// Save implements PolicyTables. It reads every table (-t filter would
// create the legacy filter table in a namespace that has none).
func (t NamespaceIPTables) Save(ns netns.NsHandle) (string, error) {
	return t.run(ns, nil, t.Binary+"-save", "-c")
}

// Restore implements PolicyTables.
func (t NamespaceIPTables) Restore(ns netns.NsHandle, payload []byte) error {
	_, err := t.run(ns, payload, t.Binary+"-restore", "--noflush", "-w")
	if err != nil {
		return fmt.Errorf("%w\npayload:\n%s", err, payload)
	}
	return nil
}
