package datapath

import (
	"strings"
	"testing"
)

// TestChainNameLimit: with generations, hmark's sticky mode adds a raw
// subchain named after the chain plus "-SYN", which must fit iptables' 28
// characters; the router refuses a longer --chain at start, not later.
func TestChainNameLimit(t *testing.T) {
	for _, tc := range []struct {
		generations, length int
		ok                  bool
	}{
		{1, 28, true}, {1, 29, false},
		{4, 24, true}, {4, 25, false},
	} {
		cfg := testConfig()
		cfg.Generations = tc.generations
		cfg.Chain = strings.Repeat("K", tc.length)
		err := cfg.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("generations %d, chain of %d characters: Validate() = %v, want ok=%v", tc.generations, tc.length, err, tc.ok)
		}
	}
}
