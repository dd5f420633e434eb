package runtime

import "context"

// AllNamespaces opens every network namespace of the node other than the
// host's and the caller's own: named ones (/var/run/netns, /run/netns) and
// those of every process, each once, identified after opening as the search
// by pod IP does. It is for tunnel-endpoint --cleanup, which removes what the
// agent owns wherever it is, without asking the API server which pods exist.
// Namespaces that vanish during the scan are skipped.
func AllNamespaces() ([]Netns, error) {
	b := NewByIP()
	skip, err := b.ownAndHost()
	if err != nil {
		return nil, err
	}
	var out []Netns
	_, err = b.each(context.Background(), skip, func(ns Netns) (bool, error) {
		ns.Via = "scan"
		out = append(out, ns)
		return true, nil
	})
	return out, err
}
