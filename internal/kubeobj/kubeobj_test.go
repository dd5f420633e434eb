package kubeobj

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestNodeAddress(t *testing.T) {
	for _, tc := range []struct {
		name  string
		addrs []corev1.NodeAddress
		want  string
	}{
		{"none", nil, "invalid IP"},
		{"hostname only", []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: "10.0.0.1"}}, "invalid IP"},
		{"internal before external", []corev1.NodeAddress{{Type: corev1.NodeExternalIP, Address: "192.0.2.1"}, {Type: corev1.NodeInternalIP, Address: "10.0.0.1"}}, "10.0.0.1"},
		{"external when no internal", []corev1.NodeAddress{{Type: corev1.NodeExternalIP, Address: "192.0.2.1"}}, "192.0.2.1"},
		{"first IPv4 internal", []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "fd00::1"}, {Type: corev1.NodeInternalIP, Address: "10.0.0.2"}, {Type: corev1.NodeInternalIP, Address: "10.0.0.3"}}, "10.0.0.2"},
		{"garbage skipped", []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "nope"}, {Type: corev1.NodeExternalIP, Address: "192.0.2.9"}}, "192.0.2.9"},
	} {
		got := NodeAddress(&corev1.Node{Status: corev1.NodeStatus{Addresses: tc.addrs}})
		if got.String() != tc.want {
			t.Errorf("%s: NodeAddress = %v, want %s", tc.name, got, tc.want)
		}
	}
}
