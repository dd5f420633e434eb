package tunnelctl

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"sigs.k8s.io/yaml"
)

// Output formats (-o).
const (
	OutputText = ""
	OutputWide = "wide"
	OutputJSON = "json"
	OutputYAML = "yaml"
)

// ValidOutput reports an -o value status and explain do not know.
func ValidOutput(o string) error {
	switch o {
	case OutputText, OutputWide, OutputJSON, OutputYAML:
		return nil
	}
	return fmt.Errorf("-o %q: want wide, json or yaml", o)
}

// writeData writes v as JSON or YAML; ok is false for the text formats.
func writeData(w io.Writer, output string, v any) (ok bool, err error) {
	switch output {
	case OutputJSON:
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return true, enc.Encode(v)
	case OutputYAML:
		b, err := yaml.Marshal(v)
		if err != nil {
			return true, err
		}
		_, err = w.Write(b)
		return true, err
	}
	return false, nil
}

// PrintStatus writes rep in output's format. now dates the routers' updates.
func PrintStatus(w io.Writer, rep *StatusReport, output string, detailed bool, now time.Time) error {
	if ok, err := writeData(w, output, rep); ok {
		return err
	}
	if detailed {
		printStatusDetails(w, rep, now)
	} else {
		printStatusTable(w, rep, output == OutputWide)
	}
	for _, c := range rep.Claims {
		ip := c.TunnelIP
		if ip == "" {
			ip = "-"
		}
		fmt.Fprintf(w, "not served: %s (%s) %s: %s\n", c.Service, ip, c.Verdict, c.Reason)
	}
	printNotes(w, rep.Notes)
	return nil
}

func printStatusTable(w io.Writer, rep *StatusReport, wide bool) {
	if len(rep.Tunnels) == 0 {
		fmt.Fprintln(w, "No tunnel IP is served here.")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	header := "TUNNEL IP\tSERVICE\tENDPOINTS\tDRAINING\tPROGRAMMED\tANNOUNCED"
	if wide {
		header += "\tPOOL\tMODE\tBUCKETS PER ENDPOINT"
	}
	fmt.Fprintln(tw, header)
	for _, t := range rep.Tunnels {
		ready, draining := 0, 0
		for _, ep := range t.Endpoints {
			if ep.State == "draining" {
				draining++
			} else {
				ready++
			}
		}
		line := fmt.Sprintf("%s\t%s\t%d\t%d\t%s\t%s", t.TunnelIP, t.Service, ready, draining, programmedSummary(t.Routers), announcedSummary(t.Routers))
		if wide {
			var per []string
			for _, ep := range t.Endpoints {
				per = append(per, fmt.Sprintf("%s=%d", endpointName(ep), ep.Buckets))
			}
			line += fmt.Sprintf("\t%s\t%s\t%s", orDash(t.Pool), t.Mode, orDash(strings.Join(per, ",")))
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
}

// programmedSummary is "2/2" (routers holding the current table, of all),
// with the others named.
func programmedSummary(rs []RouterTunnel) string {
	if len(rs) == 0 {
		return "unknown"
	}
	n := 0
	var off []string
	for _, r := range rs {
		if r.Current() || (r.Programmed && r.Table == "none") {
			n++
		} else if r.Programmed {
			off = append(off, r.Router+":"+r.Table)
		} else {
			off = append(off, r.Router+":missing")
		}
	}
	s := fmt.Sprintf("%d/%d", n, len(rs))
	if len(off) > 0 {
		s += " (" + strings.Join(off, ",") + ")"
	}
	return s
}

func announcedSummary(rs []RouterTunnel) string {
	n, bgp := 0, 0
	for _, r := range rs {
		if r.BGP {
			bgp++
		}
		if r.Announced {
			n++
		}
	}
	if bgp == 0 {
		return "bgp off"
	}
	return fmt.Sprintf("%d/%d", n, bgp)
}

func printStatusDetails(w io.Writer, rep *StatusReport, now time.Time) {
	for i, t := range rep.Tunnels {
		if i > 0 {
			fmt.Fprintln(w)
		}
		hash := "5-tuple"
		if t.ClientAffinity {
			hash = "client address (sessionAffinity: ClientIP)"
		}
		fmt.Fprintf(w, "Tunnel IP:  %s\nService:    %s (served)\nPool:       %s\nMode:       %s, %d buckets, hashed on the %s\n", t.TunnelIP, t.Service, orDash(t.Pool), t.Mode, t.Buckets, hash)
		fmt.Fprintln(w, "Endpoints:")
		if len(t.Endpoints) == 0 {
			fmt.Fprintln(w, "  none: the routers drop this tunnel IP's traffic")
		} else {
			tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "  POD\tADDRESS\tNODE\tBUCKETS\tSTATE")
			for _, ep := range t.Endpoints {
				node := orDash(ep.Node)
				if ep.NodeAddress != "" {
					node += " (" + ep.NodeAddress + ")"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\n", orDash(ep.Pod), ep.Address, node, ep.Buckets, ep.State)
			}
			tw.Flush()
		}
		fmt.Fprintln(w, "Routers:")
		if len(t.Routers) == 0 {
			fmt.Fprintln(w, "  none has published its status")
		} else {
			tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "  ROUTER\tPROGRAMMED\tTABLE\tGENERATION\tANNOUNCED\tSTATUS UPDATED")
			for _, r := range t.Routers {
				programmed, table, gen := "no", "-", "-"
				if r.Programmed {
					programmed, table, gen = "yes", r.Table, fmt.Sprint(r.Generation)
				}
				announced := yesNo(r.Announced)
				if !r.BGP {
					announced = "bgp off"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s ago\n", r.Router, programmed, table, gen, announced, now.Sub(r.Updated).Round(time.Second))
			}
			tw.Flush()
		}
		for _, p := range t.Problems {
			fmt.Fprintf(w, "Problem:    %s\n", p)
		}
	}
	if len(rep.Tunnels) > 0 && len(rep.Claims) > 0 {
		fmt.Fprintln(w)
	}
}

// PrintExplanation writes ex in output's format.
func PrintExplanation(w io.Writer, ex *Explanation, output string) error {
	if ok, err := writeData(w, output, ex); ok {
		return err
	}
	fmt.Fprintf(w, "Flow:       %s\nService:    %s\nBucket:     %d of %d (HMARK seed %s, from %s)\n", ex.Flow, ex.Service, ex.Bucket, ex.Buckets, ex.SeedFingerprint, ex.SeedFrom)
	if ex.ClientAffinity {
		fmt.Fprintln(w, "Affinity:   ClientIP: hashed on the client's address alone; every flow of this client gets this bucket")
	}
	if ex.Endpoint.Address != "" {
		fmt.Fprintf(w, "Endpoint:   %s %s on node %s (%s)\n", orDash(ex.Endpoint.Pod), ex.Endpoint.Address, orDash(ex.Endpoint.Node), ex.Endpoint.State)
		switch e := ex.Encapsulation; {
		case e.GREDestination != "":
			fmt.Fprintf(w, "Encap:      GRE to %s\n", e.GREDestination)
		case e.NextHop != "":
			fmt.Fprintf(w, "Encap:      MPLS label %d via %s\n", e.MPLSLabel, e.NextHop)
		}
		if p := ex.Policy; p != nil {
			line := p.Verdict
			switch {
			case p.Why != "":
				line += ": " + p.Why
			case len(p.Policies) > 0:
				line += " by the pod's NetworkPolicies " + strings.Join(p.Policies, ", ")
			default:
				line += ": no NetworkPolicy selects the pod"
			}
			fmt.Fprintf(w, "Policy:     %s\n", line)
			for _, pr := range p.Problems {
				fmt.Fprintf(w, "            %s\n", pr)
			}
		}
	}
	fmt.Fprintln(w, "Routers:")
	if len(ex.Routers) == 0 {
		fmt.Fprintln(w, "  none has published its status")
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	if len(ex.Routers) > 0 {
		fmt.Fprintln(tw, "  ROUTER\tCARRIES\tGENERATION\tMARK\tTABLE\tANNOUNCED\tWHY NOT")
	}
	for _, r := range ex.Routers {
		table := "-"
		if r.Table != 0 {
			table = fmt.Sprint(r.Table)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.Router, yesNo(r.Carries), r.Generation, orDash(r.Mark), table, yesNo(r.Announced), orDash(r.Why))
	}
	tw.Flush()
	printNotes(w, ex.Notes)
	return nil
}

func printNotes(w io.Writer, notes []string) {
	for _, n := range notes {
		fmt.Fprintf(w, "Note: %s\n", n)
	}
}

func endpointName(ep EndpointStatus) string {
	if ep.Pod != "" {
		if _, name, ok := strings.Cut(ep.Pod, "/"); ok {
			return name
		}
		return ep.Pod
	}
	return ep.Address
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
