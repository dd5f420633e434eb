package datapath

import (
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/cmdnu/kube-service-tunnel/test/support/seamtest"
)

// fakeLinks is a link table for the device seam.
type fakeLinks struct {
	links   map[string]netlink.Link
	added   []netlink.Link
	deleted []string
}

func (f *fakeLinks) LinkByName(name string) (netlink.Link, error) {
	if l, ok := f.links[name]; ok {
		return l, nil
	}
	return nil, netlink.LinkNotFoundError{}
}

func (f *fakeLinks) LinkAdd(l netlink.Link) error {
	l.Attrs().Index = 10 + len(f.links)
	f.links[l.Attrs().Name] = l
	f.added = append(f.added, l)
	return nil
}

func (f *fakeLinks) LinkSetAlias(l netlink.Link, alias string) error {
	l.Attrs().Alias = alias
	return nil
}

func (f *fakeLinks) LinkSetUp(l netlink.Link) error {
	l.Attrs().Flags |= 1
	l.Attrs().RawFlags |= 1
	return nil
}

func (f *fakeLinks) LinkDel(l netlink.Link) error {
	delete(f.links, l.Attrs().Name)
	f.deleted = append(f.deleted, l.Attrs().Name)
	return nil
}

func TestGREDeviceCreatesOwnsAndRemoves(t *testing.T) {
	links := &fakeLinks{links: map[string]netlink.Link{}}
	dev := &GREDevice{Name: "kst-gre", Links: links}
	idx, err := dev.Ensure()
	if err != nil {
		t.Fatal(err)
	}
	gre, ok := links.links["kst-gre"].(*netlink.Gretun)
	// The kind asked of the kernel must be IPv4 GRE: "ip6gre" needs another
	// module and fails where only ip_gre is loaded.
	if !ok || !gre.FlowBased || gre.Type() != "gre" || gre.Alias != DeviceAlias || idx != gre.Index || gre.Flags&1 == 0 {
		t.Fatalf("created %+v (index %d), want a flow-based GRE device with our alias, up", links.links["kst-gre"], idx)
	}
	// A restart adopts it without creating another.
	if _, err := (&GREDevice{Name: "kst-gre", Links: links}).Ensure(); err != nil || len(links.added) != 1 {
		t.Fatalf("adoption: err %v, %d devices added", err, len(links.added))
	}
	if err := dev.Remove(); err != nil || len(links.deleted) != 1 {
		t.Fatalf("remove: err %v, deleted %v", err, links.deleted)
	}
}

func TestGREDeviceNeverTouchesAForeignDevice(t *testing.T) {
	for name, link := range map[string]netlink.Link{
		"not ours":       &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: "kst-gre"}, FlowBased: true},
		"not flow-based": &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: "kst-gre", Alias: DeviceAlias}},
		"not gre":        &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kst-gre", Alias: "someone"}},
	} {
		links := &fakeLinks{links: map[string]netlink.Link{"kst-gre": link}}
		dev := &GREDevice{Name: "kst-gre", Links: links}
		if _, err := dev.Ensure(); err == nil || !strings.Contains(err.Error(), "choose another --gre-device") {
			t.Errorf("%s: Ensure = %v, want a refusal", name, err)
		}
		if link.Attrs().Alias != DeviceAlias {
			if err := dev.Remove(); err != nil || len(links.deleted) != 0 {
				t.Errorf("%s: Remove deleted %v (err %v)", name, links.deleted, err)
			}
		}
		if len(links.added) != 0 {
			t.Errorf("%s: a device was added", name)
		}
	}
}

// TestGRE6DeviceIsIP6GRE: the IPv6 datapath's device is a flow-based
// ip6gre device (outer IPv6); it adopts its own and refuses an IPv4 gre
// device of the router's that has its name, and the other way round.
func TestGRE6DeviceIsIP6GRE(t *testing.T) {
	links := &fakeLinks{links: map[string]netlink.Link{}}
	dev := &GREDevice{Name: "kst-gre6", Family: IPv6, Links: links}
	idx, err := dev.Ensure()
	if err != nil {
		t.Fatal(err)
	}
	gre, ok := links.links["kst-gre6"].(*netlink.Gretun)
	if !ok || !gre.FlowBased || gre.Type() != "ip6gre" || gre.Alias != DeviceAlias || idx != gre.Index {
		t.Fatalf("created %+v, want a flow-based ip6gre device with our alias", links.links["kst-gre6"])
	}
	if _, err := (&GREDevice{Name: "kst-gre6", Family: IPv6, Links: links}).Ensure(); err != nil || len(links.added) != 1 {
		t.Fatalf("adoption: err %v, %d devices added", err, len(links.added))
	}
	// The kernel lists a gre device's local address in 4 bytes, an
	// ip6gre device's in 16.
	v4 := &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: "kst-gre", Alias: DeviceAlias}, FlowBased: true, Local: net.IP{0, 0, 0, 0}}
	v6 := &netlink.Gretun{LinkAttrs: netlink.LinkAttrs{Name: "kst-gre6", Alias: DeviceAlias}, FlowBased: true, Local: net.IPv6zero}
	links = &fakeLinks{links: map[string]netlink.Link{"kst-gre": v4, "kst-gre6": v6}}
	for _, tc := range []struct {
		dev *GREDevice
		ok  bool
	}{
		{&GREDevice{Name: "kst-gre", Links: links}, true},
		{&GREDevice{Name: "kst-gre6", Family: IPv6, Links: links}, true},
		{&GREDevice{Name: "kst-gre", Family: IPv6, Links: links}, false},
		{&GREDevice{Name: "kst-gre6", Links: links}, false},
	} {
		if _, err := tc.dev.Ensure(); (err == nil) != tc.ok {
			t.Errorf("%s device %s: Ensure = %v, want ok=%v", tc.dev.kind(), tc.dev.Name, err, tc.ok)
		}
	}
	if len(links.added) != 0 {
		t.Errorf("devices added: %v", links.added)
	}
}

// A family without tunnel IPs neither needs nor creates its device: an
// IPv4-only cluster's IPv6 datapath resyncs without kst-gre6 (or, with
// --gre-device-create=false, without the operator's IPv6 device); the
// first tunnel IP needs it, and names it when it is missing.
func TestResyncNeedsTheDeviceOnlyForTunnels(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	k := seamtest.NewKernel()
	links := &fakeLinks{links: map[string]netlink.Link{}}
	dp := NewDatapath(cfg, k, k, k.Chain(), &ExistingDevice{Name: "kst-gre6", Links: links}, func(netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
	if err := dp.Resync(nil); err != nil {
		t.Fatalf("resync without tunnel IPs needed the device: %v", err)
	}
	err := dp.Resync([]Tunnel{tunnel6(cfg, "2001:db8:2::1", "fd00:10:244:1::5")})
	if err == nil || !strings.Contains(err.Error(), "kst-gre6") {
		t.Fatalf("resync of a tunnel IP without its device = %v, want an error naming kst-gre6", err)
	}
	created := &GREDevice{Name: "kst-gre6", Family: IPv6, Links: links}
	dp = NewDatapath(cfg, k, k, k.Chain(), created, func(netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
	if err := dp.Resync(nil); err != nil || len(links.added) != 0 {
		t.Fatalf("resync without tunnel IPs: %v, created %v", err, links.added)
	}
	if err := dp.Resync([]Tunnel{tunnel6(cfg, "2001:db8:2::1", "fd00:10:244:1::5")}); err != nil || len(links.added) != 1 {
		t.Fatalf("resync of a tunnel IP: %v, created %v; want the device created once", err, links.added)
	}
}

// TestDeviceGoesWithTheLastTunnelIP: the router's own GRE device is
// removed with the family's last tunnel IP (by RemoveTunnel, or by a
// resync that wants none, as at start-up after the last one went while
// the router was down), and made again for the next one.
func TestDeviceGoesWithTheLastTunnelIP(t *testing.T) {
	cfg := testConfig().ForFamily(IPv6)
	k := seamtest.NewKernel()
	links := &fakeLinks{links: map[string]netlink.Link{}}
	dev := &GREDevice{Name: "kst-gre6", Family: IPv6, Links: links}
	dp := NewDatapath(cfg, k, k, k.Chain(), dev, func(netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
	one, two := tunnel6(cfg, "2001:db8:2::1", "fd00:10:244:1::5"), tunnel6(cfg, "2001:db8:2::2", "fd00:10:244:1::6")
	if err := dp.Resync([]Tunnel{one, two}); err != nil {
		t.Fatal(err)
	}
	if err := dp.RemoveTunnel(one.VIP); err != nil || len(links.deleted) != 0 {
		t.Fatalf("removing one of two tunnel IPs: %v, deleted %v; want the device kept", err, links.deleted)
	}
	if err := dp.RemoveTunnel(two.VIP); err != nil || len(links.deleted) != 1 || links.links["kst-gre6"] != nil {
		t.Fatalf("removing the last tunnel IP: %v, deleted %v; want the device deleted", err, links.deleted)
	}
	if err := dp.SetTunnel(one); err != nil || len(links.added) != 2 {
		t.Fatalf("the next tunnel IP: %v, created %v; want the device created again", err, links.added)
	}
	// A new router finds the device and no tunnel IP wanted.
	dp = NewDatapath(cfg, k, k, k.Chain(), dev, func(netip.Addr) (int, error) { return 7, nil }, seamtest.QuietLog())
	if err := dp.Resync([]Tunnel{one}); err != nil {
		t.Fatal(err)
	}
	if err := dp.Resync(nil); err != nil || links.links["kst-gre6"] != nil {
		t.Fatalf("a resync wanting no tunnel IP: %v, links %v; want the device deleted", err, links.links)
	}
}
