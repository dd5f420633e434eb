package runtime

import (
	"fmt"

	"github.com/vishvananda/netns"
)

// AllNamespaces opens every network namespace of the node other than the
// host's and the caller's own: named ones (/var/run/netns, /run/netns) and
// those of every process. It is for tunnel-endpoint --cleanup, which removes
// what the agent owns wherever it is, without asking the API server which
// pods exist. Namespaces that vanish during the scan are skipped.
func AllNamespaces() ([]Netns, error) {
	b := NewByIP()
	skip := map[nsKey]bool{}
	host, err := b.hostKey()
	if err != nil {
		return nil, fmt.Errorf("identifying the host's network namespace: %w", err)
	}
	skip[host] = true
	if self, err := statKey(b.selfNetns); err == nil {
		skip[self] = true
	}
	var out []Netns
	for _, c := range b.candidates(skip) {
		h, err := netns.GetFromPath(c.path)
		if err != nil {
			continue
		}
		out = append(out, Netns{Handle: h, Path: c.path, Via: "scan"})
	}
	return out, nil
}
