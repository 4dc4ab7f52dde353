//! unary, binary (broadcasting), scale, swiglu.

use super::{can_repeat, contiguous, expect_arity, expect_float};
use crate::{Op, OpError, TensorMeta, UnaryOp};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    match op {
        Op::Unary(_) | Op::Scale(_) => {
            expect_arity(op, inputs, 1)?;
            expect_float(op, 0, inputs[0])?;
            if let Op::Scale(p) = op
                && !(p.scale.is_finite() && p.bias.is_finite())
            {
                return Err(OpError::InvalidParam {
                    op: op.name(),
                    why: format!("scale {} and bias {} must be finite", p.scale, p.bias),
                });
            }
            contiguous(op, inputs[0].dtype, inputs[0].ne)
        }
        Op::Binary(_) => {
            expect_arity(op, inputs, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            expect_float(op, 0, a)?;
            expect_float(op, 1, b)?;
            if !can_repeat(&b.ne, &a.ne) {
                return Err(OpError::ShapeMismatch {
                    op: op.name(),
                    lhs: a.ne,
                    rhs: b.ne,
                    why: "each dimension of the second operand must divide the first's".into(),
                });
            }
            contiguous(op, a.dtype, a.ne)
        }
        Op::Swiglu => match inputs.len() {
            1 => {
                let x = inputs[0];
                expect_float(op, 0, x)?;
                if !x.ne[0].is_multiple_of(2) {
                    return Err(OpError::InvalidShape {
                        op: op.name(),
                        shape: x.ne,
                        why: "a fused gate+up input needs an even ne[0]".into(),
                    });
                }
                contiguous(op, x.dtype, [x.ne[0] / 2, x.ne[1], x.ne[2], x.ne[3]])
            }
            2 => {
                let (g, u) = (inputs[0], inputs[1]);
                expect_float(op, 0, g)?;
                expect_float(op, 1, u)?;
                if g.ne != u.ne {
                    return Err(OpError::ShapeMismatch {
                        op: op.name(),
                        lhs: g.ne,
                        rhs: u.ne,
                        why: "gate and up must have the same shape".into(),
                    });
                }
                contiguous(op, g.dtype, g.ne)
            }
            got => Err(OpError::Arity { op: op.name(), expected: "1 or 2", got }),
        },
        _ => unreachable!("elementwise::infer called for {op}"),
    }
}

/// Rough flops per element of a unary function (transcendentals count as a handful).
pub(super) fn unary_flops(u: UnaryOp) -> u64 {
    match u {
        UnaryOp::Neg => 1,
        UnaryOp::Exp => 4,
        UnaryOp::Sigmoid | UnaryOp::Softplus => 6,
        UnaryOp::Silu => 7,
    }
}
