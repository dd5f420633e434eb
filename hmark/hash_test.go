package hmark

import (
	"math"
	"math/rand/v2"
	"net/netip"
	"regexp"
	"strings"
	"testing"
)

var addr = netip.MustParseAddr

// TestMarkKernelVectors checks Mark against marks the kernel (Linux 6.18,
// xt_HMARK) set on real packets in TestKernelMarksMatchGo.
func TestMarkKernelVectors(t *testing.T) {
	tests := []struct {
		params Params
		flow   Flow
		want   uint32
	}{
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.136.49.45"), addr("127.10.0.1"), 64914, 65535, protoUDP}, 0x412},
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.205.253.67"), addr("10.200.0.1"), 9324, 65535, protoTCP}, 0x3f9},
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.36.217.70"), addr("10.200.0.1"), 2048, 11147, protoICMP}, 0x417},
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.177.243.186"), addr("127.10.0.1"), 34255, 37509, 253}, 0x3e8},
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.195.194.104"), addr("192.0.2.10"), 30021, 9382, protoESP}, 0x40f},
		{Params{64, 1000, 0xdeadbeef}, Flow{addr("127.190.32.195"), addr("10.200.0.1"), 51448, 53471, protoAH}, 0x416},
		{Params{0x7fffffff, 0, 0x12345678}, Flow{addr("127.217.70.218"), addr("10.200.0.1"), 62709, 1, protoUDP}, 0x465afcef},
		{Params{0x7fffffff, 0, 0x12345678}, Flow{addr("127.3.254.56"), addr("192.0.2.10"), 64679, 1, protoTCP}, 0x4f554833},
		{Params{0x7fffffff, 0, 0x12345678}, Flow{addr("127.80.24.105"), addr("10.200.0.1"), 2048, 29396, protoICMP}, 0x2d8bd270},
		{Params{0x7fffffff, 0, 0x12345678}, Flow{addr("127.51.168.106"), addr("192.0.2.10"), 21252, 54289, protoAH}, 0x74f52b2},
		{Params{0xffffffff, 0, 0}, Flow{addr("127.251.135.194"), addr("192.0.2.10"), 10781, 40000, protoUDP}, 0x3a40cf93},
		{Params{0xffffffff, 0, 0}, Flow{addr("127.77.3.218"), addr("127.10.0.1"), 45733, 40000, protoTCP}, 0x4925cbb1},
		{Params{0xffffffff, 0, 0}, Flow{addr("127.94.23.138"), addr("192.0.2.10"), 50111, 34546, 253}, 0x62b94796},
		{Params{0xffffffff, 0, 0}, Flow{addr("127.170.236.228"), addr("192.0.2.10"), 52860, 17014, protoESP}, 0x65287266},
		{Params{0xfffffff0, 15, 0xffffffff}, Flow{addr("127.132.249.125"), addr("127.10.0.1"), 10828, 40000, protoUDP}, 0x713afa6f},
		{Params{0xfffffff0, 15, 0xffffffff}, Flow{addr("127.67.157.252"), addr("127.10.0.1"), 2432, 65535, protoTCP}, 0x76e1b0dc},
		{Params{3, 0x10000, 0x9e3779b9}, Flow{addr("127.132.122.147"), addr("127.10.0.1"), 48897, 53, protoUDP}, 0x10001},
		{Params{3, 0x10000, 0x9e3779b9}, Flow{addr("127.143.195.238"), addr("192.0.2.10"), 9923, 65535, protoTCP}, 0x10002},
		{Params{1, 7, 42}, Flow{addr("127.9.155.237"), addr("192.0.2.10"), 59534, 65535, protoUDP}, 7},
	}
	for _, tt := range tests {
		if got := tt.params.Mark(tt.flow); got != tt.want {
			t.Errorf("%+v.Mark(%+v) = %#x, want %#x (kernel)", tt.params, tt.flow, got, tt.want)
		}
		if got, want := tt.params.Bucket(tt.flow), tt.want-tt.params.Offset; got != want {
			t.Errorf("%+v.Bucket(%+v) = %d, want %d", tt.params, tt.flow, got, want)
		}
	}
}

func randomFlow(rng *rand.Rand) Flow {
	protos := []uint8{protoTCP, protoUDP, protoICMP, protoSCTP, protoESP, protoAH, protoUDPLite, protoDCCP, 0, 47, 253}
	var a, b [4]byte
	for i := range a {
		a[i], b[i] = byte(rng.Uint32()), byte(rng.Uint32())
	}
	return Flow{
		Src: netip.AddrFrom4(a), Dst: netip.AddrFrom4(b),
		SrcPort: uint16(rng.Uint32()), DstPort: uint16(rng.Uint32()),
		Proto: protos[rng.IntN(len(protos))],
	}
}

var propertyParams = []Params{
	{Buckets: 1, Offset: 0, Seed: 0},
	{Buckets: 2, Offset: 1, Seed: 1},
	{Buckets: 7, Offset: 0x100, Seed: 0xc0ffee},
	{Buckets: 64, Offset: 1000, Seed: 0xdeadbeef},
	{Buckets: 1000, Offset: math.MaxUint32 - 1000, Seed: 0x12345678},
	{Buckets: 0x7fffffff, Offset: 0, Seed: 0xffffffff},
	{Buckets: math.MaxUint32, Offset: 0, Seed: 0x9e3779b9},
}

// TestMarkSymmetric checks that both directions of a flow (addresses and
// ports swapped) get the same mark, for every parameter set.
func TestMarkSymmetric(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, p := range propertyParams {
		for i := 0; i < 2000; i++ {
			f := randomFlow(rng)
			back := Flow{Src: f.Dst, Dst: f.Src, SrcPort: f.DstPort, DstPort: f.SrcPort, Proto: f.Proto}
			if m, mb := p.Mark(f), p.Mark(back); m != mb {
				t.Fatalf("%+v: Mark(%+v) = %#x but Mark(%+v) = %#x", p, f, m, back, mb)
			}
		}
	}
}

// TestBucketInRange checks that every bucket is below Buckets and every
// mark is Offset plus its bucket.
func TestBucketInRange(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, p := range propertyParams {
		seen := make(map[uint32]bool)
		for i := 0; i < 5000; i++ {
			f := randomFlow(rng)
			b := p.Bucket(f)
			if b >= p.Buckets {
				t.Fatalf("%+v: Bucket(%+v) = %d, not below %d", p, f, b, p.Buckets)
			}
			if m := p.Mark(f); m != p.Offset+b {
				t.Fatalf("%+v: Mark(%+v) = %d, want Offset+Bucket = %d", p, f, m, p.Offset+b)
			}
			seen[b] = true
		}
		if p.Buckets <= 64 && uint32(len(seen)) != p.Buckets {
			t.Errorf("%+v: 5000 random flows used %d of %d buckets", p, len(seen), p.Buckets)
		}
	}
}

// TestMarkFlowDetails checks the parts of the tuple the kernel ignores or
// treats specially.
func TestMarkFlowDetails(t *testing.T) {
	p := Params{Buckets: math.MaxUint32, Offset: 0, Seed: 0xabcdef}
	base := Flow{Src: addr("10.0.0.1"), Dst: addr("10.0.0.2"), SrcPort: 1234, DstPort: 80, Proto: protoUDP}
	with := func(mod func(*Flow)) Flow {
		f := base
		mod(&f)
		return f
	}
	tests := []struct {
		name string
		a, b Flow
		same bool
	}{
		{"ports ignored for ICMP", with(func(f *Flow) { f.Proto = protoICMP }),
			with(func(f *Flow) { f.Proto, f.SrcPort, f.DstPort = protoICMP, 0, 0 }), true},
		{"ports ignored for GRE", with(func(f *Flow) { f.Proto = 47 }),
			with(func(f *Flow) { f.Proto, f.SrcPort = 47, 9 }), true},
		{"ports count for UDP", base, with(func(f *Flow) { f.SrcPort = 1235 }), false},
		{"ports count for SCTP", with(func(f *Flow) { f.Proto = protoSCTP }),
			with(func(f *Flow) { f.Proto, f.DstPort = protoSCTP, 81 }), false},
		{"SPI counts for ESP", with(func(f *Flow) { f.Proto = protoESP }),
			with(func(f *Flow) { f.Proto, f.DstPort = protoESP, 81 }), false},
		{"protocol counts", base, with(func(f *Flow) { f.Proto = protoTCP }), false},
		{"only the port pair counts, not which side", base,
			with(func(f *Flow) { f.SrcPort, f.DstPort = f.DstPort, f.SrcPort }), true},
		{"only the address pair counts, not which side", base,
			with(func(f *Flow) { f.Src, f.Dst = f.Dst, f.Src }), true},
		{"an IPv4-mapped address is IPv6, as in an IPv6 header", base,
			with(func(f *Flow) {
				f.Src = netip.AddrFrom16(f.Src.As16())
				f.Dst = netip.AddrFrom16(f.Dst.As16())
			}), false},
		// ip6tables' HMARK folds an IPv6 address into the xor of its four
		// words: addresses of equal fold hash alike, whatever the order
		// of their words.
		{"IPv6: words of an address in another order", with(func(f *Flow) {
			f.Src, f.Dst = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10")
		}), with(func(f *Flow) {
			f.Src, f.Dst = netip.MustParseAddr("0:1:2001:db8::a"), netip.MustParseAddr("2001:db8::10")
		}), true},
		{"IPv6: another address", with(func(f *Flow) {
			f.Src, f.Dst = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10")
		}), with(func(f *Flow) {
			f.Src, f.Dst = netip.MustParseAddr("2001:db8:0:1::b"), netip.MustParseAddr("2001:db8::10")
		}), false},
		{"IPv6: ports count for UDP", with(func(f *Flow) {
			f.Src, f.Dst = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10")
		}), with(func(f *Flow) {
			f.Src, f.Dst, f.SrcPort = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10"), 1235
		}), false},
		{"IPv6: ports ignored for ICMPv6", with(func(f *Flow) {
			f.Src, f.Dst, f.Proto = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10"), protoICMPv6
		}), with(func(f *Flow) {
			f.Src, f.Dst, f.Proto, f.SrcPort = netip.MustParseAddr("2001:db8:0:1::a"), netip.MustParseAddr("2001:db8::10"), protoICMPv6, 9
		}), true},
	}
	for _, tt := range tests {
		ma, mb := p.Mark(tt.a), p.Mark(tt.b)
		if (ma == mb) != tt.same {
			t.Errorf("%s: Mark(%+v) = %#x, Mark(%+v) = %#x, same = %v, want %v", tt.name, tt.a, ma, tt.b, mb, ma == mb, tt.same)
		}
	}
	other := p
	other.Seed++
	if p.Mark(base) == other.Mark(base) {
		t.Errorf("seeds %#x and %#x give the same mark %#x", p.Seed, other.Seed, p.Mark(base))
	}
}

func TestReciprocalScale(t *testing.T) {
	tests := []struct{ val, n, want uint32 }{
		{0, 64, 0},
		{math.MaxUint32, 64, 63},
		{0x80000000, 64, 32},
		{math.MaxUint32, math.MaxUint32, math.MaxUint32 - 1},
		{12345, 1, 0},
		{math.MaxUint32, 0, 0},
	}
	for _, tt := range tests {
		if got := reciprocalScale(tt.val, tt.n); got != tt.want {
			t.Errorf("reciprocalScale(%#x, %d) = %d, want %d", tt.val, tt.n, got, tt.want)
		}
	}
}

func TestParamsValidate(t *testing.T) {
	tests := []struct {
		params  Params
		wantErr string
	}{
		{Params{Buckets: 1}, ""},
		{Params{Buckets: 64, Offset: 1000, Seed: 1}, ""},
		{Params{Buckets: math.MaxUint32}, ""},
		{Params{Buckets: 1, Offset: math.MaxUint32 - 1}, ""},
		{Params{Buckets: 0, Offset: 5}, "at least 1"},
		{Params{Buckets: 2, Offset: math.MaxUint32 - 1}, "overflows"},
		{Params{Buckets: math.MaxUint32, Offset: 1}, "overflows"},
	}
	for _, tt := range tests {
		err := tt.params.Validate()
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%+v.Validate() = %v, want nil", tt.params, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%+v.Validate() = %v, want an error containing %q", tt.params, err, tt.wantErr)
		}
	}
}

func TestSeedFingerprint(t *testing.T) {
	hex6 := regexp.MustCompile(`^[0-9a-f]{6}$`)
	seen := make(map[string]uint32)
	for _, seed := range []uint32{0, 1, 2, 0xc0ffee, 0xdeadbeef, math.MaxUint32} {
		fp := SeedFingerprint(seed)
		if !hex6.MatchString(fp) {
			t.Errorf("SeedFingerprint(%#x) = %q, want 6 hex digits", seed, fp)
		}
		if fp != SeedFingerprint(seed) {
			t.Errorf("SeedFingerprint(%#x) is not deterministic", seed)
		}
		if prev, dup := seen[fp]; dup {
			t.Errorf("SeedFingerprint(%#x) = SeedFingerprint(%#x) = %q", seed, prev, fp)
		}
		seen[fp] = seed
	}
	p := Params{Buckets: 8, Offset: 1, Seed: 0xc0ffee}
	if s := p.String(); strings.Contains(s, "c0ffee") || strings.Contains(s, "12648430") ||
		!strings.Contains(s, SeedFingerprint(p.Seed)) {
		t.Errorf("Params.String() = %q: must show the fingerprint and not the seed", s)
	}
}
