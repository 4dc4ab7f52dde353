//! Reference sampling: the rule of [`crate::sample`] with real numbers. Weights are
//! `exp((l - max) / temperature)` in f64 (1 at the largest logit), untruncated; the top-p cut is
//! the shortest rank prefix whose weight reaches `top_p · W_k`, and the draw walks the kept tokens
//! in index order until the running weight exceeds `u · W`.
//!
//! Backends compute integer masses (`trunc(weight · 2^40)` through an f32 `exp`), so near a cut
//! or a draw boundary their pick may differ from this one: [`sample_accepts`] says whether a pick
//! is this rule's for some perturbation of the weights within a tolerance, which is how test-ops
//! judges them.

use super::RefTensor;
use crate::sample::{BadSetting, SampleField, SampleSettings, rank};
use crate::{KernelError, TensorMeta};

/// The op's errors for row `row`.
pub(crate) fn bad_value(row: usize, bad: BadSetting) -> KernelError {
    KernelError::BadValue {
        op: "sample",
        row,
        what: bad.field.name(),
        value: f64::from(bad.value),
        expected: bad.field.expected(),
    }
}

/// Every row's settings, checked in row order, then every row's logits (a row of NaNs fails):
/// the first bad row is the error, as on every backend.
pub(crate) fn checked_rows(logits: &RefTensor, settings: &RefTensor) -> Result<Vec<SampleSettings>, KernelError> {
    let rows = logits.ne[1];
    let parsed = (0..rows)
        .map(|r| {
            let v = |c: usize| settings.at([c, r, 0, 0]) as f32;
            SampleSettings::from_row([v(0), v(1), v(2), v(3)]).map_err(|b| bad_value(r, b))
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (r, row) in logits.data.chunks(logits.ne[0]).enumerate() {
        if row.iter().all(|l| l.is_nan()) {
            return Err(bad_value(r, BadSetting { field: SampleField::Logits, value: f32::NAN }));
        }
    }
    Ok(parsed)
}

pub(super) fn compute(inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let (logits, settings) = (&inputs[0], &inputs[1]);
    let parsed = checked_rows(logits, settings)?;
    let picks = logits.data.chunks(logits.ne[0]).zip(&parsed).map(|(row, s)| Ideal::new(row, s).pick() as f64);
    Ok(RefTensor::new(out.ne, picks.collect()))
}

/// One row's weights, rank order and top-k cut.
struct Ideal<'a> {
    s: &'a SampleSettings,
    /// The first index of the largest logit that is not NaN.
    argmax: usize,
    /// Weight per index (0 for NaN).
    w: Vec<f64>,
    /// Indices that are not NaN, in rank order (larger logit first, then lower index).
    order: Vec<usize>,
    /// Kept by top-k: `order[..k]`.
    k: usize,
    /// `cum[j]`: the weight of `order[..j]`, for `j <= k`.
    cum: Vec<f64>,
}

impl<'a> Ideal<'a> {
    /// Needs a row with a logit that is not NaN.
    fn new(row: &[f64], s: &'a SampleSettings) -> Ideal<'a> {
        let mut argmax = 0;
        let mut max = f64::NAN;
        for (i, &l) in row.iter().enumerate() {
            if !l.is_nan() && (max.is_nan() || l > max) {
                (argmax, max) = (i, l);
            }
        }
        let t = f64::from(s.temperature());
        let w: Vec<f64> = row
            .iter()
            .map(|&l| match l {
                l if l.is_nan() => 0.0,
                l if l == max => 1.0,
                l => ((l - max) / t).exp(),
            })
            .collect();
        let mut order: Vec<usize> = (0..row.len()).filter(|&i| !row[i].is_nan()).collect();
        order.sort_unstable_by_key(|&i| rank(row[i] as f32, i));
        let k = match s.top_k() as usize {
            0 => order.len(),
            k => k.min(order.len()),
        };
        let mut cum = Vec::with_capacity(k + 1);
        cum.push(0.0);
        for &i in &order[..k] {
            cum.push(cum.last().copied().unwrap_or(0.0) + w[i]);
        }
        Ideal { s, argmax, w, order, k, cum }
    }

    /// The kept prefix lengths `L` (of `order`) whose cut is within `tol · W_k` of the top-p
    /// condition `cum[L - 1] < top_p · W_k <= cum[L]`; just `k` without top-p.
    fn cuts(&self, tol: f64) -> (usize, usize) {
        let p = f64::from(self.s.top_p());
        if p >= 1.0 {
            return (self.k, self.k);
        }
        let w_k = self.cum[self.k];
        let (need, slack) = (p * w_k, tol * w_k);
        let lo = (1..=self.k).find(|&l| self.cum[l] >= need - slack).unwrap_or(self.k);
        let hi = (1..=self.k).rev().find(|&l| self.cum[l - 1] < need + slack).unwrap_or(1);
        (lo, hi.max(lo))
    }

    /// The pick of the exact rule.
    fn pick(&self) -> usize {
        if self.s.is_greedy() {
            return self.argmax;
        }
        let (keep, _) = self.cuts(0.0);
        let mut kept = vec![false; self.w.len()];
        for &i in &self.order[..keep] {
            kept[i] = true;
        }
        let total = self.cum[keep];
        let target = f64::from(self.s.u()) * total;
        let mut acc = 0.0;
        let mut last = self.argmax;
        for (i, &k) in kept.iter().enumerate() {
            if k && self.w[i] > 0.0 {
                acc += self.w[i];
                last = i;
                if acc > target {
                    return i;
                }
            }
        }
        last
    }
}

/// Whether `pick` is the reference's pick from `logits` (one row) with `settings`
/// `(temperature, top_k, top_p, u)` when every weight sum may be off by `tol` times the sum of
/// the weights it is compared with: at the top-p cut (`tol · W_k`) and at the draw (`tol · W`).
/// Greedy picks must be exact; a pick outside the top-k set, or NaN, never passes.
pub fn sample_accepts(logits: &[f64], settings: [f64; 4], pick: usize, tol: f64) -> bool {
    let Ok(s) = SampleSettings::from_row(settings.map(|v| v as f32)) else { return false };
    if pick >= logits.len() || logits[pick].is_nan() {
        return false;
    }
    let ideal = Ideal::new(logits, &s);
    if s.is_greedy() {
        return pick == ideal.argmax;
    }
    let Some(pos) = ideal.order[..ideal.k].iter().position(|&i| i == pick) else { return false };
    let (lo, hi) = ideal.cuts(tol);
    let start = lo.max(pos + 1);
    if start > hi {
        return false;
    }
    // The weight of the kept tokens before `pick` in index order, for the cut at `start`, then
    // grown one cut at a time.
    let mut before: f64 = ideal.order[..start].iter().filter(|&&i| i < pick).map(|&i| ideal.w[i]).sum();
    let u = f64::from(s.u());
    for keep in start..=hi {
        if keep > start && ideal.order[keep - 1] < pick {
            before += ideal.w[ideal.order[keep - 1]];
        }
        let total = ideal.cum[keep];
        let (target, slack) = (u * total, tol * total);
        if before - slack <= target && target < before + ideal.w[pick] + slack {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::sample_accepts;
    use crate::reference::testutil::run_typed;
    use crate::{DType, KernelError, Op};

    fn sample(logits: Vec<f64>, settings: Vec<f64>) -> Result<Vec<f64>, KernelError> {
        let rows = settings.len() / 4;
        let n = logits.len() / rows;
        run_typed(&Op::Sample, &[(DType::F32, [n, rows, 1, 1], logits), (DType::F32, [4, rows, 1, 1], settings)])
            .map(|y| y.data)
    }

    #[test]
    fn greedy_and_drawn_rows() {
        let nan = f64::NAN;
        let logits = vec![0., 3., nan, 3., 1., 1., 1., 1.];
        // Row 0 greedy: first of the tied maxima. Row 1: equal weights, u = 0.6 -> index 2.
        let y = sample(logits, vec![0., 0., 1., 0.9, 1., 0., 1., 0.6]).unwrap();
        assert_eq!(y, vec![1., 2.]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_draw() {
        // Weights over ranks (ids 1, 3, 0, 4, 2): 1, 1, e^-1, e^-2, e^-3.
        let logits = vec![2., 3., 0., 3., 1.];
        let pick = |k: f64, p: f64, u: f64| sample(logits.clone(), vec![1., k, p, u]).unwrap()[0];
        assert_eq!(pick(2., 1., 0.99), 3.);
        assert_eq!(pick(3., 1., 0.99), 3.);
        assert_eq!(pick(3., 1., 0.0), 0.);
        assert_eq!(pick(0., 0.3, 0.99), 1.);
        assert_eq!(pick(0., 1., 0.99), 4.);
    }

    #[test]
    fn bad_settings_and_nan_rows_name_the_row() {
        let e = sample(vec![1., 2., 1., 2.], vec![1., 0., 1., 0., 1., 0., 1.5, 0.]).unwrap_err();
        assert_eq!(e.to_string(), "sample: row 1: top_p is 1.5, expected in (0, 1]");
        let e = sample(vec![1., 2., f64::NAN, f64::NAN], vec![1., 0., 1., 0., 1., 0., 1., 0.]).unwrap_err();
        assert!(e.to_string().starts_with("sample: row 1: every logit is NaN"), "{e}");
        // A bad setting in a later row comes before a NaN row: settings are checked first.
        let e = sample(vec![f64::NAN, f64::NAN, 1., 2.], vec![1., 0., 1., 0., 1., 0.5, 1., 0.]).unwrap_err();
        assert!(e.to_string().starts_with("sample: row 1: top_k is 0.5"), "{e}");
    }

    #[test]
    fn accepts_picks_within_the_tolerance_of_a_boundary() {
        // Two equal weights: u = 0.5 is exactly the boundary between ids 0 and 1.
        let l = [1.0, 1.0];
        assert!(sample_accepts(&l, [1., 0., 1., 0.5], 1, 0.0));
        assert!(!sample_accepts(&l, [1., 0., 1., 0.5], 0, 0.0));
        assert!(sample_accepts(&l, [1., 0., 1., 0.5], 0, 1e-6));
        assert!(!sample_accepts(&l, [1., 0., 1., 0.4], 1, 1e-6));
        // A top-p cut exactly at the first of two equal weights: keeping both is within tol.
        assert!(!sample_accepts(&l, [1., 0., 0.5, 0.9], 1, 0.0));
        assert!(sample_accepts(&l, [1., 0., 0.5, 0.9], 1, 1e-6));
        // Outside top-k, NaN, greedy mismatches: never.
        assert!(!sample_accepts(&[3.0, 1.0, 2.0], [1., 2., 1., 0.99], 1, 0.1));
        assert!(!sample_accepts(&[3.0, f64::NAN], [1., 0., 1., 0.99], 1, 0.1));
        assert!(!sample_accepts(&[3.0, 3.0], [0., 0., 1., 0.99], 1, 0.1));
    }
}
