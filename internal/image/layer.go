package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Layer is t as an OCI layer. The tar is reproducible: entries in path
// order, every ancestor directory present, owner root, and every timestamp
// modTime, so that the same files give the same digest on any machine.
func Layer(t Tree, modTime time.Time) (v1.Layer, error) {
	data, err := tarOf(t, modTime)
	if err != nil {
		return nil, err
	}
	// Compressed once here: given an uncompressed tar, the library
	// compresses it again each time it is read (digest, size, write).
	var compressed bytes.Buffer
	zw, err := gzip.NewWriterLevel(&compressed, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(data); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(compressed.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
}

func tarOf(t Tree, modTime time.Time) ([]byte, error) {
	all := Tree{}
	for p, e := range t {
		all[p] = e
		for dir := path.Dir(p); dir != "/"; dir = path.Dir(dir) {
			if _, ok := all[dir]; !ok {
				all[dir] = Entry{Path: dir, Mode: fs.ModeDir | 0o755}
			}
		}
	}
	paths := make([]string, 0, len(all))
	for p := range all {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	for _, p := range paths {
		e := all[p]
		mode := int64(e.Mode.Perm())
		if e.Mode&fs.ModeSticky != 0 {
			mode |= 0o1000 // tar's c_ISVTX
		}
		h := &tar.Header{
			Name:    strings.TrimPrefix(p, "/"),
			Mode:    mode,
			ModTime: modTime.Truncate(time.Second),
		}
		var data []byte
		switch {
		case e.Mode&fs.ModeSymlink != 0:
			h.Typeflag, h.Linkname = tar.TypeSymlink, e.Target
		case e.Mode.IsDir():
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		default:
			var err error
			if data, err = os.ReadFile(e.Source); err != nil {
				return nil, fmt.Errorf("layer file %s: %w", p, err)
			}
			h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		}
		if err := w.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("layer file %s: %w", p, err)
		}
		if _, err := w.Write(data); err != nil {
			return nil, fmt.Errorf("layer file %s: %w", p, err)
		}
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
