package main

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

var (
	fence      = regexp.MustCompile("^\\s*(```|~~~)")
	codeSpan   = regexp.MustCompile("(`+)[^`]*?(`+)")
	inlineLink = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)`)
	refLink    = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)`)
	heading    = regexp.MustCompile(`^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
	htmlAnchor = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	scheme     = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

type link struct {
	line   int
	target string
}

// scan returns a document's links and its anchors (GitHub's heading ids and
// explicit <a name/id>), leaving out fenced code blocks and code spans.
func scan(text string) (links []link, anchors map[string]bool) {
	anchors = map[string]bool{}
	count := map[string]int{}
	inFence := ""
	for i, l := range strings.Split(text, "\n") {
		if m := fence.FindStringSubmatch(l); m != nil {
			switch {
			case inFence == "":
				inFence = m[1]
			case inFence == m[1]:
				inFence = ""
			}
			continue
		}
		if inFence != "" {
			continue
		}
		if m := heading.FindStringSubmatch(l); m != nil {
			s := Slug(m[2])
			if n := count[s]; n > 0 {
				anchors[fmt.Sprintf("%s-%d", s, n)] = true
			} else {
				anchors[s] = true
			}
			count[s]++
		}
		for _, m := range htmlAnchor.FindAllStringSubmatch(l, -1) {
			anchors[m[1]] = true
		}
		plain := codeSpan.ReplaceAllString(l, "``")
		for _, m := range inlineLink.FindAllStringSubmatch(plain, -1) {
			links = append(links, link{i + 1, m[2]})
		}
		if m := refLink.FindStringSubmatch(plain); m != nil {
			links = append(links, link{i + 1, m[1]})
		}
	}
	return links, anchors
}

// Slug is GitHub's id for a heading: its text as rendered (link targets,
// code-span backquotes and emphasis markers gone), lower-cased, every
// character but letters, digits, "_", "-" and spaces dropped, spaces as "-".
// Repeated headings get "-1", "-2", ... (in scan).
func Slug(h string) string {
	h = inlineLink.ReplaceAllString(h, "$1")
	h = regexp.MustCompile(`<[^>]+>`).ReplaceAllString(h, "")
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestMarkdownLinks: every relative link in README.md and docs/*.md points
// to a file or folder that exists, and, with a #fragment into a Markdown
// file, to one of its headings.
func TestMarkdownLinks(t *testing.T) {
	r := root(t)
	anchorsOf := map[string]map[string]bool{}
	read := func(file string) (string, error) {
		b, err := os.ReadFile(filepath.Join(r, filepath.FromSlash(file)))
		return string(b), err
	}
	anchors := func(file string) map[string]bool {
		if a, ok := anchorsOf[file]; ok {
			return a
		}
		text, err := read(file)
		if err != nil {
			t.Fatal(err)
		}
		_, a := scan(text)
		anchorsOf[file] = a
		return a
	}
	checked := 0
	for _, file := range markdownFiles(t) {
		text, err := read(file)
		if err != nil {
			t.Fatal(err)
		}
		links, _ := scan(text)
		for _, l := range links {
			if l.target == "" || scheme.MatchString(l.target) || strings.HasPrefix(l.target, "//") {
				continue
			}
			checked++
			target, frag, _ := strings.Cut(l.target, "#")
			dest := file
			if target != "" {
				if strings.HasPrefix(target, "/") {
					dest = path.Clean(strings.TrimPrefix(target, "/"))
				} else {
					dest = path.Join(path.Dir(file), target)
				}
				if strings.HasPrefix(dest, "../") || dest == ".." {
					t.Errorf("%s:%d: link %q leaves the repository", file, l.line, l.target)
					continue
				}
				if _, err := os.Stat(filepath.Join(r, filepath.FromSlash(dest))); err != nil {
					t.Errorf("%s:%d: link %q: %s does not exist", file, l.line, l.target, dest)
					continue
				}
			}
			if frag != "" && strings.HasSuffix(dest, ".md") && !anchors(dest)[frag] {
				t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s", file, l.line, l.target, dest, frag)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no relative link found: the scanner is broken")
	}
}

// TestReadmeLinksEveryDoc: the README's table of contents reaches every docs/ file.
func TestReadmeLinksEveryDoc(t *testing.T) {
	text, err := os.ReadFile(filepath.Join(root(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	links, _ := scan(string(text))
	linked := map[string]bool{}
	for _, l := range links {
		target, _, _ := strings.Cut(l.target, "#")
		linked[path.Clean(target)] = true
	}
	for _, file := range markdownFiles(t)[1:] {
		if !linked[file] {
			t.Errorf("README.md does not link %s", file)
		}
	}
}

func TestSlugAndScan(t *testing.T) {
	for h, want := range map[string]string{
		"How it works":                       "how-it-works",
		"Services of type LoadBalancer":      "services-of-type-loadbalancer",
		"`status.loadBalancer.ingress`":      "statusloadbalanceringress",
		"What the router owns, and restarts": "what-the-router-owns-and-restarts",
		"Draining and routing generations":   "draining-and-routing-generations",
		"The [lab](x.md) (VM) & tests":       "the-lab-vm--tests",
		"tunnel-router":                      "tunnel-router",
		"Flags: what `-h` does not say":      "flags-what--h-does-not-say",
	} {
		if got := Slug(h); got != want {
			t.Errorf("Slug(%q) = %q, want %q", h, got, want)
		}
	}
	links, anchors := scan("# A\n## A\n```\n[x](nowhere.md)\n# B\n```\nsee [b](b.md#a-1) and `[c](c.md)`, ![i](img.png \"t\")\n[ref]: ref.md\n")
	var targets []string
	for _, l := range links {
		targets = append(targets, l.target)
	}
	if strings.Join(targets, " ") != "b.md#a-1 img.png ref.md" {
		t.Errorf("links %v", targets)
	}
	if !anchors["a"] || !anchors["a-1"] || anchors["b"] {
		t.Errorf("anchors %v", anchors)
	}
}
