package topology

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ConntrackEvent is one conntrack event of a namespace, as ctnetlink
// multicasts it: a new entry, a change of one (TCP state, mark, status),
// or its end.
type ConntrackEvent struct {
	At time.Time
	// Kind is "new", "update" or "destroy".
	Kind  string
	Entry ConntrackEntry
	// PortID is the netlink port of the process whose request caused the
	// event (conntrackd injecting an entry), 0 for the kernel's own (a
	// packet, a timeout).
	PortID uint32
}

func (ev ConntrackEvent) String() string {
	by := ""
	if ev.PortID != 0 {
		by = fmt.Sprintf(" (by netlink port %d)", ev.PortID)
	}
	return fmt.Sprintf("%s %-7s %s%s", ev.At.UTC().Format("15:04:05.000"), ev.Kind, ev.Entry, by)
}

// ConntrackRecorder keeps the TCP conntrack events of one namespace, the
// last maxRecorded of them, so that a failure report can tell what
// happened to a flow, and when, on every host it crossed: which pod's
// kernel saw its SYN, which its ACK, which router entry carried what
// mark, and who deleted it.
type ConntrackRecorder struct {
	conn *netlink.Conn
	done chan struct{}

	mu     sync.Mutex
	events []ConntrackEvent
	lost   int
	err    error
}

const maxRecorded = 200_000

// RecordConntrack starts recording the TCP conntrack events of namespace
// ns (both families), until Close.
func RecordConntrack(ns netns.NsHandle) (*ConntrackRecorder, error) {
	groups := uint32(1<<(unix.NFNLGRP_CONNTRACK_NEW-1) | 1<<(unix.NFNLGRP_CONNTRACK_UPDATE-1) | 1<<(unix.NFNLGRP_CONNTRACK_DESTROY-1))
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(ns), Groups: groups})
	if err != nil {
		return nil, fmt.Errorf("conntrack events: %w", err)
	}
	if err := conn.SetReadBuffer(8 << 20); err != nil {
		conn.Close()
		return nil, fmt.Errorf("conntrack events: read buffer: %w", err)
	}
	r := &ConntrackRecorder{conn: conn, done: make(chan struct{})}
	go r.run()
	return r, nil
}

func (r *ConntrackRecorder) run() {
	defer close(r.done)
	for {
		msgs, err := r.conn.Receive()
		at := time.Now()
		if err != nil {
			if errors.Is(err, unix.ENOBUFS) {
				r.mu.Lock()
				r.lost++
				r.mu.Unlock()
				continue
			}
			r.mu.Lock()
			r.err = err
			r.mu.Unlock()
			return
		}
		var evs []ConntrackEvent
		for _, m := range msgs {
			if len(m.Data) < 4 {
				continue
			}
			e, err := decodeConntrack(m.Data[4:])
			if err != nil || e.Proto != "tcp" {
				continue
			}
			kind := "update"
			switch {
			case int(m.Header.Type)&0xff == nl.IPCTNL_MSG_CT_DELETE:
				kind = "destroy"
			case m.Header.Flags&netlink.Create != 0:
				kind = "new"
			}
			evs = append(evs, ConntrackEvent{At: at, Kind: kind, Entry: e, PortID: m.Header.PID})
		}
		r.mu.Lock()
		r.events = append(r.events, evs...)
		if n := len(r.events); n > maxRecorded {
			r.events = slices.Delete(r.events, 0, n-maxRecorded)
		}
		r.mu.Unlock()
	}
}

// Of returns the recorded events of the TCP flow from client:port to vip
// (an entry of either direction), oldest first, and a note when events
// were lost (the socket's buffer overran) or the recording stopped.
func (r *ConntrackRecorder) Of(client netip.Addr, port uint16, vip netip.Addr) ([]ConntrackEvent, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ConntrackEvent
	for _, ev := range r.events {
		e := ev.Entry
		if (e.Src == client && e.SrcPort == port && e.Dst == vip) || (e.Src == vip && e.Dst == client && e.DstPort == port) {
			out = append(out, ev)
		}
	}
	var note string
	if r.lost > 0 {
		note = fmt.Sprintf("%d overruns lost events", r.lost)
	}
	if r.err != nil {
		note += fmt.Sprintf(" recording stopped: %v", r.err)
	}
	return out, note
}

// Close stops the recording.
func (r *ConntrackRecorder) Close() {
	r.conn.Close()
	<-r.done
}
