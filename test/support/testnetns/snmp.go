package testnetns

import (
	"fmt"
	"strconv"
	"strings"
)

// SNMPTable parses one table ("Ip", "Tcp", ...) of a namespace's
// /proc/net/snmp, whose tables are each a line of names and a line of
// values: name -> value.
func SNMPTable(text, table string) (map[string]int64, error) {
	var names, values []string
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != table+":" {
			continue
		}
		if names == nil {
			names = f[1:]
		} else if values == nil {
			values = f[1:]
		}
	}
	if names == nil || len(values) != len(names) {
		return nil, fmt.Errorf("/proc/net/snmp: no complete %s table", table)
	}
	counters := make(map[string]int64, len(names))
	for i, name := range names {
		n, err := strconv.ParseInt(values[i], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("/proc/net/snmp: %s %s = %q", table, name, values[i])
		}
		counters[name] = n
	}
	return counters, nil
}
