package lab

import (
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
)

// File type bits of a cpio mode (the same as stat(2)'s).
const (
	modeDir     = 0o040000
	modeRegular = 0o100000
	modeSymlink = 0o120000
	modeCharDev = 0o020000
)

// usrMerged maps the top-level folders that are symlinks into /usr in the VM
// (as on Debian hosts) to their targets, so that /sbin/ip and /usr/sbin/ip are
// one file.
var usrMerged = map[string]string{"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}

// fsEntry is one file of the VM's root filesystem.
type fsEntry struct {
	mode     uint32 // type and permission bits
	hostPath string // regular file: copy this host file...
	data     []byte // ...or write these bytes
	target   string // symlink target
	rdevMaj  uint32 // character device numbers
	rdevMin  uint32
}

// fsTree is the VM's root filesystem, keyed by canonical path (no leading
// slash, usr-merged). Adding a path twice replaces the first entry, so later
// additions (the caller's files) win over earlier ones (busybox applets).
type fsTree map[string]fsEntry

// canonical turns a VM path into the tree's key: relative, cleaned, with
// /bin, /sbin, /lib and /lib64 resolved into /usr.
func canonical(p string) string {
	p = strings.TrimPrefix(path.Clean("/"+p), "/")
	first, rest, _ := strings.Cut(p, "/")
	if to, ok := usrMerged[first]; ok {
		if rest == "" {
			return to
		}
		return to + "/" + rest
	}
	return p
}

// addDir adds a folder (and its parents).
func (t fsTree) addDir(p string) {
	p = canonical(p)
	for p != "." && p != "" {
		if _, ok := t[p]; !ok {
			t[p] = fsEntry{mode: modeDir | 0o755}
		}
		p = path.Dir(p)
	}
}

// add adds an entry and the folders above it.
func (t fsTree) add(p string, e fsEntry) {
	p = canonical(p)
	t.addDir(path.Dir(p))
	t[p] = e
}

// addHostFile adds a copy of a host file, keeping its permission bits.
func (t fsTree) addHostFile(vmPath, hostPath string) error {
	fi, err := os.Stat(hostPath)
	if err != nil {
		return fmt.Errorf("adding %s as %s: %w", hostPath, vmPath, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("adding %s as %s: not a regular file", hostPath, vmPath)
	}
	t.add(vmPath, fsEntry{mode: modeRegular | uint32(fi.Mode().Perm()), hostPath: hostPath})
	return nil
}

// addData adds a regular file with the given content and permission bits.
func (t fsTree) addData(vmPath string, perm uint32, data []byte) {
	t.add(vmPath, fsEntry{mode: modeRegular | perm, data: data})
}

// addSymlink adds a symbolic link to target.
func (t fsTree) addSymlink(vmPath, target string) {
	t.add(vmPath, fsEntry{mode: modeSymlink | 0o777, target: target})
}

// writeCPIO writes the tree as a cpio archive in the "newc" format the
// kernel unpacks as its initramfs, parents before children.
func (t fsTree) writeCPIO(w io.Writer) error {
	for top, to := range usrMerged {
		t.addDir(to)
		t[top] = fsEntry{mode: modeSymlink | 0o777, target: to}
	}
	paths := make([]string, 0, len(t))
	for p := range t {
		paths = append(paths, p)
	}
	sort.Strings(paths) // a folder sorts before everything inside it
	cw := &cpioWriter{w: w}
	for _, p := range paths {
		if err := cw.writeEntry(p, t[p]); err != nil {
			return fmt.Errorf("writing %s to the cpio archive: %w", p, err)
		}
	}
	return cw.writeTrailer()
}

// cpioWriter writes "newc" records (see the kernel's
// Documentation/driver-api/early-userspace/buffer-format.rst).
type cpioWriter struct {
	w   io.Writer
	ino uint32
	off int64
}

func (cw *cpioWriter) write(b []byte) error {
	n, err := cw.w.Write(b)
	cw.off += int64(n)
	return err
}

// pad writes zeros up to the next multiple of four bytes.
func (cw *cpioWriter) pad() error {
	if rem := cw.off % 4; rem != 0 {
		return cw.write(make([]byte, 4-rem))
	}
	return nil
}

func (cw *cpioWriter) header(name string, mode uint32, size int64, rdevMaj, rdevMin uint32) error {
	cw.ino++
	nlink := uint32(1)
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		cw.ino, mode, 0, 0, nlink, 0, size, 0, 0, rdevMaj, rdevMin, len(name)+1, 0)
	if err := cw.write([]byte(hdr + name + "\x00")); err != nil {
		return err
	}
	return cw.pad()
}

func (cw *cpioWriter) writeEntry(name string, e fsEntry) error {
	switch e.mode & 0o170000 {
	case modeSymlink:
		if err := cw.header(name, e.mode, int64(len(e.target)), 0, 0); err != nil {
			return err
		}
		if err := cw.write([]byte(e.target)); err != nil {
			return err
		}
	case modeRegular:
		if e.hostPath == "" {
			if err := cw.header(name, e.mode, int64(len(e.data)), 0, 0); err != nil {
				return err
			}
			if err := cw.write(e.data); err != nil {
				return err
			}
			break
		}
		f, err := os.Open(e.hostPath)
		if err != nil {
			return err
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if err := cw.header(name, e.mode, fi.Size(), 0, 0); err != nil {
			return err
		}
		n, err := io.Copy(cw.w, f)
		cw.off += n
		if err != nil {
			return err
		}
		if n != fi.Size() {
			return fmt.Errorf("%s changed size while being copied", e.hostPath)
		}
	default: // folders and devices have no data
		if err := cw.header(name, e.mode, 0, e.rdevMaj, e.rdevMin); err != nil {
			return err
		}
	}
	return cw.pad()
}

func (cw *cpioWriter) writeTrailer() error {
	return cw.header("TRAILER!!!", 0, 0, 0, 0)
}
