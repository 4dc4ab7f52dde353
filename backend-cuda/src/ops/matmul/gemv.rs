//! mul_mat and mul_mat_swiglu at 1-8 tokens a pass (`kernels/gemv.cu`): the warp GEMV
//! `gemv_warp_N` (any weights and strides, the general path) and the fast GEMV `gemv_fast_*` /
//! `gemv_fast_glu_*` (contiguous q8_0 / nvfp4 rows, and few long f16 / bf16 rows, against
//! activations quantized once a call by `quant_x`). Few tokens against large weights are bound by
//! the weight read, so each reads a weight row once for all the tokens of a pass.

use std::sync::OnceLock;

use tessera_graph::BackendError;
use tessera_ops::DType;

use super::pack::{pack_b, packed_already, packed_len};
use super::{GEMV_MAX_N, GF_THREADS, MM_WARPS, THREADS, align, rows_vectorizable};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, GRID_YZ, TensorArg, blocks_for, config, dt};

const GEMV_WARP: [Kernel; 4] = [
    Kernel::new(Module::Gemv, "gemv_warp_1"),
    Kernel::new(Module::Gemv, "gemv_warp_2"),
    Kernel::new(Module::Gemv, "gemv_warp_4"),
    Kernel::new(Module::Gemv, "gemv_warp_8"),
];
const QUANT_X: Kernel = Kernel::new(Module::Gemv, "quant_x");

/// `gemv_fast_*` entry points: `[1 row a block, 2, 4][1 token a pass, 2, 4, 8]` (one token
/// has only the one-row entry: `gemv_fast_rows` never gives it more).
const GEMV_FAST: [[Kernel; 4]; 3] = [
    [
        Kernel::new(Module::Gemv, "gemv_fast_1"),
        Kernel::new(Module::Gemv, "gemv_fast_2"),
        Kernel::new(Module::Gemv, "gemv_fast_4"),
        Kernel::new(Module::Gemv, "gemv_fast_8"),
    ],
    [
        Kernel::new(Module::Gemv, "gemv_fast_1"),
        Kernel::new(Module::Gemv, "gemv_fast_2_r2"),
        Kernel::new(Module::Gemv, "gemv_fast_4_r2"),
        Kernel::new(Module::Gemv, "gemv_fast_8_r2"),
    ],
    [
        Kernel::new(Module::Gemv, "gemv_fast_1"),
        Kernel::new(Module::Gemv, "gemv_fast_2_r4"),
        Kernel::new(Module::Gemv, "gemv_fast_4_r4"),
        Kernel::new(Module::Gemv, "gemv_fast_8_r4"),
    ],
];

/// `gemv_fast_glu_N` (mul_mat_swiglu at 1 to 8 tokens): `[1 token a pass, 2, 4, 8]`.
const GEMV_FAST_GLU: [Kernel; 4] = [
    Kernel::new(Module::Gemv, "gemv_fast_glu_1"),
    Kernel::new(Module::Gemv, "gemv_fast_glu_2"),
    Kernel::new(Module::Gemv, "gemv_fast_glu_4"),
    Kernel::new(Module::Gemv, "gemv_fast_glu_8"),
];

/// GEMVs over at most this many weight rows (all batches) of at least `SPLIT_K` elements split
/// each row over the block's warps, so that few long rows still fill the GPU (splitting short
/// rows or many rows was slower: docs/perf-log/kernels-matmul.md).
const SPLIT_ROWS: i64 = 8192;
const SPLIT_K: i64 = 8192;

/// Rows of at least `SPLIT_K_FEW` elements split over the block's warps too when there are at
/// most this many (all batches): the MoE router (2048 x 256 f32) and the shared expert's gate
/// (2048 x 1) are a handful of memory round trips a warp unsplit, the latency of a decode step.
const SPLIT_FEW_ROWS: i64 = 512;
const SPLIT_K_FEW: i64 = 1024;

/// The warp GEMV `gemv_warp_N`: any weights and strides, after `pack_b` (or on `b` in place when
/// it already is packed rows), up to 8 tokens a pass, long rows split over the block's warps.
pub(super) fn gemv_warp(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
    let n = b.ne[1];
    let (bp, ldb) = match packed_already(&b) {
        Some(ldb) => (b.data, ldb),
        None => {
            let ldb = packed_len(b.ne[0] as usize) as i64;
            pack_b(cx, b, cx.scratch, 0, 0, 0, ldb)?;
            (cx.scratch, ldb)
        }
    };
    let kernel = GEMV_WARP[match n {
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
    // SAFETY: `gemv_warp_N(a, adt, bp, ldb, n, b2, b3, out, vec, parts)`: parts is 1 or MM_WARPS;
    // a's rows are dense of dtype adt (shape rules) and each batch maps to weight batch
    // (i2 / (b2 / a2), i3 / (b3 / a3)) inside a; bp holds b2 * b3 * n packed rows of ldb >= k f32 (scratch_bytes); out is [m, n, b2, b3]
    // f32; `vec` only when every row start is 16-byte aligned and rows are whole 16-byte pieces.
    unsafe { args.launch(config(grid, (MM_WARPS * 32, 1, 1), 0)) }?;
    Ok(())
}

/// Whether `gemv_fast_N` takes the weights: q8_0 / nvfp4 whose rows start 4-byte aligned, and
/// f16 / bf16 read in 16-byte pieces (`rows_vectorizable`) when rows are few and long: the fast
/// GEMV beat `gemv_warp_N` for every quantized shape measured and for few long bf16 rows, but not
/// for many bf16 rows (docs/perf-log/kernels-matmul.md), so those stay on `gemv_warp_N` (one token
/// against one f16 / bf16 matrix takes `word_gemv` before this).
pub(super) fn fast_gemv_fits(a: &TensorArg, d: DType) -> bool {
    let rows = a.ne[1] * a.ne[2] * a.ne[3];
    // f32 weights keep gemv_warp_N here (its split rows), the fused decode ops take their f32 units
    d != DType::F32 && fast_rows(a, d) && (d.is_quantized() || (rows <= SPLIT_ROWS && a.ne[0] >= SPLIT_K))
}

/// Whether the fast GEMV units (`gf_load` / `gf_dot`) can read the weight rows: q8_0 / nvfp4 rows
/// start 4-byte aligned, f16 / bf16 / f32 rows are whole 16-byte pieces (`rows_vectorizable`).
pub(super) fn fast_rows(a: &TensorArg, d: DType) -> bool {
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
pub(super) fn fast_activations(cx: &mut Cx<'_>, d: DType, b: TensorArg) -> Result<(u64, i64), BackendError> {
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
pub(super) fn gemv_fast(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
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

/// Bytes of `quant_x`'s int16 activations (2 bytes a value) and their per-16-value f32 scales.
pub(super) fn quant_x_bytes(n: usize) -> (usize, usize) {
    (align(n * 2), align(n / 16 * 4))
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

/// Whether `gemv_fast_glu_N` takes mul_mat_swiglu: at most `GEMV_MAX_N` tokens over q8_0 /
/// nvfp4 / f32 gate and up weights of one layout the fast units can read.
pub(super) fn glu_gemv_fits(wg: &TensorArg, wu: &TensorArg, d: DType, b: &TensorArg) -> bool {
    let dtype_ok = d.is_quantized() || d == DType::F32;
    b.ne[1] <= GEMV_MAX_N && dtype_ok && fast_rows(wg, d) && fast_rows(wu, d) && wg.nb == wu.nb
}

/// mul_mat_swiglu for a few tokens: `gemv_fast_glu_N`, a block per gate row and its up row over
/// the activations quantized once, swiglu before the store.
pub(super) fn gemv_fast_glu(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_kernels_are_entry_points_of_gemv_cu() {
        let fast = GEMV_FAST.iter().flatten();
        for &k in GEMV_WARP.iter().chain(fast).chain(&GEMV_FAST_GLU).chain([&QUANT_X]) {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
    }

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
}
