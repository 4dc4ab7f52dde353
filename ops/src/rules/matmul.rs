//! mul_mat.

use super::{contiguous, expect_arity, expect_dtype, expect_float};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    expect_arity(op, inputs, 2)?;
    let (a, b) = (inputs[0], inputs[1]);
    let name = op.name();
    expect_float(op, 0, a)?;
    expect_dtype(op, 1, b, DType::F32, "f32 activations")?;
    if !a.has_contiguous_rows() {
        return Err(OpError::NotContiguous { op: name, input: 0, shape: a.ne, nb: a.nb });
    }
    if a.ne[0] != b.ne[0] {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: a.ne,
            rhs: b.ne,
            why: "inner dimensions ne[0] (K) must match".into(),
        });
    }
    if b.ne[2] % a.ne[2] != 0 || b.ne[3] % a.ne[3] != 0 {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: a.ne,
            rhs: b.ne,
            why: "the weights' batch dims 2 and 3 must divide the activations'".into(),
        });
    }
    contiguous(op, DType::F32, [a.ne[1], b.ne[1], b.ne[2], b.ne[3]])
}

pub(super) fn flops(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    (2 * inputs[0].ne[0] as u64).saturating_mul(out.nelements() as u64)
}

pub(super) fn mul_mat_id_bytes(_inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    todo!("mul_mat_id cost")
}
