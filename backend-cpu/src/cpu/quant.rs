//! Block-quantized data on the CPU: quantize / dequantize, and the fused dequantize-dot that the
//! matrix-vector paths of mul_mat and mul_mat_id run on q8_0 / nvfp4 weight rows.
//!
//! Quantization goes through `tessera_ops::quant` (the byte-exact ggml reference quantizers), so the
//! CPU writes exactly the bytes the f64 reference stores. The dot products decode one block at a
//! time in registers (AVX2 + FMA when the CPU has them) or on the stack, multiply by the block
//! scale once per block, and combine the per-256-value partial sums pairwise, like the f32 dots in
//! [`super::sum`].

use tessera_ops::{DType, KernelError, quant};

use super::strided::{Dst, Src, row_coords};
use super::sum::{BLOCK, Cascade};

/// `quantize` (f32 -> q8_0 / nvfp4) and `dequantize` (q8_0 / nvfp4 -> f32), row by row: each row is
/// decoded to f32 and stored in the output's dtype (whole blocks through `tessera_ops::quant`).
pub(super) fn convert(x: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let meta = *dst.meta();
    if meta.dtype.is_quantized() && !meta.has_contiguous_rows() {
        return Err(KernelError::Unsupported {
            op: "quantize",
            why: format!("quantized output rows must be dense, got strides {:?}", meta.nb),
        });
    }
    let ne = meta.ne;
    dst.for_each_row(ne[0], Vec::new, |scratch: &mut Vec<f32>, r, mut row| {
        let c = row_coords(ne, r);
        if meta.dtype.is_quantized() {
            scratch.resize(ne[0], 0.0);
            x.load_row(c, scratch);
            row.store(scratch);
        } else {
            row.fill_f32(scratch, |out| x.load_row(c, out));
        }
    });
    Ok(())
}

/// Values per partial sum before the pairwise combination.
const CHUNK: usize = BLOCK;

/// Most activation columns one pass over a weight row serves (the GEMV path has at most 4).
pub(super) const MAX_COLS: usize = 4;

/// `out[c] = sum_k w[k] * cols[c * k_len + k]` for each column `c` (`out.len()` columns of
/// `k_len` values), where `w` holds `k_len` values of the block-quantized `dtype` as dense whole
/// blocks. Each block is decoded once for up to [`MAX_COLS`] columns.
///
/// A decoded value `q * d` is exact in f32 (an i8 times an f16, or an E2M1 times a UE4M3 value),
/// so this is the f32 dot of the dequantized row: per column, 8-lane FMA accumulators over 256
/// values, whose sums are combined pairwise.
pub(super) fn dot_quantized(dtype: DType, w: &[u8], cols: &[f32], out: &mut [f32]) {
    let k_len = cols.len() / out.len().max(1);
    let blocks = k_len / dtype.block_size();
    assert!(
        dtype.is_quantized()
            && k_len.is_multiple_of(dtype.block_size())
            && cols.len() == k_len * out.len()
            && w.len() >= blocks * dtype.block_bytes(),
        "dot_quantized: {} columns of {k_len} {dtype} values need {} weight bytes, got {}",
        out.len(),
        blocks * dtype.block_bytes(),
        w.len()
    );
    let w = &w[..blocks * dtype.block_bytes()];
    for (cols, out) in cols.chunks(MAX_COLS * k_len.max(1)).zip(out.chunks_mut(MAX_COLS)) {
        let x: [&[f32]; MAX_COLS] = std::array::from_fn(|c| cols.get(c * k_len..(c + 1) * k_len).unwrap_or(&[]));
        match out.len() {
            1 => out.copy_from_slice(&dot_cols::<1>(dtype, w, [x[0]])),
            2 => out.copy_from_slice(&dot_cols::<2>(dtype, w, [x[0], x[1]])),
            3 => out.copy_from_slice(&dot_cols::<3>(dtype, w, [x[0], x[1], x[2]])),
            _ => out.copy_from_slice(&dot_cols::<4>(dtype, w, x)),
        }
    }
}

/// One pass over the weight row for `NC` columns, each as long as the row.
fn dot_cols<const NC: usize>(dtype: DType, w: &[u8], x: [&[f32]; NC]) -> [f32; NC] {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); `dot_quantized` checked that `w`
        // holds the whole blocks of each column's length.
        return unsafe {
            match dtype {
                DType::Q8_0 => x86::dot_q8_0::<NC>(w, x),
                _ => x86::dot_nvfp4::<NC>(w, x),
            }
        };
    }
    match dtype {
        DType::Q8_0 => dot_portable::<NC, { quant::Q8_0_BLOCK }, { quant::Q8_0_BLOCK_BYTES }>(w, x, |b, out| {
            quant::dequantize_block_q8_0(b, out)
        }),
        _ => dot_portable::<NC, { quant::NVFP4_BLOCK }, { quant::NVFP4_BLOCK_BYTES }>(w, x, |b, out| {
            quant::dequantize_block_nvfp4(b, out)
        }),
    }
}

/// Decodes each block onto the stack and dots it with each column in 8 lane accumulators.
fn dot_portable<const NC: usize, const B: usize, const BB: usize>(
    w: &[u8],
    x: [&[f32]; NC],
    decode: impl Fn(&[u8; BB], &mut [f32; B]),
) -> [f32; NC] {
    let mut totals: [Cascade; NC] = std::array::from_fn(|_| Cascade::new());
    let mut block = [0f32; B];
    let per_chunk = (CHUNK / B).max(1);
    let (wb, _) = w.as_chunks::<BB>();
    for (ci, ws) in wb.chunks(per_chunk).enumerate() {
        let mut acc = [[0f32; 8]; NC];
        for (bi, wq) in ws.iter().enumerate() {
            decode(wq, &mut block);
            let at = (ci * per_chunk + bi) * B;
            for (acc, x) in acc.iter_mut().zip(&x) {
                for (b8, x8) in block.chunks_exact(8).zip(x[at..at + B].chunks_exact(8)) {
                    for j in 0..8 {
                        acc[j] += b8[j] * x8[j];
                    }
                }
            }
        }
        for (t, a) in totals.iter_mut().zip(&acc) {
            t.push(((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])));
        }
    }
    totals.each_mut().map(|c| c.finish())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + FMA (+ F16C) dots over raw quantized blocks: each block is decoded once into
    //! registers as exact f32 values `q * d` and FMA'd into every column's accumulator.

    use std::arch::x86_64::*;

    use tessera_ops::quant::{E2M1_HALVES, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};

    use super::{CHUNK, Cascade};

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// 8 i8 values (the low 8 bytes of `v`) as f32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn i8x8_to_ps(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// The 32 values of a q8_0 block, `q * d`, in 4 registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn decode_q8_0(blk: &[u8; Q8_0_BLOCK_BYTES]) -> [__m256; 4] {
        let d = _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes([blk[0], blk[1]])));
        // SAFETY: bytes 2..34 of the 34-byte block are readable; the load is unaligned.
        let q = unsafe { _mm256_loadu_si256(blk.as_ptr().add(2).cast()) };
        let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)].map(|v| _mm256_mul_ps(i8x8_to_ps(v), d))
    }

    /// The 64 values of an nvfp4 block, `e2m1 * ue4m3`, in 8 registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn decode_nvfp4(blk: &[u8; NVFP4_BLOCK_BYTES], lut: __m128i) -> [__m256; 8] {
        let low4 = _mm_set1_epi8(0x0F);
        let mut out = [_mm256_setzero_ps(); 8];
        for s in 0..4 {
            // E2M1 values are in halves: the real scale is ue4m3 / 2.
            let d = _mm256_set1_ps(tessera_ops::quant::ue4m3_to_f32(blk[s]) * 0.5);
            // SAFETY: sub-block `s` has its 8 code bytes at 4 + 8s .. 12 + 8s <= 36.
            let codes = unsafe { _mm_loadl_epi64(blk.as_ptr().add(4 + 8 * s).cast()) };
            let lo = _mm_and_si128(codes, low4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(codes), low4);
            // bytes 0..8: elements 0..8 (low nibbles); bytes 8..16: elements 8..16.
            let vals = _mm_shuffle_epi8(lut, _mm_unpacklo_epi64(lo, hi));
            out[2 * s] = _mm256_mul_ps(i8x8_to_ps(vals), d);
            out[2 * s + 1] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128::<8>(vals)), d);
        }
        out
    }

    /// Generates a kernel over whole blocks of `$bs` values / `$bb` bytes whose decoder gives
    /// `$bs / 8` registers.
    macro_rules! dot_kernel {
        ($name:ident, $bs:expr, $bb:expr, |$blk:ident, $lut:ident| $decode:expr) => {
            /// # Safety
            /// The CPU has AVX2, FMA and F16C; every column holds as many values as `w` encodes.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name<const NC: usize>(w: &[u8], x: [&[f32]; NC]) -> [f32; NC] {
                let (wb, _) = w.as_chunks::<{ $bb }>();
                let n = wb.len() * $bs;
                assert!(x.iter().all(|c| c.len() >= n), "quantized dot: columns shorter than the row");
                let table: [i8; 16] = E2M1_HALVES;
                // SAFETY: `table` is 16 readable bytes; the load is unaligned.
                let $lut = unsafe { _mm_loadu_si128(table.as_ptr().cast()) };
                let _ = $lut;
                let mut totals: [Cascade; NC] = std::array::from_fn(|_| Cascade::new());
                let per_chunk = CHUNK / $bs;
                for (ci, ws) in wb.chunks(per_chunk).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); NC];
                    for (bi, $blk) in ws.iter().enumerate() {
                        let v = $decode;
                        let at = (ci * per_chunk + bi) * $bs;
                        for (a, col) in acc.iter_mut().zip(&x) {
                            for (j, vj) in v.iter().enumerate() {
                                // SAFETY: values at .. at + $bs of each column exist (asserted:
                                // at + $bs <= n <= len); the load is unaligned.
                                let xv = unsafe { _mm256_loadu_ps(col.as_ptr().add(at + 8 * j)) };
                                *a = _mm256_fmadd_ps(*vj, xv, *a);
                            }
                        }
                    }
                    for (t, a) in totals.iter_mut().zip(acc) {
                        t.push(hsum(a));
                    }
                }
                totals.each_mut().map(|c| c.finish())
            }
        };
    }

    dot_kernel!(dot_q8_0, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, |blk, lut| decode_q8_0(blk));
    dot_kernel!(dot_nvfp4, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, |blk, lut| decode_nvfp4(blk, lut));
}

#[cfg(test)]
mod tests {
    use tessera_ops::{DType, host};

    use super::*;

    /// The dot of the dequantized row, in f64.
    fn exact(dtype: DType, w: &[u8], x: &[f32]) -> f64 {
        host::decode(dtype, w).iter().zip(x).map(|(&a, &b)| a * f64::from(b)).sum()
    }

    #[test]
    fn fused_dots_match_the_dequantized_row() {
        for dtype in [DType::Q8_0, DType::NvFp4] {
            for blocks in [1, 2, 7, 8, 9, 33, 80] {
                let n = blocks * dtype.block_size();
                let wv: Vec<f64> = (0..n).map(|i| (((i * 7919) % 1013) as f64 / 500.0 - 1.0) * 3.0).collect();
                let mut w = vec![0u8];
                w.extend(host::encode(dtype, &wv)); // misaligned on purpose
                for ncols in [1, 2, 3, 4, 5, 9] {
                    let x: Vec<f32> = (0..n * ncols).map(|i| ((i * 104_729) % 997) as f32 / 498.0 - 1.0).collect();
                    let mut got = vec![0f32; ncols];
                    dot_quantized(dtype, &w[1..], &x, &mut got);
                    for (c, col) in x.chunks_exact(n).enumerate() {
                        let want = exact(dtype, &w[1..], col);
                        let norm: f64 = col.iter().map(|&v| f64::from(v).abs() * 3.0).sum();
                        let what = format!("{dtype} x {blocks} column {c} of {ncols}");
                        assert!((f64::from(got[c]) - want).abs() <= 1e-6 * norm, "{what}: {} vs {want}", got[c]);
                        let portable = match dtype {
                            DType::Q8_0 => dot_portable::<1, 32, 34>(&w[1..], [col], quant::dequantize_block_q8_0),
                            _ => dot_portable::<1, 64, 36>(&w[1..], [col], quant::dequantize_block_nvfp4),
                        };
                        assert!((f64::from(portable[0]) - want).abs() <= 1e-6 * norm, "portable {what}");
                    }
                }
            }
        }
    }
}
