// Command mkimage builds the daemons' images (`make image`) and renders the
// manifest with their references (`make manifest`):
//
//	mkimage build -version V [-registry R] [-bin bin] [-out bin/images] [-cache DIR]
//	mkimage manifest -version V [-registry R] [-in tunnel-router.yaml] [-out bin]
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: mkimage build|manifest [flags]")
	}
	fs := flag.NewFlagSet("mkimage "+args[0], flag.ContinueOnError)
	version := fs.String("version", "", "the project's version: the images' tag (required)")
	registry := fs.String("registry", image.DefaultRegistry, "image name prefix: a registry and path, e.g. registry.example.com/kst")
	switch args[0] {
	case "build":
		bin := fs.String("bin", "bin", "directory with the static binaries (make build)")
		out := fs.String("out", "bin/images", "directory to write NAME.tar into")
		cache := fs.String("cache", image.DefaultCache(), "directory caching the Debian packages")
		if err := parse(fs, args[1:]); err != nil {
			return err
		}
		return build(*bin, *out, *cache, *registry, *version)
	case "manifest":
		in := fs.String("in", "tunnel-router.yaml", "manifest to render")
		out := fs.String("out", "bin", "directory to write tunnel-router.yaml and tunnel-uninstall.yaml into")
		if err := parse(fs, args[1:]); err != nil {
			return err
		}
		src, err := os.ReadFile(*in)
		if err != nil {
			return err
		}
		for _, m := range []struct {
			name string
			src  []byte
		}{{*in, src}, {"tunnel-uninstall.yaml", image.Uninstall}} {
			rendered, err := image.RenderManifest(m.src, *registry, *version)
			if err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			path := filepath.Join(*out, filepath.Base(m.name))
			if err := os.WriteFile(path, rendered, 0o644); err != nil {
				return err
			}
			fmt.Printf("%s: images %s, %s\n", path, image.Ref(*registry, image.Router.Name, *version), image.Ref(*registry, image.Endpoint.Name, *version))
		}
		return nil
	default:
		return fmt.Errorf("unknown command %q: build or manifest", args[0])
	}
}

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if v := fs.Lookup("version").Value.String(); v == "" {
		return errors.New("-version is required")
	}
	return nil
}

// sourceDate is the images' timestamp: SOURCE_DATE_EPOCH, else the last
// commit's time, so that a build of one commit is reproducible.
func sourceDate() (time.Time, error) {
	s := os.Getenv("SOURCE_DATE_EPOCH")
	if s == "" {
		out, err := exec.Command("git", "log", "-1", "--format=%ct").Output()
		if err != nil {
			return time.Time{}, fmt.Errorf("the commit's time (set SOURCE_DATE_EPOCH outside a git checkout): %w", err)
		}
		s = strings.TrimSpace(string(out))
	}
	sec, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
	}
	return time.Unix(sec, 0).UTC(), nil
}

func build(bin, out, cache, registry, version string) error {
	created, err := sourceDate()
	if err != nil {
		return err
	}
	results, err := image.BuildAll(image.Options{BinDir: bin, OutDir: out, Cache: cache, Registry: registry, Version: version, Created: created})
	if err != nil {
		return err
	}
	for _, r := range results {
		fmt.Printf("%-16s %s  %s  %.1f MB compressed (%d runtime files)  %s\n",
			r.Daemon.Name, r.Ref, r.Digest, float64(r.Size)/1e6, r.RuntimeFiles, r.Archive)
	}
	return nil
}
