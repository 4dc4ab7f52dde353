//! The copies into scratch that the matmul paths make before a product (`kernels/pack.cu`):
//! `pack_b` packs the f32 activations into rows of a fixed stride (f32 for the GEMVs, which then
//! read whole 16-byte pieces whatever the input's strides; f16 / bf16, bf16 split into hi + lo,
//! for cuBLAS), and `dequant_rows` turns quantized weight rows into bf16 hi + lo rows for cuBLAS,
//! which has no q8_0 / nvfp4 type.

use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use super::{THREADS, align};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, dt};

const PACK_B: Kernel = Kernel::new(Module::Pack, "pack_b");
const DEQUANT_ROWS: Kernel = Kernel::new(Module::Pack, "dequant_rows");

/// Packed row length (elements) of activations and dequantized weights: 8 keeps every row
/// 16-byte aligned as bf16 and 32-byte aligned as f32.
pub(super) fn packed_len(k: usize) -> usize {
    k.next_multiple_of(8)
}

/// Bytes of the packed f32 activations of `b`.
pub(super) fn packed_f32_bytes(b: &TensorMeta) -> usize {
    align(b.nelements() / b.ne[0].max(1) * packed_len(b.ne[0]) * 4)
}

/// The row stride (elements) at which `gemv_warp_N` can read the f32 activations `b` in place, when
/// they already have the packed layout `pack_b` would write: dense rows of a whole number of
/// packed lengths, rows and batches one after the other, 32-byte aligned. Saves a launch and a
/// copy for every small GEMV over f32 or f16 weights (the MoE router's, at one token).
pub(super) fn packed_already(b: &TensorArg) -> Option<i64> {
    let k = b.ne[0];
    let dense = b.nb[0] == 4 && b.nb[1] == 4 * k && b.nb[2] == b.nb[1] * b.ne[1] && b.nb[3] == b.nb[2] * b.ne[2];
    (dense && packed_len(k as usize) as i64 == k && b.data.is_multiple_of(32)).then_some(k)
}

/// Packs `b` into rows of `ldb` elements: f32 at `f32_out`, and / or half at `hi` (f16 when
/// `half_dt` is f16's code, else bf16 with the remainder at `lo` when nonzero). Zero skips.
pub(super) fn pack_b(
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

/// Rows `[m0, m0 + rows)` of the weight matrix at `a` (batch offset applied) to bf16 rows of
/// `ld` elements at `hi` (and the remainder at `lo` when nonzero).
#[allow(clippy::too_many_arguments)]
pub(super) fn dequant_rows(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_kernels_are_entry_points_of_pack_cu() {
        for k in [PACK_B, DEQUANT_ROWS] {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
    }
}
