//! Row-wise ops over `ne[0]`: rms_norm, l2_norm, sum_rows, softmax (optional f32/f16 mask),
//! argmax, top_k, argsort.
//!
//! Rows are independent, so tasks split over rows. Each row's sums use the blocked pairwise
//! summation of [`super::sum`], which keeps f32 accuracy on rows of 100k elements and more.

use tessera_ops::{KernelError, SortOrder};

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

/// `y = x / max(||x||_2, eps)` per row (ggml's l2_norm; f32 output). A zero row with `eps = 0`
/// gives NaN (0/0), as in ggml and the reference.
pub(super) fn l2_norm(eps: f32, x: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let ne = dst.ne();
    dst.for_each_row(2 * ne[0], Vec::new, |scratch, r, mut row| {
        let c = row_coords(ne, r);
        row.fill_f32(scratch, |out| {
            x.load_row(c, out);
            let squares = sum_squares(out);
            let norm = if squares >= f32::MIN_POSITIVE && squares.is_finite() {
                squares.sqrt()
            } else {
                // The squares overflowed or underflowed f32 (or the row is zero or has a NaN),
                // although the norm itself may be representable: redo it in f64.
                out.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32
            };
            let inv = 1.0 / norm.max(eps);
            map_in_place(out, |v| v * inv);
        });
    });
    Ok(())
}

/// An order-preserving integer key of an f32 for sorting: `key(a) < key(b)` iff `a < b`, with
/// `-0.0` and `0.0` equal and every NaN below every number (key 0), the reference's total order.
/// `Descending` complements the key, so that smaller keys always come first. Branch-free, so a
/// row's keys compute in SIMD.
#[inline(always)]
fn sort_key(order: SortOrder, v: f32) -> u32 {
    let bits = (v + 0.0).to_bits(); // -0.0 + 0.0 is +0.0
    // Negative floats order by descending magnitude: flip all bits; positives go above them.
    let key = bits ^ (((bits as i32) >> 31) as u32 | 0x8000_0000);
    let key = if v.is_nan() { 0 } else { key };
    if order == SortOrder::Descending { !key } else { key }
}

/// Element `i` of a row with key `key` as a `u64` whose ascending order is the sort order: the
/// key in the high half and the index in the low half, so equal values keep index order in both
/// directions and the ranks of a row are distinct.
#[inline(always)]
fn rank(key: u32, i: usize) -> u64 {
    (u64::from(key) << 32) | i as u64
}

/// The row index a rank carries (its low half; rows are at most `i32::MAX` long, the shape
/// rules check it).
#[inline]
fn rank_index(r: u64) -> i32 {
    (r & 0xFFFF_FFFF) as i32
}

/// At most this `k` (or `ne0 / 1024`, for top-k sampling over a vocabulary row) selects with a
/// sorted insertion buffer: a MoE router's top 8 of 256 compares each element once against the
/// worst kept key, and random rows insert only about `k ln(ne0 / k)` times. Larger `k`
/// partitions and sorts the head.
const SMALL_K: usize = 32;

/// True when the insertion buffer is the faster way to select `k` of `n`.
fn select_by_insertion(k: usize, n: usize) -> bool {
    k <= SMALL_K.max(n / 1024)
}

/// Per-task scratch of the sorting kernels.
#[derive(Default)]
struct SortScratch {
    x: Vec<f32>,
    keys: Vec<u32>,
    ranks: Vec<u64>,
    out: Vec<i32>,
}

/// Writes into `best` the `k` smallest ranks of the row whose keys are `keys`, in ascending
/// order: the first `k` elements of the row in the sort order.
fn select_first(keys: &[u32], best: &mut Vec<u64>, k: usize) {
    best.clear();
    if select_by_insertion(k, keys.len()) {
        best.extend(keys[..k].iter().enumerate().map(|(i, &key)| rank(key, i)));
        best.sort_unstable();
        // Indices only grow, so an element with the worst kept key ranks after it: only a
        // strictly smaller key gets in, and most elements are rejected by one compare.
        let mut worst_key = (best[k - 1] >> 32) as u32;
        for (i, &key) in keys.iter().enumerate().skip(k) {
            if key < worst_key {
                let r = rank(key, i);
                // Shift the worse ones up and drop the last: `best` stays sorted.
                let at = best.partition_point(|&b| b < r);
                best.copy_within(at..k - 1, at + 1);
                best[at] = r;
                worst_key = (best[k - 1] >> 32) as u32;
            }
        }
    } else {
        best.extend(keys.iter().enumerate().map(|(i, &key)| rank(key, i)));
        if k < best.len() {
            best.select_nth_unstable(k - 1);
            best.truncate(k);
        }
        best.sort_unstable();
    }
}

/// Runs the selection on every row: output row `r` holds the first `k` (the output's `ne0`)
/// indices of input row `r` in `order`.
fn sorted_indices(order: SortOrder, k: usize, x: Src<'_>, dst: &mut Dst<'_>) {
    let ne = x.ne();
    debug_assert!(k == dst.ne()[0] && (1..=ne[0]).contains(&k), "the shape rules fix k");
    let work = ne[0] * if select_by_insertion(k, ne[0]) { 2 } else { 8 };
    dst.for_each_row(work, SortScratch::default, |s, r, mut row| {
        let SortScratch { x: xrow, keys, ranks, out } = s;
        with_row(&x, row_coords(ne, r), xrow, |xs| {
            keys.clear();
            keys.extend(xs.iter().map(|&v| sort_key(order, v)));
        });
        select_first(keys, ranks, k);
        out.clear();
        out.extend(ranks.iter().map(|&r| rank_index(r)));
        row.store_i32(out);
    });
}

/// i32 indices of the `k` largest elements of each row, largest first; equal values by lower
/// index first, NaN below every number. Output `[k, ne1, ne2, ne3]`.
pub(super) fn top_k(k: usize, x: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    sorted_indices(SortOrder::Descending, k, x, dst);
    Ok(())
}

/// i32 indices that sort each row in `order`, stable (equal values keep index order), NaN below
/// every number. Output the shape of `x`.
pub(super) fn argsort(order: SortOrder, x: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    sorted_indices(order, x.ne()[0], x, dst);
    Ok(())
}

#[cfg(test)]
mod tests {
    use tessera_ops::SortOrder;

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

    #[test]
    fn l2_norm_of_each_dtype_and_layout() {
        for dt in FLOATS {
            check(40, 1e-12, |g, l| {
                let x = l.random(g.input("x", dt, [128, 5, 2, 1])?);
                let t = l.random(g.input("t", dt, [5, 37, 1, 1])?);
                let t = g.transpose(t)?;
                // eps above the norm of the small rows: they are divided by eps instead
                let s = l.random_in(g.input("s", dt, [8, 3, 1, 1])?, -0.01, 0.01);
                Ok(vec![g.l2_norm(x, 1e-6)?, g.l2_norm(t, 0.0)?, g.l2_norm(s, 0.5)?])
            });
        }
    }

    #[test]
    fn l2_norm_zero_rows_and_huge_values() {
        check(41, 1e-12, |g, l| {
            let x = l.values(g.input("x", F32, [3, 3, 1, 1])?, vec![0., 0., 0., 3e30, 4e30, 0., 1e-30, 0., 0.]);
            Ok(vec![g.l2_norm(x, 0.0)?, g.l2_norm(x, 1e-6)?])
        });
    }

    #[test]
    fn top_k_small_and_large_k_match_the_reference_exactly() {
        for k in [1, 2, 8, 16, 32, 33, 100, 256] {
            check(42, 0.0, |g, l| {
                let x = l.random(g.input("x", F32, [256, 9, 2, 1])?);
                Ok(vec![g.top_k(x, k)?])
            });
        }
    }

    #[test]
    fn top_k_of_long_rows_by_insertion_and_by_partition() {
        // rows of 65536: k up to 64 selects by insertion, above by partition
        for k in [50, 64, 65, 300] {
            check(46, 0.0, |g, l| {
                let x = l.random(g.input("x", F32, [65_536, 2, 1, 1])?);
                Ok(vec![g.top_k(x, k)?])
            });
        }
    }

    #[test]
    fn top_k_and_argsort_break_ties_by_index_on_strided_half_rows() {
        // bf16 values in [-1, 1) from a few levels: many exact ties per row
        for k in [3, 40] {
            check(43, 0.0, |g, l| {
                let v: Vec<f64> = (0..64 * 6).map(|_| (l.rng.below(9) as f64 - 4.0) / 4.0).collect();
                let x = l.values(g.input("x", BF16, [6, 64, 1, 1])?, v);
                let t = g.transpose(x)?; // rows of 64 with nb[0] = 6 elements
                Ok(vec![g.top_k(t, k)?, g.argsort(t, SortOrder::Ascending)?, g.argsort(t, SortOrder::Descending)?])
            });
        }
    }

    #[test]
    fn sorting_puts_nan_below_everything_and_equates_signed_zeros() {
        check(44, 0.0, |g, l| {
            let (nan, inf) = (f64::NAN, f64::INFINITY);
            let v = vec![nan, 1., -inf, -0.0, 0.0, nan, inf, -1e30, 2., -0.0, 1., nan];
            let x = l.values(g.input("x", F32, [12, 1, 1, 1])?, v);
            let f = l.random(g.input("f", F16, [67, 3, 1, 1])?);
            Ok(vec![
                g.argsort(x, SortOrder::Ascending)?,
                g.argsort(x, SortOrder::Descending)?,
                g.top_k(x, 5)?,
                g.top_k(x, 12)?,
                g.argsort(f, SortOrder::Descending)?,
            ])
        });
    }

    #[test]
    fn insertion_selection_handles_worst_case_orders() {
        // Increasing rows make every element an insertion for top_k (largest first).
        check(45, 0.0, |g, l| {
            let up: Vec<f64> = (0..512).map(f64::from).collect();
            let x = l.values(g.input("x", F32, [256, 2, 1, 1])?, up);
            let down: Vec<f64> = (0..512).rev().map(f64::from).collect();
            let y = l.values(g.input("y", F32, [256, 2, 1, 1])?, down);
            Ok(vec![g.top_k(x, 16)?, g.top_k(y, 16)?, g.argsort(x, SortOrder::Descending)?])
        });
    }
}
