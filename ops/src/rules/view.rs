//! view, reshape, permute, transpose, bitcast: zero-copy windows onto their source's memory.

use super::expect_arity;
use crate::{Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    expect_arity(op, inputs, 1)?;
    let src = inputs[0];
    let name = op.name();
    match op {
        Op::View(v) => {
            let out = TensorMeta { dtype: src.dtype, ne: v.ne, nb: v.nb };
            if v.ne.contains(&0) {
                return Err(OpError::InvalidShape {
                    op: name,
                    shape: v.ne,
                    why: "every dimension must be at least 1".into(),
                });
            }
            let bb = src.dtype.block_size();
            if v.ne[0] % bb != 0 || v.nb[0] != src.dtype.block_bytes() || v.offset % src.dtype.block_bytes() != 0 {
                return Err(OpError::InvalidShape {
                    op: name,
                    shape: v.ne,
                    why: format!(
                        "a view must keep rows of whole {} blocks: nb[0] = {}, offset a multiple of it",
                        src.dtype,
                        src.dtype.block_bytes()
                    ),
                });
            }
            let mut needed = v.offset.checked_add(src.dtype.row_bytes(v.ne[0]).unwrap_or(usize::MAX));
            for d in 1..4 {
                needed = needed.and_then(|n| n.checked_add((v.ne[d] - 1).checked_mul(v.nb[d])?));
            }
            let available = src.span_bytes();
            match needed {
                Some(needed) if needed <= available => {}
                _ => {
                    return Err(OpError::ViewOutOfRange {
                        op: name,
                        ne: v.ne,
                        nb: v.nb,
                        offset: v.offset,
                        needed: needed.unwrap_or(usize::MAX),
                        available,
                    });
                }
            }
            if !out.is_injective() {
                return Err(OpError::OverlappingStrides { op: name, ne: v.ne, nb: v.nb });
            }
            Ok(out)
        }
        Op::Reshape { ne } => {
            if !src.is_contiguous() {
                return Err(OpError::NotContiguous { op: name, input: 0, shape: src.ne, nb: src.nb });
            }
            let count = ne.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n));
            if ne.contains(&0) || count != Some(src.nelements()) {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: src.ne,
                    rhs: *ne,
                    why: "reshape must keep the element count".into(),
                });
            }
            TensorMeta::contiguous(name, src.dtype, *ne)
        }
        Op::Permute { axes } => {
            let mut seen = [false; 4];
            for &a in axes {
                if a >= 4 || seen[a] {
                    return Err(OpError::InvalidParam {
                        op: name,
                        why: format!("axes {axes:?} must be a permutation of 0, 1, 2, 3"),
                    });
                }
                seen[a] = true;
            }
            if src.dtype.is_quantized() && axes[0] != 0 {
                return Err(OpError::InvalidParam {
                    op: name,
                    why: format!("a {} tensor cannot move dimension 0: its rows are blocks", src.dtype),
                });
            }
            let mut out = *src;
            for (i, &a) in axes.iter().enumerate() {
                out.ne[a] = src.ne[i];
                out.nb[a] = src.nb[i];
            }
            Ok(out)
        }
        Op::Transpose => {
            if src.dtype.is_quantized() {
                return Err(OpError::InvalidParam {
                    op: name,
                    why: format!("a {} tensor cannot be transposed: its rows are blocks", src.dtype),
                });
            }
            let mut out = *src;
            out.ne.swap(0, 1);
            out.nb.swap(0, 1);
            Ok(out)
        }
        Op::Bitcast(dtype) => {
            let unquantized = !src.dtype.is_quantized() && !dtype.is_quantized();
            if !unquantized || src.dtype.block_bytes() != dtype.block_bytes() {
                return Err(OpError::DType {
                    op: name,
                    input: 0,
                    dtype: src.dtype,
                    expected: "an unquantized dtype of the target's element size (f32 <-> i32, f16 <-> bf16)",
                });
            }
            Ok(TensorMeta { dtype: *dtype, ..*src })
        }
        _ => unreachable!("view::infer called for {op}"),
    }
}
