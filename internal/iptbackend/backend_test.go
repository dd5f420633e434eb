package iptbackend

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
)

// fakeNode is a node's iptables: which commands exist and what each
// backend's save prints (keyed "iptables-nft-save" or
// "iptables-nft-save -t mangle"; absent keys fail like a missing table).
type fakeNode struct {
	installed map[string]bool
	saves     map[string]string
}

func (n fakeNode) commands() Commands {
	return Commands{
		LookPath: func(file string) (string, error) {
			if n.installed[file] {
				return "/usr/sbin/" + file, nil
			}
			return "", &exec.Error{Name: file, Err: exec.ErrNotFound}
		},
		Output: func(name string, args ...string) ([]byte, error) {
			key := strings.Join(append([]string{name}, args...), " ")
			if out, ok := n.saves[key]; ok {
				return []byte(out), nil
			}
			if out, ok := n.saves[name]; ok && len(args) > 0 {
				// A whole-tables save answers the per-table read too.
				return []byte(out), nil
			}
			return nil, errors.New(key + ": table does not exist")
		},
	}
}

var both = map[string]bool{"iptables": true, "iptables-nft": true, "iptables-legacy": true}

const kubeletHint = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"

func rules(table string, n int) string {
	s := "*" + table + "\n:PREROUTING ACCEPT [0:0]\n"
	for range n {
		s += "-A PREROUTING -j ACCEPT\n"
	}
	return s + "COMMIT\n"
}

func TestChoose(t *testing.T) {
	for _, tc := range []struct {
		name      string
		requested Backend
		node      fakeNode
		want      Backend
	}{
		{"configured", Legacy, fakeNode{installed: both}, Legacy},
		{"neither installed: the node's own iptables", Auto, fakeNode{installed: map[string]bool{"iptables": true}}, System},
		{"only nft installed", Auto, fakeNode{installed: map[string]bool{"iptables-nft": true}}, NFT},
		{"only legacy installed", Auto, fakeNode{installed: map[string]bool{"iptables-legacy": true}}, Legacy},
		{"kubelet's hint in nft", Auto, fakeNode{installed: both, saves: map[string]string{
			"iptables-nft-save -t mangle": kubeletHint, "iptables-legacy-save": rules("filter", 50)}}, NFT},
		{"kubelet's hint in legacy (IPv6 only) beats more nft rules", Auto, fakeNode{installed: both, saves: map[string]string{
			"ip6tables-legacy-save": kubeletHint, "iptables-nft-save": rules("filter", 50)}}, Legacy},
		{"own chain in legacy from an earlier run", Auto, fakeNode{installed: both, saves: map[string]string{
			"iptables-legacy-save": "*mangle\n:KST-HMARK - [0:0]\nCOMMIT\n", "iptables-nft-save": rules("filter", 3)}}, Legacy},
		{"own chain in both: counted", Auto, fakeNode{installed: both, saves: map[string]string{
			"iptables-legacy-save": "*mangle\n:KST-HMARK - [0:0]\nCOMMIT\n",
			"iptables-nft-save":    "*mangle\n:KST-HMARK - [0:0]\n-A KST-HMARK -j RETURN\nCOMMIT\n"}}, NFT},
		{"more legacy rules", Auto, fakeNode{installed: both, saves: map[string]string{
			"iptables-legacy-save": rules("nat", 12), "iptables-nft-save": rules("filter", 11)}}, Legacy},
		{"more nft rules", Auto, fakeNode{installed: both, saves: map[string]string{
			"iptables-legacy-save": rules("nat", 2), "ip6tables-nft-save": rules("filter", 3)}}, NFT},
		{"empty node: nft", Auto, fakeNode{installed: both}, NFT},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Choose(tc.requested, "KST-HMARK", tc.node.commands())
			if err != nil {
				t.Fatal(err)
			}
			if got.Backend != tc.want {
				t.Errorf("chose %s (%s), want %s", got.Backend, got.Reason, tc.want)
			}
			if got.Reason == "" {
				t.Error("no reason given")
			}
		})
	}
}

func TestChooseErrors(t *testing.T) {
	if _, err := Choose(Auto, "KST-HMARK", fakeNode{}.commands()); err == nil || !strings.Contains(err.Error(), "install iptables") {
		t.Errorf("no iptables at all: %v, want an error saying to install it", err)
	}
	if _, err := Choose(Legacy, "KST-HMARK", fakeNode{installed: map[string]bool{"iptables-nft": true}}.commands()); err == nil || !strings.Contains(err.Error(), "--iptables-backend legacy") {
		t.Errorf("configured legacy without iptables-legacy: %v, want an error naming the flag", err)
	}
	if _, err := Parse("nftables"); err == nil {
		t.Error(`Parse("nftables") accepted`)
	}
}

func TestBinary(t *testing.T) {
	for b, want := range map[Backend]string{NFT: "ip6tables-nft", Legacy: "ip6tables-legacy", System: "ip6tables"} {
		if got := b.Binary("ip6tables"); got != want {
			t.Errorf("%s.Binary(ip6tables) = %q, want %q", b, got, want)
		}
	}
}
