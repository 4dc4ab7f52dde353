//! Reference row-wise ops over `ne[0]`: rms_norm, sum_rows, softmax, argmax.
//!
//! Sums are plain left-to-right f64 sums: this is the oracle, not a fast path.

use super::RefTensor;
use crate::{Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> RefTensor {
    let x = &inputs[0];
    match op {
        Op::RmsNorm(p) => rms_norm(x, f64::from(p.eps), out),
        Op::SumRows => per_row(x, out, |row| row.iter().sum()),
        Op::Softmax(p) => softmax(x, inputs.get(1), f64::from(p.scale), out),
        Op::Argmax => per_row(x, out, argmax),
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
    use crate::reference::{RefTensor, compute};
    use crate::{DType, Op, RmsNormParams, SoftmaxParams, TensorMeta, infer};

    fn run(op: &Op, inputs: &[([usize; 4], Vec<f64>)]) -> RefTensor {
        let metas: Vec<TensorMeta> =
            inputs.iter().map(|(ne, _)| TensorMeta::contiguous("t", DType::F32, *ne).unwrap()).collect();
        let meta_refs: Vec<&TensorMeta> = metas.iter().collect();
        let out = infer(op, &meta_refs).unwrap();
        let tensors: Vec<RefTensor> = inputs.iter().map(|(ne, v)| RefTensor::new(*ne, v.clone())).collect();
        let y = compute(op, &tensors, &out).unwrap();
        assert_eq!(y.ne, out.ne, "result shape must be the inferred one");
        y
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "element {i}: got {g}, want {w}");
        }
    }

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
}
