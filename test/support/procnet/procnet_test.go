package procnet

import (
	"net/netip"
	"testing"

	"github.com/vishvananda/netns"
)

func TestParseTCP(t *testing.T) {
	const text = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:0007 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0A0200C0:0007 0A6433C6:D431 01 00000020:00000003 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1
`
	socks, err := ParseTCP(text)
	if err != nil {
		t.Fatal(err)
	}
	want := []TCPSocket{
		{Local: netip.MustParseAddrPort("0.0.0.0:7"), Remote: netip.MustParseAddrPort("0.0.0.0:0"), State: "LISTEN"},
		{Local: netip.MustParseAddrPort("192.0.2.10:7"), Remote: netip.MustParseAddrPort("198.51.100.10:54321"), Established: true, State: "ESTABLISHED", TxQueue: 0x20, RxQueue: 0x3},
	}
	if len(socks) != len(want) {
		t.Fatalf("got %v, want %v", socks, want)
	}
	for i := range want {
		if socks[i] != want[i] {
			t.Errorf("socket %d: got %+v, want %+v", i, socks[i], want[i])
		}
	}
	// tcp6: a server on :: and its IPv4 client, IPv4-mapped.
	socks, err = ParseTCP(`  sl  local_address                         remote_address                        st
   0: 0000000000000000FFFF00000A0200C0:0007 0000000000000000FFFF00000A6433C6:D431 01 00000020:00000003
`)
	if err != nil || len(socks) != 1 || socks[0] != want[1] {
		t.Errorf("tcp6: got %+v, %v; want %+v", socks, err, want[1])
	}
	if _, err := ParseTCP("header\n 0: 0A00:0007 00000000:0000 0A\n"); err == nil {
		t.Error("a 2-byte address parsed")
	}
}

func TestParseCounters(t *testing.T) {
	out := map[string]uint64{}
	err := parseCounters(`Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm MaxConn OutRsts
Tcp: 1 -1 7
`, out)
	if err != nil || out["OutRsts"] != 7 || out["MaxConn"] != 1<<64-1 || out["Forwarding"] != 0 {
		t.Errorf("Tcp: got %v, %v; want OutRsts 7, MaxConn -1 as uint64, no Ip counters", out, err)
	}
	if err := parseCounters("TcpExt: ListenOverflows ListenDrops\nTcpExt: 3\n", out); err == nil {
		t.Error("lines that do not pair: no error")
	}
	if err := parseCounters("TcpExt: ListenOverflows ListenDrops\nTcpExt: 3 4\n", out); err != nil || out["ListenDrops"] != 4 {
		t.Errorf("TcpExt: got %v, %v; want ListenDrops 4", out, err)
	}
}

func TestCountersInOwnNamespace(t *testing.T) {
	ns, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	out, err := CountersIn(ns)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"OutRsts", "ListenOverflows", "TCPAbortOnData"} {
		if _, ok := out[name]; !ok {
			t.Errorf("counter %s missing: %v", name, out)
		}
	}
}
