package image

import (
	_ "embed"
	"fmt"
	"regexp"
)

// Uninstall is the uninstall DaemonSet's source (uninstall.yaml), rendered
// like the manifest into bin/tunnel-uninstall.yaml.
//
//go:embed uninstall.yaml
var Uninstall []byte

// Ref is a daemon's image reference: REGISTRY/NAME:VERSION.
func Ref(registry, daemon, version string) string {
	return registry + "/" + daemon + ":" + version
}

// DefaultRegistry is the image name prefix without a registry of the
// user's: docker and containerd resolve it as a Docker Hub name, but with
// imagePullPolicy IfNotPresent kubelet uses an imported image of that name
// and never pulls.
const DefaultRegistry = "kube-service-tunnel"

// imageLine matches a container's image field naming a daemon's image in
// any registry and with any tag: submatch 1 is the indentation and key,
// 2 the daemon.
var imageLine = regexp.MustCompile(`(?m)^([ \t]*image:[ \t]*)\S*/(tunnel-router|tunnel-endpoint):\S+[ \t]*$`)

// RenderManifest is the manifest src with each daemon's image set to
// Ref(registry, daemon, version). Both daemons' images must be there.
func RenderManifest(src []byte, registry, version string) ([]byte, error) {
	seen := map[string]bool{}
	out := imageLine.ReplaceAllFunc(src, func(line []byte) []byte {
		m := imageLine.FindSubmatch(line)
		seen[string(m[2])] = true
		return []byte(string(m[1]) + Ref(registry, string(m[2]), version))
	})
	for _, d := range []Daemon{Router, Endpoint} {
		if !seen[d.Name] {
			return nil, fmt.Errorf("manifest has no container image named .../%s:TAG", d.Name)
		}
	}
	return out, nil
}
