//! mul_mat and mul_mat_id: `kernels/matmul.cu` and cuBLAS.
//!
//! Paths (f32 accumulation throughout):
//! - **GEMV** (`n <= GEMV_MAX_N`, and the general path for anything cuBLAS cannot take): the
//!   activations are packed into f32 scratch rows, then one warp per weight row reads the row
//!   once for up to 8 tokens (`gemv_{1,2,4,8}`), any weight dtype and outer strides.
//!   Aligned q8_0 / nvfp4 weights (and few long f16 / bf16 rows) take `gemv_fast_{1,2,4,8}`
//!   instead: one block per 1, 2 or 4 weight rows (`gemv_fast_rows`: with several tokens each
//!   activation load serves several rows) reading 16-value units straight from global memory;
//!   quantized weights against activations quantized once per call to int16 (two int8 halves,
//!   `quant_x`) with `dp4a`. One token against one contiguous q8_0 / nvfp4 matrix (k % 256 ==
//!   0) takes `gemv1_q8_0` / `gemv1_nvfp4` (`gemv1_plan`): rows streamed through shared memory
//!   (bulk copies on sm_90+), a thread per 64-value unit of the row with its activations
//!   quantized in the kernel and kept in registers, int16 x int8 `dp2a` (measured on an H200,
//!   1 token, % of copy bandwidth, the previous word kernels -> `gemv1`: q8_0 17408 x 5120 66 ->
//!   77, 5120 x 17408 47 -> 75-77; nvfp4 25 -> 54, 30 -> 54). One token against one f16 / bf16
//!   matrix of 16-byte words takes
//!   `gemv_f16w` / `gemv_bf16w[_long]` the same way (after `pack_b`), 2 or 5 words a thread
//!   (H200, 1 token, bf16: 17408 x 5120 58.2 -> 46.6 us, 73% -> 91%; 5120 x 17408 54.2 ->
//!   47.4 us, 78% -> 90%; 6144 x 2048 42% -> 73%).
//! - **GEMM** (`n > GEMV_MAX_N`): cuBLAS. f32 weights go through `sgemm` in place; f16 / bf16
//!   weights through `gemm_ex` in place with the activations converted to the weights' type;
//!   q8_0 / nvfp4 weights are dequantized in row chunks to bf16 (nvfp4 values are exact in bf16;
//!   q8_0 values are split into hi + lo bf16 parts) and multiplied by hi + lo bf16 activations,
//!   so the result keeps f32-level accuracy (the quantized cases take the f32 bound).
//! - **mul_mat_id**: up to `MOE_DECODE_TOKENS` tokens, `moe_decode` runs a warp per weight row
//!   over the routed (slot, token) pairs only, with `gemv_fast`'s units (for q8_0 / nvfp4 experts
//!   only where it beats `moe_mma_*`: long rows, a few tokens, `moe_decode_wins`). Beyond, `mmq::moe_prep`
//!   groups the (slot, token) pairs by expert on the device (no host sync). q8_0 / nvfp4 experts
//!   that `mmq::moe_fits` then take `moe_mma_*` (mmq.cu): each routed expert's rows are read once
//!   and multiplied by all its pairs on tensor cores; when experts average more than
//!   `MOE_TILED_AVG` pairs, those with more than `MOE_MMA_MAX` go to the tiled `mmq_*_id` instead.
//!   Other experts: `moe_gemv` runs the rows of experts with few pairs over them 8 at a time (the
//!   last few through a dot just wide enough), and `mmq_*_id` or `moe_gemm` (shared-memory tiles)
//!   the experts with many. `TESSERA_MOE_PATH=decode|mma|grouped` (read once a process) forces one
//!   of these where it can take the shapes, to measure them against each other.

use std::sync::OnceLock;

use cudarc::cublas::result as blas;
use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, TensorMeta};

use super::mmq;
use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, GRID_YZ, TensorArg, blocks_for, config, dt, sys_blas, unsupported};

const PACK_B: Kernel = Kernel::new(Module::Matmul, "pack_b");
const DEQUANT_ROWS: Kernel = Kernel::new(Module::Matmul, "dequant_rows");
const GEMV: [Kernel; 4] = [
    Kernel::new(Module::Matmul, "gemv_1"),
    Kernel::new(Module::Matmul, "gemv_2"),
    Kernel::new(Module::Matmul, "gemv_4"),
    Kernel::new(Module::Matmul, "gemv_8"),
];
const QUANT_X: Kernel = Kernel::new(Module::Matmul, "quant_x");
/// `gemv_fast_*` entry points: `[1 row a block, 2, 4][1 token a pass, 2, 4, 8]` (one token
/// has only the one-row entry: `gemv_fast_rows` never gives it more).
const GEMV_FAST: [[Kernel; 4]; 3] = [
    [
        Kernel::new(Module::Matmul, "gemv_fast_1"),
        Kernel::new(Module::Matmul, "gemv_fast_2"),
        Kernel::new(Module::Matmul, "gemv_fast_4"),
        Kernel::new(Module::Matmul, "gemv_fast_8"),
    ],
    [
        Kernel::new(Module::Matmul, "gemv_fast_1"),
        Kernel::new(Module::Matmul, "gemv_fast_2_r2"),
        Kernel::new(Module::Matmul, "gemv_fast_4_r2"),
        Kernel::new(Module::Matmul, "gemv_fast_8_r2"),
    ],
    [
        Kernel::new(Module::Matmul, "gemv_fast_1"),
        Kernel::new(Module::Matmul, "gemv_fast_2_r4"),
        Kernel::new(Module::Matmul, "gemv_fast_4_r4"),
        Kernel::new(Module::Matmul, "gemv_fast_8_r4"),
    ],
];
/// `gemv1_*` entry points: `[q8_0, nvfp4][3 stages, 4]`, and nvfp4's with a producer warp.
const GEMV1: [[Kernel; 2]; 2] = [
    [Kernel::new(Module::Matmul, "gemv1_q8_0_s3"), Kernel::new(Module::Matmul, "gemv1_q8_0_s4")],
    [Kernel::new(Module::Matmul, "gemv1_nvfp4_s3"), Kernel::new(Module::Matmul, "gemv1_nvfp4_s4")],
];
const GEMV1_NVFP4_PRODUCER: Kernel = Kernel::new(Module::Matmul, "gemv1_nvfp4_producer_s4");
const GEMV_F16W: Kernel = Kernel::new(Module::Matmul, "gemv_f16w");
const GEMV_BF16W: Kernel = Kernel::new(Module::Matmul, "gemv_bf16w");
const GEMV_F16W_LONG: Kernel = Kernel::new(Module::Matmul, "gemv_f16w_long");
const GEMV_BF16W_LONG: Kernel = Kernel::new(Module::Matmul, "gemv_bf16w_long");
/// 16-byte words of a weight row per `gemv_f16w` / `gemv_bf16w` thread (matmul.cu).
const GH_WORDS: u64 = 2;
/// Words per thread and most threads of `gemv_f16w_long` / `gemv_bf16w_long`: 5 and
/// `GH_LONG_THREADS` in matmul.cu.
const GH_LONG_WORDS: u64 = 5;
const GH_LONG_THREADS: u64 = 448;
/// Most threads of a `gemv_f16w` / `gemv_bf16w` block: `GW_MAX_THREADS` in matmul.cu.
const GW_MAX_THREADS: u64 = 512;
/// Weight rows a `gemv_f16w` block takes per step: `GW_R` in matmul.cu.
const GW_R: u64 = 4;
/// `gemv1_*` (matmul.cu): most threads a block (`G1_MAX_THREADS`, nvfp4's
/// `G1_MAX_THREADS_NVFP4`), staged f32 activation bytes per 64-value unit (`G1_XSTRIDE`).
/// TAG(gemv1-consts)
const G1_MAX_THREADS: usize = 576;
const G1_MAX_THREADS_NVFP4: usize = 640;
const G1_XSTRIDE: usize = 272;
/// Bytes of weight rows a `gemv1_*` stage aims at: nvfp4 gets two rows a thread a stage (32 KiB
/// stages cost it 20-25% on an H200; 64 KiB ones lost the gain of fewer stages in flight on an
/// H100, their first stage arriving later).
const G1_STAGE_BYTES: usize = 48 << 10;
/// Peak DRAM bandwidth (bytes/s) from which `gemv1_*` keeps 3 stages in flight instead of 2.
/// Measured (every 1-token q8_0 / nvfp4 GEMV of the perf catalogue, one call each): on an H100
/// (3.35 TB/s) 2 in flight beat 3 by 2-4 points of copy bandwidth and 4 lost 5-10; on an H200
/// (4.8 TB/s) 3 beat 2 by 3-4 points at 5120 x 17408 q8_0 and tied elsewhere.
const G1_DEEP_BANDWIDTH: u64 = 4_000_000_000_000;
/// Static shared memory of `gemv1_*` (its stage barriers), kept out of the dynamic budget.
const G1_STATIC_SHARED: usize = 64;
/// Threads (one weight row) per `gemv_fast_N` block: `GF_THREADS` in matmul.cu.
const GF_THREADS: u32 = 128;
const MOE_DECODE: Kernel = Kernel::new(Module::Matmul, "moe_decode");
const MOE_DECODE_GLU: Kernel = Kernel::new(Module::Matmul, "moe_decode_glu");
const MOE_DECODE_SUM: Kernel = Kernel::new(Module::Matmul, "moe_decode_sum");
const WEIGHTED_SLOT_SUM: Kernel = Kernel::new(Module::Matmul, "weighted_slot_sum");
/// `gemv_fast_glu_N` (mul_mat_swiglu at 1 to 8 tokens): `[1 token a pass, 2, 4, 8]`.
const GEMV_FAST_GLU: [Kernel; 4] = [
    Kernel::new(Module::Matmul, "gemv_fast_glu_1"),
    Kernel::new(Module::Matmul, "gemv_fast_glu_2"),
    Kernel::new(Module::Matmul, "gemv_fast_glu_4"),
    Kernel::new(Module::Matmul, "gemv_fast_glu_8"),
];
const MOE_GEMV: Kernel = Kernel::new(Module::Matmul, "moe_gemv");
const MOE_GEMM: Kernel = Kernel::new(Module::Matmul, "moe_gemm");
/// Weight rows per `moe_gemm` block: `MT_M` in matmul.cu.
const MT_M: u64 = 64;

const THREADS: u32 = 256;
/// Warps (weight rows) per GEMV block: TAG(mm-warps), `MM_WARPS` in matmul.cu.
const MM_WARPS: u32 = 4;
/// GEMVs over at most this many weight rows (all batches) of at least `SPLIT_K` elements split
/// each row over the block's warps, so that few long rows still fill the GPU (measured on an
/// H200: 5120 x 17408 q8_0 at 1 token 20% -> 28% of copy bandwidth; splitting short rows or
/// many rows was slower).
const SPLIT_ROWS: i64 = 8192;
const SPLIT_K: i64 = 8192;
/// Rows of at least `SPLIT_K_FEW` elements split over the block's warps too when there are at
/// most this many (all batches): the MoE router (2048 x 256 f32) and the shared expert's gate
/// (2048 x 1) are a handful of memory round trips a warp unsplit, the latency of a decode step.
const SPLIT_FEW_ROWS: i64 = 512;
const SPLIT_K_FEW: i64 = 1024;
/// Most tokens a GEMV pass serves per weight read; above this cuBLAS takes the product.
const GEMV_MAX_N: i64 = 8;
/// Bytes of dequantized bf16 weights (hi + lo parts) one cuBLAS chunk may hold.
const WEIGHT_CHUNK_BYTES: usize = 64 << 20;
/// Alignment of every scratch region.
const ALIGN: usize = 256;
/// Experts with more (slot, token) pairs than this take `moe_gemm`, the others `moe_gemv`
/// (8 rather than 16: 256 experts top-8 at 512 tokens 4.7 -> 5.4 TFLOP/s on an H200).
const MOE_GEMV_MAX: i32 = 8;
/// mul_mat_id with at most this many tokens runs `moe_decode` over the (slot, token) pairs
/// (each pair reads its expert's rows; no grouping) unless `moe_mma_*` takes the experts
/// (`moe_decode_wins`). With 256 experts top-8 few pairs share an expert, and grouping them for
/// `moe_gemv` cost far more than the repeated reads: nvfp4 on an H100, 2048 -> 512 / 512 -> 2048,
/// `moe_decode` against `moe_gemv` (threshold 2): 4 tokens 25 / 49 us against 120 / 251, 8 tokens
/// 44 / 96 against 160 / 352, 16 tokens 88 / 192 against 242 / 518.
const MOE_DECODE_TOKENS: i64 = 16;
/// mul_mat_id_weighted_sum takes `moe_decode_sum` up to this many tokens, else mul_mat_id and
/// `weighted_slot_sum`: on an H100, 35B-A3B down projection (512 -> 2048, 8 of 256 experts,
/// q8_0) fused against mul_mat_id + mul + sum_rows: 1 token 12.0 against 18.6 us, 8 tokens 71.8
/// against 57.8, 16 tokens 137 against 90 (each slot's rows read once per token, where
/// `moe_mma_*` shares nothing either but runs on tensor cores).
const MOE_DECODE_SUM_TOKENS: i64 = 2;
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

/// Packed row length (elements) of activations and dequantized weights: 8 keeps every row
/// 16-byte aligned as bf16 and 32-byte aligned as f32.
fn packed_len(k: usize) -> usize {
    k.next_multiple_of(8)
}

/// Bytes of the packed f32 activations of `b`.
fn packed_f32_bytes(b: &TensorMeta) -> usize {
    align(b.nelements() / b.ne[0].max(1) * packed_len(b.ne[0]) * 4)
}

/// bf16 parts of a dequantized weight value: nvfp4 values are exact in bf16, q8_0 need hi + lo.
fn weight_parts(d: DType) -> usize {
    if d == DType::Q8_0 { 2 } else { 1 }
}

/// Rows of dequantized weights per cuBLAS chunk (at most the grid's y limit).
fn chunk_rows(k: usize, m: usize, parts: usize) -> usize {
    let rows = WEIGHT_CHUNK_BYTES / (packed_len(k) * 2 * parts).max(1);
    let rows = if rows > 128 { rows / 128 * 128 } else { rows.max(1) };
    rows.min(m).min(GRID_YZ as usize)
}

/// Scratch for the cuBLAS path: converted activations, then (quantized weights) one chunk of
/// dequantized weights.
fn blas_scratch(a: &TensorMeta, b: &TensorMeta) -> usize {
    let (k, m) = (a.ne[0], a.ne[1]);
    let rows = b.nelements() / k.max(1);
    let half = align(rows * packed_len(k) * 2);
    match a.dtype {
        DType::F32 => packed_f32_bytes(b),
        DType::F16 | DType::BF16 => half,
        _ => {
            let parts = weight_parts(a.dtype);
            2 * half + parts * align(chunk_rows(k, m, parts) * packed_len(k) * 2)
        }
    }
}

/// Scratch of mul_mat_id: the pairs grouped by expert (`mmq::MoeGroups`), then packed
/// activations (`moe_decode` uses the start of scratch for its own).
fn moe_scratch(w: &TensorMeta, b: &TensorMeta, ids: &TensorMeta) -> usize {
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
    mmq::MoeGroups::at(0, n_expert, n_pairs).1
}

/// Bytes of `quant_x`'s int16 activations (2 bytes a value) and their per-16-value f32 scales.
fn quant_x_bytes(n: usize) -> (usize, usize) {
    (align(n * 2), align(n / 16 * 4))
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
    if (b.ne[1] as i64) > GEMV_MAX_N { gemv.max(blas_scratch(a, b)).max(mmq::mul_mat_scratch_bytes(b)) } else { gemv }
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
        (Op::MulMatId, [w, b, ids], Some(d)) => mul_mat_id(cx, *w, d, *b, *ids, out, op_code("mul_mat_id")),
        (Op::MulMatSwiglu, [wg, wu, b], Some(d)) => {
            if glu_gemv_fits(wg, wu, d, b) {
                return gemv_fast_glu(cx, *wg, *wu, d, *b, out);
            }
            let up = glu_up(cx, task, out)?;
            mul_mat(cx, *wg, d, *b, out)?;
            mul_mat(cx, *wu, d, *b, up)?;
            super::elementwise::swiglu_f32(cx, out, up, out)
        }
        (Op::MulMatIdSwiglu, [wg, wu, b, ids], Some(d)) => {
            if moe_decode_taken(wg, d, ids, moe_mma_fits(cx, wg, d, ids)) && fast_rows(wu, d) && wg.nb == wu.nb {
                return moe_decode(cx, *wg, Some(*wu), d, *b, *ids, out, op_code("mul_mat_id_swiglu"));
            }
            let up = glu_up(cx, task, out)?;
            let op = op_code("mul_mat_id_swiglu");
            mul_mat_id(cx, *wg, d, *b, *ids, out, op)?;
            mul_mat_id(cx, *wu, d, *b, *ids, up, op)?;
            super::elementwise::swiglu_f32(cx, out, up, out)
        }
        (Op::MulMatIdWeightedSum, [w, b, ids, rw], Some(d)) => {
            let op = op_code("mul_mat_id_weighted_sum");
            if weighted_decode_taken(w, d, ids) {
                return moe_decode_sum(cx, *w, d, *b, *ids, *rw, out, op);
            }
            // mul_mat_id into scratch after what it needs, then the weighted sum over the slots
            let at = align(moe_scratch(&task.inputs[0].meta, &task.inputs[1].meta, &task.inputs[2].meta));
            let ne = [w.ne[1], ids.ne[0], ids.ne[1], 1];
            let nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]];
            let y = TensorArg { data: cx.scratch + at as u64, ne, nb };
            mul_mat_id(cx, *w, d, *b, *ids, y, op)?;
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

fn mul_mat(cx: &mut Cx<'_>, a: TensorArg, d: DType, b: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let n = b.ne[1];
    let x = cx.scratch;
    if n > GEMV_MAX_N
        && mmq::weights_fit(&a, d)
        && let Some(done) = mmq::mul_mat(cx, a, d, b, out, x)
    {
        return done;
    }
    if n > GEMV_MAX_N && blas_fits(&a, d, &b, &out) {
        return mul_mat_blas(cx, a, d, b, out);
    }
    let stages = gemv1_stages(cx.info.peak_memory_bandwidth);
    let bulk = cx.info.compute_capability.0 >= 9;
    if let Some(plan) = gemv1_plan(&a, d, &b, cx.info.max_shared_per_block, stages, bulk) {
        return gemv1(cx, a, d, b, out, plan);
    }
    if let Some(kernel) = word_gemv(&a, d, &b) {
        return gemv_words(cx, a, b, out, kernel);
    }
    if fast_gemv_fits(&a, d) {
        return gemv_fast(cx, a, d, b, out);
    }
    let (bp, ldb) = match packed_already(&b) {
        Some(ldb) => (b.data, ldb),
        None => {
            let ldb = packed_len(b.ne[0] as usize) as i64;
            pack_b(cx, b, cx.scratch, 0, 0, 0, ldb)?;
            (cx.scratch, ldb)
        }
    };
    let kernel = GEMV[match n {
        ..=1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }];
    let (adt, b2, b3) = (dt(d), b.ne[2], b.ne[3]);
    let vec = i32::from(rows_vectorizable(&a, d) && bp.is_multiple_of(16));
    let rows = a.ne[1] * b2 * b3;
    let split = (rows <= SPLIT_ROWS && a.ne[0] >= SPLIT_K) || (rows <= SPLIT_FEW_ROWS && a.ne[0] >= SPLIT_K_FEW);
    let parts: i32 = if split { MM_WARPS as i32 } else { 1 };
    let blocks = (a.ne[1] as u64 * parts as u64).div_ceil(MM_WARPS as u64);
    let grid = (blocks.min(i32::MAX as u64) as u32, (b2 * b3).clamp(1, GRID_YZ) as u32, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&adt).arg(&bp).arg(&ldb).arg(&n).arg(&b2).arg(&b3).arg(&out).arg(&vec).arg(&parts);
    // SAFETY: `gemv_N(a, adt, bp, ldb, n, b2, b3, out, vec, parts)`: parts is 1 or MM_WARPS;
    // a's rows are dense of dtype adt (shape rules) and each batch maps to weight batch
    // (i2 / (b2 / a2), i3 / (b3 / a3)) inside a; bp holds b2 * b3 * n packed rows of ldb >= k f32 (scratch_bytes); out is [m, n, b2, b3]
    // f32; `vec` only when every row start is 16-byte aligned and rows are whole 16-byte pieces.
    unsafe { args.launch(config(grid, (MM_WARPS * 32, 1, 1), 0)) }?;
    Ok(())
}

/// The row stride (elements) at which `gemv_N` can read the f32 activations `b` in place, when
/// they already have the packed layout `pack_b` would write: dense rows of a whole number of
/// packed lengths, rows and batches one after the other, 32-byte aligned. Saves a launch and a
/// copy for every small GEMV over f32 or f16 weights (the MoE router's, at one token).
fn packed_already(b: &TensorArg) -> Option<i64> {
    let k = b.ne[0];
    let dense = b.nb[0] == 4 && b.nb[1] == 4 * k && b.nb[2] == b.nb[1] * b.ne[1] && b.nb[3] == b.nb[2] * b.ne[2];
    (dense && packed_len(k as usize) as i64 == k && b.data.is_multiple_of(32)).then_some(k)
}

/// Whether `gemv_fast_N` takes the weights: q8_0 / nvfp4 whose rows start 4-byte aligned, and
/// f16 / bf16 read in 16-byte pieces (`rows_vectorizable`) when rows are few and long. Measured
/// on an H200 at 1 token, % of copy bandwidth, `gemv_N` -> `gemv_fast_N`: q8_0 17408 x 5120
/// 32 -> 37, 5120 x 17408 29 -> 47; nvfp4 18 -> 20, 17 -> 30; bf16 5120 x 17408 66 -> 77, but
/// bf16 17408 x 5120 73 -> 70 and 6144 x 2048 42 -> 33, so many rows stay on `gemv_N`
/// (one token against one f16 / bf16 matrix takes `word_gemv` before this).
fn fast_gemv_fits(a: &TensorArg, d: DType) -> bool {
    let rows = a.ne[1] * a.ne[2] * a.ne[3];
    // f32 weights keep gemv_N here (its split rows), the fused decode ops take their f32 units
    d != DType::F32 && fast_rows(a, d) && (d.is_quantized() || (rows <= SPLIT_ROWS && a.ne[0] >= SPLIT_K))
}

/// Whether the fast GEMV units (`gf_load` / `gf_dot`) can read the weight rows: q8_0 / nvfp4 rows
/// start 4-byte aligned, f16 / bf16 / f32 rows are whole 16-byte pieces (`rows_vectorizable`).
fn fast_rows(a: &TensorArg, d: DType) -> bool {
    match d {
        DType::Q8_0 | DType::NvFp4 => a.data.is_multiple_of(4) && (1..4).all(|i| a.ne[i] <= 1 || a.nb[i] % 4 == 0),
        DType::F16 | DType::BF16 | DType::F32 => rows_vectorizable(a, d),
        _ => false,
    }
}

/// Activations for `gemv_fast_N` / `moe_decode`: int16 halves by `quant_x` at the start of
/// scratch (quantized weights; their scales follow at the next 256-byte boundary), else packed
/// f32 rows, read in place when `b` already is such rows (no launch). Returns their address and
/// row stride in bytes.
fn fast_activations(cx: &mut Cx<'_>, d: DType, b: TensorArg) -> Result<(u64, i64), BackendError> {
    let k = b.ne[0];
    if d.is_quantized() {
        let (xq_bytes, _) = quant_x_bytes(b.nelements() as usize);
        quant_x(cx, b, cx.scratch, cx.scratch + xq_bytes as u64)?;
        Ok((cx.scratch, 2 * k))
    } else if let Some(ldb) = packed_already(&b) {
        Ok((b.data, 4 * ldb))
    } else {
        let ldb = packed_len(k as usize) as i64;
        pack_b(cx, b, cx.scratch, 0, 0, 0, ldb)?;
        Ok((cx.scratch, 4 * ldb))
    }
}

/// Weight rows a `gemv_fast_*` block takes for `n` tokens over `m` rows on `sms` multiprocessors:
/// with several tokens each token's activations (32 bytes of int16 and a scale per 16 values)
/// outweigh the weights they meet (8.5 bytes nvfp4, 17 q8_0), so a block shares each load among
/// 4 rows, or 2, as long as that leaves at least two blocks a multiprocessor. One token stays at
/// one row a block. `TESSERA_GEMV_ROWS=1|2|4` (read once a process) forces the rows where
/// there are several tokens, to measure them against each other.
fn gemv_fast_rows(n: i64, m: i64, sms: usize) -> usize {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    if n <= 1 {
        return 1;
    }
    let forced = *FORCED.get_or_init(|| match std::env::var("TESSERA_GEMV_ROWS").as_deref() {
        Ok("1") => Some(1),
        Ok("2") => Some(2),
        Ok("4") => Some(4),
        _ => None,
    });
    forced.unwrap_or_else(|| [4, 2].into_iter().find(|&r| m / r as i64 >= 2 * sms as i64).unwrap_or(1))
}

/// The decode GEMV `gemv_fast_*`: one block per 1, 2 or 4 weight rows (`gemv_fast_rows`) over up
/// to 8 tokens a pass.
fn gemv_fast(cx: &mut Cx<'_>, a: TensorArg, d: DType, b: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let n = b.ne[1];
    let (x, ldx) = fast_activations(cx, d, b)?;
    let rows = gemv_fast_rows(n, a.ne[1], cx.info.multiprocessors);
    let kernel = GEMV_FAST[rows.trailing_zeros() as usize][match n {
        ..=1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }];
    let (adt, b2, b3) = (dt(d), b.ne[2], b.ne[3]);
    let blocks = (a.ne[1] as u64).div_ceil(rows as u64).clamp(1, i32::MAX as u64) as u32;
    let grid = (blocks, (b2 * b3).clamp(1, GRID_YZ) as u32, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&adt).arg(&x).arg(&ldx).arg(&n).arg(&b2).arg(&b3).arg(&out);
    // SAFETY: `gemv_fast_N[_rR](a, adt, x, ldx, n, b2, b3, out)`: block x reads weight rows
    // min(R x + r, M - 1) of batch (i2 / (b2 / a2), i3 / (b3 / a3)) inside a, dense of dtype adt
    // (shape rules: k a multiple of the block size), 4-byte aligned (quantized; a q8_0 unit reads
    // its fifth word only when it lies inside the block) or 16-byte aligned whole rows (f16 /
    // bf16, `fast_gemv_fits`), and writes rows < M only; x holds b2 * b3 * n rows of ldx bytes
    // (int16 halves, 2 k, with k / 16 scales each from the next 256-byte boundary after them; or
    // packed f32 rows of packed_len(k)) in scratch (scratch_bytes); out is [M, n, b2, b3] f32.
    unsafe { args.launch(config(grid, (GF_THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// Shared-memory stages of the `gemv1_*` ring on a device of peak DRAM bandwidth `bandwidth`.
fn gemv1_stages(bandwidth: u64) -> usize {
    if bandwidth >= G1_DEEP_BANDWIDTH { 4 } else { 3 }
}

/// How `gemv1_q8_0_s*` / `gemv1_nvfp4_s*` run one product: ring stages (`gemv1_stages`), threads a
/// block, thread groups (each takes every row of a stage once), rows a stage, whether a warp of
/// its own copies and adds up (`producer`), dynamic shared memory bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct G1Plan {
    stages: usize,
    threads: u32,
    groups: i32,
    rows_stage: i32,
    producer: bool,
    shared: u32,
}

/// The `gemv1_*` plan when one takes the product: one token against one q8_0 / nvfp4 matrix of
/// contiguous rows (row r at r * row_bytes from a 16-byte aligned start), k % 256 == 0 (rows of
/// whole 16-byte pieces), at most `G1_MAX_THREADS` (nvfp4: `G1_MAX_THREADS_NVFP4`) 64-value units
/// a row, and a plan whose stages fit `max_shared` (fewer rows a stage, then fewer groups, until
/// they do). Groups: as many as those threads hold; rows a stage: about `G1_STAGE_BYTES`, a
/// multiple of groups. With bulk copies (`bulk`, sm_90+) and 3 stages in flight (`stages` 4, the
/// H200) nvfp4 takes a producer warp where the threads have a warp to spare beside the groups:
/// long rows (H200, 5120 x 17408: 21.5 -> 19.8-20.0 us). Taking a group for it at 17408 x 5120
/// cost 1.5%, q8_0 lost 1-3% with it, and the H100 (2 stages in flight) 7% at 5120 x 17408.
fn gemv1_plan(a: &TensorArg, d: DType, b: &TensorArg, max_shared: usize, stages: usize, bulk: bool) -> Option<G1Plan> {
    let single = b.ne[1] == 1 && b.ne[2] * b.ne[3] == 1 && a.ne[2] * a.ne[3] == 1;
    let (unit_bytes, max_threads) = match d {
        DType::Q8_0 => (2 * d.block_bytes(), G1_MAX_THREADS),
        DType::NvFp4 => (d.block_bytes(), G1_MAX_THREADS_NVFP4),
        _ => return None,
    };
    let k = usize::try_from(a.ne[0]).ok()?;
    let nu = k / 64;
    let row_bytes = nu * unit_bytes;
    let contiguous = a.nb[1] == row_bytes as i64 && a.data.is_multiple_of(16);
    if !single || !contiguous || k % 256 != 0 || nu == 0 || nu > max_threads {
        return None;
    }
    let producer =
        bulk && stages == 4 && d == DType::NvFp4 && (max_threads / nu * nu).next_multiple_of(32) + 32 <= max_threads;
    for groups in (1..=max_threads / nu).rev() {
        for per_group in (1..=(G1_STAGE_BYTES / (groups * row_bytes)).max(1)).rev() {
            let rows_stage = groups * per_group;
            let stage = rows_stage * row_bytes;
            let partials = if producer { stages + 1 } else { 2 } * (rows_stage | 1) * nu * 4;
            let shared = (stages - 1) * stage + (stage + partials).max(nu * G1_XSTRIDE);
            if shared + G1_STATIC_SHARED <= max_shared {
                return Some(G1Plan {
                    stages,
                    threads: ((groups * nu).next_multiple_of(32) + if producer { 32 } else { 0 }) as u32,
                    groups: groups as i32,
                    rows_stage: rows_stage as i32,
                    producer,
                    shared: u32::try_from(shared).ok()?,
                });
            }
        }
    }
    None
}

/// The 1-token GEMV `gemv1_q8_0` / `gemv1_nvfp4` (activations quantized in the kernel; no
/// scratch), one block per multiprocessor (as many as fit), each over an even share of the rows.
fn gemv1(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    plan: G1Plan,
) -> Result<(), BackendError> {
    let kernel =
        if plan.producer { GEMV1_NVFP4_PRODUCER } else { GEMV1[usize::from(d == DType::NvFp4)][plan.stages - 3] };
    cx.allow_shared(kernel, plan.shared)?;
    let resident = cx.resident_blocks(kernel, plan.threads, plan.shared)?;
    let grid = ((a.ne[1] as u64).min(resident).clamp(1, i32::MAX as u64) as u32, 1, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&b).arg(&out).arg(&plan.groups).arg(&plan.rows_stage);
    // SAFETY: `gemv1_*(a, b, out, groups, rows_stage)`: a is one [k, M] q8_0 / nvfp4 matrix of
    // contiguous rows from a 16-byte aligned start, k % 256 == 0, k / 64 <= groups * (k / 64) <=
    // threads <= G1_MAX_THREADS or G1_MAX_THREADS_NVFP4, the entry point's launch bound, with a
    // whole warp beyond the groups' threads for the producer entry points (taken on sm_90+ only)
    // (`gemv1_plan`); block i copies (and on sm_90+ prefetches into L2) whole 16-byte pieces of its
    // rows [i M / grid, (i + 1) M / grid) only; `shared` holds plan.stages stages of rows_stage
    // rows plus 2 (producer: stages + 1) x (rows_stage | 1) x k / 64 f32 partials, or the staged
    // activations (k / 64 * G1_XSTRIDE bytes) if larger, and is within the device limit (raised
    // above); b is one f32 row of k values read through its strides; out is [M, 1, 1, 1] f32,
    // written at rows < M.
    unsafe { args.launch(config(grid, (plan.threads, 1, 1), plan.shared)) }?;
    Ok(())
}

/// The word GEMV kernel and its threads, when one takes the product: one token, one f16 / bf16
/// weight matrix whose rows are 16-byte aligned whole words. `gemv_f16w` / `gemv_bf16w`:
/// `GH_WORDS` words a thread, at most `GW_MAX_THREADS` threads; longer rows `gemv_f16w_long` /
/// `gemv_bf16w_long` (`GH_LONG_WORDS` words, at most `GH_LONG_THREADS` threads). Threads are
/// rounded up to whole warps.
fn word_gemv(a: &TensorArg, d: DType, b: &TensorArg) -> Option<(Kernel, u32)> {
    let single = b.ne[1] == 1 && b.ne[2] * b.ne[3] == 1 && a.ne[2] * a.ne[3] == 1;
    if !single || !rows_vectorizable(a, d) {
        return None;
    }
    let words = d.row_bytes(a.ne[0] as usize)? as u64 / 16;
    let (kernel, threads) = match d {
        DType::F16 | DType::BF16 if words.div_ceil(GH_WORDS) <= GW_MAX_THREADS => {
            (if d == DType::F16 { GEMV_F16W } else { GEMV_BF16W }, words.div_ceil(GH_WORDS))
        }
        DType::F16 | DType::BF16 if words.div_ceil(GH_LONG_WORDS).next_multiple_of(32) <= GH_LONG_THREADS => {
            (if d == DType::F16 { GEMV_F16W_LONG } else { GEMV_BF16W_LONG }, words.div_ceil(GH_LONG_WORDS))
        }
        _ => return None,
    };
    Some((kernel, threads.next_multiple_of(32) as u32))
}

/// The decode GEMV over whole words: `gemv_f16w` / `gemv_bf16w[_long]` after `pack_b`, on a grid
/// of the blocks that fit the GPU at once.
fn gemv_words(
    cx: &mut Cx<'_>,
    a: TensorArg,
    b: TensorArg,
    out: TensorArg,
    (kernel, threads): (Kernel, u32),
) -> Result<(), BackendError> {
    let x = cx.scratch;
    pack_b(cx, b, x, 0, 0, 0, packed_len(b.ne[0] as usize) as i64)?;
    let resident = cx.resident_blocks(kernel, threads, 0)?;
    let grid = ((a.ne[1] as u64).div_ceil(GW_R).min(resident).max(1) as u32, 1, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&x).arg(&out);
    // SAFETY: `gemv_f16w` / `gemv_bf16w[_long](a, x, out)`: a is one [k, M] f16 / bf16 matrix of
    // 16-byte aligned rows of whole words, row_bytes / 16 <= words a thread * threads, threads <=
    // the kernel's launch bound (`word_gemv`); x holds one `pack_b` f32 row of k values in scratch
    // (scratch_bytes). Row reads are clamped to row M - 1; out is [M, 1, 1, 1] f32.
    unsafe { args.launch(config(grid, (threads, 1, 1), 0)) }?;
    Ok(())
}

/// Quantizes the f32 activations `b` (any strides, k a multiple of 16) to `quant_x`'s int16
/// halves at `xq` (2 k bytes a row) and per-16-value scales at `xs`.
fn quant_x(cx: &mut Cx<'_>, b: TensorArg, xq: u64, xs: u64) -> Result<(), BackendError> {
    let mut args = cx.kernel(QUANT_X)?;
    args.arg(&b).arg(&xq).arg(&xs);
    // SAFETY: `quant_x(b, xq, xs)` reads b inside its span (k a multiple of 16: the weights are
    // q8_0 / nvfp4) and writes 2 k bytes a row at xq and k / 16 f32 a row at xs, for every row
    // of b (scratch_bytes sizes both).
    let blocks = blocks_for(b.nelements() / 16, THREADS);
    unsafe { args.launch(config((blocks, 1, 1), (THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// Packs `b` into rows of `ldb` elements: f32 at `f32_out`, and / or half at `hi` (f16 when
/// `half_dt` is f16's code, else bf16 with the remainder at `lo` when nonzero). Zero skips.
fn pack_b(
    cx: &mut Cx<'_>,
    b: TensorArg,
    f32_out: u64,
    hi: u64,
    lo: u64,
    half_dt: i32,
    ldb: i64,
) -> Result<(), BackendError> {
    let mut args = cx.kernel(PACK_B)?;
    args.arg(&b).arg(&f32_out).arg(&hi).arg(&lo).arg(&half_dt).arg(&ldb);
    // SAFETY: `pack_b(b, f32_out, hi, lo, half_dt, ldb)` reads b inside its span and writes row
    // r = flat row index of b at r * ldb (ldb >= k) into outputs sized for every row of b
    // (scratch_bytes).
    unsafe { args.launch(config((blocks_for(b.nelements(), THREADS), 1, 1), (THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// cuBLAS takes the product when sizes fit its ints, the output is contiguous f32 columns, and
/// plain weights are element-aligned with element strides.
fn blas_fits(a: &TensorArg, d: DType, b: &TensorArg, out: &TensorArg) -> bool {
    let small = |x: i64| x > 0 && x <= i32::MAX as i64;
    let es = d.block_bytes() as i64;
    let plain_ok = d.is_quantized()
        || (a.data.is_multiple_of(es as u64)
            && a.nb[1] % es == 0
            && small(a.nb[1] / es)
            && (1..4).all(|i| a.nb[i] % es == 0));
    small(a.ne[0]) && small(a.ne[1]) && small(b.ne[1]) && out.nb[0] == 4 && out.nb[1] == 4 * out.ne[0] && plain_ok
}

/// One `C = alpha A^T B + beta C` through `gemm_ex` (column-major: A is k x m with `lda`, B is
/// k x n with `ldb`, C is m x n f32 with `ldc`).
struct Gemm {
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
    ty: sys_blas::cudaDataType,
}

impl Gemm {
    fn run(&self, h: sys_blas::cublasHandle_t, a: u64, b: u64, c: u64, beta: f32) -> Result<(), BackendError> {
        let alpha = 1.0f32;
        // SAFETY: a, b, c are device addresses of matrices of the sizes and leading dimensions
        // in `self` (checked by the caller); alpha and beta are host f32 read during the call.
        unsafe {
            blas::gemm_ex(
                h,
                sys_blas::cublasOperation_t::CUBLAS_OP_T,
                sys_blas::cublasOperation_t::CUBLAS_OP_N,
                self.m,
                self.n,
                self.k,
                (&alpha as *const f32).cast(),
                a as *const _,
                self.ty,
                self.lda,
                b as *const _,
                self.ty,
                self.ldb,
                (&beta as *const f32).cast(),
                c as *mut _,
                sys_blas::cudaDataType::CUDA_R_32F,
                self.ldc,
                sys_blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys_blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| BackendError::Device {
            backend: crate::errors::NAME.into(),
            detail: format!("cublasGemmEx: {e:?}"),
        })
    }
}

fn mul_mat_blas(cx: &mut Cx<'_>, a: TensorArg, d: DType, b: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let h = cx.cublas()?;
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (b2, b3) = (b.ne[2], b.ne[3]);
    let (r2, r3) = (b2 / a.ne[2].max(1), b3 / a.ne[3].max(1));
    let ldb = packed_len(k as usize) as i64;
    let rows = n * b2 * b3;
    let half = align(rows as usize * ldb as usize * 2) as u64;
    let es = d.block_bytes() as i64;
    let (ty, elem) = match d {
        DType::F32 => (sys_blas::cudaDataType::CUDA_R_32F, 4),
        DType::F16 => (sys_blas::cudaDataType::CUDA_R_16F, 2),
        _ => (sys_blas::cudaDataType::CUDA_R_16BF, 2),
    };
    let (bhi, blo) = (cx.scratch, cx.scratch + half);
    match d {
        DType::F32 => pack_b(cx, b, bhi, 0, 0, 0, ldb)?,
        DType::F16 | DType::BF16 => pack_b(cx, b, 0, bhi, 0, dt(d), ldb)?,
        _ => pack_b(cx, b, 0, bhi, blo, dt(DType::BF16), ldb)?,
    }
    let g = |mm: i64, lda: i64| Gemm {
        m: mm as i32,
        n: n as i32,
        k: k as i32,
        lda: lda as i32,
        ldb: ldb as i32,
        ldc: m as i32,
        ty,
    };
    for batch in 0..b2 * b3 {
        let (i2, i3) = (batch % b2, batch / b2);
        let a_off = (i2 / r2) * a.nb[2] + (i3 / r3) * a.nb[3];
        let b_at = |base: u64| base + (batch * n * ldb * elem) as u64;
        let c = out.data + (i2 * out.nb[2] + i3 * out.nb[3]) as u64;
        if !d.is_quantized() {
            g(m, a.nb[1] / es).run(h, a.data + a_off as u64, b_at(bhi), c, 0.0)?;
            continue;
        }
        let parts = weight_parts(d);
        let chunk = chunk_rows(k as usize, m as usize, parts) as i64;
        let whi = cx.scratch + 2 * half;
        let wlo = if parts == 2 { whi + align(chunk as usize * ldb as usize * 2) as u64 } else { 0 };
        let weights = TensorArg { data: a.data + a_off as u64, ..a };
        let mut m0 = 0;
        while m0 < m {
            let rows = chunk.min(m - m0);
            dequant_rows(cx, weights, d, m0, rows, whi, wlo, ldb)?;
            let gc = g(rows, ldb);
            let c0 = c + (m0 * 4) as u64;
            gc.run(h, whi, b_at(bhi), c0, 0.0)?;
            gc.run(h, whi, b_at(blo), c0, 1.0)?;
            if parts == 2 {
                gc.run(h, wlo, b_at(bhi), c0, 1.0)?;
            }
            m0 += rows;
        }
    }
    Ok(())
}

/// Rows `[m0, m0 + rows)` of the weight matrix at `a` (batch offset applied) to bf16 rows of
/// `ld` elements at `hi` (and the remainder at `lo` when nonzero).
#[allow(clippy::too_many_arguments)]
fn dequant_rows(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    m0: i64,
    rows: i64,
    hi: u64,
    lo: u64,
    ld: i64,
) -> Result<(), BackendError> {
    let (adt, zero) = (dt(d), 0i64);
    let mut args = cx.kernel(DEQUANT_ROWS)?;
    args.arg(&a).arg(&adt).arg(&m0).arg(&zero).arg(&zero).arg(&hi).arg(&lo).arg(&ld);
    // SAFETY: `dequant_rows(a, adt, m0, a2 = 0, a3 = 0, hi, lo, ld)` reads rows m0 .. m0 + rows
    // (gridDim.y, <= 65535) of a, all below ne[1]; hi and lo hold `rows` rows of ld >= k bf16
    // (scratch_bytes sizes one chunk).
    let grid = (blocks_for(a.ne[0], THREADS).min(64), rows as u32, 1);
    unsafe { args.launch(config(grid, (THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// mul_mat_id; `op` is the code device errors (a bad expert id) name: mul_mat_id's, or that of
/// the fused op running it.
fn mul_mat_id(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    b: TensorArg,
    ids: TensorArg,
    out: TensorArg,
    op: u32,
) -> Result<(), BackendError> {
    let n_expert = w.ne[2];
    let n_pairs = ids.nelements();
    let mma = moe_mma_fits(cx, &w, d, &ids);
    if moe_decode_taken(&w, d, &ids, mma) {
        return moe_decode(cx, w, None, d, b, ids, out, op);
    }
    let n_used = ids.ne[0];
    let (g, groups) = mmq::MoeGroups::at(cx.scratch, n_expert as usize, n_pairs as usize);
    let packed = cx.scratch
        + moe_packed_at(n_expert as usize, n_pairs as usize, b.nelements() as usize, b.ne[0] as usize) as u64;
    if mma {
        // many pairs an expert: the busiest experts take 128-column tiles
        let tiled = n_pairs > MOE_TILED_AVG * n_expert && mmq::tiled_id_fits(cx, &w, d);
        let max_pairs = if tiled { MOE_MMA_MAX } else { i32::MAX };
        let xs = mmq::moe_prep(cx, ids, n_expert, &g, max_pairs, b, Some(packed), op)?;
        mmq::moe_mma(cx, w, d, b.ne[1], n_used, n_pairs, &g, packed, xs, out)?;
        if tiled {
            let (offsets, list) = (g.offsets, g.list);
            let busy = mmq::mul_mat_id(cx, w, d, b, n_used, n_pairs, offsets, list, max_pairs, out, packed, Some(xs));
            return busy.unwrap_or_else(|| Err(unsupported_id("the tiled kernels refused experts they fit")));
        }
        return Ok(());
    }
    mmq::moe_prep(cx, ids, n_expert, &g, i32::MAX, b, None, op)?;
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

/// Whether `moe_decode` beats `moe_mma_*` at `n_tokens` tokens (at most `MOE_DECODE_TOKENS`) for
/// experts of `k`-long rows. A `moe_mma_*` warp multiplies its rows' k-chunks of 256 values one
/// after another, so with few tokens (few routed experts, few work items) the time is that chain's
/// latency, which grows with k, while `moe_decode`'s grows with the pairs. Measured on an H200,
/// nvfp4, 256 experts top-8, `moe_decode` against `moe_mma` (us): 2048 -> 512 (8 chunks) 10.6 / 25.4
/// at 1 token, 42.5 / 31.4 at 8, 87.7 / 57.8 at 16 (crossing near 5 tokens); 512 -> 2048 (2 chunks)
/// 16.6 / 10.8, 95.3 / 26.6, 191.8 / 42.6. So: `moe_decode` up to chunks / 2 tokens, and never for
/// rows of at most 2 chunks.
/// Whether mul_mat_id takes `moe_decode`: few tokens where it beats `moe_mma_*` (or forced by
/// `TESSERA_MOE_PATH`), one grid row a pair (a pair count past the grid's y limit takes the
/// grouped path), rows the fast units can read.
/// `mma`: whether `moe_mma_*` could take the experts (`moe_mma_fits`).
fn moe_decode_taken(w: &TensorArg, d: DType, ids: &TensorArg, mma: bool) -> bool {
    let n_pairs = ids.nelements();
    let decode = match moe_path() {
        MoePath::Auto => ids.ne[1] <= MOE_DECODE_TOKENS && (!mma || moe_decode_wins(ids.ne[1], w.ne[0])),
        MoePath::Decode => true,
        MoePath::Mma | MoePath::Grouped => false,
    };
    decode && n_pairs <= GRID_YZ && fast_rows(w, d)
}

/// Whether `moe_mma_*` can take these experts for this many pairs (and is not switched off).
fn moe_mma_fits(cx: &Cx<'_>, w: &TensorArg, d: DType, ids: &TensorArg) -> bool {
    moe_path() != MoePath::Grouped && mmq::moe_fits(cx, w, d, ids.nelements())
}

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
fn moe_decode(
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
fn weighted_decode_taken(w: &TensorArg, d: DType, ids: &TensorArg) -> bool {
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
fn moe_decode_sum(
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
fn weighted_slot_sum(cx: &mut Cx<'_>, y: TensorArg, w: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let blocks = blocks_for(y.ne[0] * y.ne[2], 256);
    let mut args = cx.kernel(WEIGHTED_SLOT_SUM)?;
    args.arg(&y).arg(&w).arg(&out);
    // SAFETY: y [M, n_used, T] f32 (written by mul_mat_id), w [1, n_used, T] and out [M, T]
    // f32 (shape rules); a grid-stride loop over the M T outputs.
    unsafe { args.launch(config((blocks, 1, 1), (256, 1, 1), 0)) }?;
    Ok(())
}

/// Whether `gemv_fast_glu_N` takes mul_mat_swiglu: at most `GEMV_MAX_N` tokens over q8_0 /
/// nvfp4 / f32 gate and up weights of one layout the fast units can read.
fn glu_gemv_fits(wg: &TensorArg, wu: &TensorArg, d: DType, b: &TensorArg) -> bool {
    let dtype_ok = d.is_quantized() || d == DType::F32;
    b.ne[1] <= GEMV_MAX_N && dtype_ok && fast_rows(wg, d) && fast_rows(wu, d) && wg.nb == wu.nb
}

/// mul_mat_swiglu for a few tokens: `gemv_fast_glu_N`, a block per gate row and its up row over
/// the activations quantized once, swiglu before the store.
fn gemv_fast_glu(
    cx: &mut Cx<'_>,
    wg: TensorArg,
    wu: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
    let n = b.ne[1];
    let (x, ldx) = fast_activations(cx, d, b)?;
    let kernel = GEMV_FAST_GLU[match n {
        ..=1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }];
    let (adt, b2, b3) = (dt(d), b.ne[2], b.ne[3]);
    let grid = (wg.ne[1].clamp(1, i32::MAX as i64) as u32, (b2 * b3).clamp(1, GRID_YZ) as u32, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&wg).arg(&wu).arg(&adt).arg(&x).arg(&ldx).arg(&n).arg(&b2).arg(&b3).arg(&out);
    // SAFETY: as `gemv_fast_N` with one output row a block (`glu_gemv_fits` checked the gate
    // weights' layout), and the up weights have the gate's dtype, shape and strides, so each
    // row read in `wu` lies where the same row of `wg` would.
    unsafe { args.launch(config(grid, (GF_THREADS, 1, 1), 0)) }?;
    Ok(())
}

/// The up product's place in scratch for a gate-and-up op run as two products and swiglu:
/// contiguous f32 of the output's shape after what one product needs (`glu_up_at`).
fn glu_up(cx: &Cx<'_>, task: &Task<'_>, out: TensorArg) -> Result<TensorArg, BackendError> {
    let at = glu_up_at(task).ok_or_else(|| unsupported(task, "not a gate-and-up op with its inputs"))?;
    let ne = out.ne;
    let nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]];
    Ok(TensorArg { data: cx.scratch + at as u64, ne, nb })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_fast_shares_activations_among_rows_while_blocks_fill_the_gpu() {
        // One token keeps a row a block; several take 4 rows, then 2, while that leaves two
        // blocks a multiprocessor (132: an H100 / H200).
        assert_eq!(gemv_fast_rows(1, 8192, 132), 1);
        assert_eq!(gemv_fast_rows(8, 8192, 132), 4);
        assert_eq!(gemv_fast_rows(2, 1056, 132), 4);
        assert_eq!(gemv_fast_rows(8, 1055, 132), 2);
        assert_eq!(gemv_fast_rows(8, 528, 132), 2);
        assert_eq!(gemv_fast_rows(8, 527, 132), 1);
    }

    /// One contiguous [k, m] matrix of `d` at a 16-byte aligned address.
    fn weights(d: DType, k: usize, m: usize) -> TensorArg {
        let row = (k / d.block_size() * d.block_bytes()) as i64;
        TensorArg { data: 1 << 20, ne: [k as i64, m as i64, 1, 1], nb: [1, row, row * m as i64, row * m as i64] }
    }

    /// One f32 activation row of k values.
    fn activations(k: usize) -> TensorArg {
        TensorArg { data: 1 << 30, ne: [k as i64, 1, 1, 1], nb: [4, 4 * k as i64, 4 * k as i64, 4 * k as i64] }
    }

    #[test]
    fn moe_decode_takes_few_tokens_of_long_rows_only() {
        // 35B-A3B gate/up (k 2048): up to 4 tokens; down (k 512) and short rows: never
        assert!((1..=4).all(|t| moe_decode_wins(t, 2048)));
        assert!(!moe_decode_wins(5, 2048));
        assert!((1..=16).all(|t| !moe_decode_wins(t, 512) && !moe_decode_wins(t, 256)));
        assert!(moe_decode_wins(1, 1024) && !moe_decode_wins(3, 1024));
    }

    #[test]
    fn gemv1_keeps_two_stages_in_flight_below_4_tb_s() {
        // the peaks an H100 SXM and an H200 report (memory clock x bus width), and none
        assert_eq!(gemv1_stages(3_352_320_000_000), 3);
        assert_eq!(gemv1_stages(4_812_800_000_000), 4);
        assert_eq!(gemv1_stages(0), 3);
    }

    #[test]
    fn gemv1_plans_of_the_model_shapes_fit_and_give_nvfp4_two_rows_a_stage() {
        // (ring stages, opt-in shared memory, bulk copies): Hopper with either ring, Ampere (A100)
        // with 3
        for (stages, max_shared, bulk) in [(3, 232_448, true), (4, 232_448, true), (3, 166_912, false)] {
            for d in [DType::Q8_0, DType::NvFp4] {
                for (k, m) in [(5120, 17408), (17408, 5120), (2048, 6144)] {
                    let plan = gemv1_plan(&weights(d, k, m), d, &activations(k), max_shared, stages, bulk)
                        .unwrap_or_else(|| panic!("no plan for {d:?} k={k} stages={stages}"));
                    let (groups, rows_stage) = (plan.groups as usize, plan.rows_stage as usize);
                    assert_eq!(plan.stages, stages);
                    assert!(plan.shared as usize + G1_STATIC_SHARED <= max_shared, "{plan:?}");
                    let max = if d == DType::NvFp4 { G1_MAX_THREADS_NVFP4 } else { G1_MAX_THREADS };
                    let producer_warp = if plan.producer { 32 } else { 0 };
                    assert!(groups * k / 64 + producer_warp <= plan.threads as usize && plan.threads as usize <= max);
                    assert_eq!(plan.threads % 32, 0);
                    // a producer warp only for nvfp4 with bulk copies and the ring of 4, and only
                    // where it costs no group: the long rows of 272 units (2 groups, 544 + 32
                    // threads)
                    let producer = bulk && stages == 4 && d == DType::NvFp4 && k == 17408;
                    assert_eq!(plan.producer, producer, "{d:?} k={k} stages={stages}: {plan:?}");
                    assert_eq!(rows_stage % groups, 0, "{plan:?}");
                    if d == DType::NvFp4 && max_shared > 200_000 {
                        assert_eq!(rows_stage, 2 * groups, "{d:?} k={k}: {plan:?}");
                    }
                    if k == 5120 {
                        // nvfp4's 640 threads hold 8 groups of 80 units, q8_0's 576 hold 7
                        assert_eq!(groups, if d == DType::NvFp4 { 8 } else { 7 }, "{d:?}: {plan:?}");
                    }
                }
            }
        }
        // not one token, or rows that are not contiguous: no plan
        let mut two = activations(5120);
        two.ne[1] = 2;
        assert!(gemv1_plan(&weights(DType::Q8_0, 5120, 64), DType::Q8_0, &two, 232_448, 3, true).is_none());
        let mut strided = weights(DType::Q8_0, 5120, 64);
        strided.nb[1] += 16;
        assert!(gemv1_plan(&strided, DType::Q8_0, &activations(5120), 232_448, 3, true).is_none());
    }
}
