package datapath

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Families is the datapath of a dual-stack router: one Datapath per address
// family, to which it hands each tunnel IP by its family. It does what the
// router's controller asks of a datapath (Resync, SetTunnel, RemoveTunnel,
// CurrentGeneration, CollectGenerations), plus Ops and Cleanup.
//
// Either family's Datapath may be missing: that family's tunnel IPs are
// then refused with an error wrapping ErrWrongFamily that says so. Each
// family's Datapath reads and writes only its family's kernel state, so
// nothing one does touches the other's.
type Families struct {
	v4, v6 *Datapath
}

// NewFamilies returns the dispatcher over v4, the IPv4 Datapath, and v6,
// the IPv6 one; either may be nil, not both.
func NewFamilies(v4, v6 *Datapath) (*Families, error) {
	switch {
	case v4 == nil && v6 == nil:
		return nil, errors.New("datapath families: neither an IPv4 nor an IPv6 datapath")
	case v4 != nil && v4.Family() != IPv4:
		return nil, fmt.Errorf("datapath families: the IPv4 datapath is configured for %v", v4.Family())
	case v6 != nil && v6.Family() != IPv6:
		return nil, fmt.Errorf("datapath families: the IPv6 datapath is configured for %v", v6.Family())
	}
	return &Families{v4: v4, v6: v6}, nil
}

// Datapath returns family f's Datapath (nil if there is none).
func (fs *Families) Datapath(f Family) *Datapath {
	switch f {
	case IPv4:
		return fs.v4
	case IPv6:
		return fs.v6
	}
	return nil
}

// all returns the Datapaths there are, IPv4's first.
func (fs *Families) all() []*Datapath {
	var dps []*Datapath
	for _, d := range []*Datapath{fs.v4, fs.v6} {
		if d != nil {
			dps = append(dps, d)
		}
	}
	return dps
}

// of returns the Datapath of vip's family, or an error wrapping
// ErrWrongFamily if there is none.
func (fs *Families) of(vip netip.Addr) (*Datapath, error) {
	f, ok := FamilyOf(vip)
	if !ok {
		return nil, fmt.Errorf("tunnel %v: %w: neither an IPv4 nor an IPv6 address", vip, ErrWrongFamily)
	}
	if d := fs.Datapath(f); d != nil {
		return d, nil
	}
	return nil, fmt.Errorf("tunnel %v: %w: no %v datapath is configured (dual-stack is not enabled)", vip, ErrWrongFamily, f)
}

// Serves reports whether vip's family has a Datapath.
func (fs *Families) Serves(vip netip.Addr) bool {
	_, err := fs.of(vip)
	return err == nil
}

// Resync hands each family's Datapath its family's tunnels, the whole
// desired state of that family (none: the family's tunnels are all
// removed). Tunnels of a family without a Datapath are refused, in one
// error naming them; the others are resynced all the same.
func (fs *Families) Resync(tunnels []Tunnel) error {
	byFamily := map[*Datapath][]Tunnel{}
	var refused []string
	var refusal error
	for _, t := range tunnels {
		d, err := fs.of(t.VIP)
		if err != nil {
			refused = append(refused, t.VIP.String())
			refusal = err
			continue
		}
		byFamily[d] = append(byFamily[d], t)
	}
	var errs []error
	if len(refused) == 1 {
		errs = append(errs, refusal)
	} else if len(refused) > 1 {
		errs = append(errs, fmt.Errorf("%d tunnels refused (%s): %w", len(refused), listSome(refused, 5), refusal))
	}
	for _, d := range fs.all() {
		if err := d.Resync(byFamily[d]); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", d.Family(), err))
		}
	}
	return errors.Join(errs...)
}

// listSome joins the first n of items, and counts the rest.
func listSome(items []string, n int) string {
	if len(items) <= n {
		return strings.Join(items, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(items[:n], ", "), len(items)-n)
}

// SetTunnel programs t in the Datapath of its family.
func (fs *Families) SetTunnel(t Tunnel) error {
	d, err := fs.of(t.VIP)
	if err != nil {
		return err
	}
	return d.SetTunnel(t)
}

// RemoveTunnel removes vip from the Datapath of its family. Without one
// there is nothing to remove (SetTunnel refused it): that is no error.
func (fs *Families) RemoveTunnel(vip netip.Addr) error {
	d, err := fs.of(vip)
	if err != nil {
		return nil
	}
	return d.RemoveTunnel(vip)
}

// CurrentGeneration returns the generation new flows to vip use, from the
// Datapath of its family (0 without one).
func (fs *Families) CurrentGeneration(vip netip.Addr) int {
	d, err := fs.of(vip)
	if err != nil {
		return 0
	}
	return d.CurrentGeneration(vip)
}

// CollectGenerations collects the unused older generations of both
// families and returns how many it removed.
func (fs *Families) CollectGenerations() (removed int, err error) {
	var errs []error
	for _, d := range fs.all() {
		n, err := d.CollectGenerations()
		removed += n
		if err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", d.Family(), err))
		}
	}
	return removed, errors.Join(errs...)
}

// Ops returns the kernel write operations of both families so far.
func (fs *Families) Ops() uint64 {
	var n uint64
	for _, d := range fs.all() {
		n += d.Ops()
	}
	return n
}

// Cleanup removes what the router owns in both families (see
// Datapath.Cleanup).
func (fs *Families) Cleanup() error {
	var errs []error
	for _, d := range fs.all() {
		if err := d.Cleanup(); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", d.Family(), err))
		}
	}
	return errors.Join(errs...)
}
