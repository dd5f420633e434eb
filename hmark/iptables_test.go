package hmark

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/coreos/go-iptables/iptables"
)

// fakeIPTables is an in-memory iptables with the behaviour Chain relies on:
// it prints rules back in iptables' normalized form (HMARK options
// rewritten, as in `iptables -S`), fails like iptables on missing chains and
// rules, and records every write call.
type fakeIPTables struct {
	// chains maps "table/chain" to its rules, each as printed after
	// "-A CHAIN ".
	chains map[string][]fakeRule
	// order keeps chain creation order for listing.
	order []string
	// writes records write calls, e.g. "append mangle/KST-HMARK ..." or
	// "restore mangle".
	writes []string
	// restores records the payload of every Restore call.
	restores []string
	// failWrite, when set, makes write calls whose record starts with it
	// fail.
	failWrite string
}

type fakeRule struct {
	spec           string
	packets, bytes uint64
}

var errFake = errors.New("fake iptables failure")

// builtinChains are mangle's built-in chains, listed with a policy;
// rawBuiltinChains are raw's.
var (
	builtinChains    = []string{"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
	rawBuiltinChains = []string{"PREROUTING", "OUTPUT"}
)

var (
	_ IPTables = (*fakeIPTables)(nil)
	_ Restorer = (*fakeIPTables)(nil)
)

// newFakeIPTables returns a fake with the built-in mangle and raw chains,
// then lines in `iptables -t mangle -S` form ("-N X", "-A X ...") applied;
// a line starting with "-t raw" is for the raw table.
func newFakeIPTables(t *testing.T, lines ...string) *fakeIPTables {
	t.Helper()
	f := &fakeIPTables{chains: make(map[string][]fakeRule)}
	for _, c := range builtinChains {
		f.addChain("mangle/" + c)
	}
	for _, c := range rawBuiltinChains {
		f.addChain("raw/" + c)
	}
	for _, line := range lines {
		words, err := splitWords(line)
		if err != nil || len(words) < 2 {
			t.Fatalf("bad seed line %q: %v", line, err)
		}
		table := "mangle"
		if words[0] == "-t" {
			table, words = words[1], words[2:]
		}
		key := table + "/" + words[1]
		switch words[0] {
		case "-N":
			f.addChain(key)
		case "-A":
			if _, ok := f.chains[key]; !ok {
				t.Fatalf("seed line %q: no chain %s", line, words[1])
			}
			f.chains[key] = append(f.chains[key], fakeRule{spec: strings.Join(quoteWords(words[2:]), " ")})
		default:
			t.Fatalf("bad seed line %q", line)
		}
	}
	return f
}

func (f *fakeIPTables) addChain(key string) {
	f.chains[key] = []fakeRule{}
	f.order = append(f.order, key)
}

func (f *fakeIPTables) write(format string, args ...any) error {
	call := fmt.Sprintf(format, args...)
	f.writes = append(f.writes, call)
	if f.failWrite != "" && strings.HasPrefix(call, f.failWrite) {
		return fmt.Errorf("%s: %w", call, errFake)
	}
	return nil
}

func (f *fakeIPTables) ChainExists(table, chain string) (bool, error) {
	_, ok := f.chains[table+"/"+chain]
	return ok, nil
}

func (f *fakeIPTables) NewChain(table, chain string) error {
	if err := f.write("new %s/%s", table, chain); err != nil {
		return err
	}
	if _, ok := f.chains[table+"/"+chain]; ok {
		return fmt.Errorf("chain %s already exists", chain)
	}
	f.addChain(table + "/" + chain)
	return nil
}

func (f *fakeIPTables) ClearChain(table, chain string) error {
	if err := f.write("clear %s/%s", table, chain); err != nil {
		return err
	}
	if _, ok := f.chains[table+"/"+chain]; !ok {
		f.addChain(table + "/" + chain)
	}
	f.chains[table+"/"+chain] = []fakeRule{}
	return nil
}

func (f *fakeIPTables) DeleteChain(table, chain string) error {
	key := table + "/" + chain
	if err := f.write("delete-chain %s", key); err != nil {
		return err
	}
	rules, ok := f.chains[key]
	if !ok {
		return fmt.Errorf("no chain %s", chain)
	}
	if len(rules) > 0 {
		return fmt.Errorf("chain %s is not empty", chain)
	}
	for _, k := range f.order {
		if !strings.HasPrefix(k, table+"/") {
			continue // references do not cross tables
		}
		for _, r := range f.chains[k] {
			if slices.Contains(strings.Fields(r.spec), chain) {
				return fmt.Errorf("chain %s is referenced from %s", chain, k)
			}
		}
	}
	delete(f.chains, key)
	f.order = slices.DeleteFunc(f.order, func(k string) bool { return k == key })
	return nil
}

func (f *fakeIPTables) list(table, chain string, counters bool) ([]string, error) {
	key := table + "/" + chain
	rules, ok := f.chains[key]
	if !ok {
		return nil, fmt.Errorf("iptables: chain %s does not exist", chain)
	}
	var out []string
	if slices.Contains(builtinChains, chain) {
		out = append(out, "-P "+chain+" ACCEPT")
	} else {
		out = append(out, "-N "+chain)
	}
	for _, r := range rules {
		spec := r.spec
		if counters {
			// iptables 1.8 prints the counters before the target.
			c := fmt.Sprintf("-c %d %d", r.packets, r.bytes)
			if i := strings.Index(spec, "-j "); i >= 0 {
				spec = spec[:i] + c + " " + spec[i:]
			} else {
				spec += " " + c
			}
		}
		out = append(out, "-A "+chain+" "+spec)
	}
	return out, nil
}

func (f *fakeIPTables) List(table, chain string) ([]string, error) {
	return f.list(table, chain, false)
}

func (f *fakeIPTables) ListWithCounters(table, chain string) ([]string, error) {
	return f.list(table, chain, true)
}

func (f *fakeIPTables) Append(table, chain string, rulespec ...string) error {
	key := table + "/" + chain
	if err := f.write("append %s %s", key, strings.Join(rulespec, " ")); err != nil {
		return err
	}
	if _, ok := f.chains[key]; !ok {
		return fmt.Errorf("no chain %s", chain)
	}
	f.chains[key] = append(f.chains[key], fakeRule{spec: normalizeFakeSpec(rulespec)})
	return nil
}

func (f *fakeIPTables) Insert(table, chain string, pos int, rulespec ...string) error {
	key := table + "/" + chain
	if err := f.write("insert %s %d %s", key, pos, strings.Join(rulespec, " ")); err != nil {
		return err
	}
	rules, ok := f.chains[key]
	if !ok || pos < 1 || pos > len(rules)+1 {
		return fmt.Errorf("bad insert into %s at %d", chain, pos)
	}
	f.chains[key] = slices.Insert(rules, pos-1, fakeRule{spec: normalizeFakeSpec(rulespec)})
	return nil
}

func (f *fakeIPTables) Delete(table, chain string, rulespec ...string) error {
	key := table + "/" + chain
	if err := f.write("delete %s %s", key, strings.Join(rulespec, " ")); err != nil {
		return err
	}
	spec := normalizeFakeSpec(rulespec)
	i := slices.IndexFunc(f.chains[key], func(r fakeRule) bool { return r.spec == spec })
	if i < 0 {
		return errors.New("Bad rule (does a matching rule exist in that chain?)")
	}
	f.chains[key] = slices.Delete(f.chains[key], i, i+1)
	return nil
}

func (f *fakeIPTables) DeleteById(table, chain string, id int) error {
	key := table + "/" + chain
	if err := f.write("delete %s #%d", key, id); err != nil {
		return err
	}
	rules := f.chains[key]
	if id < 1 || id > len(rules) {
		return fmt.Errorf("index of deletion too big: %d", id)
	}
	f.chains[key] = slices.Delete(rules, id-1, id)
	return nil
}

// Restore applies payload as `iptables-restore --noflush --counters` does:
// atomically (all or nothing), each declared chain created or flushed,
// rules appended (with the counters of a "[PACKETS:BYTES]" prefix), every
// other chain left alone. It rejects what Chain must never
// write: another table, a policy, a rule for an undeclared chain of the
// payload that does not exist, a missing COMMIT. Like iptables-restore, its
// errors quote the offending line.
func (f *fakeIPTables) Restore(table string, payload []byte) error {
	f.restores = append(f.restores, string(payload))
	if err := f.write("restore %s", table); err != nil {
		// Quote the first rule, as iptables-restore may quote a failed one.
		var rule string
		for l := range strings.Lines(string(payload)) {
			if strings.HasPrefix(l, "-A ") {
				rule = strings.TrimSuffix(l, "\n")
				break
			}
		}
		return fmt.Errorf("rule %q failed: %w", rule, err)
	}
	text, ok := strings.CutSuffix(string(payload), "\n")
	if !ok {
		return errors.New("restore: payload does not end with a newline")
	}
	lines := strings.Split(text, "\n")
	if len(lines) < 2 || lines[0] != "*"+table || lines[len(lines)-1] != "COMMIT" {
		return fmt.Errorf("restore: payload is not one *%s table ending in COMMIT:\n%s", table, payload)
	}
	// Work on a copy and commit it only when every line applied.
	chains := make(map[string][]fakeRule, len(f.chains))
	for k, rules := range f.chains {
		chains[k] = slices.Clone(rules)
	}
	order := slices.Clone(f.order)
	for i, line := range lines[1 : len(lines)-1] {
		var counters fakeRule
		if rest, ok := strings.CutPrefix(line, "["); ok {
			pb, after, found := strings.Cut(rest, "] ")
			p, b, colon := strings.Cut(pb, ":")
			var perr, berr error
			counters.packets, perr = strconv.ParseUint(p, 10, 64)
			counters.bytes, berr = strconv.ParseUint(b, 10, 64)
			if !found || !colon || perr != nil || berr != nil || !strings.HasPrefix(after, "-A ") {
				return fmt.Errorf("restore: line %d %q: bad counters", i+2, line)
			}
			line = after
		}
		words, err := splitWords(line)
		if err != nil || len(words) < 2 {
			return fmt.Errorf("restore: line %d %q: bad line", i+2, line)
		}
		key := table + "/" + words[1]
		switch {
		case strings.HasPrefix(words[0], ":") && len(words) == 3 && words[1] == "-" && words[2] == "[0:0]":
			key = table + "/" + strings.TrimPrefix(words[0], ":")
			if slices.Contains(builtinChains, strings.TrimPrefix(words[0], ":")) {
				return fmt.Errorf("restore: line %d %q: Chain writes no policy", i+2, line)
			}
			if _, ok := chains[key]; !ok {
				order = append(order, key)
			}
			chains[key] = []fakeRule{}
		case words[0] == "-A":
			if _, ok := chains[key]; !ok {
				return fmt.Errorf("restore: line %d %q: no chain %s", i+2, line, words[1])
			}
			chains[key] = append(chains[key], fakeRule{spec: normalizeFakeSpec(words[2:]), packets: counters.packets, bytes: counters.bytes})
		default:
			return fmt.Errorf("restore: line %d %q: unexpected", i+2, line)
		}
	}
	f.chains, f.order = chains, order
	return nil
}

// normalizeFakeSpec prints a rule spec the way iptables -S prints it back:
// HMARK's --hmark-tuple src,dst,sport,dport,proto becomes its prefixes and
// masks, and the options come in libxt_HMARK's order and number formats.
func normalizeFakeSpec(spec []string) string {
	j := slices.Index(spec, "HMARK")
	if j < 1 || spec[j-1] != "-j" {
		return strings.Join(quoteWords(spec), " ")
	}
	opts := make(map[string]string)
	for i := j + 1; i+1 < len(spec); i += 2 {
		opts[spec[i]] = spec[i+1]
	}
	out := slices.Clone(spec[:j+1])
	if opts["--hmark-tuple"] == "src,dst,sport,dport,proto" {
		out = append(out, "--hmark-src-prefix", "32", "--hmark-dst-prefix", "32",
			"--hmark-sport-mask", "0xffff", "--hmark-dport-mask", "0xffff", "--hmark-proto-mask", "0xffff")
	}
	num := func(s string) uint64 {
		v, err := strconv.ParseUint(s, 0, 32)
		if err != nil {
			panic(fmt.Sprintf("fake iptables: bad number %q", s))
		}
		return v
	}
	out = append(out, "--hmark-rnd", fmt.Sprintf("0x%08x", num(opts["--hmark-rnd"])),
		"--hmark-mod", strconv.FormatUint(num(opts["--hmark-mod"]), 10))
	if off, ok := opts["--hmark-offset"]; ok {
		out = append(out, "--hmark-offset", strconv.FormatUint(num(off), 10))
	}
	return strings.Join(quoteWords(out), " ")
}

// quoteWords quotes words with spaces or quotes as iptables -S does.
func quoteWords(words []string) []string {
	out := make([]string, len(words))
	for i, w := range words {
		if strings.ContainsAny(w, " \"\\") {
			w = `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(w) + `"`
		}
		out[i] = w
	}
	return out
}

// dump returns the fake's mangle table as `iptables -t mangle -S` would.
func (f *fakeIPTables) dump() string { return f.dumpTable("mangle") }

// dumpTable returns one of the fake's tables as `iptables -t TABLE -S`
// would.
func (f *fakeIPTables) dumpTable(table string) string {
	var lines []string
	for _, key := range f.order {
		chain, ok := strings.CutPrefix(key, table+"/")
		if !ok {
			continue
		}
		l, _ := f.list(table, chain, false)
		lines = append(lines, l...)
	}
	return strings.Join(lines, "\n")
}

// Lines as Linux 6.18's iptables v1.8.9 (nft and legacy alike) printed
// them for Chain's rules with testParams.
const (
	printedJump   = "-A PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"
	printedRuleA  = "-A KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	printedRuleB  = "-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	printedRuleC  = "-A KST-HMARK -d 10.96.0.30/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256"
	printedChainN = "-N KST-HMARK"
)

var (
	testParams = Params{Buckets: 16, Offset: 256, Seed: 0xc0ffee}
	vipA       = netip.MustParseAddr("10.96.0.10")
	vipB       = netip.MustParseAddr("10.96.0.20")
	vipC       = netip.MustParseAddr("10.96.0.30")
	// Rules of others that Chain must never touch.
	othersLines = []string{
		"-N OPERATOR",
		"-A OPERATOR -d 10.1.1.1/32 -j MARK --set-xmark 0x5/0xffffffff",
		"-A OPERATOR -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00000001 --hmark-mod 2",
		"-A FORWARD -j OPERATOR",
		`-A PREROUTING -p tcp -m comment --comment "someone else's \"rule\"" -j MARK --set-xmark 0x9/0xffffffff`,
	}
)

// targetsOf returns one Target per tunnel IP, each on the chain's own
// offset (Offset 0).
func targetsOf(vips ...netip.Addr) []Target {
	targets := make([]Target, len(vips))
	for i, vip := range vips {
		targets[i] = Target{VIP: vip}
	}
	return targets
}

func newTestChain(t *testing.T, ipt IPTables, params Params) *Chain {
	t.Helper()
	c, err := NewChain(ipt, "", params)
	if err != nil {
		t.Fatalf("NewChain: %v", err)
	}
	return c
}

// canonicalState is the mangle table once Chain has synced vips with
// testParams on top of othersLines (jump inserted first in PREROUTING,
// rules sorted by tunnel IP).
func canonicalState(t *testing.T, ruleLines ...string) string {
	t.Helper()
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN}, ruleLines)...)
	f.chains["mangle/PREROUTING"] = slices.Insert(f.chains["mangle/PREROUTING"], 0,
		fakeRule{spec: strings.TrimPrefix(printedJump, "-A PREROUTING ")})
	return f.dump()
}

// sameState compares two dumps of mangle, ignoring the order of rules in
// PREROUTING (Chain keeps a jump where it finds it) and in Chain's own
// chain (whose rules all continue, so order does not matter); every other
// chain must be identical, order included.
func sameState(a, b string) bool {
	key := func(dump string) string {
		lines := strings.Split(dump, "\n")
		unordered := func(l string) bool {
			return strings.HasPrefix(l, "-A PREROUTING ") || strings.HasPrefix(l, "-A "+DefaultChainName+" ")
		}
		var free []string
		var fixed []string
		for _, l := range lines {
			if unordered(l) {
				free = append(free, l)
			} else {
				fixed = append(fixed, l)
			}
		}
		slices.Sort(free)
		return strings.Join(fixed, "\n") + "\n--\n" + strings.Join(free, "\n")
	}
	return key(a) == key(b)
}

// plainIPTables hides the fake's Restore: NewChain gives a Chain over it
// no restorer, and the Chain writes rules one by one.
type plainIPTables struct{ IPTables }

func TestSyncFromScratch(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, testParams)
	changed, err := c.Sync(targetsOf(vipC, vipA, vipB))
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if changed != 5 {
		t.Errorf("Sync changed = %d; want 5 (chain, jump, three rules)", changed)
	}
	if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB, printedRuleC); got != want {
		t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
	}
	wantWrites := []string{
		"new mangle/KST-HMARK",
		"insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK",
		"restore mangle",
	}
	if !slices.Equal(f.writes, wantWrites) {
		t.Errorf("writes:\n%s\nwant:\n%s", strings.Join(f.writes, "\n"), strings.Join(wantWrites, "\n"))
	}
	wantPayload := `*mangle
:KST-HMARK - [0:0]
-A KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
-A KST-HMARK -d 10.96.0.30/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee
COMMIT
`
	if len(f.restores) != 1 || f.restores[0] != wantPayload {
		t.Errorf("restore payloads %q, want one:\n%s", f.restores, wantPayload)
	}
}

// TestSyncFromScratchOneByOne is TestSyncFromScratch for a Chain without
// a restorer: one write per rule.
func TestSyncFromScratchOneByOne(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, plainIPTables{f}, testParams)
	changed, err := c.Sync(targetsOf(vipC, vipA, vipB))
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if changed != 5 || len(f.writes) != 5 {
		t.Errorf("Sync changed = %d, writes %q; want 5 (chain, jump, three rules)", changed, f.writes)
	}
	if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB, printedRuleC); got != want {
		t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
	}
	wantFirst := []string{
		"new mangle/KST-HMARK",
		"insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK",
		"append mangle/KST-HMARK -d 10.96.0.10/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-tuple src,dst,sport,dport,proto --hmark-mod 16 --hmark-offset 256 --hmark-rnd 0x00c0ffee",
	}
	if !slices.Equal(f.writes[:3], wantFirst) {
		t.Errorf("first writes:\n%s\nwant:\n%s", strings.Join(f.writes[:3], "\n"), strings.Join(wantFirst, "\n"))
	}
}

// TestSyncAdoptsWithoutWrites gives a new Chain a kernel state that is
// already right, in the several forms iptables may print it, and expects
// no write at all.
func TestSyncAdoptsWithoutWrites(t *testing.T) {
	protoMask00ff := strings.Replace(printedRuleA, "--hmark-proto-mask 0xffff", "--hmark-proto-mask 0xff", 1)
	tests := []struct {
		name   string
		params Params
		lines  []string
	}{
		{"as Chain wrote it", testParams, []string{printedChainN, printedJump, printedRuleA, printedRuleB}},
		{"jump not first in PREROUTING", testParams, []string{printedChainN, "-A PREROUTING -j ACCEPT", printedJump, printedRuleB, printedRuleA}},
		{"protocol mask 0xff", testParams, []string{printedChainN, printedJump, protoMask00ff, printedRuleB}},
		{"offset 0 omitted by iptables", Params{Buckets: 16, Offset: 0, Seed: 0xc0ffee}, []string{printedChainN, printedJump,
			strings.TrimSuffix(printedRuleA, " --hmark-offset 256"), strings.Replace(printedRuleB, "--hmark-offset 256", "--hmark-offset 0", 1)}},
		{"decimal seed, hex modulus", testParams, []string{printedChainN, printedJump, printedRuleA,
			strings.Replace(strings.Replace(printedRuleB, "0x00c0ffee", "12648430", 1), "--hmark-mod 16", "--hmark-mod 0x10", 1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, restore := range []bool{true, false} {
				f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
				before := f.dump()
				var ipt IPTables = f
				if !restore {
					ipt = plainIPTables{f}
				}
				changed, err := newTestChain(t, ipt, tt.params).Sync(targetsOf(vipA, vipB))
				if err != nil {
					t.Fatalf("Sync (restore %v): %v", restore, err)
				}
				if changed != 0 || len(f.writes) != 0 {
					t.Errorf("Sync (restore %v) changed = %d, writes %q; want none", restore, changed, f.writes)
				}
				if f.dump() != before {
					t.Errorf("state changed (restore %v):\n%s\nwant:\n%s", restore, f.dump(), before)
				}
			}
		})
	}
}

// TestSyncRepairs starts from drifted states and expects the canonical
// state for vipA and vipB, with exactly the writes needed, and the rules of
// others untouched.
func TestSyncRepairs(t *testing.T) {
	hmarkA := func(mod string) string { return strings.Replace(printedRuleA, "--hmark-mod 16", mod, 1) }
	tests := []struct {
		name  string
		lines []string
		// Prefixes of the expected write calls, in order: oneByOne for a
		// Chain without a restorer (one write per difference, so also the
		// changed count in both modes), restore for a Chain with one.
		oneByOne []string
		restore  []string
	}{
		{"chain missing", []string{printedJump},
			[]string{"new", "append mangle/KST-HMARK -d 10.96.0.10/32", "append mangle/KST-HMARK -d 10.96.0.20/32"}, []string{"new", "restore mangle"}},
		{"jump missing", []string{printedChainN, printedRuleA, printedRuleB},
			[]string{"insert mangle/PREROUTING 1"}, []string{"insert mangle/PREROUTING 1"}},
		{"rule missing", []string{printedChainN, printedJump, printedRuleB},
			[]string{"append mangle/KST-HMARK -d 10.96.0.10/32"}, []string{"restore mangle"}},
		{"stale tunnel IP", []string{printedChainN, printedJump, printedRuleA, printedRuleC, printedRuleB},
			[]string{"delete mangle/KST-HMARK #2"}, []string{"restore mangle"}},
		{"duplicate rule", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedRuleA},
			[]string{"delete mangle/KST-HMARK #3"}, []string{"restore mangle"}},
		{"foreign rules in own chain", []string{printedChainN, printedJump,
			"-A KST-HMARK -j MARK --set-xmark 0x1/0xffffffff",
			printedRuleA,
			`-A KST-HMARK -d 10.96.0.20/32 -m comment --comment "not ours" -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256`,
			"-A KST-HMARK -d 10.96.0.20/32 -p tcp -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK ! -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.0/24 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256 --hmark-tuple ct",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 24 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xffff --hmark-sport 0x0050 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j HMARK --hmark-src-prefix 32 --hmark-dst-prefix 32 --hmark-sport-mask 0xffff --hmark-dport-mask 0xffff --hmark-proto-mask 0xfff0 --hmark-rnd 0x00c0ffee --hmark-mod 16 --hmark-offset 256",
			"-A KST-HMARK -d 10.96.0.20/32 -m comment --comment kube-service-tunnel -j MARK --set-xmark 0x100/0xffffffff",
		}, []string{"append mangle/KST-HMARK -d 10.96.0.20/32",
			"delete mangle/KST-HMARK #12", "delete mangle/KST-HMARK #11", "delete mangle/KST-HMARK #10", "delete mangle/KST-HMARK #9", "delete mangle/KST-HMARK #8",
			"delete mangle/KST-HMARK #7", "delete mangle/KST-HMARK #6", "delete mangle/KST-HMARK #5",
			"delete mangle/KST-HMARK #4", "delete mangle/KST-HMARK #3", "delete mangle/KST-HMARK #1"}, []string{"restore mangle"}},
		{"other parameters after a config change", []string{printedChainN, printedJump, hmarkA("--hmark-mod 8"),
			strings.Replace(printedRuleB, "0x00c0ffee", "0x00c0fffe", 1)},
			[]string{"append mangle/KST-HMARK -d 10.96.0.10/32", "append mangle/KST-HMARK -d 10.96.0.20/32",
				"delete mangle/KST-HMARK #2", "delete mangle/KST-HMARK #1"}, []string{"restore mangle"}},
		{"duplicate jump", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedJump},
			[]string{"delete mangle/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"}, []string{"delete mangle/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"}},
		{"jump of another shape", []string{printedChainN, "-A PREROUTING -i eth0 -g KST-HMARK", printedRuleA, printedRuleB},
			[]string{"insert mangle/PREROUTING 1", "delete mangle/PREROUTING -i eth0 -g KST-HMARK"}, []string{"insert mangle/PREROUTING 1", "delete mangle/PREROUTING -i eth0 -g KST-HMARK"}},
	}
	for _, tt := range tests {
		for _, restore := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/restore=%v", tt.name, restore), func(t *testing.T) {
				f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
				var ipt IPTables = f
				wantWrites := tt.restore
				if !restore {
					ipt, wantWrites = plainIPTables{f}, tt.oneByOne
				}
				changed, err := newTestChain(t, ipt, testParams).Sync(targetsOf(vipB, vipA))
				if err != nil {
					t.Fatalf("Sync: %v", err)
				}
				if changed != len(tt.oneByOne) {
					t.Errorf("Sync changed = %d, want %d differences", changed, len(tt.oneByOne))
				}
				if len(f.writes) != len(wantWrites) {
					t.Fatalf("writes:\n%s\nwant %d:\n%s", strings.Join(f.writes, "\n"), len(wantWrites), strings.Join(wantWrites, "\n"))
				}
				for i, w := range wantWrites {
					if !strings.HasPrefix(f.writes[i], w) {
						t.Errorf("write %d = %q, want prefix %q", i, f.writes[i], w)
					}
				}
				if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB); !sameState(got, want) {
					t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
				}
				// A second Sync has nothing left to do.
				f.writes = nil
				if changed, err := newTestChain(t, ipt, testParams).Sync(targetsOf(vipA, vipB)); err != nil || changed != 0 || len(f.writes) != 0 {
					t.Errorf("second Sync: changed %d, err %v, writes %q; want 0, nil, none", changed, err, f.writes)
				}
			})
		}
	}
}

func TestSyncEmptyVIPsEmptiesChain(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump, printedRuleA, printedRuleB})...)
	changed, err := newTestChain(t, f, testParams).Sync(nil)
	if err != nil || changed != 2 {
		t.Fatalf("Sync(nil) = %d, %v; want 2 deletes", changed, err)
	}
	if got, want := f.dump(), canonicalState(t); !sameState(got, want) {
		t.Errorf("mangle after Sync(nil):\n%s\nwant:\n%s", got, want)
	}
	if want := "*mangle\n:KST-HMARK - [0:0]\nCOMMIT\n"; len(f.restores) != 1 || f.restores[0] != want {
		t.Errorf("restore payloads %q, want one: %q", f.restores, want)
	}
}

func TestSyncRejectsNonIPv4(t *testing.T) {
	f := newFakeIPTables(t)
	_, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, netip.MustParseAddr("2001:db8::1")))
	if err == nil || !strings.Contains(err.Error(), "not an IPv4") {
		t.Errorf("Sync with an IPv6 tunnel IP: err = %v, want not an IPv4 address", err)
	}
	if len(f.writes) != 0 {
		t.Errorf("writes %q, want none", f.writes)
	}
	mapped := netip.AddrFrom16(vipA.As16())
	if _, err := newTestChain(t, f, testParams).Sync(targetsOf(mapped)); err != nil {
		t.Errorf("Sync with 4-in-6 %s: %v", mapped, err)
	}
}

// TestSyncRestoreFailure makes the restore fail after the jump was
// inserted: Sync returns an error that wraps the restorer's, names the
// chain and quotes the failed rule without its seed, counts only the jump,
// and leaves the chain as it was (a restore is all or nothing).
func TestSyncRestoreFailure(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedRuleC})...)
	f.failWrite = "restore mangle"
	changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vipA, vipB))
	if !errors.Is(err, errFake) {
		t.Fatalf("Sync err = %v, want it to wrap the restorer's error", err)
	}
	if !strings.Contains(err.Error(), "KST-HMARK") || !strings.Contains(err.Error(), "10.96.0.10/32") {
		t.Errorf("Sync err = %q, want the chain and the failed rule in it", err)
	}
	if strings.Contains(err.Error(), "c0ffee") || !strings.Contains(err.Error(), "<seed "+SeedFingerprint(testParams.Seed)+">") {
		t.Errorf("Sync err = %q, want the seed replaced by its fingerprint", err)
	}
	if changed != 1 {
		t.Errorf("Sync changed = %d, want 1 (the jump inserted before the failure)", changed)
	}
	if got := f.chains["mangle/KST-HMARK"]; len(got) != 1 || "-A KST-HMARK "+got[0].spec != printedRuleC {
		t.Errorf("chain after a failed restore: %v, want it untouched", got)
	}
	if !slices.Equal(f.writes, []string{"insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK", "restore mangle"}) {
		t.Errorf("writes %q, want the jump, then one restore", f.writes)
	}
}

func TestSyncWrapsErrors(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump})...)
	f.failWrite = "append mangle/KST-HMARK -d 10.96.0.20/32"
	changed, err := newTestChain(t, plainIPTables{f}, testParams).Sync(targetsOf(vipA, vipB))
	if !errors.Is(err, errFake) {
		t.Fatalf("Sync err = %v, want it to wrap the iptables error", err)
	}
	if !strings.Contains(err.Error(), "KST-HMARK") || !strings.Contains(err.Error(), "10.96.0.20") {
		t.Errorf("Sync err = %q, want the chain and tunnel IP in it", err)
	}
	// The fake, like go-iptables, puts the command line in its error.
	if strings.Contains(err.Error(), "c0ffee") || !strings.Contains(err.Error(), "<seed "+SeedFingerprint(testParams.Seed)+">") {
		t.Errorf("Sync err = %q, want the seed replaced by its fingerprint", err)
	}
	if changed != 1 {
		t.Errorf("Sync changed = %d, want 1 (the append before the failure)", changed)
	}
}

// manyVIPs returns n distinct tunnel IPs from 10.96.0.0 on, shuffled, so
// that Sync has to sort them.
func manyVIPs(n int) []netip.Addr {
	vips := make([]netip.Addr, n)
	for i := range vips {
		vips[i] = netip.AddrFrom4([4]byte{10, 96 + byte(i>>16), byte(i >> 8), byte(i)})
	}
	rand.New(rand.NewPCG(1, 2)).Shuffle(n, func(i, j int) { vips[i], vips[j] = vips[j], vips[i] })
	return vips
}

// TestSyncLargeDiffOneRestore syncs 10,000 tunnel IPs: the chain is
// written in one restore call, a restarted Chain writes nothing, and
// swapping one tunnel IP for another is one restore that changes 2.
func TestSyncLargeDiffOneRestore(t *testing.T) {
	const n = 10000
	vips := manyVIPs(n)
	f := newFakeIPTables(t, othersLines...)
	changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vips...))
	if err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if changed != 2+n {
		t.Errorf("Sync changed = %d, want %d (chain, jump, %d rules)", changed, 2+n, n)
	}
	if want := []string{"new mangle/KST-HMARK", "insert mangle/PREROUTING 1 -m comment --comment kube-service-tunnel -j KST-HMARK", "restore mangle"}; !slices.Equal(f.writes, want) {
		t.Errorf("writes %q, want %q", f.writes, want)
	}
	checkChain := func(step string, want []netip.Addr) {
		t.Helper()
		rules := f.chains["mangle/KST-HMARK"]
		got := make([]netip.Addr, 0, len(rules))
		for _, r := range rules {
			vip, params, ok := rule{spec: strings.Fields(r.spec)}.vipRule()
			if !ok || params != testParams {
				t.Fatalf("%s: unexpected rule %q", step, r.spec)
			}
			got = append(got, vip)
		}
		want = slices.SortedFunc(slices.Values(want), netip.Addr.Compare)
		if !slices.Equal(got, want) {
			t.Errorf("%s: chain has %d rules, want %d, in address order", step, len(got), len(want))
		}
	}
	checkChain("first sync", vips)

	f.writes = nil
	if changed, err := newTestChain(t, f, testParams).Sync(targetsOf(vips...)); err != nil || changed != 0 || len(f.writes) != 0 {
		t.Errorf("adoption: changed %d, err %v, writes %q; want 0, nil, none", changed, err, f.writes)
	}

	swapped := slices.Concat(vips[1:], []netip.Addr{netip.MustParseAddr("10.200.0.1")})
	f.writes, f.restores = nil, nil
	changed, err = newTestChain(t, f, testParams).Sync(targetsOf(swapped...))
	if err != nil || changed != 2 {
		t.Errorf("swap one tunnel IP: changed %d, err %v; want 2, nil", changed, err)
	}
	if !slices.Equal(f.writes, []string{"restore mangle"}) {
		t.Errorf("swap one tunnel IP: writes %q, want one restore", f.writes)
	}
	if len(f.restores) == 1 {
		if got := strings.Count(f.restores[0], "\n-A KST-HMARK "); got != n {
			t.Errorf("swap one tunnel IP: restore payload has %d rules, want %d", got, n)
		}
	}
	checkChain("swap one tunnel IP", swapped)

	f.writes = nil
	other := Params{Buckets: 32, Offset: testParams.Offset, Seed: testParams.Seed}
	if changed, err := newTestChain(t, f, other).Sync(targetsOf(swapped...)); err != nil || changed != 2*n || !slices.Equal(f.writes, []string{"restore mangle"}) {
		t.Errorf("config change: changed %d, err %v, writes %q; want %d, nil, one restore", changed, err, f.writes, 2*n)
	}
}

// writeScript writes an executable shell script.
func writeScript(t *testing.T, path, body string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestExecRestorer runs ExecRestorer against stand-in iptables-restore
// scripts: it passes --noflush --counters --wait and the payload on stdin, and a
// failure reaches Sync's error with the tool's output but not the seed.
func TestExecRestorer(t *testing.T) {
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("needs /bin/sh")
	}
	dir := t.TempDir()
	writeScript(t, filepath.Join(dir, "iptables-restore"), `echo "$@" > "$(dirname "$0")/args"; cat > "$(dirname "$0")/stdin"`+"\n")
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump})...)
	c, err := NewChainWithRestorer(f, "", testParams, NewExecRestorer(filepath.Join(dir, "iptables")))
	if err != nil {
		t.Fatalf("NewChainWithRestorer: %v", err)
	}
	if changed, err := c.Sync(targetsOf(vipA)); err != nil || changed != 1 {
		t.Fatalf("Sync = %d, %v; want 1, nil", changed, err)
	}
	args, _ := os.ReadFile(filepath.Join(dir, "args"))
	stdin, _ := os.ReadFile(filepath.Join(dir, "stdin"))
	if string(args) != "--noflush --counters --wait\n" {
		t.Errorf("iptables-restore ran with %q, want --noflush --counters --wait", args)
	}
	if want := string(c.restorePayload(Table, []desiredRule{{spec: c.ruleSpec(vipA, testParams.Offset)}})); string(stdin) != want || !strings.HasPrefix(want, "*mangle\n:KST-HMARK - [0:0]\n-A KST-HMARK -d 10.96.0.10/32 ") {
		t.Errorf("iptables-restore read:\n%s\nwant:\n%s", stdin, want)
	}

	// A failing tool that echoes its input, as a verbose one might.
	writeScript(t, filepath.Join(dir, "iptables-legacy-restore"), "cat >&2; echo 'Error occurred at line: 3' >&2; exit 2\n")
	c, err = NewChainWithRestorer(f, "", testParams, NewExecRestorer(filepath.Join(dir, "iptables-legacy")))
	if err != nil {
		t.Fatalf("NewChainWithRestorer: %v", err)
	}
	changed, err := c.Sync(targetsOf(vipA, vipB))
	if err == nil || changed != 0 {
		t.Fatalf("Sync with a failing iptables-restore = %d, %v; want 0 and an error", changed, err)
	}
	for _, want := range []string{"iptables-legacy-restore", "exit status 2", "Error occurred at line: 3", "-d 10.96.0.20/32", "<seed " + SeedFingerprint(testParams.Seed) + ">"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Sync err = %q, want %q in it", err, want)
		}
	}
	if strings.Contains(err.Error(), "c0ffee") {
		t.Errorf("Sync err = %q shows the seed", err)
	}

	if err := NewExecRestorer(filepath.Join(dir, "iptables")).Restore("filter", []byte("*mangle\nCOMMIT\n")); err == nil {
		t.Errorf("Restore of a mangle payload as table filter: want an error")
	}
}

func TestNewExecRestorer(t *testing.T) {
	for in, want := range map[string]string{
		"":                       "iptables-restore",
		"iptables":               "iptables-restore",
		"iptables-legacy":        "iptables-legacy-restore",
		"/usr/sbin/iptables-nft": "/usr/sbin/iptables-nft-restore",
		"ip6tables":              "ip6tables-restore",
	} {
		if got := NewExecRestorer(in).Command; got != want {
			t.Errorf("NewExecRestorer(%q).Command = %q, want %q", in, got, want)
		}
	}
}

// TestNewChainRestorer checks which restorer NewChain picks.
func TestNewChainRestorer(t *testing.T) {
	f := newFakeIPTables(t)
	if c := newTestChain(t, f, testParams); c.restorer != Restorer(f) {
		t.Errorf("NewChain over an IPTables that restores: restorer %v, want the IPTables itself", c.restorer)
	}
	if c := newTestChain(t, plainIPTables{f}, testParams); c.restorer != nil {
		t.Errorf("NewChain over an IPTables that does not restore: restorer %v, want none", c.restorer)
	}
	if ipt, err := iptables.New(); err != nil {
		t.Logf("no go-iptables here (%v); not checking its default restorer", err)
	} else if r, ok := newTestChain(t, ipt, testParams).restorer.(*ExecRestorer); !ok || r.Command != "iptables-restore" {
		t.Errorf("NewChain over go-iptables: restorer %#v, want iptables-restore", r)
	}
	r := NewExecRestorer("iptables-legacy")
	if c, err := NewChainWithRestorer(f, "", testParams, r); err != nil || c.restorer != Restorer(r) {
		t.Errorf("NewChainWithRestorer: %v, %v; want the restorer given", c, err)
	}
	if _, err := NewChainWithRestorer(f, "", testParams, nil); err == nil {
		t.Errorf("NewChainWithRestorer(nil restorer): want an error")
	}
	if _, err := NewChainWithRestorer(nil, "", testParams, r); err == nil {
		t.Errorf("NewChainWithRestorer(nil iptables): want an error")
	}
}

func TestCleanup(t *testing.T) {
	tests := []struct {
		name  string
		lines []string
	}{
		{"synced", []string{printedChainN, printedJump, printedRuleA, printedRuleB}},
		{"extra jumps", []string{printedChainN, printedJump, printedRuleA, "-A PREROUTING -i eth0 -j KST-HMARK"}},
		{"chain without jump", []string{printedChainN, printedRuleA}},
		{"nothing there", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			if err := newTestChain(t, f, testParams).Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			if got, want := f.dump(), newFakeIPTables(t, othersLines...).dump(); got != want {
				t.Errorf("mangle after Cleanup:\n%s\nwant:\n%s", got, want)
			}
			if err := newTestChain(t, f, testParams).Cleanup(); err != nil {
				t.Errorf("second Cleanup: %v", err)
			}
		})
	}
}

func TestCounters(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump, printedRuleA, printedRuleB,
		"-A KST-HMARK -j MARK --set-xmark 0x1/0xffffffff",
		strings.Replace(printedRuleC, "--hmark-mod 16", "--hmark-mod 8", 1)})...)
	rules := f.chains["mangle/KST-HMARK"]
	rules[0].packets, rules[0].bytes = 10, 1500
	rules[1].packets, rules[1].bytes = 0, 0
	rules[2].packets, rules[2].bytes = 99, 99
	rules[3].packets, rules[3].bytes = 98, 98
	got, err := newTestChain(t, f, testParams).Counters()
	if err != nil {
		t.Fatalf("Counters: %v", err)
	}
	want := map[netip.Addr]Counter{vipA: {Packets: 10, Bytes: 1500}, vipB: {}}
	if len(got) != len(want) || got[vipA] != want[vipA] || got[vipB] != want[vipB] {
		t.Errorf("Counters = %v, want %v", got, want)
	}
	if len(f.writes) != 0 {
		t.Errorf("Counters wrote %q", f.writes)
	}
}

func TestParseRuleCounters(t *testing.T) {
	tests := []struct {
		line           string
		packets, bytes uint64
		spec           string
	}{
		// iptables 1.8 (legacy and nft): before the target.
		{"-A KST-HMARK -d 10.96.0.10/32 -c 12 3456 -j HMARK --hmark-mod 2", 12, 3456, "-d 10.96.0.10/32 -j HMARK --hmark-mod 2"},
		// go-iptables' rewrite of nft's "[P:B]" prefix: at the end.
		{"-A KST-HMARK -d 10.96.0.10/32 -j HMARK --hmark-mod 2 -c 7 8", 7, 8, "-d 10.96.0.10/32 -j HMARK --hmark-mod 2"},
	}
	for _, tt := range tests {
		r, ok, err := parseRule(tt.line, "KST-HMARK", true)
		if err != nil || !ok || !r.hasCounters || r.packets != tt.packets || r.bytes != tt.bytes || strings.Join(r.spec, " ") != tt.spec {
			t.Errorf("parseRule(%q) = %+v, %v, %v; want %d/%d and spec %q", tt.line, r, ok, err, tt.packets, tt.bytes, tt.spec)
		}
	}
}

func TestSplitWords(t *testing.T) {
	tests := []struct {
		line string
		want []string
	}{
		{"-A X -j ACCEPT", []string{"-A", "X", "-j", "ACCEPT"}},
		{`-A X -m comment --comment "a b \"c\" \\ d" -j ACCEPT`, []string{"-A", "X", "-m", "comment", "--comment", `a b "c" \ d`, "-j", "ACCEPT"}},
		{`-A X --comment ""  -j  Y `, []string{"-A", "X", "--comment", "", "-j", "Y"}},
	}
	for _, tt := range tests {
		got, err := splitWords(tt.line)
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("splitWords(%q) = %q, %v; want %q", tt.line, got, err, tt.want)
		}
	}
	if _, err := splitWords(`-A X --comment "open`); err == nil {
		t.Errorf("splitWords with an open quote: want an error")
	}
}

func TestNewChainValidates(t *testing.T) {
	f := newFakeIPTables(t)
	tests := []struct {
		name    string
		chain   string
		params  Params
		wantErr string
	}{
		{"default name", "", testParams, ""},
		{"own name", "KST-HMARK-2", testParams, ""},
		{"too long", strings.Repeat("K", 29), testParams, "longer than 28"},
		{"space", "KST HMARK", testParams, "without spaces"},
		{"option-like", "-KST", testParams, "must not start"},
		{"built-in", "PREROUTING", testParams, "reserved"},
		{"no buckets", "", Params{Seed: 1}, "at least 1"},
	}
	for _, tt := range tests {
		c, err := NewChain(f, tt.chain, tt.params)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%s: NewChain: %v", tt.name, err)
		case tt.wantErr == "" && tt.chain == "" && c.Name() != DefaultChainName:
			t.Errorf("%s: Name() = %q, want %q", tt.name, c.Name(), DefaultChainName)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%s: NewChain err = %v, want one containing %q", tt.name, err, tt.wantErr)
		}
	}
	if _, err := NewChain(nil, "", testParams); err == nil {
		t.Errorf("NewChain(nil iptables): want an error")
	}
}
