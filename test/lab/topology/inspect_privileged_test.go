package topology

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/support/testnetns"
)

// TestPodHasAddr: in a named namespace, a host address of either family on
// any link is found; the same address with a shorter prefix, or another
// address of the family, is not.
func TestPodHasAddr(t *testing.T) {
	testnetns.RequireRoot(t)
	name := fmt.Sprintf("kst-podaddr-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", "192.0.2.1/32", "dev", "lo"},
		{"addr", "add", "2001:db8:2::1/128", "dev", "lo", "nodad"},
		{"addr", "add", "192.0.2.2/24", "dev", "lo"},
		{"addr", "add", "2001:db8:2::2/64", "dev", "lo", "nodad"},
	} {
		if out, err := exec.Command("ip", append([]string{"-n", name}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	pod := &Pod{Host: Host{Name: name}}
	for addr, want := range map[string]bool{
		"192.0.2.1": true, "2001:db8:2::1": true,
		"192.0.2.2": false, "2001:db8:2::2": false, // not host prefixes
		"192.0.2.3": false, "2001:db8:2::3": false,
	} {
		got, err := PodHasAddr(context.Background(), pod, netip.MustParseAddr(addr))
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("PodHasAddr(%s) = %t, want %t", addr, got, want)
		}
	}
}
