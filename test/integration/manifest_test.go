package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"maps"
	"net"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/cmdnu/kube-service-tunnel/endpoint"
	"github.com/cmdnu/kube-service-tunnel/internal/image"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/router/startup"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

const manifestNamespace = "kube-service-tunnel"

// manifest is tunnel-router.yaml decoded into typed objects.
type manifest struct {
	namespaces      []*corev1.Namespace
	serviceAccounts map[string]*corev1.ServiceAccount
	configMaps      map[string]*corev1.ConfigMap
	daemonSets      map[string]*appsv1.DaemonSet
}

// decodeManifest decodes every document of a multi-document manifest
// strictly (an unknown or misspelt field is an error) into the API's typed
// objects.
func decodeManifest(t *testing.T, data []byte) manifest {
	t.Helper()
	decoder := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
		json.SerializerOptions{Yaml: true, Strict: true})
	m := manifest{serviceAccounts: map[string]*corev1.ServiceAccount{}, configMaps: map[string]*corev1.ConfigMap{}, daemonSets: map[string]*appsv1.DaemonSet{}}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for i := 0; ; i++ {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		if isEmptyDocument(doc) {
			continue
		}
		obj, _, err := decoder.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		meta := obj.(metav1.Object)
		if isNamespaced(obj) && meta.GetNamespace() != manifestNamespace && meta.GetNamespace() != routerstatus.DefaultNamespace {
			t.Errorf("%T %s is in namespace %q, want %q or %q", obj, meta.GetName(), meta.GetNamespace(), manifestNamespace, routerstatus.DefaultNamespace)
		}
		switch o := obj.(type) {
		case *corev1.Namespace:
			m.namespaces = append(m.namespaces, o)
		case *corev1.ServiceAccount:
			m.serviceAccounts[o.Name] = o
		case *corev1.ConfigMap:
			m.configMaps[o.Name] = o
		case *appsv1.DaemonSet:
			m.daemonSets[o.Name] = o
		}
	}
	return m
}

// isEmptyDocument reports whether a YAML document holds only comments and blanks.
func isEmptyDocument(doc []byte) bool {
	for line := range strings.SplitSeq(string(doc), "\n") {
		if l := strings.TrimSpace(line); l != "" && l != "---" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

func isNamespaced(obj k8sruntime.Object) bool {
	switch obj.(type) {
	case *corev1.ServiceAccount, *corev1.ConfigMap, *appsv1.DaemonSet:
		return true
	}
	return false
}

// daemonSet returns a DaemonSet of the manifest and its single container.
func (m manifest) daemonSet(t *testing.T, name string) (*appsv1.DaemonSet, corev1.Container) {
	t.Helper()
	ds, ok := m.daemonSets[name]
	if !ok {
		t.Fatalf("no DaemonSet %s", name)
	}
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("DaemonSet %s has %d containers, want 1", name, n)
	}
	return ds, ds.Spec.Template.Spec.Containers[0]
}

// portOf returns the port of a --metrics-address default such as ":9641".
func portOf(t *testing.T, addr string) int {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// checkDaemon checks what both daemons need: their own ServiceAccount, the
// node's network namespace, NET_ADMIN with every other capability dropped
// unless listed in extra, NODE_NAME from the downward API, the shared
// ConfigMap, resource requests, and the health probes on their metrics port.
func checkDaemon(t *testing.T, m manifest, name string, metricsAddress string, extra ...corev1.Capability) (*appsv1.DaemonSet, corev1.Container) {
	t.Helper()
	ds, c := m.daemonSet(t, name)
	spec := ds.Spec.Template.Spec
	if _, ok := m.serviceAccounts[spec.ServiceAccountName]; !ok || spec.ServiceAccountName != name {
		t.Errorf("%s: serviceAccountName %q, want its own ServiceAccount %q defined in the manifest", name, spec.ServiceAccountName, name)
	}
	if !spec.HostNetwork {
		t.Errorf("%s: hostNetwork is off; the daemon programs the node's own network namespace", name)
	}
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatalf("%s: no capabilities in the securityContext", name)
	}
	wantAdd := append([]corev1.Capability{"NET_ADMIN"}, extra...)
	add := slices.Clone(sc.Capabilities.Add)
	slices.Sort(add)
	slices.Sort(wantAdd)
	if !slices.Equal(add, wantAdd) {
		t.Errorf("%s: capabilities added %v, want exactly %v", name, sc.Capabilities.Add, wantAdd)
	}
	if !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: capabilities dropped %v, want [ALL]", name, sc.Capabilities.Drop)
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Errorf("%s: privileged", name)
	}
	nodeName := false
	for _, e := range c.Env {
		if e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName" {
			nodeName = true
		}
	}
	if !nodeName {
		t.Errorf("%s: no NODE_NAME from fieldRef spec.nodeName", name)
	}
	fromConfig := slices.ContainsFunc(c.EnvFrom, func(e corev1.EnvFromSource) bool {
		return e.ConfigMapRef != nil && m.configMaps[e.ConfigMapRef.Name] != nil
	})
	if !fromConfig {
		t.Errorf("%s: takes no environment from a ConfigMap of the manifest", name)
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if q, ok := c.Resources.Requests[r]; !ok || q.IsZero() {
			t.Errorf("%s: no %s request", name, r)
		}
	}
	port := portOf(t, metricsAddress)
	for _, probe := range []struct {
		kind string
		p    *corev1.Probe
		path string
	}{{"readinessProbe", c.ReadinessProbe, "/readyz"}, {"livenessProbe", c.LivenessProbe, "/healthz"}} {
		if probe.p == nil || probe.p.HTTPGet == nil {
			t.Errorf("%s: no HTTP %s", name, probe.kind)
			continue
		}
		if g := probe.p.HTTPGet; g.Path != probe.path || g.Port.IntValue() != port {
			t.Errorf("%s: %s GET %s on port %s, want %s on %d (the --metrics-address default %q)", name, probe.kind, g.Path, g.Port.String(), probe.path, port, metricsAddress)
		}
	}
	if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.ContainerPort == int32(port) }) {
		t.Errorf("%s: no containerPort %d (metrics)", name, port)
	}
	// make manifest sets the image: its placeholder here names the daemon's
	// own image, and is used as imported (no pull, no :latest).
	if want := image.Ref(image.DefaultRegistry, name, "set-by-make-manifest"); c.Image != want {
		t.Errorf("%s: image %q, want the placeholder %q that make manifest replaces", name, c.Image, want)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("%s: imagePullPolicy %q, want IfNotPresent", name, c.ImagePullPolicy)
	}
	// Sysctls (the router's conntrack ones, the agent's per-device ones)
	// need a writable /proc/sys/net: a runtime mounts its own read-only and
	// (runc) refuses a mount inside /proc, so the node's is mounted
	// elsewhere and named by --proc-sys. Only net/: a writable
	// kernel.core_pattern (all of /proc/sys) is root on the node.
	procSys := ""
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--proc-sys="); ok {
			procSys = v
		}
	}
	mountedAt := ""
	for _, m := range c.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name != m.Name || v.HostPath == nil {
				continue
			}
			switch p := path.Clean(v.HostPath.Path); {
			case p == "/proc/sys/net" && !m.ReadOnly:
				mountedAt = m.MountPath
			case p == "/proc" || p == "/proc/sys" || strings.HasPrefix(p, "/proc/sys/") && p != "/proc/sys/net":
				t.Errorf("%s: the node's %s is mounted at %s: only /proc/sys/net is needed", name, p, m.MountPath)
			}
		}
	}
	switch {
	case mountedAt == "":
		t.Errorf("%s: the node's /proc/sys/net is not mounted (writable) for the sysctls", name)
	case strings.HasPrefix(mountedAt+"/", "/proc/"):
		t.Errorf("%s: the node's /proc/sys/net is mounted at %s, inside /proc: runc refuses that", name, mountedAt)
	case procSys+"/net" != mountedAt:
		t.Errorf("%s: --proc-sys=%q, but the node's /proc/sys/net is mounted at %s", name, procSys, mountedAt)
	}
	if sc := spec.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: the pod's seccompProfile is not RuntimeDefault", name)
	}
	return ds, c
}

// checkKernelModules: SYS_MODULE (loading kernel code: node root) is the
// init container's alone, which runs the daemon's --kernel-check-only in
// its image with /lib/modules read-only and exits; the long-running
// container neither has it nor mounts the modules.
func checkKernelModules(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	for _, c := range spec.Containers {
		if c.SecurityContext != nil && c.SecurityContext.Capabilities != nil && slices.Contains(c.SecurityContext.Capabilities.Add, "SYS_MODULE") {
			t.Errorf("%s: container %s keeps SYS_MODULE: only the init container may load modules", ds.Name, c.Name)
		}
		for _, m := range c.VolumeMounts {
			if m.MountPath == "/lib/modules" {
				t.Errorf("%s: container %s mounts /lib/modules", ds.Name, c.Name)
			}
		}
	}
	if len(spec.InitContainers) != 1 {
		t.Fatalf("%s: %d init containers, want the kernel check's", ds.Name, len(spec.InitContainers))
	}
	ic := spec.InitContainers[0]
	// The daemon skips the check its init container just made.
	if !slices.Contains(spec.Containers[0].Args, "--kernel-check=false") {
		t.Errorf("%s: the daemon's args %v lack --kernel-check=false: it would check the kernel again", ds.Name, spec.Containers[0].Args)
	}
	if ic.Image != spec.Containers[0].Image || !slices.Contains(ic.Args, "--kernel-check-only") {
		t.Errorf("%s: init container %s runs %s %v, want the daemon's image with --kernel-check-only", ds.Name, ic.Name, ic.Image, ic.Args)
	}
	if sc := ic.SecurityContext; sc == nil || sc.Capabilities == nil ||
		!slices.Equal(slices.Sorted(slices.Values(sc.Capabilities.Add)), []corev1.Capability{"NET_ADMIN", "NET_RAW", "SYS_MODULE"}) ||
		!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: init container %s capabilities %+v, want ALL dropped and NET_ADMIN, NET_RAW, SYS_MODULE", ds.Name, ic.Name, ic.SecurityContext)
	}
	modules := false
	for _, m := range ic.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil && v.HostPath.Path == "/lib/modules" && m.MountPath == "/lib/modules" && m.ReadOnly {
				modules = true
			}
		}
	}
	if !modules {
		t.Errorf("%s: init container %s does not mount the node's /lib/modules read-only for modprobe", ds.Name, ic.Name)
	}
	if !slices.ContainsFunc(ic.EnvFrom, func(e corev1.EnvFromSource) bool {
		return e.ConfigMapRef != nil && e.ConfigMapRef.Name == "tunnel-config"
	}) {
		t.Errorf("%s: init container %s does not read tunnel-config: it would check another mode's modules", ds.Name, ic.Name)
	}
}

// hostPathFor returns the host directory mounted in c that holds the host
// path p at the same path, or "".
func hostPathFor(spec corev1.PodSpec, c corev1.Container, p string) string {
	for _, mount := range c.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name != mount.Name || v.HostPath == nil || v.HostPath.Path != mount.MountPath {
				continue
			}
			if rel := strings.TrimPrefix(p, path.Clean(v.HostPath.Path)+"/"); rel != p || p == v.HostPath.Path {
				return v.HostPath.Path
			}
		}
	}
	return ""
}

// TestManifestProperties decodes tunnel-router.yaml into typed objects and
// checks what the deployment relies on, so that an edit that breaks it fails
// here rather than on a cluster.
func TestManifestProperties(t *testing.T) {
	m := decodeManifest(t, repoFile(t, "tunnel-router.yaml"))
	var namespaces []string
	for _, ns := range m.namespaces {
		namespaces = append(namespaces, ns.Name)
	}
	if want := []string{manifestNamespace, routerstatus.DefaultNamespace}; !slices.Equal(namespaces, want) {
		t.Errorf("namespaces %v, want exactly %v", namespaces, want)
	}
	for _, sa := range []string{"tunnel-router", "tunnel-endpoint"} {
		if _, ok := m.serviceAccounts[sa]; !ok {
			t.Errorf("no ServiceAccount %s", sa)
		}
	}

	config := m.configMaps["tunnel-config"]
	if config == nil {
		t.Fatal("no ConfigMap tunnel-config")
	}
	for _, key := range []string{"KST_BUCKETS", "KST_MODE", "KST_POOLS"} {
		if config.Data[key] == "" {
			t.Errorf("ConfigMap tunnel-config has no %s", key)
		}
	}
	// No well-known seed ships: each cluster's first router creates its own
	// in the seed Secret (TestSeedSecretRoutersStartingAtOnceAgree).
	if v, ok := config.Data["KST_SEED"]; ok {
		t.Errorf("ConfigMap tunnel-config ships the seed KST_SEED=%q: every cluster that keeps it shares one public seed", v)
	}
	for _, ds := range m.daemonSets {
		for _, c := range ds.Spec.Template.Spec.Containers {
			for _, e := range c.Env {
				if e.Name == "KST_SEED" {
					t.Errorf("DaemonSet %s sets KST_SEED", ds.Name)
				}
			}
		}
	}
	// Both daemons read this ConfigMap and share tunnel nodes' network
	// namespace: one address for both would make the second fail to start.
	if v, ok := config.Data["KST_METRICS_ADDRESS"]; ok {
		t.Errorf("ConfigMap tunnel-config sets KST_METRICS_ADDRESS=%q for both daemons; set --metrics-address per DaemonSet", v)
	}
	if portOf(t, startup.DefaultMetricsAddress) == portOf(t, endpoint.DefaultMetricsAddress) {
		t.Errorf("router and endpoint agent default to the same metrics port %s", startup.DefaultMetricsAddress)
	}

	routerDS, _ := checkDaemon(t, m, "tunnel-router", startup.DefaultMetricsAddress, "NET_RAW")
	checkKernelModules(t, routerDS)
	if sel := routerDS.Spec.Template.Spec.NodeSelector; len(sel) != 1 || sel["node"] != "tunnel" {
		t.Errorf("tunnel-router nodeSelector %v, want node=tunnel", sel)
	}

	endpointDS, c := checkDaemon(t, m, "tunnel-endpoint", endpoint.DefaultMetricsAddress, "NET_RAW", "SYS_ADMIN", "SYS_PTRACE")
	checkKernelModules(t, endpointDS)
	spec := endpointDS.Spec.Template.Spec
	if !spec.HostPID {
		t.Error("tunnel-endpoint: hostPID is off; the pods' namespaces are opened through their processes")
	}
	if len(spec.NodeSelector) != 0 {
		t.Errorf("tunnel-endpoint nodeSelector %v: the agent must run on every node", spec.NodeSelector)
	}
	// The runtimes' sockets and the named network namespaces, at the paths
	// the agent looks for them (--runtime=auto).
	for _, p := range []string{"/run/containerd/containerd.sock", "/run/crio/crio.sock", "/run/docker.sock", "/run/netns"} {
		if hostPathFor(spec, c, p) == "" {
			t.Errorf("tunnel-endpoint: host path %s is not mounted at the same path", p)
		}
	}
}

// TestManifestServerSideDryRun applies tunnel-router.yaml as admin with
// server-side apply in dry-run mode: a real API server validates every object
// (schema, defaults, RBAC rules) and persists nothing.
func TestManifestServerSideDryRun(t *testing.T) {
	kubeenv.SkipIfUnavailable(t, env)
	ctx := context.Background()
	// A dry run creates no Namespace, so the namespaced objects need the
	// real one (the other tests apply the manifest for real anyway).
	for _, name := range []string{manifestNamespace, routerstatus.DefaultNamespace} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if _, err := adminClient(t).CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	if err := env.ApplyYAML(ctx, env.AdminConfig(), repoFile(t, "tunnel-router.yaml"), true); err != nil {
		t.Fatalf("server-side dry-run apply of tunnel-router.yaml: %v", err)
	}
	// The uninstall DaemonSet, as make manifest renders it.
	uninstall, err := image.RenderManifest(image.Uninstall, image.DefaultRegistry, "v0.0.0-test")
	if err != nil {
		t.Fatal(err)
	}
	if err := env.ApplyYAML(ctx, env.AdminConfig(), uninstall, true); err != nil {
		t.Fatalf("server-side dry-run apply of the uninstall manifest: %v", err)
	}
	// It is rejected when broken, so that the check above can fail.
	broken := bytes.Replace(repoFile(t, "tunnel-router.yaml"), []byte("containerPort: 9642"), []byte("containerPort: 96420"), 1)
	if bytes.Equal(broken, repoFile(t, "tunnel-router.yaml")) {
		t.Fatal("containerPort 9642 not found in tunnel-router.yaml; the negative check proves nothing")
	}
	if err := env.ApplyYAML(ctx, env.AdminConfig(), broken, true); err == nil {
		t.Fatal("the API server accepted a containerPort of 96420")
	}
}

// TestUninstallHasTheDaemonsCapabilities: each cleanup container of the
// uninstall DaemonSet runs its daemon's --cleanup, which changes what the
// daemon changed: it needs the daemon's capabilities but SYS_MODULE (a
// cleanup checks no kernel feature). The agent's cleanup once lacked
// NET_RAW, which iptables-legacy needs, so that the uninstall worked on
// nft nodes only.
func TestUninstallHasTheDaemonsCapabilities(t *testing.T) {
	daemons := decodeManifest(t, repoFile(t, "tunnel-router.yaml"))
	uninstall := decodeManifest(t, image.Uninstall)
	ds := uninstall.daemonSets["tunnel-uninstall"]
	if ds == nil {
		t.Fatal("no DaemonSet tunnel-uninstall in the uninstall manifest")
	}
	for daemon, cleanup := range map[string]string{"tunnel-router": "router-cleanup", "tunnel-endpoint": "endpoint-cleanup"} {
		_, c := daemons.daemonSet(t, daemon)
		want := map[corev1.Capability]bool{}
		for _, cp := range c.SecurityContext.Capabilities.Add {
			if cp != "SYS_MODULE" {
				want[cp] = true
			}
		}
		var found *corev1.Container
		for i := range ds.Spec.Template.Spec.Containers {
			if ds.Spec.Template.Spec.Containers[i].Name == cleanup {
				found = &ds.Spec.Template.Spec.Containers[i]
			}
		}
		if found == nil {
			t.Errorf("the uninstall has no container %s", cleanup)
			continue
		}
		got := map[corev1.Capability]bool{}
		for _, cp := range found.SecurityContext.Capabilities.Add {
			got[cp] = true
		}
		if !maps.Equal(got, want) {
			t.Errorf("uninstall container %s adds capabilities %v; %s's --cleanup needs its daemon's but SYS_MODULE: %v", cleanup, found.SecurityContext.Capabilities.Add, daemon, slices.Sorted(maps.Keys(want)))
		}
	}
}

// TestAgentMountsRunReadOnly: the agent and its uninstall cleanup see the
// node's /run (the runtimes' sockets, /run/netns) read-only, with host to
// container propagation, and only iptables-legacy's lock writable.
func TestAgentMountsRunReadOnly(t *testing.T) {
	daemons := decodeManifest(t, repoFile(t, "tunnel-router.yaml"))
	agentDS, agent := daemons.daemonSet(t, "tunnel-endpoint")
	uninstall := decodeManifest(t, image.Uninstall)
	ds := uninstall.daemonSets["tunnel-uninstall"]
	if ds == nil {
		t.Fatal("no DaemonSet tunnel-uninstall in the uninstall manifest")
	}
	var cleanup corev1.Container
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == "endpoint-cleanup" {
			cleanup = c
		}
	}
	for _, tc := range []struct {
		who  string
		spec corev1.PodSpec
		c    corev1.Container
	}{{"tunnel-endpoint", agentDS.Spec.Template.Spec, agent}, {"the uninstall's endpoint-cleanup", ds.Spec.Template.Spec, cleanup}} {
		hostPaths := map[string]string{}
		for _, v := range tc.spec.Volumes {
			if v.HostPath != nil {
				hostPaths[v.Name] = v.HostPath.Path
			}
		}
		seen := map[string]bool{}
		for _, m := range tc.c.VolumeMounts {
			switch {
			case m.MountPath == "/run":
				seen["/run"] = true
				if !m.ReadOnly || hostPaths[m.Name] != "/run" || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
					t.Errorf("%s: /run mounted from %q, readOnly %v, propagation %v; want the node's /run, read-only, HostToContainer", tc.who, hostPaths[m.Name], m.ReadOnly, m.MountPropagation)
				}
			case m.MountPath == "/run/xtables.lock":
				seen["lock"] = true
				if m.ReadOnly || hostPaths[m.Name] != "/run/xtables.lock" {
					t.Errorf("%s: /run/xtables.lock from %q, readOnly %v; want the node's lock, writable", tc.who, hostPaths[m.Name], m.ReadOnly)
				}
			case strings.HasPrefix(m.MountPath, "/run/") && !m.ReadOnly:
				t.Errorf("%s: %s is mounted writable", tc.who, m.MountPath)
			}
		}
		if !seen["/run"] || !seen["lock"] {
			t.Errorf("%s: mounts %v lack /run (read-only) or /run/xtables.lock", tc.who, tc.c.VolumeMounts)
		}
	}
}
