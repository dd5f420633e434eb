package testcri

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"time"
)

// busyboxPaths are where Debian's busybox-static (or busybox) installs it.
var busyboxPaths = []string{"/bin/busybox", "/usr/bin/busybox"}

// findStaticBusybox returns the path of a statically linked busybox, which
// runs in an image that has no libc.
func findStaticBusybox() (string, error) {
	for _, p := range busyboxPaths {
		f, err := elf.Open(p)
		if err != nil {
			continue
		}
		static := true
		for _, prog := range f.Progs {
			if prog.Type == elf.PT_INTERP {
				static = false
			}
		}
		f.Close()
		if static {
			return p, nil
		}
	}
	return "", fmt.Errorf("no statically linked busybox in %v (apt-get install busybox-static)", busyboxPaths)
}

// writeSandboxImage writes a docker-archive tarball (what `docker save`
// writes, and `ctr images import` reads) holding one image tagged ref: a
// rootfs with a static busybox whose entrypoint sleeps for ever. It stands in
// for the pause image, which no registry can give us here. PID 1 in a
// container ignores SIGTERM without a handler; containerd stops a sandbox
// with SIGKILL, so that is fine.
func writeSandboxImage(path, ref, busybox string) error {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return err
	}
	var layer bytes.Buffer
	lw := tar.NewWriter(&layer)
	mtime := time.Unix(0, 0)
	for _, d := range []string{"bin/", "dev/", "etc/", "proc/", "sys/", "tmp/"} {
		if err := lw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: mtime}); err != nil {
			return err
		}
	}
	if err := lw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(bin)), ModTime: mtime}); err != nil {
		return err
	}
	if _, err := lw.Write(bin); err != nil {
		return err
	}
	for _, l := range []string{"sh", "sleep"} {
		if err := lw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + l, Linkname: "busybox", Mode: 0o777, ModTime: mtime}); err != nil {
			return err
		}
	}
	if err := lw.Close(); err != nil {
		return err
	}
	layerSum := sha256.Sum256(layer.Bytes())

	config, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"created":      mtime.UTC().Format(time.RFC3339),
		"config": map[string]any{
			"Entrypoint": []string{"/bin/sleep", "2147483647"},
			"WorkingDir": "/",
		},
		"rootfs": map[string]any{
			"type":     "layers",
			"diff_ids": []string{"sha256:" + hex.EncodeToString(layerSum[:])},
		},
	})
	if err != nil {
		return err
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	manifest, err := json.Marshal([]map[string]any{{
		"Config":   configName,
		"RepoTags": []string{ref},
		"Layers":   []string{"layer.tar"},
	}})
	if err != nil {
		return err
	}

	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	aw := tar.NewWriter(f)
	for _, e := range []struct {
		name string
		data []byte
	}{{configName, config}, {"layer.tar", layer.Bytes()}, {"manifest.json", manifest}} {
		if err := aw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: mtime}); err != nil {
			return err
		}
		if _, err := aw.Write(e.data); err != nil {
			return err
		}
	}
	if err := aw.Close(); err != nil {
		return err
	}
	return f.Close()
}
