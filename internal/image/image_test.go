package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// writeFile creates root/p with data.
func writeFile(t *testing.T, root, p, data string, mode os.FileMode) {
	t.Helper()
	full := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(full, []byte(data), mode); err != nil {
		t.Fatal(err)
	}
}

func symlink(t *testing.T, root, p, target string) {
	t.Helper()
	full := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, full); err != nil {
		t.Fatal(err)
	}
}

func copyHostFile(t *testing.T, root, hostPath, p string) {
	t.Helper()
	data, err := os.ReadFile(hostPath)
	if err != nil {
		t.Skipf("needs %s: %v", hostPath, err)
	}
	writeFile(t, root, p, string(data), 0o755)
}

func TestClosureFollowsLinksDirectoriesAndLibraries(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "/usr/sbin/multi", "#!/bin/sh\n", 0o755) // not ELF: needs nothing
	symlink(t, root, "/usr/sbin/tool-save", "multi")
	symlink(t, root, "/sbin/tool", "/usr/sbin/tool-save")
	writeFile(t, root, "/usr/lib/ext/a.so", "x", 0o644)
	writeFile(t, root, "/usr/lib/ext/b.so", "y", 0o644)
	writeFile(t, root, "/usr/share/unwanted", "z", 0o644)
	tree, err := Closure(root, "/sbin/tool", "/usr/lib/ext")
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{
		"/sbin/tool": "link /usr/sbin/tool-save", "/usr/sbin/tool-save": "link multi", "/usr/sbin/multi": "file",
		"/usr/lib/ext": "dir", "/usr/lib/ext/a.so": "file", "/usr/lib/ext/b.so": "file",
	} {
		e, ok := tree[p]
		got := "missing"
		switch {
		case !ok:
		case e.Target != "":
			got = "link " + e.Target
		case e.Mode.IsDir():
			got = "dir"
		default:
			got = "file"
		}
		if got != want {
			t.Errorf("%s: %s, want %s", p, got, want)
		}
	}
	if _, ok := tree["/usr/share/unwanted"]; ok || len(tree) != 6 {
		t.Errorf("closure has %d entries, want exactly the 6 needed: %v", len(tree), tree)
	}
}

// A dynamically linked program brings its interpreter and libraries; one
// whose library no package provides is an error naming both.
func TestClosureAddsELFInterpreterAndLibraries(t *testing.T) {
	root := t.TempDir()
	copyHostFile(t, root, "/usr/bin/true", "/usr/bin/true")
	if _, err := Closure(root, "/usr/bin/true"); err == nil || !strings.Contains(err.Error(), "/usr/bin/true needs libc.so.6") &&
		!strings.Contains(err.Error(), "ld-linux") {
		t.Fatalf("without libc: %v, want an error naming the missing library or interpreter", err)
	}
	copyHostFile(t, root, "/lib64/ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2")
	copyHostFile(t, root, "/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6")
	tree, err := Closure(root, "/usr/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/usr/bin/true", "/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"} {
		if _, ok := tree[p]; !ok {
			t.Errorf("closure lacks %s: %v", p, tree)
		}
	}
}

func TestLayerIsReproducible(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "/usr/sbin/x", "binary", 0o755)
	tree := Tree{"/usr/sbin/x": {Path: "/usr/sbin/x", Source: filepath.Join(root, "usr/sbin/x"), Mode: 0o755}}
	at := time.Unix(1_700_000_000, 0)
	digest := func(tm time.Time) string {
		l, err := Layer(tree, tm)
		if err != nil {
			t.Fatal(err)
		}
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		return d.String()
	}
	// The source file's own time must not matter, only the given one.
	first := digest(at)
	if err := os.Chtimes(filepath.Join(root, "usr/sbin/x"), time.Now(), time.Now()); err != nil {
		t.Fatal(err)
	}
	if again := digest(at); again != first {
		t.Errorf("same files, same time: digests %s and %s", first, again)
	}
	if later := digest(at.Add(time.Second)); later == first {
		t.Error("a different time gave the same digest: the timestamp is not in the layer")
	}
	data, err := tarOf(tree, at)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range tarEntries(t, data) {
		if h := e.header; h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(at) {
			t.Errorf("%s: owner %d:%d time %v, want 0:0 at %v", h.Name, h.Uid, h.Gid, h.ModTime, at)
		}
		names = append(names, e.header.Name)
	}
	if got, want := strings.Join(names, " "), "usr/ usr/sbin/ usr/sbin/x"; got != want {
		t.Errorf("entries %q, want %q (ancestors first, in order)", got, want)
	}
}

func TestWriteArchive(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "/bin/tunnel-router", "not really a router", 0o755)
	writeFile(t, root, "/etc/protocols", "tcp 6 TCP\n", 0o644)
	runtime, err := Closure(root, "/etc/protocols")
	if err != nil {
		t.Fatal(err)
	}
	const ref = "registry.example/kst/tunnel-router:v1.2.3"
	img, err := Build(Spec{Ref: ref, Binary: filepath.Join(root, "bin/tunnel-router"), Runtime: runtime,
		Created: time.Unix(1_700_000_000, 0), Labels: map[string]string{"org.opencontainers.image.version": "v1.2.3"}})
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	a, b := filepath.Join(out, "a.tar"), filepath.Join(out, "b.tar")
	for _, p := range []string{a, b} {
		if err := WriteArchive(p, ref, img, time.Unix(1_700_000_000, 0)); err != nil {
			t.Fatal(err)
		}
	}
	da, _ := os.ReadFile(a)
	db, _ := os.ReadFile(b)
	if !bytes.Equal(da, db) {
		t.Error("the same image written twice gave different archives")
	}
	files := map[string][]byte{}
	for _, e := range tarEntries(t, da) {
		files[e.header.Name] = e.data
	}
	for _, want := range []string{"oci-layout", "index.json", "manifest.json"} {
		if _, ok := files[want]; !ok {
			t.Errorf("archive lacks %s", want)
		}
	}
	var index struct {
		Manifests []struct{ Annotations map[string]string }
	}
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("index.json: %v %s", err, files["index.json"])
	}
	if got := index.Manifests[0].Annotations["io.containerd.image.name"]; got != ref {
		t.Errorf("containerd's name annotation %q, want %q", got, ref)
	}
	if got := index.Manifests[0].Annotations["org.opencontainers.image.ref.name"]; got != "v1.2.3" {
		t.Errorf("OCI ref.name annotation %q, want the tag", got)
	}
	// docker load's view: manifest.json, read back by the library.
	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	loaded, err := tarball.ImageFromPath(a, &tag)
	if err != nil {
		t.Fatalf("reading the archive as docker load does: %v", err)
	}
	// The library rebuilds a Docker manifest, so compare what it names.
	want, _ := img.ConfigName()
	if got, _ := loaded.ConfigName(); got != want {
		t.Errorf("docker view's configuration %s, want %s", got, want)
	}
	cfg, err := loaded.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cfg.Config.Entrypoint, " "); got != "/usr/local/bin/tunnel-router" {
		t.Errorf("entrypoint %q", got)
	}
}

func TestRenderManifest(t *testing.T) {
	src, err := os.ReadFile("../../tunnel-router.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for name, src := range map[string][]byte{"tunnel-router.yaml": src, "uninstall.yaml": Uninstall} {
		out, err := RenderManifest(src, "registry.example/kst", "v1.2.3-4-gabcdef0")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		srcLines, outLines := strings.Split(string(src), "\n"), strings.Split(string(out), "\n")
		if len(srcLines) != len(outLines) {
			t.Fatalf("%s: %d lines became %d", name, len(srcLines), len(outLines))
		}
		changed := map[string]bool{}
		for i := range srcLines {
			if srcLines[i] != outLines[i] {
				changed[strings.TrimSpace(outLines[i])] = true
			}
		}
		want := map[string]bool{
			"image: registry.example/kst/tunnel-router:v1.2.3-4-gabcdef0":   true,
			"image: registry.example/kst/tunnel-endpoint:v1.2.3-4-gabcdef0": true,
		}
		if len(changed) != len(want) || !changed["image: registry.example/kst/tunnel-router:v1.2.3-4-gabcdef0"] ||
			!changed["image: registry.example/kst/tunnel-endpoint:v1.2.3-4-gabcdef0"] {
			t.Errorf("%s: changed lines %v, want only the image lines %v", name, changed, want)
		}
		if strings.Contains(string(out), ":latest") || strings.Contains(string(out), "set-by-make-manifest") {
			t.Errorf("%s: a placeholder or :latest is left", name)
		}
	}
	if _, err := RenderManifest([]byte("image: kube-service-tunnel/tunnel-router:x\n"), "r", "v"); err == nil || !strings.Contains(err.Error(), "tunnel-endpoint") {
		t.Errorf("a manifest without the endpoint image: %v, want an error naming it", err)
	}
}

func TestContainerdName(t *testing.T) {
	for ref, want := range map[string]string{
		"kube-service-tunnel/tunnel-router:v1": "docker.io/kube-service-tunnel/tunnel-router:v1",
		"registry.example:5000/kst/x:v2":       "registry.example:5000/kst/x:v2",
		"busybox:1":                            "docker.io/library/busybox:1",
	} {
		tag, err := name.NewTag(ref)
		if err != nil {
			t.Fatal(err)
		}
		if got := containerdName(tag); got != want {
			t.Errorf("containerdName(%s) = %q, want %q", ref, got, want)
		}
	}
}

type tarEntry struct {
	header *tar.Header
	data   []byte
}

// tarEntries reads a tar file's entries, in order.
func tarEntries(t *testing.T, data []byte) []tarEntry {
	t.Helper()
	var entries []tarEntry
	r := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := r.Next()
		if err == io.EOF {
			return entries
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(r)
		if err != nil {
			t.Fatal(err)
		}
		entries = append(entries, tarEntry{h, body})
	}
}
