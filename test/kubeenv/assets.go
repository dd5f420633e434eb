package kubeenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

const (
	// EnvAssetsDir names the environment variable that points at the folder
	// holding the kube-apiserver and etcd binaries.
	EnvAssetsDir = "KST_ASSETS_DIR"
	// EnvRequireIntegration names the environment variable that, when set to
	// "1", turns missing assets into a hard failure instead of a skip (CI).
	EnvRequireIntegration = "KST_REQUIRE_INTEGRATION"

	apiserverBinary = "kube-apiserver"
	etcdBinary      = "etcd"
)

// ErrNoAssets is returned (wrapped) by New when the kube-apiserver or etcd
// binary cannot be found and KST_REQUIRE_INTEGRATION is not "1". Callers
// should skip their integration tests when errors.Is(err, ErrNoAssets).
var ErrNoAssets = errors.New("kubeenv: kube-apiserver/etcd binaries not found (run test/tools/kube-assets.sh)")

// AssetsDir returns the folder searched for the binaries: $KST_ASSETS_DIR, or
// $HOME/.cache/kube-service-tunnel/assets (the default of test/tools/kube-assets.sh).
func AssetsDir() string {
	if dir := os.Getenv(EnvAssetsDir); dir != "" {
		return dir
	}
	home, err := os.UserHomeDir()
	if err != nil {
		home = os.TempDir()
	}
	return filepath.Join(home, ".cache", "kube-service-tunnel", "assets")
}

// IntegrationRequired reports whether KST_REQUIRE_INTEGRATION=1 is set, in
// which case integration tests must not be skipped.
func IntegrationRequired() bool {
	return os.Getenv(EnvRequireIntegration) == "1"
}

// assets holds the absolute paths of the binaries.
type assets struct {
	apiserver string
	etcd      string
}

// findAssets locates both binaries in AssetsDir. A missing binary yields an
// error wrapping ErrNoAssets, or a plain hard error when integration tests are
// required.
func findAssets() (assets, error) {
	dir := AssetsDir()
	var a assets
	var missing []string
	for _, bin := range []struct {
		name string
		dst  *string
	}{{etcdBinary, &a.etcd}, {apiserverBinary, &a.apiserver}} {
		path := filepath.Join(dir, bin.name)
		if _, err := exec.LookPath(path); err != nil {
			missing = append(missing, path)
			continue
		}
		*bin.dst = path
	}
	if len(missing) == 0 {
		return a, nil
	}
	if IntegrationRequired() {
		return a, fmt.Errorf("kubeenv: %s=1 but binaries are missing: %v (run test/tools/kube-assets.sh)",
			EnvRequireIntegration, missing)
	}
	return a, fmt.Errorf("%w: missing %v", ErrNoAssets, missing)
}
