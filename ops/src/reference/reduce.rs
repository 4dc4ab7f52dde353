//! Reference row-wise ops over `ne[0]`: rms_norm, l2_norm, sum_rows, softmax, argmax, top_k,
//! argsort.
//!
//! Sums are plain left-to-right f64 sums: this is the oracle, not a fast path.

use super::RefTensor;
use std::cmp::Ordering;

use crate::{Op, SortOrder, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> RefTensor {
    let x = &inputs[0];
    match op {
        Op::RmsNorm(p) => rms_norm(x, f64::from(p.eps), out),
        Op::SumRows => per_row(x, out, |row| row.iter().sum()),
        Op::Softmax(p) => softmax(x, inputs.get(1), f64::from(p.scale), out),
        Op::Argmax => per_row(x, out, argmax),
        Op::L2Norm { eps } => l2_norm(x, f64::from(*eps), out),
        Op::TopK { k } => sorted_indices(x, SortOrder::Descending, *k, out),
        Op::Argsort(order) => sorted_indices(x, *order, x.ne[0], out),
        _ => unreachable!("reference reduce::compute called for {op}"),
    }
}

/// The rows of `x` (each `ne[0]` long) in logical order `(i1, i2, i3)`.
fn rows(x: &RefTensor) -> std::slice::Chunks<'_, f64> {
    x.data.chunks(x.ne[0])
}

/// One value per row: output `[1, ne1, ne2, ne3]`.
fn per_row(x: &RefTensor, out: &TensorMeta, f: impl Fn(&[f64]) -> f64) -> RefTensor {
    RefTensor::new(out.ne, rows(x).map(f).collect())
}

/// `y = x / sqrt(mean(x^2) + eps)` per row.
fn rms_norm(x: &RefTensor, eps: f64, out: &TensorMeta) -> RefTensor {
    let mut data = Vec::with_capacity(x.data.len());
    for row in rows(x) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        data.extend(row.iter().map(|v| v * inv));
    }
    RefTensor::new(out.ne, data)
}

/// `y = x / max(||x||_2, eps)` per row (ggml's definition). A zero row with `eps = 0` gives NaN
/// (0/0), as in ggml.
fn l2_norm(x: &RefTensor, eps: f64, out: &TensorMeta) -> RefTensor {
    let mut data = Vec::with_capacity(x.data.len());
    for row in rows(x) {
        let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
        let denom = norm.max(eps);
        data.extend(row.iter().map(|v| v / denom));
    }
    RefTensor::new(out.ne, data)
}

/// Compares the elements `(i, a)` and `(j, b)` of a row: the one that comes first in `order`
/// is `Less`. NaN counts as smaller than every number (so it comes first ascending, last
/// descending), `-0.0 == 0.0`, and equal values keep index order in both directions (stable).
fn sort_cmp(order: SortOrder, (i, a): (usize, f64), (j, b): (usize, f64)) -> Ordering {
    let by_value = match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    };
    let by_value = if order == SortOrder::Descending { by_value.reverse() } else { by_value };
    by_value.then(i.cmp(&j))
}

/// Per row, the indices of the first `k` elements in `order` (see [`sort_cmp`]); `k = ne0` is a
/// full argsort. Output `[k, ne1, ne2, ne3]` holding the indices as f64.
fn sorted_indices(x: &RefTensor, order: SortOrder, k: usize, out: &TensorMeta) -> RefTensor {
    let mut data = Vec::with_capacity(out.nelements());
    for row in rows(x) {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&i, &j| sort_cmp(order, (i, row[i]), (j, row[j])));
        data.extend(idx[..k].iter().map(|&i| i as f64));
    }
    RefTensor::new(out.ne, data)
}

/// Index of the largest element of `row`, the first one on ties. NaNs are skipped; a row that is
/// all NaN gives 0.
fn argmax(row: &[f64]) -> f64 {
    let mut best: Option<(usize, f64)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i) as f64
}

/// Per row `(i1, i2, i3)`: `z[i0] = x[i0] * scale + mask[i0, i1, i2 % mask.ne2, i3 % mask.ne3]`,
/// `y = exp(z - max z) / sum exp(z - max z)`.
///
/// The mask may have more rows than `x` (ggml pads it); row `i1` of it is used. A row whose every
/// `z` is `-inf` (fully masked) comes out as **all zeros**, not NaN. A `+inf` or NaN `z` makes
/// its row NaN, as in ggml: that is a bug upstream, and the oracle should show it.
fn softmax(x: &RefTensor, mask: Option<&RefTensor>, scale: f64, out: &TensorMeta) -> RefTensor {
    let ne = x.ne;
    let mut y = RefTensor::zeros(out.ne);
    let mut z = vec![0.0; ne[0]];
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for (i0, zi) in z.iter_mut().enumerate() {
                    let m = mask.map_or(0.0, |m| m.at([i0, i1, i2 % m.ne[2], i3 % m.ne[3]]));
                    *zi = x.at([i0, i1, i2, i3]) * scale + m;
                }
                let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue; // fully masked row: leave the zeros
                }
                let mut sum = 0.0;
                for zi in z.iter_mut() {
                    *zi = (*zi - max).exp();
                    sum += *zi;
                }
                for (i0, &e) in z.iter().enumerate() {
                    y.set([i0, i1, i2, i3], e / sum);
                }
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use crate::reference::testutil::{assert_close, run};
    use crate::{Op, RmsNormParams, SoftmaxParams, SortOrder};

    const NEG_INF: f64 = f64::NEG_INFINITY;

    fn softmax(scale: f32) -> Op {
        Op::Softmax(SoftmaxParams { scale })
    }

    #[test]
    fn rms_norm_per_row() {
        // row 0: [3, 4] -> mean sq 12.5; row 1: [1, 1] -> mean sq 1 (+ eps 3 -> 4)
        let y = run(&Op::RmsNorm(RmsNormParams { eps: 0.0 }), &[([2, 2, 1, 1], vec![3., 4., 1., 1.])]);
        let r = 12.5f64.sqrt();
        assert_close(&y.data, &[3. / r, 4. / r, 1., 1.]);
        let y = run(&Op::RmsNorm(RmsNormParams { eps: 3.0 }), &[([2, 1, 1, 1], vec![1., 1.])]);
        assert_close(&y.data, &[0.5, 0.5]);
    }

    #[test]
    fn sum_rows_over_ne0() {
        let y = run(&Op::SumRows, &[([3, 2, 2, 1], (1..=12).map(f64::from).collect())]);
        assert_eq!(y.ne, [1, 2, 2, 1]);
        assert_eq!(y.data, vec![6., 15., 24., 33.]);
    }

    #[test]
    fn softmax_plain_and_scaled() {
        let y = run(&softmax(1.0), &[([2, 1, 1, 1], vec![0., 2f64.ln()])]);
        assert_close(&y.data, &[1. / 3., 2. / 3.]);
        // scale 0.5 on [0, 2 ln 3] gives [0, ln 3] -> [1/4, 3/4]
        let y = run(&softmax(0.5), &[([2, 1, 1, 1], vec![0., 2. * 3f64.ln()])]);
        assert_close(&y.data, &[0.25, 0.75]);
    }

    #[test]
    fn softmax_is_shift_invariant_for_large_inputs() {
        let y = run(&softmax(1.0), &[([2, 1, 1, 1], vec![1000., 1000.])]);
        assert_close(&y.data, &[0.5, 0.5]);
    }

    #[test]
    fn softmax_mask_adds_and_broadcasts_over_batches() {
        // x: [2, 2, 2, 1] all zeros; mask [2, 2, 1, 1]: row 0 masks element 1, row 1 adds ln 3 to element 0
        let mask = vec![0., NEG_INF, 3f64.ln(), 0.];
        let y = run(&softmax(1.0), &[([2, 2, 2, 1], vec![0.; 8]), ([2, 2, 1, 1], mask)]);
        assert_close(&y.data, &[1., 0., 0.75, 0.25, 1., 0., 0.75, 0.25]);
    }

    #[test]
    fn softmax_mask_with_more_rows_uses_row_i1() {
        // x has 1 row; the mask has 3 (padded): only mask row 0 applies
        let mask = vec![0., 2f64.ln(), 9., 9., 9., 9.];
        let y = run(&softmax(1.0), &[([2, 1, 1, 1], vec![0., 0.]), ([2, 3, 1, 1], mask)]);
        assert_close(&y.data, &[1. / 3., 2. / 3.]);
    }

    #[test]
    fn softmax_fully_masked_row_is_zeros() {
        let mask = vec![NEG_INF, NEG_INF, 0., 0.];
        let y = run(&softmax(1.0), &[([2, 2, 1, 1], vec![1., 2., 0., 0.]), ([2, 2, 1, 1], mask)]);
        assert_eq!(y.data, vec![0., 0., 0.5, 0.5]);
    }

    #[test]
    fn argmax_first_on_ties() {
        let y = run(&Op::Argmax, &[([4, 3, 1, 1], vec![1., 3., 3., 2., -1., -5., -1., -2., 0., 0., 0., 0.])]);
        assert_eq!(y.ne, [1, 3, 1, 1]);
        assert_eq!(y.data, vec![1., 0., 0.]);
    }

    #[test]
    fn argmax_ignores_nan_unless_the_row_is_all_nan() {
        let nan = f64::NAN;
        let y = run(&Op::Argmax, &[([3, 3, 1, 1], vec![nan, 1., 2., 5., nan, 4., nan, nan, nan])]);
        assert_eq!(y.data, vec![2., 0., 0.]);
        let y = run(&Op::Argmax, &[([3, 1, 1, 1], vec![NEG_INF, nan, NEG_INF])]);
        assert_eq!(y.data, vec![0.]);
    }

    #[test]
    fn l2_norm_divides_by_the_norm_or_eps() {
        // row 0: [3, 4] -> norm 5; row 1: [0.3, 0.4] -> norm 0.5 < eps 2 -> divide by 2
        let y = run(&Op::L2Norm { eps: 2.0 }, &[([2, 2, 1, 1], vec![3., 4., 0.3, 0.4])]);
        assert_close(&y.data, &[0.6, 0.8, 0.15, 0.2]);
        let y = run(&Op::L2Norm { eps: 0.0 }, &[([3, 1, 1, 1], vec![1., -2., 2.])]);
        assert_close(&y.data, &[1. / 3., -2. / 3., 2. / 3.]);
        // a zero row with eps 0 is 0/0, as in ggml
        let y = run(&Op::L2Norm { eps: 0.0 }, &[([2, 1, 1, 1], vec![0., 0.])]);
        assert!(y.data.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn top_k_is_largest_first_with_lower_index_on_ties() {
        let y = run(&Op::TopK { k: 3 }, &[([5, 2, 1, 1], vec![0.1, 0.5, -1., 0.5, 0.3, 2., 2., 2., 1., 3.])]);
        assert_eq!(y.ne, [3, 2, 1, 1]);
        assert_eq!(y.data, vec![1., 3., 4., 4., 0., 1.]);
        let y = run(&Op::TopK { k: 1 }, &[([3, 1, 1, 1], vec![-0.0, 0.0, -1.])]);
        assert_eq!(y.data, vec![0.], "-0 and +0 tie: the lower index wins");
    }

    #[test]
    fn argsort_is_stable_in_both_orders() {
        let x = vec![2., 1., 2., 0., 1.];
        let y = run(&Op::Argsort(SortOrder::Ascending), &[([5, 1, 1, 1], x.clone())]);
        assert_eq!(y.data, vec![3., 1., 4., 0., 2.]);
        let y = run(&Op::Argsort(SortOrder::Descending), &[([5, 1, 1, 1], x)]);
        assert_eq!(y.data, vec![0., 2., 1., 4., 3.]);
    }

    #[test]
    fn nan_sorts_as_the_smallest_value() {
        let nan = f64::NAN;
        let x = vec![nan, 1., f64::NEG_INFINITY, nan, f64::INFINITY];
        let y = run(&Op::Argsort(SortOrder::Ascending), &[([5, 1, 1, 1], x.clone())]);
        assert_eq!(y.data, vec![0., 3., 2., 1., 4.]);
        let y = run(&Op::Argsort(SortOrder::Descending), &[([5, 1, 1, 1], x.clone())]);
        assert_eq!(y.data, vec![4., 1., 2., 0., 3.]);
        let y = run(&Op::TopK { k: 4 }, &[([5, 1, 1, 1], x)]);
        assert_eq!(y.data, vec![4., 1., 2., 0.]);
    }
}
