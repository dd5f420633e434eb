package kubeenv_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/cmdnu/kube-service-tunnel/test/kubeenv"
)

// TestGrantChecks: the checks that the lab cluster runs on its audit log
// find a grant that no request used, and match requests as RBAC does
// (namespace, subresource, resource name).
func TestGrantChecks(t *testing.T) {
	manifest, err := os.ReadFile(filepath.Join("..", "..", "tunnel-router.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	grants, err := kubeenv.ManifestGrants(manifest)
	if err != nil {
		t.Fatal(err)
	}
	const router = "system:serviceaccount:kube-service-tunnel:tunnel-router"
	find := func(verb, resource, namespace string) *kubeenv.Grant {
		for i, g := range grants {
			if g.User == router && g.Verb == verb && g.Resource == resource && g.Namespace == namespace {
				return &grants[i]
			}
		}
		t.Fatalf("no grant %s %s in %q to the router in the manifest", verb, resource, namespace)
		return nil
	}
	event := func(s string) kubeenv.AuditEvent {
		var ev kubeenv.AuditEvent
		if err := json.Unmarshal([]byte(s), &ev); err != nil {
			t.Fatal(err)
		}
		return ev
	}
	seed := find("get", "secrets", "kube-service-tunnel")
	patchStatus := find("patch", "services/status", "")
	for _, tc := range []struct {
		grant *kubeenv.Grant
		event string
		want  bool
	}{
		{seed, `{"user":{"username":"` + router + `"},"verb":"get","objectRef":{"resource":"secrets","namespace":"kube-service-tunnel","name":"tunnel-hmark-seed"},"responseStatus":{"code":200}}`, true},
		{seed, `{"user":{"username":"` + router + `"},"verb":"get","objectRef":{"resource":"secrets","namespace":"kube-service-tunnel","name":"another"}}`, false},
		{seed, `{"user":{"username":"` + router + `"},"verb":"get","objectRef":{"resource":"secrets","namespace":"default","name":"tunnel-hmark-seed"}}`, false},
		{seed, `{"user":{"username":"system:serviceaccount:kube-service-tunnel:tunnel-endpoint"},"verb":"get","objectRef":{"resource":"secrets","namespace":"kube-service-tunnel","name":"tunnel-hmark-seed"}}`, false},
		{patchStatus, `{"user":{"username":"` + router + `"},"verb":"patch","objectRef":{"resource":"services","subresource":"status","namespace":"team-a","name":"web"}}`, true},
		{patchStatus, `{"user":{"username":"` + router + `"},"verb":"patch","objectRef":{"resource":"services","namespace":"team-a","name":"web"}}`, false},
	} {
		if got := tc.grant.Allows(event(tc.event)); got != tc.want {
			t.Errorf("%v allows %s: %v, want %v", tc.grant, tc.event, got, tc.want)
		}
	}
	used := []kubeenv.AuditEvent{event(`{"user":{"username":"` + router + `"},"verb":"get","objectRef":{"resource":"secrets","namespace":"kube-service-tunnel","name":"tunnel-hmark-seed"},"responseStatus":{"code":200}}`)}
	unused := kubeenv.UnusedGrants(grants, used)
	if len(unused) != len(grants)-1 {
		t.Errorf("%d of %d grants unused after one request for the seed, want all but one", len(unused), len(grants))
	}
	for _, g := range unused {
		if g.Source == seed.Source && g.Verb == "get" {
			t.Errorf("%v counted unused after a request it allows", g)
		}
	}
	denied := event(`{"user":{"username":"` + router + `"},"verb":"get","objectRef":{"resource":"secrets","namespace":"kube-service-tunnel","name":"tunnel-hmark-seed"},"responseStatus":{"code":403}}`)
	if n := len(kubeenv.UnusedGrants(grants, []kubeenv.AuditEvent{denied})); n != len(grants) {
		t.Errorf("a denied request counted as using a grant: %d unused of %d", n, len(grants))
	}
	if got := kubeenv.Forbidden([]kubeenv.AuditEvent{denied}, router); len(got) != 1 {
		t.Errorf("Forbidden found %d of 1 denied requests", len(got))
	}
}
