//! Data movement: get_rows, set_rows, cpy / cast / cont, concat, repeat.
//!
//! Values move as raw element bytes whenever source and destination share a dtype (exact for
//! i32, whose values above 2^24 would not survive a trip through f32), and through f32 with
//! rounding to nearest when they differ.

use tessera_ops::KernelError;

use super::strided::{Dst, DstRow, Src, row_coords};

/// Per-task scratch rows.
#[derive(Default)]
struct Scratch {
    raw: Vec<u8>,
    f32s: Vec<f32>,
}

/// Reads every row id of `ids` (an i32 tensor) in logical order and checks it against
/// `0..limit`. The first bad one is the error, reported exactly as the reference reports it, and
/// it is found before anything is written.
fn checked_ids(op: &'static str, ids: &Src<'_>, limit: usize, what: &'static str) -> Result<Vec<usize>, KernelError> {
    let ne = ids.ne();
    let mut out = Vec::with_capacity(ids.meta.nelements());
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    let id = ids.elem_i32([i0, i1, i2, i3]);
                    match usize::try_from(id) {
                        Ok(row) if row < limit => out.push(row),
                        _ => return Err(KernelError::IndexOutOfRange { op, index: i64::from(id), limit, what }),
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Copies source row `c` into `row`: raw when the dtypes match, converted through f32 otherwise.
fn copy_row(src: &Src<'_>, c: [usize; 3], row: &mut DstRow<'_>, scratch: &mut Scratch) {
    if src.dtype() == row.dtype() {
        row.fill_raw(&mut scratch.raw, |out| src.load_row_raw(c, out));
    } else {
        row.fill_f32(&mut scratch.f32s, |out| src.load_row(c, out));
    }
}

/// `out[:, r, j, k] = src[:, ids[r, j, k], j, k]` (ggml's get_rows).
pub(super) fn get_rows(src: Src<'_>, ids: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let rows = checked_ids("get_rows", &ids, src.ne()[1], "row id")?;
    let dne = dst.ne();
    // Destination row r is [n, ne2, ne3]-indexed exactly like flat element r of ids.
    dst.for_each_row(dne[0], Scratch::default, |s, r, mut row| {
        let [_, j, k] = row_coords(dne, r);
        copy_row(&src, [rows[r], j, k], &mut row, s);
    });
    Ok(())
}

/// Writes row `r` of `src[:, :, j, k]` to row `ids[r, j, k]` of `dst[:, :, j, k]`, in increasing
/// `r`, so the last `r` naming a destination row wins. `prior` is the destination's old value when
/// it is not already the output's contents (a hand-built task placing them apart).
pub(super) fn set_rows(
    prior: Option<Src<'_>>,
    src: Src<'_>,
    ids: Src<'_>,
    dst: &mut Dst<'_>,
) -> Result<(), KernelError> {
    let dne = dst.ne();
    let targets = checked_ids("set_rows", &ids, dne[1], "destination row")?;
    if let Some(prior) = prior {
        copy(prior, dst);
    }
    // (destination flat row, source flat row); ids are [src.ne1, ne2, ne3] like src's rows.
    let mut pairs: Vec<(usize, usize)> = targets
        .iter()
        .enumerate()
        .map(|(r, &t)| {
            let [_, j, k] = row_coords(src.ne(), r);
            (t + dne[1] * (j + dne[2] * k), r)
        })
        .collect();
    // Stable: among equal destinations the source rows stay in increasing order; keep the last.
    pairs.sort_by_key(|&(d, _)| d);
    let mut rows = Vec::with_capacity(pairs.len());
    let mut from = Vec::with_capacity(pairs.len());
    for (d, r) in pairs {
        match (rows.last(), from.last_mut()) {
            (Some(&last), Some(f)) if last == d => *f = r,
            _ => {
                rows.push(d);
                from.push(r);
            }
        }
    }
    let sne = src.ne();
    dst.for_listed_rows(&rows, dne[0], Scratch::default, |s, k, mut row| {
        copy_row(&src, row_coords(sne, from[k]), &mut row, s);
    })
}

/// Element `e` of `src` (flat, logical order) to element `e` of `dst`: cpy, cast and cont. The
/// shapes may differ; only the element counts match (checked by the shape rules).
pub(super) fn copy(src: Src<'_>, dst: &mut Dst<'_>) {
    let n0 = dst.ne()[0];
    let same_dtype = src.dtype() == dst.meta().dtype;
    dst.for_each_row(n0, Scratch::default, |s, r, mut row| {
        let start = r * n0;
        if same_dtype {
            row.fill_raw(&mut s.raw, |out| src.gather_flat_raw(start, out));
        } else {
            row.fill_f32(&mut s.f32s, |out| src.gather_flat_f32(start, out));
        }
    });
}

/// `a` followed by `b` along `dim` (same dtype, all other dimensions equal).
pub(super) fn concat(a: Src<'_>, b: Src<'_>, dim: usize, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    if dim >= 4 {
        return Err(KernelError::Unsupported { op: "concat", why: format!("dim {dim} is out of range") });
    }
    let dne = dst.ne();
    let (a_ne, eb) = (a.ne(), a.dtype().block_bytes());
    dst.for_each_row(dne[0], Scratch::default, |s, r, mut row| {
        let mut c = row_coords(dne, r);
        if dim == 0 {
            let split = a_ne[0] * eb;
            row.fill_raw(&mut s.raw, |out| {
                let (left, right) = out.split_at_mut(split);
                a.load_row_raw(c, left);
                b.load_row_raw(c, right);
            });
        } else if c[dim - 1] < a_ne[dim] {
            row.fill_raw(&mut s.raw, |out| a.load_row_raw(c, out));
        } else {
            c[dim - 1] -= a_ne[dim];
            row.fill_raw(&mut s.raw, |out| b.load_row_raw(c, out));
        }
    });
    Ok(())
}

/// `out[i] = src[i mod src.ne]` per dimension (ggml's repeat).
pub(super) fn repeat(src: Src<'_>, dst: &mut Dst<'_>) {
    let (sne, dne) = (src.ne(), dst.ne());
    let seg = sne[0] * src.dtype().block_bytes();
    dst.for_each_row(dne[0], Scratch::default, |s, r, mut row| {
        let c = row_coords(dne, r);
        let sc = [c[0] % sne[1], c[1] % sne[2], c[2] % sne[3]];
        row.fill_raw(&mut s.raw, |out| {
            let (first, rest) = out.split_at_mut(seg);
            src.load_row_raw(sc, first);
            for tile in rest.chunks_exact_mut(seg) {
                tile.copy_from_slice(first);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use tessera_graph::{BackendError, ExecError};
    use tessera_ops::KernelError;

    use crate::CpuBackend;
    use crate::cpu::testutil::{BF16, F16, F32, FLOATS, I32, case, check, check_error};

    #[test]
    fn get_rows_of_each_float_dtype_with_batches() {
        for dt in FLOATS {
            check(1, 0.0, |g, l| {
                let src = l.random(g.input("src", dt, [37, 5, 2, 3])?);
                let ids = l.ids(g.input("ids", I32, [4, 2, 3, 1])?, 5);
                Ok(vec![g.get_rows(src, ids)?])
            });
        }
    }

    #[test]
    fn get_rows_of_strided_source_with_transposed_ids() {
        check(2, 0.0, |g, l| {
            let base = l.random(g.input("base", F16, [40, 6, 2, 1])?);
            // rows of 37 starting 3 elements in, every row of the base
            let src = g.view(base, [37, 6, 2, 1], [2, 80, 480, 960], 6)?;
            let ids = l.ids(g.input("ids", I32, [2, 7, 1, 1])?, 6);
            let ids = g.transpose(ids)?; // [7, 2]: nb[0] = 8 bytes
            Ok(vec![g.get_rows(src, ids)?])
        });
    }

    #[test]
    fn get_rows_of_i32_is_exact_beyond_f32_precision() {
        check(3, 0.0, |g, l| {
            let big: Vec<f64> = (0..12).map(|i| f64::from((1 << 30) + 2 * i + 1)).collect();
            let src = l.values(g.input("src", I32, [3, 4, 1, 1])?, big);
            let ids = l.values(g.input("ids", I32, [3, 1, 1, 1])?, vec![3., 0., 3.]);
            Ok(vec![g.get_rows(src, ids)?])
        });
    }

    #[test]
    fn get_rows_rejects_out_of_range_ids_like_the_reference() {
        for bad in [5., -1.] {
            let err = check_error(|g, l| {
                let src = l.random(g.input("src", F32, [4, 5, 1, 1])?);
                let ids = l.values(g.input("ids", I32, [3, 1, 1, 1])?, vec![0., bad, 9.]);
                Ok(vec![g.get_rows(src, ids)?])
            });
            let want = KernelError::IndexOutOfRange { op: "get_rows", index: bad as i64, limit: 5, what: "row id" };
            assert_eq!(err, ExecError::Backend(BackendError::Kernel(want)));
        }
    }

    #[test]
    fn set_rows_in_place_with_duplicate_ids_last_wins() {
        check(4, 0.0, |g, l| {
            let dst = l.random(g.state("cache", F16, [8, 10, 2, 1])?);
            let src = l.random(g.input("src", F32, [8, 4, 2, 1])?);
            let ids = l.values(g.input("ids", I32, [4, 2, 1, 1])?, vec![3., 7., 3., 0., 9., 9., 9., 1.]);
            Ok(vec![g.set_rows(dst, src, ids)?])
        });
    }

    #[test]
    fn set_rows_into_a_transposed_view_leaves_the_rest() {
        check(5, 0.0, |g, l| {
            let state = l.random(g.state("state", BF16, [10, 8, 1, 1])?);
            let dst = g.transpose(state)?; // [8, 10]: strided rows
            let src = l.random(g.input("src", F32, [8, 3, 1, 1])?);
            let src = g.view(src, [8, 2, 1, 1], [4, 32, 96, 96], 32)?;
            let ids = l.values(g.input("ids", I32, [2, 1, 1, 1])?, vec![9., 2.]);
            let out = g.set_rows(dst, src, ids)?;
            Ok(vec![out, state])
        });
    }

    #[test]
    fn set_rows_error_writes_nothing() {
        check_error(|g, l| {
            let dst = l.random(g.state("cache", F32, [4, 3, 1, 1])?);
            let src = l.random(g.input("src", F32, [4, 2, 1, 1])?);
            let ids = l.values(g.input("ids", I32, [2, 1, 1, 1])?, vec![0., 3.]);
            Ok(vec![g.set_rows(dst, src, ids)?])
        });
        // Run by hand to read the state after the failed step.
        let c = case(6, |g, l| {
            let dst = l.values(g.state("cache", F32, [2, 2, 1, 1])?, vec![1., 2., 3., 4.]);
            let src = l.random(g.input("src", F32, [2, 2, 1, 1])?);
            let ids = l.values(g.input("ids", I32, [2, 1, 1, 1])?, vec![1., 2.]);
            g.set_rows(dst, src, ids)?;
            Ok(vec![dst])
        });
        let (run, state) = c.run_and_read(&mut CpuBackend::new());
        assert!(run.is_err());
        assert_eq!(state.expect("state readable"), vec![vec![1., 2., 3., 4.]]);
    }

    #[test]
    fn cpy_converts_dtype_and_reshapes_in_logical_order() {
        for (from, to) in [(F32, F16), (F16, BF16), (BF16, F32), (F32, F32)] {
            check(7, 0.0, |g, l| {
                let src = l.random(g.input("src", from, [6, 4, 1, 1])?);
                let src = g.transpose(src)?; // [4, 6], strided
                let dst = l.random(g.state("dst", to, [3, 8, 1, 1])?);
                Ok(vec![g.cpy(src, dst)?])
            });
        }
    }

    #[test]
    fn cpy_into_a_permuted_view_of_state() {
        check(8, 0.0, |g, l| {
            let state = l.random(g.state("kv", F16, [5, 3, 4, 2])?);
            let dst = g.permute(state, [1, 0, 2, 3])?; // [3, 5, 4, 2], nb[0] = 10 bytes
            let src = l.random(g.input("k", F32, [3, 5, 4, 2])?);
            let out = g.cpy(src, dst)?;
            Ok(vec![out, state])
        });
    }

    #[test]
    fn cpy_of_i32_is_exact() {
        check(9, 0.0, |g, l| {
            let v: Vec<f64> = (0..24).map(|i| f64::from(i32::MAX - 3 * i)).collect();
            let src = l.values(g.input("src", I32, [4, 6, 1, 1])?, v);
            let dst = l.ids(g.state("dst", I32, [6, 2, 2, 1])?, 10);
            let t = g.transpose(src)?;
            Ok(vec![g.cpy(t, dst)?])
        });
    }

    #[test]
    fn cast_round_trips_and_cont_of_permuted_tensors() {
        check(10, 0.0, |g, l| {
            let x = l.random_in(g.input("x", F32, [3, 4, 5, 2])?, -100.0, 100.0);
            let p = g.permute(x, [2, 0, 3, 1])?;
            let h = g.cast(p, BF16)?;
            let back = g.cast(h, F32)?;
            let c = g.cont(p)?;
            let xi = l.ids(g.input("i", I32, [7, 3, 1, 1])?, 1000);
            let ti = g.transpose(xi)?;
            let ci = g.cont(ti)?;
            let cast_i = g.cast(ti, I32)?;
            Ok(vec![h, back, c, ci, cast_i])
        });
    }

    #[test]
    fn concat_along_each_dim_with_strided_inputs() {
        for dim in 0..4 {
            for dt in [F32, F16, I32] {
                check(11 + dim as u64, 0.0, |g, l| {
                    let mut b_ne = [3, 4, 2, 2];
                    b_ne[dim] = 5;
                    let a = l.ids(g.input("a", dt, [3, 4, 2, 2])?, 100);
                    let b = l.ids(g.input("b", dt, [b_ne[1], b_ne[0], b_ne[2], b_ne[3]])?, 100);
                    let b = g.transpose(b)?;
                    Ok(vec![g.concat(a, b, dim)?])
                });
            }
        }
    }

    #[test]
    fn repeat_tiles_strided_sources_of_each_dtype() {
        for dt in [F32, F16, BF16, I32] {
            check(15, 0.0, |g, l| {
                let x = l.ids(g.input("x", dt, [2, 3, 1, 1])?, 50);
                let t = g.transpose(x)?; // [3, 2]
                Ok(vec![g.repeat(t, &[6, 4, 3, 2])?])
            });
        }
    }
}
