// Command docsgen writes docs/flags.md, the flags reference of both daemons,
// from their own -h output:
//
//	go run ./test/docsgen     (or: make docs)
//
// It builds cmd/tunnel-router and cmd/tunnel-endpoint into a temporary
// folder, runs each with -h and an empty environment (so no KST_* variable
// of the caller changes a default), parses the flag package's usage text and
// renders one Markdown table per daemon. It never imports the daemons' Go
// packages, only their commands' paths. docsgen_test.go fails when
// docs/flags.md differs from what this would write.
package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// EnvPrefix is the prefix of every flag's environment variable
// (internal/flagenv: KST_ + the flag name upper-cased, "-" as "_").
const EnvPrefix = "KST_"

// FlagsDoc is the generated file, relative to the module root.
const FlagsDoc = "docs/flags.md"

// Daemon is one command whose flags are documented.
type Daemon struct {
	Name    string // binary name, as in "Usage of NAME:"
	Pkg     string // package path relative to the module root
	Summary string // one line under its heading
}

// Daemons are documented in this order.
var Daemons = []Daemon{
	{Name: "tunnel-router", Pkg: "./cmd/tunnel-router", Summary: "The tunnel router, on every node labelled `node=tunnel`."},
	{Name: "tunnel-endpoint", Pkg: "./cmd/tunnel-endpoint", Summary: "The endpoint agent, on every node."},
}

// Flag is one flag as the flag package prints it.
type Flag struct {
	Name        string
	Type        string // the type word after the name ("string", "int", "duration", "value"); "" for a bool
	Usage       string // the description, without the "(default ...)" suffix
	Default     string // the printed default, unquoted; "" when none is printed
	HasDefault  bool
	Environment string
}

func main() {
	root, err := ModuleRoot()
	if err != nil {
		fail(err)
	}
	usages, err := Usages(root)
	if err != nil {
		fail(err)
	}
	out, err := Render(usages)
	if err != nil {
		fail(err)
	}
	path := filepath.Join(root, FlagsDoc)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		fail(err)
	}
	if err := os.WriteFile(path, out, 0o644); err != nil {
		fail(err)
	}
	fmt.Println("wrote", FlagsDoc)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "docsgen:", err)
	os.Exit(1)
}

// ModuleRoot finds the folder holding go.mod, from the working directory up.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod in the working directory or above it")
		}
		dir = parent
	}
}

// goTool returns the go command: the one on PATH, else the toolchain's own.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// Usages builds every daemon once into a temporary folder and returns each
// one's -h output, keyed by name.
func Usages(root string) (map[string]string, error) {
	tmp, err := os.MkdirTemp("", "kst-docsgen-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)

	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	args := []string{"build", "-o", tmp + string(filepath.Separator)}
	for _, d := range Daemons {
		args = append(args, d.Pkg)
	}
	build := exec.CommandContext(ctx, goTool(), args...)
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}

	usages := map[string]string{}
	for _, d := range Daemons {
		u, err := runHelp(filepath.Join(tmp, d.Name))
		if err != nil {
			return nil, err
		}
		usages[d.Name] = u
	}
	return usages, nil
}

// runHelp runs bin -h with an empty environment and returns what it printed.
// The daemons return nil for -h (exit 0); exit status 2, what a flag set with
// flag.ExitOnError used to give, is accepted as well.
func runHelp(bin string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-h")
	cmd.Env = []string{}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 2) {
		return "", fmt.Errorf("%s -h: %v\n%s%s", filepath.Base(bin), err, stdout.String(), stderr.String())
	}
	// The flag package prints the usage on stderr; take stdout too, in case.
	return stderr.String() + stdout.String(), nil
}

var (
	flagLine    = regexp.MustCompile(`^  -([^\s=]+)(?: (\S+))?$`)
	shortLine   = regexp.MustCompile(`^  -([^\s=])\t(.*)$`)
	defaultTail = regexp.MustCompile(`(?s)^(.*) \(default (.*)\)$`)
)

// ParseUsage parses the output of the flag package's PrintDefaults, preceded
// by its "Usage of NAME:" line: for each flag, "  -name type" then one or
// more description lines "    \t...", the last one possibly ending in
// " (default X)" (X quoted for string flags). A one-letter flag without a
// type has its description on the same line, after a tab. Any other line is
// an error, so that a change of format cannot go unnoticed.
func ParseUsage(name, out string) ([]Flag, error) {
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	header := "Usage of " + name + ":"
	start := -1
	for i, l := range lines {
		if l == header {
			start = i + 1
			break
		}
	}
	if start < 0 {
		return nil, fmt.Errorf("%s -h printed no %q line:\n%s", name, header, out)
	}
	var flags []Flag
	var desc []string
	finish := func() {
		if len(flags) == 0 {
			return
		}
		f := &flags[len(flags)-1]
		text := strings.Join(desc, "\n")
		if m := defaultTail.FindStringSubmatch(text); m != nil {
			text, f.Default, f.HasDefault = m[1], m[2], true
			if s, err := strconv.Unquote(f.Default); err == nil {
				f.Default = s
			}
		}
		f.Usage = text
		desc = nil
	}
	for _, l := range lines[start:] {
		switch {
		case strings.HasPrefix(l, "    \t"):
			if len(flags) == 0 {
				return nil, fmt.Errorf("%s -h: description before any flag: %q", name, l)
			}
			desc = append(desc, strings.TrimPrefix(l, "    \t"))
		case shortLine.MatchString(l):
			finish()
			m := shortLine.FindStringSubmatch(l)
			flags = append(flags, Flag{Name: m[1]})
			desc = []string{m[2]}
		case flagLine.MatchString(l):
			finish()
			m := flagLine.FindStringSubmatch(l)
			flags = append(flags, Flag{Name: m[1], Type: m[2]})
		default:
			return nil, fmt.Errorf("%s -h: unexpected line %q", name, l)
		}
	}
	finish()
	if len(flags) == 0 {
		return nil, fmt.Errorf("%s -h listed no flag:\n%s", name, out)
	}
	for i := range flags {
		flags[i].Environment = EnvName(flags[i].Name)
	}
	return flags, nil
}

// EnvName is the environment variable a flag falls back to (internal/flagenv).
func EnvName(flag string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// defaultCell is what the table shows as a flag's default. The flag package
// prints no default for a zero value; the zero value of the plain types is
// shown, other types (flag.Value) show nothing.
func defaultCell(f Flag) string {
	if f.HasDefault {
		if f.Default == "" {
			return `""`
		}
		return code(f.Default)
	}
	switch f.Type {
	case "":
		return "`false`"
	case "int", "uint", "int64", "uint64", "float":
		return "`0`"
	case "duration":
		return "`0s`"
	}
	return ""
}

// code wraps s in a Markdown code span, with a longer fence if s holds backquotes.
func code(s string) string {
	fence := "`"
	for strings.Contains(s, fence) {
		fence += "`"
	}
	if strings.HasPrefix(s, "`") || strings.HasSuffix(s, "`") {
		s = " " + s + " "
	}
	return fence + cell(s) + fence
}

// cell escapes text for a Markdown table cell.
func cell(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	s = strings.ReplaceAll(s, "|", `\|`)
	return strings.ReplaceAll(s, "<", "&lt;")
}

// Render writes docs/flags.md from each daemon's -h output.
func Render(usages map[string]string) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString("# Flags\n\n")
	b.WriteString("Every flag of both daemons, its default, its environment variable and its description, from their own `-h`. Back to the [README](../README.md).\n\n")
	b.WriteString("> Generated from the daemons' `-h` output by `go run ./test/docsgen` (or `make docs`); do not edit by hand. `go test ./test/docsgen` fails when it is stale.\n\n")
	b.WriteString("Every flag falls back to an environment variable: `" + EnvPrefix + "` and the flag name in upper case with `-` as `_` (`--seed` is `KST_SEED`); the command line wins. `tunnel-router.yaml` sets them from the `tunnel-config` ConfigMap, which both daemons read. What `-h` does not say (limits, values that must match, why the defaults) is in [operating.md](operating.md#flags).\n")
	for _, d := range Daemons {
		out, ok := usages[d.Name]
		if !ok {
			return nil, fmt.Errorf("no -h output for %s", d.Name)
		}
		flags, err := ParseUsage(d.Name, out)
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(&b, "\n## %s\n\n%s Source: `%s`.\n\n", d.Name, d.Summary, d.Pkg)
		b.WriteString("| Flag | Default | Environment | Description |\n|---|---|---|---|\n")
		for _, f := range flags {
			fmt.Fprintf(&b, "| `--%s` | %s | `%s` | %s |\n", f.Name, defaultCell(f), f.Environment, cell(f.Usage))
		}
	}
	return b.Bytes(), nil
}
