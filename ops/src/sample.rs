//! Token sampling as an exact function of f32 logits, per-row settings and one uniform draw `u`:
//! the rule `Op::Sample` computes, the host sampler of `tessera-models` calls, and the CPU backend
//! runs. The CUDA kernels (`backend-cuda/kernels/sample.cu`) compute the same integers, so every
//! backend picks the same token bit for bit. `docs/OPS.md` (`sample`) states the rule; in short:
//!
//! 1. `max` is the largest logit that is not NaN (NaN logits are never picked; a row of NaNs has
//!    no pick). Greedy (`temperature == 0` or `top_k == 1`): the first index holding `max`.
//! 2. Each logit `l` weighs `q(l) = trunc(exp((l - max) / temperature) · 2^40)` (an integer;
//!    `2^40` when `l == max`, so infinite logits are well defined), computed by [`mass`] with f32
//!    operations in a fixed order (its own `exp`), which the CUDA kernel repeats exactly.
//! 3. Rank order: larger logit first, lower index first among equal logits ([`rank`]). `top_k`
//!    keeps the first `k` ranks (0 keeps all). `top_p < 1` keeps the shortest rank prefix of that
//!    set whose mass reaches `ceil(top_p · W_k)`, `W_k` the mass of the top-k set.
//! 4. With `W` the kept mass, the pick is the kept index `i`, in **index order**, at which the
//!    running mass first exceeds `floor(u · W)`: a draw from the kept tokens in proportion to
//!    their weights, without sorting the vocabulary.
//!
//! All sums are exact (u64: rows are shorter than 2^24, so `n · 2^40 < 2^64`), so the order a
//! backend adds in cannot move a pick. The f64 reference (`reference::sample_accepts`) states the
//! same rule with real numbers.

use std::fmt;

/// Longest row of logits: `n · 2^40` must fit in a u64 (TAG(sample-limits) in sample.cu).
pub const MAX_VOCAB: usize = (1 << 24) - 1;

/// Largest `top_k` (any `k >= n_vocab` keeps every token); an exact integer in f32.
pub const MAX_TOP_K: u32 = 1 << 24;

/// The mass of the largest logit: `q(max) = 2^40`.
pub const MASS_ONE: u64 = 1 << MASS_BITS;

/// Fixed-point bits of a mass.
pub const MASS_BITS: u32 = 40;

// exp's constants, by their bits, shared with sample.cu: TAG(sample-exp).
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// `1/k!` for k = 2..=7.
const C: [f32; 6] = [
    f32::from_bits(0x3f00_0000),
    f32::from_bits(0x3e2a_aaab),
    f32::from_bits(0x3d2a_aaab),
    f32::from_bits(0x3c08_8889),
    f32::from_bits(0x3ab6_0b61),
    f32::from_bits(0x3950_0d01),
];

/// `trunc(e^x · 2^40)` for `x <= 0`, with f32 operations in a fixed order (no contraction: each
/// fused multiply-add is explicit), so the CUDA kernel's copy gives the same bits. Relative error
/// about 2e-7; 0 below `x = -32` (where the true value is below 2^-6).
fn exp_mass(x: f32) -> u64 {
    // NaN and -inf fail too.
    if x.is_nan() || x < -32.0 {
        return 0;
    }
    // x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite: n · LN2_HI is exact for |n| < 2^11).
    let n = (x * LOG2E + 0.5).floor();
    if n < -(MASS_BITS as f32) {
        return 0;
    }
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    // e^r by its Taylor polynomial of degree 7 (error below 6e-9 on |r| <= 0.35).
    let mut p = C[5];
    for &c in C[..5].iter().rev() {
        p = p.mul_add(r, c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // p · 2^(n + 40) with n + 40 in 0..=40: a power-of-two scaling, exact.
    let scale = f32::from_bits(((n as i32 + MASS_BITS as i32 + 127) as u32) << 23);
    (p * scale) as u64
}

/// The mass `q` of a logit `l` (not NaN) in a row whose largest logit is `max`, at temperature
/// `t > 0`: `2^40` when `l == max`, else `trunc(exp((l - max) / t) · 2^40)`.
pub fn mass(l: f32, max: f32, t: f32) -> u64 {
    if l == max {
        return MASS_ONE;
    }
    exp_mass((l - max) / t)
}

/// An order-preserving u32 of a float that is not NaN (`-0.0` and `0.0` equal).
pub fn order_key(l: f32) -> u32 {
    let b = (l + 0.0).to_bits();
    b ^ (((b as i32 >> 31) as u32) | 0x8000_0000)
}

/// Rank of logit `l` at index `i`: smaller ranks come first (larger logit, then lower index).
pub fn rank(l: f32, i: usize) -> u64 {
    (u64::from(!order_key(l)) << 32) | i as u64
}

/// `v = m · 2^-e` for a float `v` in `[0, 1]` (`m < 2^24`).
fn split(v: f32) -> (u64, u32) {
    let bits = v.to_bits();
    let (exp, frac) = (bits >> 23, u64::from(bits & 0x7f_ffff));
    if exp == 0 { (frac, 149) } else { (frac | 1 << 23, 150 - exp) }
}

/// `floor(w · v)` exactly, for `v` in `[0, 1]`.
pub fn mul_floor(w: u64, v: f32) -> u64 {
    let (m, e) = split(v);
    (u128::from(w) * u128::from(m)).checked_shr(e).unwrap_or(0) as u64
}

/// `ceil(w · v)` exactly, for `v` in `[0, 1]`.
pub fn mul_ceil(w: u64, v: f32) -> u64 {
    let (m, e) = split(v);
    let prod = u128::from(w) * u128::from(m);
    let floor = prod.checked_shr(e).unwrap_or(0) as u64;
    let exact = if e >= 128 { prod == 0 } else { prod & ((1u128 << e) - 1) == 0 };
    floor + u64::from(!exact)
}

/// A value of a sample row that is out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleField {
    Temperature,
    TopK,
    TopP,
    U,
    /// Every logit of the row is NaN.
    Logits,
}

impl SampleField {
    /// The name used in errors.
    pub const fn name(self) -> &'static str {
        match self {
            SampleField::Temperature => "temperature",
            SampleField::TopK => "top_k",
            SampleField::TopP => "top_p",
            SampleField::U => "u",
            SampleField::Logits => "every logit",
        }
    }

    /// What the value should have been.
    pub const fn expected(self) -> &'static str {
        match self {
            SampleField::Temperature => "finite and >= 0",
            SampleField::TopK => "an integer in 0..=16777216 (0 keeps every token)",
            SampleField::TopP => "in (0, 1]",
            SampleField::U => "in [0, 1)",
            SampleField::Logits => "at least one logit that is not NaN",
        }
    }

    /// The code device kernels report it by (`WHAT_SAMPLE_*` in kernels/common.cuh):
    /// TAG(sample-fields).
    pub const fn code(self) -> u32 {
        match self {
            SampleField::Temperature => 16,
            SampleField::TopK => 17,
            SampleField::TopP => 18,
            SampleField::U => 19,
            SampleField::Logits => 20,
        }
    }

    /// The field of a device code.
    pub fn from_code(code: u32) -> Option<SampleField> {
        [SampleField::Temperature, SampleField::TopK, SampleField::TopP, SampleField::U, SampleField::Logits]
            .into_iter()
            .find(|f| f.code() == code)
    }
}

/// An out-of-range setting (or a row of NaN logits) and its value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BadSetting {
    pub field: SampleField,
    pub value: f32,
}

impl fmt::Display for BadSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is {}, expected {}", self.field.name(), self.value, self.field.expected())
    }
}

impl std::error::Error for BadSetting {}

/// Validated settings of one row: temperature (0: greedy), top-k (0: all), top-p (1: all), and
/// the uniform draw `u`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSettings {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    u: f32,
}

impl SampleSettings {
    /// Checks, in this order: `temperature` finite and >= 0, `top_k <= 2^24`, `top_p` in (0, 1],
    /// `u` in [0, 1).
    pub fn new(temperature: f32, top_k: u32, top_p: f32, u: f32) -> Result<SampleSettings, BadSetting> {
        let bad = |field, value| Err(BadSetting { field, value });
        if !(temperature.is_finite() && temperature >= 0.0) {
            return bad(SampleField::Temperature, temperature);
        }
        if top_k > MAX_TOP_K {
            return bad(SampleField::TopK, top_k as f32);
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad(SampleField::TopP, top_p);
        }
        if !(0.0..1.0).contains(&u) {
            return bad(SampleField::U, u);
        }
        Ok(SampleSettings { temperature, top_k, top_p, u })
    }

    /// Greedy settings (`u` is not used).
    pub fn greedy() -> SampleSettings {
        SampleSettings { temperature: 0.0, top_k: 0, top_p: 1.0, u: 0.0 }
    }

    /// One row of the op's settings tensor, `(temperature, top_k, top_p, u)`; `top_k` must be an
    /// integer-valued float in `0..=2^24`.
    pub fn from_row(row: [f32; 4]) -> Result<SampleSettings, BadSetting> {
        let [t, k, p, u] = row;
        if !(t.is_finite() && t >= 0.0) {
            return Err(BadSetting { field: SampleField::Temperature, value: t });
        }
        if !(k >= 0.0 && k <= MAX_TOP_K as f32 && k.fract() == 0.0) {
            return Err(BadSetting { field: SampleField::TopK, value: k });
        }
        SampleSettings::new(t, k as u32, p, u)
    }

    /// The row of the op's settings tensor that holds these settings.
    pub fn to_row(&self) -> [f32; 4] {
        [self.temperature, self.top_k as f32, self.top_p, self.u]
    }

    /// The same settings with another draw (`u` in [0, 1)).
    pub fn with_u(self, u: f32) -> Result<SampleSettings, BadSetting> {
        SampleSettings::new(self.temperature, self.top_k, self.top_p, u)
    }

    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    pub fn top_k(&self) -> u32 {
        self.top_k
    }

    pub fn top_p(&self) -> f32 {
        self.top_p
    }

    pub fn u(&self) -> f32 {
        self.u
    }

    /// Temperature 0 or top-k 1: the pick is the argmax and `u` is not used.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// The first index of the largest logit that is not NaN, that logit, and how many are not NaN.
fn argmax(logits: &[f32]) -> Option<(usize, f32, usize)> {
    let mut best: Option<(usize, f32)> = None;
    let mut valid = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        valid += 1;
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, l)| (i, l, valid))
}

/// The token picked from `logits` (see the module doc); `None` when every logit is NaN (or there
/// are none).
///
/// # Panics
/// When `logits` is longer than [`MAX_VOCAB`].
pub fn sample(logits: &[f32], s: &SampleSettings) -> Option<u32> {
    assert!(logits.len() <= MAX_VOCAB, "sample: {} logits, at most {MAX_VOCAB}", logits.len());
    let (arg, max, n_valid) = argmax(logits)?;
    if s.is_greedy() {
        return Some(arg as u32);
    }
    let t = s.temperature;
    let q: Vec<u64> = logits.iter().map(|&l| if l.is_nan() { 0 } else { mass(l, max, t) }).collect();
    let k = s.top_k as usize;
    let k = if k == 0 || k >= n_valid { n_valid } else { k };
    let cut = (k < n_valid || s.top_p < 1.0).then(|| last_kept(logits, &q, k, s.top_p));
    let kept = |i: usize, l: f32| !l.is_nan() && cut.is_none_or(|c| rank(l, i) <= c);
    let total: u64 = logits.iter().enumerate().filter(|&(i, &l)| kept(i, l)).map(|(i, _)| q[i]).sum();
    let target = mul_floor(total, s.u);
    let mut acc = 0u64;
    for (i, &l) in logits.iter().enumerate() {
        if kept(i, l) {
            acc += q[i];
            if acc > target {
                return Some(i as u32);
            }
        }
    }
    // `target < total` (u < 1) and the largest logit is always kept with mass 2^40.
    debug_assert!(false, "sample: the running mass never passed the target");
    Some(arg as u32)
}

/// The rank of the last kept token: the `k`-th rank (of the tokens that are not NaN), or, when
/// `top_p < 1`, the first rank at which the running mass in rank order reaches
/// `ceil(top_p · W_k)`, whichever comes first.
fn last_kept(logits: &[f32], q: &[u64], k: usize, top_p: f32) -> u64 {
    let mut cand: Vec<(u64, u64)> =
        logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (rank(l, i), q[i])).collect();
    if k < cand.len() {
        cand.select_nth_unstable(k - 1);
        cand.truncate(k);
    }
    if top_p >= 1.0 {
        return cand.iter().map(|c| c.0).max().unwrap_or(0);
    }
    let w_k: u64 = cand.iter().map(|c| c.1).sum();
    mass_cut(&mut cand, mul_ceil(w_k, top_p))
}

/// The rank at which the running mass of `c` in rank order first reaches `need` (`1 <= need <=`
/// the total): a quickselect on the mass, expected linear time.
fn mass_cut(c: &mut [(u64, u64)], need: u64) -> u64 {
    // c[..lo] holds the lo smallest ranks, of mass acc < need; the answer lies in c[lo..hi].
    let (mut lo, mut hi, mut acc) = (0, c.len(), 0u64);
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        c[lo..hi].select_nth_unstable(mid - lo);
        let m: u64 = c[lo..=mid].iter().map(|e| e.1).sum();
        if acc + m >= need {
            hi = mid + 1;
        } else {
            acc += m;
            lo = mid + 1;
        }
    }
    c[lo..hi].sort_unstable();
    for &(r, m) in &c[lo..hi] {
        acc += m;
        if acc >= need {
            return r;
        }
    }
    c[hi - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(t: f32, k: u32, p: f32, u: f32) -> SampleSettings {
        SampleSettings::new(t, k, p, u).unwrap()
    }

    #[test]
    fn exp_mass_is_accurate_and_monotone() {
        let mut prev = 0u64;
        let mut worst = 0f64;
        for i in (0..=3_200_000).rev() {
            let x = -(i as f32) * 1e-5;
            let q = exp_mass(x);
            assert!(q >= prev, "not monotone at {x}: {q} < {prev}");
            prev = q;
            let want = (f64::from(x)).exp() * MASS_ONE as f64;
            if want > 1e9 {
                worst = worst.max((q as f64 - want).abs() / want);
            }
        }
        assert!(worst < 3e-7, "relative error {worst:e}");
        assert_eq!(exp_mass(0.0), MASS_ONE);
        assert_eq!(exp_mass(-0.0), MASS_ONE);
        assert_eq!(exp_mass(f32::NEG_INFINITY), 0);
        assert_eq!(exp_mass(f32::NAN), 0);
        assert_eq!(exp_mass(-32.0), 0);
        assert_eq!(mass(f32::INFINITY, f32::INFINITY, 1.0), MASS_ONE);
        assert_eq!(mass(3.0, f32::INFINITY, 1.0), 0);
        assert_eq!(mass(f32::NEG_INFINITY, f32::NEG_INFINITY, 0.5), MASS_ONE);
    }

    #[test]
    fn exact_products() {
        assert_eq!(mul_floor(10, 0.5), 5);
        assert_eq!(mul_ceil(10, 0.5), 5);
        assert_eq!(mul_floor(11, 0.5), 5);
        assert_eq!(mul_ceil(11, 0.5), 6);
        assert_eq!(mul_floor(u64::MAX, 1.0), u64::MAX);
        assert_eq!(mul_ceil(u64::MAX, 1.0), u64::MAX);
        assert_eq!(mul_floor(1 << 60, f32::from_bits(1)), 0);
        assert_eq!(mul_ceil(1 << 60, f32::from_bits(1)), 1);
        assert_eq!(mul_floor(123, 0.0), 0);
        assert_eq!(mul_ceil(123, 0.0), 0);
        let u = 0.1f32;
        assert_eq!(mul_floor(1_000_000_007, u), (1_000_000_007f64 * f64::from(u)).floor() as u64);
    }

    #[test]
    fn settings_are_checked_in_order() {
        let bad = |r: [f32; 4]| SampleSettings::from_row(r).unwrap_err().field;
        assert_eq!(bad([-1.0, 0.5, 0.0, 2.0]), SampleField::Temperature);
        assert_eq!(bad([f32::INFINITY, 0.0, 1.0, 0.0]), SampleField::Temperature);
        assert_eq!(bad([1.0, 0.5, 1.0, 0.0]), SampleField::TopK);
        assert_eq!(bad([1.0, -1.0, 1.0, 0.0]), SampleField::TopK);
        assert_eq!(bad([1.0, 16777217.0 * 2.0, 1.0, 0.0]), SampleField::TopK);
        assert_eq!(bad([1.0, f32::NAN, 1.0, 0.0]), SampleField::TopK);
        assert_eq!(bad([1.0, 3.0, 0.0, 0.0]), SampleField::TopP);
        assert_eq!(bad([1.0, 3.0, 1.01, 0.0]), SampleField::TopP);
        assert_eq!(bad([1.0, 3.0, 1.0, 1.0]), SampleField::U);
        assert_eq!(bad([1.0, 3.0, 1.0, -0.1]), SampleField::U);
        let s = SampleSettings::from_row([0.7, 40.0, 0.9, 0.25]).unwrap();
        assert_eq!(s.to_row(), [0.7, 40.0, 0.9, 0.25]);
        assert_eq!(SampleSettings::from_row([1.0, 16777216.0, 1.0, 0.0]).unwrap().top_k(), MAX_TOP_K);
        let e = BadSetting { field: SampleField::TopP, value: 1.5 };
        assert_eq!(e.to_string(), "top_p is 1.5, expected in (0, 1]");
        for f in [SampleField::Temperature, SampleField::TopK, SampleField::TopP, SampleField::U, SampleField::Logits] {
            assert_eq!(SampleField::from_code(f.code()), Some(f));
        }
    }

    #[test]
    fn greedy_is_the_first_argmax_and_skips_nan() {
        let g = SampleSettings::greedy();
        assert_eq!(sample(&[0.0, 3.0, f32::NAN, 3.0, -1.0], &g), Some(1));
        assert_eq!(sample(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY], &g), Some(1));
        assert_eq!(sample(&[f32::NAN, f32::NAN], &g), None);
        assert_eq!(sample(&[], &g), None);
        // top_k = 1 is greedy at any temperature and draw.
        assert_eq!(sample(&[0.5, 2.0, 2.0, -3.0], &settings(5.0, 1, 1.0, 0.99)), Some(1));
    }

    #[test]
    fn the_draw_walks_the_kept_tokens_in_index_order() {
        // Equal logits: masses 2^40 each; u picks by index.
        let l = [1.0f32; 4];
        for (u, want) in [(0.0, 0), (0.2499, 0), (0.25, 1), (0.5, 2), (0.74, 2), (0.75, 3), (0.999, 3)] {
            assert_eq!(sample(&l, &settings(1.0, 0, 1.0, u)), Some(want), "u = {u}");
        }
        // NaN and -inf are never drawn; +inf logits share all the mass.
        let l = [f32::NAN, f32::INFINITY, 0.0, f32::INFINITY, f32::NEG_INFINITY];
        for (u, want) in [(0.0, 1), (0.49, 1), (0.5, 3), (0.99, 3)] {
            assert_eq!(sample(&l, &settings(1.0, 0, 1.0, u)), Some(want), "u = {u}");
        }
        // A row of -inf (and NaN) is uniform over the -inf tokens.
        let l = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        assert_eq!(sample(&l, &settings(1.0, 0, 1.0, 0.3)), Some(0));
        assert_eq!(sample(&l, &settings(1.0, 0, 1.0, 0.7)), Some(2));
    }

    #[test]
    fn top_k_and_top_p_cut_in_rank_order_with_ties_by_index() {
        // Ranks: 1 (3.0), 3 (3.0), 0 (2.0), 4 (1.0), 2 (0.0).
        let l = [2.0f32, 3.0, 0.0, 3.0, 1.0];
        let picks = |k, p| {
            let mut seen = [false; 5];
            for i in 0..1000 {
                let u = i as f32 / 1000.0;
                seen[sample(&l, &settings(1.0, k, p, u)).unwrap() as usize] = true;
            }
            seen
        };
        assert_eq!(picks(2, 1.0), [false, true, false, true, false]);
        assert_eq!(picks(3, 1.0), [true, true, false, true, false]);
        assert_eq!(picks(0, 1.0), [true; 5]);
        assert_eq!(picks(9, 1.0), [true; 5]);
        // Masses e^0, e^0, e^-1, e^-2, e^-3 over ranks: W = 2.553; the first rank reaches 0.39 W.
        assert_eq!(picks(0, 0.3), [false, true, false, false, false]);
        assert_eq!(picks(0, 0.5), [false, true, false, true, false]);
        assert_eq!(picks(0, 0.85), [true, true, false, true, false]);
        // top-p within top-k: W_k = 2 for k = 2, so 0.6 needs both.
        assert_eq!(picks(2, 0.6), [false, true, false, true, false]);
        assert_eq!(picks(2, 0.5), [false, true, false, false, false]);
    }

    #[test]
    fn mass_cut_matches_a_sorted_walk() {
        let mut state = 0x1234_5678u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state >> 33
        };
        for _ in 0..200 {
            let n = 1 + (next() % 500) as usize;
            let mut c: Vec<(u64, u64)> = (0..n).map(|i| ((next() % 50) << 32 | i as u64, next() % 7)).collect();
            let total: u64 = c.iter().map(|e| e.1).sum();
            if total == 0 {
                continue;
            }
            let need = 1 + next() % total;
            let mut sorted = c.clone();
            sorted.sort_unstable();
            let mut acc = 0;
            let want = sorted.iter().find(|e| {
                acc += e.1;
                acc >= need
            });
            assert_eq!(mass_cut(&mut c, need), want.unwrap().0);
        }
    }

    #[test]
    fn frequencies_follow_the_weights() {
        // Two tokens with weights 1 and 3 at temperature 1: u in steps of 1/4096.
        let l = [0.0f32, 3f32.ln()];
        let ones = (0..4096).filter(|&i| sample(&l, &settings(1.0, 0, 1.0, i as f32 / 4096.0)) == Some(1)).count();
        assert!((ones as f64 / 4096.0 - 0.75).abs() < 1e-3, "{ones}");
        // Temperature 2 flattens: weights 1 and sqrt 3.
        let ones = (0..4096).filter(|&i| sample(&l, &settings(2.0, 0, 1.0, i as f32 / 4096.0)) == Some(1)).count();
        let want = 3f64.sqrt() / (1.0 + 3f64.sqrt());
        assert!((ones as f64 / 4096.0 - want).abs() < 1e-3, "{ones}");
    }
}
