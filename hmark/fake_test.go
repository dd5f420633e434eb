package hmark

// The fake iptables and iptables-restore that the unit tests give Chain,
// and the fixtures they share.

import (
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// fakeIPTables is an in-memory iptables, and iptables-restore, with the
// behaviour Chain relies on: it prints rules back in iptables' normalized
// form (HMARK options rewritten, as in `iptables -S`), fails like iptables
// on missing chains and rules, and records every write call.
type fakeIPTables struct {
	// chains maps "table/chain" to its rules, each as printed after
	// "-A CHAIN ".
	chains map[string][]fakeRule
	// order keeps chain creation order for listing.
	order []string
	// writes records write calls, e.g. "insert mangle/PREROUTING 1 ..."
	// or "restore mangle".
	writes []string
	// restores records the payload of every Restore call.
	restores []string
	// reads records read calls: "save mangle", "exists raw/CHAIN",
	// "list mangle/CHAIN". With writes, they are every iptables,
	// iptables-save and iptables-restore process a real backend would
	// run (see iptablesCalls).
	reads []string
	// failWrite, when set, makes write calls whose record starts with it
	// fail.
	failWrite string
	// sets are the fake's ipsets (it is the IPSets seam too).
	sets map[string]*fakeSet
	// family is that of the fake's tables: iptables' or ip6tables'. Like
	// the kernel, it refuses a set match on a set of the other family, and
	// its seed sets ("-S") are of its family.
	family Family
}

// fakeSet is one ipset of the fake.
type fakeSet struct {
	typ      string
	family   uint8
	counters bool
	members  map[netip.Addr]Counter
	// ports are the elements of a hash:ip,port set.
	ports map[portElem]bool
}

// fakeElem names an entry as the fake records its writes: the address,
// and ",PROTO:PORT" for a hash:ip,port element.
func fakeElem(entry *netlink.IPSetEntry) string {
	a, _ := netip.AddrFromSlice(entry.IP)
	if entry.Port == nil || entry.Protocol == nil {
		return a.String()
	}
	return fmt.Sprintf("%s,%d:%d", a.Unmap(), *entry.Protocol, *entry.Port)
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
	_ IPSets   = (*fakeIPTables)(nil)
)

// newFakeIPTables returns an IPv4 fake with the built-in mangle and raw
// chains, then lines in `iptables -t mangle -S` form ("-N X", "-A X ...")
// applied; a line starting with "-t raw" is for the raw table.
func newFakeIPTables(t *testing.T, lines ...string) *fakeIPTables {
	t.Helper()
	return newFakeIPTablesFamily(t, IPv4, lines...)
}

// newFakeIPTablesFamily is newFakeIPTables for family: for IPv6 the fake
// is ip6tables, and its seed sets are inet6.
func newFakeIPTablesFamily(t *testing.T, family Family, lines ...string) *fakeIPTables {
	t.Helper()
	f := &fakeIPTables{chains: make(map[string][]fakeRule), sets: make(map[string]*fakeSet), family: family}
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
		case "-S":
			// "-S NAME [ADDR...]": a set like the router's, with members.
			set := &fakeSet{typ: SetType, family: family.setFamily(), counters: true, members: map[netip.Addr]Counter{}}
			if synSetPattern.MatchString(words[1]) {
				set.typ, set.counters = SynSetType, false
			}
			for _, a := range words[2:] {
				set.members[netip.MustParseAddr(a)] = Counter{}
			}
			f.sets[words[1]] = set
			continue
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

// synSetPattern names the SYN sets of the handshake memory (NAME-sG,
// NAME-scG): a seed line "-S" of such a name makes one.
var synSetPattern = regexp.MustCompile(`-sc?[0-9]+$`)

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
	f.reads = append(f.reads, "exists "+table+"/"+chain)
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

func (f *fakeIPTables) list(table, chain string) ([]string, error) {
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
		out = append(out, "-A "+chain+" "+spec)
	}
	return out, nil
}

func (f *fakeIPTables) List(table, chain string) ([]string, error) {
	f.reads = append(f.reads, "list "+table+"/"+chain)
	return f.list(table, chain)
}

// Save prints table as iptables-save -t table does: the chains in
// creation order (the built-in ones with their policy), then every rule.
func (f *fakeIPTables) Save(table string) ([]byte, error) {
	f.reads = append(f.reads, "save "+table)
	return f.save(table), nil
}

// save is what Save prints, without recording a read.
func (f *fakeIPTables) save(table string) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "# Generated by fake iptables-save\n*%s\n", table)
	var rules []string
	for _, key := range f.order {
		chain, ok := strings.CutPrefix(key, table+"/")
		if !ok {
			continue
		}
		policy := "-"
		if slices.Contains(builtinChains, chain) {
			policy = "ACCEPT"
		}
		fmt.Fprintf(&b, ":%s %s [0:0]\n", chain, policy)
		for _, r := range f.chains[key] {
			rules = append(rules, "-A "+chain+" "+r.spec)
		}
	}
	for _, r := range rules {
		b.WriteString(r + "\n")
	}
	b.WriteString("COMMIT\n# Completed\n")
	return []byte(b.String())
}

// iptablesCalls counts, by table, the iptables processes f's calls since
// reads and writes were last emptied stand for: every read and every
// write but the ipset ones.
func (f *fakeIPTables) iptablesCalls() map[string]int {
	n := map[string]int{}
	for _, call := range slices.Concat(f.reads, f.writes) {
		verb, rest, _ := strings.Cut(call, " ")
		if verb == "ipset" {
			continue
		}
		table, _, _ := strings.Cut(strings.Fields(rest)[0], "/")
		n[table]++
	}
	return n
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
	f.chains[key] = slices.Insert(rules, pos-1, fakeRule{spec: f.normalize(rulespec)})
	return nil
}

func (f *fakeIPTables) Delete(table, chain string, rulespec ...string) error {
	key := table + "/" + chain
	if err := f.write("delete %s %s", key, strings.Join(rulespec, " ")); err != nil {
		return err
	}
	spec := f.normalize(rulespec)
	i := slices.IndexFunc(f.chains[key], func(r fakeRule) bool { return r.spec == spec })
	if i < 0 {
		return errors.New("Bad rule (does a matching rule exist in that chain?)")
	}
	f.chains[key] = slices.Delete(f.chains[key], i, i+1)
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
			if j := slices.Index(words, "--match-set"); j >= 0 && j+1 < len(words) {
				switch set := f.sets[words[j+1]]; {
				case set == nil:
					return fmt.Errorf("restore: line %d %q: Set %s doesn't exist", i+2, line, words[j+1])
				case set.family != f.family.setFamily():
					return fmt.Errorf("restore: line %d %q: The protocol family of set %s is not applicable", i+2, line, words[j+1])
				}
			}
			chains[key] = append(chains[key], fakeRule{spec: f.normalize(words[2:]), packets: counters.packets, bytes: counters.bytes})
		default:
			return fmt.Errorf("restore: line %d %q: unexpected", i+2, line)
		}
	}
	f.chains, f.order = chains, order
	return nil
}

// normalize prints a rule spec the way iptables -S (or ip6tables -S)
// prints it back: HMARK's --hmark-tuple src,dst,sport,dport,proto becomes
// its prefixes (32 or 128) and masks, and the options come in
// libxt_HMARK's order and number formats.
func (f *fakeIPTables) normalize(spec []string) string {
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
		prefix := strconv.Itoa(f.family.bits())
		out = append(out, "--hmark-src-prefix", prefix, "--hmark-dst-prefix", prefix,
			"--hmark-sport-mask", "0xffff", "--hmark-dport-mask", "0xffff", "--hmark-proto-mask", "0xffff")
	}
	// Given in the printed form already: kept, in libxt_HMARK's order.
	for _, o := range []string{"--hmark-src-prefix", "--hmark-dst-prefix", "--hmark-sport-mask", "--hmark-dport-mask", "--hmark-proto-mask"} {
		if v, ok := opts[o]; ok && opts["--hmark-tuple"] == "" {
			out = append(out, o, v)
		}
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
		l, _ := f.list(table, chain)
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

// newTestChain returns the default chain over f, with params; f is its
// restorer too.
func newTestChain(t *testing.T, f *fakeIPTables, params Params) *Chain {
	t.Helper()
	c, err := NewChain(f, f, "", params, f)
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
	return sameIgnoringOrder(a, b, "-A PREROUTING ", "-A "+DefaultChainName+" ")
}

// sameIgnoringOrder compares two dumps, ignoring the order of the lines
// that start with one of unordered; every other line must be identical,
// order included.
func sameIgnoringOrder(a, b string, unordered ...string) bool {
	key := func(dump string) string {
		var fixed, free []string
		for _, l := range strings.Split(dump, "\n") {
			if slices.ContainsFunc(unordered, func(prefix string) bool { return strings.HasPrefix(l, prefix) }) {
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

// checkWrites compares f's writes with prefixes of the wanted ones.
func checkWrites(t *testing.T, step string, f *fakeIPTables, want []string) {
	t.Helper()
	ok := len(f.writes) == len(want)
	for i := 0; ok && i < len(want); i++ {
		ok = strings.HasPrefix(f.writes[i], want[i])
	}
	if !ok {
		t.Errorf("%s: writes:\n%s\nwant (prefixes):\n%s", step, strings.Join(f.writes, "\n"), strings.Join(want, "\n"))
	}
}

func (f *fakeIPTables) IpsetCreate(setname, typename string, options netlink.IpsetCreateOptions) error {
	if err := f.write("ipset create %s", setname); err != nil {
		return err
	}
	if _, ok := f.sets[setname]; ok {
		return nl.IPSetError(nl.IPSET_ERR_EXIST_SETNAME2)
	}
	f.sets[setname] = &fakeSet{typ: typename, family: options.Family, counters: options.Counters, members: map[netip.Addr]Counter{}, ports: map[portElem]bool{}}
	return nil
}

func (f *fakeIPTables) IpsetDestroy(setname string) error {
	if err := f.write("ipset destroy %s", setname); err != nil {
		return err
	}
	if _, ok := f.sets[setname]; !ok {
		return nil // like the kernel
	}
	for _, rules := range f.chains {
		for _, r := range rules {
			if strings.Contains(r.spec, "--match-set "+setname+" ") {
				return nl.IPSetError(nl.IPSET_ERR_BUSY)
			}
		}
	}
	delete(f.sets, setname)
	return nil
}

func (f *fakeIPTables) IpsetList(setname string) (*netlink.IPSetResult, error) {
	s, ok := f.sets[setname]
	if !ok {
		return nil, syscall.ENOENT
	}
	res := &netlink.IPSetResult{SetName: setname, TypeName: s.typ, Family: s.family}
	if s.counters {
		res.CadtFlags |= nl.IPSET_FLAG_WITH_COUNTERS
	}
	for e := range s.ports {
		proto, port := e.port.Protocol, e.port.Number
		res.Entries = append(res.Entries, netlink.IPSetEntry{IP: e.vip.AsSlice(), Protocol: &proto, Port: &port})
	}
	for a, c := range s.members {
		e := netlink.IPSetEntry{IP: a.AsSlice()}
		if s.counters {
			p, b := c.Packets, c.Bytes
			e.Packets, e.Bytes = &p, &b
		}
		res.Entries = append(res.Entries, e)
	}
	return res, nil
}

func (f *fakeIPTables) IpsetAdd(setname string, entry *netlink.IPSetEntry) error {
	a, _ := netip.AddrFromSlice(entry.IP)
	if err := f.write("ipset add %s %s", setname, fakeElem(entry)); err != nil {
		return err
	}
	s, ok := f.sets[setname]
	if !ok {
		return syscall.ENOENT
	}
	if entryFamily(entry) != s.family {
		return nl.IPSetError(nl.IPSET_ERR_PROTOCOL)
	}
	a = a.Unmap()
	if s.typ == PortSetType {
		e := portElem{a, Port{*entry.Protocol, *entry.Port}}
		if s.ports[e] {
			return nl.IPSetError(nl.IPSET_ERR_EXIST)
		}
		s.ports[e] = true
		return nil
	}
	if _, dup := s.members[a]; dup {
		return nl.IPSetError(nl.IPSET_ERR_EXIST)
	}
	s.members[a] = Counter{}
	return nil
}

func (f *fakeIPTables) IpsetDel(setname string, entry *netlink.IPSetEntry) error {
	a, _ := netip.AddrFromSlice(entry.IP)
	if err := f.write("ipset del %s %s", setname, fakeElem(entry)); err != nil {
		return err
	}
	s, ok := f.sets[setname]
	if !ok {
		return syscall.ENOENT
	}
	if entryFamily(entry) != s.family {
		return nl.IPSetError(nl.IPSET_ERR_PROTOCOL)
	}
	a = a.Unmap()
	if s.typ == PortSetType {
		e := portElem{a, Port{*entry.Protocol, *entry.Port}}
		if !s.ports[e] {
			return nl.IPSetError(nl.IPSET_ERR_EXIST)
		}
		delete(s.ports, e)
		return nil
	}
	if _, ok := s.members[a]; !ok {
		return nl.IPSetError(nl.IPSET_ERR_EXIST)
	}
	delete(s.members, a)
	return nil
}

// entryFamily is the address family netlink sends entry's address as: an
// address that To4 accepts (IPv4, or IPv4-mapped IPv6) goes as IPv4, and
// the kernel refuses it in an inet6 set (and an IPv6 one in an inet set)
// with "invalid protocol".
func entryFamily(entry *netlink.IPSetEntry) uint8 {
	if entry.IP.To4() != nil {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// dumpSets lists the fake's sets and members as ipsetstate does: "set
// NAME" and "member NAME ADDR", sorted.
func (f *fakeIPTables) dumpSets() string {
	var lines []string
	for name, s := range f.sets {
		lines = append(lines, "set "+name)
		for a := range s.members {
			lines = append(lines, "member "+name+" "+a.String())
		}
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// count adds packets to vip's counters in the set name, as traffic would.
func (f *fakeIPTables) count(name string, vip netip.Addr, packets, bytes uint64) {
	s := f.sets[name]
	c := s.members[vip]
	c.Packets += packets
	c.Bytes += bytes
	s.members[vip] = c
}
