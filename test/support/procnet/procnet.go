// Package procnet parses the kernel's /proc/net/tcp and tcp6, for tests
// that report which sockets of a network namespace hold a flow, in what
// TCP state (request sockets of a listener included, as SYN_RECV, which
// sock_diag dumps leave out unless asked).
package procnet

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netns"

	"github.com/cmdnu/kube-service-tunnel/internal/nsexec"
)

// TCPSocket is one line of /proc/net/tcp.
type TCPSocket struct {
	Local, Remote netip.AddrPort
	// Established is the TCP_ESTABLISHED state.
	Established bool
	// State is the kernel's TCP state (/proc/net/tcp's st, named), and
	// TxQueue and RxQueue the bytes in its queues, for failure reports.
	State            string
	TxQueue, RxQueue uint64
}

// tcpStates name /proc/net/tcp's st column (include/net/tcp_states.h).
var tcpStates = map[string]string{
	"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
	"06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
	"0C": "NEW_SYN_RECV",
}

// ParseTCP reads /proc/net/tcp or tcp6: "sl local_address
// rem_address st ...", an address being the hex of its in-memory (network
// order) bytes read as host-order (little-endian) 32-bit words, and a hex
// port. IPv4-mapped IPv6 addresses are returned as IPv4.
func ParseTCP(text string) ([]TCPSocket, error) {
	var socks []TCPSocket
	for i, line := range strings.Split(strings.TrimSpace(text), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) < 4 {
			continue
		}
		local, err1 := parseHexAddrPort(f[1])
		remote, err2 := parseHexAddrPort(f[2])
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("/proc/net/tcp line %q: %w", line, err)
		}
		sock := TCPSocket{Local: local, Remote: remote, Established: f[3] == "01", State: tcpStates[f[3]]}
		if sock.State == "" {
			sock.State = "st " + f[3]
		}
		if len(f) > 4 {
			tx, rx, _ := strings.Cut(f[4], ":")
			sock.TxQueue, _ = strconv.ParseUint(tx, 16, 64)
			sock.RxQueue, _ = strconv.ParseUint(rx, 16, 64)
		}
		socks = append(socks, sock)
	}
	return socks, nil
}

func parseHexAddrPort(s string) (netip.AddrPort, error) {
	addrHex, portHex, ok := strings.Cut(s, ":")
	b, err := hex.DecodeString(addrHex)
	if !ok || err != nil || (len(b) != 4 && len(b) != 16) {
		return netip.AddrPort{}, fmt.Errorf("address %q", s)
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("port %q", s)
	}
	for i := 0; i < len(b); i += 4 {
		binary.BigEndian.PutUint32(b[i:], binary.LittleEndian.Uint32(b[i:]))
	}
	ip, _ := netip.AddrFromSlice(b)
	return netip.AddrPortFrom(ip.Unmap(), uint16(port)), nil
}

// TCPIn reads the TCP sockets of network namespace ns, IPv4 and IPv6, from
// a thread inside it.
func TCPIn(ns netns.NsHandle) ([]TCPSocket, error) {
	var socks []TCPSocket
	err := nsexec.Do(ns, func() error {
		for _, file := range []string{"tcp", "tcp6"} {
			b, err := os.ReadFile("/proc/thread-self/net/" + file)
			if err != nil {
				return err
			}
			s, err := ParseTCP(string(b))
			if err != nil {
				return err
			}
			socks = append(socks, s...)
		}
		return nil
	})
	return socks, err
}

// CountersIn reads the TCP counters of network namespace ns: /proc/net/snmp's
// "Tcp" line (OutRsts, RetransSegs, ...) and /proc/net/netstat's "TcpExt"
// (ListenOverflows, ListenDrops, TCPAbortOnData, ...), by name.
func CountersIn(ns netns.NsHandle) (map[string]uint64, error) {
	out := map[string]uint64{}
	err := nsexec.Do(ns, func() error {
		for _, file := range []string{"snmp", "netstat"} {
			b, err := os.ReadFile("/proc/thread-self/net/" + file)
			if err != nil {
				return err
			}
			if err := parseCounters(string(b), out); err != nil {
				return fmt.Errorf("/proc/net/%s: %w", file, err)
			}
		}
		return nil
	})
	return out, err
}

// parseCounters adds the Tcp and TcpExt counters of /proc/net/snmp or
// netstat to out: each group is a line of names ("TcpExt: SyncookiesSent
// ...") followed by a line of values.
func parseCounters(text string, out map[string]uint64) error {
	lines := strings.Split(strings.TrimSpace(text), "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) != len(values) || len(names) == 0 || names[0] != values[0] {
			return fmt.Errorf("lines %q and %q do not pair", lines[i], lines[i+1])
		}
		if names[0] != "Tcp:" && names[0] != "TcpExt:" {
			continue
		}
		for j := 1; j < len(names); j++ {
			v, err := strconv.ParseInt(values[j], 10, 64)
			if err != nil {
				return fmt.Errorf("%s %s: %w", names[0], names[j], err)
			}
			out[names[j]] = uint64(v)
		}
	}
	return nil
}
