// Package version is the project's version, as both daemons and the images
// carry it.
package version

import "runtime/debug"

// Version is set at link time by `make build` and `make image`:
//
//	-ldflags "-X github.com/cmdnu/kube-service-tunnel/internal/version.Version=$(git describe --tags --always --dirty)"
//
// Empty in a plain `go build`; String then falls back to the VCS revision
// Go stamps into the binary.
var Version string

// String is the version to print and log: Version when set, else the
// binary's VCS revision ("+dirty" when the tree had changes), else "devel".
func String() string {
	if Version != "" {
		return Version
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	return fromBuildSettings(info.Settings)
}

func fromBuildSettings(settings []debug.BuildSetting) string {
	revision, dirty := "", false
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if revision == "" {
		return "devel"
	}
	if len(revision) > 12 {
		revision = revision[:12]
	}
	if dirty {
		revision += "+dirty"
	}
	return revision
}
