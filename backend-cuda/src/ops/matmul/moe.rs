//! mul_mat_id and its fused forms (mul_mat_id_swiglu, mul_mat_id_weighted_sum): the choice among
//! their paths, and the wrappers of `kernels/moe.cu`. One token over q8_0 / nvfp4 experts takes
//! `moe_ring_*` (gemv_one.rs) where it fits (`moe_rings`). A few tokens take `moe_decode*` (each routed
//! (slot, token) pair straight over its expert's rows, no grouping) unless the tensor-core
//! `moe_mma_*` (`moe_mma.rs`) wins; more tokens group the pairs by expert on the device (`moe_prep`)
//! and run the busy experts on tensor cores or `moe_gemm`, the rest through `moe_gemv`.

use std::sync::OnceLock;

use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use super::gemv::{fast_activations, fast_rows, quant_x_bytes};
use super::gemv_one::{MoeRingMode, moe_rings};
use super::pack::{pack_b, packed_len};
use super::{GF_THREADS, MM_WARPS, THREADS, align, mmq, moe_mma, rows_vectorizable};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, GRID_YZ, TensorArg, blocks_for, config, dt};

const MOE_DECODE: Kernel = Kernel::new(Module::Moe, "moe_decode");
const MOE_DECODE_GLU: Kernel = Kernel::new(Module::Moe, "moe_decode_glu");
const MOE_DECODE_SUM: Kernel = Kernel::new(Module::Moe, "moe_decode_sum");
const WEIGHTED_SLOT_SUM: Kernel = Kernel::new(Module::Moe, "weighted_slot_sum");
const MOE_GEMV: Kernel = Kernel::new(Module::Moe, "moe_gemv");
const MOE_GEMM: Kernel = Kernel::new(Module::Moe, "moe_gemm");

/// Weight rows per `moe_gemm` block: `MT_M` in moe.cu.
const MT_M: u64 = 64;

/// Experts with more (slot, token) pairs than this take `moe_gemm`, the others `moe_gemv` (8 was
/// faster than 16 over 256 experts top-8 at 512 tokens: docs/perf-log/kernels-matmul.md).
const MOE_GEMV_MAX: i32 = 8;

/// mul_mat_id with at most this many tokens runs `moe_decode` over the (slot, token) pairs
/// (each pair reads its expert's rows; no grouping) unless `moe_mma_*` takes the experts
/// (`moe_decode_wins`). With 256 experts top-8 few pairs share an expert, and grouping them for
/// `moe_gemv` cost far more than the repeated reads, up to 16 tokens
/// (docs/perf-log/kernels-matmul.md).
const MOE_DECODE_TOKENS: i64 = 16;

/// mul_mat_id_weighted_sum takes `moe_decode_sum` up to this many tokens (where the one-token
/// ring does not run), else mul_mat_id and `weighted_slot_sum`: fused is faster at one token and
/// slower from 2 on (each slot's rows read once per token, where `moe_mma_*` shares nothing
/// either but runs on tensor cores; docs/perf-log/kernels-matmul.md and kernels-mmid.md).
const MOE_DECODE_SUM_TOKENS: i64 = 1;

/// With more (slot, token) pairs than this an expert on average, the experts with more than
/// `MOE_MMA_MAX` pairs take the tiled `mmq_*_id` (128-column tiles) rather than `moe_mma_*`
/// (passes of up to 32 pairs over the expert's rows).
const MOE_TILED_AVG: i64 = 8;
const MOE_MMA_MAX: i32 = 32;

/// A forced mul_mat_id path (`TESSERA_MOE_PATH`), for measuring the paths against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MoePath {
    /// By token count and weights (unset or unknown).
    Auto,
    /// `moe_decode` whenever it can take the shapes.
    Decode,
    /// `moe_mma_*` whenever it can take the weights, at any token count.
    Mma,
    /// The grouped path without `moe_mma_*`.
    Grouped,
}

fn moe_path() -> MoePath {
    static PATH: OnceLock<MoePath> = OnceLock::new();
    *PATH.get_or_init(|| match std::env::var("TESSERA_MOE_PATH").as_deref() {
        Ok("decode") => MoePath::Decode,
        Ok("mma") => MoePath::Mma,
        Ok("grouped") => MoePath::Grouped,
        _ => MoePath::Auto,
    })
}

/// Scratch of mul_mat_id: the pairs grouped by expert (`moe_mma::MoeGroups`), then packed
/// activations (`moe_decode` uses the start of scratch for its own).
pub(super) fn moe_scratch(w: &TensorMeta, b: &TensorMeta, ids: &TensorMeta) -> usize {
    moe_packed_at(w.ne[2], ids.nelements(), b.nelements(), b.ne[0]) + mmq::packed_bytes(b)
}

/// Where mul_mat_id's scratch holds `mmq`'s packed activations: after the expert grouping and
/// the f32 / `quant_x` activations (`n_b` values of `k` per row); the f32 rows follow the grouping.
fn moe_packed_at(n_expert: usize, n_pairs: usize, n_b: usize, k: usize) -> usize {
    let (xq, xs) = quant_x_bytes(n_b);
    let f32_rows = align(n_b / k.max(1) * packed_len(k) * 4);
    moe_groups_bytes(n_expert, n_pairs) + f32_rows.max(xq + xs)
}

fn moe_groups_bytes(n_expert: usize, n_pairs: usize) -> usize {
    moe_mma::MoeGroups::at(0, n_expert, n_pairs).1
}

/// mul_mat_id; `op` is the code device errors (a bad expert id) name: mul_mat_id's, or that of
/// the fused op running it. With `up` (mul_mat_id_swiglu's up experts, of w's shape and strides,
/// and where their products go) both products are written; on `moe_mma_*` they share one grouping
/// and one launch.
#[allow(clippy::too_many_arguments)]
pub(super) fn mul_mat_id(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    b: TensorArg,
    ids: TensorArg,
    out: TensorArg,
    up: Option<(TensorArg, TensorArg)>,
    op: u32,
) -> Result<(), BackendError> {
    if up.is_none()
        && let Some(done) = moe_rings(cx, MoeRingMode::Id, w, None, d, b, ids, None, out, op, ring_tokens())
    {
        return done;
    }
    let n_expert = w.ne[2];
    let n_pairs = ids.nelements();
    let mma = moe_mma_fits(cx, &w, d, &ids);
    let decode = moe_decode_taken(&w, d, &ids, mma);
    if let Some((wu, out_up)) = up {
        let one_launch = mma && !decode && wu.nb == w.nb && wu.ne == w.ne && moe_mma_fits(cx, &wu, d, &ids);
        if !one_launch {
            // each product on its own path
            mul_mat_id(cx, w, d, b, ids, out, None, op)?;
            return mul_mat_id(cx, wu, d, b, ids, out_up, None, op);
        }
    }
    if decode {
        return moe_decode(cx, w, None, d, b, ids, out, op);
    }
    let n_used = ids.ne[0];
    let (g, groups) = moe_mma::MoeGroups::at(cx.scratch, n_expert as usize, n_pairs as usize);
    let packed = cx.scratch
        + moe_packed_at(n_expert as usize, n_pairs as usize, b.nelements() as usize, b.ne[0] as usize) as u64;
    if mma {
        // many pairs an expert: the busiest experts take 128-column tiles
        let tiled = n_pairs > MOE_TILED_AVG * n_expert
            && mmq::tiled_id_fits(cx, &w, d)
            && up.is_none_or(|(wu, _)| mmq::tiled_id_fits(cx, &wu, d));
        let max_pairs = if tiled { MOE_MMA_MAX } else { i32::MAX };
        let xs = moe_mma::moe_prep(cx, ids, n_expert, &g, max_pairs, b, Some(packed), op)?;
        moe_mma::moe_mma(cx, w, d, b.ne[1], n_used, n_pairs, &g, packed, xs, out, up)?;
        if tiled {
            let (offsets, list) = (g.offsets, g.list);
            for (w, out) in std::iter::once((w, out)).chain(up) {
                let busy =
                    mmq::mul_mat_id(cx, w, d, b, n_used, n_pairs, offsets, list, max_pairs, out, packed, Some(xs));
                busy.unwrap_or_else(|| Err(unsupported_id("the tiled kernels refused experts they fit")))?;
            }
        }
        return Ok(());
    }
    moe_mma::moe_prep(cx, ids, n_expert, &g, i32::MAX, b, None, op)?;
    let bp = cx.scratch + groups as u64;
    let ldb = packed_len(b.ne[0] as usize) as i64;
    pack_b(cx, b, bp, 0, 0, 0, ldb)?;
    let (adt, n_b) = (dt(d), b.ne[1]);
    let vec = i32::from(rows_vectorizable(&w, d) && bp.is_multiple_of(16));
    let grid =
        ((w.ne[1] as u64).div_ceil(MM_WARPS as u64).min(i32::MAX as u64) as u32, n_expert.clamp(1, GRID_YZ) as u32, 1);
    let (offsets, list) = (g.offsets, g.list);
    let mut args = cx.kernel(MOE_GEMV)?;
    args.arg(&w)
        .arg(&adt)
        .arg(&bp)
        .arg(&ldb)
        .arg(&n_b)
        .arg(&n_used)
        .arg(&offsets)
        .arg(&list)
        .arg(&out)
        .arg(&vec)
        .arg(&MOE_GEMV_MAX);
    // SAFETY: `moe_gemv(as, adt, bp, ldb, n_b, n_used, offsets, list, out, vec, gemv_max)`: expert e =
    // blockIdx.y < n_expert (the rules keep n_expert small) reads its dense rows of as; the list
    // holds valid pairs s = u + n_used * t only, so b row (u mod n_b) + n_b * t is one of the
    // packed rows and out[:, u, t] is inside out [m, n_used, T].
    unsafe { args.launch(config(grid, (MM_WARPS * 32, 1, 1), 0)) }?;

    if mmq::weights_fit(&w, d)
        && let Some(done) =
            mmq::mul_mat_id(cx, w, d, b, n_used, n_pairs, offsets, list, MOE_GEMV_MAX, out, packed, None)
    {
        return done;
    }
    let grid = ((w.ne[1] as u64).div_ceil(MT_M).min(i32::MAX as u64) as u32, grid.1, 1);
    let mut args = cx.kernel(MOE_GEMM)?;
    args.arg(&w)
        .arg(&adt)
        .arg(&bp)
        .arg(&ldb)
        .arg(&n_b)
        .arg(&n_used)
        .arg(&offsets)
        .arg(&list)
        .arg(&out)
        .arg(&MOE_GEMV_MAX);
    // SAFETY: `moe_gemm(as, adt, bp, ldb, n_b, n_used, offsets, list, out, gemv_max)`: as moe_gemv (the
    // experts with many pairs); weight rows and k beyond the tensor are masked to zero.
    unsafe { args.launch(config(grid, (THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// Most tokens `moe_rings` (gemv_one.rs) takes, one launch a token: 1, one token's product, unless
/// `TESSERA_MOE_RING_TOKENS` (read once a process) sets more, to measure the ring a token at a
/// time against `moe_decode*` at a few tokens; 0 when `TESSERA_MOE_PATH` forces another path.
pub(super) fn ring_tokens() -> i64 {
    static SET: OnceLock<Option<i64>> = OnceLock::new();
    if moe_path() != MoePath::Auto {
        return 0;
    }
    crate::launch::env_number(&SET, "TESSERA_MOE_RING_TOKENS").unwrap_or(1)
}

/// Whether mul_mat_id takes `moe_decode`: few tokens where it beats `moe_mma_*` (or forced by
/// `TESSERA_MOE_PATH`), one grid row a pair (a pair count past the grid's y limit takes the
/// grouped path), rows the fast units can read.
/// `mma`: whether `moe_mma_*` could take the experts (`moe_mma_fits`).
pub(super) fn moe_decode_taken(w: &TensorArg, d: DType, ids: &TensorArg, mma: bool) -> bool {
    let n_pairs = ids.nelements();
    let decode = match moe_path() {
        MoePath::Auto => ids.ne[1] <= MOE_DECODE_TOKENS && (!mma || moe_decode_wins(ids.ne[1], w.ne[0])),
        MoePath::Decode => true,
        MoePath::Mma | MoePath::Grouped => false,
    };
    decode && n_pairs <= GRID_YZ && fast_rows(w, d)
}

/// Whether `moe_mma_*` can take these experts for this many pairs (and is not switched off).
pub(super) fn moe_mma_fits(cx: &Cx<'_>, w: &TensorArg, d: DType, ids: &TensorArg) -> bool {
    moe_path() != MoePath::Grouped && moe_mma::moe_fits(cx, w, d, ids.nelements())
}

/// Whether `moe_decode` beats `moe_mma_*` at `n_tokens` tokens (at most `MOE_DECODE_TOKENS`) for
/// experts of `k`-long rows. A `moe_mma_*` warp multiplies its rows' k-chunks of 256 values one
/// after another, so with few tokens (few routed experts, few work items) the time is that chain's
/// latency, which grows with k, while `moe_decode`'s grows with the pairs. Measured (nvfp4, 256
/// experts top-8: docs/perf-log/kernels-matmul.md), the two crossed near chunks / 2 tokens, and
/// `moe_mma_*` won at every token count for rows of 2 chunks. So: `moe_decode` up to chunks / 2
/// tokens, and never for rows of at most 2 chunks.
fn moe_decode_wins(n_tokens: i64, k: i64) -> bool {
    let chunks = k / 256;
    chunks > 2 && 2 * n_tokens <= chunks
}

/// A device error for a mul_mat_id path that refused shapes it had accepted (a bug, not bad input).
fn unsupported_id(why: &str) -> BackendError {
    BackendError::Device { backend: crate::errors::NAME.into(), detail: format!("mul_mat_id: {why}") }
}

/// mul_mat_id for a few tokens: `moe_decode` over the (slot, token) pairs, after the activations
/// are quantized (`quant_x`) or packed to f32 rows at the start of scratch. With `up` (the up
/// experts of mul_mat_id_swiglu) `moe_decode_glu`: each warp one row of both, swiglu before the
/// store.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_decode(
    cx: &mut Cx<'_>,
    w: TensorArg,
    up: Option<TensorArg>,
    d: DType,
    b: TensorArg,
    ids: TensorArg,
    out: TensorArg,
    op: u32,
) -> Result<(), BackendError> {
    let (x, ldx) = fast_activations(cx, d, b)?;
    let kernel = if up.is_some() { MOE_DECODE_GLU } else { MOE_DECODE };
    let (adt, n_b, err) = (dt(d), b.ne[1], cx.errors);
    let blocks = (w.ne[1] as u64).div_ceil(GF_THREADS as u64 / 32).min(i32::MAX as u64) as u32;
    let grid = (blocks, ids.nelements().max(1) as u32, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&w);
    if let Some(up) = &up {
        args.arg(up);
    }
    args.arg(&adt).arg(&x).arg(&ldx).arg(&n_b).arg(&ids).arg(&out).arg(&err).arg(&op);
    // SAFETY: `moe_decode(as, adt, x, ldx, n_b, ids, out, err, op)` (`moe_decode_glu` with
    // `as_up` after `as`): pair s = blockIdx.y < n_used * T (at most GRID_YZ pairs, as
    // `moe_decode_taken` checked: none is cut off) reads ids[s mod n_used, s / n_used] and skips
    // ids outside [0, n_expert); weight rows m < M of that expert are dense of dtype adt and
    // aligned as `fast_rows` checked; the up experts have the gate's dtype, shape (shape rules)
    // and strides (checked by the caller), so each row read there lies where the same row of `w`
    // would; activation row (u mod n_b) + n_b t is one of b's n_b * T rows of ldx bytes in
    // scratch (scales after them as `quant_x` writes them; scratch_bytes sizes both); out[m, u,
    // t] lies in out [M, n_used, T].
    unsafe { args.launch(config(grid, (GF_THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// Whether mul_mat_id_weighted_sum takes `moe_decode_sum`: up to `MOE_DECODE_SUM_TOKENS` tokens
/// (`TESSERA_MOE_PATH=decode` up to `MOE_DECODE_TOKENS`; `mma` / `grouped` never), rows the
/// fast units can read.
pub(super) fn weighted_decode_taken(w: &TensorArg, d: DType, ids: &TensorArg) -> bool {
    let most = match moe_path() {
        MoePath::Auto => MOE_DECODE_SUM_TOKENS,
        MoePath::Decode => MOE_DECODE_TOKENS,
        MoePath::Mma | MoePath::Grouped => 0,
    };
    ids.ne[1] <= most && fast_rows(w, d)
}

/// mul_mat_id_weighted_sum for a few tokens: `moe_decode_sum`, a warp per output row summing its
/// token's weighted slots.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_decode_sum(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    b: TensorArg,
    ids: TensorArg,
    rw: TensorArg,
    out: TensorArg,
    op: u32,
) -> Result<(), BackendError> {
    let (x, ldx) = fast_activations(cx, d, b)?;
    let (adt, n_b, err) = (dt(d), b.ne[1], cx.errors);
    let blocks = (w.ne[1] as u64).div_ceil(GF_THREADS as u64 / 32).min(i32::MAX as u64) as u32;
    let grid = (blocks, ids.ne[1].max(1) as u32, 1);
    let mut args = cx.kernel(MOE_DECODE_SUM)?;
    args.arg(&w).arg(&adt).arg(&x).arg(&ldx).arg(&n_b).arg(&ids).arg(&rw).arg(&out).arg(&err).arg(&op);
    // SAFETY: `moe_decode_sum(as, adt, x, ldx, n_b, ids, w, out, err, op)`: token t =
    // blockIdx.y < T (at most GRID_YZ, checked) reads ids[u, t] for u < n_used and skips ids
    // outside [0, n_expert); the weight rows m < M (a warp past M reads row M - 1 and stores
    // nothing) of that expert are dense of dtype adt and aligned as `fast_rows` checked;
    // activation row (u mod n_b) + n_b t is one of b's n_b * T rows of ldx bytes in scratch
    // (scales after them as `quant_x` writes them); w [1, n_used, T] and out [M, T] f32 (shape
    // rules).
    unsafe { args.launch(config(grid, (GF_THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// out[m, t] = sum_u w[0, u, t] y[m, u, t] over mul_mat_id's output `y` in scratch.
pub(super) fn weighted_slot_sum(
    cx: &mut Cx<'_>,
    y: TensorArg,
    w: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
    let blocks = blocks_for(y.ne[0] * y.ne[2], 256);
    let mut args = cx.kernel(WEIGHTED_SLOT_SUM)?;
    args.arg(&y).arg(&w).arg(&out);
    // SAFETY: y [M, n_used, T] f32 (written by mul_mat_id), w [1, n_used, T] and out [M, T]
    // f32 (shape rules); a grid-stride loop over the M T outputs.
    unsafe { args.launch(config((blocks, 1, 1), (256, 1, 1), 0)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_kernels_are_entry_points_of_moe_cu() {
        for k in [MOE_DECODE, MOE_DECODE_GLU, MOE_DECODE_SUM, WEIGHTED_SLOT_SUM, MOE_GEMV, MOE_GEMM] {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
    }

    #[test]
    fn moe_decode_takes_few_tokens_of_long_rows_only() {
        // 35B-A3B gate/up (k 2048): up to 4 tokens; down (k 512) and short rows: never
        assert!((1..=4).all(|t| moe_decode_wins(t, 2048)));
        assert!(!moe_decode_wins(5, 2048));
        assert!((1..=16).all(|t| !moe_decode_wins(t, 512) && !moe_decode_wins(t, 256)));
        assert!(moe_decode_wins(1, 1024) && !moe_decode_wins(3, 1024));
    }
}
