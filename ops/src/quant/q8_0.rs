//! q8_0 (ggml type 8): 32 values share one f16 scale.
//!
//! Block layout, 34 bytes: `d` as little-endian IEEE f16 (bytes 0..2), then 32 `i8` quants in element
//! order (bytes 2..34). A value decodes as `q as f32 * f32::from(d)`.
//!
//! Encoding, as ggml's `quantize_row_q8_0_ref` (ggml `src/ggml-quants.c:276`) and gguf-py's
//! `Q8_0.quantize_blocks` (gguf 0.19.0 `quants.py`, written to be bit-exact with it) both do, all in f32:
//!
//! 1. `amax = max |x|`, `d = amax / 127`;
//! 2. `id = 1 / d` from the **f32** `d` (0 when `d == 0`), *not* from the f16-rounded stored scale;
//! 3. `q = round(x * id)` with ties **away from zero** (C `roundf`; gguf-py's `np_roundf`);
//! 4. the stored scale is `d` rounded to f16, nearest-even (overflows to inf past 65504).
//!
//! An all-zero block (either sign) stores `d = +0` and all-zero quants. The scale's f16 rounding
//! can lose a block: `amax` above about `8.3e6` stores `d = inf` (the block dequantizes to `±inf`,
//! NaN for zero quants), and `amax` below about `3.8e-6` stores `d = 0` (it dequantizes to zeros)
//! while its quants still hold the f32-scaled values.
//!
//! Non-finite inputs follow gguf-py (the fixtures' reference):
//! - any NaN makes `amax`, `d` and `id` NaN: the block stores `d = NaN` and all-zero quants, so it
//!   dequantizes to all NaN. The NaN is stored as `0x7E00`, as ggml's f16 conversion does; numpy
//!   keeps the input NaN's payload bits, so for NaNs other than the default one the two differ in
//!   the scale's bit pattern (both are NaN). (ggml's C reference differs here: its `MAX` macro,
//!   `src/ggml-impl.h:40`, drops a NaN that is followed by another element, so the NaN element gets
//!   quant 0 and the rest are scaled by the max of the elements after it.)
//! - `±inf` makes `d = inf`, `id = 0` and every quant 0 (the inf element's `inf * 0` is NaN), so the
//!   block dequantizes to all NaN; ggml's C reference agrees.
//! - a quant whose `x * id` is not finite is stored as 0, as the x86 float-to-int conversion in both
//!   references does. This happens when `d` is so small that `1 / d` overflows (`amax` below about
//!   `3.7e-37`); `d` then rounds to f16 zero, so the block still dequantizes to zeros.

use super::{QuantError, check_lengths};

/// Values per q8_0 block (ggml `QK8_0`).
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per q8_0 block: a 2-byte f16 scale and 32 `i8` quants (ggml `sizeof(block_q8_0)`).
pub const Q8_0_BLOCK_BYTES: usize = 34;

const NAME: &str = "q8_0";
/// f16 bit pattern stored for a NaN scale (ggml's; numpy gives the same for the default NaN).
const F16_NAN: [u8; 2] = 0x7E00u16.to_le_bytes();

/// Quantizes one block of 32 values. See the module docs for the exact rounding.
pub fn quantize_block_q8_0(src: &[f32; Q8_0_BLOCK], dst: &mut [u8; Q8_0_BLOCK_BYTES]) {
    // NaN-propagating max, as numpy's `max`: once `amax` is NaN, `a > amax` is false and it stays NaN.
    let amax = src.iter().fold(0.0f32, |amax, &x| {
        let a = x.abs();
        if a > amax || a.is_nan() { a } else { amax }
    });
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let d_bytes = if d.is_nan() { F16_NAN } else { half::f16::from_f32(d).to_le_bytes() };
    dst[..2].copy_from_slice(&d_bytes);
    for (q, &x) in dst[2..].iter_mut().zip(src) {
        let v = x * id;
        // `f32::round` rounds half away from zero, like `roundf`; the i8 range is never exceeded
        // because |x * id| <= 127 up to an ulp.
        let qi: i8 = if v.is_finite() { v.round() as i8 } else { 0 };
        *q = qi as u8;
    }
}

/// Dequantizes one block: `dst[j] = qs[j] * d` in f32, as ggml's `dequantize_row_q8_0`
/// (`src/ggml-quants.c:553`).
pub fn dequantize_block_q8_0(src: &[u8; Q8_0_BLOCK_BYTES], dst: &mut [f32; Q8_0_BLOCK]) {
    let d = half::f16::from_le_bytes([src[0], src[1]]).to_f32();
    for (y, &q) in dst.iter_mut().zip(&src[2..]) {
        *y = f32::from(q as i8) * d;
    }
}

/// Quantizes `src` (a whole number of 32-value blocks) into `dst` (34 bytes per block).
///
/// # Errors
/// [`QuantError`] when `src.len()` is not a multiple of [`Q8_0_BLOCK`] or `dst` is not exactly
/// `src.len() / 32 * 34` bytes; nothing is written then.
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_lengths(NAME, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, src.len(), dst.len())?;
    let (src_blocks, _) = src.as_chunks::<Q8_0_BLOCK>();
    let (dst_blocks, _) = dst.as_chunks_mut::<Q8_0_BLOCK_BYTES>();
    for (x, y) in src_blocks.iter().zip(dst_blocks) {
        quantize_block_q8_0(x, y);
    }
    Ok(())
}

/// Dequantizes `src` (34 bytes per block) into `dst` (32 values per block).
///
/// # Errors
/// [`QuantError`] when `dst.len()` is not a multiple of [`Q8_0_BLOCK`] or `src` is not exactly
/// `dst.len() / 32 * 34` bytes; nothing is written then.
pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(NAME, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, dst.len(), src.len())?;
    let (src_blocks, _) = src.as_chunks::<Q8_0_BLOCK_BYTES>();
    let (dst_blocks, _) = dst.as_chunks_mut::<Q8_0_BLOCK>();
    for (x, y) in src_blocks.iter().zip(dst_blocks) {
        dequantize_block_q8_0(x, y);
    }
    Ok(())
}

/// [`dequantize_q8_0`] into f64, for the f64 reference. Every value equals the f32 result widened:
/// an `i8` times an f16 needs at most 18 significant bits, so the f32 product is already exact.
///
/// # Errors
/// As [`dequantize_q8_0`].
pub fn dequantize_q8_0_f64(src: &[u8], dst: &mut [f64]) -> Result<(), QuantError> {
    check_lengths(NAME, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, dst.len(), src.len())?;
    let mut block = [0f32; Q8_0_BLOCK];
    let (src_blocks, _) = src.as_chunks::<Q8_0_BLOCK_BYTES>();
    for (x, y) in src_blocks.iter().zip(dst.chunks_exact_mut(Q8_0_BLOCK)) {
        dequantize_block_q8_0(x, &mut block);
        for (o, &v) in y.iter_mut().zip(&block) {
            *o = f64::from(v);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(src: &[f32; 32]) -> [u8; 34] {
        let mut out = [0u8; 34];
        quantize_block_q8_0(src, &mut out);
        out
    }

    fn scale(block: &[u8; 34]) -> half::f16 {
        half::f16::from_le_bytes([block[0], block[1]])
    }

    fn quants(block: &[u8; 34]) -> Vec<i8> {
        block[2..].iter().map(|&b| b as i8).collect()
    }

    #[test]
    fn zero_blocks_store_zero_scale_and_quants() {
        assert_eq!(quant(&[0.0; 32]), [0; 34]);
        assert_eq!(quant(&[-0.0; 32]), [0; 34]);
    }

    #[test]
    fn ties_round_away_from_zero() {
        // amax 127 gives d = 1 and id = 1 exactly, so x * id is the tie itself.
        let mut x = [0.0f32; 32];
        x[..7].copy_from_slice(&[127.0, 0.5, -0.5, 1.5, -2.5, 126.5, -0.49]);
        let b = quant(&x);
        assert_eq!(scale(&b), half::f16::ONE);
        assert_eq!(&quants(&b)[..7], &[127, 1, -1, 2, -3, 127, 0]);
    }

    #[test]
    fn quants_use_the_f32_scale_not_the_stored_f16_one() {
        // amax = 1.3: d = 1.3 / 127 is not an f16, so the stored scale is off by a relative 2e-4.
        // x = 85.5 * d32 (just above the tie, rounded) rounds to 86 with id = 1 / d32, while
        // x / d16 lands on the other side of the tie.
        let d32 = 1.3f32 / 127.0;
        let d16 = half::f16::from_f32(d32).to_f32();
        let x = 85.5 * d32 * (1.0 + 2e-6);
        assert_eq!((x * (1.0 / d32)).round(), 86.0);
        assert_eq!((x / d16).round(), 85.0, "test premise: f16 rounding moves this element");
        let mut src = [0.0f32; 32];
        src[0] = 1.3;
        src[1] = x;
        assert_eq!(quants(&quant(&src))[1], 86);
    }

    #[test]
    fn nan_poisons_the_block_and_inf_gives_an_infinite_scale() {
        let mut x = [1.0f32; 32];
        x[5] = f32::NAN;
        let b = quant(&x);
        assert_eq!(&b[..2], &F16_NAN);
        assert!(quants(&b).iter().all(|&q| q == 0));
        let mut y = [0.0f32; 32];
        dequantize_block_q8_0(&b, &mut y);
        assert!(y.iter().all(|v| v.is_nan()));

        x[5] = f32::NEG_INFINITY;
        let b = quant(&x);
        assert_eq!(scale(&b), half::f16::INFINITY);
        assert!(quants(&b).iter().all(|&q| q == 0));
    }

    #[test]
    fn subnormal_f32_inputs_give_a_zero_block() {
        // 1 / d overflows to inf; every x * id is inf and stored as 0; d rounds to f16 zero.
        let x = [1e-40f32; 32];
        assert_eq!(quant(&x), [0; 34]);
    }

    #[test]
    fn round_trip_within_half_a_step() {
        let x: [f32; 32] = std::array::from_fn(|i| ((i as f32) * 0.37).sin() * 3.0);
        let b = quant(&x);
        let mut y = [0.0f32; 32];
        dequantize_block_q8_0(&b, &mut y);
        let d16 = scale(&b).to_f32();
        let d32 = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 0.5 * d32 + 127.0 * (d16 - d32).abs() + 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn slice_api_checks_lengths() {
        let src = [0.5f32; 64];
        let mut dst = [0u8; 68];
        assert_eq!(quantize_q8_0(&src, &mut dst), Ok(()));
        let mut back = [0f32; 64];
        assert_eq!(dequantize_q8_0(&dst, &mut back), Ok(()));
        let mut back64 = [0f64; 64];
        assert_eq!(dequantize_q8_0_f64(&dst, &mut back64), Ok(()));
        assert!(back.iter().zip(&back64).all(|(&a, &b)| f64::from(a) == b));

        assert!(quantize_q8_0(&src[..40], &mut dst).is_err(), "partial block");
        assert!(quantize_q8_0(&src, &mut dst[..34]).is_err(), "short destination");
        assert!(dequantize_q8_0(&dst[..67], &mut back).is_err(), "short source");
        assert!(dequantize_q8_0_f64(&dst, &mut back64[..40]).is_err(), "partial block");
    }
}
