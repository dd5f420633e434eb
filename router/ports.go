package router

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/cmdnu/kube-service-tunnel/hmark"
	"golang.org/x/sys/unix"
)

// PortsAnnotation on a Service opts its tunnel IPs into every port and
// protocol (value AllPorts): GRE or ESP into a pod, a pod's whole port
// range. Without it a tunnel IP carries only the Service's spec.ports
// (and ICMP), as kube-proxy and MetalLB expose a Service's ports alone.
const PortsAnnotation = "cmd.nu/tunnel-ports"

// AllPorts is PortsAnnotation's one value.
const AllPorts = "all"

// PortFilter returns what svc's tunnel IPs carry: every protocol and port
// (filter false), or the protocols and ports of spec.ports (port, not
// targetPort: the tunnel does not translate ports), TCP when a port names
// no protocol. problems describe what the router cannot honour, each
// naming the field: an annotation value other than AllPorts (the tunnel IP
// is then filtered, the safe side), and a numeric targetPort that differs
// from its port.
func PortFilter(svc *corev1.Service) (filter bool, ports []hmark.Port, problems []string) {
	if v, ok := svc.Annotations[PortsAnnotation]; ok {
		if strings.TrimSpace(v) == AllPorts {
			return false, nil, nil
		}
		problems = append(problems, fmt.Sprintf("metadata.annotations[%s]=%q: the only value is %q (every port and protocol); the tunnel IPs carry only spec.ports", PortsAnnotation, v, AllPorts))
	}
	for i, p := range svc.Spec.Ports {
		proto := uint8(unix.IPPROTO_TCP)
		switch p.Protocol {
		case corev1.ProtocolUDP:
			proto = unix.IPPROTO_UDP
		case corev1.ProtocolSCTP:
			proto = unix.IPPROTO_SCTP
		}
		if p.Port < 1 || p.Port > 65535 {
			problems = append(problems, fmt.Sprintf("spec.ports[%d].port %d is not a port; left out", i, p.Port))
			continue
		}
		ports = append(ports, hmark.Port{Protocol: proto, Number: uint16(p.Port)})
		if p.TargetPort.Type == intstr.Int && p.TargetPort.IntVal != 0 && p.TargetPort.IntVal != p.Port {
			problems = append(problems, fmt.Sprintf("spec.ports[%d]: targetPort %d differs from port %d, but a tunnel IP does not translate ports: the pods receive port %d", i, p.TargetPort.IntVal, p.Port, p.Port))
		}
	}
	return true, ports, problems
}

// describePorts names what a tunnel IP carries, for its event.
func describePorts(filter bool, ports []hmark.Port) string {
	if !filter {
		return "every port and protocol (" + PortsAnnotation + ": " + AllPorts + ")"
	}
	if len(ports) == 0 {
		return "no port (spec.ports is empty: only ICMP)"
	}
	names := map[uint8]string{unix.IPPROTO_TCP: "tcp", unix.IPPROTO_UDP: "udp", unix.IPPROTO_SCTP: "sctp"}
	parts := make([]string, len(ports))
	for i, p := range ports {
		parts[i] = fmt.Sprintf("%s/%d", names[p.Protocol], p.Number)
	}
	return "ports " + strings.Join(parts, ", ")
}
