package integration

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/encap"
	"github.com/cmdnu/kube-service-tunnel/internal/livepolicy"
	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/internal/tunnelctl"
	"github.com/cmdnu/kube-service-tunnel/router"
)

var seedRef = seedsecret.Ref{Namespace: seedsecret.DefaultNamespace, Name: seedsecret.DefaultName}

// Routers starting at once in a cluster without a seed agree on one random
// seed, through the manifest's RBAC; that RBAC lets them read no other
// Secret, and the endpoint agent not even this one.
func TestSeedSecretRoutersStartingAtOnceAgree(t *testing.T) {
	routerRest := routerConfig(t)
	admin := adminClient(t)
	ctx := context.Background()
	secrets := admin.CoreV1().Secrets(seedRef.Namespace)
	if err := secrets.Delete(ctx, seedRef.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	const routers = 4
	seeds := make([]uint32, routers)
	sources := make([]seedsecret.Source, routers)
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := range routers {
		client, err := kubernetes.NewForConfig(routerRest)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			start.Wait()
			var err error
			seeds[i], sources[i], err = seedsecret.Ensure(ctx, client, seedRef, 30*time.Second)
			if err != nil {
				t.Errorf("router %d: %v", i, err)
			}
		})
	}
	start.Done()
	wg.Wait()
	created := 0
	for i := range routers {
		if seeds[i] != seeds[0] {
			t.Errorf("router %d chose seed %#x, router 0 %#x", i, seeds[i], seeds[0])
		}
		if sources[i] == seedsecret.Created {
			created++
		}
	}
	if created != 1 {
		t.Errorf("%d routers created the Secret (sources %v), want 1", created, sources)
	}
	stored, err := seedsecret.Read(ctx, admin, seedRef)
	if err != nil || stored != seeds[0] {
		t.Errorf("the Secret holds %#x (%v); the routers use %#x", stored, err, seeds[0])
	}
	t.Logf("%d routers started at once; one created the seed Secret, all use seed fingerprint %s", routers, hmark.SeedFingerprint(seeds[0]))

	// The router's RBAC reaches this Secret only.
	other := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: seedRef.Namespace, Name: "not-the-seed"}, StringData: map[string]string{"x": "y"}}
	if _, err := secrets.Create(ctx, other, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	routerClient, _ := kubernetes.NewForConfig(routerRest)
	if _, err := routerClient.CoreV1().Secrets(seedRef.Namespace).Get(ctx, "not-the-seed", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the router read another Secret: %v", err)
	}
	agentClient, _ := kubernetes.NewForConfig(serviceAccountConfig(t, "tunnel-endpoint"))
	if _, err := seedsecret.Read(ctx, agentClient, seedRef); !apierrors.IsForbidden(errors.Unwrap(err)) {
		t.Errorf("the endpoint agent read the seed: %v", err)
	}
}

// Two routers, each running the controller with a status publisher as the
// tunnel-router ServiceAccount, publish what they programmed; kubectl
// tunnel's status, reading as an operator, shows both with the current
// table, and one that falls behind as outdated.
func TestRouterStatusShowsWhatEachRouterProgrammed(t *testing.T) {
	routerRest := routerConfig(t)
	admin := adminClient(t)
	ns := freshNamespace(t, admin)
	vip := "192.0.2.171"
	nodes := []string{ns + "-router-a", ns + "-router-b"}
	cfg := routerCfg(encap.GRE, 16)
	var stops []func()
	for _, node := range nodes {
		client, err := kubernetes.NewForConfig(routerRest)
		if err != nil {
			t.Fatal(err)
		}
		_, stop := startController(t, client, cfg, node, newRecorder(), nil, func(ctrl *router.Controller) []func(context.Context) {
			pub := routerstatus.NewPublisher(client, routerstatus.DefaultNamespace, routerstatus.Router{Node: node, Mode: cfg.Mode, Buckets: cfg.Buckets, Generations: 1, MarkOffset: cfg.MarkOffset, TableBase: cfg.TableBase}, "", nil, quietLogger())
			ctrl.SetStatusPublisher(pub)
			return []func(context.Context){pub.Run}
		})
		stops = append(stops, stop)
		// No pod owns the status ConfigMap here.
		t.Cleanup(func() {
			_ = admin.CoreV1().ConfigMaps(routerstatus.DefaultNamespace).Delete(context.Background(), routerstatus.Name(node), metav1.DeleteOptions{})
		})
	}
	createService(t, admin, ns, "web", vip)
	deleteAtCleanup(t, admin, ns, "web")
	applySlice(t, admin, ns, "web", "web-1", ep{addr: "10.244.1.5", node: "n1"}, ep{addr: "10.244.2.5", node: "n2"})

	status := func() (tunnelctl.TunnelStatus, error) {
		inv, err := tunnelctl.Load(context.Background(), admin, seedRef.Namespace, routerstatus.DefaultNamespace)
		if err != nil {
			return tunnelctl.TunnelStatus{}, err
		}
		rep, err := inv.Status(context.Background(), tunnelctl.StatusFilter{Target: vip})
		if err != nil {
			return tunnelctl.TunnelStatus{}, err
		}
		if len(rep.Tunnels) != 1 {
			return tunnelctl.TunnelStatus{}, fmt.Errorf("%d tunnels", len(rep.Tunnels))
		}
		return rep.Tunnels[0], nil
	}
	routerTable := func(ts tunnelctl.TunnelStatus) map[string]string {
		out := map[string]string{}
		for _, r := range ts.Routers {
			out[r.Router] = r.Table
		}
		return out
	}
	eventually(t, 30*time.Second, "both routers published the current table", func() error {
		ts, err := status()
		if err != nil {
			return err
		}
		if got := routerTable(ts); got[nodes[0]] != "current" || got[nodes[1]] != "current" || len(ts.Endpoints) != 2 {
			return fmt.Errorf("routers %v, %d endpoints", got, len(ts.Endpoints))
		}
		return nil
	})

	// router-b stops; a third endpoint changes the table: router-a
	// publishes it, router-b's status shows the table it had.
	stops[1]()
	applySlice(t, admin, ns, "web", "web-1", ep{addr: "10.244.1.5", node: "n1"}, ep{addr: "10.244.2.5", node: "n2"}, ep{addr: "10.244.3.5", node: "n3"})
	eventually(t, 30*time.Second, "router-a current, the stopped router-b outdated", func() error {
		ts, err := status()
		if err != nil {
			return err
		}
		if got := routerTable(ts); got[nodes[0]] != "current" || got[nodes[1]] != "outdated" {
			return fmt.Errorf("routers %v", got)
		}
		return nil
	})
}

// Two routers on the real API server, each with its events behind the
// Lease: a change gives one Event, recorded by the router holding the
// Lease; when that router stops (releasing it), the other records the next
// change, once.
func TestOneEventPerChangeNotPerRouter(t *testing.T) {
	routerRest := routerConfig(t)
	admin := adminClient(t)
	ns := freshNamespace(t, admin)
	type running struct {
		node string
		gate *router.EventGate
		stop func()
	}
	var routers []*running
	for _, node := range []string{ns + "-router-a", ns + "-router-b"} {
		client, err := kubernetes.NewForConfig(routerRest)
		if err != nil {
			t.Fatal(err)
		}
		gate := router.NewEventGate(quietLogger())
		gate.LeaseDuration, gate.RenewDeadline, gate.RetryPeriod = 4*time.Second, 3*time.Second, 500*time.Millisecond
		_, stop := startController(t, client, routerCfg(encap.GRE, 8), node, newRecorder(), gate.Recorder, func(ctrl *router.Controller) []func(context.Context) {
			return []func(context.Context){func(ctx context.Context) { gate.Run(ctx, client, routerstatus.DefaultNamespace, node, ctrl.Ready) }}
		})
		routers = append(routers, &running{node: node, gate: gate, stop: stop})
	}
	leader := func() *running {
		var held []*running
		for _, r := range routers {
			if r.gate.Leader() {
				held = append(held, r)
			}
		}
		if len(held) != 1 {
			return nil
		}
		return held[0]
	}
	var first *running
	eventually(t, 30*time.Second, "one router holding the events Lease", func() error {
		if first = leader(); first == nil {
			return fmt.Errorf("no single leader")
		}
		return nil
	})
	events := func(svc string) ([]corev1.Event, error) {
		list, err := admin.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + svc})
		if err != nil {
			return nil, err
		}
		var out []corev1.Event
		for _, e := range list.Items {
			if e.Reason == router.ReasonInvalidTunnelIP {
				out = append(out, e)
			}
		}
		return out, nil
	}
	// Both routers see the bad annotation; one Event, from the leader.
	oneEvent := func(svc string, from *running) {
		t.Helper()
		createService(t, admin, ns, svc, "not-an-ip")
		deleteAtCleanup(t, admin, ns, svc)
		eventually(t, 20*time.Second, "the InvalidTunnelIP event of "+svc, func() error {
			evs, err := events(svc)
			if err != nil || len(evs) == 0 {
				return fmt.Errorf("no event yet (%v)", err)
			}
			return nil
		})
		time.Sleep(3 * time.Second) // the other router's copy, if any, would be there by now
		evs, err := events(svc)
		if err != nil {
			t.Fatal(err)
		}
		if len(evs) != 1 || evs[0].Count != 1 || evs[0].Source.Host != from.node {
			var got []string
			for _, e := range evs {
				got = append(got, fmt.Sprintf("%s x%d", e.Source.Host, e.Count))
			}
			t.Errorf("events of %s: %v; want one, once, from %s", svc, got, from.node)
		}
	}
	oneEvent("bad-1", first)

	// The leader stops and releases the Lease: the other router records.
	first.stop() // returns once its gate released the Lease
	var second *running
	eventually(t, 20*time.Second, "the other router holding the Lease", func() error {
		if second = leader(); second == nil || second == first {
			return fmt.Errorf("no new leader")
		}
		return nil
	})
	oneEvent("bad-2", second)
	t.Logf("events recorded once, by %s, then by %s after it stopped", first.node, second.node)
}

// A change of KST_POOLS in the daemons' ConfigMap, watched with the
// manifest's RBAC, applies without a restart: a tunnel IP the new pools no
// longer admit is withdrawn with a TunnelIPRefused Warning, one they newly
// admit is served, and an unaffected one keeps its table untouched.
func TestPoolChangeAppliesWithoutRestart(t *testing.T) {
	routerRest := routerConfig(t)
	admin := adminClient(t)
	ctx := context.Background()
	cms := admin.CoreV1().ConfigMaps(seedRef.Namespace)
	orig, err := cms.Get(ctx, tunnelctl.ConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cur, err := cms.Get(context.Background(), tunnelctl.ConfigMapName, metav1.GetOptions{})
		if err == nil {
			cur.Data = orig.Data
			_, err = cms.Update(context.Background(), cur, metav1.UpdateOptions{})
		}
		if err != nil {
			t.Errorf("restoring the ConfigMap: %v", err)
		}
	})
	setPools := func(pools string) {
		t.Helper()
		cur, err := cms.Get(ctx, tunnelctl.ConfigMapName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cur.Data["KST_POOLS"] = pools
		if _, err := cms.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setPools("192.0.2.0/24")

	ns := freshNamespace(t, admin)
	keep, drop, add := "192.0.2.81", "192.0.2.201", "203.0.113.181"
	for name, ip := range map[string]string{"keep": keep, "drop": drop, "add": add} {
		createService(t, admin, ns, name, ip)
		deleteAtCleanup(t, admin, ns, name)
		applySlice(t, admin, ns, name, name+"-1", ep{addr: "10.244.1.5", node: "n1"}, ep{addr: "10.244.2.5", node: "n2"})
	}

	client, err := kubernetes.NewForConfig(routerRest)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := routerCfg(encap.GRE, 8)
	cfg.Policy = tunnelclaim.Policy{Pools: mustPools(t, "192.0.2.0/24")}
	configMap := livepolicy.Ref{Namespace: seedRef.Namespace, Name: tunnelctl.ConfigMapName}
	startController(t, client, cfg, ns+"-router", rec, nil, func(ctrl *router.Controller) []func(context.Context) {
		return []func(context.Context){func(ctx context.Context) {
			stop, err := livepolicy.Start(ctx, client, configMap, ctrl, nil, quietLogger())
			if err != nil {
				t.Error(err)
				return
			}
			<-ctx.Done()
			stop()
		}}
	})
	// The endpoint agent watches the same ConfigMap with its own RBAC.
	agentClient, err := kubernetes.NewForConfig(serviceAccountConfig(t, "tunnel-endpoint"))
	if err != nil {
		t.Fatal(err)
	}
	agentPolicy := livepolicy.New(cfg.Policy)
	agentWatch, err := livepolicy.Watch(agentClient, configMap, agentPolicy, nil, func(tunnelclaim.Policy) {}, quietLogger())
	if err != nil {
		t.Fatal(err)
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	agentWatch.Start(watchCtx.Done())
	t.Cleanup(func() { stopWatch(); agentWatch.Shutdown() })
	waitTable(t, rec, keep, 8, addrs("10.244.1.5", "10.244.2.5"))
	waitTable(t, rec, drop, 8, addrs("10.244.1.5", "10.244.2.5"))
	if _, ok := rec.get(add); ok {
		t.Fatalf("%s served before its pool exists", add)
	}
	keepBefore, _ := rec.get(keep)

	setPools("192.0.2.0/25;203.0.113.0/24")
	waitTable(t, rec, add, 8, addrs("10.244.1.5", "10.244.2.5"))
	waitRemoved(t, rec, drop, "the new pools no longer admit it")
	dropSvc, err := admin.CoreV1().Services(ns).Get(ctx, "drop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitEvent(t, admin, dropSvc, corev1.EventTypeWarning, router.ReasonRefused, "no address pool")
	eventually(t, 10*time.Second, "the endpoint agent's policy following the ConfigMap", func() error {
		if got := agentPolicy.Get().Pools.String(); got != "192.0.2.0/25;203.0.113.0/24" {
			return fmt.Errorf("agent pools %s", got)
		}
		return nil
	})
	keepAfter, _ := rec.get(keep)
	// The datapath is handed the same table, so it writes nothing for it
	// (a resync of an unchanged table is write-free: see router/datapath).
	if fmt.Sprint(tableAddrs(keepAfter)) != fmt.Sprint(tableAddrs(keepBefore)) {
		t.Errorf("%s, in both the old and the new pools, changed table: %v -> %v", keep, tableAddrs(keepBefore), tableAddrs(keepAfter))
	}
	t.Logf("pools changed in the ConfigMap: %s withdrawn with a Warning, %s served, %s untouched; no restart", drop, add, keep)
}

func mustPools(t *testing.T, s string) tunnelclaim.Pools {
	t.Helper()
	p, err := tunnelclaim.ParsePools(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// deleteAtCleanup deletes the Services names of ns when the test ends, so
// that their tunnel IPs take no part in the tests after it (namespaces are
// never deleted here: see freshNamespace).
func deleteAtCleanup(t *testing.T, cs kubernetes.Interface, ns string, names ...string) {
	t.Cleanup(func() {
		for _, name := range names {
			if err := cs.CoreV1().Services(ns).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("deleting Service %s/%s: %v", ns, name, err)
			}
		}
	})
}
