package hmark

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
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
	// writes records write calls, e.g. "append mangle/KST-HMARK ...".
	writes []string
	// failWrite, when set, makes write calls whose record starts with it
	// fail.
	failWrite string
}

type fakeRule struct {
	spec           string
	packets, bytes uint64
}

var errFake = errors.New("fake iptables failure")

// builtinChains are mangle's built-in chains, listed with a policy.
var builtinChains = []string{"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}

var _ IPTables = (*fakeIPTables)(nil)

// newFakeIPTables returns a fake with the built-in mangle chains, then
// lines in `iptables -t mangle -S` form ("-N X", "-A X ...") applied.
func newFakeIPTables(t *testing.T, lines ...string) *fakeIPTables {
	t.Helper()
	f := &fakeIPTables{chains: make(map[string][]fakeRule)}
	for _, c := range builtinChains {
		f.addChain("mangle/" + c)
	}
	for _, line := range lines {
		words, err := splitWords(line)
		if err != nil || len(words) < 2 {
			t.Fatalf("bad seed line %q: %v", line, err)
		}
		key := "mangle/" + words[1]
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
func (f *fakeIPTables) dump() string {
	var lines []string
	for _, key := range f.order {
		chain := strings.TrimPrefix(key, "mangle/")
		l, _ := f.list("mangle", chain, false)
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

func TestSyncFromScratch(t *testing.T) {
	f := newFakeIPTables(t, othersLines...)
	c := newTestChain(t, f, testParams)
	changed, err := c.Sync([]netip.Addr{vipC, vipA, vipB, vipA})
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
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			before := f.dump()
			changed, err := newTestChain(t, f, tt.params).Sync([]netip.Addr{vipA, vipB})
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if changed != 0 || len(f.writes) != 0 {
				t.Errorf("Sync changed = %d, writes %q; want none", changed, f.writes)
			}
			if f.dump() != before {
				t.Errorf("state changed:\n%s\nwant:\n%s", f.dump(), before)
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
		name       string
		lines      []string
		wantWrites []string // prefixes of the expected write calls, in order
	}{
		{"chain missing", []string{printedJump},
			[]string{"new", "append mangle/KST-HMARK -d 10.96.0.10/32", "append mangle/KST-HMARK -d 10.96.0.20/32"}},
		{"jump missing", []string{printedChainN, printedRuleA, printedRuleB},
			[]string{"insert mangle/PREROUTING 1"}},
		{"rule missing", []string{printedChainN, printedJump, printedRuleB},
			[]string{"append mangle/KST-HMARK -d 10.96.0.10/32"}},
		{"stale tunnel IP", []string{printedChainN, printedJump, printedRuleA, printedRuleC, printedRuleB},
			[]string{"delete mangle/KST-HMARK #2"}},
		{"duplicate rule", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedRuleA},
			[]string{"delete mangle/KST-HMARK #3"}},
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
			"delete mangle/KST-HMARK #4", "delete mangle/KST-HMARK #3", "delete mangle/KST-HMARK #1"}},
		{"other parameters after a config change", []string{printedChainN, printedJump, hmarkA("--hmark-mod 8"),
			strings.Replace(printedRuleB, "0x00c0ffee", "0x00c0fffe", 1)},
			[]string{"append mangle/KST-HMARK -d 10.96.0.10/32", "append mangle/KST-HMARK -d 10.96.0.20/32",
				"delete mangle/KST-HMARK #2", "delete mangle/KST-HMARK #1"}},
		{"duplicate jump", []string{printedChainN, printedJump, printedRuleA, printedRuleB, printedJump},
			[]string{"delete mangle/PREROUTING -m comment --comment kube-service-tunnel -j KST-HMARK"}},
		{"jump of another shape", []string{printedChainN, "-A PREROUTING -i eth0 -g KST-HMARK", printedRuleA, printedRuleB},
			[]string{"insert mangle/PREROUTING 1", "delete mangle/PREROUTING -i eth0 -g KST-HMARK"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeIPTables(t, slices.Concat(othersLines, tt.lines)...)
			changed, err := newTestChain(t, f, testParams).Sync([]netip.Addr{vipB, vipA})
			if err != nil {
				t.Fatalf("Sync: %v", err)
			}
			if changed != len(f.writes) {
				t.Errorf("Sync changed = %d, but made %d writes", changed, len(f.writes))
			}
			if len(f.writes) != len(tt.wantWrites) {
				t.Fatalf("writes:\n%s\nwant %d:\n%s", strings.Join(f.writes, "\n"), len(tt.wantWrites), strings.Join(tt.wantWrites, "\n"))
			}
			for i, w := range tt.wantWrites {
				if !strings.HasPrefix(f.writes[i], w) {
					t.Errorf("write %d = %q, want prefix %q", i, f.writes[i], w)
				}
			}
			if got, want := f.dump(), canonicalState(t, printedRuleA, printedRuleB); !sameState(got, want) {
				t.Errorf("mangle after Sync:\n%s\nwant:\n%s", got, want)
			}
			// A second Sync has nothing left to do.
			f.writes = nil
			if changed, err := newTestChain(t, f, testParams).Sync([]netip.Addr{vipA, vipB}); err != nil || changed != 0 {
				t.Errorf("second Sync: changed %d, err %v, writes %q; want 0, nil", changed, err, f.writes)
			}
		})
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
}

func TestSyncRejectsNonIPv4(t *testing.T) {
	f := newFakeIPTables(t)
	_, err := newTestChain(t, f, testParams).Sync([]netip.Addr{vipA, netip.MustParseAddr("2001:db8::1")})
	if err == nil || !strings.Contains(err.Error(), "not an IPv4") {
		t.Errorf("Sync with an IPv6 tunnel IP: err = %v, want not an IPv4 address", err)
	}
	if len(f.writes) != 0 {
		t.Errorf("writes %q, want none", f.writes)
	}
	mapped := netip.AddrFrom16(vipA.As16())
	if _, err := newTestChain(t, f, testParams).Sync([]netip.Addr{mapped}); err != nil {
		t.Errorf("Sync with 4-in-6 %s: %v", mapped, err)
	}
}

func TestSyncWrapsErrors(t *testing.T) {
	f := newFakeIPTables(t, slices.Concat(othersLines, []string{printedChainN, printedJump})...)
	f.failWrite = "append mangle/KST-HMARK -d 10.96.0.20/32"
	changed, err := newTestChain(t, f, testParams).Sync([]netip.Addr{vipA, vipB})
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
