package runtime

import (
	"fmt"
	"io/fs"
	"strings"

	"github.com/vishvananda/netns"
)

// nsID identifies a namespace whatever handle or path reaches it: the
// device and inode of its nsfs file, as netns.NsHandle.UniqueId prints
// them ("NS(dev:ino)"). It is what NsHandle.Equal compares, in a form that
// can be kept (a map key, the namespace this process started in) without
// holding the namespace open.
type nsID string

// nsIDOf identifies the namespace h is open on.
func nsIDOf(h netns.NsHandle) (nsID, error) {
	id := h.UniqueId()
	// UniqueId has no error: it says "NS(none)" for a closed handle and
	// "NS(unknown)" when fstat fails, neither with a colon.
	if !strings.Contains(id, ":") {
		return "", fmt.Errorf("namespace handle %d: cannot identify it: %s", int(h), id)
	}
	return nsID(id), nil
}

// nsIDOfPath identifies the namespace at path (a /proc/PID/ns file or a
// bind mount of one). It opens path only for as long as it takes.
func nsIDOfPath(path string) (nsID, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return "", &fs.PathError{Op: "open", Path: path, Err: err}
	}
	defer h.Close()
	return nsIDOf(h)
}
