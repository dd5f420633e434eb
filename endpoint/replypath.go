package endpoint

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Calico's annotations on a pod. Its CNI plugin records the pod's
// addresses in the first two when it sets the pod's network up: their
// presence says Calico's Felix guards the pod's interface, where it drops
// every packet whose source is not the pod's own unless the pod's
// allowedSourcePrefixes (honoured only with FelixConfiguration
// workloadSourceSpoofing: Any) lists it. The replies come from the tunnel
// IPs. Read from Calico v3.31.0's source
// (libcalico-go/lib/backend/k8s/conversion/workload_endpoint_default.go).
const (
	calicoPodIPAnnotation          = "cni.projectcalico.org/podIP"
	calicoPodIPsAnnotation         = "cni.projectcalico.org/podIPs"
	calicoAllowedSourcesAnnotation = "cni.projectcalico.org/allowedSourcePrefixes"
)

// replyPathProblems names the served pods whose network plugin drops their
// replies from their tunnel IPs, one line each for the agent's log: a pod
// that Calico set up without an allowedSourcePrefixes annotation holding
// each of its tunnel IPs. desired is by pod key; pods are the node's.
func replyPathProblems(desired map[string]PodTunnels, pods []*corev1.Pod) []string {
	var problems []string
	for _, pod := range pods {
		pt, ok := desired[pod.Namespace+"/"+pod.Name]
		if !ok || len(pt.TunnelIPs) == 0 {
			continue
		}
		_, calico := pod.Annotations[calicoPodIPAnnotation]
		if _, ok := pod.Annotations[calicoPodIPsAnnotation]; ok {
			calico = true
		}
		if !calico {
			continue
		}
		allowed, err := allowedSourcePrefixes(pod.Annotations[calicoAllowedSourcesAnnotation])
		if err != nil {
			problems = append(problems, fmt.Sprintf("pod %s/%s: annotation %s: %v: Calico's Felix drops the pod's replies from its tunnel IPs %v (docs/network-plugins.md#calico)",
				pod.Namespace, pod.Name, calicoAllowedSourcesAnnotation, err, pt.TunnelIPs))
			continue
		}
		var missing []string
		for _, ip := range pt.TunnelIPs {
			if !slices.ContainsFunc(allowed, func(p netip.Prefix) bool { return p.Contains(ip) }) {
				missing = append(missing, netip.PrefixFrom(ip, ip.BitLen()).String())
			}
		}
		if len(missing) == 0 {
			continue
		}
		want, _ := json.Marshal(missing)
		problems = append(problems, fmt.Sprintf("pod %s/%s is on Calico's network (its CNI plugin annotated %s) and its annotation %s does not allow %s: Calico's Felix drops the pod's replies from them. Set FelixConfiguration default's workloadSourceSpoofing: Any first (Felix rejects a pod that asks for prefixes without it), then %s: '%s' in the pod template (docs/network-plugins.md#calico)",
			pod.Namespace, pod.Name, calicoPodIPsAnnotation, calicoAllowedSourcesAnnotation, strings.Join(missing, ", "), calicoAllowedSourcesAnnotation, want))
	}
	slices.Sort(problems)
	return problems
}

// allowedSourcePrefixes parses Calico's annotation: a JSON list of
// prefixes (or addresses); empty means none.
func allowedSourcePrefixes(value string) ([]netip.Prefix, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	var list []string
	if err := json.Unmarshal([]byte(value), &list); err != nil {
		return nil, fmt.Errorf("not a JSON list of prefixes: %w", err)
	}
	var out []netip.Prefix
	for _, s := range list {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return nil, fmt.Errorf("%q is not a prefix", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, p.Masked())
	}
	return out, nil
}
