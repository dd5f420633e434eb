package image

import (
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// Package is one Debian package of an image.
type Package struct {
	Name, Version string
	Deb           string // the .deb file
}

// FetchPackages returns the named Debian packages as .deb files in cache,
// downloading with `apt-get download` only those not there yet (after one
// `apt-get update` if apt cannot find one). A cached .deb is used as it is,
// so images built from one cache are identical; empty the cache to take
// Debian's newer versions.
func FetchPackages(cache string, names []string) ([]Package, error) {
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, err
	}
	var missing []string
	for _, n := range names {
		if debs, _ := filepath.Glob(filepath.Join(cache, n+"_*.deb")); len(debs) == 0 {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		if err := aptDownload(cache, missing); err != nil {
			if out, uerr := exec.Command("apt-get", "update", "-qq").CombinedOutput(); uerr != nil {
				return nil, fmt.Errorf("apt-get update: %w: %s", uerr, strings.TrimSpace(string(out)))
			}
			if err := aptDownload(cache, missing); err != nil {
				return nil, err
			}
		}
	}
	pkgs := make([]Package, 0, len(names))
	for _, n := range names {
		debs, _ := filepath.Glob(filepath.Join(cache, n+"_*.deb"))
		if len(debs) != 1 {
			return nil, fmt.Errorf("package %s: want one .deb in %s, found %d (%v): remove the stale ones", n, cache, len(debs), debs)
		}
		// name_version_arch.deb, the version URL-escaped (an epoch's ':' is %3a).
		fields := strings.Split(strings.TrimSuffix(filepath.Base(debs[0]), ".deb"), "_")
		if len(fields) != 3 {
			return nil, fmt.Errorf("package %s: unexpected file name %s", n, debs[0])
		}
		version, err := url.PathUnescape(fields[1])
		if err != nil {
			return nil, fmt.Errorf("package %s: version in %s: %w", n, debs[0], err)
		}
		pkgs = append(pkgs, Package{Name: n, Version: version, Deb: debs[0]})
	}
	return pkgs, nil
}

func aptDownload(dir string, names []string) error {
	cmd := exec.Command("apt-get", append([]string{"download", "-qq"}, names...)...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get download %s: %w: %s", strings.Join(names, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Extract unpacks pkgs into root with dpkg-deb (files only; no maintainer
// scripts run).
func Extract(root string, pkgs []Package) error {
	for _, p := range pkgs {
		if out, err := exec.Command("dpkg-deb", "-x", p.Deb, root).CombinedOutput(); err != nil {
			return fmt.Errorf("dpkg-deb -x %s: %w: %s", p.Deb, err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}

// PackageList is pkgs as "name=version" lines, sorted: an image label.
func PackageList(pkgs []Package) string {
	lines := make([]string, 0, len(pkgs))
	for _, p := range pkgs {
		lines = append(lines, p.Name+"="+p.Version)
	}
	sort.Strings(lines)
	return strings.Join(lines, " ")
}
