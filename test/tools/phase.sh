#!/usr/bin/env bash
# phase.sh NAME COMMAND...: runs one phase of make test and records how long
# it took, so that every run's log ends with its phases' durations.
#
# Each phase appends "NAME SECONDS exit=CODE" to $KST_PHASES (default
# /tmp/kst-phases.txt). The files named in $KST_PHASE_SHOW (space-separated;
# e.g. a lab's table of its slowest scenarios) are printed after the command,
# whatever its result. When the command fails, the phases so far are printed
# too, and phase.sh exits with the command's code.
#
#   phase.sh --start        forget the phases of an earlier run
#   phase.sh --summary      print every phase recorded since --start
set -uo pipefail

PHASES="${KST_PHASES:-/tmp/kst-phases.txt}"

summary() {
	echo "== make test phases (seconds) =="
	[[ -f $PHASES ]] && column -t "$PHASES" 2>/dev/null || cat "$PHASES" 2>/dev/null
	if [[ -f $PHASES ]]; then
		awk '{ s += $2 } END { printf "total %d s (%.1f min)\n", s, s / 60 }' "$PHASES"
	fi
}

case "${1:-}" in
--start) rm -f "$PHASES"; exit 0 ;;
--summary) summary; exit 0 ;;
esac

name=$1
shift
start=$(date +%s)
echo "== phase $name: started $(date -u +%H:%M:%S)"
"$@"
rc=$?
took=$(($(date +%s) - start))
echo "$name $took exit=$rc" >>"$PHASES"
for f in ${KST_PHASE_SHOW:-}; do
	[[ -f $f ]] && cat "$f"
done
echo "== phase $name: $took s, exit code $rc"
if [[ $rc != 0 ]]; then
	summary
fi
exit $rc
