package router

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/hmark"
)

func TestPortFilter(t *testing.T) {
	ports := []corev1.ServicePort{
		{Port: 80},
		{Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(53)},
		{Protocol: corev1.ProtocolSCTP, Port: 3868, TargetPort: intstr.FromString("diameter")},
		{Protocol: corev1.ProtocolTCP, Port: 443, TargetPort: intstr.FromInt32(8443)},
	}
	listed := []hmark.Port{{Protocol: 6, Number: 80}, {Protocol: 17, Number: 53}, {Protocol: 132, Number: 3868}, {Protocol: 6, Number: 443}}
	for _, tc := range []struct {
		name        string
		annotation  *string
		ports       []corev1.ServicePort
		wantFilter  bool
		wantPorts   []hmark.Port
		wantProblem []string
	}{
		{name: "the Service's ports by default", ports: ports, wantFilter: true, wantPorts: listed, wantProblem: []string{"spec.ports[3]: targetPort 8443 differs from port 443"}},
		{name: "every port", annotation: ptr("all"), ports: ports},
		{name: "every port, spaces", annotation: ptr(" all "), ports: ports[:1]},
		{name: "a bad value filters", annotation: ptr("any"), ports: ports[:1], wantFilter: true, wantPorts: listed[:1], wantProblem: []string{`metadata.annotations[cmd.nu/tunnel-ports]="any"`}},
		{name: "no port: ICMP alone", wantFilter: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "a"}, Spec: corev1.ServiceSpec{Ports: tc.ports}}
			if tc.annotation != nil {
				svc.Annotations = map[string]string{PortsAnnotation: *tc.annotation}
			}
			filter, got, problems := PortFilter(svc)
			if filter != tc.wantFilter || !slices.Equal(got, tc.wantPorts) {
				t.Errorf("PortFilter = %v, %v; want %v, %v", filter, got, tc.wantFilter, tc.wantPorts)
			}
			if len(problems) != len(tc.wantProblem) {
				t.Fatalf("problems %q, want %d", problems, len(tc.wantProblem))
			}
			for i, p := range tc.wantProblem {
				if !strings.Contains(problems[i], p) {
					t.Errorf("problem %q, want it to name %q", problems[i], p)
				}
			}
		})
	}
	if got := describePorts(true, listed[:2]); got != "ports tcp/80, udp/53" {
		t.Errorf("describePorts = %q", got)
	}
}
