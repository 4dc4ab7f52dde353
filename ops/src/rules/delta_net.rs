//! gated_delta_net: shape/dtype rules and cost.
//!
//! Inputs `[q, k, v, g, beta, state, slots]` (see `Op::GatedDeltaNet` and docs/OPS.md):
//! `q, k [S_k, H_k, n_t, n_seq]`, `v [S_v, H_v, n_t, n_seq]`, `g, beta [1, H_v, n_t, n_seq]`
//! (any float type, any strides), `state [S_k, S_v, H_v, n_slots]` f32 contiguous, `slots` i32
//! `[n_seq]`; `H_v` a multiple of `H_k`. Output f32 `[S_v, H_v, n_t, n_seq]`, contiguous.
//!
//! Ragged (`ragged: true`): the tokens of all sequences packed, `q, k [S_k, H_k, n_tokens, 1]`,
//! `v [S_v, H_v, n_tokens, 1]`, `g, beta [1, H_v, n_tokens, 1]`, `slots` i32 `[n_seq]` and an
//! eighth input, `seq_offsets` i32 `[n_seq + 1]` (values checked at run time); output f32
//! `[S_v, H_v, n_tokens, 1]`.

use super::{contiguous, expect_dtype, expect_float};
use crate::{DType, DeltaNetAlgo, GatedDeltaNetParams, Op, OpError, TensorMeta};

const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const G: usize = 3;
const BETA: usize = 4;
const STATE: usize = 5;
const SLOTS: usize = 6;
const OFFSETS: usize = 7;

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let Op::GatedDeltaNet(p) = op else { unreachable!("delta_net::infer called with {op}") };
    rules(op, p, inputs)
}

/// The delta rule's rules on `inputs` in gated_delta_net's order (errors name `op` and those
/// input numbers): for gated_delta_net, and for a fused op that ends in it.
pub(super) fn rules(op: &Op, p: &GatedDeltaNetParams, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let name = op.name();
    let (n_in, expected) = if p.ragged {
        (8, "8 (q, k, v, g, beta, state, slots, seq_offsets)")
    } else {
        (7, "7 (q, k, v, g, beta, state, slots)")
    };
    if inputs.len() != n_in {
        return Err(OpError::Arity { op: name, expected, got: inputs.len() });
    }
    if !p.scale.is_finite() {
        return Err(OpError::InvalidParam { op: name, why: format!("scale must be finite, got {}", p.scale) });
    }
    if let DeltaNetAlgo::Chunked { chunk: 0 } = p.algo {
        return Err(OpError::InvalidParam { op: name, why: "chunk size must be at least 1".into() });
    }
    for i in [Q, K, V, G, BETA] {
        expect_float(op, i, inputs[i])?;
    }
    expect_dtype(op, STATE, inputs[STATE], DType::F32, "f32")?;
    expect_dtype(op, SLOTS, inputs[SLOTS], DType::I32, "i32 state slots")?;
    if p.ragged {
        expect_dtype(op, OFFSETS, inputs[OFFSETS], DType::I32, "i32 seq_offsets")?;
    }
    let (q, k, v, g, beta, state, slots) =
        (inputs[Q].ne, inputs[K].ne, inputs[V].ne, inputs[G].ne, inputs[BETA].ne, inputs[STATE].ne, inputs[SLOTS].ne);
    let mismatch = |lhs: [usize; 4], rhs: [usize; 4], why: String| OpError::ShapeMismatch { op: name, lhs, rhs, why };
    if q != k {
        return Err(mismatch(q, k, "q and k must have the same shape [S_k, H_k, n_t, n_seq]".into()));
    }
    let [s_k, h_k, n_t, n_seq] = q;
    if p.ragged && n_seq != 1 {
        let why = "ragged q and k pack every sequence's tokens: [S_k, H_k, n_tokens, 1]".into();
        return Err(OpError::InvalidShape { op: name, shape: q, why });
    }
    let [s_v, h_v] = [v[0], v[1]];
    if v[2] != n_t || v[3] != n_seq {
        return Err(mismatch(q, v, format!("v must be [S_v, H_v, {n_t}, {n_seq}] (tokens and sequences of q)")));
    }
    if !h_v.is_multiple_of(h_k) {
        return Err(mismatch(
            q,
            v,
            format!("the {h_v} value heads of v must be a multiple of the {h_k} key heads of q and k"),
        ));
    }
    let per_head = [1, h_v, n_t, n_seq];
    for (what, ne) in [("g", g), ("beta", beta)] {
        if ne != per_head {
            return Err(mismatch(v, ne, format!("{what} must be [1, H_v, n_t, n_seq] = {per_head:?}")));
        }
    }
    if state[0] != s_k || state[1] != s_v || state[2] != h_v || state[3] == 0 {
        return Err(mismatch(v, state, format!("state must be [S_k, S_v, H_v, n_slots] = [{s_k}, {s_v}, {h_v}, _]")));
    }
    if !inputs[STATE].is_contiguous() {
        return Err(OpError::NotContiguous { op: name, input: STATE, shape: state, nb: inputs[STATE].nb });
    }
    if p.ragged {
        let n = slots[0];
        if slots != [n, 1, 1, 1] {
            return Err(mismatch(q, slots, "slots must be i32 [n_seq, 1, 1, 1]".into()));
        }
        let offsets = inputs[OFFSETS].ne;
        if offsets != [n + 1, 1, 1, 1] {
            let why = format!("seq_offsets must be i32 [n_seq + 1, 1, 1, 1] = [{}, 1, 1, 1] ({n} slots)", n + 1);
            return Err(mismatch(slots, offsets, why));
        }
    } else if slots != [n_seq, 1, 1, 1] {
        return Err(mismatch(q, slots, format!("slots must be i32 [n_seq, 1, 1, 1] = [{n_seq}, 1, 1, 1]")));
    }
    contiguous(op, DType::F32, [s_v, h_v, n_t, n_seq])
}

/// The token-serial recurrence: per value head and token, decay (1), `S^T k` (2), the rank-1
/// update (2) and `S^T q` (2) on the `S_k x S_v` state: `7 S_k S_v H_v n_t n_seq`. The chunked
/// form does about as much (more for large chunks); it is counted the same.
pub(super) fn flops(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let s_k = inputs[Q].ne[0] as u64;
    (out.nelements() as u64).saturating_mul(s_k).saturating_mul(7)
}

/// q, k, v, g, beta, slots (and seq_offsets) and the output once, plus the state of the `n_seq`
/// named slots read and written (not the whole state tensor; ragged: every sequence counted as
/// if it had tokens).
pub(super) fn bytes(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let size = |m: &TensorMeta| m.nbytes_contiguous() as u64;
    let streamed =
        inputs.iter().enumerate().filter(|&(i, _)| i != STATE).fold(0u64, |acc, (_, m)| acc.saturating_add(size(m)));
    let state = inputs[STATE];
    let per_slot = size(state) / state.ne[3].max(1) as u64;
    let n_seq = inputs[SLOTS].ne[0] as u64;
    streamed.saturating_add(size(out)).saturating_add(per_slot.saturating_mul(n_seq).saturating_mul(2))
}

#[cfg(test)]
mod tests {
    use crate::{DeltaNetAlgo, GatedDeltaNetParams, HeadMap, Op, OpError, TensorMeta, cost, infer};

    use crate::DType::{self, F16, F32, I32};

    fn m(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    fn op(algo: DeltaNetAlgo) -> Op {
        Op::GatedDeltaNet(GatedDeltaNetParams { scale: 0.5, head_map: HeadMap::Tiled, algo, ragged: false })
    }

    /// `[q, k, v, g, beta, state, slots]` for S_k 4, S_v 3, H_k 2, H_v 6, 5 tokens, 2 seqs, 3 slots.
    fn good() -> Vec<TensorMeta> {
        vec![
            m(F32, [4, 2, 5, 2]),
            m(F16, [4, 2, 5, 2]),
            m(F32, [3, 6, 5, 2]),
            m(F32, [1, 6, 5, 2]),
            m(F32, [1, 6, 5, 2]),
            m(F32, [4, 3, 6, 3]),
            m(I32, [2, 1, 1, 1]),
        ]
    }

    fn run(op: &Op, ins: &[TensorMeta]) -> Result<TensorMeta, OpError> {
        let refs: Vec<&TensorMeta> = ins.iter().collect();
        infer(op, &refs)
    }

    #[test]
    fn output_is_f32_per_value_head() {
        let ins = good();
        let out = run(&op(DeltaNetAlgo::Serial), &ins).unwrap();
        assert_eq!((out.dtype, out.ne), (F32, [3, 6, 5, 2]));
        assert!(out.is_contiguous());
        let refs: Vec<&TensorMeta> = ins.iter().collect();
        let c = cost(&op(DeltaNetAlgo::Chunked { chunk: 4 }), &refs, &out);
        assert_eq!(c.flops, 7 * 4 * 3 * 6 * 5 * 2);
        // q 320 + k (f16) 160 + v 720 + g 240 + beta 240 + slots 8 + out 720, plus the state of the
        // 2 named slots (288 bytes each) read and written
        assert_eq!(c.bytes, 320 + 160 + 720 + 240 + 240 + 8 + 720 + 2 * 288 * 2);
    }

    #[test]
    fn strided_inputs_are_accepted() {
        let mut ins = good();
        // q as a window of a wider conv output: rows dense, outer strides larger.
        ins[0].nb = [4, 64, 64 * 2, 64 * 10];
        ins[2].nb = [4, 100, 600, 3000];
        assert!(run(&op(DeltaNetAlgo::Serial), &ins).is_ok());
    }

    #[test]
    fn bad_inputs_and_params_are_errors() {
        let serial = op(DeltaNetAlgo::Serial);
        let bad = |f: &dyn Fn(&mut Vec<TensorMeta>)| {
            let mut ins = good();
            f(&mut ins);
            run(&serial, &ins).unwrap_err()
        };
        assert!(matches!(run(&op(DeltaNetAlgo::Chunked { chunk: 0 }), &good()), Err(OpError::InvalidParam { .. })));
        let nan = Op::GatedDeltaNet(GatedDeltaNetParams {
            scale: f32::NAN,
            head_map: HeadMap::Grouped,
            algo: DeltaNetAlgo::Serial,
            ragged: false,
        });
        assert!(matches!(run(&nan, &good()), Err(OpError::InvalidParam { .. })));
        assert!(matches!(run(&serial, &good()[..6]), Err(OpError::Arity { .. })));
        // H_v not a multiple of H_k
        let e = bad(&|i| {
            i[2] = m(F32, [3, 5, 5, 2]);
            i[3] = m(F32, [1, 5, 5, 2]);
            i[4] = m(F32, [1, 5, 5, 2]);
            i[5] = m(F32, [4, 3, 5, 3]);
        });
        assert!(matches!(&e, OpError::ShapeMismatch { why, .. } if why.contains("multiple")), "{e}");
        // S_k differs between q and k
        assert!(matches!(bad(&|i| i[1] = m(F32, [5, 2, 5, 2])), OpError::ShapeMismatch { .. }));
        // v with other tokens, g and beta with other heads
        assert!(matches!(bad(&|i| i[2] = m(F32, [3, 6, 4, 2])), OpError::ShapeMismatch { .. }));
        assert!(matches!(bad(&|i| i[3] = m(F32, [1, 3, 5, 2])), OpError::ShapeMismatch { .. }));
        assert!(matches!(bad(&|i| i[4] = m(F32, [2, 6, 5, 2])), OpError::ShapeMismatch { .. }));
        // state: wrong key or value dim, wrong dtype, not contiguous
        assert!(matches!(bad(&|i| i[5] = m(F32, [3, 4, 6, 3])), OpError::ShapeMismatch { .. }));
        assert!(matches!(bad(&|i| i[5] = m(F16, [4, 3, 6, 3])), OpError::DType { input: 5, .. }));
        assert!(matches!(bad(&|i| i[5].nb = [4, 16, 64, 64 * 6]), OpError::NotContiguous { input: 5, .. }));
        // slots: dtype and length
        assert!(matches!(bad(&|i| i[6] = m(F32, [2, 1, 1, 1])), OpError::DType { input: 6, .. }));
        assert!(matches!(bad(&|i| i[6] = m(I32, [3, 1, 1, 1])), OpError::ShapeMismatch { .. }));
        // integer activations
        assert!(matches!(bad(&|i| i[0] = m(I32, [4, 2, 5, 2])), OpError::DType { input: 0, .. }));
    }

    fn ragged_op() -> Op {
        Op::GatedDeltaNet(GatedDeltaNetParams {
            scale: 0.5,
            head_map: HeadMap::Tiled,
            algo: DeltaNetAlgo::Chunked { chunk: 4 },
            ragged: true,
        })
    }

    /// The ragged form of [`good`]: 9 packed tokens, 3 sequences (3 slots), 4 offsets.
    fn good_ragged() -> Vec<TensorMeta> {
        vec![
            m(F32, [4, 2, 9, 1]),
            m(F32, [4, 2, 9, 1]),
            m(F32, [3, 6, 9, 1]),
            m(F32, [1, 6, 9, 1]),
            m(F32, [1, 6, 9, 1]),
            m(F32, [4, 3, 6, 2]),
            m(I32, [3, 1, 1, 1]),
            m(I32, [4, 1, 1, 1]),
        ]
    }

    #[test]
    fn ragged_packs_tokens_and_takes_offsets_last() {
        let ins = good_ragged();
        let out = run(&ragged_op(), &ins).unwrap();
        assert_eq!((out.dtype, out.ne), (F32, [3, 6, 9, 1]));
        let refs: Vec<&TensorMeta> = ins.iter().collect();
        let c = cost(&ragged_op(), &refs, &out);
        // q 288 + k 288 + v 648 + g 216 + beta 216 + slots 12 + offsets 16 + out 648, plus the
        // state of 3 sequences (288 bytes each) read and written
        assert_eq!(c.bytes, 288 + 288 + 648 + 216 + 216 + 12 + 16 + 648 + 3 * 288 * 2);
        // More sequences than slots is fine: empty sequences may share a slot.
        let mut more = good_ragged();
        more[6] = m(I32, [5, 1, 1, 1]);
        more[7] = m(I32, [6, 1, 1, 1]);
        assert!(run(&ragged_op(), &more).is_ok());

        let bad = |f: &dyn Fn(&mut Vec<TensorMeta>)| {
            let mut ins = good_ragged();
            f(&mut ins);
            run(&ragged_op(), &ins).unwrap_err()
        };
        assert!(
            matches!(run(&ragged_op(), &good_ragged()[..7]), Err(OpError::Arity { expected, .. }) if expected.starts_with('8'))
        );
        assert!(matches!(run(&op(DeltaNetAlgo::Serial), &good_ragged()), Err(OpError::Arity { .. })));
        let e = bad(&|i| i[7] = m(I32, [3, 1, 1, 1]));
        assert!(matches!(&e, OpError::ShapeMismatch { why, .. } if why.contains("seq_offsets")), "{e}");
        assert!(matches!(bad(&|i| i[7] = m(F32, [4, 1, 1, 1])), OpError::DType { input: 7, .. }));
        assert!(matches!(bad(&|i| i[6] = m(I32, [3, 2, 1, 1])), OpError::ShapeMismatch { .. }));
        // Tokens must be packed along dimension 2, with dimension 3 of 1.
        let e = bad(&|i| {
            i[0] = m(F32, [4, 2, 3, 3]);
            i[1] = m(F32, [4, 2, 3, 3]);
        });
        assert!(matches!(&e, OpError::InvalidShape { why, .. } if why.contains("n_tokens, 1")), "{e}");
        assert!(matches!(bad(&|i| i[3] = m(F32, [1, 6, 8, 1])), OpError::ShapeMismatch { .. }));
    }
}
