package guard

import (
	"net/netip"
	"strconv"
	"strings"
	"testing"
)

var (
	pod     = netip.MustParseAddr("10.244.1.11")
	vip     = netip.MustParseAddr("192.0.2.10")
	routerA = netip.MustParseAddr("172.20.0.11")
	routerB = netip.MustParseAddr("172.20.0.12")
)

func greParams() Params {
	return Params{PodIP: pod, Routers: []netip.Addr{routerB, routerA, routerA}, TunnelIPs: []netip.Addr{vip}, Device: "kst-decap", Other: "kst-decap6"}
}

func TestRenderGRE(t *testing.T) {
	got := strings.Join(Render(greParams()).Body, "\n")
	want := strings.Join([]string{
		"-A KST-GUARD -s 172.20.0.11/32 -d 10.244.1.11/32 -p 47 -j RETURN",
		"-A KST-GUARD -s 172.20.0.12/32 -d 10.244.1.11/32 -p 47 -j RETURN",
		"-A KST-GUARD -d 10.244.1.11/32 -p 47 -m comment --comment kube-service-tunnel:carrier-source -j DROP",
		"-A KST-GUARD -d 192.0.2.10/32 -i kst-decap -j RETURN",
		"-A KST-GUARD -i kst-decap -m comment --comment kube-service-tunnel:inner-destination -j DROP",
		"-A KST-GUARD -i kst-decap6 -m comment --comment kube-service-tunnel:inner-destination -j DROP",
		"-A KST-GUARD -i lo -j RETURN",
		"-A KST-GUARD -d 192.0.2.10/32 -m comment --comment kube-service-tunnel:bypass -j DROP",
	}, "\n")
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
}

func TestRenderMPLSTrustsOnlyTheLoopbackPath(t *testing.T) {
	p := Params{MPLS: true, PodIP: netip.MustParseAddr("fd00::11"), TunnelIPs: []netip.Addr{netip.MustParseAddr("2001:db8::10")}}
	got := strings.Join(Render(p).Body, "\n")
	for _, line := range []string{
		"-A KST-GUARD -s ::1/128 -i lo -j RETURN",
		"-A KST-GUARD -s fd00::11/128 -i lo -j RETURN",
		"-A KST-GUARD -d 2001:db8::10/128 -i lo -j RETURN",
		"-A KST-GUARD -i lo -m comment --comment kube-service-tunnel:inner-destination -j DROP",
		"-A KST-GUARD -d 2001:db8::10/128 -m comment --comment kube-service-tunnel:bypass -j DROP",
	} {
		if !strings.Contains(got, line) {
			t.Errorf("missing %q in\n%s", line, got)
		}
	}
	if strings.Contains(got, "-p 47") {
		t.Errorf("mpls mode has no GRE rule:\n%s", got)
	}
}

func TestDigestFollowsTheRouters(t *testing.T) {
	a := Render(greParams())
	p := greParams()
	p.Routers = p.Routers[:1]
	if b := Render(p); a.Equal(b) {
		t.Fatal("a router less renders the same guard")
	}
	if b := Render(greParams()); !a.Equal(b) {
		t.Fatal("the same parameters render different guards")
	}
}

// save renders what iptables-save -c would show after Update's payload was
// applied to an empty table, with counters.
func save(r *Rules, drops map[string]int) string {
	var b strings.Builder
	b.WriteString("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j DROP\nCOMMIT\n*raw\n:PREROUTING ACCEPT [0:0]\n:KST-GUARD - [0:0]\n")
	b.WriteString("[0:0] -A PREROUTING -m comment --comment \"" + Comment + ":" + r.Digest + "\" -j KST-GUARD\n")
	for _, line := range r.Body {
		n := 0
		for reason, c := range drops {
			if strings.Contains(line, Comment+":"+reason) {
				n = c
			}
		}
		b.WriteString("[" + strconv.Itoa(n) + ":" + strconv.Itoa(n*100) + "] " + line + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

func TestParseUpdateRoundTrip(t *testing.T) {
	want := Render(greParams())
	if got := string(Update(want, Observed{})); !strings.Contains(got, "*raw\n:KST-GUARD - [0:0]\n") || !strings.HasSuffix(got, "-I PREROUTING 1 -m comment --comment kube-service-tunnel:"+want.Digest+" -j KST-GUARD\nCOMMIT\n") {
		t.Fatalf("first write:\n%s", got)
	}
	have := ParseSave(save(want, map[string]int{CarrierSource: 3, Bypass: 2}))
	if have.Rules != len(want.Body) || len(have.Jumps) != 1 || have.Digests[0] != want.Digest {
		t.Fatalf("parsed %+v", have)
	}
	if c := have.Dropped[CarrierSource]; c.Packets != 3 || c.Bytes != 300 {
		t.Errorf("carrier-source drops %+v, want 3 packets", c)
	}
	if c := have.Dropped[InnerDestination]; c.Packets != 0 {
		t.Errorf("inner-destination drops %+v, want 0", c)
	}
	if p := Update(want, have); p != nil {
		t.Fatalf("an up-to-date table is rewritten:\n%s", p)
	}
	p := greParams()
	p.Routers = nil
	changed := Render(p)
	got := string(Update(changed, have))
	if !strings.Contains(got, "-D PREROUTING -m comment --comment \"kube-service-tunnel:"+want.Digest+"\" -j KST-GUARD\n") || !strings.Contains(got, "-I PREROUTING 1 -m comment --comment kube-service-tunnel:"+changed.Digest) {
		t.Fatalf("change: want the old jump replaced:\n%s", got)
	}
	got = string(Update(nil, have))
	if !strings.HasSuffix(got, "-X KST-GUARD\nCOMMIT\n") || !strings.Contains(got, "-D PREROUTING") {
		t.Fatalf("removal:\n%s", got)
	}
	if Update(nil, ParseSave("*raw\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n")) != nil {
		t.Fatal("removing from a table without the guard writes something")
	}
}
