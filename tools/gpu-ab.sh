#!/usr/bin/env bash
# Kernel variants against each other in one GPU-machine call: the same binaries run with each
# variant's kernel sources (TESSERA_KERNEL_DIR; "-" for the sources built in), or a variant's own
# binaries ("@DIR": a host-side change, with the kernels built into them), or the same binaries
# with settings in the environment ("%NAME=VALUE[,NAME=VALUE]", e.g. narrow=%TESSERA_MMQ_WIDE=0; a
# value may hold commas: a comma starts the next setting only before NAME=),
# alternated REPS times, so that every figure of the table was taken in the same call on the same
# device (variant names: letters, digits, "_" and "-"). "@DIR+KDIR" runs DIR's binaries with the
# kernel sources of KDIR (a host change measured against an older tree's kernels). Settings may
# follow any of these after a "%": "KDIR%NAME=VALUE" runs KDIR's kernels with that setting (e.g.
# pairs=.gpu/kv/new%TESSERA_FA_PAIR=1).
#
#   VARIANTS='old=.gpu/kold new=-' EVAL='mul_mat_id' \
#   PERF='mul_mat_id b=[2048,1,32,1]|mul_mat_id b=[2048,1,512,1]' \
#   BENCH='--preset qwen35moe-35b-a3b --dtype nvfp4 --set block_count=8 -r 2 --prefill 512 --widths 32' \
#   bash tools/gpu-ab.sh .gpu/bin
#
# BIN: a folder with tessera-test-ops (built with --features cuda) and, for BENCH, tessera.
# EVAL: ops to check against the CPU oracle (comma-separated), with the variants named in EVAL_ON
# (space-separated; default: every variant but the first).
# PERF: `|`-separated "op filter" pairs for `tessera-test-ops perf` (keep them narrow: building
# a case's inputs costs more than timing it). BENCH: `tessera bench` arguments, run BENCH_REPS
# times a variant (default 1), the passes alternating in order (A B B A).
# Everything is appended to $OUT/ab.log as it finishes (a call cut short by its time limit still
# brings back what ran: only the files under $OUT come back, and only a few of them), the tables
# last: the median us a run per perf case and variant, and each bench run's ms a step with their
# mean. DEADLINE: seconds after the start past which no further perf or bench run starts, so that
# the tables still come out under an outer `timeout` (set it a minute or two below that limit).
# On a machine just started, the first run of each binary compiles the kernel modules it uses
# (NVRTC, a minute or more for a model's bench; cached in $TESSERA_KERNEL_CACHE afterwards): leave
# room for it in the first call's limits, or warm the cache first with a short eval, or carry
# CUBINs compiled here (docs/GPU.md, "Compilation": tessera-nvrtc-check --cache-dir).
set -uo pipefail
BIN=${1:?usage: gpu-ab.sh BIN_DIR}
OUT=${OUT:-/tmp/out}
BACKEND=${BACKEND:-cuda}
REPS=${REPS:-2}
VARIANTS=${VARIANTS:-new=-}
mkdir -p "$OUT"
LOG="$OUT/ab.log"
RAW=$(mktemp -d)
log() { echo "$@" | tee -a "$LOG"; }
DEADLINE=${DEADLINE:-0}
# true once DEADLINE (if set) has passed; says so once
late() {
    [ "$DEADLINE" -gt 0 ] && [ "$SECONDS" -ge "$DEADLINE" ] || return 1
    [ -n "${LATE_SAID:-}" ] || log "DEADLINE ${DEADLINE}s reached: the runs left are skipped"
    LATE_SAID=1
}
ENV_SET=""
use() {  # use VARIANT: its binaries in $B, TESSERA_KERNEL_DIR at its sources, its settings exported
    local dir=${1#*=} e settings=""
    B=$BIN
    unset TESSERA_KERNEL_DIR
    for e in $ENV_SET; do unset "$e"; done
    ENV_SET=""
    # "SPEC%SETTINGS": the settings apart from the binaries and kernels they go with
    if [[ "$dir" == ?*%* ]]; then
        settings=${dir#*%}
        dir=${dir%%%*}
    fi
    case "$dir" in
        -) ;;
        @*+*)
            B=${dir%%+*}
            B=${B#@}
            export TESSERA_KERNEL_DIR=$(realpath "${dir#*+}")
            ;;
        @*) B=${dir#@} ;;
        %*) settings=${dir#%} ;;
        *) export TESSERA_KERNEL_DIR=$(realpath "$dir") ;;
    esac
    if [ -n "$settings" ]; then
        local list
        # split at the commas that start the next NAME=: a value may hold commas
        # (TESSERA_DISABLE_PASSES=a,b)
        mapfile -t list < <(printf '%s\n' "$settings" | sed -E 's/,([A-Z_][A-Z0-9_]*=)/\n\1/g')
        for e in "${list[@]}"; do
            export "${e?}"
            ENV_SET="$ENV_SET ${e%%=*}"
        done
    fi
}
name() { echo "${1%%=*}"; }

log "== $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU ($BACKEND)"), $(date -u +'%Y-%m-%d %H:%M UTC')"
log "variants: $VARIANTS"

EVAL_ON=${EVAL_ON:-$(for v in ${VARIANTS#* }; do printf '%s ' "$(name "$v")"; done)}
for v in $VARIANTS; do
    if [ -n "${EVAL:-}" ] && [[ " $EVAL_ON " == *" $(name "$v") "* ]]; then
        use "$v"
        "$B/tessera-test-ops" eval --backend "$BACKEND" --op "$EVAL" > "$RAW/eval" 2>&1
        rc=$?
        log "eval $(name "$v") ($EVAL): rc=$rc $(grep -A20 'per op' "$RAW/eval" | grep -E '^ ' | tr -s ' ' | tr '\n' ';') $(tail -1 "$RAW/eval")"
    fi
done

IFS='|' read -ra CASES <<< "${PERF:-}"
for rep in $(seq 1 "$REPS"); do
    for v in $VARIANTS; do
        use "$v"
        for c in "${CASES[@]}"; do
            late && break 3
            op=${c%% *}
            filter=${c#* }
            "$B/tessera-test-ops" perf --backend "$BACKEND" --op "$op" --filter "$filter" 2>&1 | grep "^$op(" |
                awk -v n="$(name "$v")" '{print n "\t" $1 "\t" $2}' | tee -a "$RAW/perf" >> "$LOG"
        done
    done
done

if [ -n "${BENCH:-}" ]; then
    # BENCH_REPS passes over the variants, every other one in reverse order (A B B A ...): a
    # device warms between runs, and a later run was measured slower than the same binary first.
    forward=$VARIANTS
    backward=$(for v in $VARIANTS; do echo "$v"; done | tac | tr '\n' ' ')
    for rep in $(seq 1 "${BENCH_REPS:-1}"); do
        order=$forward
        [ $((rep % 2)) = 0 ] && order=$backward
        for v in $order; do
            late && break 2
            use "$v"
            # shellcheck disable=SC2086  # BENCH is a list of arguments
            "$B/tessera" bench --backend "$BACKEND" $BENCH 2>&1 | grep -E '^\| (pp|tg)' | sed "s/^/$(name "$v") /" >> "$LOG"
        done
    done
fi

if [ -s "$RAW/perf" ]; then
    log ""
    log "median us a run (up to $REPS runs each)"
    python3 - "$RAW/perf" "$(for v in $VARIANTS; do name "$v"; done | tr '\n' ' ')" <<'EOF' | tee -a "$LOG"
import statistics, sys
names = sys.argv[2].split()
runs = {}
for line in open(sys.argv[1]):
    v, case, us = line.rstrip("\n").split("\t")
    runs.setdefault(case, {}).setdefault(v, []).append(float(us))
print("| case | " + " | ".join(names) + " |")
print("| --- |" + " ---: |" * len(names))
for case, by in runs.items():
    cells = [f"{statistics.median(by[n]):.2f}" if n in by else "" for n in names]
    print(f"| `{case}` | " + " | ".join(cells) + " |")
EOF
fi
if grep -qE '^[a-z0-9_-]+ \| (pp|tg)' "$LOG"; then
    # the bench rows: every run's ms a step, then their mean, per case and variant
    log ""
    log "tessera bench, ms a step (each run; mean; after the first variant, its mean over the first's)"
    grep -E '^[a-z0-9_-]+ \| (pp|tg)' "$LOG" | python3 -c '
import statistics, sys
names = sys.argv[1].split()
runs = {}
for line in sys.stdin:
    cells = [c.strip() for c in line.split("|")]
    runs.setdefault(cells[1], {}).setdefault(cells[0], []).append(float(cells[4]))
print("| case | " + " | ".join(names) + " |")
print("| --- |" + " ---: |" * len(names))
for case, by in runs.items():
    base = statistics.mean(by[names[0]]) if names[0] in by else None
    def cell(n):
        if n not in by:
            return ""
        mean = statistics.mean(by[n])
        ratio = f", {mean / base:.3f}x" if base and n != names[0] else ""
        return " / ".join(f"{x:.3f}" for x in by[n]) + f" ({mean:.3f}{ratio})"
    print(f"| {case} | " + " | ".join(cell(n) for n in names) + " |")
' "$(for v in $VARIANTS; do name "$v"; done | tr '\n' ' ')" | tee -a "$LOG"
fi
rm -rf "$RAW"
