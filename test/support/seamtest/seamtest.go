// Package seamtest has stand-ins for the tunnel router datapath's kernel
// seams (routes, rules, the HMARK chain, the tunnel device) for unit tests,
// and wrappers that count the writes reaching a real kernel, for tests that
// compare them with what the datapath and its metrics report.
package seamtest

import (
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"syscall"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
)

// Kernel stands in for rtnetlink, the rule table, the HMARK chain and the
// device. It records the order of route, nexthop and mark changes per
// tunnel IP. Like the kernel, it refuses a route that names a missing
// nexthop object, and deleting a nexthop object deletes its routes.
type Kernel struct {
	Routes   map[rtnl.RouteKey]rtnl.Route
	NextHops map[uint32]rtnl.NextHop
	Rules    []netlink.Rule
	Marked   map[netip.Addr]uint32 // HMARK offset per tunnel IP
	Affinity map[netip.Addr]bool   // tunnel IPs hashed on the client's address alone
	Writes   int
	Journal  []string
	DevUp    bool
}

// NewKernel returns an empty Kernel.
func NewKernel() *Kernel {
	return &Kernel{Routes: map[rtnl.RouteKey]rtnl.Route{}, NextHops: map[uint32]rtnl.NextHop{}}
}

func (k *Kernel) Walk(f rtnl.ListFilter, reset func(), visit func(rtnl.Route) error) error {
	reset()
	for _, r := range k.Routes {
		if r.Table >= f.Tables.First && r.Table <= f.Tables.Last && (f.Protocol == 0 || r.Protocol == f.Protocol) {
			if err := visit(r); err != nil {
				return err
			}
		}
	}
	return nil
}

func (k *Kernel) ListNextHops(protocol uint8) ([]rtnl.NextHop, error) {
	var out []rtnl.NextHop
	for _, n := range k.NextHops {
		if protocol == 0 || n.Protocol == protocol {
			out = append(out, n)
		}
	}
	return out, nil
}

// Apply applies ops in order; like rtnl.Client, a failing op does not stop
// the others, and the failures come back as an *rtnl.ApplyError. Writes
// counts every op sent.
func (k *Kernel) Apply(ops []rtnl.Op) error {
	ae := &rtnl.ApplyError{}
	for i, op := range ops {
		k.Writes++
		if err := k.apply(op); err != nil {
			ae.Failed = append(ae.Failed, &rtnl.OpError{Index: i, Op: op, Err: err})
		}
	}
	if len(ae.Failed) > 0 {
		return ae
	}
	return nil
}

func (k *Kernel) apply(op rtnl.Op) error {
	switch op.Kind {
	case rtnl.Replace:
		if id := op.Route.NextHopID; id != 0 {
			if _, ok := k.NextHops[id]; !ok {
				return fmt.Errorf("nexthop id %d does not exist: %w", id, syscall.EINVAL)
			}
		}
		k.Routes[op.Route.Key()] = op.Route
		k.Journal = append(k.Journal, "route+ "+op.Route.Dst.Addr().String())
	case rtnl.Delete:
		if r, ok := k.Routes[op.Route.Key()]; ok && r.Protocol == op.Route.Protocol {
			delete(k.Routes, op.Route.Key())
		}
		k.Journal = append(k.Journal, "route- "+op.Route.Dst.Addr().String())
	case rtnl.AddNextHop:
		if _, ok := k.NextHops[op.NextHop.ID]; ok {
			return syscall.EEXIST
		}
		k.NextHops[op.NextHop.ID] = op.NextHop
		k.Journal = append(k.Journal, fmt.Sprintf("nexthop+ %d", op.NextHop.ID))
	case rtnl.ReplaceNextHop:
		k.NextHops[op.NextHop.ID] = op.NextHop
		k.Journal = append(k.Journal, fmt.Sprintf("nexthop~ %d", op.NextHop.ID))
	case rtnl.DeleteNextHop:
		k.DeleteNextHop(op.NextHop.ID)
		k.Journal = append(k.Journal, fmt.Sprintf("nexthop- %d", op.NextHop.ID))
	}
	return nil
}

// DeleteNextHop deletes nexthop object id and, as the kernel does, every
// route that uses it. It is not counted as a write (drift is made with it).
func (k *Kernel) DeleteNextHop(id uint32) {
	delete(k.NextHops, id)
	for key, r := range k.Routes {
		if r.NextHopID == id {
			delete(k.Routes, key)
		}
	}
}

func (k *Kernel) RuleListFiltered(int, *netlink.Rule, uint64) ([]netlink.Rule, error) {
	return slices.Clone(k.Rules), nil
}

func (k *Kernel) RuleAdd(r *netlink.Rule) error {
	k.Writes++
	k.Rules = append(k.Rules, *r)
	return nil
}

func (k *Kernel) RuleDel(r *netlink.Rule) error {
	k.Writes++
	for i := range k.Rules {
		if k.Rules[i].Priority == r.Priority && k.Rules[i].Table == r.Table && k.Rules[i].Mark == r.Mark {
			k.Rules = slices.Delete(k.Rules, i, i+1)
			return nil
		}
	}
	return fmt.Errorf("no such rule")
}

// Chain is the HMARK chain seam of a Kernel: it records the marked tunnel IPs.
type Chain struct{ k *Kernel }

// Chain returns the HMARK chain seam backed by k.
func (k *Kernel) Chain() Chain { return Chain{k} }

func (c Chain) Sync(targets []hmark.Target) (int, error) {
	want := map[netip.Addr]uint32{}
	affinity := map[netip.Addr]bool{}
	for _, t := range targets {
		want[t.VIP] = t.Offset
		if t.ClientAffinity {
			affinity[t.VIP] = true
		}
	}
	if maps.Equal(want, c.k.Marked) && maps.Equal(affinity, c.k.Affinity) {
		return 0, nil
	}
	for _, t := range targets {
		if off, ok := c.k.Marked[t.VIP]; !ok {
			c.k.Journal = append(c.k.Journal, "mark+ "+t.VIP.String())
		} else if off != t.Offset || c.k.Affinity[t.VIP] != t.ClientAffinity {
			c.k.Journal = append(c.k.Journal, "mark~ "+t.VIP.String())
		}
	}
	c.k.Affinity = affinity
	for v := range c.k.Marked {
		if _, ok := want[v]; !ok {
			c.k.Journal = append(c.k.Journal, "mark- "+v.String())
		}
	}
	c.k.Marked = want
	c.k.Writes++
	return 1, nil
}

// Update is Sync: the fake reads nothing either way.
func (c Chain) Update(targets []hmark.Target) (int, error) { return c.Sync(targets) }

func (c Chain) Offsets() (map[netip.Addr]uint32, error) { return maps.Clone(c.k.Marked), nil }

func (c Chain) Cleanup() error { c.k.Marked = nil; return nil }

// Device is the tunnel device seam of a Kernel: its index is always 42.
type Device struct{ k *Kernel }

// Device returns the tunnel device seam backed by k.
func (k *Kernel) Device() Device { return Device{k} }

func (d Device) Ensure() (int, error) { d.k.DevUp = true; return 42, nil }
func (d Device) Remove() error        { d.k.DevUp = false; return nil }

// CountingRoutes and CountingRules count kernel Writes independently of what
// the Datapath reports.
type CountingRoutes struct {
	*rtnl.Client
	Writes int
}

func (c *CountingRoutes) Apply(ops []rtnl.Op) error { c.Writes += len(ops); return c.Client.Apply(ops) }

type CountingRules struct {
	*netlink.Handle
	Writes int
}

func (c *CountingRules) RuleAdd(r *netlink.Rule) error { c.Writes++; return c.Handle.RuleAdd(r) }
func (c *CountingRules) RuleDel(r *netlink.Rule) error { c.Writes++; return c.Handle.RuleDel(r) }

// QuietLog returns a logger that writes nowhere.
func QuietLog() logrus.FieldLogger {
	l := logrus.New()
	l.Out = io.Discard
	return l
}
