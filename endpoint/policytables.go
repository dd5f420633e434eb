package endpoint

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// PolicyTables reads and writes the filter tables of a pod's network
// namespace: the seam to iptables (ipv6 false) and ip6tables (ipv6 true)
// for the network policy rules.
type PolicyTables interface {
	// Save returns iptables-save's (ip6tables-save's) output, with counters.
	Save(ns netns.NsHandle, ipv6 bool) (string, error)
	// Restore feeds payload to iptables-restore (ip6tables-restore) --noflush.
	Restore(ns netns.NsHandle, ipv6 bool, payload []byte) error
}

// NamespaceIPTables runs the iptables commands of one backend inside pod
// namespaces: Binary is "iptables", "iptables-nft" or "iptables-legacy"
// (iptbackend.Backend.Binary), with "-save" and "-restore" added; the IPv6
// commands are the same with ip6tables in place of iptables
// (ip6tables-nft-save).
type NamespaceIPTables struct {
	Binary string
}

// binary returns the command of the family: Binary, or its ip6tables
// counterpart.
func (t NamespaceIPTables) binary(ipv6 bool) string {
	if !ipv6 {
		return t.Binary
	}
	dir, base := filepath.Split(t.Binary)
	if rest, ok := strings.CutPrefix(base, "iptables"); ok {
		return dir + "ip6tables" + rest
	}
	return t.Binary // not an iptables command: used as it is
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
func (t NamespaceIPTables) Save(ns netns.NsHandle, ipv6 bool) (string, error) {
	return t.run(ns, nil, t.binary(ipv6)+"-save", "-c")
}

// Restore implements PolicyTables.
func (t NamespaceIPTables) Restore(ns netns.NsHandle, ipv6 bool, payload []byte) error {
	_, err := t.run(ns, payload, t.binary(ipv6)+"-restore", "--noflush", "-w")
	if err != nil {
		return fmt.Errorf("%w\npayload:\n%s", err, payload)
	}
	return nil
}
