// Package daemon holds what the tunnel router and the endpoint agent set up
// the same way: the options every daemon has, their KST_* environment
// fallbacks, the logger, the Kubernetes client, and the metrics and health server.
package daemon

import (
	"flag"
	"fmt"
	"os"
	"runtime/debug"
	"strings"

	"github.com/bombsimon/logrusr/v4"
	"github.com/sirupsen/logrus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/cmdnu/kube-service-tunnel/internal/flagenv"
	"github.com/cmdnu/kube-service-tunnel/internal/version"
)

// EnvPrefix prefixes the environment variable of every flag.
const EnvPrefix = "KST_"

// Common are the options every daemon has.
type Common struct {
	Kubeconfig string
	LogLevel   string
	GCPercent  int
	// PrintVersion makes Parse print the version and return flag.ErrHelp.
	PrintVersion bool
	// CommandLine names the flags given on the command line (not through
	// their KST_* variables): those never change while the daemon runs.
	CommandLine map[string]bool
	// ConfigMap is the daemons' ConfigMap (--config-map), watched for
	// changes of the address pools; empty Name: not watched.
	ConfigMap struct{ Namespace, Name string }
}

// DefaultGCPercent is --gc-percent: a collection once the heap has grown
// 40% over what the last one left live (Go's default is 100%). Both daemons'
// heaps are mostly their informer caches, which live as long as they do:
// at 100% the router with 10,000 tunnel IPs held twice its live heap, at 40%
// it holds 1.4 times, for collections that cost little at its allocation
// rate. Calico's Felix makes the same choice (GOGC 40).
const DefaultGCPercent = 40

// AddFlags registers the common options on fs.
func (c *Common) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig file; empty means in-cluster configuration")
	fs.StringVar(&c.LogLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.BoolVar(&c.PrintVersion, "version", false, "print the version and exit")
	fs.IntVar(&c.GCPercent, "gc-percent", DefaultGCPercent, "Go garbage collector target (as GOGC): collect once the heap grew this many percent over the live heap; an explicit GOGC environment variable wins over the default")
	c.ConfigMap.Namespace, c.ConfigMap.Name = "kube-service-tunnel", "tunnel-config"
	fs.Func("config-map", `the daemons' ConfigMap as NAMESPACE/NAME, watched so that a change of KST_POOLS, KST_POD_CIDR or KST_SERVICE_CIDR applies without a restart (a flag given on the command line wins); "" watches nothing (default "kube-service-tunnel/tunnel-config")`, func(s string) error {
		if s == "" {
			c.ConfigMap.Namespace, c.ConfigMap.Name = "", ""
			return nil
		}
		ns, name, ok := strings.Cut(s, "/")
		if !ok || ns == "" || name == "" {
			return fmt.Errorf("%q: want NAMESPACE/NAME", s)
		}
		c.ConfigMap.Namespace, c.ConfigMap.Name = ns, name
		return nil
	})
}

// Parse parses args, applies the KST_* environment fallbacks, then fills
// nodeName from NODE_NAME and the kubeconfig from KUBECONFIG when unset,
// and sets the garbage collector's target (see DefaultGCPercent). With
// --version it prints "NAME VERSION" to standard output and returns
// flag.ErrHelp, before any validation.
func (c *Common) Parse(fs *flag.FlagSet, args []string, nodeName *string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if c.PrintVersion {
		fmt.Println(fs.Name(), version.String())
		return flag.ErrHelp
	}
	c.CommandLine = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { c.CommandLine[f.Name] = true })
	if err := flagenv.Apply(fs, EnvPrefix); err != nil {
		return err
	}
	if c.GCPercent < 1 {
		return fmt.Errorf("--gc-percent %d: must be at least 1 (GOGC=off is not an option for a daemon)", c.GCPercent)
	}
	if gcPercent, ok := c.gcPercent(fs); ok {
		debug.SetGCPercent(gcPercent)
	}
	if *nodeName == "" {
		*nodeName = os.Getenv("NODE_NAME")
	}
	if c.Kubeconfig == "" {
		c.Kubeconfig = os.Getenv("KUBECONFIG")
	}
	return nil
}

// gcPercent is the garbage collector target to set, if any: --gc-percent
// (or KST_GC_PERCENT) when given, else its default unless the GOGC
// environment variable chose one for the Go runtime already.
func (c *Common) gcPercent(fs *flag.FlagSet) (int, bool) {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "gc-percent" })
	if _, gogc := os.LookupEnv("GOGC"); gogc && !given {
		return 0, false
	}
	return c.GCPercent, true
}

// LogTimeFormat is the time format of the daemons' log lines (RFC 3339
// with milliseconds).
const LogTimeFormat = "2006-01-02T15:04:05.000Z07:00"

// Logger returns a structured logger at --log-level, tagged with component.
func (c *Common) Logger(component string) (*logrus.Entry, error) {
	log := logrus.New()
	level, err := logrus.ParseLevel(c.LogLevel)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	log.SetLevel(level)
	// Milliseconds: what the daemons do is often a matter of them, and
	// latencies can then be read from the log without asking the daemon.
	log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true, TimestampFormat: LogTimeFormat})
	entry := log.WithField("component", component)
	RouteKlog(entry)
	return entry, nil
}

// RouteKlog sends what client-go logs through klog (reflector errors, leader
// and watch warnings) to log as structured lines tagged source=client-go,
// instead of klog's own format on stderr.
func RouteKlog(log logrus.FieldLogger) {
	klog.SetLogger(logrusr.New(log.WithField("source", "client-go")))
}

// KubeClient returns a client from --kubeconfig (or the in-cluster
// configuration) identifying itself as kube-service-tunnel/component.
func (c *Common) KubeClient(component string, qps float32, burst int) (kubernetes.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client configuration: %w", err)
	}
	cfg.UserAgent = "kube-service-tunnel/" + component
	cfg.QPS, cfg.Burst = qps, burst
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return client, nil
}

// DefaultProcSys is --proc-sys: the sysctls as the process sees them.
const DefaultProcSys = "/proc/sys"

// AddProcSysFlag registers --proc-sys on fs into dir. A container runtime
// mounts /proc/sys read-only and refuses a mount inside /proc, so the
// manifest mounts the node's /proc/sys elsewhere and names it here. The
// net.* sysctls under any mount of it are those of the network namespace of
// the thread that opens them.
func AddProcSysFlag(fs *flag.FlagSet, dir *string) {
	fs.StringVar(dir, "proc-sys", DefaultProcSys, "directory of the sysctls to read and write: /proc/sys, or the node's /proc/sys mounted elsewhere (a container runtime mounts its own read-only)")
}
