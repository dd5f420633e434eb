package router

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
)

// oneEndpoint6 is a Service's IPv6 EndpointSlice with one endpoint.
func oneEndpoint6(ns, svc, addr string) *discoveryv1.EndpointSlice {
	es := oneEndpoint(ns, svc, addr)
	es.Name, es.AddressType = svc+"-6", discoveryv1.AddressTypeIPv6
	return es
}

// A dual-stack Service is served both tunnel IPs, each carried to the
// endpoints of its own family, and each family is judged, reported and
// withdrawn on its own.
func TestControllerServesEachFamilyOnItsOwn(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24;2001:db8::/64")
	tc.add(t,
		tunnelSvc("web", "dual", "192.0.2.10, 2001:db8::10", time.Hour),
		oneEndpoint("web", "dual", "10.244.1.5"), oneEndpoint6("web", "dual", "fd00:244:1::5"),
		// An IPv6 tunnel IP on a Service with IPv4 endpoints only.
		tunnelSvc("web", "v4only", "2001:db8::11", time.Hour), oneEndpoint("web", "v4only", "10.244.1.6"),
		// The IPv6 address is refused (outside the pools); the IPv4 one is served.
		tunnelSvc("web", "half", "192.0.2.12, 2001:db8:1::12", time.Hour), oneEndpoint("web", "half", "10.244.1.7"),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5 192.0.2.12>10.244.1.7 2001:db8::10>fd00:244:1::5 2001:db8::11>-"; got != want {
		t.Fatalf("served %q, want %q", got, want)
	}
	events := tc.drain()
	for _, want := range []string{
		"Normal TunnelProgrammed tunnel IP 192.0.2.10 programmed",
		"Normal TunnelProgrammed tunnel IP 2001:db8::10 programmed",
		"Warning NoReadyEndpoints tunnel IP 2001:db8::11 has no ready endpoint: the Service has no EndpointSlice of addressType IPv6",
		"Warning TunnelIPRefused tunnel IP 2001:db8:1::12 is in no address pool",
		"Normal TunnelProgrammed tunnel IP 192.0.2.12 programmed",
	} {
		if !hasEvent(events, want) {
			t.Errorf("no event %q in %q", want, events)
		}
	}
	if got := tc.refused["web/half"]; !slices.Equal(got, []string{"refused"}) {
		t.Errorf("refused reasons of web/half = %q, want one policy refusal", got)
	}
	// Two families' events on one Service do not undo each other's
	// deduplication: a resync repeats none.
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if again := tc.drain(); len(again) != 0 {
		t.Errorf("resync recorded %q again", again)
	}

	// Dropping the IPv6 address from the annotation withdraws it alone.
	svc := tunnelSvc("web", "dual", "192.0.2.10", time.Hour)
	svc.ObjectMeta.ResourceVersion = "2"
	tc.add(t, svc)
	if err := tc.syncService("web/dual"); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5 192.0.2.12>10.244.1.7 2001:db8::11>-"; got != want {
		t.Fatalf("after dropping the IPv6 address: served %q, want %q", got, want)
	}
	if got := tc.claims["web/dual"]; len(got) != 1 || !got[0].Is4() {
		t.Errorf("claims of web/dual = %v, want its IPv4 tunnel IP alone", got)
	}
	if _, ok := tc.byVIP[netip.MustParseAddr("2001:db8::10")]; ok {
		t.Error("the dropped IPv6 tunnel IP still has a claimant")
	}
}

// A conflict on a dual-stack Service's IPv6 tunnel IP leaves its IPv4 one
// served, and the loser gets the IPv6 one when the winner releases it.
func TestControllerConflictOnOneFamilyOnly(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24;2001:db8::/64")
	tc.add(t,
		tunnelSvc("web", "old", "2001:db8::10", 2*time.Hour), oneEndpoint6("web", "old", "fd00:244:1::5"),
		tunnelSvc("web", "new", "192.0.2.10,2001:db8::10", time.Hour),
		oneEndpoint("web", "new", "10.244.1.6"), oneEndpoint6("web", "new", "fd00:244:1::6"),
	)
	if err := tc.resync(); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.6 2001:db8::10>fd00:244:1::5"; got != want {
		t.Fatalf("served %q, want %q", got, want)
	}
	if events := tc.drain(); !hasEvent(events, "Warning TunnelIPConflict tunnel IP 2001:db8::10 is already served for Service web/old") {
		t.Errorf("no conflict event in %q", events)
	}
	if err := tc.inf.Core().V1().Services().Informer().GetIndexer().Delete(tunnelSvc("web", "old", "", 0)); err != nil {
		t.Fatal(err)
	}
	if err := tc.syncService("web/old"); err != nil {
		t.Fatal(err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.6 2001:db8::10>fd00:244:1::6"; got != want {
		t.Fatalf("after the winner left: served %q, want %q", got, want)
	}
}

// A router without an IPv6 datapath (--ipv6=false) serves the IPv4 tunnel
// IPs and tells the Services once why their IPv6 one is not served; its
// resyncs and syncs do not fail over it.
func TestControllerWithoutIPv6ServesIPv4(t *testing.T) {
	tc := newTestController(t, "192.0.2.0/24;2001:db8::/64")
	tc.dp.ipv4Only = true
	tc.add(t,
		tunnelSvc("web", "dual", "192.0.2.10, 2001:db8::10", time.Hour),
		oneEndpoint("web", "dual", "10.244.1.5"), oneEndpoint6("web", "dual", "fd00:244:1::5"),
	)
	if err := tc.resync(); err != nil {
		t.Fatalf("resync failed over the unserved family: %v", err)
	}
	if got, want := tc.dp.served(), "192.0.2.10>10.244.1.5"; got != want {
		t.Fatalf("served %q, want %q", got, want)
	}
	want := "Warning TunnelProgramFailed tunnel IP 2001:db8::10 is not served: this router runs without IPv6 (--ipv6=false)"
	if events := tc.drain(); !hasEvent(events, want) {
		t.Errorf("no event %q in %q", want, events)
	}
	if err := tc.syncService("web/dual"); err != nil {
		t.Fatalf("sync failed over the unserved family: %v", err)
	}
	if again := tc.drain(); len(again) != 0 {
		t.Errorf("the sync repeated %q", again)
	}
}
