//! Row-wise ops over `ne[0]`: rms_norm, sum_rows, softmax (optional f32/f16 mask), argmax.
//!
//! Rows are independent, so tasks split over rows. Each row's sums use the blocked pairwise
//! summation of [`super::sum`], which keeps f32 accuracy on rows of 100k elements and more.

use super::math::{exp, map_in_place, zip_in_place};
use super::strided::{Dst, Src, row_coords};
use super::sum::{sum, sum_squares};

/// Per-task scratch: one row of the input and one of the mask.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    mask: Vec<f32>,
}

/// Calls `f` on row `c` of `x` as f32 values: borrowed when dense aligned f32, else decoded into
/// `scratch`.
fn with_row<T>(x: &Src<'_>, c: [usize; 3], scratch: &mut Vec<f32>, f: impl FnOnce(&[f32]) -> T) -> T {
    match x.row_f32(c) {
        Some(xs) => f(xs),
        None => {
            scratch.resize(x.ne()[0], 0.0);
            x.load_row(c, scratch);
            f(scratch)
        }
    }
}

/// `y = x / sqrt(mean(x^2) + eps)` per row (f32 output).
pub(super) fn rms_norm(eps: f32, x: Src<'_>, dst: &mut Dst<'_>) {
    let ne = dst.ne();
    let n = ne[0] as f32;
    dst.for_each_row(2 * ne[0], Vec::new, |scratch, r, mut row| {
        let c = row_coords(ne, r);
        row.fill_f32(scratch, |out| {
            x.load_row(c, out);
            let inv = 1.0 / (sum_squares(out) / n + eps).sqrt();
            map_in_place(out, |v| v * inv);
        });
    });
}

/// The sum of each row: output `[1, ne1, ne2, ne3]`, f32.
pub(super) fn sum_rows(x: Src<'_>, dst: &mut Dst<'_>) {
    let ne = x.ne();
    dst.for_each_row(ne[0], Vec::new, |scratch, r, mut row| {
        let total = with_row(&x, row_coords(ne, r), scratch, sum);
        row.store(&[total]);
    });
}

/// Index of the largest element of a row, the first on ties; NaNs are skipped and an all-NaN row
/// gives 0 (the reference's rule).
fn argmax_row(xs: &[f32]) -> i32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in xs.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    // A row longer than i32::MAX cannot have its index stored; saturate (shape rules keep rows
    // far shorter in practice).
    best.map_or(0, |(i, _)| i32::try_from(i).unwrap_or(i32::MAX))
}

/// Index of the largest element of each row: output i32 `[1, ne1, ne2, ne3]`.
pub(super) fn argmax(x: Src<'_>, dst: &mut Dst<'_>) {
    let ne = x.ne();
    dst.for_each_row(ne[0], Vec::new, |scratch, r, mut row| {
        let best = with_row(&x, row_coords(ne, r), scratch, argmax_row);
        row.store_i32(&[best]);
    });
}

/// Per row `(i1, i2, i3)`: `z = x * scale + mask[:, i1, i2 % mask.ne2, i3 % mask.ne3]`,
/// `y = exp(z - max z) / sum exp(z - max z)` (f32 output).
///
/// Subtracting the maximum keeps `exp` from overflowing. A row whose every `z` is `-inf` (fully
/// masked) comes out as zeros, as in the reference; a `+inf` or NaN `z` makes its row NaN.
pub(super) fn softmax(scale: f32, x: Src<'_>, mask: Option<Src<'_>>, dst: &mut Dst<'_>) {
    let ne = dst.ne();
    dst.for_each_row(4 * ne[0], Scratch::default, |scratch, r, mut row| {
        let Scratch { x: out_row, mask: mask_row } = scratch;
        let c = row_coords(ne, r);
        row.fill_f32(out_row, |z| {
            x.load_row(c, z);
            match &mask {
                Some(m) => {
                    let mne = m.ne();
                    let cm = [c[0], c[1] % mne[2], c[2] % mne[3]];
                    with_row(m, cm, mask_row, |ms| {
                        zip_in_place(z, ms, |zi, mi| zi * scale + mi);
                    });
                }
                None if scale != 1.0 => map_in_place(z, |zi| zi * scale),
                None => {}
            }
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if max == f32::NEG_INFINITY {
                z.fill(0.0);
                return;
            }
            map_in_place(z, |v| exp(v - max));
            let total = sum(z);
            map_in_place(z, |v| v / total);
        });
    });
}

#[cfg(test)]
mod tests {
    use crate::cpu::testutil::{BF16, F16, F32, FLOATS, check};

    #[test]
    fn rms_norm_of_each_dtype_and_layout() {
        for dt in FLOATS {
            check(30, 1e-12, |g, l| {
                let x = l.random(g.input("x", dt, [37, 5, 2, 1])?);
                let t = l.random(g.input("t", dt, [5, 37, 1, 1])?);
                let t = g.transpose(t)?;
                Ok(vec![g.rms_norm(x, 1e-6)?, g.rms_norm(t, 0.5)?])
            });
        }
    }

    #[test]
    fn rms_norm_keeps_precision_on_a_long_row() {
        check(31, 1e-12, |g, l| {
            let x = l.random_in(g.input("x", F32, [100_003, 2, 1, 1])?, 999.0, 1001.0);
            Ok(vec![g.rms_norm(x, 1e-5)?])
        });
    }

    #[test]
    fn sum_rows_of_long_rows_beats_naive_f32() {
        // Values in [0, 1): a naive f32 sum of 200k of them drifts by ~3e-6 relative (NMSE ~1e-11).
        let nmse = check(32, 1e-12, |g, l| {
            let x = l.random_in(g.input("x", F32, [200_003, 2, 1, 1])?, 0.0, 1.0);
            Ok(vec![g.sum_rows(x)?])
        });
        assert!(nmse < 1e-13, "sum_rows NMSE {nmse:e}");
    }

    #[test]
    fn sum_rows_of_strided_half_types() {
        for dt in [F16, BF16] {
            check(33, 1e-12, |g, l| {
                let x = l.random(g.input("x", dt, [6, 45, 3, 1])?);
                let p = g.permute(x, [1, 0, 2, 3])?; // rows of 45 with nb[0] = 6 elements
                Ok(vec![g.sum_rows(p)?])
            });
        }
    }

    #[test]
    fn softmax_without_mask_scaled_and_strided() {
        for dt in FLOATS {
            check(34, 1e-12, |g, l| {
                let x = l.random_in(g.input("x", dt, [19, 7, 2, 1])?, -10.0, 10.0);
                let t = g.transpose(x)?;
                Ok(vec![g.softmax(x, 0.5, None)?, g.softmax(t, 1.0, None)?])
            });
        }
    }

    #[test]
    fn softmax_with_broadcast_padded_masks() {
        for mask_dt in [F32, F16] {
            check(35, 1e-12, |g, l| {
                let x = l.random_in(g.input("x", F32, [24, 5, 4, 2])?, -5.0, 5.0);
                // the mask has more rows than x (padding) and broadcasts over dims 2 and 3
                let n = 24 * 8 * 2;
                let mask: Vec<f64> =
                    (0..n).map(|i| if i % 7 == 3 { f64::NEG_INFINITY } else { (i % 5) as f64 }).collect();
                let m = l.values(g.input("mask", mask_dt, [24, 8, 2, 1])?, mask);
                Ok(vec![g.softmax(x, 0.125, Some(m))?])
            });
        }
    }

    #[test]
    fn softmax_fully_masked_rows_are_zero_and_large_inputs_are_stable() {
        check(36, 1e-12, |g, l| {
            let x = l.values(
                g.input("x", F32, [4, 3, 1, 1])?,
                vec![1e4, 1e4 + 1., 9e3, -1e4, 1., 2., 3., 4., 1., 1., 1., 1.],
            );
            let inf = f64::NEG_INFINITY;
            let m = l.values(
                g.input("mask", F16, [4, 3, 1, 1])?,
                vec![0., 0., 0., 0., inf, inf, inf, inf, 0., inf, 0., inf],
            );
            Ok(vec![g.softmax(x, 1.0, Some(m))?])
        });
    }

    #[test]
    fn softmax_of_a_long_row() {
        check(37, 1e-12, |g, l| {
            let x = l.random_in(g.input("x", F32, [150_001, 1, 1, 1])?, -20.0, 20.0);
            Ok(vec![g.softmax(x, 1.0, None)?])
        });
    }

    #[test]
    fn argmax_ties_nan_and_strides() {
        check(38, 0.0, |g, l| {
            let nan = f64::NAN;
            let v = vec![1., 3., 3., 2., nan, -5., nan, -2., nan, nan, nan, nan, f64::NEG_INFINITY, nan, -1e30, 0.];
            let x = l.values(g.input("x", F32, [4, 4, 1, 1])?, v);
            let t = g.transpose(x)?;
            let h = l.random(g.input("h", BF16, [33, 9, 2, 1])?);
            Ok(vec![g.argmax(x)?, g.argmax(t)?, g.argmax(h)?])
        });
    }
}

pub(super) fn l2_norm(_eps: f32, _x: Src<'_>, _dst: &mut Dst<'_>) -> Result<(), tessera_ops::KernelError> {
    todo!("l2_norm cpu")
}

pub(super) fn top_k(_k: usize, _x: Src<'_>, _dst: &mut Dst<'_>) -> Result<(), tessera_ops::KernelError> {
    todo!("top_k cpu")
}

pub(super) fn argsort(
    _order: tessera_ops::SortOrder,
    _x: Src<'_>,
    _dst: &mut Dst<'_>,
) -> Result<(), tessera_ops::KernelError> {
    todo!("argsort cpu")
}
