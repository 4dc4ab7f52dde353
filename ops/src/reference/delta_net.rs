//! gated_delta_net in f64: the token-serial recurrence and the chunked (WY / UT-transform) form,
//! both written out as plain loops over small dense matrices.
//!
//! Per value head `h` of sequence `s`, with `S` the `S_k x S_v` state of slot `slots[s]` (element
//! `state[i, j, h, slot]` is `S[k = i][v = j]`), `q, k` the key head serving `h` and `g, beta` the
//! head's scalars, each token does
//!
//! ```text
//! S <- exp(g) S;   u = S^T k;   S <- S + k (beta (v - u))^T;   o = S^T (scale q)
//! ```
//!
//! and the final `S` goes back to the slot. The chunked form computes the same thing a chunk of
//! `C` tokens at a time (docs/notes/hybrid-ops.md §2.7): with `gamma` the inclusive cumulative sum
//! of `g` inside the chunk, `A[i][j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j)` for `i > j`,
//! `T = (I + A)^-1`, `U = T (beta V)`, `W = T (beta exp(gamma) K)`,
//!
//! ```text
//! V_new = U - W S
//! O     = (Q exp(gamma)) S + (Q K^T ⊙ Gamma) V_new        (Gamma[i][j] = exp(gamma_i - gamma_j), j <= i)
//! S    <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V_new
//! ```
//!
//! A last chunk shorter than `C` is handled as a chunk of its own length (the same as padding it
//! with `g = 0, beta = 0, k = 0` tokens).

use std::ops::Range;

use super::RefTensor;
use crate::{
    DeltaNetAlgo, GatedDeltaNetParams, HeadMap, KernelError, TensorMeta, checked_ragged_slots, checked_seq_offsets,
    checked_slots,
};

const OP: &str = "gated_delta_net";

/// The key head that serves value head `h` (`ratio = H_v / H_k`).
pub(crate) fn key_head(map: HeadMap, h: usize, h_k: usize, ratio: usize) -> usize {
    match map {
        HeadMap::Tiled => h % h_k,
        HeadMap::Grouped => h / ratio,
    }
}

/// One sequence's work in a recurrent op: its state slot, the index of its tokens along the
/// outermost dimension (`s` dense, 0 ragged) and its tokens along the token dimension.
pub(super) struct SeqSpan {
    pub slot: usize,
    pub outer: usize,
    pub tokens: Range<usize>,
}

/// The sequences a recurrent op runs, checked before anything is computed. Dense (no
/// `offsets`): `n_seq` sequences of all `n_t` tokens, slot `s` checked by `checked_slots`.
/// Ragged: sequence `s` owns tokens `offsets[s] .. offsets[s + 1]` of dimension 2 (checked by
/// `checked_seq_offsets`); sequences without tokens are left out, unchecked
/// (`checked_ragged_slots`).
pub(super) fn sequences(
    op: &'static str,
    offsets: Option<&RefTensor>,
    slots: &RefTensor,
    n_t: usize,
    n_seq: usize,
    n_slots: usize,
) -> Result<Vec<SeqSpan>, KernelError> {
    let slot_values = slots.data.iter().map(|&x| x as i64);
    let Some(offsets) = offsets else {
        let slot_of = checked_slots(op, slot_values.take(n_seq), n_slots)?;
        return Ok(slot_of
            .into_iter()
            .enumerate()
            .map(|(s, slot)| SeqSpan { slot, outer: s, tokens: 0..n_t })
            .collect());
    };
    let offsets = checked_seq_offsets(op, offsets.data.iter().map(|&x| x as i64), n_t)?;
    let slot_of = checked_ragged_slots(op, slot_values, &offsets, n_slots)?;
    Ok(slot_of
        .into_iter()
        .zip(offsets.windows(2))
        .filter_map(|(slot, w)| slot.map(|slot| SeqSpan { slot, outer: 0, tokens: w[0]..w[1] }))
        .collect())
}

/// One head's inputs for one sequence, as dense f64 rows (token-major).
struct HeadSeq {
    /// `[n_t][S_k]`, already multiplied by `scale`.
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    /// `[n_t][S_v]`
    v: Vec<Vec<f64>>,
    g: Vec<f64>,
    beta: Vec<f64>,
}

/// Returns the output (`[S_v, H_v, n_t, n_seq]`, or `[S_v, H_v, n_tokens, 1]` ragged, zero for
/// tokens of no sequence) and the whole new state tensor.
pub(super) fn compute(
    p: &GatedDeltaNetParams,
    inputs: &[RefTensor],
    out: &TensorMeta,
) -> Result<(RefTensor, RefTensor), KernelError> {
    let n_in = if p.ragged { 8 } else { 7 };
    let (Some([q, k, v, g, beta, state, slots]), true) = (inputs.first_chunk(), inputs.len() == n_in) else {
        return Err(KernelError::Unsupported { op: OP, why: format!("expected {n_in} inputs, got {}", inputs.len()) });
    };
    let offsets = inputs.get(7);
    let [s_k, h_k, n_t, n_seq] = q.ne;
    let [s_v, h_v, ..] = v.ne;
    let n_slots = state.ne[3];
    let seqs = sequences(OP, offsets, slots, n_t, n_seq, n_slots)?;
    let ratio = h_v / h_k;
    let mut o = RefTensor::zeros(out.ne);
    let mut new_state = state.clone();
    for SeqSpan { slot, outer: s, tokens } in seqs {
        for h in 0..h_v {
            let kh = key_head(p.head_map, h, h_k, ratio);
            let row = |t: &RefTensor, n: usize, i1: usize, i2: usize, mul: f64| -> Vec<f64> {
                (0..n).map(|i| t.at([i, i1, i2, s]) * mul).collect()
            };
            let seq = HeadSeq {
                q: tokens.clone().map(|t| row(q, s_k, kh, t, f64::from(p.scale))).collect(),
                k: tokens.clone().map(|t| row(k, s_k, kh, t, 1.0)).collect(),
                v: tokens.clone().map(|t| row(v, s_v, h, t, 1.0)).collect(),
                g: tokens.clone().map(|t| g.at([0, h, t, s])).collect(),
                beta: tokens.clone().map(|t| beta.at([0, h, t, s])).collect(),
            };
            // S[k][v] = state[k, v, h, slot]
            let mut st: Vec<Vec<f64>> =
                (0..s_k).map(|i| (0..s_v).map(|j| state.at([i, j, h, slot])).collect()).collect();
            let outs = match p.algo {
                DeltaNetAlgo::Serial => serial(&seq, &mut st),
                DeltaNetAlgo::Chunked { chunk } => {
                    if chunk == 0 {
                        return Err(KernelError::Unsupported { op: OP, why: "chunk size 0".into() });
                    }
                    chunked(&seq, &mut st, chunk)
                }
            };
            for (t, ot) in tokens.clone().zip(&outs) {
                for (j, &x) in ot.iter().enumerate() {
                    o.set([j, h, t, s], x);
                }
            }
            for (i, st_row) in st.iter().enumerate() {
                for (j, &x) in st_row.iter().enumerate() {
                    new_state.set([i, j, h, slot], x);
                }
            }
        }
    }
    Ok((o, new_state))
}

/// The recurrence one token at a time; returns `o_t` per token and leaves the final state in `st`.
fn serial(x: &HeadSeq, st: &mut [Vec<f64>]) -> Vec<Vec<f64>> {
    let s_v = st.first().map_or(0, Vec::len);
    let mut outs = Vec::with_capacity(x.g.len());
    for t in 0..x.g.len() {
        let decay = x.g[t].exp();
        st.iter_mut().flatten().for_each(|e| *e *= decay);
        // u = S^T k;  delta = beta (v - u);  S += k delta^T
        let delta: Vec<f64> = (0..s_v)
            .map(|j| {
                let u: f64 = st.iter().zip(&x.k[t]).map(|(r, &kk)| r[j] * kk).sum();
                x.beta[t] * (x.v[t][j] - u)
            })
            .collect();
        for (r, &kk) in st.iter_mut().zip(&x.k[t]) {
            for (e, &d) in r.iter_mut().zip(&delta) {
                *e += kk * d;
            }
        }
        // o = S^T q (q already scaled)
        outs.push((0..s_v).map(|j| st.iter().zip(&x.q[t]).map(|(r, &qq)| r[j] * qq).sum()).collect());
    }
    outs
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The WY / UT-transform form, `chunk` tokens at a time (the last chunk may be shorter).
#[allow(clippy::needless_range_loop)] // the matrix formulas read best with explicit indices
fn chunked(x: &HeadSeq, st: &mut [Vec<f64>], chunk: usize) -> Vec<Vec<f64>> {
    let (s_k, s_v) = (st.len(), st.first().map_or(0, Vec::len));
    let n_t = x.g.len();
    let mut outs = Vec::with_capacity(n_t);
    let mut start = 0;
    while start < n_t {
        let c = chunk.min(n_t - start);
        let r = start..start + c;
        let (q, k, v, beta) = (&x.q[r.clone()], &x.k[r.clone()], &x.v[r.clone()], &x.beta[r.clone()]);
        // gamma: inclusive cumulative log decay within the chunk.
        let gamma: Vec<f64> = x.g[r]
            .iter()
            .scan(0.0, |acc, &gi| {
                *acc += gi;
                Some(*acc)
            })
            .collect();
        // Gamma[i][j] = exp(gamma_i - gamma_j) for j <= i (0 above the diagonal).
        let big_gamma: Vec<Vec<f64>> =
            (0..c).map(|i| (0..c).map(|j| if j <= i { (gamma[i] - gamma[j]).exp() } else { 0.0 }).collect()).collect();
        // A[i][j] = beta_i (k_i . k_j) Gamma[i][j] for i > j, 0 otherwise.
        let a: Vec<Vec<f64>> = (0..c)
            .map(|i| (0..c).map(|j| if j < i { beta[i] * dot(&k[i], &k[j]) * big_gamma[i][j] } else { 0.0 }).collect())
            .collect();
        // T = (I + A)^-1, unit lower triangular: (I + A) T = I gives, row by row (forward
        // substitution), T[i][j] = [i == j] - sum_{m < i} A[i][m] T[m][j].
        let mut t = vec![vec![0.0; c]; c];
        for i in 0..c {
            for j in 0..=i {
                let identity = if i == j { 1.0 } else { 0.0 };
                t[i][j] = identity - (j..i).map(|m| a[i][m] * t[m][j]).sum::<f64>();
            }
        }
        // U = T (beta V)  [c x S_v];  W = T (beta exp(gamma) K)  [c x S_k]
        let u: Vec<Vec<f64>> =
            (0..c).map(|i| (0..s_v).map(|jv| (0..c).map(|m| t[i][m] * beta[m] * v[m][jv]).sum()).collect()).collect();
        let w: Vec<Vec<f64>> = (0..c)
            .map(|i| (0..s_k).map(|jk| (0..c).map(|m| t[i][m] * beta[m] * gamma[m].exp() * k[m][jk]).sum()).collect())
            .collect();
        // V_new = U - W S
        let v_new: Vec<Vec<f64>> = (0..c)
            .map(|i| (0..s_v).map(|jv| u[i][jv] - (0..s_k).map(|kk| w[i][kk] * st[kk][jv]).sum::<f64>()).collect())
            .collect();
        // O = (Q exp(gamma)) S + (Q K^T ⊙ Gamma, diagonal included) V_new
        for i in 0..c {
            let qk: Vec<f64> = (0..=i).map(|j| dot(&q[i], &k[j]) * big_gamma[i][j]).collect();
            let o: Vec<f64> = (0..s_v)
                .map(|jv| {
                    let inter = gamma[i].exp() * (0..s_k).map(|kk| q[i][kk] * st[kk][jv]).sum::<f64>();
                    let intra: f64 = (0..=i).map(|j| qk[j] * v_new[j][jv]).sum();
                    inter + intra
                })
                .collect();
            outs.push(o);
        }
        // S <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V_new
        let last = c - 1;
        for (kk, st_row) in st.iter_mut().enumerate() {
            for (jv, e) in st_row.iter_mut().enumerate() {
                let add: f64 = (0..c).map(|j| k[j][kk] * big_gamma[last][j] * v_new[j][jv]).sum();
                *e = gamma[last].exp() * *e + add;
            }
        }
        start += c;
    }
    outs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(algo: DeltaNetAlgo) -> GatedDeltaNetParams {
        GatedDeltaNetParams { scale: 0.5, head_map: HeadMap::Tiled, algo, ragged: false }
    }

    fn out_meta(ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", crate::DType::F32, ne).unwrap()
    }

    /// One head, S_k = S_v = 1: every step is scalar arithmetic.
    /// s0 = 2; token 0: g = ln 0.5, k = 1, v = 3, beta = 0.5, q = 2 (scale 0.5 -> 1):
    ///   s = 1, u = 1, s = 1 + 0.5 * (3 - 1) = 2, o = 2.
    /// token 1: g = 0, k = 2, v = 1, beta = 0.25, q = 4 (-> 2):
    ///   u = 4, s = 2 + 2 * 0.25 * (1 - 4) = 0.5, o = 1.
    #[test]
    fn scalar_head_by_hand() {
        let ins = vec![
            RefTensor::new([1, 1, 2, 1], vec![2.0, 4.0]),
            RefTensor::new([1, 1, 2, 1], vec![1.0, 2.0]),
            RefTensor::new([1, 1, 2, 1], vec![3.0, 1.0]),
            RefTensor::new([1, 1, 2, 1], vec![0.5f64.ln(), 0.0]),
            RefTensor::new([1, 1, 2, 1], vec![0.5, 0.25]),
            RefTensor::new([1, 1, 1, 2], vec![7.0, 2.0]),
            RefTensor::new([1, 1, 1, 1], vec![1.0]),
        ];
        for algo in [DeltaNetAlgo::Serial, DeltaNetAlgo::Chunked { chunk: 1 }, DeltaNetAlgo::Chunked { chunk: 2 }] {
            let (o, st) = compute(&params(algo), &ins, &out_meta([1, 1, 2, 1])).unwrap();
            assert!((o.data[0] - 2.0).abs() < 1e-12 && (o.data[1] - 1.0).abs() < 1e-12, "{algo:?}: {:?}", o.data);
            assert_eq!(st.data[0], 7.0, "slot 0 untouched");
            assert!((st.data[1] - 0.5).abs() < 1e-12, "{algo:?}: {:?}", st.data);
        }
    }

    /// S_k = S_v = 2, one token, zero state, g = 0, beta = 1: S = k v^T, o = S^T q = (k.q) v.
    /// k = (1, 2), v = (3, -1), q = (1, 1) with scale 0.5: S = [[3, -1], [6, -2]] (S[k][v]),
    /// o = 0.5 * 3 * (3, -1) = (4.5, -1.5); state memory is k-fastest: [3, 6, -1, -2].
    #[test]
    fn rank_one_update_layout() {
        let ins = vec![
            RefTensor::new([2, 1, 1, 1], vec![1.0, 1.0]),
            RefTensor::new([2, 1, 1, 1], vec![1.0, 2.0]),
            RefTensor::new([2, 1, 1, 1], vec![3.0, -1.0]),
            RefTensor::new([1, 1, 1, 1], vec![0.0]),
            RefTensor::new([1, 1, 1, 1], vec![1.0]),
            RefTensor::zeros([2, 2, 1, 1]),
            RefTensor::new([1, 1, 1, 1], vec![0.0]),
        ];
        let (o, st) = compute(&params(DeltaNetAlgo::Serial), &ins, &out_meta([2, 1, 1, 1])).unwrap();
        assert_eq!(o.data, vec![4.5, -1.5]);
        assert_eq!(st.data, vec![3.0, 6.0, -1.0, -2.0]);
    }

    #[test]
    fn head_maps_pick_key_heads() {
        // H_k = 2, H_v = 6 (ratio 3)
        let tiled: Vec<usize> = (0..6).map(|h| key_head(HeadMap::Tiled, h, 2, 3)).collect();
        let grouped: Vec<usize> = (0..6).map(|h| key_head(HeadMap::Grouped, h, 2, 3)).collect();
        assert_eq!(tiled, [0, 1, 0, 1, 0, 1]);
        assert_eq!(grouped, [0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn bad_slots_are_errors() {
        let one = |x: f64| RefTensor::new([1, 1, 1, 1], vec![x]);
        let mk = |slots: RefTensor| {
            let n = slots.ne[0];
            vec![
                RefTensor::zeros([1, 1, 1, n]),
                RefTensor::zeros([1, 1, 1, n]),
                RefTensor::zeros([1, 1, 1, n]),
                RefTensor::zeros([1, 1, 1, n]),
                RefTensor::zeros([1, 1, 1, n]),
                RefTensor::zeros([1, 1, 1, 2]),
                slots,
            ]
        };
        let p = params(DeltaNetAlgo::Serial);
        let e = compute(&p, &mk(one(2.0)), &out_meta([1, 1, 1, 1])).unwrap_err();
        assert_eq!(e, KernelError::IndexOutOfRange { op: OP, index: 2, limit: 2, what: "state slot" });
        let e = compute(&p, &mk(one(-1.0)), &out_meta([1, 1, 1, 1])).unwrap_err();
        assert!(matches!(e, KernelError::IndexOutOfRange { index: -1, .. }));
        let dup = RefTensor::new([2, 1, 1, 1], vec![1.0, 1.0]);
        let e = compute(&p, &mk(dup), &out_meta([1, 1, 1, 2])).unwrap_err();
        assert!(matches!(e, KernelError::DuplicateIndex { index: 1, first: 0, second: 1, .. }), "{e}");
    }
}
