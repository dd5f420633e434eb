package version

import (
	"runtime/debug"
	"testing"
)

func TestFromBuildSettings(t *testing.T) {
	for _, tc := range []struct {
		name     string
		settings []debug.BuildSetting
		want     string
	}{
		{"no vcs", nil, "devel"},
		{"clean", []debug.BuildSetting{{Key: "vcs.revision", Value: "98d6541aa0b1c2d3e4f5"}, {Key: "vcs.modified", Value: "false"}}, "98d6541aa0b1"},
		{"dirty", []debug.BuildSetting{{Key: "vcs.revision", Value: "98d6541"}, {Key: "vcs.modified", Value: "true"}}, "98d6541+dirty"},
	} {
		if got := fromBuildSettings(tc.settings); got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestStringPrefersTheLinkedVersion(t *testing.T) {
	defer func(v string) { Version = v }(Version)
	Version = "v1.2.3-4-gabcdef0"
	if got := String(); got != Version {
		t.Errorf("String() = %q, want %q", got, Version)
	}
}
