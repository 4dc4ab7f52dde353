//! rms_norm, l2_norm, sum_rows, softmax, argmax, top_k, argsort: row-wise over ne[0].

use super::{contiguous, expect_arity, expect_float, expect_not_quantized};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    match op {
        Op::RmsNorm(p) => {
            expect_arity(op, inputs, 1)?;
            expect_float(op, 0, inputs[0])?;
            expect_not_quantized(op, 0, inputs[0])?;
            if !(p.eps >= 0.0 && p.eps.is_finite()) {
                return Err(OpError::InvalidParam { op: name, why: format!("eps {} must be finite and >= 0", p.eps) });
            }
            contiguous(op, DType::F32, inputs[0].ne)
        }
        Op::SumRows | Op::Argmax => {
            expect_arity(op, inputs, 1)?;
            let x = inputs[0];
            expect_float(op, 0, x)?;
            expect_not_quantized(op, 0, x)?;
            let dtype = if matches!(op, Op::Argmax) { DType::I32 } else { DType::F32 };
            contiguous(op, dtype, [1, x.ne[1], x.ne[2], x.ne[3]])
        }
        Op::Softmax(p) => {
            if inputs.is_empty() || inputs.len() > 2 {
                return Err(OpError::Arity { op: name, expected: "1 or 2", got: inputs.len() });
            }
            let x = inputs[0];
            expect_float(op, 0, x)?;
            expect_not_quantized(op, 0, x)?;
            if !p.scale.is_finite() {
                return Err(OpError::InvalidParam { op: name, why: format!("scale {} must be finite", p.scale) });
            }
            if let Some(mask) = inputs.get(1) {
                if !matches!(mask.dtype, DType::F32 | DType::F16) {
                    return Err(OpError::DType {
                        op: name,
                        input: 1,
                        dtype: mask.dtype,
                        expected: "an f32 or f16 mask",
                    });
                }
                let fits = mask.ne[0] == x.ne[0]
                    && mask.ne[1] >= x.ne[1]
                    && x.ne[2].is_multiple_of(mask.ne[2])
                    && x.ne[3].is_multiple_of(mask.ne[3]);
                if !fits {
                    return Err(OpError::ShapeMismatch {
                        op: name,
                        lhs: x.ne,
                        rhs: mask.ne,
                        why: "the mask must be [ne0, >= ne1, a divisor of ne2, a divisor of ne3]".into(),
                    });
                }
            }
            contiguous(op, DType::F32, x.ne)
        }
        Op::L2Norm { eps } => {
            expect_arity(op, inputs, 1)?;
            expect_float(op, 0, inputs[0])?;
            expect_not_quantized(op, 0, inputs[0])?;
            if !(*eps >= 0.0 && eps.is_finite()) {
                return Err(OpError::InvalidParam { op: name, why: format!("eps {eps} must be finite and >= 0") });
            }
            contiguous(op, DType::F32, inputs[0].ne)
        }
        Op::TopK { k } => {
            expect_arity(op, inputs, 1)?;
            let x = inputs[0];
            expect_float(op, 0, x)?;
            expect_not_quantized(op, 0, x)?;
            expect_indexable_rows(op, x)?;
            if *k == 0 || *k > x.ne[0] {
                return Err(OpError::InvalidParam {
                    op: name,
                    why: format!("k = {k} must be in 1..={} (the row length ne[0] of input {:?})", x.ne[0], x.ne),
                });
            }
            contiguous(op, DType::I32, [*k, x.ne[1], x.ne[2], x.ne[3]])
        }
        Op::Argsort(_) => {
            expect_arity(op, inputs, 1)?;
            let x = inputs[0];
            expect_float(op, 0, x)?;
            expect_not_quantized(op, 0, x)?;
            expect_indexable_rows(op, x)?;
            contiguous(op, DType::I32, x.ne)
        }
        _ => unreachable!("reduce::infer called for {op}"),
    }
}

/// Ops that return positions within a row as i32 need every position to fit in an i32.
fn expect_indexable_rows(op: &Op, x: &TensorMeta) -> Result<(), OpError> {
    if i32::try_from(x.ne[0]).is_err() {
        return Err(OpError::InvalidShape {
            op: op.name(),
            shape: x.ne,
            why: "rows longer than i32::MAX cannot be indexed by i32 results".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, SortOrder, TensorMeta, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    #[test]
    fn l2_norm_is_f32_of_the_input_shape() {
        let out = infer(&Op::L2Norm { eps: 1e-6 }, &[&meta(DType::BF16, [128, 16, 3, 1])]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [128, 16, 3, 1]));
        for eps in [-1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                infer(&Op::L2Norm { eps }, &[&meta(DType::F32, [4, 1, 1, 1])]),
                Err(OpError::InvalidParam { .. })
            ));
        }
        assert!(matches!(
            infer(&Op::L2Norm { eps: 0.0 }, &[&meta(DType::I32, [4, 1, 1, 1])]),
            Err(OpError::DType { .. })
        ));
    }

    #[test]
    fn top_k_and_argsort_give_i32_indices() {
        let x = meta(DType::F32, [256, 7, 2, 1]);
        let out = infer(&Op::TopK { k: 8 }, &[&x]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::I32, [8, 7, 2, 1]));
        assert_eq!(infer(&Op::TopK { k: 256 }, &[&x]).unwrap().ne, [256, 7, 2, 1]);
        for k in [0, 257] {
            assert!(matches!(infer(&Op::TopK { k }, &[&x]), Err(OpError::InvalidParam { .. })), "k = {k}");
        }
        let out = infer(&Op::Argsort(SortOrder::Descending), &[&x]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::I32, x.ne));
        assert!(matches!(
            infer(&Op::Argsort(SortOrder::Ascending), &[&meta(DType::I32, [4, 1, 1, 1])]),
            Err(OpError::DType { .. })
        ));
        assert!(matches!(infer(&Op::TopK { k: 1 }, &[&x, &x]), Err(OpError::Arity { .. })));
    }
}
