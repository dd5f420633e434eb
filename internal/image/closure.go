// Package image builds the daemons' container images offline: a static Go
// binary plus exactly the files of Debian packages that it executes at run
// time (each program with the shared libraries it links, found by reading
// its ELF headers), assembled with go-containerregistry into an archive that
// docker load, ctr images import and skopeo copy all accept.
package image

import (
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// libraryDirs are where the dynamic loader looks for a library named by
// DT_NEEDED, in this order (Debian's multiarch directories first).
var libraryDirs = []string{
	"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
	"/lib64", "/usr/lib64", "/lib", "/usr/lib",
}

// Entry is one file of a layer: a regular file copied from Source, a
// symbolic link to Target, or a directory.
type Entry struct {
	Path   string // absolute, in the image
	Source string // regular files: the file to copy
	Target string // symbolic links: the link's target, as written
	Mode   fs.FileMode
}

// Tree is a set of files to put in a layer, keyed by their path in the
// image.
type Tree map[string]Entry

// Closure is the files of root (an extracted set of Debian packages) that
// the given paths need: each path itself, the targets of symbolic links
// (followed inside root), every file under a directory, and for each ELF
// file its program interpreter and its DT_NEEDED libraries, transitively.
// A library that is nowhere in root is an error naming who needs it.
func Closure(root string, paths ...string) (Tree, error) {
	c := closure{root: root, tree: Tree{}}
	for _, p := range paths {
		if err := c.add(p, "requested"); err != nil {
			return nil, err
		}
	}
	return c.tree, nil
}

type closure struct {
	root string
	tree Tree
}

func (c *closure) add(p, neededBy string) error {
	p = path.Clean("/" + p)
	if _, done := c.tree[p]; done {
		return nil
	}
	full := filepath.Join(c.root, p)
	info, err := os.Lstat(full)
	if err != nil {
		return fmt.Errorf("%s (needed by %s): %w", p, neededBy, err)
	}
	switch {
	case info.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(full)
		if err != nil {
			return err
		}
		c.tree[p] = Entry{Path: p, Target: target, Mode: fs.ModeSymlink | 0o777}
		resolved := target
		if !path.IsAbs(target) {
			resolved = path.Join(path.Dir(p), target)
		}
		return c.add(resolved, p)
	case info.IsDir():
		c.tree[p] = Entry{Path: p, Mode: fs.ModeDir | 0o755}
		names, err := os.ReadDir(full)
		if err != nil {
			return err
		}
		for _, n := range names {
			if err := c.add(path.Join(p, n.Name()), p); err != nil {
				return err
			}
		}
		return nil
	case info.Mode().IsRegular():
		c.tree[p] = Entry{Path: p, Source: full, Mode: info.Mode().Perm()}
		return c.addELFDependencies(p, full)
	default:
		return fmt.Errorf("%s: neither a file, a directory nor a symbolic link (%v)", p, info.Mode())
	}
}

// addELFDependencies adds the interpreter and the libraries an ELF file
// needs; a file that is not ELF needs nothing.
func (c *closure) addELFDependencies(p, full string) error {
	if isELF, err := hasELFMagic(full); err != nil || !isELF {
		return err // nil for a script or data
	}
	f, err := elf.Open(full)
	if err != nil {
		return fmt.Errorf("reading %s: %w", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		interp := make([]byte, prog.Filesz)
		if _, err := prog.ReadAt(interp, 0); err != nil {
			return fmt.Errorf("reading %s's interpreter: %w", p, err)
		}
		if err := c.add(strings.TrimRight(string(interp), "\x00"), p); err != nil {
			return err
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return fmt.Errorf("reading %s's libraries: %w", p, err)
	}
	sort.Strings(libs)
	for _, lib := range libs {
		found := ""
		for _, dir := range libraryDirs {
			if _, err := os.Lstat(filepath.Join(c.root, dir, lib)); err == nil {
				found = path.Join(dir, lib)
				break
			}
		}
		if found == "" {
			return fmt.Errorf("%s needs %s, which no package provides: add its Debian package to the image's list", p, lib)
		}
		if err := c.add(found, p); err != nil {
			return err
		}
	}
	return nil
}

func hasELFMagic(file string) (bool, error) {
	f, err := os.Open(file)
	if err != nil {
		return false, err
	}
	defer f.Close()
	magic := make([]byte, len(elf.ELFMAG))
	if _, err := io.ReadFull(f, magic); err != nil {
		return false, nil // shorter than the magic: not ELF
	}
	return string(magic) == elf.ELFMAG, nil
}
