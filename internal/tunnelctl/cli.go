package tunnelctl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/pflag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cmdnu/kube-service-tunnel/internal/routerstatus"
	"github.com/cmdnu/kube-service-tunnel/internal/seedsecret"
	"github.com/cmdnu/kube-service-tunnel/internal/version"
)

const usage = `kubectl tunnel: where kube-service-tunnel sends traffic.

Usage:
  kubectl tunnel status [SERVICE|TUNNEL-IP] [-n NAMESPACE | -A] [-o wide|json|yaml]
  kubectl tunnel explain TUNNEL-IP[:PORT] --from CLIENT-IP[:PORT] [--proto tcp|udp|sctp|icmp|N] [-o json|yaml]
  kubectl tunnel version

status shows each served tunnel IP: its Service, pool, endpoints (buckets,
draining) and which routers programmed and announce it, as the routers
publish it. With SERVICE or TUNNEL-IP it shows that one in detail.

explain tells where a new flow goes: its HMARK bucket, the endpoint pod and
node, the encapsulation, and each router's generation, mark and table. It
reads the HMARK seed from the Secret kube-service-tunnel/tunnel-hmark-seed
(or --seed).

Flags:
`

// Main runs kubectl tunnel with args (without the program name).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := pflag.NewFlagSet("kubectl-tunnel", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	loading := clientcmd.NewDefaultClientConfigLoadingRules()
	fs.StringVar(&loading.ExplicitPath, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
	overrides := &clientcmd.ConfigOverrides{}
	clientcmd.BindOverrideFlags(overrides, fs, clientcmd.RecommendedConfigOverrideFlags(""))
	all := fs.BoolP("all-namespaces", "A", false, "status: the tunnel IPs of every namespace")
	output := fs.StringP("output", "o", "", "output format: wide, json or yaml")
	tunnelNS := fs.String("tunnel-namespace", seedsecret.DefaultNamespace, "namespace of kube-service-tunnel's configuration (tunnel-config, the seed Secret)")
	statusNS := fs.String("status-namespace", routerstatus.DefaultNamespace, "namespace of the routers' status ConfigMaps (the routers' --status-namespace)")
	seedSecret := fs.String("seed-secret", seedsecret.DefaultName, "explain: name of the Secret holding the HMARK seed, in --tunnel-namespace")
	seedFlag := fs.String("seed", "", "explain: the HMARK seed, instead of reading its Secret")
	from := fs.String("from", "", "explain: the client's address, CLIENT-IP[:PORT]")
	proto := fs.String("proto", "tcp", "explain: the flow's protocol: tcp, udp, sctp, icmp, ... or a number")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return nil
		}
		return err
	}
	if err := ValidOutput(*output); err != nil {
		return err
	}
	words := fs.Args()
	if len(words) == 0 {
		fs.Usage()
		return errors.New("missing command: status, explain or version")
	}
	if words[0] == "version" {
		fmt.Fprintln(stdout, "kubectl-tunnel", version.String())
		return nil
	}
	clientConfig := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(loading, overrides)
	restConfig, err := clientConfig.ClientConfig()
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	restConfig.UserAgent = "kubectl-tunnel/" + version.String()
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	switch words[0] {
	case "status":
		if len(words) > 2 {
			return fmt.Errorf("status takes at most one SERVICE or TUNNEL-IP, got %q", strings.Join(words[1:], " "))
		}
		filter := StatusFilter{}
		if !*all {
			if filter.Namespace, _, err = clientConfig.Namespace(); err != nil {
				return err
			}
		}
		if len(words) == 2 {
			filter.Target = words[1]
		}
		inv, err := Load(ctx, client, *tunnelNS, *statusNS)
		if err != nil {
			return err
		}
		rep, err := inv.Status(ctx, filter)
		if err != nil {
			return err
		}
		return PrintStatus(stdout, rep, *output, filter.Target != "", time.Now())
	case "explain":
		if len(words) != 2 {
			return errors.New("explain takes one TUNNEL-IP[:PORT]")
		}
		flow, err := ParseFlow(words[1], *from, *proto)
		if err != nil {
			return err
		}
		seed, err := readSeed(ctx, client, *seedFlag, seedsecret.Ref{Namespace: *tunnelNS, Name: *seedSecret})
		if err != nil {
			return err
		}
		inv, err := Load(ctx, client, *tunnelNS, *statusNS)
		if err != nil {
			return err
		}
		ex, err := inv.Explain(ctx, flow, seed)
		if err != nil {
			return err
		}
		return PrintExplanation(stdout, ex, *output)
	}
	return fmt.Errorf("unknown command %q: want status, explain or version", words[0])
}

// readSeed returns the seed given on the command line, else the one in its
// Secret, saying plainly when the caller may not read it.
func readSeed(ctx context.Context, client kubernetes.Interface, given string, ref seedsecret.Ref) (Seed, error) {
	if given != "" {
		v, err := seedsecret.ParseSeed(given)
		if err != nil {
			return Seed{}, fmt.Errorf("--seed: %w", err)
		}
		return Seed{Value: v, From: "--seed"}, nil
	}
	v, err := seedsecret.Read(ctx, client, ref)
	switch {
	case apierrors.IsForbidden(err):
		return Seed{}, fmt.Errorf("you may not read the HMARK seed, so the flow's bucket cannot be computed: %w\n"+
			"The seed decides every flow's bucket and is kept secret from clients; ask for \"get\" on secret %s (docs/operating.md, \"The HMARK seed\"), or pass --seed", err, ref)
	case apierrors.IsNotFound(err):
		return Seed{}, fmt.Errorf("no HMARK seed Secret %s: the routers create it at start-up unless they run with --seed (then pass the same --seed here): %w", ref, err)
	case err != nil:
		return Seed{}, err
	}
	return Seed{Value: v, From: "secret " + ref.String()}, nil
}

// Output runs kubectl tunnel with args, as the plugin binary does, and
// returns its standard output; its error carries the command line and
// what it wrote to standard error.
func Output(ctx context.Context, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	if err := Main(ctx, args, &stdout, &stderr); err != nil {
		return "", fmt.Errorf("kubectl tunnel %s: %w\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}
