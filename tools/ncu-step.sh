#!/usr/bin/env bash
# The device time of every kernel of a model step, on the GPU machine: where a decode step's time
# goes kernel by kernel, and how much of the step is between kernels. The per-op profile
# (`TESSERA_CUDA_PROFILE=1`) brackets each op with events on an eager stream, which adds a few us
# to every small kernel; here Nsight Compute times each kernel alone (one metric,
# gpu__time_duration, so one pass a kernel), and the difference between the step time
# `tessera bench` measures with graphs and the sum of its kernels is what launches, drains and
# waits cost.
#
#   tools/ncu-step.sh NAME [BENCH ARGS...]
#   e.g. tools/ncu-step.sh x1 --preset qwen35moe-35b-a3b --dtype nvfp4 --set block_count=8 --widths 1
#
# Runs `BIN/tessera bench ARGS --prefill 16 --n-gen 4 -r 1` eagerly (TESSERA_CUDA_GRAPHS=0: ncu
# times the kernels a graph would replay, one by one) under ncu, writes $OUT/NAME.csv (a row a
# kernel launch, after the program's own output), then tools/ncu_step.py splits the launches into
# steps after each run of kernels matching BOUNDARY (default: the sampler's) and prints the last STEPS
# (default 2) steps' kernels: launches, us a step and share, and the step's sum (NAME.md also lists
# the last step's launches with their grids). Then the same
# bench without ncu, with graphs, for the step time to set beside that sum. BIN: the folder with
# `tessera` (default .gpu/bin); NCU: the ncu binary (default: on PATH, else the newest under
# /opt/nvidia). Kernels compile on first use: warm the cache first on a fresh machine.
set -uo pipefail
[ $# -ge 1 ] || { sed -n '10,11p' "$0" >&2; exit 2; }
NAME=$1
shift
OUT=${OUT:-/tmp/out}
BIN=${BIN:-.gpu/bin}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)}
[ -x "$NCU" ] || { echo "ncu-step: no ncu found (set NCU)" >&2; exit 1; }
HERE=$(dirname "$0")
mkdir -p "$OUT"
TESSERA_CUDA_GRAPHS=0 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --page raw --print-units base \
    "$BIN/tessera" bench "$@" --prefill 16 --n-gen 4 -r 1 > "$OUT/$NAME.csv" 2> "$OUT/$NAME.bench.err"
echo "== $NAME: ncu rc=$? ($(grep -c '"gpu__time_duration.sum"' "$OUT/$NAME.csv") header rows)"
python3 "$HERE/ncu_step.py" "$OUT/$NAME.csv" --boundary "${BOUNDARY:-sample}" --steps "${STEPS:-2}" --launches > "$OUT/$NAME.md"
sed -n '/^$/q;p' "$OUT/$NAME.md"  # the per-kernel table (the launch list stays in the file)
echo "== $NAME: the same bench with graphs (ms a step)"
"$BIN/tessera" bench "$@" --prefill 16 --n-gen 32 -r 2 2>&1 | grep -E '^\| (tg|pp)' | tee -a "$OUT/$NAME.md"
