//! get_rows, set_rows, cpy, cast, cont, concat, repeat.

use super::{can_repeat, contiguous, expect_arity, expect_dtype, expect_not_quantized};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    match op {
        Op::GetRows => {
            expect_arity(op, inputs, 2)?;
            let (src, ids) = (inputs[0], inputs[1]);
            expect_dtype(op, 1, ids, DType::I32, "i32 row ids")?;
            if !src.has_contiguous_rows() {
                return Err(OpError::NotContiguous { op: name, input: 0, shape: src.ne, nb: src.nb });
            }
            if ids.ne[1] != src.ne[2] || ids.ne[2] != src.ne[3] || ids.ne[3] != 1 {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: src.ne,
                    rhs: ids.ne,
                    why: "ids must be [n_rows, src.ne[2], src.ne[3], 1]".into(),
                });
            }
            let out_dtype = if src.dtype == DType::I32 { DType::I32 } else { DType::F32 };
            contiguous(op, out_dtype, [src.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]])
        }
        Op::SetRows => {
            expect_arity(op, inputs, 3)?;
            let (dst, src, ids) = (inputs[0], inputs[1], inputs[2]);
            expect_not_quantized(op, 0, dst)?;
            expect_dtype(op, 2, ids, DType::I32, "i32 row ids")?;
            if !src.dtype.is_float() || !dst.dtype.is_float() {
                let (input, m) = if src.dtype.is_float() { (0, dst) } else { (1, src) };
                return Err(OpError::DType {
                    op: name,
                    input,
                    dtype: m.dtype,
                    expected: "a float type (f32, f16, bf16)",
                });
            }
            if !dst.is_injective() {
                return Err(OpError::OverlappingStrides { op: name, ne: dst.ne, nb: dst.nb });
            }
            if src.ne[0] != dst.ne[0] || src.ne[2] != dst.ne[2] || src.ne[3] != dst.ne[3] {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: dst.ne,
                    rhs: src.ne,
                    why: "src must be [dst.ne[0], n_rows, dst.ne[2], dst.ne[3]]".into(),
                });
            }
            if ids.ne != [src.ne[1], src.ne[2], src.ne[3], 1] {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: src.ne,
                    rhs: ids.ne,
                    why: "ids must be [src.ne[1], src.ne[2], src.ne[3], 1]".into(),
                });
            }
            Ok(*dst)
        }
        Op::Cpy => {
            expect_arity(op, inputs, 2)?;
            let (src, dst) = (inputs[0], inputs[1]);
            for (i, m) in [src, dst].into_iter().enumerate() {
                expect_not_quantized(op, i, m)?;
            }
            if src.dtype.is_float() != dst.dtype.is_float() {
                return Err(OpError::DType {
                    op: name,
                    input: 1,
                    dtype: dst.dtype,
                    expected: "a float type when the source is float, i32 when it is i32",
                });
            }
            if src.nelements() != dst.nelements() {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: src.ne,
                    rhs: dst.ne,
                    why: "source and destination must have the same number of elements".into(),
                });
            }
            if !dst.is_injective() {
                return Err(OpError::OverlappingStrides { op: name, ne: dst.ne, nb: dst.nb });
            }
            Ok(*dst)
        }
        Op::Cast(to) => {
            expect_arity(op, inputs, 1)?;
            let src = inputs[0];
            expect_not_quantized(op, 0, src)?;
            if src.dtype.is_float() != to.is_float() {
                return Err(OpError::DType {
                    op: name,
                    input: 0,
                    dtype: src.dtype,
                    expected: "a dtype of the same kind (float to float, i32 to i32)",
                });
            }
            contiguous(op, *to, src.ne)
        }
        Op::Cont => {
            expect_arity(op, inputs, 1)?;
            expect_not_quantized(op, 0, inputs[0])?;
            contiguous(op, inputs[0].dtype, inputs[0].ne)
        }
        Op::Concat { dim } => {
            expect_arity(op, inputs, 2)?;
            let (a, b) = (inputs[0], inputs[1]);
            if *dim >= 4 {
                return Err(OpError::InvalidParam { op: name, why: format!("dim {dim} is out of range 0..4") });
            }
            expect_not_quantized(op, 0, a)?;
            if a.dtype != b.dtype {
                return Err(OpError::DType {
                    op: name,
                    input: 1,
                    dtype: b.dtype,
                    expected: "the same dtype as input 0",
                });
            }
            if (0..4).any(|d| d != *dim && a.ne[d] != b.ne[d]) {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: a.ne,
                    rhs: b.ne,
                    why: format!("all dimensions but {dim} must match"),
                });
            }
            let mut ne = a.ne;
            ne[*dim] = a.ne[*dim].checked_add(b.ne[*dim]).ok_or(OpError::TooLarge {
                op: name,
                shape: a.ne,
                dtype: a.dtype,
            })?;
            contiguous(op, a.dtype, ne)
        }
        Op::Repeat { ne } => {
            expect_arity(op, inputs, 1)?;
            let src = inputs[0];
            expect_not_quantized(op, 0, src)?;
            if ne.contains(&0) || !can_repeat(&src.ne, ne) {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: src.ne,
                    rhs: *ne,
                    why: "each target dimension must be a non-zero multiple of the source's".into(),
                });
            }
            contiguous(op, src.dtype, *ne)
        }
        _ => unreachable!("data::infer called for {op}"),
    }
}
