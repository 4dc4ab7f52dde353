//! rope_multi: rotary position embedding over the first `n_rot` dims of each head.
//!
//! `x [head_dim, n_head, n_tokens, 1]` (any float type, any strides: Qwen builds q as a strided
//! view into a joint q+gate projection) and `positions` i32 `[n_tokens]`, or `[4 * n_tokens]`
//! stream-major (t, h, w, e) with sections. The output is a contiguous f32 tensor of `x`'s shape.

use super::{contiguous, expect_arity, expect_dtype, expect_float, expect_not_quantized};
use crate::{DType, Op, OpError, RopeParams, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let Op::RopeMulti(p) = op else { unreachable!("rope::infer called for {op}") };
    expect_arity(op, inputs, 2)?;
    rope_rules(op, p, inputs[0], inputs[1])
}

/// rope_multi's rules on `x` and `pos` (input numbers 0 and 1), for `op` (rope_multi, or a fused
/// op ending in it).
pub(super) fn rope_rules(op: &Op, p: &RopeParams, x: &TensorMeta, pos: &TensorMeta) -> Result<TensorMeta, OpError> {
    let name = op.name();
    expect_float(op, 0, x)?;
    expect_not_quantized(op, 0, x)?;
    expect_dtype(op, 1, pos, DType::I32, "i32 positions")?;
    check_params(name, p, x.ne[0])?;
    if x.ne[3] != 1 {
        return Err(OpError::InvalidShape {
            op: name,
            shape: x.ne,
            why: "x must be [head_dim, n_head, n_tokens, 1] (ne[3] = 1)".into(),
        });
    }
    let n_tokens = x.ne[2];
    let streams = if p.sections.is_some() { 4 } else { 1 };
    let want = [streams * n_tokens, 1, 1, 1];
    if pos.ne != want {
        let why = if p.sections.is_some() {
            format!("with sections, positions must be [4 * n_tokens] = {want:?} (stream-major t, h, w, e)")
        } else {
            format!("positions must be [n_tokens] = {want:?}, one per token of x (ne[2])")
        };
        return Err(OpError::ShapeMismatch { op: name, lhs: x.ne, rhs: pos.ne, why });
    }
    contiguous(op, DType::F32, x.ne)
}

fn check_params(name: &'static str, p: &RopeParams, head_dim: usize) -> Result<(), OpError> {
    let bad = |why: String| Err(OpError::InvalidParam { op: name, why });
    if p.n_rot == 0 || !p.n_rot.is_multiple_of(2) || p.n_rot > head_dim {
        return bad(format!("n_rot {} must be even, > 0 and <= head_dim {head_dim}", p.n_rot));
    }
    if !(p.freq_base.is_finite() && p.freq_base > 0.0) {
        return bad(format!("freq_base {} must be finite and > 0", p.freq_base));
    }
    if let Some(s) = p.sections {
        let total = s.iter().try_fold(0usize, |acc, &v| acc.checked_add(v));
        if total.is_none_or(|t| t == 0) {
            return bad(format!("sections {s:?} must have a positive (finite) sum"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, RopePairing, RopeParams, TensorMeta, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    fn rope(n_rot: usize, sections: Option<[usize; 4]>) -> Op {
        Op::RopeMulti(RopeParams { n_rot, freq_base: 1e7, pairing: RopePairing::Neox, sections })
    }

    #[test]
    fn output_is_contiguous_f32_of_x_shape() {
        let x = meta(DType::BF16, [256, 16, 5, 1]);
        let out = infer(&rope(64, None), &[&x, &meta(DType::I32, [5, 1, 1, 1])]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [256, 16, 5, 1]));
        assert!(out.is_contiguous());
        let out = infer(&rope(64, Some([11, 11, 10, 0])), &[&x, &meta(DType::I32, [20, 1, 1, 1])]).unwrap();
        assert_eq!(out.ne, [256, 16, 5, 1]);
    }

    #[test]
    fn strided_x_is_accepted() {
        // q as a view into a joint q+gate projection: head stride 2 * head_dim.
        let mut x = meta(DType::F32, [128, 4, 3, 1]);
        x.nb = [4, 1024, 4096, 12288];
        assert!(infer(&rope(128, None), &[&x, &meta(DType::I32, [3, 1, 1, 1])]).is_ok());
    }

    #[test]
    fn bad_params_and_shapes_are_errors() {
        let x = meta(DType::F32, [64, 2, 3, 1]);
        let pos = meta(DType::I32, [3, 1, 1, 1]);
        for n_rot in [0, 7, 66] {
            assert!(matches!(infer(&rope(n_rot, None), &[&x, &pos]), Err(OpError::InvalidParam { .. })), "{n_rot}");
        }
        let zero_base =
            Op::RopeMulti(RopeParams { n_rot: 8, freq_base: 0.0, pairing: RopePairing::Adjacent, sections: None });
        assert!(matches!(infer(&zero_base, &[&x, &pos]), Err(OpError::InvalidParam { .. })));
        assert!(matches!(
            infer(&rope(8, Some([0, 0, 0, 0])), &[&x, &meta(DType::I32, [12, 1, 1, 1])]),
            Err(OpError::InvalidParam { .. })
        ));
        // positions: wrong length, 1 stream where 4 are needed, wrong dtype
        assert!(matches!(
            infer(&rope(8, None), &[&x, &meta(DType::I32, [4, 1, 1, 1])]),
            Err(OpError::ShapeMismatch { .. })
        ));
        assert!(matches!(infer(&rope(8, Some([1, 1, 1, 1])), &[&x, &pos]), Err(OpError::ShapeMismatch { .. })));
        assert!(matches!(
            infer(&rope(8, None), &[&x, &meta(DType::I32, [1, 3, 1, 1])]),
            Err(OpError::ShapeMismatch { .. })
        ));
        assert!(matches!(infer(&rope(8, None), &[&x, &meta(DType::F32, [3, 1, 1, 1])]), Err(OpError::DType { .. })));
        assert!(matches!(infer(&rope(8, None), &[&pos, &pos]), Err(OpError::DType { input: 0, .. })));
        assert!(matches!(
            infer(&rope(8, None), &[&meta(DType::F32, [64, 2, 3, 2]), &pos]),
            Err(OpError::InvalidShape { .. })
        ));
        assert!(matches!(infer(&rope(8, None), &[&x]), Err(OpError::Arity { .. })));
    }
}
