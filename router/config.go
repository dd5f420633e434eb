package router

import (
	"errors"
	"fmt"
	"time"
)

// Mode selects how a tunnel router encapsulates packets towards endpoints.
type Mode string

const (
	// ModeGRE encapsulates in GRE through one flow-based GRE device, with the
	// pod IP as the outer destination.
	ModeGRE Mode = "gre"
	// ModeMPLS pushes a per-endpoint label (see internal/mplslabel) and sends the
	// packet to the endpoint's node, which swaps it towards the pod.
	ModeMPLS Mode = "mpls"
)

// Defaults. They stay clear of kube-proxy's marks (0x4000 masquerade, 0x8000
// drop), Calico's mark bits (0xffff0000 by default), Cilium's magic marks
// (0x0f00 bits), the kernel's reserved tables (0, 253-255) and the default rule
// priorities (0, 32766, 32767).
const (
	DefaultBuckets       = 64
	DefaultMarkOffset    = 0x1000
	DefaultRulePriority  = 7600
	DefaultTableBase     = 7600
	DefaultRouteProtocol = 0xf5 // 245: shown as "proto 245" by iproute2
	DefaultGREDevice     = "kst-gre"
	DefaultResyncPeriod  = 5 * time.Minute
	// MaxBuckets bounds the table count; each bucket costs one rule and one table.
	MaxBuckets = 1024
)

// foreignMarkBits are mark bits owned by kube-proxy and Calico. A bucket mark
// must not set any of them, since HMARK overwrites the whole packet mark.
const foreignMarkBits = 0x4000 | 0x8000 | 0xffff0000

// Config is the router configuration every tunnel router must share, plus the
// node-local ranges it owns. Everything the router creates is identified by
// these ranges; nothing outside them is ever touched.
type Config struct {
	Mode Mode
	// Buckets is the number of HMARK buckets (--hmark-mod), one rule and one
	// routing table each.
	Buckets int
	// MarkOffset is the mark of bucket 0 (--hmark-offset); bucket i has mark MarkOffset+i.
	MarkOffset uint32
	// Seed is the HMARK seed (--hmark-rnd). All routers must share it.
	Seed uint32
	// RulePriority is the priority of bucket 0's policy rule; bucket i uses RulePriority+i.
	RulePriority int
	// TableBase is bucket 0's routing table; bucket i uses TableBase+i.
	TableBase int
	// RouteProtocol marks the routes the router installs.
	RouteProtocol uint8
	// GREDevice is the name of the flow-based GRE device (gre mode).
	GREDevice string
	// Chain is the iptables chain in the mangle table that holds the HMARK rules.
	Chain string
	// ResyncPeriod is how often the whole kernel state is compared with the
	// desired state and repaired.
	ResyncPeriod time.Duration
}

// Validate checks the configuration and names the first bad field.
func (c Config) Validate() error {
	var errs []error
	if c.Mode != ModeGRE && c.Mode != ModeMPLS {
		errs = append(errs, fmt.Errorf("mode %q: must be %q or %q", c.Mode, ModeGRE, ModeMPLS))
	}
	if c.Buckets < 1 || c.Buckets > MaxBuckets {
		errs = append(errs, fmt.Errorf("buckets %d: must be between 1 and %d", c.Buckets, MaxBuckets))
	}
	if c.MarkOffset == 0 {
		errs = append(errs, errors.New("mark offset 0: mark 0 means unmarked, choose a non-zero offset"))
	}
	if c.Buckets >= 1 && c.Buckets <= MaxBuckets {
		for b := 0; b < c.Buckets; b++ {
			if m := uint64(c.MarkOffset) + uint64(b); m > 0xffffffff || uint32(m)&foreignMarkBits != 0 {
				errs = append(errs, fmt.Errorf("mark offset %#x with %d buckets: mark %#x sets bits of kube-proxy (0x4000, 0x8000) or Calico (0xffff0000)", c.MarkOffset, c.Buckets, m))
				break
			}
		}
		lastTable := c.TableBase + c.Buckets - 1
		if c.TableBase < 1 || lastTable >= 1<<31 || (c.TableBase <= 255 && lastTable >= 253) {
			errs = append(errs, fmt.Errorf("tables %d-%d: must avoid 0 and the kernel's tables 253-255", c.TableBase, lastTable))
		}
		lastPrio := c.RulePriority + c.Buckets - 1
		if c.RulePriority < 1 || lastPrio >= 32766 {
			errs = append(errs, fmt.Errorf("rule priorities %d-%d: must be between 1 and 32765 (0, 32766 and 32767 hold the kernel's default rules)", c.RulePriority, lastPrio))
		}
	}
	if c.Mode == ModeGRE && (c.GREDevice == "" || len(c.GREDevice) > 15) {
		errs = append(errs, fmt.Errorf("gre device %q: must be 1-15 characters", c.GREDevice))
	}
	if c.Mode == ModeGRE && (c.GREDevice == "gre0" || c.GREDevice == "gretap0") {
		errs = append(errs, fmt.Errorf("gre device %q: the kernel's fallback device cannot be flow-based", c.GREDevice))
	}
	if c.Chain == "" || len(c.Chain) > 28 {
		errs = append(errs, fmt.Errorf("chain %q: must be 1-28 characters", c.Chain))
	}
	if c.RouteProtocol < 5 {
		errs = append(errs, fmt.Errorf("route protocol %d: 0-4 are the kernel's own", c.RouteProtocol))
	}
	return errors.Join(errs...)
}

// Table is bucket b's routing table.
func (c Config) Table(b int) int { return c.TableBase + b }

// Mark is the packet mark HMARK gives bucket b.
func (c Config) Mark(b int) uint32 { return c.MarkOffset + uint32(b) }

// Priority is bucket b's policy rule priority.
func (c Config) Priority(b int) int { return c.RulePriority + b }

// ownsTable reports whether table t is one of the router's bucket tables.
func (c Config) ownsTable(t int) bool { return t >= c.TableBase && t < c.TableBase+c.Buckets }
