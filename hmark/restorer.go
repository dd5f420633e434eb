package hmark

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
)

// Restorer is the seam to iptables-save and iptables-restore: Sync reads
// each table it syncs in one Save, and Chain hands Restore the whole new
// content of its chain in one payload, so that rewriting 10,000 rules costs
// one process instead of 10,000, and a Sync one process per table to read
// (see Sync). ExecRestorer runs the real binaries; unit tests give Chain a
// fake, privileged tests a restorer bound to a test network namespace.
type Restorer interface {
	// Save returns table as `iptables-save -t table` prints it: "*table",
	// a ":CHAIN POLICY [packets:bytes]" line per chain ("-" for a user
	// chain), every rule as "-A CHAIN ..." in the form `iptables -S`
	// prints it, and "COMMIT" (comment lines aside). It must read where
	// Restore writes and the Chain's IPTables reads: the same backend, in
	// the same network namespace.
	Save(table string) ([]byte, error)
	// Restore applies payload, in iptables-save format and for table only
	// ("*table", chain declarations, rules, "COMMIT"), as `iptables-restore
	// --noflush --counters --wait` does: atomically, each chain the payload
	// declares flushed and refilled, every other chain and rule left as it
	// is. (The tunnel IPs' counters live in a set, not in the rules, so
	// a restore does not reset them.)
	// Errors may quote the payload; Chain scrubs its seed from them.
	Restore(table string, payload []byte) error
}

// ExecRestorer is the Restorer that runs an iptables-restore binary with
// --noflush --counters --wait (waiting for the xtables lock, like
// go-iptables does), and the matching iptables-save.
type ExecRestorer struct {
	// Command is the iptables-restore binary: a name looked up in PATH,
	// or a path, ending in "-restore". It must match the iptables binary
	// Chain reads with (same backend), or Chain writes rules where it
	// never reads them. Save runs the binary of the same name with
	// "-save" for "-restore".
	Command string
}

// NewExecRestorer returns the Restorer that runs the iptables-restore
// matching iptablesBinary, a name or a path: "iptables" (or "") gives
// "iptables-restore", "iptables-legacy" gives "iptables-legacy-restore",
// "/usr/sbin/iptables-nft" gives "/usr/sbin/iptables-nft-restore"; for an
// IPv6 Chain, "ip6tables" gives "ip6tables-restore" and
// "ip6tables-legacy" "ip6tables-legacy-restore" (the empty name is
// iptables: an IPv6 Chain must name its binary).
func NewExecRestorer(iptablesBinary string) *ExecRestorer {
	if iptablesBinary == "" {
		iptablesBinary = "iptables"
	}
	return &ExecRestorer{Command: iptablesBinary + "-restore"}
}

// Restore runs `Command --noflush --counters --wait` with payload on its
// standard input. It refuses a payload that does not start with "*table".
// Its error has the tool's output, which may quote a rule of the payload.
func (r *ExecRestorer) Restore(table string, payload []byte) error {
	if !bytes.HasPrefix(payload, []byte("*"+table+"\n")) {
		return fmt.Errorf("%s: payload does not start with *%s", r.Command, table)
	}
	cmd := exec.Command(r.Command, "--noflush", "--counters", "--wait")
	cmd.Stdin = bytes.NewReader(payload)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s --noflush --counters --wait (table %s): %w: %s", r.Command, table, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// Save runs Command's iptables-save (iptables-nft-restore's is
// iptables-nft-save) with -t table and returns what it prints. Its error
// has the tool's standard error.
func (r *ExecRestorer) Save(table string) ([]byte, error) {
	base, ok := strings.CutSuffix(r.Command, "-restore")
	if !ok {
		return nil, fmt.Errorf("%s: no iptables-save to go with it (the name does not end in -restore)", r.Command)
	}
	save := base + "-save"
	cmd := exec.Command(save, "-t", table)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return nil, fmt.Errorf("%s -t %s: %w", save, table, err)
	}
	return out, nil
}

// restorePayloadOf is the iptables-restore input that replaces the content
// of chain in table with the rules specs, in order. With --noflush,
// declaring the chain flushes it (and creates it if absent); no other chain
// is declared, so no other chain changes. No word needs quoting: the chain
// and set names are validated, the comment is RuleComment, the rest are
// numbers, chain and option names.
func restorePayloadOf(table, chain string, specs [][]string) []byte {
	var b bytes.Buffer
	b.Grow(64 + len(specs)*(len(chain)+200))
	fmt.Fprintf(&b, "*%s\n:%s - [0:0]\n", table, chain)
	for _, spec := range specs {
		b.WriteString("-A ")
		b.WriteString(chain)
		for _, w := range spec {
			b.WriteByte(' ')
			b.WriteString(w)
		}
		b.WriteByte('\n')
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}
