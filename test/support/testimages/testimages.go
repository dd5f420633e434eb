// Package testimages builds the daemons' images for tests, as make build and
// make image do, for a version of the test's choosing.
package testimages

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/image"
)

// Build builds both daemons for version (so --version prints it) and their
// images named registry/NAME:version into dir, and returns them by daemon
// name. It fails the test on any error.
func Build(t testing.TB, dir, registry, version string) map[string]image.Result {
	t.Helper()
	_, here, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(here), "..", "..", "..")
	bin := filepath.Join(dir, "bin")
	daemons := []image.Daemon{image.Router, image.Endpoint}
	var wg sync.WaitGroup
	errs := make([]error, len(daemons))
	for i, d := range daemons {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command("go", "build", "-trimpath", "-ldflags",
				"-s -w -X github.com/cmdnu/kube-service-tunnel/internal/version.Version="+version,
				"-o", filepath.Join(bin, d.Name), "./cmd/"+d.Name)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("go build %s: %v\n%s", d.Name, err, out)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	results, err := image.BuildAll(image.Options{
		BinDir: bin, OutDir: filepath.Join(dir, "images"), Cache: image.DefaultCache(),
		Registry: registry, Version: version, Created: time.Unix(1_700_000_000, 0),
	})
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]image.Result{}
	for _, r := range results {
		byName[r.Daemon.Name] = r
	}
	return byName
}
