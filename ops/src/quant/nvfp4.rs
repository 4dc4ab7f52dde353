//! nvfp4 (ggml type 40, `GGML_TYPE_NVFP4`): 64 values as four sub-blocks of 16, each with its own
//! UE4M3 scale and 4-bit E2M1 codes.
//!
//! # Block layout (36 bytes; ggml `block_nvfp4`, `src/ggml-common.h:221-227`)
//!
//! | bytes  | content                                                                  |
//! |--------|--------------------------------------------------------------------------|
//! | 0..4   | `d[s]`: the UE4M3 scale of sub-block `s` (elements `16s..16s+16`)        |
//! | 4..36  | `qs`: 8 bytes per sub-block, sub-block `s` at `4 + 8s`                   |
//!
//! Within a sub-block, byte `j` (0..8) holds element `j` in its **low** nibble and element `j + 8` in
//! its **high** nibble (not adjacent pairs). gguf-py's `NVFP4.dequantize_blocks` and ggml's
//! `dequantize_row_nvfp4` (`src/ggml-quants.c:589`) agree. convert_hf_to_gguf.py's `_nvfp4_pack`
//! produces the same order from ModelOpt checkpoints, whose own packing is adjacent pairs
//! (element `2i` low, `2i + 1` high), by regrouping the unpacked nibbles.
//!
//! # Values
//!
//! A value decodes as `e2m1(code) * ue4m3(d[s])`. ggml computes it as
//! `kvalues_fp4[code] * (ue4m3 / 2)` with the E2M1 table doubled to integers ([`E2M1_HALVES`],
//! `src/ggml-common.h:1126`) and the scale decoder returning half the scale
//! (`ggml_ue4m3_to_fp32`, `src/ggml-impl.h:502`); both factors have few significant bits, so every
//! product is exact in f32 and the two formulations agree bit for bit. Code 8 (E2M1's −0) decodes
//! as +0, since the doubled table holds the integer 0.
//!
//! **UE4M3** (unsigned E4M3, bias 7): code `eeeemmm`, value `2^(e-7) * (1 + m/8)` for `e > 0`,
//! `m * 2^-9` for `e == 0`. ggml decodes `0x00` and `0x7F` (E4M3's NaN) as 0 and ignores bit 7
//! otherwise, so `0x80 | c` decodes as `c`, except `0xFF`, which decodes as 480. See
//! [`ue4m3_to_f32`].
//!
//! # Encoding (ggml `quantize_row_nvfp4_ref`, `src/ggml-quants.c:384`)
//!
//! Per sub-block, in f32:
//! 1. `amax = max |x|`, skipping NaN (`if (amax < fabsf(x)) amax = fabsf(x)`);
//! 2. `d[s] = f32_to_ue4m3(amax / 6)` (6 is the largest E2M1 magnitude), see [`f32_to_ue4m3`] for
//!    its rounding (half up, not to even) and its saturation quirks;
//! 3. each element takes the code whose decoded value (with the *decoded* scale) is nearest,
//!    `|e2m1 * scale - x|` computed in f32; on a tie the **lowest code index** wins
//!    (`best_index_mxfp4`, `src/ggml-quants.c:337`, strict `<`). For `x >= 0` that is the smaller
//!    magnitude; for `x < 0` also the smaller magnitude (codes 9..15 run −0.5 .. −6); 0 and −0
//!    (codes 0 and 8) tie and code 0 wins, so negative zeros and small negatives that round to zero
//!    store code 0. Values beyond `6 * scale` clip to ±6 * scale.
//!
//! Non-finite inputs (ggml's behaviour, reproduced): NaN is skipped by `amax` and encodes as code 0
//! (every distance is NaN, so no code beats index 0); `±inf` makes `amax / 6` saturate to scale 448
//! (`0x7E`) and itself encodes as code 0 (every distance is inf). An all-zero sub-block, and any
//! sub-block with `amax / 6 < 2^-10`, stores scale `0x00` and all-zero codes.
//!
//! gguf 0.19.0 can dequantize NVFP4 but not quantize it, so the fixtures' quantized bytes come from
//! `tools/gen_quant_fixtures.py`'s restatement of ggml's C reference, checked against that C code.
//! NVFP4 tensors converted from ModelOpt checkpoints keep the checkpoint's own scale bytes (sign bit
//! cleared), which may use the exponent-15 codes `0x78..=0x7D` that [`f32_to_ue4m3`] never produces.
//!
//! # The per-tensor scale
//!
//! See the [module docs](super) (`weight_scale_2`, stored as `<name>.scale`).

use super::{QuantError, check_lengths};

/// Values per nvfp4 block (ggml `QK_NVFP4`).
pub const NVFP4_BLOCK: usize = 64;
/// Values per nvfp4 sub-block, the unit that shares one UE4M3 scale (ggml `QK_NVFP4_SUB`).
pub const NVFP4_SUB_BLOCK: usize = 16;
/// Bytes per nvfp4 block: 4 UE4M3 scales then 32 bytes of packed E2M1 codes.
pub const NVFP4_BLOCK_BYTES: usize = 36;

const NAME: &str = "nvfp4";
const SUBS: usize = NVFP4_BLOCK / NVFP4_SUB_BLOCK;
const HALF_SUB: usize = NVFP4_SUB_BLOCK / 2;

/// The 16 E2M1 values in units of 0.5, indexed by 4-bit code (ggml's `kvalues_fp4`): codes 0..8 are
/// `0, 0.5, 1, 1.5, 2, 3, 4, 6`, codes 8..16 the same negated (code 8, E2M1's −0, is held as 0).
pub const E2M1_HALVES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The E2M1 value of the low nibble of `code`, as ggml decodes it (code 8 gives +0).
pub fn e2m1_to_f32(code: u8) -> f32 {
    f32::from(E2M1_HALVES[usize::from(code & 0x0F)]) * 0.5
}

/// `2^e` for `e` in the normal f32 exponent range.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Decodes a UE4M3 scale byte as ggml does (`ggml_ue4m3_to_fp32` times 2, i.e. the real scale).
///
/// `0x00` and `0x7F` decode as 0; bit 7 is ignored, so `0x80 | c` decodes as `c` except `0xFF`,
/// which decodes as `2^8 * 1.875 = 480`. The largest value [`f32_to_ue4m3`] produces is `0x7E` = 448.
pub fn ue4m3_to_f32(code: u8) -> f32 {
    if code == 0 || code == 0x7F {
        return 0.0;
    }
    let exp = i32::from((code >> 3) & 0x0F);
    let man = f32::from(code & 0x07);
    if exp == 0 { man * pow2(-9) } else { (8.0 + man) * pow2(exp - 10) }
}

/// Encodes a non-negative scale as UE4M3, bit-exactly as ggml's `ggml_fp32_to_ue4m3`
/// (`src/ggml-impl.h:517`):
///
/// - `x <= 0` and NaN give `0x00`; `x > 448` is first clamped to 448.
/// - Normal range (`x >= 2^-6`): the f32 mantissa is cut to 3 bits and rounded **half up** by adding
///   the first dropped bit (ties go away from zero, not to even).
/// - Exponent 15 is treated as overflow: any `x >= 256`, or a value that rounds up to 256, gives
///   `0x7E` (448). Codes `0x78..=0x7D` (256..416) are never produced.
/// - Subnormal range (`x < 2^-6`): mantissa `(x * 512 + 0.5) as i32` in f32 arithmetic (half up),
///   capped at 7, so `[7.5, 8) * 2^-9` gives 7 rather than rounding up to `2^-6`; below `2^-10` gives 0.
pub fn f32_to_ue4m3(x: f32) -> u8 {
    // Zero, negatives and NaN (C's `!(x > 0.0f)`).
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(448.0);
    let bits = x.to_bits();
    let mut exp = ((bits >> 23) & 0xFF) as i32 - 127 + 7;
    if exp <= 0 {
        // Truncation toward zero of a positive value, as C's `(int)`; at most 8, so no saturation.
        let man = (x * 512.0 + 0.5) as i32;
        return man.clamp(0, 7) as u8;
    }
    if exp >= 15 {
        return 0x7E;
    }
    let mut man = ((bits >> 20) & 0x07) + ((bits >> 19) & 1);
    if man > 7 {
        man = 0;
        exp += 1;
        if exp >= 15 {
            return 0x7E;
        }
    }
    ((exp as u32) << 3 | man) as u8
}

/// The code whose value `E2M1_HALVES[i] * d_half` is nearest to `x` (lowest index on ties),
/// as ggml's `best_index_mxfp4`. `d_half` is half the decoded sub-block scale.
fn nearest_e2m1(x: f32, d_half: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (f32::from(E2M1_HALVES[0]) * d_half - x).abs();
    for (i, &k) in E2M1_HALVES.iter().enumerate().skip(1) {
        let err = (f32::from(k) * d_half - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// Quantizes one block of 64 values. See the module docs for the layout and rounding.
pub fn quantize_block_nvfp4(src: &[f32; NVFP4_BLOCK], dst: &mut [u8; NVFP4_BLOCK_BYTES]) {
    let (subs, _) = src.as_chunks::<NVFP4_SUB_BLOCK>();
    for (s, xs) in subs.iter().enumerate() {
        // NaN-skipping max: `amax < NaN` is false.
        let amax = xs.iter().fold(0.0f32, |amax, &x| if amax < x.abs() { x.abs() } else { amax });
        let code = f32_to_ue4m3(amax / 6.0);
        dst[s] = code;
        let d_half = ue4m3_to_f32(code) * 0.5;
        let qs = &mut dst[SUBS + s * HALF_SUB..SUBS + (s + 1) * HALF_SUB];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = nearest_e2m1(xs[j], d_half) | nearest_e2m1(xs[j + HALF_SUB], d_half) << 4;
        }
    }
}

/// Dequantizes one block, bit-exactly as ggml's `dequantize_row_nvfp4`.
pub fn dequantize_block_nvfp4(src: &[u8; NVFP4_BLOCK_BYTES], dst: &mut [f32; NVFP4_BLOCK]) {
    let (subs, _) = dst.as_chunks_mut::<NVFP4_SUB_BLOCK>();
    for (s, ys) in subs.iter_mut().enumerate() {
        let d_half = ue4m3_to_f32(src[s]) * 0.5;
        let qs = &src[SUBS + s * HALF_SUB..SUBS + (s + 1) * HALF_SUB];
        for (j, &q) in qs.iter().enumerate() {
            ys[j] = f32::from(E2M1_HALVES[usize::from(q & 0x0F)]) * d_half;
            ys[j + HALF_SUB] = f32::from(E2M1_HALVES[usize::from(q >> 4)]) * d_half;
        }
    }
}

/// Quantizes `src` (a whole number of 64-value blocks) into `dst` (36 bytes per block).
///
/// # Errors
/// [`QuantError`] when `src.len()` is not a multiple of [`NVFP4_BLOCK`] or `dst` is not exactly
/// `src.len() / 64 * 36` bytes; nothing is written then.
pub fn quantize_nvfp4(src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_lengths(NAME, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, src.len(), dst.len())?;
    let (src_blocks, _) = src.as_chunks::<NVFP4_BLOCK>();
    let (dst_blocks, _) = dst.as_chunks_mut::<NVFP4_BLOCK_BYTES>();
    for (x, y) in src_blocks.iter().zip(dst_blocks) {
        quantize_block_nvfp4(x, y);
    }
    Ok(())
}

/// Dequantizes `src` (36 bytes per block) into `dst` (64 values per block). The per-tensor scale,
/// if the tensor has one, is not applied (see the [module docs](super)).
///
/// # Errors
/// [`QuantError`] when `dst.len()` is not a multiple of [`NVFP4_BLOCK`] or `src` is not exactly
/// `dst.len() / 64 * 36` bytes; nothing is written then.
pub fn dequantize_nvfp4(src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(NAME, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, dst.len(), src.len())?;
    let (src_blocks, _) = src.as_chunks::<NVFP4_BLOCK_BYTES>();
    let (dst_blocks, _) = dst.as_chunks_mut::<NVFP4_BLOCK>();
    for (x, y) in src_blocks.iter().zip(dst_blocks) {
        dequantize_block_nvfp4(x, y);
    }
    Ok(())
}

/// [`dequantize_nvfp4`] into f64, for the f64 reference. Every value equals the f32 result widened
/// (each product has at most 7 significant bits).
///
/// # Errors
/// As [`dequantize_nvfp4`].
pub fn dequantize_nvfp4_f64(src: &[u8], dst: &mut [f64]) -> Result<(), QuantError> {
    check_lengths(NAME, NVFP4_BLOCK, NVFP4_BLOCK_BYTES, dst.len(), src.len())?;
    let mut block = [0f32; NVFP4_BLOCK];
    let (src_blocks, _) = src.as_chunks::<NVFP4_BLOCK_BYTES>();
    for (x, y) in src_blocks.iter().zip(dst.chunks_exact_mut(NVFP4_BLOCK)) {
        dequantize_block_nvfp4(x, &mut block);
        for (o, &v) in y.iter_mut().zip(&block) {
            *o = f64::from(v);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(src: &[f32; 64]) -> [u8; 36] {
        let mut out = [0u8; 36];
        quantize_block_nvfp4(src, &mut out);
        out
    }

    fn dequant(src: &[u8; 36]) -> [f32; 64] {
        let mut out = [0f32; 64];
        dequantize_block_nvfp4(src, &mut out);
        out
    }

    #[test]
    fn e2m1_table() {
        let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for (code, &w) in want.iter().enumerate() {
            assert_eq!(e2m1_to_f32(code as u8), w);
            assert_eq!(e2m1_to_f32(code as u8 + 8), -w);
        }
        assert_eq!(e2m1_to_f32(8).to_bits(), 0.0f32.to_bits(), "E2M1's -0 decodes as +0, as in ggml");
        assert_eq!(e2m1_to_f32(0xF7), 6.0, "only the low nibble is read");
    }

    /// The UE4M3 value of a code in `0..=0x7E`, from the format definition (independent of the
    /// implementation under test).
    fn ue4m3_reference(code: u8) -> f64 {
        let (e, m) = (i32::from(code >> 3), f64::from(code & 7));
        if e == 0 { m * 2f64.powi(-9) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) }
    }

    #[test]
    fn ue4m3_decodes_all_256_codes() {
        for code in 0..=255u8 {
            let got = f64::from(ue4m3_to_f32(code));
            let want = match code {
                0x7F | 0x80 => 0.0,
                0xFF => 480.0,
                c => ue4m3_reference(c & 0x7F),
            };
            assert_eq!(got, want, "code {code:#04x}");
        }
        assert_eq!(ue4m3_to_f32(0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(ue4m3_to_f32(0x08), 2f32.powi(-6), "smallest normal");
        assert_eq!(ue4m3_to_f32(0x38), 1.0);
        assert_eq!(ue4m3_to_f32(0x7E), 448.0);
    }

    #[test]
    fn ue4m3_encode_decode_round_trip_over_all_codes() {
        for code in 0..=255u8 {
            let back = f32_to_ue4m3(ue4m3_to_f32(code));
            let want = match code {
                0x7F | 0x80 => 0,    // decode to 0
                0x78..=0x7D => 0x7E, // exponent 15 saturates to 448
                0xF8..=0xFF => 0x7E, // likewise (bit 7 ignored; 0xFF is 480, clamped)
                c => c & 0x7F,
            };
            assert_eq!(back, want, "code {code:#04x}");
        }
    }

    #[test]
    fn ue4m3_rounding() {
        assert_eq!(f32_to_ue4m3(1.0625), 0x39, "tie 1 .. 1.125 rounds up");
        assert_eq!(f32_to_ue4m3(1.0624999), 0x38);
        assert_eq!(f32_to_ue4m3(1.1875), 0x3A, "tie 1.125 .. 1.25 rounds up too, not to even");
        assert_eq!(f32_to_ue4m3(1.96875), 0x40, "mantissa carry into the exponent: 2.0");
        assert_eq!(f32_to_ue4m3(240.0), 0x77);
        assert_eq!(f32_to_ue4m3(248.0), 0x7E, "rounds into exponent 15: saturates");
        assert_eq!(f32_to_ue4m3(256.0), 0x7E);
        assert_eq!(f32_to_ue4m3(1e30), 0x7E);
        assert_eq!(f32_to_ue4m3(f32::INFINITY), 0x7E);
        assert_eq!(f32_to_ue4m3(1.5 / 512.0), 2, "subnormal tie rounds up");
        assert_eq!(f32_to_ue4m3(7.75 / 512.0), 7, "subnormal mantissa caps at 7");
        assert_eq!(f32_to_ue4m3(0.5 / 512.0), 1);
        assert_eq!(f32_to_ue4m3(0.49 / 512.0), 0);
        assert_eq!(f32_to_ue4m3(0.0), 0);
        assert_eq!(f32_to_ue4m3(-1.0), 0);
        assert_eq!(f32_to_ue4m3(f32::NAN), 0);
        assert_eq!(f32_to_ue4m3(f32::from_bits(1)), 0, "f32 subnormal");
    }

    #[test]
    fn layout_scales_first_then_low_nibble_j_high_nibble_j_plus_8() {
        // Sub-block 0: amax 6 gives scale 1.0 (0x38), so values are their own E2M1 codes.
        let mut x = [0.0f32; 64];
        x[0] = 6.0; // code 7
        x[8] = -6.0; // code 15
        x[1] = 0.5; // code 1
        x[9] = 1.5; // code 3
        // Sub-block 2 (elements 32..48): amax 12 gives scale 2.0 (0x40).
        x[32 + 7] = -12.0; // code 15
        x[32 + 15] = 3.0; // 1.5 * 2: code 3
        let b = quant(&x);
        assert_eq!(&b[..4], &[0x38, 0x00, 0x40, 0x00]);
        assert_eq!(b[4], 0xF7, "element 0 low, element 8 high");
        assert_eq!(b[5], 0x31, "element 1 low, element 9 high");
        assert!(b[6..12].iter().all(|&q| q == 0));
        assert_eq!(b[4 + 16 + 7], 0x3F, "sub-block 2 at byte 20: element 7 low, element 15 high");
        assert_eq!(dequant(&b), x.map(|v| if v == 0.0 { 0.0 } else { v }));
    }

    #[test]
    fn ties_take_the_smaller_magnitude() {
        let mut x = [0.0f32; 64];
        let ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
        for (i, &t) in ties.iter().enumerate() {
            x[i] = t;
            x[i + 8] = -t;
        }
        let y = dequant(&quant(&x));
        let want = [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0];
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(y[i], w, "element {i}");
            assert_eq!(y[i + 8], if w == 0.0 { 0.0 } else { -w }, "element {}", i + 8);
        }
    }

    #[test]
    fn zeros_and_negative_zeros_store_code_zero() {
        assert_eq!(quant(&[0.0; 64]), [0; 36]);
        assert_eq!(quant(&[-0.0; 64]), [0; 36]);
        let mut x = [-0.0f32; 64];
        x[0] = 6.0;
        x[1] = -0.2; // rounds to zero: code 0, not code 8
        let b = quant(&x);
        assert_eq!(b[4], 0x07);
        assert_eq!(b[5], 0x00);
    }

    #[test]
    fn nan_is_skipped_and_inf_saturates_the_scale() {
        let mut x = [0.0f32; 64];
        x[0] = f32::NAN;
        x[1] = 6.0;
        x[16] = f32::INFINITY;
        x[17] = 224.0;
        let b = quant(&x);
        assert_eq!(b[0], 0x38, "NaN does not enter amax");
        assert_eq!(b[4], 0x00, "NaN (element 0) stores code 0");
        assert_eq!(b[5], 0x07, "element 1");
        assert_eq!(b[1], 0x7E, "inf saturates the scale to 448");
        let y = dequant(&b);
        assert_eq!((y[0], y[1], y[16], y[17]), (0.0, 6.0, 0.0, 224.0));
    }

    #[test]
    fn round_trip_within_half_a_grid_step() {
        let x: [f32; 64] = std::array::from_fn(|i| ((i as f32) * 0.61).sin() * 5.0);
        let b = quant(&x);
        let y = dequant(&b);
        for (s, &code) in b[..4].iter().enumerate() {
            let scale = ue4m3_to_f32(code);
            for (xi, yi) in x[16 * s..16 * (s + 1)].iter().zip(&y[16 * s..16 * (s + 1)]) {
                // The widest gap of the E2M1 grid is 2 (between 4 and 6): half of it is 1.
                assert!((xi - yi).abs() <= scale * 1.0001, "{xi} vs {yi}");
            }
        }
    }

    #[test]
    fn slice_api_checks_lengths() {
        let src = [0.75f32; 128]; // 0.75 / 6 = 0.125 is a UE4M3 value: exact round trip
        let mut dst = [0u8; 72];
        assert_eq!(quantize_nvfp4(&src, &mut dst), Ok(()));
        let mut back = [0f32; 128];
        assert_eq!(dequantize_nvfp4(&dst, &mut back), Ok(()));
        assert_eq!(back, src);
        let mut back64 = [0f64; 128];
        assert_eq!(dequantize_nvfp4_f64(&dst, &mut back64), Ok(()));
        assert!(back64.iter().all(|&v| v == 0.75));

        assert!(quantize_nvfp4(&src[..96], &mut dst[..54]).is_err(), "partial block");
        assert!(quantize_nvfp4(&src, &mut dst[..36]).is_err(), "short destination");
        assert!(dequantize_nvfp4(&dst[..71], &mut back).is_err(), "short source");
    }
}
