package image

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// DefaultCache is where the Debian packages are cached: beside the other
// test assets, in $KST_ASSETS_DIR or ~/.cache/kube-service-tunnel/assets.
func DefaultCache() string {
	dir := os.Getenv("KST_ASSETS_DIR")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = os.TempDir()
		}
		dir = filepath.Join(home, ".cache", "kube-service-tunnel", "assets")
	}
	return filepath.Join(dir, "debian-packages")
}

// Options are what BuildAll builds from and where it writes.
type Options struct {
	// BinDir holds the static binaries, built for Version.
	BinDir string
	// OutDir receives NAME.tar for each daemon.
	OutDir string
	// Cache holds the Debian packages (FetchPackages).
	Cache string
	// Registry and Version make the references (Ref).
	Registry, Version string
	// Created is the images' time (the commit's, for reproducible builds).
	Created time.Time
}

// Result is one built image.
type Result struct {
	Daemon  Daemon
	Ref     string
	Archive string
	Digest  string
	// Size is the compressed size (Size).
	Size         int64
	RuntimeFiles int
}

// BuildAll builds both daemons' images into o.OutDir.
func BuildAll(o Options) ([]Result, error) {
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, err
	}
	root, err := os.MkdirTemp(o.OutDir, ".rootfs-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(root)
	var results []Result
	for _, d := range []Daemon{Router, Endpoint} {
		binary := filepath.Join(o.BinDir, d.Name)
		if err := checkVersion(binary, d.Name, o.Version); err != nil {
			return nil, err
		}
		pkgs, err := FetchPackages(o.Cache, d.Packages)
		if err != nil {
			return nil, err
		}
		if err := Extract(root, pkgs); err != nil {
			return nil, err
		}
		files, err := Closure(root, append(d.Paths, d.CopyrightPaths()...)...)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.Name, err)
		}
		ref := Ref(o.Registry, d.Name, o.Version)
		img, err := Build(Spec{
			Ref: ref, Binary: binary, Runtime: files, Created: o.Created,
			Labels: map[string]string{
				"org.opencontainers.image.version":           o.Version,
				"org.opencontainers.image.title":             d.Name,
				"nu.cmd.kube-service-tunnel.debian-packages": PackageList(pkgs),
			},
		})
		if err != nil {
			return nil, err
		}
		r := Result{Daemon: d, Ref: ref, Archive: filepath.Join(o.OutDir, d.Name+".tar"), RuntimeFiles: len(files)}
		if err := WriteArchive(r.Archive, ref, img, o.Created); err != nil {
			return nil, err
		}
		digest, err := img.Digest()
		if err != nil {
			return nil, err
		}
		r.Digest = digest.String()
		if r.Size, err = Size(img); err != nil {
			return nil, err
		}
		results = append(results, r)
	}
	return results, nil
}

// checkVersion makes sure binary was built for version: an image tagged
// with one version must not carry another's binary.
func checkVersion(binary, name, version string) error {
	out, err := exec.Command(binary, "--version").Output()
	if err != nil {
		return fmt.Errorf("%s --version (run make build first): %w", binary, err)
	}
	if got, want := strings.TrimSpace(string(out)), name+" "+version; got != want {
		return fmt.Errorf("%s --version prints %q, want %q: rebuild it with make build VERSION=%s", binary, got, want, version)
	}
	return nil
}
