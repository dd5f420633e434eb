package bgp

import (
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

func TestParseValidConfig(t *testing.T) {
	cfg, err := Parse([]byte(`
asn: 64512
nextHop: 198.51.100.7
nextHopIPv6: 2001:db8:100::7
gracefulRestart: {enabled: true, restartTime: 60s}
peers:
- address: 198.51.100.1
  asn: 64500
  holdTime: 9s
  keepaliveTime: 3s
  bfd: {minInterval: 100ms, multiplier: 5}
  nodeSelector: {matchLabels: {rack: r1}}
- address: 2001:db8::1
  asn: 64501
  ebgpMultihop: 2
`))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ASN != 64512 || cfg.NextHop != "198.51.100.7" || cfg.NextHopIPv6 != "2001:db8:100::7" || len(cfg.Peers) != 2 || cfg.Peers[0].holdTime() != 9*time.Second || cfg.Peers[1].holdTime() != DefaultHoldTime {
		t.Fatalf("parsed %+v", cfg)
	}
	if !cfg.Peers[0].Selects(map[string]string{"rack": "r1", "node": "tunnel"}) || cfg.Peers[0].Selects(map[string]string{"rack": "r2"}) {
		t.Error("nodeSelector matchLabels rack=r1 not applied")
	}
	if !cfg.Peers[1].Selects(nil) {
		t.Error("a peer without nodeSelector must select every node")
	}
	if cfg.WithdrawWait() != DefaultWithdrawDelay {
		t.Errorf("withdraw wait %v", cfg.WithdrawWait())
	}
}

func TestParseRejectsBadConfigNamingTheField(t *testing.T) {
	for _, tc := range []struct{ yaml, field string }{
		{`peers: [{address: 198.51.100.1, asn: 1}]`, "asn: must be set"},
		{`{asn: 1, peers: []}`, "peers: at least one"},
		{`{asn: 1, peers: [{address: nope, asn: 2}]}`, "peers[0].address"},
		{`{asn: 1, peers: [{address: 198.51.100.1}]}`, "peers[0].asn"},
		{`{asn: 1, peers: [{address: 198.51.100.1, asn: 2}, {address: 198.51.100.1, asn: 3}]}`, "peers[1].address: 198.51.100.1 is also peers[0]"},
		{`{asn: 1, peers: [{address: 198.51.100.1, asn: 2, holdTime: 2s}]}`, "peers[0].holdTime"},
		{`{asn: 1, peers: [{address: 198.51.100.1, asn: 2, holdTime: 9s, keepaliveTime: 9s}]}`, "peers[0].keepaliveTime"},
		{`{asn: 1, peers: [{address: 198.51.100.1, asn: 2, passwordFile: /nonexistent}]}`, "peers[0].passwordFile"},
		{`{asn: 1, peers: [{address: 198.51.100.1, asn: 2, nodeSelector: {matchExpressions: [{key: a, operator: Bad}]}}]}`, "peers[0].nodeSelector"},
		{`{asn: 1, routerID: "2001:db8::1", peers: [{address: 198.51.100.1, asn: 2}]}`, "routerID"},
		{`{asn: 1, peer: [{address: 198.51.100.1, asn: 2}]}`, `unknown field "peer"`},
		{`{asn: 1, gracefulRestart: {enabled: true, restartTime: 2h}, peers: [{address: 198.51.100.1, asn: 2}]}`, "gracefulRestart.restartTime"},
		{`{asn: 1, nextHop: "2001:db8::1", peers: [{address: 198.51.100.1, asn: 2}]}`, `nextHop: "2001:db8::1" is not an IPv4 address`},
		{`{asn: 1, nextHop: nope, peers: [{address: 198.51.100.1, asn: 2}]}`, `nextHop: "nope"`},
		{`{asn: 1, nextHopIPv6: 192.0.2.1, peers: [{address: 198.51.100.1, asn: 2}]}`, `nextHopIPv6: "192.0.2.1" is not a global IPv6 address`},
		{`{asn: 1, nextHopIPv6: "::ffff:192.0.2.1", peers: [{address: 198.51.100.1, asn: 2}]}`, `nextHopIPv6: "::ffff:192.0.2.1"`},
		{`{asn: 1, nextHopIPv6: "fe80::1", peers: [{address: 198.51.100.1, asn: 2}]}`, `nextHopIPv6: "fe80::1"`},
		{`{asn: 1, nextHop6: "2001:db8::1", peers: [{address: 198.51.100.1, asn: 2}]}`, `unknown field "nextHop6"`},
	} {
		_, err := Parse([]byte(tc.yaml))
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: error %v, want one naming %q", tc.yaml, err, tc.field)
		}
	}
}

// TestManifestExampleParses keeps the example in tunnel-router.yaml valid.
func TestManifestExampleParses(t *testing.T) {
	data, err := os.ReadFile("../../tunnel-router.yaml")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var cm corev1.ConfigMap
		if err := yaml.Unmarshal([]byte(doc), &cm); err != nil || cm.Kind != "ConfigMap" || cm.Name != "tunnel-bgp" {
			continue
		}
		found = true
		if _, err := Parse([]byte(cm.Data["bgp.yaml"])); err != nil {
			t.Fatalf("tunnel-router.yaml's tunnel-bgp bgp.yaml: %v", err)
		}
	}
	if !found {
		t.Fatal("tunnel-router.yaml has no ConfigMap tunnel-bgp")
	}
}
