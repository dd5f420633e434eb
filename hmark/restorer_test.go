package hmark

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// writeScript writes an executable shell script.
func writeScript(t *testing.T, path, body string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
}

// writeSaveScript writes a stand-in BINARY-save in dir that prints, for
// -t TABLE, the file dir/TABLE.save (see writeSaved).
func writeSaveScript(t *testing.T, dir, binary string) {
	t.Helper()
	writeScript(t, filepath.Join(dir, binary+"-save"), `[ "$1" = -t ] || exit 2; echo "$@" >> "$(dirname "$0")/save-args"; cat "$(dirname "$0")/$2.save"`+"\n")
}

// writeSaved writes f's mangle and raw tables where the stand-in
// iptables-save of writeSaveScript prints them from.
func writeSaved(t *testing.T, dir string, f *fakeIPTables) {
	t.Helper()
	for _, table := range []string{Table, RawTable} {
		if err := os.WriteFile(filepath.Join(dir, table+".save"), f.save(table), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExecRestorer runs ExecRestorer against stand-in iptables-restore
// scripts: it passes --noflush --counters --wait and the payload on stdin, and a
// failure reaches Sync's error with the tool's output but not the seed.
func TestExecRestorer(t *testing.T) {
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("needs /bin/sh")
	}
	dir := t.TempDir()
	writeScript(t, filepath.Join(dir, "iptables-restore"), `echo "$@" > "$(dirname "$0")/args"; cat > "$(dirname "$0")/stdin"`+"\n")
	writeSaveScript(t, dir, "iptables")
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump})...)
	writeSaved(t, dir, f)
	c, err := NewChain(f, f, "", testParams, NewExecRestorer(filepath.Join(dir, "iptables")))
	if err != nil {
		t.Fatalf("NewChain: %v", err)
	}
	// Two sets created, vipA added to both, two rules written.
	if changed, err := c.Sync(targetsOf(vipA)); err != nil || changed != 6 {
		t.Fatalf("Sync = %d, %v; want 6, nil", changed, err)
	}
	args, _ := os.ReadFile(filepath.Join(dir, "args"))
	stdin, _ := os.ReadFile(filepath.Join(dir, "stdin"))
	if string(args) != "--noflush --counters --wait\n" {
		t.Errorf("iptables-restore ran with %q, want --noflush --counters --wait", args)
	}
	if saveArgs, _ := os.ReadFile(filepath.Join(dir, "save-args")); string(saveArgs) != "-t mangle\n-t raw\n" {
		t.Errorf("iptables-save ran with %q, want -t mangle, then -t raw", saveArgs)
	}
	if want := string(restorePayloadOf(Table, c.name, c.mangleRules([]int{0}, false))); string(stdin) != want || !strings.HasPrefix(want, "*mangle\n:KST-HMARK - [0:0]\n-A KST-HMARK -m set ! --match-set KST-HMARK dst ") {
		t.Errorf("iptables-restore read:\n%s\nwant:\n%s", stdin, want)
	}

	// A failing tool that echoes its input, as a verbose one might.
	writeScript(t, filepath.Join(dir, "iptables-legacy-restore"), "cat >&2; echo 'Error occurred at line: 3' >&2; exit 2\n")
	writeSaveScript(t, dir, "iptables-legacy")
	c, err = NewChain(f, f, "", testParams, NewExecRestorer(filepath.Join(dir, "iptables-legacy")))
	if err != nil {
		t.Fatalf("NewChain: %v", err)
	}
	// vipB joins both sets, then the restore fails: changed counts the
	// two set elements written before it.
	changed, err := c.Sync(targetsOf(vipA, vipB))
	if err == nil || changed != 2 {
		t.Fatalf("Sync with a failing iptables-restore = %d, %v; want 2 and an error", changed, err)
	}
	for _, want := range []string{"iptables-legacy-restore", "exit status 2", "Error occurred at line: 3", "--match-set KST-HMARK-0 dst", "<seed " + SeedFingerprint(testParams.Seed) + ">"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Sync err = %q, want %q in it", err, want)
		}
	}
	if strings.Contains(err.Error(), "c0ffee") {
		t.Errorf("Sync err = %q shows the seed", err)
	}

	if err := NewExecRestorer(filepath.Join(dir, "iptables")).Restore("filter", []byte("*mangle\nCOMMIT\n")); err == nil {
		t.Errorf("Restore of a mangle payload as table filter: want an error")
	}

	// A failing iptables-save stops Sync before any write, with its
	// output; a Command that is no iptables-restore has no save.
	writeScript(t, filepath.Join(dir, "iptables-nft-save"), "echo 'Table does not exist' >&2; exit 1\n")
	f.writes = nil
	c, err = NewChain(f, f, "", testParams, NewExecRestorer(filepath.Join(dir, "iptables-nft")))
	if err != nil {
		t.Fatalf("NewChain: %v", err)
	}
	_, err = c.Sync(targetsOf(vipA))
	if err == nil || !strings.Contains(err.Error(), "iptables-nft-save -t mangle: exit status 1: Table does not exist") || len(f.writes) != 0 {
		t.Errorf("Sync with a failing iptables-save = %v with writes %q; want its error, and no write", err, f.writes)
	}
	if _, err := (&ExecRestorer{Command: "restore-all"}).Save(Table); err == nil {
		t.Errorf("Save of ExecRestorer %q: want an error", "restore-all")
	}
}

func TestNewExecRestorer(t *testing.T) {
	for in, want := range map[string]string{
		"":                        "iptables-restore",
		"iptables":                "iptables-restore",
		"iptables-legacy":         "iptables-legacy-restore",
		"/usr/sbin/iptables-nft":  "/usr/sbin/iptables-nft-restore",
		"ip6tables":               "ip6tables-restore",
		"ip6tables-legacy":        "ip6tables-legacy-restore",
		"/usr/sbin/ip6tables-nft": "/usr/sbin/ip6tables-nft-restore",
	} {
		if got := NewExecRestorer(in).Command; got != want {
			t.Errorf("NewExecRestorer(%q).Command = %q, want %q", in, got, want)
		}
	}
}
