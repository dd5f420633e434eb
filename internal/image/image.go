package image

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Spec is one daemon's image.
type Spec struct {
	// Ref is the image's name and tag, e.g. "kube-service-tunnel/tunnel-router:v0.4.0".
	Ref string
	// Binary is the static Go binary, installed as /usr/local/bin/BASENAME
	// and used as the entrypoint.
	Binary string
	// Runtime is what the binary executes at run time, from the extracted
	// packages (see Closure); its own layer, below the binary's.
	Runtime Tree
	// Created is the image's creation time and every file's timestamp (the
	// commit's time, for reproducible builds).
	Created time.Time
	// Labels go into the image configuration.
	Labels map[string]string
}

// Build assembles the image: a layer with the runtime files (and the /run
// and /tmp mount points), a layer with the binary, and a configuration that
// runs the binary as root with PATH set. The dynamic loader finds the
// libraries in Debian's multiarch directories by itself: Debian's glibc
// searches them without an ld.so.cache.
func Build(s Spec) (v1.Image, error) {
	// Mount points: /run holds legacy iptables' lock (the manifest mounts
	// the node's /run/xtables.lock) and the agent's view of the node's
	// /run (read-only); /tmp is for whatever wants one. /var/run is a
	// directory, not a link to /run as on the node: the kubelet mounts the
	// ServiceAccount token at /var/run/secrets/kubernetes.io/serviceaccount,
	// which through a link would be created in the node's /run (and fail on
	// the read-only mount). The agent opens the runtimes'
	// /var/run/netns/cni-... under /run (runtime.openHostPath).
	files := Tree{
		"/run":     {Path: "/run", Mode: fs.ModeDir | 0o755},
		"/var/run": {Path: "/var/run", Mode: fs.ModeDir | 0o755},
		"/tmp":     {Path: "/tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777},
	}
	for p, e := range s.Runtime {
		files[p] = e
	}
	runtimeLayer, err := Layer(files, s.Created)
	if err != nil {
		return nil, fmt.Errorf("%s: runtime layer: %w", s.Ref, err)
	}
	binaryPath := "/usr/local/bin/" + filepath.Base(s.Binary)
	binaryLayer, err := Layer(Tree{binaryPath: {Path: binaryPath, Source: s.Binary, Mode: 0o755}}, s.Created)
	if err != nil {
		return nil, fmt.Errorf("%s: binary layer: %w", s.Ref, err)
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, runtimeLayer, binaryLayer); err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Created = v1.Time{Time: s.Created.UTC()}
	cfg.Config = v1.Config{
		Entrypoint: []string{binaryPath},
		Env:        []string{"PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Labels:     s.Labels,
	}
	// The history's timestamps would otherwise be the build's time.
	for i := range cfg.History {
		cfg.History[i].Created = cfg.Created
	}
	return mutate.ConfigFile(img, cfg)
}

// WriteArchive writes img as ref to archive: an OCI image layout (oci-layout,
// index.json and blobs/, named by the org.opencontainers.image.ref.name and
// io.containerd.image.name annotations) with a Docker manifest.json beside
// it, the same shape as `docker save` writes since Docker 25. skopeo and
// ctr read the layout, older docker load the manifest.json. The archive is
// reproducible: the same image gives the same bytes.
func WriteArchive(archive, ref string, img v1.Image, modTime time.Time) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("image name %q: %w", ref, err)
	}
	dir, err := os.MkdirTemp(filepath.Dir(archive), ".image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": tag.TagStr(),
		"io.containerd.image.name":          containerdName(tag),
	})); err != nil {
		return fmt.Errorf("writing %s: %w", ref, err)
	}
	manifest, err := dockerManifest(img, ref)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), manifest, 0o644); err != nil {
		return err
	}
	return tarDirectory(archive, dir, modTime)
}

// containerdName is tag's full name as containerd and the CRI spell it:
// a Docker Hub-style reference such as kube-service-tunnel/NAME:TAG is
// docker.io/kube-service-tunnel/NAME:TAG (the library spells the registry
// index.docker.io, under which kubelet would not find the image).
func containerdName(tag name.Tag) string {
	registry := tag.Context().RegistryStr()
	if registry == name.DefaultRegistry {
		registry = "docker.io"
	}
	return registry + "/" + tag.Context().RepositoryStr() + ":" + tag.TagStr()
}

// dockerManifest is docker load's manifest.json, pointing into blobs/.
func dockerManifest(img v1.Image, ref string) ([]byte, error) {
	configDigest, err := img.ConfigName()
	if err != nil {
		return nil, err
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	entry := struct {
		Config   string
		RepoTags []string
		Layers   []string
	}{Config: blobPath(configDigest), RepoTags: []string{ref}}
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return nil, err
		}
		entry.Layers = append(entry.Layers, blobPath(d))
	}
	return json.Marshal([]any{entry})
}

func blobPath(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }

// tarDirectory writes dir's regular files, in path order, as a tar file.
func tarDirectory(archive, dir string, modTime time.Time) error {
	t := Tree{}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		t["/"+filepath.ToSlash(rel)] = Entry{Path: "/" + rel, Source: p, Mode: 0o644}
		return nil
	})
	if err != nil {
		return err
	}
	data, err := tarOf(t, modTime)
	if err != nil {
		return err
	}
	tmp := archive + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, archive)
}

// Size is an image's compressed size: its layers, configuration and manifest.
func Size(img v1.Image) (int64, error) {
	layers, err := img.Layers()
	if err != nil {
		return 0, err
	}
	var total int64
	for _, l := range layers {
		n, err := l.Size()
		if err != nil {
			return 0, err
		}
		total += n
	}
	for _, f := range []func() ([]byte, error){img.RawConfigFile, img.RawManifest} {
		b, err := f()
		if err != nil {
			return 0, err
		}
		total += int64(len(b))
	}
	return total, nil
}
