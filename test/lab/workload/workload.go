// Package workload is the traffic of the end-to-end lab: small TCP and UDP
// servers that run inside pod network namespaces and say which pod answered,
// and clients that run inside the client's network namespace and check what
// comes back.
//
// The TCP protocol is one command line from the client, then:
//
//	WHO        -> "pod=NAME peer=IP:PORT local=IP:PORT\n", server closes
//	SINK N     -> server reads N bytes, replies "got=N sha256=HEX pod=... peer=... local=...\n", closes
//	SOURCE N   -> server writes the N bytes of Payload(N), closes
//	ECHO       -> server echoes every byte until the client goes away
//
// Over UDP, a datagram "WHO" is answered by one datagram
// "pod=NAME peer=IP:PORT local=IP:PORT", sent from the address the request
// was sent to.
//
// peer is the client as the server sees it and local is the address the
// request arrived on: the tunnel IP when it came through the tunnel.
package workload

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net/netip"
	"strings"
)

// Identity is who answered a request, as the server reports it.
type Identity struct {
	// Pod is the name the server was started with.
	Pod string
	// Peer is the client's address and port as the server saw them.
	Peer netip.AddrPort
	// Local is the address and port the request arrived on.
	Local netip.AddrPort
}

// String is the wire form of an identity: "pod=NAME peer=IP:PORT local=IP:PORT".
func (id Identity) String() string {
	return fmt.Sprintf("pod=%s peer=%s local=%s", id.Pod, id.Peer, id.Local)
}

// parseFields splits "k=v k=v ..." into a map.
func parseFields(line string) (map[string]string, error) {
	fields := map[string]string{}
	for _, f := range strings.Fields(line) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("malformed field %q in %q", f, line)
		}
		fields[k] = v
	}
	return fields, nil
}

// identityFrom reads the pod, peer and local fields of a reply.
func identityFrom(fields map[string]string) (Identity, error) {
	var id Identity
	var err error
	id.Pod = fields["pod"]
	if id.Pod == "" {
		return id, fmt.Errorf("reply has no pod name")
	}
	if id.Peer, err = netip.ParseAddrPort(fields["peer"]); err != nil {
		return id, fmt.Errorf("reply peer: %w", err)
	}
	if id.Local, err = netip.ParseAddrPort(fields["local"]); err != nil {
		return id, fmt.Errorf("reply local: %w", err)
	}
	return id, nil
}

// parseIdentity parses the wire form written by Identity.String.
func parseIdentity(line string) (Identity, error) {
	fields, err := parseFields(line)
	if err != nil {
		return Identity{}, err
	}
	return identityFrom(fields)
}

// Payload returns the n bytes a server sends for "SOURCE n" and Download
// expects: a ChaCha8 stream seeded with n, so any corruption, truncation or
// reordering is detected by comparing against a fresh Payload(n).
func Payload(n int) io.Reader {
	var seed [32]byte
	copy(seed[:], fmt.Sprintf("kst-workload-%d", n))
	return io.LimitReader(rand.NewChaCha8(seed), int64(n))
}
