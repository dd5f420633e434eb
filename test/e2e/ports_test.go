package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cmdnu/kube-service-tunnel/router"
	"github.com/cmdnu/kube-service-tunnel/test/lab/attack"
)

// 17. A tunnel IP carries only its Service's ports. The client sends UDP
// datagrams to a port the Service does not list (the pod listens there on
// every address): none arrives, and the routers count them as dropped
// before encapsulation; TCP to the Service's port still answers. With
// cmd.nu/tunnel-ports: all on the Service, the same datagrams arrive.
func servicePortsOnly(t *testing.T, e *env) {
	ctx := context.Background()
	vips := tunnelIPs(17)
	target := e.Pods[0]
	e.deploy(t, "ports", vips, target)
	ns, err := target.NS()
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	listener, err := attack.Listen(ns, attackPort)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()

	dropped := func() map[string]int {
		out := map[string]int{}
		for _, vip := range vips {
			out[vip.String()], _ = e.routerSum(t, "kube_service_tunnel_router_port_dropped_packets_total{", `vip="`+vip.String()+`"`)
		}
		return out
	}
	// send sends attackPackets datagrams to each tunnel IP's unlisted port
	// and returns how many of each arrived.
	send := func(label string) []int {
		got := make([]int, len(vips))
		for i, vip := range vips {
			token := fmt.Sprintf("ports/%s/%s/%d", label, vip, time.Now().UnixNano())
			if err := attack.SendUDP(e.client, netip.AddrPortFrom(vip, attackPort), []byte(token), attackPackets); err != nil {
				t.Fatal(err)
			}
			time.Sleep(attack.Settle)
			got[i] = listener.Count(token)
			t.Logf("udp to %s port %d %s %s: %d of %d delivered", familyName(vip), attackPort, label, e.Opts.Mode, got[i], attackPackets)
			e.who(t, "tcp", vip, 0) // the Service's port answers
		}
		return got
	}

	before := dropped()
	got := send("not in spec.ports")
	after := dropped()
	for i, vip := range vips {
		if got[i] != 0 {
			t.Errorf("%s: %d of %d datagrams to port %d (not in spec.ports) delivered, want 0", vip, got[i], attackPackets, attackPort)
		}
		if d := after[vip.String()] - before[vip.String()]; d < attackPackets {
			t.Errorf("%s: the routers counted +%d dropped, want %d", vip, d, attackPackets)
		} else {
			t.Logf("%s: the routers counted +%d dropped", vip, d)
		}
	}

	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{router.PortsAnnotation: router.AllPorts}}})
	if _, err := e.Kube.CoreV1().Services(e.Opts.Namespace).Patch(ctx, "ports", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	// The routers apply it at their next sync of the Service: poll.
	deadline := time.Now().Add(30 * time.Second)
	for {
		got = send("with " + router.PortsAnnotation + ": " + router.AllPorts)
		if got[0] == attackPackets && got[1] == attackPackets {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("with %s: %s, the datagrams still do not arrive: %v of %d", router.PortsAnnotation, router.AllPorts, got, attackPackets)
		}
	}
}
