//! Vectorisable f32 math for the elementwise and softmax kernels: `exp`, `sigmoid`, `silu`, and
//! slice loops ([`map`], [`map_in_place`], [`zip`], [`zip_in_place`]) compiled twice, for the
//! x86-64 baseline (SSE2, 4 lanes) and for AVX2 (8 lanes), the latter picked at run time. Both
//! versions do the same IEEE operations in the same order (no FMA contraction), so results are
//! bit-identical whichever runs.
//!
//! libm's `expf` is a function call the compiler cannot vectorise, which made `silu` and
//! `softmax` 10x slower than memory bandwidth. [`exp`] here is branch-free arithmetic (Cephes'
//! `expf` polynomial after a Cody-Waite range reduction, the same scheme ggml's SIMD exp uses), so
//! loops over it vectorise; its error is about 1 ulp over the whole range (tested against f64
//! below). Overflow gives `inf`, underflow `0` (through subnormals), NaN stays NaN.

/// `1.5 * 2^23`: adding it rounds an f32 of magnitude below `2^22` to an integer (round to
/// nearest even) without a rounding instruction (x86-64's baseline SSE2 has none).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x` in f32, about 1 ulp.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // Past these bounds the result is inf / 0 anyway; clamping keeps n in range. NaN passes.
    let x = x.clamp(-104.0, 89.0);
    // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two so n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let t = x * std::f32::consts::LOG2_E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    // e^r on [-ln2/2, ln2/2] (Cephes expf coefficients).
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * r * r + r + 1.0;
    // y * 2^n in two steps, so n in [-150, 128] never leaves the exponent range of one factor.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni - n1;
    y * pow2(n1) * pow2(n2)
}

/// `2^n` for `n` in `[-126, 127]`.
#[inline(always)]
fn pow2(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

/// `1 / (1 + e^-x)` without overflow: with `e = e^-|x|` (never above 1), `1 / (1 + e)` for
/// `x >= 0` and `e / (1 + e)` otherwise. Branch-free, so it vectorises.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 { s } else { e * s }
}

/// `x * sigmoid(x)`: finite for every finite `x` (no `inf / inf`).
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `out[i] = f(xs[i])` over the common length.
pub(crate) fn map(out: &mut [f32], xs: &[f32], f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { x86::map(out, xs, &f) };
    }
    map_plain(out, xs, &f)
}

/// `v[i] = f(v[i])`.
pub(crate) fn map_in_place(v: &mut [f32], f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { x86::map_in_place(v, &f) };
    }
    map_in_place_plain(v, &f)
}

/// `out[i] = f(a[i], b[i])` over the common length.
pub(crate) fn zip(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { x86::zip(out, a, b, &f) };
    }
    zip_plain(out, a, b, &f)
}

/// `out[i] = f(out[i], b[i])` over the common length.
pub(crate) fn zip_in_place(out: &mut [f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { x86::zip_in_place(out, b, &f) };
    }
    zip_in_place_plain(out, b, &f)
}

#[inline(always)]
fn map_plain(out: &mut [f32], xs: &[f32], f: &impl Fn(f32) -> f32) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = f(x);
    }
}

#[inline(always)]
fn map_in_place_plain(v: &mut [f32], f: &impl Fn(f32) -> f32) {
    for x in v.iter_mut() {
        *x = f(*x);
    }
}

#[inline(always)]
fn zip_plain(out: &mut [f32], a: &[f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[inline(always)]
fn zip_in_place_plain(out: &mut [f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    for (o, &y) in out.iter_mut().zip(b) {
        *o = f(*o, y);
    }
}

/// The same loops compiled with AVX2; the closures inline into them.
#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx2")]
    pub(super) fn map<F: Fn(f32) -> f32>(out: &mut [f32], xs: &[f32], f: &F) {
        super::map_plain(out, xs, f)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn map_in_place<F: Fn(f32) -> f32>(v: &mut [f32], f: &F) {
        super::map_in_place_plain(v, f)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn zip<F: Fn(f32, f32) -> f32>(out: &mut [f32], a: &[f32], b: &[f32], f: &F) {
        super::zip_plain(out, a, b, f)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn zip_in_place<F: Fn(f32, f32) -> f32>(out: &mut [f32], b: &[f32], f: &F) {
        super::zip_in_place_plain(out, b, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units of the last place of `want` (rounded to f32).
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.to_bits() + 1) - w).abs() as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulps_over_its_range() {
        let mut worst: f64 = 0.0;
        let mut x = -87.0f32;
        while x < 88.5 {
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(88.7).is_finite());
        // subnormal results keep their magnitude
        let sub = exp(-95.0) as f64;
        assert!((sub - (-95f64).exp()).abs() <= 1.5e-45, "{sub}");
    }

    #[test]
    fn dispatched_loops_match_the_plain_ones_bit_for_bit() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.173).collect();
        let y: Vec<f32> = x.iter().map(|v| v * 0.5 - 1.0).collect();
        let (mut got, mut want) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        map(&mut got, &x, silu);
        map_plain(&mut want, &x, &silu);
        assert_eq!(got, want);
        zip(&mut got, &x, &y, |a, b| silu(a) * b);
        zip_plain(&mut want, &x, &y, &|a, b| silu(a) * b);
        assert_eq!(got, want);
        map_in_place(&mut got, exp);
        map_in_place_plain(&mut want, &exp);
        assert_eq!(got, want);
        zip_in_place(&mut got, &y, |a, b| a / b);
        zip_in_place_plain(&mut want, &y, &|a, b| a / b);
        assert_eq!(got, want);
    }

    #[test]
    fn sigmoid_and_silu_are_stable() {
        for x in [-1000.0f32, -90.0, -20.0, -1.0, 0.0, 1.0, 20.0, 90.0, 1000.0] {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            // (e^-90 is subnormal in f32: allow its absolute rounding too)
            assert!((sigmoid(x) as f64 - want).abs() <= 2e-7 * want + 1e-44, "sigmoid({x})");
            assert!(silu(x).is_finite(), "silu({x})");
        }
        assert!(sigmoid(f32::NAN).is_nan());
    }
}
