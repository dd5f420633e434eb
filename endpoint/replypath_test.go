package endpoint

import (
	"net/netip"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestReplyPathProblemsUnderCalico: a served pod that Calico set up is
// named unless its allowedSourcePrefixes holds every tunnel IP it serves;
// pods of other plugins, unserved pods and covered ones are not.
func TestReplyPathProblemsUnderCalico(t *testing.T) {
	vip4, vip6 := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")
	pod := func(name string, annotations map[string]string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "demo", Name: name, Annotations: annotations}}
	}
	calico := func(allowed string) map[string]string {
		a := map[string]string{calicoPodIPsAnnotation: "10.244.2.5/32"}
		if allowed != "" {
			a[calicoAllowedSourcesAnnotation] = allowed
		}
		return a
	}
	pods := []*corev1.Pod{
		pod("flannel", nil),
		pod("bare", calico("")),
		pod("covered", calico(`["192.0.2.10/32", "2001:db8::/64"]`)),
		pod("half", calico(`["192.0.2.10"]`)),
		pod("garbled", calico(`192.0.2.10/32`)),
		pod("unserved", calico("")),
		{ObjectMeta: metav1.ObjectMeta{Namespace: "demo", Name: "old-calico", Annotations: map[string]string{calicoPodIPAnnotation: "10.244.2.9/32"}}},
	}
	desired := map[string]PodTunnels{
		"demo/flannel":    {TunnelIPs: []netip.Addr{vip4}},
		"demo/bare":       {TunnelIPs: []netip.Addr{vip4}},
		"demo/covered":    {TunnelIPs: []netip.Addr{vip4, vip6}},
		"demo/half":       {TunnelIPs: []netip.Addr{vip4, vip6}},
		"demo/garbled":    {TunnelIPs: []netip.Addr{vip4}},
		"demo/unserved":   {},
		"demo/old-calico": {TunnelIPs: []netip.Addr{vip4}},
	}
	got := replyPathProblems(desired, pods)
	want := map[string]string{
		"demo/bare":       `does not allow 192.0.2.10/32: Calico's Felix drops`,
		"demo/half":       `does not allow 2001:db8::10/128: Calico's Felix drops`,
		"demo/garbled":    `not a JSON list of prefixes`,
		"demo/old-calico": `'["192.0.2.10/32"]' in the pod template`,
	}
	if len(got) != len(want) {
		t.Fatalf("%d problems, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
	for pod, sub := range want {
		found := false
		for _, p := range got {
			if strings.HasPrefix(p, "pod "+pod+" ") || strings.HasPrefix(p, "pod "+pod+":") {
				found = true
				if !strings.Contains(p, sub) {
					t.Errorf("the problem of %s is %q, want it to say %q", pod, p, sub)
				}
			}
		}
		if !found {
			t.Errorf("no problem names %s:\n%s", pod, strings.Join(got, "\n"))
		}
	}
}
