//! q8_0 and nvfp4 against fixtures written by `tools/gen_quant_fixtures.py` with the `gguf` Python
//! package (0.19.0): our quantizers must produce the same bytes, our dequantizers the same f32 bits,
//! and the round trip must stay within the formats' error bounds. See
//! `ops/tests/fixtures/quant/README.md` for what each case covers and how to regenerate them.

use tessera_ops::quant::{
    NVFP4_BLOCK, NVFP4_BLOCK_BYTES, NVFP4_SUB_BLOCK, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, dequantize_nvfp4,
    dequantize_nvfp4_f64, dequantize_q8_0, dequantize_q8_0_f64, quantize_nvfp4, quantize_q8_0, ue4m3_to_f32,
};

/// One fixture case: 256 input values and what gguf-py made of them.
struct Case {
    name: &'static str,
    input: &'static [u8],
    q8_0: &'static [u8],
    q8_0_dequant: &'static [u8],
    nvfp4: &'static [u8],
    nvfp4_dequant: &'static [u8],
}

macro_rules! case {
    ($name:literal) => {
        Case {
            name: $name,
            input: include_bytes!(concat!("fixtures/quant/", $name, ".f32.bin")),
            q8_0: include_bytes!(concat!("fixtures/quant/", $name, ".q8_0.bin")),
            q8_0_dequant: include_bytes!(concat!("fixtures/quant/", $name, ".q8_0.dequant.bin")),
            nvfp4: include_bytes!(concat!("fixtures/quant/", $name, ".nvfp4.bin")),
            nvfp4_dequant: include_bytes!(concat!("fixtures/quant/", $name, ".nvfp4.dequant.bin")),
        }
    };
}

const CASES: [Case; 7] = [
    case!("normal"),
    case!("magnitudes"),
    case!("signed_zeros"),
    case!("grid_ties"),
    case!("q8_ties"),
    case!("scale_edges"),
    case!("special"),
];

const N: usize = 256;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Same bits, or both NaN (NaN payloads are not specified by Rust or numpy).
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn assert_same_blocks(case: &str, format: &str, block_bytes: usize, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{case}/{format}: byte count");
    for (i, (g, w)) in got.chunks(block_bytes).zip(want.chunks(block_bytes)).enumerate() {
        assert_eq!(g, w, "{case}/{format}: block {i} differs from gguf-py");
    }
}

fn assert_same_values(case: &str, format: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{case}/{format}: value count");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same_f32(g, w),
            "{case}/{format}: value {i} is {g:e} ({:#010x}), gguf-py has {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn fixtures_have_the_expected_sizes() {
    for c in &CASES {
        assert_eq!(c.input.len(), N * 4, "{}", c.name);
        assert_eq!(c.q8_0.len(), N / Q8_0_BLOCK * Q8_0_BLOCK_BYTES, "{}", c.name);
        assert_eq!(c.q8_0_dequant.len(), N * 4, "{}", c.name);
        assert_eq!(c.nvfp4.len(), N / NVFP4_BLOCK * NVFP4_BLOCK_BYTES, "{}", c.name);
        assert_eq!(c.nvfp4_dequant.len(), N * 4, "{}", c.name);
    }
}

#[test]
fn q8_0_quantize_matches_gguf_bytes() {
    for c in &CASES {
        let mut got = vec![0u8; c.q8_0.len()];
        quantize_q8_0(&f32s(c.input), &mut got).expect("whole blocks");
        assert_same_blocks(c.name, "q8_0", Q8_0_BLOCK_BYTES, &got, c.q8_0);
    }
}

#[test]
fn q8_0_dequantize_matches_gguf_values() {
    for c in &CASES {
        let mut got = vec![0f32; N];
        dequantize_q8_0(c.q8_0, &mut got).expect("whole blocks");
        assert_same_values(c.name, "q8_0", &got, &f32s(c.q8_0_dequant));
    }
}

#[test]
fn nvfp4_quantize_matches_reference_bytes() {
    for c in &CASES {
        let mut got = vec![0u8; c.nvfp4.len()];
        quantize_nvfp4(&f32s(c.input), &mut got).expect("whole blocks");
        assert_same_blocks(c.name, "nvfp4", NVFP4_BLOCK_BYTES, &got, c.nvfp4);
    }
}

#[test]
fn nvfp4_dequantize_matches_gguf_values() {
    for c in &CASES {
        let mut got = vec![0f32; N];
        dequantize_nvfp4(c.nvfp4, &mut got).expect("whole blocks");
        assert_same_values(c.name, "nvfp4", &got, &f32s(c.nvfp4_dequant));
    }
}

#[test]
fn f64_dequantizers_widen_the_f32_values() {
    for c in &CASES {
        let mut wide = vec![0f64; N];
        dequantize_q8_0_f64(c.q8_0, &mut wide).expect("whole blocks");
        for (&w, &v) in wide.iter().zip(&f32s(c.q8_0_dequant)) {
            assert!(w.to_bits() == f64::from(v).to_bits() || (w.is_nan() && v.is_nan()), "{}/q8_0", c.name);
        }
        dequantize_nvfp4_f64(c.nvfp4, &mut wide).expect("whole blocks");
        for (&w, &v) in wide.iter().zip(&f32s(c.nvfp4_dequant)) {
            assert_eq!(w.to_bits(), f64::from(v).to_bits(), "{}/nvfp4", c.name);
        }
    }
}

/// Per element, `|dequant(quant(x)) - x| <= d/2`, with `d = amax / 127` the f32 scale the quants were
/// rounded with, plus what rounding the stored scale to f16 adds: `|q| <= 127` times the f16 error.
/// (A bare `d/2` does not hold: the f16 scale is off by up to a relative 2^-11.) Blocks whose f16
/// scale is not finite dequantize to non-finite values; blocks with a non-finite `1 / d` to zeros.
#[test]
fn q8_0_round_trip_error_is_half_a_step() {
    let mut checked = 0;
    for c in &CASES {
        let x = f32s(c.input);
        let y = f32s(c.q8_0_dequant);
        for (b, (xb, yb)) in x.chunks(Q8_0_BLOCK).zip(y.chunks(Q8_0_BLOCK)).enumerate() {
            let q = &c.q8_0[b * Q8_0_BLOCK_BYTES..(b + 1) * Q8_0_BLOCK_BYTES];
            let d16 = half::f16::from_le_bytes([q[0], q[1]]).to_f32();
            if !d16.is_finite() {
                assert!(yb.iter().all(|v| !v.is_finite()), "{}: block {b} has scale {d16}", c.name);
                continue;
            }
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d32 = amax / 127.0;
            if !(1.0 / d32).is_finite() {
                assert!(yb.iter().all(|&v| v == 0.0), "{}: block {b}", c.name);
                continue;
            }
            let bound = 0.5 * d32 + 127.0 * (d16 - d32).abs() + 4.0 * f32::EPSILON * amax;
            for (i, (&xv, &yv)) in xb.iter().zip(yb).enumerate() {
                let err = (xv - yv).abs();
                assert!(err <= bound, "{}: block {b} element {i}: |{yv:e} - {xv:e}| = {err:e} > {bound:e}", c.name);
            }
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} finite blocks checked");
}

/// Quantizing the dequantized values gives the same bytes back: the amax element always gets
/// `|q| = 127`, so the recovered block has the same scale. (Not for blocks whose scale is not finite
/// or rounded to f16 zero.)
#[test]
fn q8_0_requantizing_the_dequantized_block_is_stable() {
    for c in &CASES {
        let y = f32s(c.q8_0_dequant);
        for (b, yb) in y.chunks(Q8_0_BLOCK).enumerate() {
            let want = &c.q8_0[b * Q8_0_BLOCK_BYTES..(b + 1) * Q8_0_BLOCK_BYTES];
            if yb.iter().any(|v| !v.is_finite()) || yb.iter().all(|&v| v == 0.0) {
                continue;
            }
            let mut got = [0u8; Q8_0_BLOCK_BYTES];
            quantize_q8_0(yb, &mut got).expect("one block");
            assert_eq!(&got[..], want, "{}: block {b}", c.name);
        }
    }
}

/// Half the gap of the E2M1 magnitude grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} around `m` (in units of the
/// sub-block scale).
fn e2m1_half_gap(m: f32) -> f32 {
    if m <= 2.0 {
        0.25
    } else if m <= 4.0 {
        0.5
    } else {
        1.0
    }
}

/// One UE4M3 step at `v`: 2^-9 in the subnormal range, 2^(e-3) for `v` in `[2^e, 2^(e+1))`.
fn ue4m3_step(v: f32) -> f32 {
    if v < 2f32.powi(-6) { 2f32.powi(-9) } else { 2f32.powi(v.log2().floor() as i32 - 3) }
}

/// Per element, the error is at most half the E2M1 grid gap at that magnitude times the sub-block
/// scale `s`. Elements beyond `6 s` (the scale was rounded down) clip to `±6 s`, and the clip is at
/// most 6 UE4M3 steps of `amax / 6`; sub-blocks whose `amax / 6` exceeds 448 saturate and are not
/// bounded. A zero scale code means `amax / 6 < 2^-10` and the sub-block decodes to zeros.
#[test]
fn nvfp4_round_trip_error_is_half_a_grid_step() {
    let mut checked = 0;
    for c in &CASES {
        let x = f32s(c.input);
        let y = f32s(c.nvfp4_dequant);
        for (k, (xs, ys)) in x.chunks(NVFP4_SUB_BLOCK).zip(y.chunks(NVFP4_SUB_BLOCK)).enumerate() {
            if xs.iter().any(|v| !v.is_finite()) {
                continue;
            }
            let code = c.nvfp4[k / 4 * NVFP4_BLOCK_BYTES + k % 4];
            let s = ue4m3_to_f32(code);
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let v = amax / 6.0;
            if code == 0 {
                assert!(v < 2f32.powi(-10), "{}: sub-block {k}: zero scale for amax {amax:e}", c.name);
                assert!(ys.iter().all(|&y| y == 0.0), "{}: sub-block {k}", c.name);
                continue;
            }
            for (i, (&xv, &yv)) in xs.iter().zip(ys).enumerate() {
                let err = (xv - yv).abs();
                if xv.abs() <= 6.0 * s {
                    let bound = e2m1_half_gap(xv.abs() / s) * s * (1.0 + 1e-6);
                    assert!(err <= bound, "{}: sub-block {k} element {i}: |{yv} - {xv}| > {bound:e}", c.name);
                } else {
                    assert_eq!(yv, (6.0 * s).copysign(xv), "{}: sub-block {k} element {i} clips", c.name);
                    if v <= 448.0 {
                        let bound = 6.0 * ue4m3_step(v) * (1.0 + 1e-6);
                        assert!(err <= bound, "{}: sub-block {k} element {i}: clip {err:e} > {bound:e}", c.name);
                    }
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 80, "only {checked} finite sub-blocks checked");
}
