#!/usr/bin/env bash
# The whole CUDA check in one GPU-machine call: every op against the CPU oracle, the backend's
# own tests, the models against the CPU, the demo, the perf catalogue, and end-to-end decode speed
# on the tiny models and on a real-size synthetic qwen35moe (35B-A3B shapes, nvfp4 weights)
# generated on the machine. Binaries come from a folder staged by the caller (default .gpu-lead):
#   tessera-test-ops, tessera, device-tests, model-tests, and optionally cuda-unit-tests (the
#   tessera-cuda lib tests: byte-exact quantize, data errors) and gpu-test-NAME for the backend's
#   other GPU test binaries (backend-cuda/tests/NAME.rs: fused, elemfuse, delta_net_fused,
#   moe_ring, prefill_attention)
# Logs go to $OUT (default /tmp/out); a short table is printed last.
set -uo pipefail
G=${1:-.gpu-lead}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export TESSERA_KERNEL_CACHE=/tmp/tessera-kernels
summary=()
note() { summary+=("$1"); }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +"%Y-%m-%d %H:%M UTC" >> "$OUT/gpu.txt"

timeout 240 "$G/tessera-test-ops" eval --backend cuda > "$OUT/eval.txt" 2>&1
note "eval --backend cuda: rc=$? $(tail -1 "$OUT/eval.txt")"
# the prefill attention's head pairs on every eval shape they can take (the host's rule gives them
# to large grids only)
TESSERA_FA_PAIR=1 timeout 120 "$G/tessera-test-ops" eval --backend cuda --op flash_attn_ext > "$OUT/eval-pairs.txt" 2>&1
note "eval flash_attn_ext, TESSERA_FA_PAIR=1: rc=$? $(tail -1 "$OUT/eval-pairs.txt")"
timeout 120 "$G/device-tests" --test-threads=1 > "$OUT/device.txt" 2>&1
note "tessera-cuda device tests: rc=$? $(grep '^test result' "$OUT/device.txt")"
if [ -x "$G/cuda-unit-tests" ]; then
    timeout 120 "$G/cuda-unit-tests" --test-threads=1 > "$OUT/cuda-unit.txt" 2>&1
    note "tessera-cuda unit tests: rc=$? $(grep '^test result' "$OUT/cuda-unit.txt")"
fi
for t in "$G"/gpu-test-*; do
    [ -x "$t" ] || continue
    n=${t##*/gpu-test-}
    timeout 200 "$t" --test-threads=1 > "$OUT/gpu-test-$n.txt" 2>&1
    note "tests/$n.rs: rc=$? $(grep '^test result' "$OUT/gpu-test-$n.txt")"
done
timeout 180 "$G/model-tests" --test-threads=1 --nocapture > "$OUT/models.txt" 2>&1
note "models/tests/cuda_backend: rc=$? $(grep '^test result' "$OUT/models.txt")"
timeout 120 "$G/tessera" demo > "$OUT/demo.txt" 2>&1
note "demo: rc=$? $(grep 'oracle check' "$OUT/demo.txt" | cut -c1-140)"
timeout 300 "$G/tessera-test-ops" perf --backend cuda > "$OUT/perf.txt" 2>&1
note "perf --backend cuda: rc=$? ($(grep -c 'us/run\|^[a-z_]*(' "$OUT/perf.txt") lines)"

# End to end: decode tokens/s, and prefill of a 512-token prompt on the big model.
P16=$(seq -s, 1 16)
for preset in tiny tiny-moe; do
    "$G/tessera" synth --preset $preset --dtype f32 -q -o /tmp/$preset.gguf > /dev/null 2>&1
    timeout 120 "$G/tessera" run /tmp/$preset.gguf --backend cuda --tokens $P16 -n 128 > "$OUT/run-$preset.txt" 2>&1
    note "$preset f32, 1 seq: $(grep -E '^decode' "$OUT/run-$preset.txt")"
done
t0=$(date +%s)
timeout 300 "$G/tessera" synth --preset qwen35moe-35b-a3b --dtype nvfp4 -q -o /tmp/big.gguf > "$OUT/synth-big.txt" 2>&1
note "synth qwen35moe-35b-a3b nvfp4: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/synth-big.txt" | cut -c1-120)"
timeout 240 "$G/tessera" run /tmp/big.gguf --backend cuda --tokens $P16 -n 64 > "$OUT/run-big-1.txt" 2>&1
note "35B-A3B nvfp4, 1 seq: rc=$? $(grep -E '^(prefill|decode)' "$OUT/run-big-1.txt" | tr '\n' ' ')"
timeout 240 "$G/tessera" run /tmp/big.gguf --backend cuda --max-tokens-per-step 512 --tokens "$(seq -s, 1 512)" -n 8 > "$OUT/run-big-512.txt" 2>&1
note "35B-A3B nvfp4, 512-token prompt: rc=$? $(grep -E '^(prefill|decode)' "$OUT/run-big-512.txt" | tr '\n' ' ')"
timeout 300 "$G/tessera" bench /tmp/big.gguf --backend cuda -r 2 --widths 1,8,32 --prefill 512,2048 > "$OUT/bench-big.md" 2>&1
note "35B-A3B nvfp4, tessera bench: rc=$? $(grep -E '^\| (pp|tg)' "$OUT/bench-big.md" | awk -F'|' '{printf "%s %s;", $2, $4}')"
args=""; for s in 1 2 3 4 5 6 7 8; do args="$args --tokens $(seq -s, $s $((s+15)))"; done
timeout 240 "$G/tessera" run /tmp/big.gguf --backend cuda $args -n 64 > "$OUT/run-big-8.txt" 2>&1
note "35B-A3B nvfp4, 8 seqs: rc=$? $(grep -E '^(prefill|decode)' "$OUT/run-big-8.txt" | tr '\n' ' ')"

echo
echo "==== summary ($(head -1 "$OUT/gpu.txt"))"
for s in "${summary[@]}"; do echo "  $s"; done
