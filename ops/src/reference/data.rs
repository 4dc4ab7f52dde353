//! Reference data movement: get_rows, set_rows, cpy, cast, cont, concat, repeat.
//!
//! Values pass through unchanged: any rounding to a narrower output dtype happens when the caller
//! stores the result (see the module doc of [`super`]).

use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    match op {
        Op::GetRows => get_rows(&inputs[0], &inputs[1], out),
        Op::SetRows => set_rows(&inputs[0], &inputs[1], &inputs[2]),
        // The values of `src` in logical order, laid out in the destination's shape.
        Op::Cpy => Ok(RefTensor::new(out.ne, inputs[0].data.clone())),
        Op::Cast(_) | Op::Cont => Ok(RefTensor::new(out.ne, inputs[0].data.clone())),
        Op::Concat { dim } => Ok(concat(&inputs[0], &inputs[1], *dim, out)),
        Op::Repeat { .. } => Ok(repeat(&inputs[0], out)),
        _ => unreachable!("reference data::compute called for {op}"),
    }
}

/// Checks a row id read from an i32 tensor (stored as f64) against `0..limit`. A value that is
/// not a whole number (which an i32 source cannot produce) is rejected like an out-of-range one.
fn row_id(op: &'static str, id: f64, limit: usize, what: &'static str) -> Result<usize, KernelError> {
    if id.fract() == 0.0 && id >= 0.0 && id < limit as f64 {
        Ok(id as usize)
    } else {
        // `as` saturates (and maps NaN to 0); the message only needs to show the offending value.
        Err(KernelError::IndexOutOfRange { op, index: id as i64, limit, what })
    }
}

/// `out[i0, r, j, k] = src[i0, ids[r, j, k], j, k]`.
fn get_rows(src: &RefTensor, ids: &RefTensor, out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let mut y = RefTensor::zeros(out.ne);
    let nr = src.ne[1];
    for k in 0..out.ne[3] {
        for j in 0..out.ne[2] {
            for r in 0..out.ne[1] {
                let row = row_id("get_rows", ids.at([r, j, k, 0]), nr, "row id")?;
                for i0 in 0..out.ne[0] {
                    y.set([i0, r, j, k], src.at([i0, row, j, k]));
                }
            }
        }
    }
    Ok(y)
}

/// A copy of `dst` in which row `ids[r, j, k]` of `dst[:, :, j, k]` is replaced by `src[:, r, j, k]`.
///
/// Rows are written in increasing `r`, so when the same destination row appears more than once in
/// `ids[:, j, k]`, the **last** `r` naming it wins. All ids are checked before any write, so an
/// error leaves nothing half-done (the result is not returned anyway).
fn set_rows(dst: &RefTensor, src: &RefTensor, ids: &RefTensor) -> Result<RefTensor, KernelError> {
    let nr = dst.ne[1];
    let mut targets = Vec::with_capacity(ids.data.len());
    for &id in &ids.data {
        targets.push(row_id("set_rows", id, nr, "destination row")?);
    }
    let mut y = dst.clone();
    for k in 0..src.ne[3] {
        for j in 0..src.ne[2] {
            for r in 0..src.ne[1] {
                let row = targets[ids.index([r, j, k, 0])];
                for i0 in 0..src.ne[0] {
                    y.set([i0, row, j, k], src.at([i0, r, j, k]));
                }
            }
        }
    }
    Ok(y)
}

/// `a` followed by `b` along `dim`.
fn concat(a: &RefTensor, b: &RefTensor, dim: usize, out: &TensorMeta) -> RefTensor {
    let mut y = RefTensor::zeros(out.ne);
    for i in RefTensor::indices(out.ne) {
        let x = if i[dim] < a.ne[dim] {
            a.at(i)
        } else {
            let mut ib = i;
            ib[dim] -= a.ne[dim];
            b.at(ib)
        };
        y.set(i, x);
    }
    y
}

/// `out[i] = src[i mod src.ne]`, dimension by dimension.
fn repeat(src: &RefTensor, out: &TensorMeta) -> RefTensor {
    let mut y = RefTensor::zeros(out.ne);
    for i in RefTensor::indices(out.ne) {
        let is = [i[0] % src.ne[0], i[1] % src.ne[1], i[2] % src.ne[2], i[3] % src.ne[3]];
        y.set(i, src.at(is));
    }
    y
}

#[cfg(test)]
mod tests {
    use crate::reference::testutil::run_typed as run;
    use crate::{DType, KernelError, Op};

    const F32: DType = DType::F32;
    const I32: DType = DType::I32;

    #[test]
    fn get_rows_picks_rows_per_batch() {
        // src: 2 batches of 3 rows of 2; ids pick rows [2, 0] from batch 0 and [1, 1] from batch 1.
        let src: Vec<f64> = (0..12).map(f64::from).collect();
        let y = run(&Op::GetRows, &[(F32, [2, 3, 2, 1], src), (I32, [2, 2, 1, 1], vec![2., 0., 1., 1.])]).unwrap();
        assert_eq!(y.ne, [2, 2, 2, 1]);
        assert_eq!(y.data, vec![4., 5., 0., 1., 8., 9., 8., 9.]);
    }

    #[test]
    fn get_rows_rejects_out_of_range_ids() {
        let src = vec![0.; 6];
        let err = run(&Op::GetRows, &[(F32, [2, 3, 1, 1], src.clone()), (I32, [1, 1, 1, 1], vec![3.])]).unwrap_err();
        assert_eq!(err, KernelError::IndexOutOfRange { op: "get_rows", index: 3, limit: 3, what: "row id" });
        let err = run(&Op::GetRows, &[(F32, [2, 3, 1, 1], src), (I32, [1, 1, 1, 1], vec![-1.])]).unwrap_err();
        assert_eq!(err, KernelError::IndexOutOfRange { op: "get_rows", index: -1, limit: 3, what: "row id" });
    }

    #[test]
    fn set_rows_writes_selected_rows_and_keeps_the_rest() {
        let dst = vec![0.; 6];
        let y = run(
            &Op::SetRows,
            &[(F32, [2, 3, 1, 1], dst), (F32, [2, 2, 1, 1], vec![1., 2., 3., 4.]), (I32, [2, 1, 1, 1], vec![2., 0.])],
        )
        .unwrap();
        assert_eq!(y.data, vec![3., 4., 0., 0., 1., 2.]);
    }

    #[test]
    fn set_rows_duplicate_ids_last_write_wins() {
        let dst = vec![9.; 4];
        let y = run(
            &Op::SetRows,
            &[(F32, [2, 2, 1, 1], dst), (F32, [2, 2, 1, 1], vec![1., 2., 3., 4.]), (I32, [2, 1, 1, 1], vec![1., 1.])],
        )
        .unwrap();
        assert_eq!(y.data, vec![9., 9., 3., 4.]);
    }

    #[test]
    fn set_rows_rejects_out_of_range_ids() {
        let err = run(
            &Op::SetRows,
            &[(F32, [2, 2, 1, 1], vec![0.; 4]), (F32, [2, 1, 1, 1], vec![1., 2.]), (I32, [1, 1, 1, 1], vec![2.])],
        )
        .unwrap_err();
        assert_eq!(err, KernelError::IndexOutOfRange { op: "set_rows", index: 2, limit: 2, what: "destination row" });
    }

    #[test]
    fn cpy_keeps_logical_order_in_the_destination_shape() {
        let y = run(
            &Op::Cpy,
            &[(F32, [3, 2, 1, 1], vec![1., 2., 3., 4., 5., 6.]), (DType::F16, [2, 3, 1, 1], vec![0.; 6])],
        )
        .unwrap();
        assert_eq!(y.ne, [2, 3, 1, 1]);
        assert_eq!(y.data, vec![1., 2., 3., 4., 5., 6.]);
    }

    #[test]
    fn cast_and_cont_do_not_round() {
        let v = vec![0.1, 1.0 + 1e-5];
        assert_eq!(run(&Op::Cast(DType::F16), &[(F32, [2, 1, 1, 1], v.clone())]).unwrap().data, v);
        assert_eq!(run(&Op::Cont, &[(F32, [1, 2, 1, 1], v.clone())]).unwrap().data, v);
    }

    #[test]
    fn concat_along_each_dim() {
        let a = vec![1., 2., 3., 4.]; // [2, 2]
        let b = vec![5., 6., 7., 8.]; // [2, 2]
        let y0 =
            run(&Op::Concat { dim: 0 }, &[(F32, [2, 2, 1, 1], a.clone()), (F32, [2, 2, 1, 1], b.clone())]).unwrap();
        assert_eq!(y0.ne, [4, 2, 1, 1]);
        assert_eq!(y0.data, vec![1., 2., 5., 6., 3., 4., 7., 8.]);
        let y1 =
            run(&Op::Concat { dim: 1 }, &[(F32, [2, 2, 1, 1], a.clone()), (F32, [2, 2, 1, 1], b.clone())]).unwrap();
        assert_eq!(y1.ne, [2, 4, 1, 1]);
        assert_eq!(y1.data, vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let y3 = run(&Op::Concat { dim: 3 }, &[(F32, [2, 2, 1, 1], a), (F32, [2, 2, 1, 2], [b.clone(), b].concat())])
            .unwrap();
        assert_eq!(y3.ne, [2, 2, 1, 3]);
        assert_eq!(y3.data, vec![1., 2., 3., 4., 5., 6., 7., 8., 5., 6., 7., 8.]);
    }

    #[test]
    fn repeat_tiles_each_dimension() {
        let y = run(&Op::Repeat { ne: [4, 2, 1, 1] }, &[(F32, [2, 1, 1, 1], vec![1., 2.])]).unwrap();
        assert_eq!(y.data, vec![1., 2., 1., 2., 1., 2., 1., 2.]);
        let y = run(&Op::Repeat { ne: [2, 2, 2, 1] }, &[(F32, [1, 2, 1, 1], vec![1., 2.])]).unwrap();
        assert_eq!(y.data, vec![1., 1., 2., 2., 1., 1., 2., 2.]);
    }
}
