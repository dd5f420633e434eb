package lab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// buildStaticGo compiles a one-file Go program with CGO_ENABLED=0.
func buildStaticGo(t *testing.T, source string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module labhello\n\ngo 1.26\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(source), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "hello")
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the static Go program: %v\n%s", err, out)
	}
	return bin
}

const helloSource = `package main

import "fmt"

func main() { fmt.Println("static go says hello") }
`

// smokeScript proves each datapath feature the project needs; every check
// prints "ok NAME" only when it worked.
const smokeScript = `#!/bin/sh
check() { name=$1; shift; if "$@"; then echo "ok $name"; else echo "FAIL $name"; fi; }

check gre-p2p /sbin/ip link add g1 type gre local 10.1.1.1 remote 10.1.1.2
check gre-external /sbin/ip link add g2 type gre external
check mpls-labels sysctl -w net.mpls.platform_labels=1000
check mpls-route /sbin/ip -f mpls route add 100 dev lo
check hmark iptables -t mangle -A PREROUTING -d 10.96.0.10/32 -j HMARK \
	--hmark-tuple src,dst,sport,dport,proto --hmark-mod 4 --hmark-offset 100 --hmark-rnd 0x1234
iptables -t mangle -S PREROUTING
check ip6gre-p2p /sbin/ip link add g6 type ip6gre local fd00::1
check ip6gre-external /sbin/ip link add g7 type ip6gre external
check hmark6 ip6tables -t mangle -A PREROUTING -d 2001:db8:2::10/128 -j HMARK \
	--hmark-tuple src,dst,sport,dport,proto --hmark-mod 4 --hmark-offset 100 --hmark-rnd 0x1234
ip6tables -t mangle -S PREROUTING

/sbin/ip netns add a && /sbin/ip netns add b &&
	/sbin/ip link add va netns a type veth peer name vb netns b &&
	/sbin/ip -n a addr add 192.168.77.1/24 dev va && /sbin/ip -n b addr add 192.168.77.2/24 dev vb &&
	/sbin/ip -n a link set va up && /sbin/ip -n b link set vb up
check veth-ping /sbin/ip netns exec a ping -c 1 -W 5 192.168.77.2
check hmark-legacy /sbin/ip netns exec a iptables-legacy -t mangle -A PREROUTING -d 10.96.0.10/32 -j HMARK \
	--hmark-tuple src,dst,sport,dport,proto --hmark-mod 4 --hmark-offset 100 --hmark-rnd 0x1234
check hmark6-legacy /sbin/ip netns exec a ip6tables-legacy -t mangle -A PREROUTING -d 2001:db8:2::10/128 -j HMARK \
	--hmark-tuple src,dst,sport,dport,proto --hmark-mod 4 --hmark-offset 100 --hmark-rnd 0x1234
check raw6-legacy /sbin/ip netns exec a ip6tables-legacy -t raw -A PREROUTING -d 2001:db8:2::10/128 -j CT --notrack
/sbin/ip -n a addr add fd77::1/64 dev va nodad && /sbin/ip -n b addr add fd77::2/64 dev vb nodad
check veth-ping6 /sbin/ip netns exec a ping -6 -c 1 -W 5 fd77::2

check static-go /lab/hello

check guestfwd sh -c 'wget -q -O - http://` + HostForwardAddr + `:$(cat /lab/port)/ | grep -q "from the host"'
# A second connection: each guest connection needs its own relay.
check guestfwd-again sh -c 'wget -q -O - http://` + HostForwardAddr + `:$(cat /lab/port)/ | grep -q "from the host"'
exit 0
`

func TestLabSmoke(t *testing.T) {
	start := time.Now()
	assets := Require(t)
	t.Logf("assets ready in %v: kernel %s", time.Since(start).Round(time.Millisecond), assets.KernelVersion)

	// A server on the host's loopback, the only outside address the VM
	// may reach.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello from the host")
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	port := ln.Addr().(*net.TCPAddr).Port

	dir := t.TempDir()
	portFile := filepath.Join(dir, "port")
	if err := os.WriteFile(portFile, []byte(fmt.Sprint(port)), 0o644); err != nil {
		t.Fatal(err)
	}
	hello := buildStaticGo(t, helloSource)

	start = time.Now()
	ir, err := BuildInitramfs(InitramfsOptions{
		Assets: assets,
		Output: filepath.Join(dir, "initrd.cpio"),
		Script: smokeScript,
		Files:  map[string]string{"/lab/hello": hello, "/lab/port": portFile},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("initramfs built in %v: %.1f MB, %d modules", time.Since(start).Round(time.Millisecond),
		float64(ir.Size)/(1<<20), len(ir.Modules))

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	start = time.Now()
	out, code, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel, ForwardHostPorts: []int{port}})
	t.Logf("boot to end marker: %v", time.Since(start).Round(time.Millisecond))
	t.Logf("serial console:\n%s", out)
	if err != nil {
		t.Fatal(err)
	}
	if code != 0 {
		t.Errorf("run.sh exit code %d, want 0", code)
	}
	for _, want := range []string{
		"ok gre-p2p", "ok gre-external", "ok mpls-labels", "ok mpls-route", "ok hmark",
		"ok ip6gre-p2p", "ok ip6gre-external", "ok hmark6", "ok hmark6-legacy", "ok raw6-legacy", "ok veth-ping6",
		"-j HMARK", "ok hmark-legacy", "ok veth-ping", "static go says hello", "ok static-go", "ok guestfwd", "ok guestfwd-again",
	} {
		if !strings.Contains(out, want+"\n") && !strings.Contains(out, want+" ") {
			t.Errorf("console lacks %q", want)
		}
	}
}

func TestParseExitCode(t *testing.T) {
	for _, tc := range []struct {
		out    string
		code   int
		wantOK bool
	}{
		{"boot\nM rc=0\n", 0, true},
		{"M rc=3\nreboot: Power down\n", 3, true},
		{"M rc=1", 0, false}, // line not complete yet
		{"no marker\n", 0, false},
		{"M rc=x\n", 0, false},
	} {
		code, ok := parseExitCode(tc.out, "M rc=")
		if code != tc.code || ok != tc.wantOK {
			t.Errorf("parseExitCode(%q) = %d, %v; want %d, %v", tc.out, code, ok, tc.code, tc.wantOK)
		}
	}
}

func TestCanonical(t *testing.T) {
	for in, want := range map[string]string{
		"/sbin/ip":                 "usr/sbin/ip",
		"bin/sh":                   "usr/bin/sh",
		"/lib64/ld-linux.so.2":     "usr/lib64/ld-linux.so.2",
		"/lib/modules/x/veth.ko":   "usr/lib/modules/x/veth.ko",
		"/usr/bin/wget":            "usr/bin/wget",
		"/lab/run.sh":              "lab/run.sh",
		"/binary":                  "binary",
		"/lab/../etc/passwd":       "etc/passwd",
		"/usr/sbin/../../sbin/tc":  "usr/sbin/tc",
		"/lib":                     "usr/lib",
		"/var/run":                 "var/run",
		"/dev/console":             "dev/console",
		"/usr/lib/x86_64/xtables/": "usr/lib/x86_64/xtables",
	} {
		if got := canonical(in); got != want {
			t.Errorf("canonical(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestBootTimeout(t *testing.T) {
	assets := Require(t)
	ir, err := BuildInitramfs(InitramfsOptions{
		Assets:  assets,
		Output:  filepath.Join(t.TempDir(), "initrd.cpio"),
		Modules: []string{},
		Script:  "sleep 600\n",
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, code, err := Boot(ctx, ir, BootOptions{Kernel: assets.Kernel})
	if !errors.Is(err, context.DeadlineExceeded) || code != -1 {
		t.Fatalf("Boot = %d, %v; want -1 and a deadline error", code, err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("Boot returned %v after its deadline", d)
	}
}

// TestGuestResultsFailuresFirst: the failed leaf tests are reported before
// their parents, whose logs carry the long diagnostics.
func TestGuestResultsFailuresFirst(t *testing.T) {
	out := `=== RUN   TestInCluster
=== RUN   TestInCluster/gre
--- FAIL: TestInCluster (9.00s)
    --- PASS: TestInCluster/gre (3.00s)
        --- PASS: TestInCluster/gre/install (1.00s)
    --- FAIL: TestInCluster/mpls (6.00s)
        --- PASS: TestInCluster/mpls/install (1.00s)
        --- FAIL: TestInCluster/mpls/rollout_restart (5.00s)
--- FAIL: TestOther (0.50s)
--- SKIP: TestNodeHelper (0.00s)
`
	var got []string
	for _, r := range guestResults(out) {
		got = append(got, fmt.Sprintf("%s %s %v", r.result, r.name, r.failedBelow))
	}
	want := []string{
		"FAIL TestInCluster/mpls/rollout_restart false",
		"FAIL TestOther false",
		"FAIL TestInCluster true",
		"PASS TestInCluster/gre false",
		"PASS TestInCluster/gre/install false",
		"FAIL TestInCluster/mpls true",
		"PASS TestInCluster/mpls/install false",
		"SKIP TestNodeHelper false",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("order:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestDurationReport: the modes' totals, then the slowest scenarios first,
// from go test -v's result lines.
func TestDurationReport(t *testing.T) {
	out := `--- PASS: TestInVM (30.00s)
    --- PASS: TestInVM/gre (12.00s)
        --- PASS: TestInVM/gre/1_reach (2.50s)
        --- PASS: TestInVM/gre/9_draining (9.50s)
            --- PASS: TestInVM/gre/9_draining/terminating (8.00s)
    --- FAIL: TestInVM/mpls (18.00s)
        --- FAIL: TestInVM/mpls/1_reach (17.25s)
        --- SKIP: TestInVM/mpls/9_draining (0.00s)
`
	got := DurationReport("e2e", out, 31*time.Second, 2)
	want := `== e2e: 31s in all
  TestInVM/gre                                                    12.0 s  PASS
  TestInVM/mpls                                                   18.0 s  FAIL
== e2e: the slowest 2 of 4
  TestInVM/mpls/1_reach                                           17.2 s  FAIL
  TestInVM/gre/9_draining                                          9.5 s  PASS
`
	if got != want {
		t.Errorf("report:\n%s\nwant:\n%s", got, want)
	}
}

// TestBoundWatchFollowsTheRunningTest: the watch names the last test go
// test -v started, across writes that split lines, and warns at 3/4 of
// its bound.
func TestBoundWatchFollowsTheRunningTest(t *testing.T) {
	var out, timed strings.Builder
	w := WatchBound(t, &out, time.Hour)
	defer w.Stop()
	w.TimeLinesTo(&timed)
	for _, chunk := range []string{"=== RUN   TestInVM\n=== RUN   TestIn", "VM/gre/9_draining\n    some log\n", "=== RUN   TestInVM/gre/9_dr"} {
		if _, err := w.Write([]byte(chunk)); err != nil {
			t.Fatal(err)
		}
	}
	if w.running != "TestInVM/gre/9_draining" {
		t.Errorf("running %q, want TestInVM/gre/9_draining", w.running)
	}
	if !strings.HasSuffix(out.String(), "=== RUN   TestInVM/gre/9_dr") {
		t.Errorf("the console was not forwarded as written: %q", out.String())
	}
	lines := strings.Split(strings.TrimSuffix(timed.String(), "\n"), "\n")
	if len(lines) != 3 || !strings.HasSuffix(lines[1], " === RUN   TestInVM/gre/9_draining") || !strings.HasPrefix(strings.TrimSpace(lines[2]), "0.") {
		t.Errorf("the timed copy holds %q, want the 3 whole lines, each after its time", timed.String())
	}
}

// TestInParallel: every index is called once, never more than `at` at a
// time, and at times `at` at once.
func TestInParallel(t *testing.T) {
	var mu sync.Mutex
	running, most := 0, 0
	called := make([]int, 20)
	InParallel(3, len(called), func(i int) {
		mu.Lock()
		running++
		most = max(most, running)
		called[i]++
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		mu.Lock()
		running--
		mu.Unlock()
	})
	for i, n := range called {
		if n != 1 {
			t.Errorf("f(%d) called %d times", i, n)
		}
	}
	if most != 3 {
		t.Errorf("at most %d calls ran at once, want 3", most)
	}
}

func TestParseSoftnet(t *testing.T) {
	// Two CPUs, as a 6.x kernel prints them (13 columns).
	data := []byte("0002a3f1 0000012c 00000010 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000\n" +
		"0001d4c0 00000001 00000002 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000001\n")
	p, d, s, err := parseSoftnet(data)
	if err != nil {
		t.Fatal(err)
	}
	if p != 0x2a3f1+0x1d4c0 || d != 0x12c+1 || s != 0x10+2 {
		t.Fatalf("got processed %d, dropped %d, squeezed %d; want %d, %d, %d", p, d, s, 0x2a3f1+0x1d4c0, 0x12c+1, 0x10+2)
	}
	if _, _, _, err := parseSoftnet([]byte("zz 0 0\n")); err == nil {
		t.Fatal("a column that is not hexadecimal parsed")
	}
}
