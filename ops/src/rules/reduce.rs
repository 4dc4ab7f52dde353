//! rms_norm, sum_rows, softmax, argmax: row-wise over ne[0].

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
        _ => unreachable!("reduce::infer called for {op}"),
    }
}
