package livepolicy

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
)

func pools(t *testing.T, s string) tunnelclaim.Pools {
	t.Helper()
	p, err := tunnelclaim.ParsePools(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestParse(t *testing.T) {
	base := tunnelclaim.Policy{Pools: pools(t, "192.0.2.0/24")}
	got, err := Parse(map[string]string{"KST_POOLS": "203.0.113.0/24=team-a", "KST_SERVICE_CIDR": "10.96.0.0/12"}, base, nil)
	if err != nil || got.Pools.String() != "203.0.113.0/24=team-a" || len(got.ServiceCIDRs) != 1 {
		t.Errorf("Parse = %+v, %v", got, err)
	}
	// A flag given on the command line is not read from the ConfigMap.
	got, err = Parse(map[string]string{"KST_POOLS": "203.0.113.0/24"}, base, map[string]bool{"pools": true})
	if err != nil || got.Pools.String() != "192.0.2.0/24" {
		t.Errorf("Parse with --pools on the command line = %+v, %v", got, err)
	}
	// A key removed from the ConfigMap clears its setting.
	if got, err = Parse(map[string]string{}, base, nil); err != nil || len(got.Pools) != 0 {
		t.Errorf("Parse without KST_POOLS = %+v, %v; want no pool", got, err)
	}
	if _, err = Parse(map[string]string{"KST_POOLS": "192.0.2.0/33"}, base, nil); err == nil || !strings.Contains(err.Error(), "KST_POOLS") {
		t.Errorf("Parse of a bad pool: %v; want an error naming the key", err)
	}
}

// Watch applies each change of the ConfigMap once, and keeps the previous
// policy when the new value is refused.
func TestWatch(t *testing.T) {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "kst", Name: "tunnel-config"}, Data: map[string]string{"KST_POOLS": "192.0.2.0/24"}}
	client := fake.NewClientset(cm)
	p := New(tunnelclaim.Policy{Pools: pools(t, "192.0.2.0/24")})
	changes := make(chan tunnelclaim.Policy, 10)
	factory, err := Watch(client, Ref{"kst", "tunnel-config"}, p, nil, func(next tunnelclaim.Policy) { changes <- next }, logrus.New())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	defer cancel() // before Shutdown, which waits for the informer to stop
	factory.WaitForCacheSync(ctx.Done())
	update := func(pools string) {
		cm.Data["KST_POOLS"] = pools
		cm.ResourceVersion = ""
		if _, err := client.CoreV1().ConfigMaps("kst").Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	update("192.0.2.0/24;203.0.113.0/24")
	select {
	case next := <-changes:
		if next.Pools.String() != "192.0.2.0/24;203.0.113.0/24" || p.Get().Pools.String() != next.Pools.String() {
			t.Errorf("change %s, policy %s", next.Pools, p.Get().Pools)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no change seen")
	}
	update("not a pool")
	update("192.0.2.0/24;203.0.113.0/24") // the same as before the bad value: no change
	time.Sleep(500 * time.Millisecond)
	select {
	case next := <-changes:
		t.Errorf("a refused value, then the same policy again, changed it to %s", next.Pools)
	default:
	}
	if got := p.Get().Pools.String(); got != "192.0.2.0/24;203.0.113.0/24" {
		t.Errorf("policy %s after a refused value", got)
	}
}
