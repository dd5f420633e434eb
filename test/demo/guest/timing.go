package main

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/cmdnu/kube-service-tunnel/test/lab/topology"
)

// changeTiming splits the time from an EndpointSlice write until the lab
// sees both routers' new bucket tables into its parts, each observed where
// it happens: the API request, the watch event (a watch of the demo's own,
// over the same API server path as the routers' informers), each router's
// first and last route change for the tunnel IP (netlink route
// notifications in its namespace, so no polling), and the lab's own
// polling check.
type changeTiming struct {
	mu                      sync.Mutex
	written, requestStarted time.Time
	watched                 time.Time
	first, last             map[string]time.Time // per router
	cancel                  context.CancelFunc
	wg                      sync.WaitGroup
}

// watchChange starts watching the EndpointSlice sliceName and the bucket
// routes of vip on every router. Call it before the write.
func watchChange(ctx context.Context, l *topology.Lab, sliceName string, vip netip.Addr) (*changeTiming, error) {
	ctx, cancel := context.WithCancel(ctx)
	ct := &changeTiming{first: map[string]time.Time{}, last: map[string]time.Time{}, cancel: cancel}
	sliceClient := l.Kube.DiscoveryV1().EndpointSlices(l.Opts.Namespace)
	current, err := sliceClient.Get(ctx, sliceName, metav1.GetOptions{})
	if err != nil {
		cancel()
		return nil, err
	}
	w, err := sliceClient.Watch(ctx, metav1.ListOptions{
		FieldSelector:   fields.OneTermEqualSelector("metadata.name", sliceName).String(),
		ResourceVersion: current.ResourceVersion,
	})
	if err != nil {
		cancel()
		return nil, err
	}
	ct.wg.Add(1)
	go func() {
		defer ct.wg.Done()
		defer w.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.ResultChan():
				if !ok {
					return
				}
				if ev.Type == watch.Modified {
					ct.mu.Lock()
					if ct.watched.IsZero() {
						ct.watched = time.Now()
					}
					ct.mu.Unlock()
				}
			}
		}
	}()
	for _, r := range l.Routers {
		h, err := netns.GetFromName(r.Name)
		if err != nil {
			cancel()
			return nil, err
		}
		updates := make(chan netlink.RouteUpdate, 1024)
		err = netlink.RouteSubscribeWithOptions(updates, ctx.Done(), netlink.RouteSubscribeOptions{Namespace: &h})
		h.Close()
		if err != nil {
			cancel()
			return nil, fmt.Errorf("route notifications of %s: %w", r.Name, err)
		}
		ct.wg.Add(1)
		go func(router string) {
			defer ct.wg.Done()
			for u := range updates {
				if u.Dst == nil || !u.Dst.IP.Equal(vip.AsSlice()) || u.Table < 256 {
					continue
				}
				now := time.Now()
				ct.mu.Lock()
				if ct.first[router].IsZero() {
					ct.first[router] = now
				}
				ct.last[router] = now
				ct.mu.Unlock()
			}
		}(r.Name)
	}
	return ct, nil
}

// request records when the write's API request started and returned.
func (ct *changeTiming) request(started, returned time.Time) {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	ct.requestStarted, ct.written = started, returned
}

// report stops watching and describes the parts, each as the time since
// the write's request was sent; seen is when the lab's polling saw the
// change in every router.
func (ct *changeTiming) report(seen time.Time) string {
	ct.cancel()
	ct.wg.Wait()
	since := func(t time.Time) string { return t.Sub(ct.requestStarted).Round(time.Millisecond).String() }
	var b strings.Builder
	fmt.Fprintf(&b, "counted from the EndpointSlice write being sent: the API server answered at %s", since(ct.written))
	if ct.watched.IsZero() {
		b.WriteString("; a watch of the demo's own saw no change")
	} else {
		fmt.Fprintf(&b, "; a watch of the demo's own (the routers' path to the API server) saw the change at %s", since(ct.watched))
	}
	for _, r := range slices.Sorted(maps.Keys(ct.first)) {
		fmt.Fprintf(&b, "; %s wrote the new bucket routes from %s to %s", r, since(ct.first[r]), since(ct.last[r]))
	}
	fmt.Fprintf(&b, "; the lab's own polling (every 200 ms it reads both routers' routes, chains and sets and every pod's addresses, under TCG) confirmed it at %s", since(seen))
	return b.String()
}
