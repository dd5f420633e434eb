// Package kubeenv runs a real etcd and kube-apiserver on 127.0.0.1 for
// integration tests. It is a test helper: import it only from _test.go files.
//
// The binaries come from test/tools/kube-assets.sh, found in $KST_ASSETS_DIR
// (default $HOME/.cache/kube-service-tunnel/assets). Without them New returns
// an error wrapping ErrNoAssets so tests can skip, unless
// KST_REQUIRE_INTEGRATION=1 makes that a hard failure.
//
// One API server for a whole package:
//
//	var env *kubeenv.Env
//
//	func TestMain(m *testing.M) { kubeenv.Main(m, &env) }
//
//	func TestSomething(t *testing.T) {
//		kubeenv.SkipIfUnavailable(t, env)
//		cs := kubernetes.NewForConfigOrDie(env.AdminConfig())
//		...
//	}
//
// StopAPIServer and StartAPIServer kill kube-apiserver and start it again on
// the same address with the same etcd, tokens and certificate, for tests of
// how clients live through a lost API server (see restart.go).
//
// No controller-manager runs: nothing creates EndpointSlices, garbage
// collects, or finishes deleting namespaces (they stay Terminating), so use a
// fresh namespace per test.
package kubeenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const (
	// AdminUser is the user name of the static admin token (group system:masters).
	AdminUser = "kubeenv-admin"
	// ServiceClusterIPRange is the --service-cluster-ip-range of the API server.
	ServiceClusterIPRange = "10.96.0.0/16"
	// ServiceAccountIssuer is the --service-account-issuer of the API server.
	ServiceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

	readyTimeout = 60 * time.Second
	startRetries = 3
)

// Env is a running etcd plus kube-apiserver. Create it with New (or Start,
// or Main) and end it with Stop. Its methods are safe for concurrent use.
type Env struct {
	dir        string
	host       string
	etcdURL    string
	adminToken string
	caData     []byte
	startup    time.Duration

	launcher *launcher
	etcd     *process
	opts     Options
	// saKey is the service accounts' signing key (the controller-manager's
	// token controller signs with it too).
	saKey string
	// controllers are kube-controller-manager and kube-scheduler, once
	// StartControllers ran.
	controllers []*process

	// apiserverBin and apiserverCmd are the binary and command line of the
	// first start, which StartAPIServer reuses.
	apiserverBin string
	apiserverCmd []string

	mu        sync.Mutex // guards apiserver and restarts (StopAPIServer, StartAPIServer)
	apiserver *process
	restarts  int

	stopOnce sync.Once
	stopErr  error
}

// Options change what New starts.
type Options struct {
	// ServiceAccountAdmission enables the API server's ServiceAccount
	// admission plugin, which gives pods their ServiceAccount token volume,
	// as a kubelet needs them (off by default: the tests create pods that
	// nothing runs, before their ServiceAccounts).
	ServiceAccountAdmission bool
	// AuditServiceAccountsOf, when set, makes the API server write an audit
	// log (AuditLog) of every request by a ServiceAccount of that
	// namespace, at the Metadata level.
	AuditServiceAccountsOf string
}

// New starts etcd and kube-apiserver and waits until /readyz answers ok.
// It returns an error wrapping ErrNoAssets when the binaries are missing
// (unless KST_REQUIRE_INTEGRATION=1). The caller must call Stop.
func New() (*Env, error) { return NewWithOptions(Options{}) }

// NewWithOptions is New with options.
func NewWithOptions(o Options) (*Env, error) {
	bins, err := findAssets()
	if err != nil {
		return nil, err
	}
	dir, err := makeTempDir()
	if err != nil {
		return nil, fmt.Errorf("kubeenv: %w", err)
	}
	e := &Env{dir: dir, launcher: newLauncher(), opts: o}
	if err := e.start(bins); err != nil {
		err = fmt.Errorf("kubeenv: start: %w", err)
		if stopErr := e.Stop(); stopErr != nil {
			err = errors.Join(err, stopErr)
		}
		return nil, err
	}
	return e, nil
}

// Start is New for a single test: it skips tb when the assets are missing
// (and not required), fails it on any other error, and registers Stop with
// tb.Cleanup.
func Start(tb testing.TB) *Env { tb.Helper(); return StartWithOptions(tb, Options{}) }

// StartWithOptions is Start with options.
func StartWithOptions(tb testing.TB, o Options) *Env {
	tb.Helper()
	e, err := NewWithOptions(o)
	if errors.Is(err, ErrNoAssets) {
		tb.Skip(err)
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := e.Stop(); err != nil {
			tb.Errorf("kubeenv stop: %v", err)
		}
	})
	return e
}

// Main is a TestMain body: it starts one Env shared by the package's tests,
// stores it in *env, runs the tests, stops the Env and exits. When the
// assets are missing (and not required) *env stays nil and the tests should
// call SkipIfUnavailable. Any other start error exits with status 1.
func Main(m *testing.M, env **Env) {
	os.Exit(runMain(m, env))
}

func runMain(m *testing.M, env **Env) int {
	e, err := New()
	switch {
	case errors.Is(err, ErrNoAssets):
		fmt.Fprintf(os.Stderr, "%v; integration tests will skip\n", err)
	case err != nil:
		fmt.Fprintln(os.Stderr, err)
		return 1
	default:
		fmt.Fprintf(os.Stderr, "kubeenv: API server %s ready in %v\n", e.Host(), e.StartupDuration().Round(time.Millisecond))
		*env = e
	}
	code := m.Run()
	if err := e.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "kubeenv: stop: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// SkipIfUnavailable skips tb when env is nil, i.e. when Main found no assets.
func SkipIfUnavailable(tb testing.TB, env *Env) {
	tb.Helper()
	if env == nil {
		tb.Skipf("no kube-apiserver/etcd: run test/tools/kube-assets.sh or set %s", EnvAssetsDir)
	}
}

// Host returns the API server URL, https://127.0.0.1:PORT.
func (e *Env) Host() string { return e.host }

// Port returns the API server's port on 127.0.0.1, PORT in Host.
func (e *Env) Port() int {
	port, _ := strconv.Atoi(e.host[strings.LastIndex(e.host, ":")+1:])
	return port
}

// Dir returns the Env's temp dir. It holds etcd.log, kube-apiserver.log (and
// kube-apiserver-N.log after N restarts), the certificates and the etcd data,
// and is removed by Stop.
func (e *Env) Dir() string { return e.dir }

// StartupDuration returns how long New took from starting etcd until the API
// server was ready.
func (e *Env) StartupDuration() time.Duration { return e.startup }

// PIDs returns the process ids of etcd and kube-apiserver (for leak checks).
func (e *Env) PIDs() []int {
	var pids []int
	for _, p := range []*process{e.etcd, e.currentAPIServer()} {
		if p != nil {
			pids = append(pids, p.pid())
		}
	}
	return pids
}

// Stop kills kube-apiserver and etcd, waits for them to exit and removes the
// temp dir. It is idempotent and safe on a nil Env.
func (e *Env) Stop() error {
	if e == nil {
		return nil
	}
	e.stopOnce.Do(func() { e.stopErr = e.stop() })
	return e.stopErr
}

func (e *Env) stop() error {
	var errs []error
	for _, p := range e.controllers {
		errs = append(errs, p.kill())
	}
	errs = append(errs, e.currentAPIServer().kill(), e.etcd.kill())
	e.launcher.close()
	if err := os.RemoveAll(e.dir); err != nil {
		errs = append(errs, fmt.Errorf("remove %s: %w", e.dir, err))
	}
	return errors.Join(errs...)
}

// start runs etcd, then kube-apiserver, each retried when its random port
// was taken in the meantime.
func (e *Env) start(bins assets) error {
	begin := time.Now()
	if err := retryOnPortClash(func() error { return e.startEtcd(bins.etcd) }); err != nil {
		return err
	}
	if err := retryOnPortClash(func() error { return e.startAPIServer(bins.apiserver) }); err != nil {
		return err
	}
	e.startup = time.Since(begin)
	return nil
}

// errPortInUse marks a start that failed because a port was taken.
var errPortInUse = errors.New("port already in use")

func retryOnPortClash(start func() error) error {
	var err error
	for range startRetries {
		if err = start(); !errors.Is(err, errPortInUse) {
			return err
		}
	}
	return err
}

// logPath returns the path of a process log in the temp dir.
func (e *Env) logPath(name string) string {
	return filepath.Join(e.dir, name+".log")
}
