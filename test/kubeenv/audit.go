package kubeenv

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

// AuditLog is the path of the API server's audit log (JSON lines), written
// when Options.AuditServiceAccountsOf is set.
func (e *Env) AuditLog() string { return filepath.Join(e.dir, "audit.log") }

// writeAuditPolicy writes an audit policy that logs, at the Metadata level,
// every request by a ServiceAccount of namespace and nothing else.
func writeAuditPolicy(dir, namespace string) (string, error) {
	policy := fmt.Sprintf(`apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:%s"]
  - level: None
`, namespace)
	path := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(path, []byte(policy), 0o600); err != nil {
		return "", fmt.Errorf("write audit policy: %w", err)
	}
	return path, nil
}

// AuditEvent is what a grant check needs of one audit.k8s.io/v1 Event.
type AuditEvent struct {
	User struct {
		Username string `json:"username"`
	} `json:"user"`
	Verb       string `json:"verb"`
	RequestURI string `json:"requestURI"`
	ObjectRef  *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
		APIGroup    string `json:"apiGroup"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
}

// ReadAuditLog reads an audit log of JSON lines.
func ReadAuditLog(path string) ([]AuditEvent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	defer f.Close()
	var events []AuditEvent
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for line := 1; sc.Scan(); line++ {
		var ev AuditEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("audit log %s line %d: %w", path, line, err)
		}
		events = append(events, ev)
	}
	return events, sc.Err()
}

// Grant is one verb on one resource of one API group, of one RBAC rule
// that a manifest binds to a ServiceAccount, in Namespace ("" when a
// ClusterRoleBinding grants it).
type Grant struct {
	User      string // system:serviceaccount:NAMESPACE:NAME
	Namespace string
	Source    string // the role and rule, for messages
	Verb      string
	APIGroup  string
	Resource  string // with its subresource: services/status
	// ResourceNames limits the grant to these names, when set.
	ResourceNames []string
}

func (g Grant) String() string {
	where := "cluster-wide"
	if g.Namespace != "" {
		where = "in namespace " + g.Namespace
	}
	resource := g.Resource
	if g.APIGroup != "" {
		resource += "." + g.APIGroup
	}
	s := fmt.Sprintf("%s %s of %s %s (%s)", g.Verb, resource, g.User, where, g.Source)
	if len(g.ResourceNames) > 0 {
		s += " named " + strings.Join(g.ResourceNames, ",")
	}
	return s
}

// Allows reports whether the grant covers a resource request, as the RBAC
// authorizer judges it (no wildcards: a manifest that uses them fails
// ManifestGrants).
func (g Grant) Allows(ev AuditEvent) bool {
	ref := ev.ObjectRef
	if ref == nil || ev.User.Username != g.User || ev.Verb != g.Verb {
		return false
	}
	if g.Namespace != "" && ref.Namespace != g.Namespace {
		return false
	}
	resource := ref.Resource
	if ref.Subresource != "" {
		resource += "/" + ref.Subresource
	}
	if g.APIGroup != ref.APIGroup || g.Resource != resource {
		return false
	}
	return len(g.ResourceNames) == 0 || slices.Contains(g.ResourceNames, ref.Name)
}

// ManifestGrants lists every rule that a multi-document manifest's
// RoleBindings and ClusterRoleBindings grant to ServiceAccounts, verb by
// verb, API group by group and resource by resource.
func ManifestGrants(manifest []byte) ([]Grant, error) {
	decoder := serializer.NewCodecFactory(scheme.Scheme).UniversalDeserializer()
	roles := map[string]*rbacv1.Role{}
	clusterRoles := map[string]*rbacv1.ClusterRole{}
	var bindings []*rbacv1.RoleBinding
	var clusterBindings []*rbacv1.ClusterRoleBinding
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(manifest)))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := decoder.Decode(doc, nil, nil)
		if err != nil {
			return nil, err
		}
		switch o := obj.(type) {
		case *rbacv1.Role:
			roles[o.Namespace+"/"+o.Name] = o
		case *rbacv1.ClusterRole:
			clusterRoles[o.Name] = o
		case *rbacv1.RoleBinding:
			bindings = append(bindings, o)
		case *rbacv1.ClusterRoleBinding:
			clusterBindings = append(clusterBindings, o)
		}
	}
	var grants []Grant
	add := func(subjects []rbacv1.Subject, namespace, source string, rules []rbacv1.PolicyRule) error {
		for _, s := range subjects {
			if s.Kind != rbacv1.ServiceAccountKind {
				continue
			}
			for i, rule := range rules {
				for _, field := range [][]string{rule.APIGroups, rule.Resources, rule.Verbs, rule.ResourceNames} {
					if slices.Contains(field, "*") {
						return fmt.Errorf("%s rule %d: a wildcard grants what no test can show used", source, i)
					}
				}
				for _, verb := range rule.Verbs {
					for _, group := range rule.APIGroups {
						for _, resource := range rule.Resources {
							grants = append(grants, Grant{User: "system:serviceaccount:" + s.Namespace + ":" + s.Name, Namespace: namespace,
								Source: fmt.Sprintf("%s rule %d", source, i), Verb: verb, APIGroup: group, Resource: resource, ResourceNames: rule.ResourceNames})
						}
					}
				}
			}
		}
		return nil
	}
	for _, b := range clusterBindings {
		role, ok := clusterRoles[b.RoleRef.Name]
		if b.RoleRef.Kind != "ClusterRole" || !ok {
			return nil, fmt.Errorf("ClusterRoleBinding %s: no ClusterRole %s in the manifest", b.Name, b.RoleRef.Name)
		}
		if err := add(b.Subjects, "", "ClusterRole "+role.Name, role.Rules); err != nil {
			return nil, err
		}
	}
	for _, b := range bindings {
		var rules []rbacv1.PolicyRule
		source := ""
		switch b.RoleRef.Kind {
		case "Role":
			role, ok := roles[b.Namespace+"/"+b.RoleRef.Name]
			if !ok {
				return nil, fmt.Errorf("RoleBinding %s/%s: no Role %s in the manifest", b.Namespace, b.Name, b.RoleRef.Name)
			}
			rules, source = role.Rules, "Role "+b.Namespace+"/"+role.Name
		case "ClusterRole":
			role, ok := clusterRoles[b.RoleRef.Name]
			if !ok {
				return nil, fmt.Errorf("RoleBinding %s/%s: no ClusterRole %s in the manifest", b.Namespace, b.Name, b.RoleRef.Name)
			}
			rules, source = role.Rules, "ClusterRole "+role.Name+" in "+b.Namespace
		}
		if err := add(b.Subjects, b.Namespace, source, rules); err != nil {
			return nil, err
		}
	}
	return grants, nil
}

// stripComments drops YAML comment lines, so that a document of comments
// only counts as empty.
func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("#")) {
			out = append(out, line)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

// UnusedGrants returns the grants that no successful request of events
// needed.
func UnusedGrants(grants []Grant, events []AuditEvent) []Grant {
	var unused []Grant
	for _, g := range grants {
		used := slices.ContainsFunc(events, func(ev AuditEvent) bool {
			return g.Allows(ev) && (ev.ResponseStatus == nil || ev.ResponseStatus.Code != 403)
		})
		if !used {
			unused = append(unused, g)
		}
	}
	return unused
}

// Forbidden returns the requests of users that answered 403.
func Forbidden(events []AuditEvent, users ...string) []AuditEvent {
	var out []AuditEvent
	for _, ev := range events {
		if ev.ResponseStatus != nil && ev.ResponseStatus.Code == 403 && slices.Contains(users, ev.User.Username) {
			out = append(out, ev)
		}
	}
	return out
}
