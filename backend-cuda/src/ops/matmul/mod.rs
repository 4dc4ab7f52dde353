//! mul_mat and mul_mat_id (and their fused forms) on CUDA: the choice among the paths and the
//! launch wrappers of the matmul kernel modules, one file per module as in `kernels/`:
//! - `pack.rs` (`pack.cu`): activations packed to f32 / f16 / bf16 rows, quantized weights
//!   dequantized to bf16, in scratch;
//! - `gemv.rs` (`gemv.cu`): 1-8 tokens a pass, the warp GEMV (any weights) and the fast GEMV;
//! - `gemv_one.rs` (`gemv_one.cu`): one token against one matrix, the ring and word GEMVs;
//! - `moe.rs` (`moe.cu`): mul_mat_id's paths and its kernels off the tensor cores;
//! - `mmq.rs` (`mmq.cu`): the tiled tensor-core GEMM of q8_0 / nvfp4 weights (mul_mat and
//!   mul_mat_id with many pairs an expert);
//! - `moe_mma.rs` (`moe_mma.cu`): mul_mat_id with few pairs an expert on tensor cores (the pairs
//!   grouped by expert on the device, each routed expert's rows read once), and dense products
//!   of a few tokens on the same kernels;
//! - `gemm_f32.rs` (`gemm_f32.cu`): the split-tf32 tensor-core GEMM of f32 weights;
//! - `blas.rs`: the GEMM through cuBLAS.
//!
//! `kernels/matmul.cuh` holds the device code that `pack.cu`, `gemv.cu` and `moe.cu` share;
//! `kernels/quant_mma.cuh` what `mmq.cu` and `moe_mma.cu` share.
//!
//! Paths (f32 accumulation throughout). First, one column against batches that share their
//! matrices (grouped-query attention's K Q or V^T P at decode) becomes r columns against each
//! matrix (`broadcast_as_columns`), and one f32 weight row against many columns swaps roles
//! (`one_row_swapped`); then:
//! - **GEMV** (`n <= GEMV_MAX_N`, and the general path for anything cuBLAS cannot take): the
//!   activations are packed into f32 scratch rows, then one warp per weight row reads the row
//!   once for up to 8 tokens (`gemv_warp_{1,2,4,8}`), any weight dtype and outer strides.
//!   Aligned q8_0 / nvfp4 weights (and few long f16 / bf16 rows) take `gemv_fast_{1,2,4,8}`
//!   instead: one block per 1, 2 or 4 weight rows (`gemv_fast_rows`: with several tokens each
//!   activation load serves several rows) reading 16-value units straight from global memory;
//!   quantized weights against activations quantized once per call to int16 (two int8 halves,
//!   `quant_x`) with `dp4a`. One token against one contiguous q8_0 / nvfp4 matrix (k % 256 ==
//!   0), and 2-4 tokens where `dense_mma` does not take them, in one launch (two pairs, or a pair
//!   and one, where the rows are too long) (`gemv_ring_columns`), take the ring GEMV
//!   `gemv_ring_q8_0[_t2|_t3|_t4]_s*` / `gemv_ring_nvfp4[_t2|_t3|_t4]_s*` (`gemv_ring_plan`):
//!   rows streamed through a ring of shared-memory stages (bulk copies on sm_90+), a thread per
//!   64-value unit of the row with its activations (of every token of the launch) quantized in
//!   the kernel and kept in registers, int16 x int8 `dp2a`. One token against one f16 / bf16
//!   matrix of 16-byte words (or f32 of rows of at least 1024 values: the MoE router) takes
//!   `gemv_f16w` / `gemv_bf16w` / `gemv_f32w` (`[_long]`) the same way (the activations read in
//!   place when they are one dense row, else after `pack_b`), 2 or 5 words a thread. Both come
//!   closer to the copy bandwidth at one token than the GEMVs before them
//!   (docs/perf-log/kernels-matmul.md).
//! - **Tensor cores over rows read once** (2-32 tokens against contiguous q8_0 / nvfp4 matrices
//!   of enough 32-row items: 16 a multiprocessor at 2 tokens (and at 3-4 where the ring GEMV's
//!   `_t3_` / `_t4_` entries take the matrix), 1.5 at 3-16, 2 beyond; the `_n1` entries up to 8
//!   tokens): `moe_mma::dense_mma`, the matrix as one expert of `moe_mma_*` (rows streamed
//!   through shared memory, each row read once for every token), where `gemv_fast`'s dp4a work
//!   grows with the tokens and mmq's 128-column tiles would multiply mostly padding
//!   (`dense_mma_limits`).
//! - **GEMM** (`n > GEMV_MAX_N`): `mmq` for the weights it takes; one f32 weight matrix of
//!   16-byte aligned rows against such columns (K % 4 == 0) `gemm_f32`: tensor cores in split
//!   tf32 (3xTF32, about 21 significant bits a product), 64 x 64 tiles, K split over the blocks
//!   with a fixed-order sum when the tiles alone would leave the GPU idle (the MoE router's 256 x
//!   512 x 2048: 32 tiles, 8 splits). Else cuBLAS (`blas.rs`): f32 weights go through `gemm_ex`
//!   in place; f16 / bf16 weights through `gemm_ex` in place with the activations converted to
//!   the weights' type (also for 2-8 tokens against f16 / bf16 matrices `gemv_fast` does not
//!   take); q8_0 / nvfp4 weights are dequantized in row chunks to bf16 (nvfp4
//!   values are exact in bf16; q8_0 values are split into hi + lo bf16 parts) and multiplied by
//!   hi + lo bf16 activations, so the result keeps f32-level accuracy (the quantized cases take
//!   the f32 bound).
//! - **mul_mat_id** (`moe.rs`): one token over q8_0 / nvfp4 experts of contiguous rows on sm_90+
//!   (and its fused forms) takes `moe_ring_*` (`gemv_one.rs`): the ring GEMV over the routed
//!   experts' rows, gathered by bulk copies, one launch. Else up to `MOE_DECODE_TOKENS` tokens,
//!   `moe_decode` runs a warp per
//!   weight row over the routed (slot, token) pairs only, with `gemv_fast`'s units (for q8_0 /
//!   nvfp4 experts only where it beats `moe_mma_*`: long rows, a few tokens, `moe_decode_wins`).
//!   Beyond, `moe_mma::moe_prep` groups the (slot, token) pairs by expert on the device (no host
//!   sync). q8_0 / nvfp4 experts that `moe_mma::moe_fits` then take `moe_mma_*` (moe_mma.cu):
//!   each routed expert's rows are read once and multiplied by all its pairs on tensor cores; when
//!   experts average more than `MOE_TILED_AVG` pairs, those with more than `MOE_MMA_MAX` go to the
//!   tiled `mmq_*_id` instead. Other experts: `moe_gemv` runs the rows of experts with few pairs
//!   over them 8 at a time (the last few through a dot just wide enough), and `mmq_*_id` or
//!   `moe_gemm` (shared-memory tiles) the experts with many. `TESSERA_MOE_PATH=decode|mma|grouped`
//!   (read once a process) forces one of these where it can take the shapes, to measure them
//!   against each other.

mod blas;
mod gemm_f32;
mod gemv;
mod gemv_one;
mod mmq;
mod moe;
pub(crate) mod moe_mma;
mod pack;

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, TensorMeta};

use self::blas::{blas_fits, blas_scratch, mul_mat_blas};
use self::gemm_f32::{gemm_f32, gemm_f32_fits, gemm_f32_scratch};
use self::gemv::{fast_gemv_fits, fast_rows, gemv_fast, gemv_fast_glu, gemv_warp, glu_gemv_fits, quant_x_bytes};
use self::gemv_one::{
    MoeRingMode, RingPlan, gemv_ring, gemv_ring_plan, gemv_ring_stages, gemv_words, moe_rings, word_gemv,
};
use self::moe::{
    moe_decode, moe_decode_sum, moe_decode_taken, moe_mma_fits, moe_scratch, mul_mat_id, ring_tokens,
    weighted_decode_taken, weighted_slot_sum,
};
use self::pack::packed_f32_bytes;
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, unsupported};

/// Threads a block of the grid-stride kernels (`pack_b`, `quant_x`, `dequant_rows`) and of
/// `moe_gemm`.
const THREADS: u32 = 256;

/// Warps (weight rows) per block of the warp GEMVs (`gemv_warp_N`, `moe_gemv`): TAG(mm-warps),
/// `MM_WARPS` in matmul.cuh.
const MM_WARPS: u32 = 4;

/// Threads per block of the fast GEMVs (`gemv_fast_N`: one weight row or a few; `moe_decode*`:
/// a warp a row): `GF_THREADS` in matmul.cuh.
const GF_THREADS: u32 = 128;

/// Most tokens a GEMV pass serves per weight read; above this cuBLAS takes the product.
const GEMV_MAX_N: i64 = 8;

/// Alignment of every scratch region.
const ALIGN: usize = 256;

/// Weights f32 / f16 / bf16 / q8_0 / nvfp4 and f32 activations, as the shape rules allow.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    // the gate-and-up ops take their activations after the up weights
    let x = if matches!(op, Op::MulMatSwiglu | Op::MulMatIdSwiglu) { 2 } else { 1 };
    inputs.get(x).is_some_and(|b| b.dtype == DType::F32)
        && inputs
            .first()
            .is_some_and(|a| matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::NvFp4))
}

fn align(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGN)
}

pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let m = |i: usize| task.inputs.get(i).map(|t| t.meta);
    match (task.op, m(0), m(1), m(2), m(3)) {
        (Op::MulMat, Some(a), Some(b), _, _) => mul_mat_scratch(&a, &b),
        (Op::MulMatId, Some(w), Some(b), Some(ids), _) => moe_scratch(&w, &b, &ids),
        (Op::MulMatSwiglu | Op::MulMatIdSwiglu, ..) => {
            glu_up_at(task).map_or(0, |at| at + task.output.meta.nbytes_contiguous())
        }
        (Op::MulMatIdWeightedSum, Some(w), Some(b), Some(ids), _) => {
            align(moe_scratch(&w, &b, &ids)) + 4 * w.ne[1] * ids.nelements()
        }
        _ => 0,
    }
}

fn mul_mat_scratch(a: &TensorMeta, b: &TensorMeta) -> usize {
    let (xq, xs) = quant_x_bytes(b.nelements());
    let gemv = packed_f32_bytes(b).max(if a.dtype.is_quantized() { xq + xs } else { 0 });
    if (b.ne[1] as i64) > GEMV_MAX_N {
        gemv.max(blas_scratch(a, b)).max(mmq::mul_mat_scratch_bytes(b)).max(gemm_f32_scratch(a, b))
    } else if a.dtype.is_quantized() {
        // (mmq's packed activations for `dense_mma` at a few tokens)
        gemv.max(mmq::packed_bytes(b))
    } else {
        // (cuBLAS's converted activations for f16 / bf16 weights at 2-8 tokens)
        gemv.max(blas_scratch(a, b))
    }
}

/// The fewest tokens for which f16 / bf16 weights that `gemv_fast` does not take go to cuBLAS: 2,
/// or `TESSERA_HALF_BLAS_TOKENS` (read once a process; 9 keeps `gemv_warp` up to GEMV_MAX_N
/// tokens, to measure one against the other).
fn half_blas_tokens() -> i64 {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_HALF_BLAS_TOKENS").unwrap_or(2).max(2)
}

/// When `moe_mma::dense_mma` takes a quantized mul_mat of `n` tokens, on `sms` multiprocessors:
/// (the least 32-row items of weight rows, the fewest tokens, the most tokens). Default
/// `moe_mma::dense_mma_min_items` and `moe_mma::DENSE_MMA_MIN_TOKENS` ..= `DensePairs::MAX`;
/// `TESSERA_DENSE_MMA=N`, read once a process, sets N items in all and 2 tokens (1: every shape,
/// to test it), 0 turns the path off; `TESSERA_DENSE_MMA_MAX=T` sets the most tokens (8 keeps
/// mmq's tiles from 9 tokens, as before 2026-11-28) and `TESSERA_DENSE_MMA_MIN=T` the fewest (5
/// keeps the ring GEMV once a token at 2-4 tokens, as before 2026-11-28's second change).
/// `wide_ring`: the product is 3 or 4 tokens that the ring GEMV's `_t3_` / `_t4_` entries take;
/// by default they then need as many items as 2 tokens do (only the widest matrices, such as the
/// output projection, stay on `dense_mma`): one `_t4_` launch beat `dense_mma` at 8192 x 2048 and
/// 17408 x 5120 (docs/perf-log/kernels-matmul.md).
fn dense_mma_limits(sms: usize, n: i64, wide_ring: bool) -> (i64, i64, i64) {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    static MAX: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    static MIN: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let max = crate::launch::env_number(&MAX, "TESSERA_DENSE_MMA_MAX")
        .unwrap_or(moe_mma::DensePairs::MAX as i64)
        .min(moe_mma::DensePairs::MAX as i64);
    match crate::launch::env_number(&SET, "TESSERA_DENSE_MMA") {
        Some(items) => (items, 2, max),
        None => {
            let min = crate::launch::env_number(&MIN, "TESSERA_DENSE_MMA_MIN").unwrap_or(moe_mma::DENSE_MMA_MIN_TOKENS);
            let items = moe_mma::dense_mma_min_items(sms as i64, if wide_ring { 2 } else { n });
            (items, min.max(moe_mma::DENSE_MMA_MIN_TOKENS), max)
        }
    }
}

/// Where a gate-and-up op that runs as its two products and swiglu keeps the up product in
/// scratch: after what one product needs.
fn glu_up_at(task: &Task<'_>) -> Option<usize> {
    let m = |i: usize| task.inputs.get(i).map(|t| t.meta);
    match (task.op, m(0), m(2), m(3)) {
        (Op::MulMatSwiglu, Some(a), Some(b), _) => Some(align(mul_mat_scratch(&a, &b))),
        (Op::MulMatIdSwiglu, Some(w), Some(b), Some(ids)) => Some(align(moe_scratch(&w, &b, &ids))),
        _ => None,
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let dtype = task.inputs.first().map(|t| t.meta.dtype);
    match (task.op, ins, dtype) {
        (Op::MulMat, [a, b], Some(d)) => mul_mat(cx, *a, d, *b, out),
        (Op::MulMatId, [w, b, ids], Some(d)) => mul_mat_id(cx, *w, d, *b, *ids, out, None, op_code("mul_mat_id")),
        (Op::MulMatSwiglu, [wg, wu, b], Some(d)) => {
            if glu_gemv_fits(wg, wu, d, b) {
                return gemv_fast_glu(cx, *wg, *wu, d, *b, out);
            }
            let up = glu_up(cx, task, out)?;
            // both products in one mmq launch where it takes them, else one after the other
            let x = cx.scratch;
            let both = b.ne[1] > GEMV_MAX_N && mmq::weights_fit(wg, d) && mmq::weights_fit(wu, d);
            match both.then(|| mmq::mul_mat(cx, *wg, d, *b, out, x, Some((*wu, up)))).flatten() {
                Some(done) => done?,
                None => {
                    mul_mat(cx, *wg, d, *b, out)?;
                    mul_mat(cx, *wu, d, *b, up)?;
                }
            }
            super::elementwise::swiglu_f32(cx, out, up, out)
        }
        (Op::MulMatIdSwiglu, [wg, wu, b, ids], Some(d)) => {
            let op = op_code("mul_mat_id_swiglu");
            if let Some(done) =
                moe_rings(cx, MoeRingMode::Glu, *wg, Some(*wu), d, *b, *ids, None, out, op, ring_tokens())
            {
                return done;
            }
            if moe_decode_taken(wg, d, ids, moe_mma_fits(cx, wg, d, ids)) && fast_rows(wu, d) && wg.nb == wu.nb {
                return moe_decode(cx, *wg, Some(*wu), d, *b, *ids, out, op);
            }
            let up = glu_up(cx, task, out)?;
            mul_mat_id(cx, *wg, d, *b, *ids, out, Some((*wu, up)), op)?;
            super::elementwise::swiglu_f32(cx, out, up, out)
        }
        (Op::MulMatIdWeightedSum, [w, b, ids, rw], Some(d)) => {
            let op = op_code("mul_mat_id_weighted_sum");
            if let Some(done) =
                moe_rings(cx, MoeRingMode::Sum, *w, None, d, *b, *ids, Some(*rw), out, op, ring_tokens())
            {
                return done;
            }
            if weighted_decode_taken(w, d, ids) {
                return moe_decode_sum(cx, *w, d, *b, *ids, *rw, out, op);
            }
            // mul_mat_id into scratch after what it needs, then the weighted sum over the slots
            let at = align(moe_scratch(&task.inputs[0].meta, &task.inputs[1].meta, &task.inputs[2].meta));
            let ne = [w.ne[1], ids.ne[0], ids.ne[1], 1];
            let nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]];
            let y = TensorArg { data: cx.scratch + at as u64, ne, nb };
            mul_mat_id(cx, *w, d, *b, *ids, y, None, op)?;
            weighted_slot_sum(cx, y, *rw, out)
        }
        _ => Err(unsupported(task, "not a matmul op with its inputs")),
    }
}

/// Whether weight rows may be read in 16-byte pieces: every row start 16-byte aligned and the
/// row length a multiple of 16 bytes.
fn rows_vectorizable(a: &TensorArg, d: DType) -> bool {
    let row_bytes = d.row_bytes(a.ne[0] as usize).unwrap_or(1);
    let strides_ok = (1..4).all(|i| a.ne[i] <= 1 || a.nb[i] % 16 == 0);
    a.data.is_multiple_of(16) && row_bytes.is_multiple_of(16) && strides_ok
}

/// Most tokens for which mul_mat runs the ring GEMV (`gemv_ring_columns`) instead of
/// `gemv_fast`.
const RING_MAX_TOKENS: i64 = 4;

/// Whether the ring GEMV takes tokens in pairs (the `_t2_` entries, each row read once for both):
/// yes unless `TESSERA_RING_PAIRS=0` (read once a process), which runs every token alone, as
/// before 2026-11-28.
fn ring_pairs() -> bool {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_RING_PAIRS") != Some(0)
}

/// Whether the ring GEMV takes three or four tokens in one launch (the `_t3_` / `_t4_` entries)
/// where it has a plan for them: yes unless `TESSERA_RING_QUADS=0` (read once a process), which
/// runs them as a pair and one token, or two pairs.
fn ring_quads() -> bool {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_RING_QUADS") != Some(0)
}

/// The ring GEMV's plan for `a` against the columns `b` (1-4) on this device.
fn ring_plan(cx: &Cx<'_>, a: &TensorArg, d: DType, b: &TensorArg) -> Option<RingPlan> {
    let stages = gemv_ring_stages(cx.info.peak_memory_bandwidth);
    gemv_ring_plan(a, d, b, cx.info.max_shared_per_block, stages, cx.info.compute_capability.0 >= 9)
}

/// The ring GEMV's plan for three or four tokens in one launch (its `_t3_` / `_t4_` entries):
/// `None` for other token counts, without `ring_quads`, or where the rows are too long for every
/// token's staged activations.
fn wide_ring_plan(cx: &Cx<'_>, a: &TensorArg, d: DType, b: &TensorArg) -> Option<RingPlan> {
    if (3..=RING_MAX_TOKENS).contains(&b.ne[1]) && ring_quads() { ring_plan(cx, a, d, b) } else { None }
}

/// mul_mat of 1-`RING_MAX_TOKENS` tokens (one batch) on the ring GEMV: three or four tokens in
/// one launch with `wide` (`wide_ring_plan`), else pairs of tokens on the two-token entries and an
/// odd last token (or every token, without `ring_pairs`) on the one-token ones; `None` where the
/// ring does not take the matrix.
fn gemv_ring_columns(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    wide: Option<RingPlan>,
) -> Option<Result<(), BackendError>> {
    let n = b.ne[1];
    if !(1..=RING_MAX_TOKENS).contains(&n) || b.ne[2] * b.ne[3] != 1 || out.ne[2] * out.ne[3] != 1 {
        return None;
    }
    if let Some(p) = wide {
        return Some(gemv_ring(cx, a, d, b, out, p));
    }
    // columns i .. i + w of t
    let cols = |t: &TensorArg, i: i64, w: i64| TensorArg {
        data: t.data + (i * t.nb[1]) as u64,
        ne: [t.ne[0], w, 1, 1],
        nb: t.nb,
    };
    let plan = |w: i64| ring_plan(cx, &a, d, &cols(&b, 0, w));
    let one = plan(1)?;
    let two = if n >= 2 && ring_pairs() { plan(2) } else { None };
    let mut run = || {
        let mut i = 0;
        while i < n {
            let (w, p) = match two {
                Some(p) if n - i >= 2 => (2, p),
                _ => (1, one),
            };
            gemv_ring(cx, a, d, cols(&b, i, w), cols(&out, i, w), p)?;
            i += w;
        }
        Ok(())
    };
    Some(run())
}

fn mul_mat(cx: &mut Cx<'_>, a: TensorArg, d: DType, b: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    if let Some((a, b, out)) = one_row_swapped(&a, d, &b, &out) {
        return mul_mat(cx, a, DType::F32, b, out);
    }
    if let Some((b, out)) = broadcast_as_columns(&a, &b, &out) {
        return mul_mat(cx, a, d, b, out);
    }
    let n = b.ne[1];
    let x = cx.scratch;
    // a few tokens against q8_0 / nvfp4 weights of enough rows: tensor cores over rows read once
    // (mmq's 128-column tiles would multiply mostly padding, and `gemv_fast` decode each unit once
    // a token)
    let wide = wide_ring_plan(cx, &a, d, &b);
    let (min_items, min_tokens, max_tokens) = dense_mma_limits(cx.info.multiprocessors, n, wide.is_some());
    if (min_tokens..=max_tokens).contains(&n)
        && min_items > 0
        && let Some(done) = moe_mma::dense_mma(cx, a, d, b, out, min_items, min_tokens)
    {
        return done;
    }
    if n > GEMV_MAX_N
        && mmq::weights_fit(&a, d)
        && let Some(done) = mmq::mul_mat(cx, a, d, b, out, x, None)
    {
        return done;
    }
    if n > GEMV_MAX_N && gemm_f32_fits(&a, d, &b, &out, cx.info.max_shared_per_block) {
        return gemm_f32(cx, a, b, out);
    }
    if n > GEMV_MAX_N && blas_fits(&a, d, &b, &out) {
        return mul_mat_blas(cx, a, d, b, out);
    }
    // f16 / bf16 weights against 2-8 tokens that `gemv_fast` does not take (more than its
    // SPLIT_ROWS rows): cuBLAS reads the matrix once for all the tokens, where `gemv_warp` ran at
    // a sixth of the copy rate (docs/perf-log/kernels-matmul.md).
    if n >= half_blas_tokens()
        && matches!(d, DType::F16 | DType::BF16)
        && !fast_gemv_fits(&a, d)
        && blas_fits(&a, d, &b, &out)
    {
        return mul_mat_blas(cx, a, d, b, out);
    }
    // 1-4 tokens against a matrix the ring GEMV takes (and, from 2, `dense_mma` did not): the
    // ring GEMV, up to four tokens a launch. Even once a token it beat `gemv_fast_2` / `_4`, whose
    // loads of the activations for each 16-value unit bound them (docs/perf-log/kernels-matmul.md).
    if let Some(done) = gemv_ring_columns(cx, a, d, b, out, wide) {
        return done;
    }
    if let Some(kernel) = word_gemv(&a, d, &b) {
        return gemv_words(cx, a, b, out, kernel);
    }
    if fast_gemv_fits(&a, d) {
        return gemv_fast(cx, a, d, b, out);
    }
    gemv_warp(cx, a, d, b, out)
}

/// One column against batches that share their matrices (grouped-query attention at decode: the
/// r query heads of a kv head against its K or V) as r columns against each matrix: batch
/// `i2 r + j` of b and out becomes column j of batch i2, so each matrix is read once for the r
/// columns rather than once for each (the warp GEMV ran such a K Q at 1% of the copy rate:
/// docs/perf-log/kernels-matmul.md). Only the second dimension's broadcast folds; a broadcast
/// of the fourth stays one.
fn broadcast_as_columns(a: &TensorArg, b: &TensorArg, out: &TensorArg) -> Option<(TensorArg, TensorArg)> {
    let r = b.ne[2] / a.ne[2].max(1);
    if b.ne[1] != 1 || out.ne[1] != 1 || r < 2 || a.ne[2] * r != b.ne[2] || out.ne[2] != b.ne[2] {
        return None;
    }
    let fold = |t: &TensorArg| TensorArg {
        data: t.data,
        ne: [t.ne[0], r, a.ne[2], t.ne[3]],
        nb: [t.nb[0], t.nb[2], t.nb[2] * r, t.nb[3]],
    };
    Some((fold(b), fold(out)))
}

/// One f32 weight row against N > 1 columns (a gate's logit for every token) as the product with
/// the roles swapped: the columns, dense f32 rows of K, as the matrix and the weight row as the one
/// column, whose output [N, 1] has the bytes of [1, N] when that is dense. The same sums, read at
/// the matrix-vector kernels' speed (above 8 columns the row went to cuBLAS as a GEMM of one row,
/// several times its read time: docs/perf-log/prefill-step.md). Both operands and the output must
/// be single matrices (no batch dimensions).
fn one_row_swapped(
    a: &TensorArg,
    d: DType,
    b: &TensorArg,
    out: &TensorArg,
) -> Option<(TensorArg, TensorArg, TensorArg)> {
    let single = |t: &TensorArg| t.ne[2] == 1 && t.ne[3] == 1;
    let fits = d == DType::F32
        && a.ne[1] == 1
        && a.nb[0] == 4
        && b.ne[1] > 1
        && b.nb[0] == 4
        && out.nb[0] == 4
        && single(a)
        && single(b)
        && single(out);
    let n = b.ne[1];
    fits.then(|| {
        let column = TensorArg { data: out.data, ne: [n, 1, 1, 1], nb: [4, 4 * n, 4 * n, 4 * n] };
        (*b, *a, column)
    })
}

/// The up product's place in scratch for a gate-and-up op run as two products and swiglu:
/// contiguous f32 of the output's shape after what one product needs (`glu_up_at`).
fn glu_up(cx: &Cx<'_>, task: &Task<'_>, out: TensorArg) -> Result<TensorArg, BackendError> {
    let at = glu_up_at(task).ok_or_else(|| unsupported(task, "not a gate-and-up op with its inputs"))?;
    let ne = out.ne;
    let nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]];
    Ok(TensorArg { data: cx.scratch + at as u64, ne, nb })
}

/// Whether `kernel` is an entry point of its module's source, defined there directly or through
/// an `..._ENTRY(name, ...)` macro (for the tests: a kernel that names the wrong module fails only
/// when it is launched, on a GPU).
#[cfg(test)]
fn defined_in_its_module(kernel: crate::compile::Kernel) -> bool {
    let (direct, by_macro) = (format!(" {}(", kernel.name), format!("_ENTRY({},", kernel.name));
    kernel.module.source_from(None).lines().any(|line| {
        let line = line.trim_start();
        (line.starts_with("extern \"C\" __global__") && line.contains(&direct)) || line.contains(&by_macro)
    })
}

#[cfg(test)]
mod tests {
    use tessera_ops::DType;

    use super::{broadcast_as_columns, one_row_swapped};
    use crate::compile::{Kernel, Module};
    use crate::launch::TensorArg;

    fn dense(data: u64, ne: [i64; 4]) -> TensorArg {
        TensorArg { data, ne, nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]] }
    }

    #[test]
    fn one_weight_row_runs_as_a_matrix_vector_product() {
        let (a, b, out) = (dense(1, [2048, 1, 1, 1]), dense(2, [2048, 512, 1, 1]), dense(3, [1, 512, 1, 1]));
        let (a2, b2, out2) = one_row_swapped(&a, DType::F32, &b, &out).expect("swapped");
        assert_eq!((a2, b2), (b, a));
        assert_eq!((out2.data, out2.ne, out2.nb[..2].to_vec()), (3, [512, 1, 1, 1], vec![4, 2048]));
        // not for quantized weights, several rows, one column, batches or a strided output
        assert!(one_row_swapped(&a, DType::F16, &b, &out).is_none());
        assert!(one_row_swapped(&dense(1, [2048, 2, 1, 1]), DType::F32, &b, &dense(3, [2, 512, 1, 1])).is_none());
        assert!(one_row_swapped(&a, DType::F32, &dense(2, [2048, 1, 1, 1]), &dense(3, [1, 1, 1, 1])).is_none());
        assert!(one_row_swapped(&a, DType::F32, &dense(2, [2048, 512, 2, 1]), &dense(3, [1, 512, 2, 1])).is_none());
        let strided = TensorArg { nb: [8, 8, 4096, 4096], ..out };
        assert!(one_row_swapped(&a, DType::F32, &b, &strided).is_none());
    }

    #[test]
    fn one_column_against_shared_matrices_runs_as_columns() {
        // K [128, 4096, 4 kv heads] against q [128, 1, 32 heads] permuted from [128, 32, 1]
        let k = TensorArg { data: 1, ne: [128, 4096, 4, 1], nb: [2, 256, 256 * 4096, 256 * 4096 * 4] };
        let q = TensorArg { data: 2, ne: [128, 1, 32, 1], nb: [4, 512 * 32, 512, 512 * 32] };
        let out = dense(3, [4096, 1, 32, 1]);
        let (q2, out2) = broadcast_as_columns(&k, &q, &out).expect("folded");
        assert_eq!((q2.data, q2.ne, q2.nb), (2, [128, 8, 4, 1], [4, 512, 512 * 8, 512 * 32]));
        assert_eq!((out2.data, out2.ne, out2.nb), (3, [4096, 8, 4, 1], [4, 4 * 4096, 4 * 4096 * 8, 4 * 4096 * 32]));
        // not for several columns, no broadcast, or a batch count that does not divide
        assert!(broadcast_as_columns(&k, &dense(2, [128, 2, 32, 1]), &dense(3, [4096, 2, 32, 1])).is_none());
        assert!(broadcast_as_columns(&k, &dense(2, [128, 1, 4, 1]), &dense(3, [4096, 1, 4, 1])).is_none());
        assert!(broadcast_as_columns(&k, &dense(2, [128, 1, 6, 1]), &dense(3, [4096, 1, 6, 1])).is_none());
    }

    #[test]
    fn the_entry_point_check_finds_a_kernel_in_the_wrong_module() {
        assert!(super::defined_in_its_module(Kernel::new(Module::Pack, "pack_b")));
        assert!(super::defined_in_its_module(Kernel::new(Module::Gemv, "gemv_fast_8_r4")));
        assert!(!super::defined_in_its_module(Kernel::new(Module::Gemv, "pack_b")));
        // device functions, named in calls and comments: not entry points
        assert!(!super::defined_in_its_module(Kernel::new(Module::Gemv, "warp_dot")));
        assert!(!super::defined_in_its_module(Kernel::new(Module::Moe, "moe_gemv_pairs")));
    }
}
