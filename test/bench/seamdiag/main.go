package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

type rec struct {
	mu   sync.Mutex
	seen map[netip.Addr]time.Time
}

func (r *rec) Resync([]datapath.Tunnel) error { return nil }
func (r *rec) SetTunnel(t datapath.Tunnel) error {
	r.mu.Lock()
	r.seen[t.VIP] = time.Now()
	r.mu.Unlock()
	return nil
}
func (r *rec) RemoveTunnel(netip.Addr) error { return nil }

func vipOf(i int) netip.Addr { return netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}) }

func main() {
	n, updates := 2000, 200
	env, err := kubeenv.New()
	if err != nil {
		panic(err)
	}
	defer env.Stop()
	ctx := context.Background()
	m, _ := os.ReadFile("tunnel-router.yaml")
	if err := env.ApplyYAML(ctx, env.AdminConfig(), m, false); err != nil {
		panic(err)
	}
	admin, _ := kubernetes.NewForConfig(env.AdminConfig())
	admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{})
	var wg sync.WaitGroup
	work := make(chan int)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				name := fmt.Sprintf("svc-%d", i)
				svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{tunnelclaim.Annotation: vipOf(i).String()}},
					Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Ports: []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
				if _, err := admin.CoreV1().Services("bench").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
					panic(err)
				}
				es := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: name}}, AddressType: discoveryv1.AddressTypeIPv4}
				for e := range 10 {
					es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{fmt.Sprintf("10.244.%d.%d", e, i%250)}})
				}
				if _, err := admin.DiscoveryV1().EndpointSlices("bench").Create(ctx, es, metav1.CreateOptions{}); err != nil {
					panic(err)
				}
			}
		}()
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	saCfg, err := env.ServiceAccountConfig(ctx, "kube-service-tunnel", "tunnel-router")
	if err != nil {
		panic(err)
	}
	saCfg.QPS, saCfg.Burst = 50, 100
	client, _ := kubernetes.NewForConfig(saCfg)
	factory := informers.NewSharedInformerFactory(client, 0)
	r := &rec{seen: map[netip.Addr]time.Time{}}
	log := logrus.New()
	log.Out = io.Discard
	cfg := router.Config{Config: datapath.DefaultConfig(), ResyncPeriod: 5 * time.Minute,
		Policy: tunnelclaim.Policy{Pools: tunnelclaim.Pools{{Prefix: netip.MustParsePrefix("198.18.0.0/16")}}}}
	cfg.Seed = 7
	ctrl, err := router.NewController(cfg, client, factory, r, router.NewEventRecorder(ctx, client, "tunnel-router", "n"), log)
	if err != nil {
		panic(err)
	}
	var hmu sync.Mutex
	handlerSeen := map[string]time.Time{}
	factory.Discovery().V1().EndpointSlices().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{UpdateFunc: func(_, o any) {
		es := o.(*discoveryv1.EndpointSlice)
		hmu.Lock()
		handlerSeen[es.Name+"/"+es.ResourceVersion] = time.Now()
		hmu.Unlock()
	}})
	factory.Start(ctx.Done())
	go ctrl.Run(ctx)
	for !ctrl.Ready() {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	var write, toHandler, toSeam, handlerToSeam []float64
	for k := range updates {
		i := (k * 7919) % n
		name := fmt.Sprintf("svc-%d", i)
		es, err := admin.DiscoveryV1().EndpointSlices("bench").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			panic(err)
		}
		es.Endpoints[k%10].Addresses = []string{fmt.Sprintf("10.250.%d.%d", k>>8, k&255)}
		r.mu.Lock()
		delete(r.seen, vipOf(i))
		r.mu.Unlock()
		t0 := time.Now()
		up, err := admin.DiscoveryV1().EndpointSlices("bench").Update(ctx, es, metav1.UpdateOptions{})
		if err != nil {
			panic(err)
		}
		t1 := time.Now()
		var t3 time.Time
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Microsecond) {
			r.mu.Lock()
			t3 = r.seen[vipOf(i)]
			r.mu.Unlock()
			if !t3.IsZero() {
				break
			}
		}
		hmu.Lock()
		t2 := handlerSeen[name+"/"+up.ResourceVersion]
		hmu.Unlock()
		ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
		write = append(write, ms(t1.Sub(t0)))
		toHandler = append(toHandler, ms(t2.Sub(t0)))
		toSeam = append(toSeam, ms(t3.Sub(t0)))
		handlerToSeam = append(handlerToSeam, ms(t3.Sub(t2)))
		if os.Getenv("V") != "" {
			fmt.Printf("%d write %.1f handler %.1f seam %.1f\n", k, ms(t1.Sub(t0)), ms(t2.Sub(t0)), ms(t3.Sub(t0)))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, s := range []struct {
		name string
		v    []float64
	}{{"update call", write}, {"to informer handler", toHandler}, {"to seam", toSeam}, {"handler to seam", handlerToSeam}} {
		sort.Float64s(s.v)
		p := func(q float64) float64 { return s.v[int(q*float64(len(s.v)-1))] }
		fmt.Printf("%-20s p50 %.1f p90 %.1f p99 %.1f max %.1f ms\n", s.name, p(.5), p(.9), p(.99), s.v[len(s.v)-1])
	}
}
