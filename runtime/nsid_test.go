package runtime

import (
	"errors"
	"io/fs"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

// idOfPath identifies the namespace at path, failing the test if it cannot.
func idOfPath(t *testing.T, path string) nsID {
	t.Helper()
	id, err := nsIDOfPath(path)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// idOfHandle identifies the namespace h is open on, failing the test if it
// cannot.
func idOfHandle(t *testing.T, h netns.NsHandle) nsID {
	t.Helper()
	id, err := nsIDOf(h)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestNSID checks, without root, that a namespace has one identity through
// every path and handle, that NsHandle.Equal agrees with it, that another
// namespace has another, and that what is not an open namespace has none.
func TestNSID(t *testing.T) {
	net := idOfPath(t, "/proc/self/ns/net")
	if !strings.HasPrefix(string(net), "NS(") {
		t.Errorf("nsIDOfPath(/proc/self/ns/net) = %q, want NS(dev:ino)", net)
	}
	h, err := netns.GetFromPath("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if got := idOfHandle(t, h); got != net {
		t.Errorf("through a handle: %q, through the path: %q; want the same", got, net)
	}
	other, err := netns.GetFromPath("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if !h.Equal(other) {
		t.Errorf("NsHandle.Equal of two handles on the same namespace: false")
	}
	if mnt := idOfPath(t, "/proc/self/ns/mnt"); mnt == net {
		t.Errorf("the mount namespace has the network namespace's identity %q", mnt)
	}

	if id, err := nsIDOf(netns.None()); err == nil {
		t.Errorf("nsIDOf(closed handle) = %q, want an error", id)
	}
	if id, err := nsIDOf(netns.NsHandle(1 << 20)); err == nil { // no such descriptor: fstat fails
		t.Errorf("nsIDOf(not a descriptor) = %q, want an error", id)
	}
	if id, err := nsIDOfPath("/proc/self/ns/no-such-namespace"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("nsIDOfPath(missing) = %q, %v; want an error wrapping fs.ErrNotExist", id, err)
	}
}
