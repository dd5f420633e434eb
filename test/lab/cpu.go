package lab

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of /proc's CPU times on Linux.
const clockTicks = 100

// CPUByProcess reports where a VM's CPU time went: the whole machine's
// (from /proc/stat) and the top processes' since they started (utime and
// stime of /proc/PID/stat, and their reaped children's), so that
// a slow run shows which program used the lab's two emulated cores. A
// process's children are those it waited for: init's are every orphan's
// (runc, the shims, the containers' processes once they ended).
func CPUByProcess(top int) string {
	var b strings.Builder
	if stat, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(stat), "\n")
		f := strings.Fields(line)
		names := []string{"user", "nice", "system", "idle", "iowait", "irq", "softirq"}
		var parts []string
		for i, n := range names {
			if i+1 < len(f) {
				v, _ := strconv.ParseFloat(f[i+1], 64)
				parts = append(parts, fmt.Sprintf("%s %.1fs", n, v/clockTicks))
			}
		}
		fmt.Fprintf(&b, "all CPUs: %s\n", strings.Join(parts, ", "))
	}
	type proc struct {
		name          string
		cpu, children float64
	}
	byName := map[string]*proc{}
	paths, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(data)
		open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || close < open {
			continue
		}
		f := strings.Fields(s[close+1:])
		// After the name: state(0) ... utime(11) stime(12) cutime(13) cstime(14).
		if len(f) < 15 {
			continue
		}
		ticks := func(fields ...int) float64 {
			var sum float64
			for _, i := range fields {
				v, _ := strconv.ParseFloat(f[i], 64)
				sum += v
			}
			return sum / clockTicks
		}
		name := s[open+1 : close]
		pr := byName[name]
		if pr == nil {
			pr = &proc{name: name}
			byName[name] = pr
		}
		pr.cpu += ticks(11, 12)
		pr.children += ticks(13, 14)
	}
	var procs []*proc
	for _, p := range byName {
		procs = append(procs, p)
	}
	sort.Slice(procs, func(i, j int) bool { return procs[i].cpu+procs[i].children > procs[j].cpu+procs[j].children })
	fmt.Fprintf(&b, "%9s %9s  %s\n", "own", "children", "process")
	for i, p := range procs {
		if i == top || p.cpu+p.children < 0.05 {
			break
		}
		fmt.Fprintf(&b, "%8.1fs %8.1fs  %s\n", p.cpu, p.children, p.name)
	}
	return b.String()
}

// Softnet sums /proc/net/softnet_stat over the CPUs: packets the stack
// took off its per-CPU backlogs, those it dropped because a backlog held
// net.core.netdev_max_backlog already, and the times a poll ran out of its
// budget (time squeeze). Every veth hop of the lab passes a backlog, so a
// drop there is a packet lost inside the VM, not by the product.
func Softnet() (processed, dropped, squeezed uint64, err error) {
	data, err := os.ReadFile("/proc/net/softnet_stat")
	if err != nil {
		return 0, 0, 0, err
	}
	return parseSoftnet(data)
}

// parseSoftnet sums the first three columns (hexadecimal) of
// /proc/net/softnet_stat's lines, one per CPU.
func parseSoftnet(data []byte) (processed, dropped, squeezed uint64, err error) {
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		var v [3]uint64
		for i := range v {
			if v[i], err = strconv.ParseUint(f[i], 16, 64); err != nil {
				return 0, 0, 0, fmt.Errorf("softnet_stat %q: %w", line, err)
			}
		}
		processed, dropped, squeezed = processed+v[0], dropped+v[1], squeezed+v[2]
	}
	return processed, dropped, squeezed, nil
}

// SoftnetReport is Softnet as one line.
func SoftnetReport() string {
	p, d, s, err := Softnet()
	if err != nil {
		return "softnet: " + err.Error()
	}
	return fmt.Sprintf("softnet: %d packets processed, %d dropped (backlog full), %d time squeezes", p, d, s)
}
