package topology

import (
	"net/netip"
	"slices"
	"testing"
)

func TestParseConntrack(t *testing.T) {
	// As a router's /proc/net/nf_conntrack shows them: a flow without and
	// one with accounting, a closing one, a UDP one, and a line to skip.
	const table = `ipv4     2 tcp      6 299 ESTABLISHED src=198.51.100.10 dst=192.0.2.10 sport=46000 dport=7 [UNREPLIED] src=192.0.2.10 dst=198.51.100.10 sport=7 dport=46000 mark=4110 zone=0 use=2
ipv4     2 tcp      6 296 ESTABLISHED src=198.51.100.10 dst=192.0.2.10 sport=21284 dport=7 packets=1 bytes=52 [UNREPLIED] src=192.0.2.10 dst=198.51.100.10 sport=7 dport=21284 packets=0 bytes=0 mark=4141 zone=0 use=2
ipv4     2 tcp      6 118 FIN_WAIT src=198.51.100.10 dst=192.0.2.10 sport=45001 dport=7 packets=9 bytes=0 [UNREPLIED] src=192.0.2.10 dst=198.51.100.10 sport=7 dport=45001 packets=3 bytes=180 mark=4100 zone=0 use=2
ipv4     2 udp      17 29 src=198.51.100.10 dst=192.0.2.10 sport=48303 dport=53 [UNREPLIED] src=192.0.2.10 dst=198.51.100.10 sport=53 dport=48303 mark=4097 zone=0 use=2
garbage
`
	client, vip := netip.MustParseAddr("198.51.100.10"), netip.MustParseAddr("192.0.2.10")
	got := parseConntrack(table)
	want := []ConntrackEntry{
		{Proto: "tcp", Timeout: 299, State: "ESTABLISHED", Src: client, Dst: vip, SrcPort: 46000, DstPort: 7, Flags: []string{"UNREPLIED"}, Mark: 4110},
		{Proto: "tcp", Timeout: 296, State: "ESTABLISHED", Src: client, Dst: vip, SrcPort: 21284, DstPort: 7, Packets: 1, Bytes: 52, HasCounters: true, Flags: []string{"UNREPLIED"}, Mark: 4141},
		{Proto: "tcp", Timeout: 118, State: "FIN_WAIT", Src: client, Dst: vip, SrcPort: 45001, DstPort: 7, Packets: 9, Bytes: 0, HasCounters: true, Flags: []string{"UNREPLIED"}, Mark: 4100},
		{Proto: "udp", Timeout: 29, Src: client, Dst: vip, SrcPort: 48303, DstPort: 53, Flags: []string{"UNREPLIED"}, Mark: 4097},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		g := got[i]
		g.Line = ""
		if g.String() != want[i].String() || !slices.Equal(g.Flags, want[i].Flags) || g.Bytes != want[i].Bytes {
			t.Errorf("entry %d:\n got %+v\nwant %+v", i, g, want[i])
		}
	}
	if got[1].String() != "tcp  198.51.100.10:21284 -> 192.0.2.10:7 ESTABLISHED  timeout 296s mark 0x102d packets 1 bytes 52 [UNREPLIED]" {
		t.Errorf("String() = %q", got[1].String())
	}
}

func TestGenerationOfMark(t *testing.T) {
	l := &Lab{Opts: Options{Buckets: 64}}
	for _, c := range []struct {
		mark   uint32
		gen    int
		wantOK bool
	}{
		{0x1000, 0, true}, {0x103f, 0, true}, {0x1040, 1, true}, {0x10ff, 3, true},
		{0x1100, 0, false}, {0xfff, 0, false}, {0, 0, false},
	} {
		gen, ok := l.GenerationOfMark(c.mark)
		if gen != c.gen || ok != c.wantOK {
			t.Errorf("GenerationOfMark(%#x) = %d, %v; want %d, %v", c.mark, gen, ok, c.gen, c.wantOK)
		}
	}
}
