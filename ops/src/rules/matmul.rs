//! mul_mat, mul_mat_id.
//!
//! Weights (`a` of mul_mat, `as` of mul_mat_id) may be f32, f16, bf16 or block-quantized (q8_0,
//! nvfp4) and must have dense rows (`nb[0]` is one block); activations are f32 of any layout.

use super::{contiguous, expect_arity, expect_dtype};
use crate::{DType, Op, OpError, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    match op {
        Op::MulMat => mul_mat(op, inputs),
        Op::MulMatId => mul_mat_id(op, inputs),
        _ => unreachable!("matmul::infer called for {op}"),
    }
}

/// Weights: any float or block-quantized dtype, with dense rows.
fn expect_weights(op: &Op, input: usize, a: &TensorMeta) -> Result<(), OpError> {
    if !a.dtype.is_float() {
        return Err(OpError::DType {
            op: op.name(),
            input,
            dtype: a.dtype,
            expected: "float or block-quantized weights (f32, f16, bf16, q8_0, nvfp4)",
        });
    }
    if !a.has_contiguous_rows() {
        return Err(OpError::NotContiguous { op: op.name(), input, shape: a.ne, nb: a.nb });
    }
    Ok(())
}

pub(super) fn mul_mat(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    expect_arity(op, inputs, 2)?;
    let (a, b) = (inputs[0], inputs[1]);
    let name = op.name();
    expect_weights(op, 0, a)?;
    expect_dtype(op, 1, b, DType::F32, "f32 activations")?;
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

/// `as [K, N, n_expert, 1]`, `b [K, n_b, n_tokens, 1]` f32, `ids [n_used, n_tokens, 1, 1]` i32
/// with `n_used` a multiple of `n_b` (ggml's rule; in practice `n_b` is `n_used` or 1) ->
/// f32 `[N, n_used, n_tokens, 1]`.
pub(super) fn mul_mat_id(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    expect_arity(op, inputs, 3)?;
    let (w, b, ids) = (inputs[0], inputs[1], inputs[2]);
    let name = op.name();
    expect_weights(op, 0, w)?;
    expect_dtype(op, 1, b, DType::F32, "f32 activations")?;
    expect_dtype(op, 2, ids, DType::I32, "i32 expert ids")?;
    if w.ne[3] != 1 {
        return Err(OpError::InvalidShape {
            op: name,
            shape: w.ne,
            why: "expert weights must be 3-D [K, N, n_expert, 1]".into(),
        });
    }
    if b.ne[3] != 1 {
        return Err(OpError::InvalidShape {
            op: name,
            shape: b.ne,
            why: "activations must be 3-D [K, n_b, n_tokens, 1]".into(),
        });
    }
    if w.ne[0] != b.ne[0] {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: w.ne,
            rhs: b.ne,
            why: "inner dimensions ne[0] (K) of the experts and the activations must match".into(),
        });
    }
    if ids.ne[2] != 1 || ids.ne[3] != 1 || ids.ne[1] != b.ne[2] {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: b.ne,
            rhs: ids.ne,
            why: "ids must be [n_used, n_tokens, 1, 1] with n_tokens = b.ne[2]".into(),
        });
    }
    if !ids.ne[0].is_multiple_of(b.ne[1]) {
        return Err(OpError::ShapeMismatch {
            op: name,
            lhs: b.ne,
            rhs: ids.ne,
            why: "b.ne[1] must be 1 or n_used (ids.ne[0]), or divide n_used".into(),
        });
    }
    contiguous(op, DType::F32, [w.ne[1], ids.ne[0], ids.ne[1], 1])
}

/// `2 K` per output element (mul_mat and mul_mat_id alike).
pub(super) fn flops(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    (2 * inputs[0].ne[0] as u64).saturating_mul(out.nelements() as u64)
}

/// Bytes of mul_mat_id: the routed experts' weights (each distinct expert read once), the
/// activations, the ids and the output. The cost model does not see the ids, so the distinct
/// experts are their expected number when each of the T tokens routes to n_used distinct experts
/// drawn uniformly from n (as test-ops' cases do): `n (1 - (1 - n_used / n)^T)`, exactly n_used at
/// one token and n when the tokens route to every expert on average (256 experts top-8: 8 at one
/// token, 163.3 at 32, 255.9 at 512). Skewed routing reads fewer.
pub(super) fn mul_mat_id_bytes(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let (w, b, ids) = (inputs[0], inputs[1], inputs[2]);
    let size = |m: &TensorMeta| m.nbytes_contiguous() as u64;
    let expert = (w.row_bytes() as u64).saturating_mul(w.ne[1] as u64);
    expert
        .saturating_mul(expected_distinct_experts(w.ne[2], ids.ne[0], ids.nelements() / ids.ne[0].max(1)))
        .saturating_add(size(b))
        .saturating_add(size(ids))
        .saturating_add(size(out))
}

/// The expected number of distinct experts (rounded to the nearest) that `tokens` tokens touch when
/// each takes `n_used` distinct experts of `n` uniformly at random.
fn expected_distinct_experts(n: usize, n_used: usize, tokens: usize) -> u64 {
    if n == 0 || n_used >= n {
        return n as u64;
    }
    let unused = (1.0 - n_used as f64 / n as f64).powf(tokens as f64);
    (n as f64 * (1.0 - unused)).round() as u64
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, TensorMeta, cost, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    #[test]
    fn routed_experts_are_their_expected_number_under_uniform_routing() {
        use super::expected_distinct_experts as e;
        assert_eq!(e(256, 8, 1), 8);
        assert_eq!(e(256, 8, 32), 163); // 256 (1 - (31/32)^32) = 163.3
        assert_eq!(e(256, 8, 512), 256);
        assert_eq!(e(8, 8, 3), 8);
        assert_eq!(e(4, 6, 1), 4); // more slots than experts: every expert
        assert_eq!(e(64, 8, 0), 0);
    }

    #[test]
    fn mul_mat_takes_quantized_weights_with_dense_rows() {
        for dt in [DType::Q8_0, DType::NvFp4] {
            let a = meta(dt, [128, 7, 1, 1]);
            let b = meta(DType::F32, [128, 3, 1, 1]);
            let y = infer(&Op::MulMat, &[&a, &b]).unwrap();
            assert_eq!((y.dtype, y.ne), (DType::F32, [7, 3, 1, 1]));
            assert!(matches!(infer(&Op::MulMat, &[&b, &a]), Err(OpError::DType { input: 1, .. })));
        }
        let i = meta(DType::I32, [4, 4, 1, 1]);
        let b = meta(DType::F32, [4, 1, 1, 1]);
        assert!(matches!(infer(&Op::MulMat, &[&i, &b]), Err(OpError::DType { input: 0, .. })));
    }

    #[test]
    fn mul_mat_id_shapes() {
        let w = meta(DType::Q8_0, [64, 10, 8, 1]);
        let ids = meta(DType::I32, [4, 3, 1, 1]);
        for n_b in [1, 2, 4] {
            let b = meta(DType::F32, [64, n_b, 3, 1]);
            let y = infer(&Op::MulMatId, &[&w, &b, &ids]).unwrap();
            assert_eq!((y.dtype, y.ne), (DType::F32, [10, 4, 3, 1]));
        }
        let bad = |w: &TensorMeta, b: &TensorMeta, ids: &TensorMeta| infer(&Op::MulMatId, &[w, b, ids]).unwrap_err();
        let b = meta(DType::F32, [64, 1, 3, 1]);
        let e = bad(&w, &meta(DType::F32, [64, 3, 3, 1]), &ids);
        assert!(e.to_string().contains("divide n_used"), "{e}");
        let e = bad(&w, &meta(DType::F32, [64, 1, 2, 1]), &ids);
        assert!(e.to_string().contains("n_tokens"), "{e}");
        let e = bad(&meta(DType::F32, [32, 10, 8, 1]), &b, &ids);
        assert!(e.to_string().contains("K"), "{e}");
        assert!(matches!(bad(&meta(DType::F32, [64, 10, 8, 2]), &b, &ids), OpError::InvalidShape { .. }));
        assert!(matches!(bad(&w, &meta(DType::F32, [64, 1, 3, 2]), &ids), OpError::InvalidShape { .. }));
        assert!(matches!(bad(&w, &b, &meta(DType::F32, [4, 3, 1, 1])), OpError::DType { input: 2, .. }));
        assert!(matches!(bad(&w, &meta(DType::F16, [64, 1, 3, 1]), &ids), OpError::DType { input: 1, .. }));
        assert!(matches!(infer(&Op::MulMatId, &[&w, &b]), Err(OpError::Arity { .. })));
    }

    #[test]
    fn mul_mat_id_reads_only_routed_experts() {
        // 16 experts of 512 x 2048 q8_0 (row 2048 / 32 * 34 = 2176 bytes); 8 used, 1 token.
        let w = meta(DType::Q8_0, [2048, 512, 16, 1]);
        let b = meta(DType::F32, [2048, 1, 1, 1]);
        let ids = meta(DType::I32, [8, 1, 1, 1]);
        let out = infer(&Op::MulMatId, &[&w, &b, &ids]).unwrap();
        let c = cost(&Op::MulMatId, &[&w, &b, &ids], &out);
        let expert = 2176 * 512;
        assert_eq!(c.bytes, 8 * expert + 2048 * 4 + 8 * 4 + 512 * 8 * 4);
        assert_eq!(c.flops, 2 * 2048 * 512 * 8);
        // 3 tokens of 8 of 16 experts: 16 (1 - (1/2)^3) = 14 distinct experts expected, each once.
        let ids = meta(DType::I32, [8, 3, 1, 1]);
        let b = meta(DType::F32, [2048, 1, 3, 1]);
        let out = infer(&Op::MulMatId, &[&w, &b, &ids]).unwrap();
        let c = cost(&Op::MulMatId, &[&w, &b, &ids], &out);
        assert_eq!(c.bytes, 14 * expert + 3 * 2048 * 4 + 24 * 4 + 512 * 24 * 4);
    }
}
