//! mul_mat and mul_mat_id with q8_0 / nvfp4 weights for many tokens: `kernels/mmq.cu`, a tiled
//! tensor-core GEMM (f16 operands, f32 accumulators) that dequantizes each weight tile in shared
//! memory (`wgmma` on Hopper, `mma.sync` elsewhere). The activations are packed once per call
//! (`mmq_pack_x`) into f16 rows scaled by powers of two, which keeps results within the f32 bound
//! of the CPU oracle (the file comment of mmq.cu has the error budget). `matmul.rs` decides
//! when these kernels take a product; this file owns their launch rules.

use cudarc::driver::PushKernelArg;
use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, launch_error};

const PACK_X: Kernel = Kernel::new(Module::Mmq, "mmq_pack_x");
/// `[weights q8_0, nvfp4][4 ring slots, 5]`.
const MMQ: [[Kernel; 2]; 2] = [
    [Kernel::new(Module::Mmq, "mmq_q8_0_s4"), Kernel::new(Module::Mmq, "mmq_q8_0_s5")],
    [Kernel::new(Module::Mmq, "mmq_nvfp4_s4"), Kernel::new(Module::Mmq, "mmq_nvfp4_s5")],
];
const MMQ_ID: [[Kernel; 2]; 2] = [
    [Kernel::new(Module::Mmq, "mmq_q8_0_s4_id"), Kernel::new(Module::Mmq, "mmq_q8_0_s5_id")],
    [Kernel::new(Module::Mmq, "mmq_nvfp4_s4_id"), Kernel::new(Module::Mmq, "mmq_nvfp4_s5_id")],
];
/// Decoded weight tiles (and q8_0 scale sets) in shared memory: `MQ_DECODED`.
const DECODED: usize = 3;

/// Block tile: weight rows, activation columns, k per step (`MQ_BM`, `MQ_BN`, `MQ_BK`).
const BM: i64 = 128;
const BN: i64 = 128;
const BK: i64 = 64;
const THREADS: u32 = 256;
/// Bytes of one 128-row shared tile of 64 f16 (`MQ_TILE`).
const TILE: usize = 128 * 128;
/// Bytes of the entry points' static shared arrays (column tables).
const STATIC_SHARED: usize = 128 * (8 + 4 + 8);
/// Largest grid y / z.
const GRID_YZ: i64 = 65535;

/// Tiles of `t` covering `n` (n >= 0).
fn tiles(n: i64, t: i64) -> i64 {
    (n + t - 1) / t
}

/// Bytes of one row's raw weights in a slot (`mq_raw_stride`: q8_0's 68 padded to 72).
fn raw_stride(d: DType) -> usize {
    if d == DType::Q8_0 { 72 } else { 36 }
}

/// Dynamic shared memory of a block with `stages` ring slots: TAG(mmq-smem), `mq_shared_bytes`
/// (slots of an activation tile and the raw weights, the decoded weight tiles and q8_0 scales,
/// 1 KiB to align the base).
fn shared_bytes(d: DType, stages: usize) -> usize {
    let slot = (TILE + BM as usize * raw_stride(d) + 16).next_multiple_of(1024);
    stages * slot + DECODED * (TILE + BM as usize * 2 * 4) + 1024
}

/// The kernel variant for `d` on this device: 5 ring slots where a block may have that much
/// shared memory (Hopper: 181 KiB for q8_0), else 4 (155 KiB: sm_80's 163 KiB fits). The static shared arrays of the entry points (column tables, 2.5 KiB)
/// come on top.
fn variant(cx: &Cx<'_>, d: DType) -> Option<(usize, usize, u32)> {
    let ty = usize::from(d == DType::NvFp4);
    let fits = |stages| shared_bytes(d, stages) + STATIC_SHARED <= cx.info.max_shared_per_block;
    let stages = [5, 4].into_iter().find(|&s| fits(s))?;
    Some((ty, stages - 4, shared_bytes(d, stages) as u32))
}

/// Whether these kernels can take weights `a` (dtype `d`): q8_0 / nvfp4 rows of whole k-tiles
/// starting 4-byte aligned (the raw tiles are copied in words).
pub(super) fn weights_fit(a: &TensorArg, d: DType) -> bool {
    matches!(d, DType::Q8_0 | DType::NvFp4)
        && a.ne[0] > 0
        && a.ne[0] % BK == 0
        && a.data.is_multiple_of(4)
        && (1..4).all(|i| a.nb[i] % 4 == 0)
        && tiles(a.ne[1], BM) <= GRID_YZ
}

/// Scratch bytes of the packed activations of `b`: f16 values, then an f32 scale per row.
pub(super) fn packed_bytes(b: &TensorMeta) -> usize {
    values_bytes(b.nelements()) + (b.nelements() / b.ne[0].max(1) * 4).next_multiple_of(256)
}

fn values_bytes(n: usize) -> usize {
    (n * 2).next_multiple_of(256)
}

/// Packs `b` (k a multiple of 64) into `x` as `mmq_pack_x` lays it out; returns where the row
/// scales are.
fn pack_x(cx: &mut Cx<'_>, b: TensorArg, x: u64) -> Result<u64, BackendError> {
    let xs = x + values_bytes(b.nelements() as usize) as u64;
    let rows = b.nelements() / b.ne[0].max(1);
    let f = cx.function(PACK_X)?;
    let mut args = cx.stream.launch_builder(&f);
    args.arg(&b).arg(&x).arg(&xs);
    // SAFETY: `mmq_pack_x(b, x, xs)` reads b inside its span (row_coords) and writes 2 bytes per
    // element of b at x and 4 per row at xs, which `packed_bytes` sized.
    unsafe { args.launch(config((blocks_for(rows, THREADS / 32), 1, 1), (THREADS, 1, 1), 0)) }
        .map_err(|e| launch_error(PACK_X, e))?;
    Ok(xs)
}

/// `out = a^T b` for weights that `weights_fit`, with the packed activations at `x` (scratch of
/// `packed_bytes(b)`). `None` when the device cannot hold a block's tiles or the batch count
/// exceeds the grid: the caller takes another path.
pub(super) fn mul_mat(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    x: u64,
) -> Option<Result<(), BackendError>> {
    let (ty, s, shared) = variant(cx, d)?;
    let (n, b2, b3) = (b.ne[1], b.ne[2], b.ne[3]);
    if b2 * b3 > GRID_YZ {
        return None;
    }
    let kernel = MMQ[ty][s];
    let run = |cx: &mut Cx<'_>| {
        let xs = pack_x(cx, b, x)?;
        cx.allow_shared(kernel, shared)?;
        let f = cx.function(kernel)?;
        let grid = (tiles(n, BN) as u32, tiles(a.ne[1], BM) as u32, (b2 * b3) as u32);
        let mut args = cx.stream.launch_builder(&f);
        args.arg(&a).arg(&x).arg(&xs).arg(&n).arg(&b2).arg(&b3).arg(&out);
        // SAFETY: `mmq_*(a, x, xs, n, b2, b3, out)`: a's rows are whole 64-value k-tiles, 4-byte
        // aligned (`weights_fit`), and rows past ne[1] are never read; batch (i2, i3) reads weight
        // batch (i2 / (b2 / A2), i3 / (b3 / A3)) inside a (shape rules); x, xs hold the
        // b2 * b3 * n packed rows; columns past n and rows past M are neither read nor written; out is
        // [M, n, b2, b3] f32 at its strides; `shared` bytes were allowed above.
        unsafe { args.launch(config(grid, (THREADS, 1, 1), shared)) }.map_err(|e| launch_error(kernel, e))?;
        Ok(())
    };
    Some(run(cx))
}

/// mul_mat_id's experts on tensor cores: for each expert e, the pairs listed at
/// `list[offsets[e] .. offsets[e + 1]]` (by `moe_group`, device memory) when there are more than
/// `min_pairs` of them; the others are left to the caller. `x` is scratch of `packed_bytes(b)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn mul_mat_id(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    b: TensorArg,
    n_used: i64,
    n_pairs: i64,
    offsets: u64,
    list: u64,
    min_pairs: i32,
    out: TensorArg,
    x: u64,
) -> Option<Result<(), BackendError>> {
    let (ty, s, shared) = variant(cx, d)?;
    if w.ne[2] > GRID_YZ {
        return None;
    }
    let kernel = MMQ_ID[ty][s];
    let run = |cx: &mut Cx<'_>| {
        let xs = pack_x(cx, b, x)?;
        cx.allow_shared(kernel, shared)?;
        let f = cx.function(kernel)?;
        // Column blocks per expert for twice the average pairs (the kernel loops over any more):
        // with many experts most have one tile's worth, and empty blocks still cost a launch slot
        // (H200, 512 tokens top-8, nvfp4: 256 experts 463 -> 404 us, 64 experts 151 -> 121 us
        // against a block per possible tile of all pairs).
        let per_expert = tiles(2 * n_pairs / w.ne[2].max(1), BN).clamp(1, tiles(n_pairs, BN).max(1));
        let grid = (per_expert as u32, tiles(w.ne[1], BM) as u32, w.ne[2] as u32);
        let n_b = b.ne[1];
        let mut args = cx.stream.launch_builder(&f);
        args.arg(&w).arg(&x).arg(&xs).arg(&n_b).arg(&n_used).arg(&offsets).arg(&list).arg(&min_pairs).arg(&out);
        // SAFETY: `mmq_*_id(as, x, xs, n_b, n_used, offsets, list, min_pairs, out)`: expert e =
        // blockIdx.z < n_expert reads its own rows of as (whole aligned k-tiles, `weights_fit`);
        // offsets has n_expert + 1 entries and list the valid pairs s = u + n_used t only, so the
        // packed row (u mod n_b) + n_b t exists in x, xs and out[:, u, t] lies in out.
        unsafe { args.launch(config(grid, (THREADS, 1, 1), shared)) }.map_err(|e| launch_error(kernel, e))?;
        Ok(())
    };
    Some(run(cx))
}
