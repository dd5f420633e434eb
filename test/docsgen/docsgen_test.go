package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// generated builds the daemons once per test binary.
var generated = sync.OnceValues(func() (map[string]string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return nil, err
	}
	return Usages(root)
})

func usages(t *testing.T) map[string]string {
	t.Helper()
	u, err := generated()
	if err != nil {
		t.Fatalf("running the daemons with -h: %v", err)
	}
	return u
}

func root(t *testing.T) string {
	t.Helper()
	r, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// daemonFlags returns each daemon's flag names, from its -h.
func daemonFlags(t *testing.T) map[string][]string {
	t.Helper()
	all := map[string][]string{}
	for name, out := range usages(t) {
		flags, err := ParseUsage(name, out)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range flags {
			all[name] = append(all[name], f.Name)
		}
	}
	return all
}

func TestFlagsDocIsUpToDate(t *testing.T) {
	want, err := Render(usages(t))
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(root(t), FlagsDoc))
	if err != nil {
		t.Fatalf("docs/flags.md is stale: run go run ./test/docsgen (%v)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("docs/flags.md is stale: run go run ./test/docsgen (or make docs)\n%s", firstDifference(string(got), string(want)))
	}
}

// firstDifference names the first line where the file and the generated text differ.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < max(len(g), len(w)); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("first difference at line %d:\n  docs/flags.md: %q\n  generated:     %q", i+1, gl, wl)
		}
	}
	return "(the files differ only in line endings)"
}

var (
	docSection = regexp.MustCompile("^## (\\S+)")
	docFlagRow = regexp.MustCompile("^\\| `--([^`]+)`")
)

// TestFlagsDocListsOnlyRealFlags fails for a flag in docs/flags.md that its
// daemon does not have (a hand edit, or a flag removed), and for a daemon
// section that is missing.
func TestFlagsDocListsOnlyRealFlags(t *testing.T) {
	have := daemonFlags(t)
	text, err := os.ReadFile(filepath.Join(root(t), FlagsDoc))
	if err != nil {
		t.Fatal(err)
	}
	section := ""
	seen := map[string]bool{}
	for i, l := range strings.Split(string(text), "\n") {
		if m := docSection.FindStringSubmatch(l); m != nil {
			section = m[1]
			seen[section] = true
			continue
		}
		m := docFlagRow.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		flags, ok := have[section]
		if !ok {
			t.Errorf("docs/flags.md:%d: flag --%s under %q, which is no daemon", i+1, m[1], section)
			continue
		}
		if !slices.Contains(flags, m[1]) {
			t.Errorf("docs/flags.md:%d: --%s is listed for %s, which has no such flag (%s -h): run go run ./test/docsgen", i+1, m[1], section, section)
		}
	}
	for _, d := range Daemons {
		if !seen[d.Name] {
			t.Errorf("docs/flags.md has no section for %s: run go run ./test/docsgen", d.Name)
		}
	}
}

// TestDocsFlagRowsNameRealFlags: a table row of the hand-written docs that
// starts with a flag (`--name`) names a flag one of the daemons has.
func TestDocsFlagRowsNameRealFlags(t *testing.T) {
	known := map[string]bool{}
	for _, flags := range daemonFlags(t) {
		for _, f := range flags {
			known[f] = true
		}
	}
	for _, file := range markdownFiles(t) {
		if file == FlagsDoc {
			continue
		}
		text, err := os.ReadFile(filepath.Join(root(t), file))
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(text), "\n") {
			if m := docFlagRow.FindStringSubmatch(l); m != nil && !known[m[1]] {
				t.Errorf("%s:%d: a row for --%s, which neither daemon has", file, i+1, m[1])
			}
		}
	}
}

// TestParseUsage checks the parser against what this Go release's flag
// package prints, for every kind of flag.
func TestParseUsage(t *testing.T) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	var buf bytes.Buffer
	fs.SetOutput(&buf)
	fs.String("name", "kst-gre", "a string with a default")
	fs.String("empty", "", "a string without one")
	fs.Int("count", 64, "an int")
	fs.Int("zero", 0, "an int at zero")
	fs.Bool("on", true, "a bool, true")
	fs.Bool("off", false, "a bool, false")
	fs.Duration("period", 5*time.Minute, "a duration")
	fs.Func("mode", `a func flag: "a" or "b" (default "a")`, func(string) error { return nil })
	fs.String("multi", "x", "two lines:\nthe second (and parentheses)")
	fs.String("path", "", "a `file` named in backquotes")
	fs.Bool("v", false, "a one-letter bool")
	fs.Uint("pipe", 1, "a | in the text")
	fs.PrintDefaults()
	out := "Usage of demo:\n" + buf.String()

	flags, err := ParseUsage("demo", out)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Flag{}
	var names []string
	for _, f := range flags {
		got[f.Name] = f
		names = append(names, f.Name)
	}
	if !sort.StringsAreSorted(names) || len(names) != 12 {
		t.Fatalf("flags %v: want the 12 flags, sorted", names)
	}
	for _, c := range []struct {
		name, typ, usage, def, cell string
	}{
		{"name", "string", "a string with a default", "kst-gre", "`kst-gre`"},
		{"empty", "string", "a string without one", "", ""},
		{"count", "int", "an int", "64", "`64`"},
		{"zero", "int", "an int at zero", "", "`0`"},
		{"on", "", "a bool, true", "true", "`true`"},
		{"off", "", "a bool, false", "", "`false`"},
		{"period", "duration", "a duration", "5m0s", "`5m0s`"},
		{"mode", "value", `a func flag: "a" or "b"`, "a", "`a`"},
		{"multi", "string", "two lines:\nthe second (and parentheses)", "x", "`x`"},
		{"path", "file", "a file named in backquotes", "", ""},
		{"v", "", "a one-letter bool", "", "`false`"},
		{"pipe", "uint", "a | in the text", "1", "`1`"},
	} {
		f := got[c.name]
		if f.Type != c.typ || f.Usage != c.usage || f.Default != c.def || defaultCell(f) != c.cell {
			t.Errorf("--%s: parsed type %q usage %q default %q cell %q; want %q %q %q %q",
				c.name, f.Type, f.Usage, f.Default, defaultCell(f), c.typ, c.usage, c.def, c.cell)
		}
	}
	if got["pipe"].Environment != "KST_PIPE" || EnvName("generation-check-period") != "KST_GENERATION_CHECK_PERIOD" {
		t.Errorf("environment names: %q, %q", got["pipe"].Environment, EnvName("generation-check-period"))
	}
	if c := cell(got["pipe"].Usage); c != `a \| in the text` {
		t.Errorf("cell escaping: %q", c)
	}
	if _, err := ParseUsage("demo", out+"something else\n"); err == nil {
		t.Error("an unexpected line was accepted")
	}
	if _, err := ParseUsage("other", out); err == nil {
		t.Error("output of another command was accepted")
	}
}

// TestDaemonsHaveFlags guards against an empty or truncated -h.
func TestDaemonsHaveFlags(t *testing.T) {
	flags := daemonFlags(t)
	for _, d := range Daemons {
		for _, want := range []string{"mode", "pools", "metrics-address", "cleanup"} {
			if !slices.Contains(flags[d.Name], want) {
				t.Errorf("%s -h has no --%s: %v", d.Name, want, flags[d.Name])
			}
		}
	}
}

// markdownFiles are the checked documents, relative to the module root:
// README.md and docs/*.md.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md"}
	docs, err := filepath.Glob(filepath.Join(root(t), "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		files = append(files, "docs/"+filepath.Base(d))
	}
	sort.Strings(files[1:])
	return files
}
