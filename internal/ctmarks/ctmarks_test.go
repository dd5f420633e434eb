package ctmarks

import (
	"math/rand/v2"
	"testing"
)

func TestBlocksCoverTheRangeExactly(t *testing.T) {
	for _, tc := range []struct {
		r    Range
		want []Block
	}{
		{Range{0x100, 0x100}, []Block{{0x100, 0xffffff00}}},
		{Range{0x100, 0x40}, []Block{{0x100, 0xffffffc0}}},
		{Range{0x101, 3}, []Block{{0x101, 0xffffffff}, {0x102, 0xfffffffe}}},
		{Range{0, 0}, nil},
		{Range{0xffffffff, 5}, []Block{{0xffffffff, 0xffffffff}}},
		{Range{0, 1 << 31}, []Block{{0, 0x80000000}}},
	} {
		got := Blocks(tc.r)
		if len(got) != len(tc.want) {
			t.Errorf("Blocks(%+v) = %x, want %x", tc.r, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("Blocks(%+v) = %x, want %x", tc.r, got, tc.want)
				break
			}
		}
	}
	// Random ranges: every mark in the range is in exactly one block, the
	// marks just outside in none.
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		r := Range{First: rng.Uint32N(1 << 20), Count: rng.Uint32N(2000)}
		blocks := Blocks(r)
		in := func(m uint32) int {
			n := 0
			for _, b := range blocks {
				if m&b.Mask == b.Value {
					n++
				}
			}
			return n
		}
		for m := r.First; m < r.First+r.Count; m++ {
			if in(m) != 1 {
				t.Fatalf("Blocks(%+v): mark %#x in %d blocks", r, m, in(m))
			}
		}
		if r.First > 0 && in(r.First-1) != 0 || in(r.First+r.Count) != 0 {
			t.Fatalf("Blocks(%+v) = %x covers a mark outside", r, blocks)
		}
	}
}
