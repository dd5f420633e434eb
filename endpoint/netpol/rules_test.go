package netpol

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// saved renders what iptables-save prints for r (with the agent's jumps
// and a foreign rule), for the pure tests.
func saved(r *Rules, extraJumps ...string) string {
	var b strings.Builder
	b.WriteString("*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j KST-POLICY\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\n")
	for _, c := range r.Chains {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	b.WriteString("[5:300] -A INPUT -s 10.9.9.9/32 -j ACCEPT\n")
	for _, vip := range r.VIPs {
		b.WriteString("[0:0] -A INPUT " + strings.Join(Jump(vip), " ") + "\n")
	}
	for _, j := range extraJumps {
		b.WriteString("[0:0] -A INPUT " + j + "\n")
	}
	for _, l := range r.Body {
		if strings.Contains(l, "-j DROP") {
			b.WriteString("[7:420] ")
		}
		b.WriteString(strings.Replace(l, Comment+":"+r.Digest, `"`+Comment+":"+r.Digest+`"`, 1) + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

func TestUpdate(t *testing.T) {
	a, b := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("192.0.2.11")
	office := Ingress{Isolated: true, Rules: []Rule{{
		Sources: []Source{{Prefix: netip.MustParsePrefix("203.0.113.0/24"), Except: []netip.Prefix{netip.MustParsePrefix("203.0.113.4/32")}}},
		Ports:   []Port{{Protocol: "TCP", First: 80, Last: 80}},
	}}}
	denyAll := Ingress{Isolated: true}
	one := Render(office, []netip.Addr{a})
	two := Render(office, []netip.Addr{a, b})

	if Render(office, nil) != nil {
		t.Fatal("a pod that serves nothing must get no rules")
	}
	tracking := Render(Ingress{}, []netip.Addr{a})
	if tracking == nil || tracking.Isolated || len(tracking.VIPs) != 0 || len(tracking.Body) != 1 || !strings.Contains(tracking.Body[0], "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN") {
		t.Fatalf("a pod that no policy isolates must get its connection tracking rule alone, and no jump: %+v", tracking)
	}
	if p := string(Update(tracking, ParseSave(saved(one)))); !strings.Contains(p, "-D INPUT -d 192.0.2.10/32") || !strings.Contains(p, "-X KST-POLICY-0") || strings.Contains(p, "-I INPUT") {
		t.Errorf("no longer isolated: the jump and subchain must go, the chain stay:\n%s", p)
	}
	if one.Digest == two.Digest || one.Digest == Render(denyAll, []netip.Addr{a}).Digest {
		t.Fatal("different rules got the same digest")
	}
	have := ParseSave(saved(one))
	if have.Digest != one.Digest || have.Counts[Chain] != one.Counts[Chain] || have.Counts[Chain+"-0"] != 2 || len(have.Jumps) != 1 {
		t.Fatalf("ParseSave: %+v", have)
	}
	if d := have.Dropped[a]; d.Packets != 7 || d.Bytes != 420 {
		t.Errorf("dropped counters of %v: %+v, want 7 packets, 420 bytes", a, d)
	}
	if p := Update(one, have); p != nil {
		t.Errorf("the table holds the policy already, but Update writes:\n%s", p)
	}

	for _, c := range []struct {
		name       string
		want       *Rules
		have       Observed
		contains   []string
		notContain []string
	}{
		{"from empty", one, ParseSave("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"),
			[]string{":KST-POLICY - [0:0]", ":KST-POLICY-0 - [0:0]", "-I INPUT 1 -d 192.0.2.10/32", "-j DROP"}, []string{"-D ", "-X "}},
		{"second tunnel IP", two, have,
			[]string{":KST-POLICY - [0:0]", "-I INPUT 1 -d 192.0.2.11/32", "-A KST-POLICY -d 192.0.2.11/32"}, []string{"-I INPUT 1 -d 192.0.2.10/32", "-D "}},
		{"deny all drops the subchain", Render(denyAll, []netip.Addr{a}), have,
			[]string{":KST-POLICY - [0:0]", ":KST-POLICY-0 - [0:0]", "-X KST-POLICY-0"}, []string{"-I INPUT"}},
		{"removal", nil, ParseSave(saved(two)),
			[]string{"-D INPUT -d 192.0.2.10/32", "-D INPUT -d 192.0.2.11/32", "-X KST-POLICY\n", "-X KST-POLICY-0"}, []string{"-A ", "10.9.9.9"}},
		{"duplicate and stray jumps", one, ParseSave(saved(one, strings.Join(Jump(a), " "), "-d 192.0.2.99/32 -m comment --comment kube-service-tunnel -j KST-POLICY")),
			[]string{"-D INPUT -d 192.0.2.10/32", "-D INPUT -d 192.0.2.99/32"}, []string{":KST-POLICY", "-I INPUT", "10.9.9.9"}},
		{"drift in the chain", one, func() Observed { o := have; o.Counts = map[string]int{Chain: 2, Chain + "-0": 2}; return o }(),
			[]string{":KST-POLICY - [0:0]"}, nil},
	} {
		p := string(Update(c.want, c.have))
		if p == "" {
			t.Errorf("%s: Update wrote nothing", c.name)
			continue
		}
		for _, s := range c.contains {
			if !strings.Contains(p, s) {
				t.Errorf("%s: payload lacks %q:\n%s", c.name, s, p)
			}
		}
		for _, s := range c.notContain {
			if strings.Contains(p, s) {
				t.Errorf("%s: payload has %q:\n%s", c.name, s, p)
			}
		}
	}
	if p := Update(nil, ParseSave("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n")); p != nil {
		t.Errorf("nothing of ours, nothing wanted, yet Update writes:\n%s", p)
	}
}

// TestRenderByFamily: the rules of one family's tunnel IPs name only that
// family's sources (iptables refuses an IPv6 address, ip6tables an IPv4
// one), and a rule whose peers are all of the other family admits nothing
// of this one; a rule without peers admits both.
func TestRenderByFamily(t *testing.T) {
	v4, v6 := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")
	in := Ingress{Isolated: true, Rules: []Rule{
		{Sources: []Source{
			{Prefix: netip.MustParsePrefix("203.0.113.0/24"), Except: []netip.Prefix{netip.MustParsePrefix("203.0.113.4/32")}},
			{Prefix: netip.MustParsePrefix("2001:db8:77::/48"), Except: []netip.Prefix{netip.MustParsePrefix("2001:db8:77::4/128")}},
			{Prefix: netip.MustParsePrefix("10.244.1.5/32")},
			{Prefix: netip.MustParsePrefix("fd00:10:244::5/128")},
		}, AllPorts: true},
		{Sources: []Source{{Prefix: netip.MustParsePrefix("198.51.100.0/24")}}, Ports: []Port{{Protocol: "TCP", First: 443, Last: 443}}},
		{AllSources: true, Ports: []Port{{Protocol: "UDP", First: 53, Last: 53}}},
	}}
	for _, tc := range []struct {
		name      string
		vips      []netip.Addr
		want, not []string
	}{
		{"IPv4", []netip.Addr{v4, v6}, []string{"-s 203.0.113.0/24 -j KST-POLICY-0", "-A KST-POLICY-0 -s 203.0.113.4/32", "-s 10.244.1.5/32 -j ACCEPT",
			"-s 198.51.100.0/24 -p tcp --dport 443", "-A KST-POLICY -p udp --dport 53 -j ACCEPT", "-d 192.0.2.10/32 -j DROP"}, []string{"2001:", "fd00:"}},
		{"IPv6", []netip.Addr{v6, v4}, []string{"-s 2001:db8:77::/48 -j KST-POLICY-0", "-A KST-POLICY-0 -s 2001:db8:77::4/128", "-s fd00:10:244::5/128 -j ACCEPT",
			"-A KST-POLICY -p udp --dport 53 -j ACCEPT", "-d 2001:db8::10/128 -j DROP"}, []string{"203.0.113", "10.244.1.5", "198.51.100", "192.0.2.10", "--dport 443"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Render(in, tc.vips)
			body := strings.Join(r.Body, "\n")
			for _, s := range tc.want {
				if !strings.Contains(body, s) {
					t.Errorf("rules lack %q:\n%s", s, body)
				}
			}
			for _, s := range tc.not {
				if strings.Contains(body, s) {
					t.Errorf("rules hold %q of the other family:\n%s", s, body)
				}
			}
			if len(r.VIPs) != 1 || r.VIPs[0] != tc.vips[0] {
				t.Errorf("VIPs = %v, want the first family's alone", r.VIPs)
			}
		})
	}
	// The IPv4 rules of a pod without IPv6 peers are what they were before
	// IPv6: the digests adopted from an earlier version stay.
	only4 := Ingress{Isolated: true, Rules: []Rule{{Sources: []Source{{Prefix: netip.MustParsePrefix("203.0.113.0/24")}}, AllPorts: true}}}
	mixed := only4
	mixed.Rules = []Rule{{Sources: append(slices.Clone(only4.Rules[0].Sources), Source{Prefix: netip.MustParsePrefix("2001:db8:77::/48")}), AllPorts: true}}
	if a, b := Render(only4, []netip.Addr{v4}), Render(mixed, []netip.Addr{v4}); a.Digest != b.Digest {
		t.Errorf("an IPv6 peer changed the IPv4 rules: %s vs %s", a.Digest, b.Digest)
	}
}
