// Package iptbackend chooses which iptables backend the router writes its
// rules with. iptables 1.8 has two that do not see each other: "legacy"
// (the kernel's x_tables) and "nft" (nftables through the xtables
// compatibility layer). A daemon in a container must use the node's: a rule
// written with the other one runs in another hook order and is invisible
// to the node's tools. Like kube-proxy's iptables-wrapper, Choose looks at
// which backend already holds rules.
package iptbackend

import (
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
)

// Backend is an iptables backend.
type Backend string

const (
	// Auto detects the node's backend (see Choose).
	Auto Backend = "auto"
	// NFT is iptables-nft (nftables).
	NFT Backend = "nft"
	// Legacy is iptables-legacy (x_tables).
	Legacy Backend = "legacy"
	// System is whichever backend the "iptables" on PATH uses: what a
	// router installed on the node (not in a container) has always used.
	System Backend = "system"
)

// Parse checks a --iptables-backend value.
func Parse(s string) (Backend, error) {
	switch b := Backend(s); b {
	case Auto, NFT, Legacy, System:
		return b, nil
	}
	return "", fmt.Errorf("iptables backend %q: want auto, nft, legacy or system", s)
}

// Binary is the backend's command for family, "iptables" or "ip6tables":
// "iptables-nft", "ip6tables-legacy", or plain "iptables" for System. Its
// restore and save commands add "-restore" and "-save".
func (b Backend) Binary(family string) string {
	if b == System || b == Auto || b == "" {
		return family
	}
	return family + "-" + string(b)
}

// Choice is a chosen backend and why, for the start-up log.
type Choice struct {
	Backend Backend
	Reason  string
}

// Commands are Choose's seams to the system: LookPath finds a command,
// Output runs one and returns its standard output.
type Commands struct {
	LookPath func(file string) (string, error)
	Output   func(name string, args ...string) ([]byte, error)
}

// Choose returns requested unless it is Auto. Auto picks, in this order:
//  1. the only one of iptables-nft and iptables-legacy that is installed,
//     or System when neither is (a node's own iptables);
//  2. the backend holding kubelet's KUBE-IPTABLES-HINT or
//     KUBE-KUBELET-CANARY chain in its mangle table (kubelet writes one
//     with the node's backend; nft is checked first, as iptables-wrapper
//     does, and legacy's tables are read whole so that reading creates
//     none);
//  3. the backend holding ownChain (the router's own chain, from an earlier
//     run), when only one does, so that a restart keeps its backend;
//  4. the backend with more rules, IPv4 and IPv6 together;
//  5. nft, the default of current distributions, when both are empty.
//
// A backend whose save command fails (for example legacy on a kernel
// without x_tables) counts as holding nothing.
func Choose(requested Backend, ownChain string, cmd Commands) (Choice, error) {
	if requested != Auto {
		if _, err := cmd.LookPath(requested.Binary("iptables")); err != nil {
			return Choice{}, fmt.Errorf("--iptables-backend %s: %w", requested, err)
		}
		return Choice{Backend: requested, Reason: "configured"}, nil
	}
	_, nftErr := cmd.LookPath(NFT.Binary("iptables"))
	_, legacyErr := cmd.LookPath(Legacy.Binary("iptables"))
	switch {
	case nftErr != nil && legacyErr != nil:
		if _, err := cmd.LookPath("iptables"); err != nil {
			return Choice{}, errors.New("no iptables command on PATH: install iptables (1.8 or later), or use the project's image")
		}
		return Choice{Backend: System, Reason: "neither iptables-nft nor iptables-legacy is installed: using iptables"}, nil
	case legacyErr != nil:
		return Choice{Backend: NFT, Reason: "only iptables-nft is installed"}, nil
	case nftErr != nil:
		return Choice{Backend: Legacy, Reason: "only iptables-legacy is installed"}, nil
	}
	save := func(b Backend, args ...string) []byte {
		var all []byte
		for _, family := range []string{"iptables", "ip6tables"} {
			out, err := cmd.Output(b.Binary(family)+"-save", args...)
			if err == nil {
				all = append(all, out...)
			}
		}
		return all
	}
	nftMangle := save(NFT, "-t", "mangle")
	if kubeletChains.Match(nftMangle) {
		return Choice{Backend: NFT, Reason: "kubelet's chains are in nft"}, nil
	}
	legacyAll := save(Legacy)
	if kubeletChains.Match(legacyAll) {
		return Choice{Backend: Legacy, Reason: "kubelet's chains are in legacy"}, nil
	}
	if ownChain != "" {
		declares := regexp.MustCompile(`(?m)^:` + regexp.QuoteMeta(ownChain) + ` `)
		inNFT, inLegacy := declares.Match(nftMangle), declares.Match(legacyAll)
		switch {
		case inNFT && !inLegacy:
			return Choice{Backend: NFT, Reason: "chain " + ownChain + " of an earlier run is in nft"}, nil
		case inLegacy && !inNFT:
			return Choice{Backend: Legacy, Reason: "chain " + ownChain + " of an earlier run is in legacy"}, nil
		}
	}
	nftRules, legacyRules := countRules(save(NFT)), countRules(legacyAll)
	switch {
	case legacyRules > nftRules:
		return Choice{Backend: Legacy, Reason: fmt.Sprintf("legacy holds more rules (%d) than nft (%d)", legacyRules, nftRules)}, nil
	case nftRules > legacyRules:
		return Choice{Backend: NFT, Reason: fmt.Sprintf("nft holds more rules (%d) than legacy (%d)", nftRules, legacyRules)}, nil
	}
	return Choice{Backend: NFT, Reason: fmt.Sprintf("no hint (%d rules in each): nft, the default of current distributions", nftRules)}, nil
}

var kubeletChains = regexp.MustCompile(`(?m)^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) `)

// countRules counts the rules ("-A" lines) of iptables-save output.
func countRules(save []byte) int {
	n := 0
	for _, line := range bytes.Split(save, []byte("\n")) {
		if bytes.HasPrefix(line, []byte("-A ")) {
			n++
		}
	}
	return n
}

// Host runs the commands on this machine.
var Host = Commands{
	LookPath: exec.LookPath,
	Output:   func(name string, args ...string) ([]byte, error) { return exec.Command(name, args...).Output() },
}
