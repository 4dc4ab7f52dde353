#!/usr/bin/env bash
# Stages one tree's binaries for a GPU-machine call, packed to fit the carry limit: tessera and
# tessera-test-ops (with CUDA), the GPU test binaries (tessera-cuda's unit and integration tests,
# the models' cuda_backend), NVRTC 13.0 CUBINs of its kernels for sm_90 (the lent machines' NVRTC:
# no compile minute on a fresh machine), and tools/gpu-ab.sh. (../shared/tools/gpu-stage stages
# every test binary of some cargo arguments, unpacked and without CUBINs, into .gpu/ itself: this
# one keeps several trees side by side, such as main and a patched worktree, for one A/B call.)
#
#   tools/stage-gpu.sh NAME [PATCH ...]
#
# builds this checkout (or, with patches, a worktree of HEAD with them applied in order) and
# writes .gpu/NAME/pack.tgz and .gpu/NAME/env.sh. On the GPU machine (carry ".gpu/NAME"):
#   source .gpu/NAME/env.sh    # unpacks once; sets LD_LIBRARY_PATH and TESSERA_KERNEL_CACHE
#   $STAGE/bin/tessera-test-ops eval --backend cuda;  for t in $STAGE/test/*; do $t; done
#   VARIANTS='a=@/path/other/bin b=-' bash $STAGE/gpu-ab.sh $STAGE/bin
# Extra kernel folders for TESSERA_KERNEL_DIR variants: KDIRS="dir ..." compiles their CUBINs
# into the same cache and packs the folders as $STAGE/kdir/NAME. Set CARGO_TARGET_DIR to reuse a build; NVRTC_DIR to a folder holding
# libnvrtc.so.13 (else the nvidia-cuda-nvrtc 13.0 wheel is installed under /tmp).
set -euo pipefail
name=${1:?usage: tools/stage-gpu.sh NAME [PATCH ...]}
shift
top=$(git rev-parse --show-toplevel)
out=$top/.gpu/$name
grep -qxF '/.gpu/' "$top/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$top/.git/info/exclude"

src=$top
if [ $# -gt 0 ]; then
    src=/tmp/stage-gpu-$name
    git -C "$top" worktree remove --force "$src" 2>/dev/null || rm -rf "$src"
    git -C "$top" worktree add -q --detach "$src" HEAD
    for p in "$@"; do git -C "$src" apply "$(realpath "$p")"; done
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$src/target}
cd "$src"

echo "stage-gpu: building in $src" >&2
cargo build -q --release --bins -p tessera-test-ops -p tessera-cli --features tessera-test-ops/cuda
tests=$(cargo test -q --release --no-run --message-format=json -p tessera-cuda -p tessera-models 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        # the backend library'"'"'s unit tests, its integration tests, the models'"'"' GPU test
        if m["package_id"].find("backend-cuda") >= 0 and t["name"] != "tessera-nvrtc-check" or t["name"] == "cuda_backend":
            print(t["name"] + " " + m["executable"])
')
cargo build -q --release -p tessera-cuda --bin tessera-nvrtc-check

nvrtc=${NVRTC_DIR:-/tmp/nvrtc130i/nvidia/cu13/lib}
if [ ! -e "$nvrtc/libnvrtc.so.13" ]; then
    pip install -q --no-deps --target /tmp/nvrtc130i 'nvidia-cuda-nvrtc==13.0.*' >&2
    nvrtc=/tmp/nvrtc130i/nvidia/cu13/lib
fi

rm -rf "$out"
mkdir -p "$out/stage/bin" "$out/stage/test" "$out/stage/kcache"
cp "$CARGO_TARGET_DIR/release/tessera" "$CARGO_TARGET_DIR/release/tessera-test-ops" "$out/stage/bin/"
while read -r n path; do
    [ -n "$n" ] && cp "$path" "$out/stage/test/$n"
done <<< "$tests"
strip "$out"/stage/bin/* "$out"/stage/test/* 2>/dev/null || true
for k in "$src/backend-cuda/kernels" ${KDIRS:-}; do
    LD_LIBRARY_PATH=$nvrtc TESSERA_KERNEL_DIR=$(realpath "$k") "$CARGO_TARGET_DIR/release/tessera-nvrtc-check" \
        --cache-dir "$out/stage/kcache" sm_90 | tail -1 >&2
done
# the extra kernel folders travel too: $STAGE/kdir/NAME for TESSERA_KERNEL_DIR (gpu-ab.sh's KDIR)
for k in ${KDIRS:-}; do
    mkdir -p "$out/stage/kdir"
    cp -r "$(realpath "$k")" "$out/stage/kdir/$(basename "$k")"
done
cp "$top/tools/gpu-ab.sh" "$out/stage/"
tar czf "$out/pack.tgz" -C "$out/stage" .
rm -rf "$out/stage"
cat > "$out/env.sh" <<'ENV'
# source on the GPU machine: unpacks the stage once, then the environment its binaries need
STAGE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/stage
[ -d "$STAGE" ] || { mkdir -p "$STAGE" && tar xzf "$(dirname "$STAGE")/pack.tgz" -C "$STAGE"; }
export STAGE
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export TESSERA_KERNEL_CACHE=$STAGE/kcache RUST_BACKTRACE=1
ENV
# the patched worktree (and a build inside it) is no longer needed
if [ "$src" != "$top" ]; then
    cd "$top"
    git worktree remove --force "$src"
fi
echo "stage-gpu: $(du -sh "$out/pack.tgz" | cut -f1) in $out (carry \".gpu/$name\")" >&2
