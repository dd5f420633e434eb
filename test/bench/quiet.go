package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"
)

// Forwarding rounds are measured on a quiet machine: after programming
// 640,000 routes or deleting the namespaces that held them, the kernel
// frees them in workqueues for seconds, and this process's own garbage
// collector runs on either CPU; both take the CPU the forwarding path runs
// on. quietRound waits (up to quietTimeout) until every CPU has been at
// least quietIdle idle over a quietWindow, then runs measure with this
// process's garbage collector off (the sender allocates nothing per
// packet).
const (
	quietWindow  = 500 * time.Millisecond
	quietIdle    = 0.9
	quietTimeout = time.Minute
)

func quietRound(measure func() (float64, error)) (float64, error) {
	if err := waitQuiet(); err != nil {
		fmt.Printf("  (%v; measuring anyway)\n", err)
	}
	runtime.GC()
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	return measure()
}

// waitQuiet waits until the machine was idle (idle and iowait time in
// /proc/stat) for quietIdle of a quietWindow.
func waitQuiet() error {
	deadline := time.Now().Add(quietTimeout)
	var idle float64
	for time.Now().Before(deadline) {
		busy0, total0, err := cpuTimes()
		if err != nil {
			return err
		}
		time.Sleep(quietWindow)
		busy1, total1, err := cpuTimes()
		if err != nil {
			return err
		}
		if total1 > total0 {
			idle = 1 - float64(busy1-busy0)/float64(total1-total0)
			if idle >= quietIdle {
				return nil
			}
		}
	}
	return fmt.Errorf("the machine was not quiet within %v (last %.0f%% idle)", quietTimeout, idle*100)
}

// cpuTimes reads the busy and total jiffies of all CPUs from /proc/stat.
func cpuTimes() (busy, total uint64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(fields) < 8 || fields[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	for i, f := range fields[1:] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/stat: %w", err)
		}
		if i >= 8 { // guest and guest_nice are already in user and nice
			break
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total, nil
}
