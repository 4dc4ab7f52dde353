//! Reference fused ops, each computed as the subgraph it replaces: the reference functions of the
//! ops in that subgraph, called in order through [`super::compute`] (views are only relabelled
//! shapes). The definition of a fused op IS this composition; intermediates stay in f64 here,
//! where the unfused graph would round them to f32, which is far inside every tolerance.

use super::{RefTensor, compute};
use crate::{
    BinaryOp, DType, GatedDeltaNetFusedParams, KernelError, Op, RmsNormParams, SoftmaxParams, TensorMeta, UnaryOp,
    infer,
};

pub(super) fn compute_fused(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let f32s = |t: &RefTensor| (t.clone(), DType::F32);
    let y = match op {
        // s = add(a, b); h = mul(rms_norm(s), w); the output stacks [s, h] along dim 2.
        Op::AddRmsNormMul(p) => {
            let s = step(op, Op::Binary(BinaryOp::Add), &[f32s(&inputs[0]), f32s(&inputs[1])])?;
            let h = norm_mul(op, *p, &s, &inputs[2])?;
            step(op, Op::Concat { dim: 2 }, &[(s, DType::F32), (h, DType::F32)])?
        }
        // mul(rms_norm(x), w)
        Op::RmsNormMul(p) => norm_mul(op, *p, &inputs[0], &inputs[1])?,
        // rope_multi(mul(rms_norm(x), w), positions)
        Op::RmsNormMulRope(p) => {
            let h = norm_mul(op, p.norm, &inputs[0], &inputs[1])?;
            step(op, Op::RopeMulti(p.rope), &[(h, DType::F32), (inputs[2].clone(), DType::I32)])?
        }
        // mul(mul(rms_norm(x), w), silu(z))
        Op::GatedRmsNorm(p) => {
            let h = norm_mul(op, *p, &inputs[0], &inputs[1])?;
            let gate = step(op, Op::Unary(UnaryOp::Silu), &[f32s(&inputs[2])])?;
            step(op, Op::Binary(BinaryOp::Mul), &[(h, DType::F32), (gate, DType::F32)])?
        }
        // top_k(softmax(logits), k), then concat(.., tail, 0) when ids are appended
        Op::SoftmaxTopK { k } => {
            let probs = step(op, softmax(), &[f32s(&inputs[0])])?;
            let top = step(op, Op::TopK { k: *k }, &[(probs, DType::F32)])?;
            match inputs.get(1) {
                Some(tail) => step(op, Op::Concat { dim: 0 }, &[(top, DType::I32), (tail.clone(), DType::I32)])?,
                None => top,
            }
        }
        // the weights, then concat(.., reshape(sigmoid(gate), [1, 1, n]), 1) when gated
        Op::MoeWeights => {
            let w = moe_weights(op, &inputs[0], &inputs[1])?;
            match inputs.get(2) {
                Some(gate) => {
                    let g = step(op, Op::Unary(UnaryOp::Sigmoid), &[f32s(gate)])?;
                    let g = RefTensor::new([1, 1, g.ne[1], 1], g.data);
                    step(op, Op::Concat { dim: 1 }, &[(w, DType::F32), (g, DType::F32)])?
                }
                None => w,
            }
        }
        // plane 0: softmax_top_k(logits, k[, tail]); plane 1: the bits of the f32 weights,
        // moe_weights(logits, the first k ids), then concat(.., reshape(sigmoid(gate), [1, m, n]), 1)
        Op::MoeRouter { k } => {
            let mut ids_in = vec![f32s(&inputs[0])];
            ids_in.extend(inputs.get(1).map(|tail| (tail.clone(), DType::I32)));
            let ids = step(op, Op::SoftmaxTopK { k: *k }, &ids_in)?;
            let [slots, n, _, _] = ids.ne;
            let routed = ids.data.chunks(slots).flat_map(|row| &row[..*k]).copied().collect();
            let routed = (RefTensor::new([*k, n, 1, 1], routed), DType::I32);
            let w = step(op, Op::MoeWeights, &[f32s(&inputs[0]), routed])?;
            let w = match inputs.get(2) {
                Some(gate) => {
                    let g = step(op, Op::Unary(UnaryOp::Sigmoid), &[f32s(gate)])?;
                    let g = RefTensor::new([1, g.ne[0], n, 1], g.data);
                    step(op, Op::Concat { dim: 1 }, &[(w, DType::F32), (g, DType::F32)])?
                }
                None => w,
            };
            let bits = w.data.iter().map(|&v| f64::from((v as f32).to_bits() as i32));
            RefTensor::new([slots, n, 2, 1], ids.data.iter().copied().chain(bits).collect())
        }
        // swiglu(mul_mat(wg, x), mul_mat(wu, x)), the weights as their values
        Op::MulMatSwiglu => {
            let gate = step(op, Op::MulMat, &[f32s(&inputs[0]), f32s(&inputs[2])])?;
            let up = step(op, Op::MulMat, &[f32s(&inputs[1]), f32s(&inputs[2])])?;
            step(op, Op::Swiglu, &[(gate, DType::F32), (up, DType::F32)])?
        }
        // reshape(sum_rows(transpose(mul(mul_mat_id(as, b, ids), w))), [N, n_tokens])
        Op::MulMatIdWeightedSum => {
            let ids = (inputs[2].clone(), DType::I32);
            let y = step(op, Op::MulMatId, &[f32s(&inputs[0]), f32s(&inputs[1]), ids])?;
            let y = step(op, Op::Binary(BinaryOp::Mul), &[(y, DType::F32), f32s(&inputs[3])])?;
            let [n, k, t, _] = y.ne;
            let mut slots_first = vec![0.0; y.data.len()];
            for (i, v) in y.data.iter().enumerate() {
                let (m, u, tt) = (i % n, i / n % k, i / (n * k));
                slots_first[u + k * (m + n * tt)] = *v;
            }
            let summed = step(op, Op::SumRows, &[(RefTensor::new([k, n, t, 1], slots_first), DType::F32)])?;
            RefTensor::new([n, t, 1, 1], summed.data)
        }
        // swiglu(mul_mat_id(wg, x, ids), mul_mat_id(wu, x, ids))
        Op::MulMatIdSwiglu => {
            let ids = (inputs[3].clone(), DType::I32);
            let gate = step(op, Op::MulMatId, &[f32s(&inputs[0]), f32s(&inputs[2]), ids.clone()])?;
            let up = step(op, Op::MulMatId, &[f32s(&inputs[1]), f32s(&inputs[2]), ids])?;
            step(op, Op::Swiglu, &[(gate, DType::F32), (up, DType::F32)])?
        }
        _ => unreachable!("reference fused::compute_fused called for {op}"),
    };
    if y.ne != out.ne {
        return Err(KernelError::Unsupported {
            op: op.name(),
            why: format!("the composition gives shape {:?}, the op's output is {:?}", y.ne, out.ne),
        });
    }
    Ok(y)
}

fn softmax() -> Op {
    Op::Softmax(SoftmaxParams { scale: 1.0 })
}

/// `mul(rms_norm(x), w)`.
fn norm_mul(fused: &Op, p: RmsNormParams, x: &RefTensor, w: &RefTensor) -> Result<RefTensor, KernelError> {
    let normed = step(fused, Op::RmsNorm(p), &[(x.clone(), DType::F32)])?;
    step(fused, Op::Binary(BinaryOp::Mul), &[(normed, DType::F32), (w.clone(), DType::F32)])
}

/// The router's weights as qwen35's `ffn` builds them:
/// `probs = softmax(logits)` `[n_expert, n]`; `w = get_rows(reshape(probs, [1, n_expert, n]), ids)`
/// `[1, k, n]`; `w = reshape(w, [k, n])`; `w = div(w, sum_rows(w))`; `reshape(w, [1, k, n])`.
/// An id outside `0..n_expert` is `IndexOutOfRange` ("expert id"), the first in logical order.
fn moe_weights(fused: &Op, logits: &RefTensor, ids: &RefTensor) -> Result<RefTensor, KernelError> {
    let [n_expert, n, _, _] = logits.ne;
    let k = ids.ne[0];
    // The ids are checked first, so the error names this op and the expert count (get_rows
    // would call them row ids of its source).
    for &id in &ids.data {
        if !(id.fract() == 0.0 && id >= 0.0 && id < n_expert as f64) {
            return Err(KernelError::IndexOutOfRange {
                op: fused.name(),
                index: id as i64,
                limit: n_expert,
                what: "expert id",
            });
        }
    }
    let probs = step(fused, softmax(), &[(logits.clone(), DType::F32)])?;
    let rows = RefTensor::new([1, n_expert, n, 1], probs.data);
    let picked = step(fused, Op::GetRows, &[(rows, DType::F32), (ids.clone(), DType::I32)])?;
    let picked = RefTensor::new([k, n, 1, 1], picked.data);
    let total = step(fused, Op::SumRows, &[(picked.clone(), DType::F32)])?;
    let w = step(fused, Op::Binary(BinaryOp::Div), &[(picked, DType::F32), (total, DType::F32)])?;
    Ok(RefTensor::new([1, k, n, 1], w.data))
}

/// gated_delta_net_fused: `gated_delta_net(l2_norm(q), l2_norm(k), v, reshape(softplus(alpha +
/// dt_bias) * a), reshape(sigmoid(beta)), state, slots[, seq_offsets])`, q and k the two halves
/// of `l2_norm(qk)` (one norm over both, as the model builds it: the norm is per row). Returns
/// the output and the new state.
pub(super) fn delta_net_fused(
    fused: &Op,
    p: &GatedDeltaNetFusedParams,
    inputs: &[RefTensor],
    out: &TensorMeta,
) -> Result<(RefTensor, RefTensor), KernelError> {
    let f32s = |t: &RefTensor| (t.clone(), DType::F32);
    let [qk, v, alpha, dt_bias, a, beta] = [0, 1, 2, 3, 4, 5].map(|i| &inputs[i]);
    let [s_k, two_h_k, n_t, n_seq] = qk.ne;
    let qk = step(fused, Op::L2Norm { eps: p.eps }, &[f32s(qk)])?;
    // The views of the two halves: heads [0, H_k) and [H_k, 2 H_k) of every token.
    let head_rows = |from: usize| -> Vec<f64> {
        (0..n_t * n_seq)
            .flat_map(|t| {
                let at = t * s_k * two_h_k + from * s_k;
                qk.data[at..at + s_k * two_h_k / 2].iter().copied()
            })
            .collect()
    };
    let ne_qk = [s_k, two_h_k / 2, n_t, n_seq];
    let (q, k) = (RefTensor::new(ne_qk, head_rows(0)), RefTensor::new(ne_qk, head_rows(two_h_k / 2)));
    let g = step(fused, Op::Binary(BinaryOp::Add), &[f32s(alpha), f32s(dt_bias)])?;
    let g = step(fused, Op::Unary(UnaryOp::Softplus), &[(g, DType::F32)])?;
    let g = step(fused, Op::Binary(BinaryOp::Mul), &[(g, DType::F32), f32s(a)])?;
    let b = step(fused, Op::Unary(UnaryOp::Sigmoid), &[f32s(beta)])?;
    let per_head = [1, v.ne[1], n_t, n_seq];
    let (g, b) = (RefTensor::new(per_head, g.data), RefTensor::new(per_head, b.data));
    let mut rule_inputs = vec![q, k, v.clone(), g, b];
    rule_inputs.extend(inputs[6..].iter().cloned());
    super::delta_net::compute(&p.net, &rule_inputs, out).map_err(|e| e.in_op(fused.name()))
}

/// One op of the composition on contiguous inputs of the given dtypes: its output descriptor from
/// the shape rules, its value from the reference.
fn step(fused: &Op, op: Op, inputs: &[(RefTensor, DType)]) -> Result<RefTensor, KernelError> {
    let unsupported = |why: String| KernelError::Unsupported { op: fused.name(), why };
    let metas = inputs
        .iter()
        .map(|(t, d)| TensorMeta::contiguous(fused.name(), *d, t.ne))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unsupported(e.to_string()))?;
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = infer(&op, &refs).map_err(|e| unsupported(format!("{op} in the composition: {e}")))?;
    let values: Vec<RefTensor> = inputs.iter().map(|(t, _)| t.clone()).collect();
    // A data error of a step (mul_mat_id's expert ids) is the fused op's.
    compute(&op, &values, &out).map_err(|e| e.in_op(fused.name()))
}

#[cfg(test)]
mod tests {
    use crate::reference::testutil::{assert_close, run, run_typed};
    use crate::{DType, KernelError, Op, RmsNormMulRopeParams, RmsNormParams, RopePairing, RopeParams};

    const P: RmsNormParams = RmsNormParams { eps: 0.0 };

    #[test]
    fn add_rms_norm_mul_stacks_the_sum_and_its_weighted_norm() {
        // s = [1, 3] + [2, 1] = [3, 4]: mean square 12.5
        let y = run(
            &Op::AddRmsNormMul(P),
            &[([2, 1, 1, 1], vec![1., 3.]), ([2, 1, 1, 1], vec![2., 1.]), ([2, 1, 1, 1], vec![2., -1.])],
        );
        assert_eq!(y.ne, [2, 1, 2, 1]);
        let r = 12.5f64.sqrt();
        assert_close(&y.data, &[3., 4., 2. * 3. / r, -4. / r]);
    }

    #[test]
    fn rms_norm_mul_broadcasts_the_weight() {
        // rows [3, 4] and [1, 1] (eps 0), weight [10, 100] for every row
        let y = run(&Op::RmsNormMul(P), &[([2, 2, 1, 1], vec![3., 4., 1., 1.]), ([2, 1, 1, 1], vec![10., 100.])]);
        let r = 12.5f64.sqrt();
        assert_close(&y.data, &[30. / r, 400. / r, 10., 100.]);
    }

    #[test]
    fn rms_norm_mul_rope_rotates_the_weighted_norm() {
        // one head [3, 4] (eps 0, mean square 12.5), weight [1, 2]: h = [3, 8] / r; n_rot 2 at
        // position 1 (base 10000: theta = 1) rotates the pair (h0, h1) by one radian.
        let rope = RopeParams { n_rot: 2, freq_base: 1e4, pairing: RopePairing::Neox, sections: None };
        let op = Op::RmsNormMulRope(RmsNormMulRopeParams { norm: P, rope });
        let y = run_typed(
            &op,
            &[
                (DType::F32, [2, 1, 1, 1], vec![3., 4.]),
                (DType::F32, [2, 1, 1, 1], vec![1., 2.]),
                (DType::I32, [1, 1, 1, 1], vec![1.]),
            ],
        )
        .unwrap();
        let r = 12.5f64.sqrt();
        let (a, b, (s, c)) = (3. / r, 8. / r, 1f64.sin_cos());
        assert_close(&y.data, &[a * c - b * s, a * s + b * c]);
    }

    #[test]
    fn gated_rms_norm_multiplies_by_silu_of_the_gate() {
        let s1 = 1. / (1. + (-1f64).exp());
        let y = run(
            &Op::GatedRmsNorm(P),
            &[([2, 1, 1, 1], vec![1., -1.]), ([1, 1, 1, 1], vec![3.]), ([2, 1, 1, 1], vec![1., 0.])],
        );
        assert_close(&y.data, &[3. * s1, 0.]);
    }

    #[test]
    fn softmax_top_k_selects_by_probability() {
        let y = run(&Op::SoftmaxTopK { k: 2 }, &[([4, 2, 1, 1], vec![0.1, 3., -1., 2., 5., 5., 0., 9.])]);
        assert_eq!(y.ne, [2, 2, 1, 1]);
        assert_eq!(y.data, vec![1., 3., 3., 0.]);
    }

    #[test]
    fn moe_weights_renormalise_the_selected_probabilities() {
        // probabilities proportional to [1, 2, 4]: picking experts 2 and 0 gives [4/5, 1/5]
        let logits = vec![0., 2f64.ln(), 4f64.ln()];
        let y = run_typed(
            &Op::MoeWeights,
            &[(DType::F32, [3, 1, 1, 1], logits.clone()), (DType::I32, [2, 1, 1, 1], vec![2., 0.])],
        )
        .unwrap();
        assert_eq!(y.ne, [1, 2, 1, 1]);
        assert_close(&y.data, &[0.8, 0.2]);
        let err = run_typed(
            &Op::MoeWeights,
            &[(DType::F32, [3, 1, 1, 1], logits), (DType::I32, [3, 1, 1, 1], vec![1., 3., -1.])],
        )
        .unwrap_err();
        assert_eq!(err, KernelError::IndexOutOfRange { op: "moe_weights", index: 3, limit: 3, what: "expert id" });
    }

    #[test]
    fn moe_router_packs_the_ids_and_the_bits_of_their_weights() {
        // probabilities proportional to [1, 2, 4]: the top 2 are experts 2 and 1, weights [2/3, 1/3];
        // the tail appends expert 7 with the sigmoid of its gate logit 0
        let logits = (DType::F32, [3, 1, 1, 1], vec![0., 2f64.ln(), 4f64.ln()]);
        let bits = |w: f64| f64::from((w as f32).to_bits() as i32);
        let y = run_typed(&Op::MoeRouter { k: 2 }, std::slice::from_ref(&logits)).unwrap();
        assert_eq!(y.ne, [2, 1, 2, 1]);
        assert_eq!(y.data[..2], [2., 1.]);
        assert_eq!(y.data[2..], [bits(2. / 3.), bits(1. / 3.)]);
        let tail = (DType::I32, [1, 1, 1, 1], vec![7.]);
        let gate = (DType::F32, [1, 1, 1, 1], vec![0.]);
        let y = run_typed(&Op::MoeRouter { k: 2 }, &[logits, tail, gate]).unwrap();
        assert_eq!(y.ne, [3, 1, 2, 1]);
        assert_eq!(y.data[..3], [2., 1., 7.]);
        assert_eq!(y.data[5], bits(0.5));
    }

    fn silu(x: f64) -> f64 {
        x / (1. + (-x).exp())
    }

    #[test]
    fn gate_up_products_and_their_glu() {
        // gate = [1, 0] . [3, 5] = 3, up = [0, 2] . [3, 5] = 10
        let y = run(
            &Op::MulMatSwiglu,
            &[([2, 1, 1, 1], vec![1., 0.]), ([2, 1, 1, 1], vec![0., 2.]), ([2, 1, 1, 1], vec![3., 5.])],
        );
        assert_eq!(y.ne, [1, 1, 1, 1]);
        assert_close(&y.data, &[silu(3.) * 10.]);
        // experts 0 and 1: gate rows [1, 0] and [0, 1], up rows [1, 1] and [2, 0]; slot 0 routes
        // to expert 1 (gate 5, up 6), slot 1 to expert 0 (gate 3, up 8)
        let experts = |v: [f64; 4]| (DType::F32, [2, 1, 2, 1], v.to_vec());
        let x = (DType::F32, [2, 1, 1, 1], vec![3., 5.]);
        let ids = |v: [f64; 2]| (DType::I32, [2, 1, 1, 1], v.to_vec());
        let routed = |i: [f64; 2]| {
            run_typed(&Op::MulMatIdSwiglu, &[experts([1., 0., 0., 1.]), experts([1., 1., 2., 0.]), x.clone(), ids(i)])
        };
        let y = routed([1., 0.]).unwrap();
        assert_eq!(y.ne, [1, 2, 1, 1]);
        assert_close(&y.data, &[silu(5.) * 6., silu(3.) * 8.]);
        // a bad id is the fused op's error, not its mul_mat_id step's
        let err = routed([1., 2.]).unwrap_err();
        assert_eq!(
            err,
            KernelError::IndexOutOfRange { op: "mul_mat_id_swiglu", index: 2, limit: 2, what: "expert id" }
        );
    }
}
