//! Reference flash_attn_ext: a plain two-pass softmax in f64 per (sequence, token, head).
//!
//! For query row `(t, h, s)` and logical kv position `j` (cell `block_table[j, s]` of sequence 0
//! when paged, else position `j` of sequence `s`), with kv head `hk = h / (n_head / n_head_kv)`:
//! `x_j = scale * q[:, t, h, s] . k[:, j, hk, s]`, `l_j = softcap * tanh(x_j / softcap)` when
//! `softcap > 0` (else `x_j`), plus `mask[j, t, 0, s % mask.ne3]`. Positions with `l_j = -inf` are
//! skipped; `out[:, h, t, s] = sum_j e^(l_j - max) v[:, j, hk, s] / sum_j e^(l_j - max)`, and a row
//! whose every logit is `-inf` is all zeros.
//!
//! Ragged: q holds one packed sequence dimension; sequence `s` owns tokens `seq_offsets[s] ..
//! seq_offsets[s + 1]` (L of them) and its `i`-th token reads positions `0 ..= kv_lens[s] - L + i`
//! of sequence `s` (the same formula over those positions; the mask row is the packed token's).
//! Tokens of no sequence stay zero. Checked first, in this order: the offsets, the kv lengths of
//! the sequences with tokens (`L <= kv_lens[s] <= n_kv`), then the table entries that are read.
//!
//! Gated: the result times `sigmoid(gate)` (the reference sigmoid and mul, in f64).

use super::RefTensor;
use crate::{BinaryOp, KernelError, Op, TensorMeta, UnaryOp, checked_seq_offsets};

/// The query rows of one sequence: `tokens` of q's (and the output's) sequence slot `qs`; token
/// `tokens.start + i` reads logical positions `0..visible(i)` of sequence `s`.
struct Seq {
    s: usize,
    qs: usize,
    tokens: std::ops::Range<usize>,
    /// Positions the first token sees; each later token sees one more (ragged), or all `n_kv`.
    first_visible: usize,
    causal: bool,
}

/// The sequences of a ragged batch (offsets and kv lengths checked) or of a dense one.
fn sequences(
    op: &Op,
    inputs: &[RefTensor],
    ragged: bool,
    n_tokens: usize,
    n_kv: usize,
) -> Result<Vec<Seq>, KernelError> {
    if !ragged {
        let n_seq = inputs[0].ne[3];
        return Ok((0..n_seq)
            .map(|s| Seq { s, qs: s, tokens: 0..n_tokens, first_visible: n_kv, causal: false })
            .collect());
    }
    let Op::FlashAttnExt(p) = op else { unreachable!("reference attention::sequences called for {op}") };
    let at = p.inputs().ragged.unwrap_or(3);
    let (offsets, kv_lens) = (&inputs[at], &inputs[at + 1]);
    let offsets = checked_seq_offsets(op.name(), offsets.data.iter().map(|&x| x as i64), n_tokens)?;
    let mut seqs = Vec::new();
    for (s, w) in offsets.windows(2).enumerate() {
        let len = w[1] - w[0];
        if len == 0 {
            continue; // no tokens: its kv length and table row are not read
        }
        let kv_len = kv_lens.data[s] as i64;
        if kv_len < len as i64 || kv_len > n_kv as i64 {
            return Err(KernelError::ValueOutOfRange {
                op: op.name(),
                what: "kv_lens",
                at: s,
                value: kv_len,
                low: len as i64,
                high: n_kv as i64,
            });
        }
        let first_visible = kv_len as usize - len + 1;
        seqs.push(Seq { s, qs: 0, tokens: w[0]..w[1], first_visible, causal: true });
    }
    Ok(seqs)
}

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let Op::FlashAttnExt(p) = op else { unreachable!("reference attention::compute called for {op}") };
    let at = p.inputs();
    if let Some(gate) = at.gate {
        // mul(flash_attn_ext(..), sigmoid(gate)), the composition the gate stands for
        let attn = compute(&Op::FlashAttnExt(p.ungated()), &inputs[..gate], out)?;
        let sig = super::compute(&Op::Unary(UnaryOp::Sigmoid), &inputs[gate..], out)?;
        return super::compute(&Op::Binary(BinaryOp::Mul), &[attn, sig], out);
    }
    let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
    let mask = at.mask.map(|i| &inputs[i]);
    let table = at.table.map(|i| &inputs[i]);
    let [d_k, n_tokens, n_head, _] = q.ne;
    let (d_v, n_head_kv, n_rows) = (v.ne[0], k.ne[2], k.ne[1]);
    let group = n_head / n_head_kv;
    let n_kv = table.map_or(n_rows, |t| t.ne[0]);
    let seqs = sequences(op, inputs, p.ragged, n_tokens, n_kv)?;
    // Where each position a sequence reads lives: (row of k/v, sequence of k/v); table entries
    // are checked in (sequence, position) order over the positions read.
    let mut cells: Vec<Vec<(usize, usize)>> = Vec::with_capacity(seqs.len());
    for sq in &seqs {
        let read = sq.first_visible + if sq.causal { sq.tokens.len() - 1 } else { 0 };
        let mut row = Vec::with_capacity(read);
        for j in 0..read {
            row.push(match table {
                None => (j, sq.s),
                Some(t) => {
                    let c = t.at([j, sq.s, 0, 0]);
                    if !(c >= 0.0 && c < n_rows as f64) {
                        return Err(KernelError::IndexOutOfRange {
                            op: op.name(),
                            index: c as i64,
                            limit: n_rows,
                            what: "block table entry (k/v cell)",
                        });
                    }
                    (c as usize, 0)
                }
            });
        }
        cells.push(row);
    }
    let (scale, softcap) = (f64::from(p.scale), f64::from(p.softcap));
    let mut y = RefTensor::zeros(out.ne);
    for (sq, cells) in seqs.iter().zip(&cells) {
        let s = sq.qs;
        for (i, t) in sq.tokens.clone().enumerate() {
            let visible = if sq.causal { sq.first_visible + i } else { sq.first_visible };
            for h in 0..n_head {
                let hk = h / group;
                let logits: Vec<f64> = (0..visible)
                    .map(|j| {
                        let (cell, ks) = cells[j];
                        let dot: f64 = (0..d_k).map(|e| q.at([e, t, h, s]) * k.at([e, cell, hk, ks])).sum();
                        let x = scale * dot;
                        let l = if softcap > 0.0 { softcap * (x / softcap).tanh() } else { x };
                        l + mask.map_or(0.0, |m| m.at([j, t, 0, s % m.ne[3]]))
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue; // every position masked: the row stays zero
                }
                let mut total = 0.0;
                let mut acc = vec![0.0; d_v];
                for (j, &l) in logits.iter().enumerate() {
                    if l == f64::NEG_INFINITY {
                        continue;
                    }
                    let w = (l - max).exp();
                    total += w;
                    let (cell, ks) = cells[j];
                    for (e, a) in acc.iter_mut().enumerate() {
                        *a += w * v.at([e, cell, hk, ks]);
                    }
                }
                for (e, a) in acc.iter().enumerate() {
                    y.set([e, h, t, s], a / total);
                }
            }
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, FlashAttnParams};

    fn op(scale: f32, softcap: f32, mask: bool, paged: bool) -> Op {
        Op::FlashAttnExt(FlashAttnParams { scale, softcap, mask, paged, ragged: false, gate: false })
    }

    fn run(op: &Op, inputs: &[RefTensor]) -> Result<RefTensor, KernelError> {
        let Op::FlashAttnExt(p) = op else { unreachable!() };
        let n_i32 = usize::from(p.paged) + 2 * usize::from(p.ragged);
        let metas: Vec<TensorMeta> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let dt = if i + n_i32 >= inputs.len() { DType::I32 } else { DType::F32 };
                TensorMeta::contiguous("t", dt, t.ne).unwrap()
            })
            .collect();
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        let out = crate::infer(op, &refs).unwrap();
        compute(op, inputs, &out)
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn two_positions_by_hand() {
        // d = 1: q = 1, k = [0, ln 3], scale 1 -> weights 1/4, 3/4 over v = [4, 8] -> 7.
        let q = RefTensor::new([1, 1, 1, 1], vec![1.0]);
        let k = RefTensor::new([1, 2, 1, 1], vec![0.0, 3f64.ln()]);
        let v = RefTensor::new([2, 2, 1, 1], vec![4.0, 1.0, 8.0, -1.0]);
        let y = run(&op(1.0, 0.0, false, false), &[q.clone(), k.clone(), v.clone()]).unwrap();
        close(&y.data, &[7.0, -0.5]);
        // a mask of [0, -inf] keeps only position 0
        let m = RefTensor::new([2, 1, 1, 1], vec![0.0, f64::NEG_INFINITY]);
        let y = run(&op(1.0, 0.0, true, false), &[q.clone(), k.clone(), v.clone(), m]).unwrap();
        close(&y.data, &[4.0, 1.0]);
        // fully masked: zeros
        let m = RefTensor::new([2, 1, 1, 1], vec![f64::NEG_INFINITY; 2]);
        let y = run(&op(1.0, 0.0, true, false), &[q, k, v, m]).unwrap();
        close(&y.data, &[0.0, 0.0]);
    }

    #[test]
    fn softcap_applies_scale_inside_tanh() {
        // logits: 2 * tanh(0.5 * 3 / 2) and 2 * tanh(0), v = [1, 0]
        let q = RefTensor::new([1, 1, 1, 1], vec![3.0]);
        let k = RefTensor::new([1, 2, 1, 1], vec![1.0, 0.0]);
        let v = RefTensor::new([1, 2, 1, 1], vec![1.0, 0.0]);
        let y = run(&op(0.5, 2.0, false, false), &[q, k, v]).unwrap();
        let l0 = 2.0 * 0.75f64.tanh();
        close(&y.data, &[l0.exp() / (l0.exp() + 1.0)]);
    }

    #[test]
    fn gqa_heads_and_permuted_output() {
        // 2 query heads share kv head 0; 2 tokens; one position: output is v whatever q is.
        let q = RefTensor::new([1, 2, 2, 1], vec![1.0, 2.0, 3.0, 4.0]);
        let k = RefTensor::new([1, 1, 1, 1], vec![1.0]);
        let v = RefTensor::new([2, 1, 1, 1], vec![5.0, 6.0]);
        let y = run(&op(1.0, 0.0, false, false), &[q, k, v]).unwrap();
        assert_eq!(y.ne, [2, 2, 2, 1]);
        close(&y.data, &[5.0, 6.0, 5.0, 6.0, 5.0, 6.0, 5.0, 6.0]);
    }

    #[test]
    fn paged_reads_cells_and_rejects_out_of_range() {
        // cache cells: k = [0, 9, ln 3], v = [4, 100, 8]; the table reads cells [2, 0] -> same as
        // the contiguous [ln 3, 0] over [8, 4]: 3/4 * 8 + 1/4 * 4 = 7.
        let q = RefTensor::new([1, 1, 1, 1], vec![1.0]);
        let k = RefTensor::new([1, 3, 1, 1], vec![0.0, 9.0, 3f64.ln()]);
        let v = RefTensor::new([1, 3, 1, 1], vec![4.0, 100.0, 8.0]);
        let t = RefTensor::new([2, 1, 1, 1], vec![2.0, 0.0]);
        let y = run(&op(1.0, 0.0, false, true), &[q.clone(), k.clone(), v.clone(), t]).unwrap();
        close(&y.data, &[7.0]);
        let bad = RefTensor::new([2, 1, 1, 1], vec![2.0, 3.0]);
        let e = run(&op(1.0, 0.0, false, true), &[q, k, v, bad]).unwrap_err();
        assert!(matches!(e, KernelError::IndexOutOfRange { index: 3, limit: 3, .. }), "{e}");
    }

    #[test]
    fn ragged_is_causal_bottom_right_per_sequence() {
        // d = 1, one head. Sequence 0: tokens 1..3 (L = 2) over kv length 3, so token 1 sees
        // positions 0..=1 and token 2 sees 0..=2; sequence 1: no tokens (garbage kv length);
        // sequence 2: token 3 over kv length 1 (position 0). Tokens 0 and 4 are padding.
        let ragged = Op::FlashAttnExt(FlashAttnParams {
            scale: 1.0,
            softcap: 0.0,
            mask: false,
            paged: false,
            ragged: true,
            gate: false,
        });
        let q = RefTensor::new([1, 5, 1, 1], vec![9.0, 1.0, 1.0, 1.0, 9.0]);
        let k = RefTensor::new([1, 3, 1, 3], vec![0.0, 3f64.ln(), 50.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0]);
        let v = RefTensor::new([1, 3, 1, 3], vec![4.0, 8.0, 100.0, 0.0, 0.0, 0.0, -2.0, 0.0, 0.0]);
        let offsets = RefTensor::new([4, 1, 1, 1], vec![1.0, 3.0, 3.0, 4.0]);
        let kv_lens = RefTensor::new([3, 1, 1, 1], vec![3.0, -9.0, 1.0]);
        let y = run(&ragged, &[q.clone(), k.clone(), v.clone(), offsets, kv_lens.clone()]).unwrap();
        // token 1: 1/4 * 4 + 3/4 * 8 = 7; token 2: weights 1, 3, e^50 over 4, 8, 100
        let w = [1.0, 3.0, 50f64.exp()];
        let t2 = (w[0] * 4.0 + w[1] * 8.0 + w[2] * 100.0) / w.iter().sum::<f64>();
        close(&y.data, &[0.0, 7.0, t2, -2.0, 0.0]);
        // bad offsets and kv lengths
        let bad = RefTensor::new([4, 1, 1, 1], vec![1.0, 3.0, 2.0, 4.0]);
        let e = run(&ragged, &[q.clone(), k.clone(), v.clone(), bad, kv_lens]).unwrap_err();
        assert!(matches!(e, KernelError::ValueOutOfRange { what: "seq_offsets", at: 2, value: 2, low: 3, .. }), "{e}");
        let offsets = RefTensor::new([4, 1, 1, 1], vec![1.0, 3.0, 3.0, 4.0]);
        let short = RefTensor::new([3, 1, 1, 1], vec![1.0, 0.0, 1.0]);
        let e = run(&ragged, &[q, k, v, offsets, short]).unwrap_err();
        assert!(
            matches!(e, KernelError::ValueOutOfRange { what: "kv_lens", at: 0, value: 1, low: 2, high: 3, .. }),
            "{e}"
        );
    }
}
