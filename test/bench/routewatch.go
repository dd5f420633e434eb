package main

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/internal/rtnl"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// rtaNHID is RTA_NH_ID: the nexthop object a route uses.
const rtaNHID = 30

// routeWatch follows, from rtnetlink notifications, where each route of
// some tunnel IPs in the router's tables sends its packets: the pod of its
// IP encapsulation, inline or through a nexthop object, whichever the
// router programs. It reports when a tunnel IP's routes of one generation
// all lead to the pods of a wanted bucket table.
type routeWatch struct {
	cfg datapath.Config
	fd  int

	mu       sync.Mutex
	routes   map[netip.Addr]map[int]route // tunnel IP -> slot -> route
	nexthops map[uint32]netip.Addr        // nexthop object -> its pod
	want     netip.Addr                   // the tunnel IP waited for
	table    []netip.Addr                 // its wanted pods, per bucket
	done     chan time.Time               // receives when it has them
	err      error
}

type route struct {
	pod   netip.Addr // inline encapsulation
	nexth uint32     // or nexthop object
}

// watchRoutes subscribes to route and nexthop notifications in the calling
// thread's namespace, then reads the current routes of vips in the router's
// tables with client (so that nothing between the read and the
// subscription is missed).
func watchRoutes(cfg datapath.Config, client *rtnl.Client, vips []netip.Addr) (*routeWatch, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 64<<20)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	for _, g := range []int{unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_NEXTHOP} {
		if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, g); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("joining rtnetlink group %d: %w", g, err)
		}
	}
	w := &routeWatch{cfg: cfg, fd: fd, routes: map[netip.Addr]map[int]route{}, nexthops: map[uint32]netip.Addr{}}
	for _, v := range vips {
		w.routes[v] = map[int]route{}
	}
	all, err := client.List(rtnl.ListFilter{Tables: rtnl.TableRange{First: uint32(cfg.Table(0)), Last: uint32(cfg.Table(cfg.Slots() - 1))}})
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	nhs, err := client.ListNextHops(0)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	w.mu.Lock()
	for _, n := range nhs {
		if n.IPEncap != nil {
			w.nexthops[n.ID] = n.IPEncap.Dst
		}
	}
	for _, r := range all {
		rt := route{nexth: r.NextHopID}
		if r.IPEncap != nil {
			rt.pod = r.IPEncap.Dst
		}
		w.set(r.Dst, int(r.Table), rt, true)
	}
	w.mu.Unlock()
	go w.read()
	return w, nil
}

func (w *routeWatch) close() { unix.Close(w.fd) }

// set records a route (add) or its removal; call with mu held.
func (w *routeWatch) set(dst netip.Prefix, table int, r route, add bool) {
	slots, ok := w.routes[dst.Addr()]
	if !ok || dst.Bits() != 32 {
		return
	}
	slot := table - w.cfg.Table(0)
	if slot < 0 || slot >= w.cfg.Slots() {
		return
	}
	if add {
		slots[slot] = r
	} else {
		delete(slots, slot)
	}
}

// expect sets the bucket table to wait for; the returned channel receives
// the time of the notification that completed it.
func (w *routeWatch) expect(vip netip.Addr, table []netip.Addr) <-chan time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.want, w.table, w.done = vip, table, make(chan time.Time, 1)
	w.check(time.Now())
	return w.done
}

// check reports the wanted table once one generation holds it; call with
// mu held.
func (w *routeWatch) check(now time.Time) {
	if w.done == nil {
		return
	}
	slots := w.routes[w.want]
	for g := 0; g < w.cfg.Generations; g++ {
		ok := true
		for b, pod := range w.table {
			r, have := slots[w.cfg.Slot(g, b)]
			p := r.pod
			if r.nexth != 0 {
				p = w.nexthops[r.nexth]
			}
			if !have || p != pod {
				ok = false
				break
			}
		}
		if ok {
			w.done <- now
			w.done = nil
			return
		}
	}
}

func (w *routeWatch) read() {
	buf := make([]byte, 1<<20)
	for {
		n, _, err := unix.Recvfrom(w.fd, buf, 0)
		now := time.Now()
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			w.mu.Lock()
			if err != unix.EBADF {
				w.err = fmt.Errorf("reading route notifications: %w", err)
			}
			w.mu.Unlock()
			return
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			continue
		}
		w.mu.Lock()
		for _, m := range msgs {
			w.apply(m)
		}
		w.check(now)
		w.mu.Unlock()
	}
}

// apply decodes one notification; call with mu held.
func (w *routeWatch) apply(m syscall.NetlinkMessage) {
	switch m.Header.Type {
	case unix.RTM_NEWROUTE, unix.RTM_DELROUTE:
		if len(m.Data) < unix.SizeofRtMsg || m.Data[0] != unix.AF_INET {
			return
		}
		bits, table := int(m.Data[1]), uint32(m.Data[4])
		var dst netip.Addr
		var r route
		for _, a := range attrs(m.Data[unix.SizeofRtMsg:]) {
			switch a.typ {
			case unix.RTA_DST:
				dst, _ = netip.AddrFromSlice(a.val)
			case unix.RTA_TABLE:
				if len(a.val) == 4 {
					table = binary.NativeEndian.Uint32(a.val)
				}
			case unix.RTA_ENCAP:
				var e rtnl.IPEncap
				if e.Decode(a.val) == nil {
					r.pod = e.Dst
				}
			case rtaNHID:
				if len(a.val) == 4 {
					r.nexth = binary.NativeEndian.Uint32(a.val)
				}
			}
		}
		if dst.IsValid() {
			w.set(netip.PrefixFrom(dst, bits), int(table), r, m.Header.Type == unix.RTM_NEWROUTE)
		}
	case unix.RTM_NEWNEXTHOP, unix.RTM_DELNEXTHOP:
		const sizeofNhmsg = 8
		if len(m.Data) < sizeofNhmsg {
			return
		}
		var id uint32
		var pod netip.Addr
		for _, a := range attrs(m.Data[sizeofNhmsg:]) {
			switch a.typ {
			case unix.NHA_ID:
				if len(a.val) == 4 {
					id = binary.NativeEndian.Uint32(a.val)
				}
			case unix.NHA_ENCAP:
				var e rtnl.IPEncap
				if e.Decode(a.val) == nil {
					pod = e.Dst
				}
			}
		}
		if m.Header.Type == unix.RTM_DELNEXTHOP {
			delete(w.nexthops, id)
		} else {
			w.nexthops[id] = pod
		}
	}
}

type attr struct {
	typ uint16
	val []byte
}

// attrs splits netlink attributes (the nested flag masked off).
func attrs(b []byte) []attr {
	var out []attr
	for len(b) >= unix.SizeofRtAttr {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		if l < unix.SizeofRtAttr || l > len(b) {
			break
		}
		out = append(out, attr{typ: binary.NativeEndian.Uint16(b[2:4]) & 0x3fff, val: b[unix.SizeofRtAttr:l]})
		b = b[min(len(b), (l+3)&^3):]
	}
	return out
}
