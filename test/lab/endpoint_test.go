package lab

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// kernelTests are the tests of package endpoint that need GRE and MPLS.
var kernelTests = []string{"TestKernelGREPod", "TestKernelMPLSPod", "TestKernelMPLSNode"}

// TestEndpointKernelInVM runs the endpoint agent's kernel tests (real GRE
// device in a pod, MPLS pop route, node swap route, their adoption after a
// restart) inside the lab VM, whose kernel has what this host's lacks, and
// the bridge guard's test on the kernel the lab runs (Debian's, older than
// this host's).
func TestEndpointKernelInVM(t *testing.T) {
	assets := Require(t)
	dir := t.TempDir()
	bin := filepath.Join(dir, "endpoint.test")
	if err := BuildStaticTest("./endpoint", bin); err != nil {
		t.Fatal(err)
	}
	guardBin := filepath.Join(dir, "bridgeguard.test")
	if err := BuildStaticTest("./internal/bridgeguard", guardBin); err != nil {
		t.Fatal(err)
	}
	script := `#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
cd /tmp
/lab/endpoint.test -test.run '^(` + strings.Join(kernelTests, "|") + `)$' -test.v -test.count=1
echo "endpoint tests rc=$?"
/lab/bridgeguard.test -test.v -test.count=1
echo "bridgeguard tests rc=$?"
`
	ir, err := BuildInitramfs(InitramfsOptions{Assets: assets, Output: filepath.Join(dir, "initrd.cpio"), Script: script,
		Files: map[string]string{"/lab/endpoint.test": bin, "/lab/bridgeguard.test": guardBin}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	start := time.Now()
	out, _, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel})
	t.Logf("VM ran the endpoint kernel tests in %v:\n%s", time.Since(start).Round(time.Millisecond), out)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range kernelTests {
		if !strings.Contains(out, "--- PASS: "+name) {
			t.Errorf("%s did not pass in the VM", name)
		}
	}
	if !strings.Contains(out, "endpoint tests rc=0") {
		t.Errorf("the endpoint test binary failed in the VM")
	}
	if !strings.Contains(out, "--- PASS: TestBridgedPodLabelIsDropped") || !strings.Contains(out, "bridgeguard tests rc=0") {
		t.Errorf("the bridge guard's test did not pass in the VM")
	}
}
