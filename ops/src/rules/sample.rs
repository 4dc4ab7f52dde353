//! sample: one token id per row of f32 logits, from per-row settings (`crate::sample`).

use super::{contiguous, expect_arity, expect_dtype};
use crate::sample::MAX_VOCAB;
use crate::{DType, Op, OpError, TensorMeta};

/// `[logits f32 [n_vocab, n_rows, 1, 1] (dense rows), settings f32 [4, n_rows, 1, 1]]` ->
/// i32 `[1, n_rows, 1, 1]`.
pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    expect_arity(op, inputs, 2)?;
    let (logits, settings) = (inputs[0], inputs[1]);
    expect_dtype(op, 0, logits, DType::F32, "f32 logits")?;
    expect_dtype(op, 1, settings, DType::F32, "f32 settings (temperature, top_k, top_p, u)")?;
    if logits.ne[2] != 1 || logits.ne[3] != 1 {
        return Err(OpError::InvalidShape {
            op: name,
            shape: logits.ne,
            why: "logits must be [n_vocab, n_rows, 1, 1]".into(),
        });
    }
    if logits.ne[0] > MAX_VOCAB {
        return Err(OpError::InvalidShape {
            op: name,
            shape: logits.ne,
            why: format!("rows of more than {MAX_VOCAB} logits are not supported (exact masses need n · 2^40 < 2^64)"),
        });
    }
    if !logits.has_contiguous_rows() {
        return Err(OpError::NotContiguous { op: name, input: 0, shape: logits.ne, nb: logits.nb });
    }
    if settings.ne != [4, logits.ne[1], 1, 1] {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: logits.ne,
            rhs: settings.ne,
            why: "settings must be [4, n_rows, 1, 1]: (temperature, top_k, top_p, u) per row of logits".into(),
        });
    }
    contiguous(op, DType::I32, [1, logits.ne[1], 1, 1])
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, TensorMeta, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    #[test]
    fn one_i32_id_per_row() {
        let out = infer(&Op::Sample, &[&meta(DType::F32, [248320, 8, 1, 1]), &meta(DType::F32, [4, 8, 1, 1])]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::I32, [1, 8, 1, 1]));
    }

    #[test]
    fn bad_inputs_are_named() {
        let l = meta(DType::F32, [100, 3, 1, 1]);
        let s = meta(DType::F32, [4, 3, 1, 1]);
        let err = |inputs: &[&TensorMeta]| infer(&Op::Sample, inputs).unwrap_err();
        assert!(matches!(err(&[&l]), OpError::Arity { .. }));
        assert!(matches!(err(&[&meta(DType::F16, [100, 3, 1, 1]), &s]), OpError::DType { input: 0, .. }));
        assert!(matches!(err(&[&l, &meta(DType::I32, [4, 3, 1, 1])]), OpError::DType { input: 1, .. }));
        assert!(matches!(err(&[&meta(DType::F32, [100, 3, 2, 1]), &s]), OpError::InvalidShape { .. }));
        assert!(matches!(err(&[&l, &meta(DType::F32, [4, 2, 1, 1])]), OpError::ShapeMismatch { .. }));
        assert!(matches!(err(&[&l, &meta(DType::F32, [3, 3, 1, 1])]), OpError::ShapeMismatch { .. }));
        let huge = meta(DType::F32, [1 << 24, 1, 1, 1]);
        assert!(matches!(err(&[&huge, &meta(DType::F32, [4, 1, 1, 1])]), OpError::InvalidShape { .. }));
        let mut strided = l;
        strided.nb[0] = 8;
        strided.nb[1] = 800;
        assert!(matches!(err(&[&strided, &s]), OpError::NotContiguous { input: 0, .. }));
    }
}
