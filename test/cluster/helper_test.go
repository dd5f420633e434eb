package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cmdnu/kube-service-tunnel/test/lab"
	"github.com/cmdnu/kube-service-tunnel/test/lab/kstate"
	"github.com/cmdnu/kube-service-tunnel/test/support/procnet"
)

// TestNodeHelper runs in lab-worker: it serves, on the nodes' link, what
// TestInCluster in lab-router needs to see of this node, until asked to
// stop:
//
//	GET  /kstate   the node's kernel state (kstate.Snapshot of its root namespace), JSON
//	GET  /sockets  every pod's TCP sockets (podSockets), JSON
//	GET  /podlogs  ?namespace=NS&pod=NAME: the pod's containers' logs, text
//	GET  /debug    routes, MPLS routes, links, addresses and the tails of the pods' logs, text
//	GET  /cpu      the VM's CPU time, in all and by process name, text
//	GET  /kube-proxy  the filter table with counters (iptables-save -c) and kube-proxy's log's tail, text
//	POST /kube-proxy  ?mode=MODE: (re)starts kube-proxy in MODE (lab.KubeProxyStart)
//	GET  /iptables    ?table=T: iptables-save -c -t T, text
//	GET  /netfilter   every iptables rule and nftables table with counters, and the sysctls that judge replies, text
//	POST /stop     ends the helper
func TestNodeHelper(t *testing.T) {
	if os.Getenv(roleEnv) != "worker" {
		t.Skip("runs in the lab cluster's worker VM; TestCluster boots it")
	}
	quietNetlinkLog()
	stop := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("GET /kstate", func(w http.ResponseWriter, r *http.Request) {
		st, err := kstate.Snapshot(r.Context(), nodeNS)
		writeJSON(w, st, err)
	})
	mux.HandleFunc("GET /sockets", func(w http.ResponseWriter, r *http.Request) {
		pods, err := allPodSockets()
		writeJSON(w, pods, err)
	})
	mux.HandleFunc("GET /debug", func(w http.ResponseWriter, r *http.Request) {
		for _, args := range [][]string{{"/sbin/ip", "route"}, {"/sbin/ip", "-f", "mpls", "route"}, {"/sbin/ip", "-br", "link"}, {"/sbin/ip", "-br", "addr"},
			{"sh", "-c", "for f in /var/log/pods/*/*/*.log; do echo \"== $f\"; tail -n 20 \"$f\"; done"},
			{"tail", "-n", "20", lab.FlannelLog}, {"tail", "-n", "20", lab.CalicoLog}, {"tail", "-n", "20", lab.KubeProxyLog},
			{"/sbin/ip", "-s", "link"}, {"/sbin/ip", "neigh"},
			{"sh", "-c", "for n in /run/netns/cni-*; do n=${n#/run/netns/}; echo \"== $n\"; /sbin/ip -n $n -br addr; /sbin/ip -n $n route; /sbin/ip -n $n -f mpls route; /sbin/ip -n $n -s link show eth0; /sbin/ip -n $n neigh; done"}} {
			out, err := exec.CommandContext(r.Context(), args[0], args[1:]...).CombinedOutput()
			fmt.Fprintf(w, "$ %s (%v)\n%s\n", strings.Join(args, " "), err, out)
		}
	})
	mux.HandleFunc("GET /podlogs", func(w http.ResponseWriter, r *http.Request) {
		logs, err := podLogs(r.URL.Query().Get("namespace"), r.URL.Query().Get("pod"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_, _ = io.WriteString(w, logs)
	})
	// The NetworkPolicy engine's packet verdicts and the tail of its log.
	mux.HandleFunc("GET /engine", func(w http.ResponseWriter, r *http.Request) {
		if clusterCNI() == cniCalico {
			out, err := exec.CommandContext(r.Context(), "iptables-save", "-c", "-t", "filter").CombinedOutput()
			if err != nil {
				fmt.Fprintf(w, "iptables-save: %v: %s\n", err, out)
				return
			}
			_, _ = io.WriteString(w, felixPolicyVerdicts(string(out)))
			return
		}
		if metrics, err := engineMetrics(r.Context()); err != nil {
			fmt.Fprintf(w, "metrics: %v\n", err)
		} else {
			fmt.Fprintf(w, "%s", metrics)
		}
		out, _ := exec.CommandContext(r.Context(), "tail", "-n", "30", knpLog).CombinedOutput()
		fmt.Fprintf(w, "== %s\n%s", knpLog, out)
		out, _ = exec.CommandContext(r.Context(), "sh", "-c", "ps | grep -v grep | grep kube-network; ls -la /var/run/secrets/kubernetes.io/serviceaccount/; cat /proc/net/netfilter/nfnetlink_queue").CombinedOutput()
		fmt.Fprintf(w, "== processes, token, queues\n%s", out)
	})
	mux.HandleFunc("GET /cpu", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, lab.CPUByProcess(15))
	})
	mux.HandleFunc("GET /kube-proxy", func(w http.ResponseWriter, r *http.Request) {
		out, err := exec.CommandContext(r.Context(), "iptables-save", "-c", "-t", "filter").CombinedOutput()
		if err != nil {
			http.Error(w, fmt.Sprintf("iptables-save: %v: %s", err, out), http.StatusInternalServerError)
			return
		}
		tail, _ := exec.CommandContext(r.Context(), "tail", "-n", "20", lab.KubeProxyLog).CombinedOutput()
		fmt.Fprintf(w, "%s\n== %s\n%s", out, lab.KubeProxyLog, tail)
	})
	mux.HandleFunc("GET /iptables", func(w http.ResponseWriter, r *http.Request) {
		out, err := exec.CommandContext(r.Context(), "iptables-save", "-c", "-t", r.URL.Query().Get("table")).CombinedOutput()
		if err != nil {
			http.Error(w, fmt.Sprintf("iptables-save: %v: %s", err, out), http.StatusInternalServerError)
			return
		}
		_, _ = w.Write(out)
	})
	mux.HandleFunc("GET /netfilter", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, netfilterState(r.Context()))
	})
	mux.HandleFunc("POST /kube-proxy", func(w http.ResponseWriter, r *http.Request) {
		out, err := exec.CommandContext(r.Context(), lab.KubeProxyStart, r.URL.Query().Get("mode")).CombinedOutput()
		if err != nil {
			http.Error(w, fmt.Sprintf("%s: %v: %s", lab.KubeProxyStart, err, out), http.StatusInternalServerError)
		}
	})
	mux.HandleFunc("POST /stop", func(w http.ResponseWriter, r *http.Request) {
		close(stop)
	})
	ln, err := net.Listen("tcp", net.JoinHostPort(workerNode.linkAddr, strconv.Itoa(helperPort)))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Logf("serving on %s", ln.Addr())
	<-stop
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(ctx)
}

// engineMetrics returns the lines of kube-network-policies' metrics that
// count packets by verdict.
// felixPolicyVerdicts is what Calico's Felix, the NetworkPolicy engine
// under Calico, did to the pods' incoming packets, from iptables-save -c
// output: each DROP of its to-workload chains (cali-tw-*, "no policy
// passed the packet") as a line in the form of kube-network-policies'
// metrics (verdict="drop"), which engineDrops sums, and its policy
// chains' rules with their counters.
func felixPolicyVerdicts(save string) string {
	var b strings.Builder
	for l := range strings.Lines(save) {
		l = strings.TrimSpace(l)
		counters, rule, ok := strings.Cut(strings.TrimPrefix(l, "["), "] ")
		if !ok || !strings.HasPrefix(rule, "-A cali-") {
			continue
		}
		chain := strings.Fields(rule)[1]
		packets, _, _ := strings.Cut(counters, ":")
		switch {
		case strings.HasPrefix(chain, "cali-tw-") && strings.HasSuffix(rule, "-j DROP"):
			fmt.Fprintf(&b, "felix_packets{chain=%q,verdict=\"drop\"} %s\n", chain, packets)
		case strings.HasPrefix(chain, "cali-pi-"):
			fmt.Fprintf(&b, "# %s %s\n", packets, rule)
		}
	}
	return b.String()
}

func engineMetrics(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+knpMetrics+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	var lines []string
	for _, l := range strings.Split(string(body), "\n") {
		if strings.Contains(l, "packet") && !strings.HasPrefix(l, "#") {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n") + "\n", nil
}

func writeJSON(w http.ResponseWriter, v any, err error) {
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// podLogs is what kubelet logged of every container of pod namespace/name
// on this node (/var/log/pods/NAMESPACE_NAME_UID/CONTAINER/N.log).
func podLogs(namespace, name string) (string, error) {
	files, err := filepath.Glob(filepath.Join("/var/log/pods", namespace+"_"+name+"_*", "*", "*.log"))
	if err != nil {
		return "", err
	}
	if len(files) == 0 {
		return "", fmt.Errorf("no logs of pod %s/%s on this node", namespace, name)
	}
	var b strings.Builder
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		b.Write(data)
	}
	return b.String(), nil
}

// podSockets are the TCP sockets of one pod's network namespace.
type podSockets struct {
	// NetNS is the namespace's path (containerd's /run/netns/cni-...).
	NetNS string
	// Addrs are the pod's IPv4 addresses on eth0, AllAddrs those of every
	// link (a tunnel IP included).
	Addrs, AllAddrs []netip.Addr
	// Conns are its TCP sockets.
	Conns []tcpSocket
}

// tcpSocket is one line of /proc/net/tcp.
type tcpSocket = procnet.TCPSocket

// allPodSockets reads the sockets of every network namespace containerd
// made for a pod.
func allPodSockets() ([]podSockets, error) {
	paths, err := filepath.Glob("/run/netns/cni-*")
	if err != nil {
		return nil, err
	}
	var pods []podSockets
	for _, p := range paths {
		ps, err := socketsIn(p)
		if errors.Is(err, fs.ErrNotExist) {
			// The sandbox of a pod being deleted went away between the
			// glob and the open: it has no sockets left to report.
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		pods = append(pods, ps)
	}
	return pods, nil
}

// socketsIn reads /proc/thread-self/net/tcp from a thread inside the
// namespace at path, and the namespace's eth0 addresses.
func socketsIn(path string) (podSockets, error) {
	ps := podSockets{NetNS: path}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return ps, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return ps, err
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return ps, err
	}
	eth0, _ := h.LinkByName("eth0")
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP.To4())
		if !ok {
			continue
		}
		ps.AllAddrs = append(ps.AllAddrs, ip)
		if eth0 != nil && a.LinkIndex == eth0.Attrs().Index {
			ps.Addrs = append(ps.Addrs, ip)
		}
	}
	done := make(chan error, 1)
	go func() {
		// The thread is thrown away afterwards (never unlocked), so no
		// goroutine runs in the pod's namespace by accident.
		runtime.LockOSThread()
		if err := netns.Set(ns); err != nil {
			done <- err
			return
		}
		// A server listening on :: (busybox nc does) has its IPv4
		// connections in tcp6, with IPv4-mapped addresses.
		for _, file := range []string{"tcp", "tcp6"} {
			b, err := os.ReadFile("/proc/thread-self/net/" + file)
			var conns []tcpSocket
			if err == nil {
				conns, err = procnet.ParseTCP(string(b))
			}
			if err != nil {
				done <- err
				return
			}
			ps.Conns = append(ps.Conns, conns...)
		}
		done <- nil
	}()
	return ps, <-done
}

// netfilterState is the node's netfilter rules with their counters (both
// iptables backends and nftables), conntrack's statistics and the reverse
// path filter's settings: where a lost packet was dropped.
func netfilterState(ctx context.Context) string {
	var b strings.Builder
	for _, args := range [][]string{{"iptables-save", "-c"}, {"iptables-legacy-save", "-c"}, {"nft", "list", "ruleset"},
		{"sh", "-c", "grep . /proc/sys/net/ipv4/conf/*/rp_filter /proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal /proc/sys/net/netfilter/nf_conntrack_tcp_loose; cat /proc/net/stat/nf_conntrack"}} {
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		fmt.Fprintf(&b, "$ %s (%v)\n%s\n", strings.Join(args, " "), err, out)
	}
	return b.String()
}
