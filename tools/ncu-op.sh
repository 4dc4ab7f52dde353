#!/usr/bin/env bash
# Profile the kernels of one test-ops perf case with Nsight Compute, on the GPU machine:
#
#   tools/ncu-op.sh NAME KERNEL_REGEX COUNT OP FILTER
#   e.g. tools/ncu-op.sh moe 'moe_mma_nvfp4' 1 mul_mat_id 'type_a=nvfp4,n_mats=256,n_used=8,b=[2048,1,512,1]'
#
# Runs `tessera-test-ops perf --backend cuda --op OP --filter FILTER` eagerly (no CUDA graphs: ncu
# cannot profile kernels launched during a capture) under ncu, skipping the first 4 launches that
# match KERNEL_REGEX (warm-up) and profiling the next COUNT, with the sections that say where time
# goes (speed of light, warp states, occupancy, memory, source counters). Writes to $OUT (default
# /tmp/out): NAME.details.txt (ncu's details page), NAME.sass.csv (per-instruction counters) and
# NAME.stalls.md (tools/ncu_stalls.py: stall reasons, the instructions that wait most, the loops), and
# prints the headline figures and the stall summary. BIN: the folder with tessera-test-ops
# (default .gpu/bin); NCU: the ncu binary (default: on PATH, else the newest under /opt/nvidia).
set -uo pipefail
[ $# -eq 5 ] || { sed -n '2,4p' "$0" >&2; exit 2; }
NAME=$1 KERNEL=$2 COUNT=$3 OP=$4 FILTER=$5
OUT=${OUT:-/tmp/out}
BIN=${BIN:-.gpu/bin}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)}
[ -x "$NCU" ] || { echo "ncu-op: no ncu found (set NCU)" >&2; exit 1; }
HERE=$(dirname "$0")
mkdir -p "$OUT"
TESSERA_CUDA_GRAPHS=0 "$NCU" --clock-control none --cache-control none -k "regex:$KERNEL" -s 4 -c "$COUNT" \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section SourceCounters --import-source no -f -o "$OUT/$NAME" \
    "$BIN/tessera-test-ops" perf --backend cuda --op "$OP" --filter "$FILTER" --time-ms 10 > "$OUT/$NAME.log" 2>&1
rc=$?
"$NCU" -i "$OUT/$NAME.ncu-rep" --page details > "$OUT/$NAME.details.txt" 2>&1
"$NCU" -i "$OUT/$NAME.ncu-rep" --page source --print-source sass --csv > "$OUT/$NAME.sass.csv" 2>&1
rm -f "$OUT/$NAME.ncu-rep"
python3 "$HERE/ncu_stalls.py" "$OUT/$NAME.sass.csv" > "$OUT/$NAME.stalls.md" 2>&1
echo "== $NAME ($OP, $FILTER): ncu rc=$rc"
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Block Limit" \
    "$OUT/$NAME.details.txt" | sed 's/  */ /g' | head -40
cat "$OUT/$NAME.stalls.md"
