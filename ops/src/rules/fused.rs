//! Fused ops: add_rms_norm_mul, rms_norm_mul, rms_norm_mul_rope, gated_rms_norm, softmax_top_k,
//! moe_weights, moe_router, mul_mat_swiglu, mul_mat_id_swiglu, mul_mat_id_weighted_sum, gated_delta_net_fused.
//!
//! Each is defined by the subgraph it replaces (docs/OPS.md, "Fused ops"), so its rules are that
//! subgraph's rules narrowed to what the fusion passes emit: f32 everywhere (the composition would
//! round to a half input's dtype in between), dense rows for the normalised activations (what the
//! CUDA kernels read without a per-element stride), and the router's `[n_expert, n_tokens]`
//! logits. The gate-and-up projections take mul_mat's / mul_mat_id's rules on each weight, the
//! two weights of one dtype and shape. A pass that meets anything else leaves the subgraph
//! unfused.

use super::{can_repeat, contiguous, expect_arity, expect_arity_in, expect_dtype};
use crate::{DType, GatedDeltaNetFusedParams, Op, OpError, RmsNormParams, TensorMeta};

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    match op {
        Op::AddRmsNormMul(p) => {
            expect_arity(op, inputs, 3)?;
            let (a, b, w) = (inputs[0], inputs[1], inputs[2]);
            expect_eps(op, p)?;
            expect_rows(op, 0, a)?;
            expect_rows(op, 1, b)?;
            if a.ne != b.ne {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: a.ne,
                    rhs: b.ne,
                    why: "the two addends must have the same shape".into(),
                });
            }
            if a.ne[2] != 1 || a.ne[3] != 1 {
                return Err(OpError::InvalidShape {
                    op: name,
                    shape: a.ne,
                    why: "the addends must be [E, n, 1, 1] (the output stacks s and the norm as dim 2)".into(),
                });
            }
            expect_weight(op, 2, w, a)?;
            contiguous(op, DType::F32, [a.ne[0], a.ne[1], 2, 1])
        }
        Op::RmsNormMul(p) => {
            expect_arity(op, inputs, 2)?;
            let (x, w) = (inputs[0], inputs[1]);
            expect_eps(op, p)?;
            expect_rows(op, 0, x)?;
            expect_weight(op, 1, w, x)?;
            contiguous(op, DType::F32, x.ne)
        }
        Op::RmsNormMulRope(p) => {
            expect_arity(op, inputs, 3)?;
            let (x, w, pos) = (inputs[0], inputs[1], inputs[2]);
            expect_eps(op, &p.norm)?;
            expect_rows(op, 0, x)?;
            expect_weight(op, 1, w, x)?;
            // rope_multi's rules on the normalised tensor (f32, x's shape) and the positions.
            let normed = contiguous(op, DType::F32, x.ne)?;
            super::rope::rope_rules(op, &p.rope, &normed, pos).map_err(|e| match e {
                OpError::DType { op, input: 1, dtype, expected } => OpError::DType { op, input: 2, dtype, expected },
                e => e,
            })
        }
        Op::GatedDeltaNetFused(p) => delta_net_fused(op, p, inputs),
        Op::GatedRmsNorm(p) => {
            expect_arity(op, inputs, 3)?;
            let (x, w, z) = (inputs[0], inputs[1], inputs[2]);
            expect_eps(op, p)?;
            expect_rows(op, 0, x)?;
            expect_weight(op, 1, w, x)?;
            expect_rows(op, 2, z)?;
            if z.ne != x.ne {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: x.ne,
                    rhs: z.ne,
                    why: "the gate z must have x's shape".into(),
                });
            }
            contiguous(op, DType::F32, x.ne)
        }
        Op::SoftmaxTopK { k } => {
            expect_arity_in(op, inputs, 1..=2, "1 or 2")?;
            top_k_ids(op, *k, inputs[0], inputs.get(1).copied())
        }
        Op::MoeRouter { k } => {
            let (logits, tail, gate) = match inputs {
                [logits] => (*logits, None, None),
                [logits, tail, gate] => (*logits, Some(*tail), Some(*gate)),
                _ => return Err(OpError::Arity { op: name, expected: "1 or 3", got: inputs.len() }),
            };
            let ids = top_k_ids(op, *k, logits, tail)?;
            if let (Some(tail), Some(gate)) = (tail, gate) {
                expect_dtype(op, 2, gate, DType::F32, "f32 gate logits")?;
                if gate.ne != tail.ne {
                    return Err(OpError::ShapeMismatch {
                        op: name,
                        lhs: tail.ne,
                        rhs: gate.ne,
                        why: "the gate logits must have the appended ids' shape [m, n_tokens, 1, 1]".into(),
                    });
                }
            }
            contiguous(op, DType::I32, [ids.ne[0], ids.ne[1], 2, 1])
        }
        Op::MoeWeights => {
            expect_arity_in(op, inputs, 2..=3, "2 or 3")?;
            let (logits, ids) = (inputs[0], inputs[1]);
            expect_logits(op, logits)?;
            expect_dtype(op, 1, ids, DType::I32, "i32 expert ids")?;
            if ids.ne[1] != logits.ne[1] || ids.ne[2] != 1 || ids.ne[3] != 1 {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: logits.ne,
                    rhs: ids.ne,
                    why: "ids must be [k, n_tokens, 1, 1] for logits [n_expert, n_tokens, 1, 1]".into(),
                });
            }
            // The optional gate: one logit a token whose sigmoid is appended after the k weights.
            let gated = match inputs.get(2) {
                Some(gate) => {
                    expect_dtype(op, 2, gate, DType::F32, "f32 gate logits")?;
                    if gate.ne != [1, logits.ne[1], 1, 1] {
                        return Err(OpError::ShapeMismatch {
                            op: name,
                            lhs: logits.ne,
                            rhs: gate.ne,
                            why: "the gate must be [1, n_tokens, 1, 1] for logits [n_expert, n_tokens, 1, 1]".into(),
                        });
                    }
                    1
                }
                None => 0,
            };
            contiguous(op, DType::F32, [1, ids.ne[0] + gated, ids.ne[1], 1])
        }
        Op::MulMatSwiglu => {
            expect_arity(op, inputs, 3)?;
            expect_gate_up(op, inputs[0], inputs[1])?;
            super::matmul::mul_mat(op, &[inputs[0], inputs[2]]).map_err(past_up)
        }
        Op::MulMatIdSwiglu => {
            expect_arity(op, inputs, 4)?;
            expect_gate_up(op, inputs[0], inputs[1])?;
            super::matmul::mul_mat_id(op, &[inputs[0], inputs[2], inputs[3]]).map_err(past_up)
        }
        Op::MulMatIdWeightedSum => {
            expect_arity(op, inputs, 4)?;
            let y = super::matmul::mul_mat_id(op, &inputs[..3])?; // [N, n_used, n_tokens]
            let w = inputs[3];
            expect_dtype(op, 3, w, DType::F32, "f32 router weights")?;
            if w.ne != [1, y.ne[1], y.ne[2], 1] {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: y.ne,
                    rhs: w.ne,
                    why: "the router weights must be [1, n_used, n_tokens, 1]".into(),
                });
            }
            contiguous(op, DType::F32, [y.ne[0], y.ne[2], 1, 1])
        }
        _ => unreachable!("fused::infer called for {op}"),
    }
}

/// The gate and up weights: one dtype and one shape (each then takes the matmul's rules).
fn expect_gate_up(op: &Op, wg: &TensorMeta, wu: &TensorMeta) -> Result<(), OpError> {
    if wg.dtype != wu.dtype {
        return Err(OpError::DType { op: op.name(), input: 1, dtype: wu.dtype, expected: "the gate weight's dtype" });
    }
    if wg.ne != wu.ne {
        return Err(OpError::ShapeMismatch {
            op: op.name(),
            lhs: wg.ne,
            rhs: wu.ne,
            why: "the gate and up weights must have one shape".into(),
        });
    }
    Ok(())
}

/// An error of the matmul rule on `[wg, x(, ids)]` with the fused op's input numbers: the
/// activations and ids come after the up weight.
fn past_up(e: OpError) -> OpError {
    match e {
        OpError::DType { op, input, dtype, expected } if input > 0 => {
            OpError::DType { op, input: input + 1, dtype, expected }
        }
        OpError::NotContiguous { op, input, shape, nb } if input > 0 => {
            OpError::NotContiguous { op, input: input + 1, shape, nb }
        }
        e => e,
    }
}

/// gated_delta_net_fused (`[qk, v, alpha, dt_bias, a, beta, state, slots, seq_offsets?]`): the
/// preparation's inputs checked here (qk f32 with dense rows and an even head count, alpha and
/// beta f32 `[H_v, n_t, n_seq, 1]`, dt_bias and a f32 broadcasting to alpha, eps as l2_norm's),
/// then gated_delta_net's rules on what the preparation gives (q, k contiguous f32 `[S_k, H_k,
/// n_t, n_seq]`, g and beta `[1, H_v, n_t, n_seq]`), their errors renumbered to these inputs.
fn delta_net_fused(op: &Op, p: &GatedDeltaNetFusedParams, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    let expected = if p.net.ragged {
        "9 (qk, v, alpha, dt_bias, a, beta, state, slots, seq_offsets)"
    } else {
        "8 (qk, v, alpha, dt_bias, a, beta, state, slots)"
    };
    if inputs.len() != if p.net.ragged { 9 } else { 8 } {
        return Err(OpError::Arity { op: name, expected, got: inputs.len() });
    }
    if !(p.eps >= 0.0 && p.eps.is_finite()) {
        return Err(OpError::InvalidParam { op: name, why: format!("eps {} must be finite and >= 0", p.eps) });
    }
    let (qk, v, alpha, dt_bias, a, beta) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]);
    expect_rows(op, 0, qk)?;
    let [s_k, two_h_k, n_t, n_seq] = qk.ne;
    if two_h_k == 0 || !two_h_k.is_multiple_of(2) {
        let why = "qk must hold q's and k's heads side by side: [S_k, 2 H_k, n_t, n_seq]".into();
        return Err(OpError::InvalidShape { op: name, shape: qk.ne, why });
    }
    expect_dtype(op, 1, v, DType::F32, "f32")?;
    let per_head = [v.ne[1], n_t, n_seq, 1];
    for (i, m) in [(2, alpha), (5, beta)] {
        expect_dtype(op, i, m, DType::F32, "f32")?;
        if m.ne != per_head {
            let why = format!("alpha and beta must be [H_v, n_t, n_seq, 1] = {per_head:?}");
            return Err(OpError::ShapeMismatch { op: name, lhs: v.ne, rhs: m.ne, why });
        }
    }
    for (i, m) in [(3, dt_bias), (4, a)] {
        expect_dtype(op, i, m, DType::F32, "f32")?;
        if !can_repeat(&m.ne, &alpha.ne) {
            let why = "each dimension of dt_bias and a must divide alpha's".into();
            return Err(OpError::ShapeMismatch { op: name, lhs: alpha.ne, rhs: m.ne, why });
        }
    }
    // What the preparation gives the delta rule.
    let q = contiguous(op, DType::F32, [s_k, two_h_k / 2, n_t, n_seq])?;
    let g = contiguous(op, DType::F32, [1, v.ne[1], n_t, n_seq])?;
    let mut rule_inputs = vec![&q, &q, v, &g, &g];
    rule_inputs.extend_from_slice(&inputs[6..]);
    // gated_delta_net's input i is this op's input FROM[i].
    const FROM: [usize; 8] = [0, 0, 1, 2, 5, 6, 7, 8];
    super::delta_net::rules(op, &p.net, &rule_inputs).map_err(|e| match e {
        OpError::DType { op, input, dtype, expected } => OpError::DType { op, input: FROM[input], dtype, expected },
        OpError::NotContiguous { op, input, shape, nb } => OpError::NotContiguous { op, input: FROM[input], shape, nb },
        e => e,
    })
}

/// rms_norm's rule: eps finite and non-negative.
fn expect_eps(op: &Op, p: &RmsNormParams) -> Result<(), OpError> {
    if !(p.eps >= 0.0 && p.eps.is_finite()) {
        return Err(OpError::InvalidParam { op: op.name(), why: format!("eps {} must be finite and >= 0", p.eps) });
    }
    Ok(())
}

/// f32 with dense rows (`nb[0] = 4`), any outer strides.
fn expect_rows(op: &Op, input: usize, m: &TensorMeta) -> Result<(), OpError> {
    expect_dtype(op, input, m, DType::F32, "f32")?;
    if !m.has_contiguous_rows() {
        return Err(OpError::NotContiguous { op: op.name(), input, shape: m.ne, nb: m.nb });
    }
    Ok(())
}

/// The norm weight: f32, any strides, broadcasting to `x` (ggml's repeat rule, as `mul` takes it).
fn expect_weight(op: &Op, input: usize, w: &TensorMeta, x: &TensorMeta) -> Result<(), OpError> {
    expect_dtype(op, input, w, DType::F32, "an f32 weight")?;
    if !can_repeat(&w.ne, &x.ne) {
        return Err(OpError::ShapeMismatch {
            op: op.name(),
            lhs: x.ne,
            rhs: w.ne,
            why: "each dimension of the weight must divide the normalised tensor's".into(),
        });
    }
    Ok(())
}

/// Router logits: f32 `[n_expert, n_tokens, 1, 1]`, any strides, rows indexable by i32.
fn expect_logits(op: &Op, logits: &TensorMeta) -> Result<(), OpError> {
    expect_dtype(op, 0, logits, DType::F32, "f32 logits")?;
    if logits.ne[2] != 1 || logits.ne[3] != 1 {
        return Err(OpError::InvalidShape {
            op: op.name(),
            shape: logits.ne,
            why: "logits must be [n_expert, n_tokens, 1, 1]".into(),
        });
    }
    if i32::try_from(logits.ne[0]).is_err() {
        return Err(OpError::InvalidShape {
            op: op.name(),
            shape: logits.ne,
            why: "rows longer than i32::MAX cannot be indexed by i32 expert ids".into(),
        });
    }
    Ok(())
}

/// `top_k(softmax(logits), k)`'s ids, then `tail`'s appended (softmax_top_k, moe_router).
fn top_k_ids(op: &Op, k: usize, logits: &TensorMeta, tail: Option<&TensorMeta>) -> Result<TensorMeta, OpError> {
    let name = op.name();
    expect_logits(op, logits)?;
    if k == 0 || k > logits.ne[0] {
        return Err(OpError::InvalidParam {
            op: name,
            why: format!("k = {k} must be in 1..={} (n_expert, ne[0] of logits {:?})", logits.ne[0], logits.ne),
        });
    }
    // The optional tail: rows of ids appended after each token's k (a shared expert).
    let tail = match tail {
        Some(tail) => {
            expect_dtype(op, 1, tail, DType::I32, "i32 ids to append")?;
            if tail.ne[1] != logits.ne[1] || tail.ne[2] != 1 || tail.ne[3] != 1 {
                return Err(OpError::ShapeMismatch {
                    op: name,
                    lhs: logits.ne,
                    rhs: tail.ne,
                    why: "the appended ids must be [m, n_tokens, 1, 1] for logits [n_expert, n_tokens, 1, 1]".into(),
                });
            }
            tail.ne[0]
        }
        None => 0,
    };
    contiguous(op, DType::I32, [k + tail, logits.ne[1], 1, 1])
}

/// Flops of a fused op: the sum of the ops it replaces (rules/mod.rs counts: add / mul 1,
/// rms_norm 3, silu 7 per element; softmax 5 and top_k 8 per logit; sum_rows 1 and div 1 per
/// selected weight).
pub(super) fn flops(op: &Op, inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let n_in = inputs[0].nelements() as u64;
    match op {
        Op::AddRmsNormMul(_) => n_in.saturating_mul(5),
        Op::RmsNormMul(_) => n_in.saturating_mul(4),
        // rms_norm_mul's 4 per element, then rope_multi's 6 per rotated element
        Op::RmsNormMulRope(p) => n_in
            .saturating_mul(4)
            .saturating_add(n_in.saturating_mul(6).saturating_mul(p.rope.n_rot as u64) / inputs[0].ne[0].max(1) as u64),
        Op::GatedRmsNorm(_) => n_in.saturating_mul(12),
        Op::SoftmaxTopK { .. } => n_in.saturating_mul(13),
        // softmax_top_k's, then 2 a weight to sum and divide (the gates' sigmoids counted so)
        Op::MoeRouter { .. } => n_in.saturating_mul(13).saturating_add((out.nelements() as u64 / 2).saturating_mul(2)),
        // (the gate's sigmoid, when there is one, counted as a weight)
        Op::MoeWeights => n_in.saturating_mul(5).saturating_add((out.nelements() as u64).saturating_mul(2)),
        // the product's 2 K per expert output, then 2 to weigh and sum it
        Op::MulMatIdWeightedSum => {
            let slots = inputs[2].ne[0] as u64;
            (2 * inputs[0].ne[0] as u64 + 2).saturating_mul(slots).saturating_mul(out.nelements() as u64)
        }
        // two products of 2 K per output element, then swiglu's 6
        Op::MulMatSwiglu | Op::MulMatIdSwiglu => {
            (4 * inputs[0].ne[0] as u64 + 6).saturating_mul(out.nelements() as u64)
        }
        // l2_norm's 3 per q/k element, add 1, softplus and sigmoid as the unary ops, mul 1 per
        // alpha/beta element, then the delta rule's 7 S_k per output element
        Op::GatedDeltaNetFused(_) => {
            use super::elementwise::unary_flops;
            use crate::UnaryOp;
            let per_head = inputs[2].nelements() as u64;
            let prep = 2 + unary_flops(UnaryOp::Softplus) + unary_flops(UnaryOp::Sigmoid);
            n_in.saturating_mul(3)
                .saturating_add(per_head.saturating_mul(prep))
                .saturating_add((out.nelements() as u64).saturating_mul(inputs[0].ne[0] as u64).saturating_mul(7))
        }
        _ => unreachable!("fused::flops called for {op}"),
    }
}

/// gated_delta_net_fused's bytes: every input but the state and the output once, plus the state
/// of the `n_seq` named slots read and written (gated_delta_net's rule).
pub(super) fn delta_net_fused_bytes(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    const STATE: usize = 6;
    let size = |m: &TensorMeta| m.nbytes_contiguous() as u64;
    let streamed =
        inputs.iter().enumerate().filter(|&(i, _)| i != STATE).fold(0u64, |acc, (_, m)| acc.saturating_add(size(m)));
    let state = inputs[STATE];
    let per_slot = size(state) / state.ne[3].max(1) as u64;
    let n_seq = inputs[STATE + 1].ne[0] as u64;
    streamed.saturating_add(size(out)).saturating_add(per_slot.saturating_mul(n_seq).saturating_mul(2))
}

#[cfg(test)]
mod tests {
    use crate::{DType, Op, OpError, RmsNormParams, TensorMeta, cost, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    fn f32s(ne: [usize; 4]) -> TensorMeta {
        meta(DType::F32, ne)
    }

    const P: RmsNormParams = RmsNormParams { eps: 1e-6 };

    #[test]
    fn rms_norm_mul_rope_takes_the_norm_and_the_rope_rules() {
        use crate::{RmsNormMulRopeParams, RopePairing, RopeParams};
        let rope =
            RopeParams { n_rot: 64, freq_base: 1e7, pairing: RopePairing::Neox, sections: Some([11, 11, 10, 0]) };
        let op = Op::RmsNormMulRope(RmsNormMulRopeParams { norm: P, rope });
        // q as a view into a joint q+gate projection: dense rows, head stride 2 * head_dim
        let mut x = f32s([256, 16, 5, 1]);
        x.nb = [4, 2048, 2048 * 16, 2048 * 16 * 5];
        let (w, pos) = (f32s([256, 1, 1, 1]), meta(DType::I32, [20, 1, 1, 1]));
        let out = infer(&op, &[&x, &w, &pos]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [256, 16, 5, 1]));
        assert!(out.is_contiguous());
        let err = |inputs: &[&TensorMeta]| infer(&op, inputs).unwrap_err();
        assert!(matches!(err(&[&x, &w]), OpError::Arity { .. }));
        assert!(matches!(err(&[&x, &w, &meta(DType::I32, [5, 1, 1, 1])]), OpError::ShapeMismatch { .. }));
        assert!(matches!(err(&[&x, &w, &meta(DType::F32, [20, 1, 1, 1])]), OpError::DType { input: 2, .. }));
        assert!(matches!(err(&[&x, &f32s([100, 1, 1, 1]), &pos]), OpError::ShapeMismatch { .. }));
        assert!(matches!(err(&[&meta(DType::F16, x.ne), &w, &pos]), OpError::DType { input: 0, .. }));
        let mut t = x;
        t.nb[0] = 8;
        assert!(matches!(err(&[&t, &w, &pos]), OpError::NotContiguous { input: 0, .. }));
        let bad_rot = Op::RmsNormMulRope(RmsNormMulRopeParams { norm: P, rope: RopeParams { n_rot: 258, ..rope } });
        assert!(matches!(infer(&bad_rot, &[&x, &w, &pos]), Err(OpError::InvalidParam { .. })));
        let c = cost(&op, &[&x, &w, &pos], &out);
        let n = (256 * 16 * 5) as u64;
        assert_eq!(c.flops, 4 * n + 6 * n * 64 / 256);
    }

    #[test]
    fn add_rms_norm_mul_stacks_both_results() {
        let op = Op::AddRmsNormMul(P);
        let (a, w) = (f32s([2048, 7, 1, 1]), f32s([2048, 1, 1, 1]));
        let out = infer(&op, &[&a, &a, &w]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [2048, 7, 2, 1]));
        assert!(out.is_contiguous());
        let err = |inputs: &[&TensorMeta]| infer(&op, inputs).unwrap_err();
        assert!(matches!(err(&[&a, &a]), OpError::Arity { .. }));
        assert!(matches!(err(&[&a, &f32s([2048, 6, 1, 1]), &w]), OpError::ShapeMismatch { .. }));
        let a3 = f32s([2048, 7, 2, 1]);
        assert!(matches!(err(&[&a3, &a3, &w]), OpError::InvalidShape { .. }));
        assert!(matches!(err(&[&a, &meta(DType::F16, [2048, 7, 1, 1]), &w]), OpError::DType { input: 1, .. }));
        assert!(matches!(err(&[&a, &a, &f32s([1000, 1, 1, 1])]), OpError::ShapeMismatch { .. }));
        let mut strided = a;
        strided.nb = [8, 8 * 2048, 8 * 2048 * 7, 8 * 2048 * 7];
        assert!(matches!(err(&[&a, &strided, &w]), OpError::NotContiguous { input: 1, .. }));
        let bad = Op::AddRmsNormMul(RmsNormParams { eps: f32::NAN });
        assert!(matches!(infer(&bad, &[&a, &a, &w]), Err(OpError::InvalidParam { .. })));
        // rows apart (a window) are fine: only nb[0] must be dense
        let mut window = a;
        window.nb[1] = 4 * 2050;
        assert!(infer(&op, &[&window, &a, &w]).is_ok());
    }

    #[test]
    fn rms_norm_mul_and_gated_norm_keep_the_shape() {
        let x = f32s([128, 32, 5, 1]);
        for w in [[128, 1, 1, 1], [128, 32, 1, 1], [1, 1, 1, 1], [64, 1, 5, 1]] {
            let out = infer(&Op::RmsNormMul(P), &[&x, &f32s(w)]).unwrap();
            assert_eq!((out.dtype, out.ne), (DType::F32, x.ne));
            let out = infer(&Op::GatedRmsNorm(P), &[&x, &f32s(w), &x]).unwrap();
            assert_eq!((out.dtype, out.ne), (DType::F32, x.ne));
        }
        let w = f32s([128, 1, 1, 1]);
        assert!(matches!(infer(&Op::RmsNormMul(P), &[&x, &f32s([96, 1, 1, 1])]), Err(OpError::ShapeMismatch { .. })));
        assert!(matches!(infer(&Op::RmsNormMul(P), &[&x]), Err(OpError::Arity { .. })));
        assert!(matches!(
            infer(&Op::RmsNormMul(P), &[&meta(DType::BF16, x.ne), &w]),
            Err(OpError::DType { input: 0, .. })
        ));
        assert!(matches!(
            infer(&Op::RmsNormMul(P), &[&x, &meta(DType::F16, w.ne)]),
            Err(OpError::DType { input: 1, .. })
        ));
        let mut t = x;
        t.nb = [512, 4, 4 * 128 * 32, 4 * 128 * 32 * 5];
        assert!(matches!(infer(&Op::RmsNormMul(P), &[&t, &w]), Err(OpError::NotContiguous { input: 0, .. })));
        assert!(matches!(infer(&Op::GatedRmsNorm(P), &[&x, &w, &t]), Err(OpError::NotContiguous { input: 2, .. })));
        assert!(matches!(
            infer(&Op::GatedRmsNorm(P), &[&x, &w, &f32s([128, 32, 4, 1])]),
            Err(OpError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            infer(&Op::GatedRmsNorm(RmsNormParams { eps: -1.0 }), &[&x, &w, &x]),
            Err(OpError::InvalidParam { .. })
        ));
    }

    #[test]
    fn router_ops_give_ids_and_weights() {
        let logits = f32s([256, 9, 1, 1]);
        let ids = meta(DType::I32, [8, 9, 1, 1]);
        let out = infer(&Op::SoftmaxTopK { k: 8 }, &[&logits]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::I32, [8, 9, 1, 1]));
        let out = infer(&Op::MoeWeights, &[&logits, &ids]).unwrap();
        assert_eq!((out.dtype, out.ne), (DType::F32, [1, 8, 9, 1]));
        for k in [0, 257] {
            assert!(matches!(infer(&Op::SoftmaxTopK { k }, &[&logits]), Err(OpError::InvalidParam { .. })));
        }
        let l3 = f32s([256, 9, 2, 1]);
        assert!(matches!(infer(&Op::SoftmaxTopK { k: 8 }, &[&l3]), Err(OpError::InvalidShape { .. })));
        assert!(matches!(infer(&Op::MoeWeights, &[&l3, &ids]), Err(OpError::InvalidShape { .. })));
        assert!(matches!(
            infer(&Op::SoftmaxTopK { k: 8 }, &[&meta(DType::F16, logits.ne)]),
            Err(OpError::DType { input: 0, .. })
        ));
        assert!(matches!(
            infer(&Op::MoeWeights, &[&logits, &f32s([8, 9, 1, 1])]),
            Err(OpError::DType { input: 1, .. })
        ));
        assert!(matches!(
            infer(&Op::MoeWeights, &[&logits, &meta(DType::I32, [8, 8, 1, 1])]),
            Err(OpError::ShapeMismatch { .. })
        ));
        assert!(matches!(infer(&Op::MoeWeights, &[&logits]), Err(OpError::Arity { .. })));
    }

    #[test]
    fn costs_are_the_sums_of_the_replaced_ops() {
        let a = f32s([64, 3, 1, 1]);
        let w = f32s([64, 1, 1, 1]);
        let op = Op::AddRmsNormMul(P);
        let out = infer(&op, &[&a, &a, &w]).unwrap();
        let c = cost(&op, &[&a, &a, &w], &out);
        assert_eq!(c.flops, 5 * 192);
        assert_eq!(c.bytes, (192 + 192 + 64 + 384) * 4);
        let logits = f32s([256, 4, 1, 1]);
        let ids = meta(DType::I32, [8, 4, 1, 1]);
        let out = infer(&Op::MoeWeights, &[&logits, &ids]).unwrap();
        let c = cost(&Op::MoeWeights, &[&logits, &ids], &out);
        assert_eq!(c.flops, 5 * 1024 + 2 * 32);
        assert_eq!(c.bytes, (1024 + 32 + 32) * 4);
    }
}
