//! Reference flash_attn_ext: a plain two-pass softmax in f64 per (sequence, token, head).
//!
//! For query row `(t, h, s)` and logical kv position `j` (cell `block_table[j, s]` of sequence 0
//! when paged, else position `j` of sequence `s`), with kv head `hk = h / (n_head / n_head_kv)`:
//! `x_j = scale * q[:, t, h, s] . k[:, j, hk, s]`, `l_j = softcap * tanh(x_j / softcap)` when
//! `softcap > 0` (else `x_j`), plus `mask[j, t, 0, s % mask.ne3]`. Positions with `l_j = -inf` are
//! skipped; `out[:, h, t, s] = sum_j e^(l_j - max) v[:, j, hk, s] / sum_j e^(l_j - max)`, and a row
//! whose every logit is `-inf` is all zeros.

use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let Op::FlashAttnExt(p) = op else { unreachable!("reference attention::compute called for {op}") };
    let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
    let mask = p.mask.then(|| &inputs[3]);
    let table = p.paged.then(|| &inputs[3 + usize::from(p.mask)]);
    let [d_k, n_tokens, n_head, n_seq] = q.ne;
    let (d_v, n_head_kv, n_rows) = (v.ne[0], k.ne[2], k.ne[1]);
    let group = n_head / n_head_kv;
    // Where each logical position of each sequence lives: (row of k/v, sequence of k/v).
    let n_kv = table.map_or(n_rows, |t| t.ne[0]);
    let mut cells = Vec::with_capacity(n_kv * n_seq);
    for s in 0..n_seq {
        for j in 0..n_kv {
            cells.push(match table {
                None => (j, s),
                Some(t) => {
                    let c = t.at([j, s, 0, 0]);
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
    }
    let (scale, softcap) = (f64::from(p.scale), f64::from(p.softcap));
    let mut y = RefTensor::zeros(out.ne);
    let mut logits = vec![0.0; n_kv];
    for s in 0..n_seq {
        for t in 0..n_tokens {
            for h in 0..n_head {
                let hk = h / group;
                for (j, l) in logits.iter_mut().enumerate() {
                    let (cell, ks) = cells[s * n_kv + j];
                    let dot: f64 = (0..d_k).map(|i| q.at([i, t, h, s]) * k.at([i, cell, hk, ks])).sum();
                    let x = scale * dot;
                    *l = if softcap > 0.0 { softcap * (x / softcap).tanh() } else { x };
                    if let Some(m) = mask {
                        *l += m.at([j, t, 0, s % m.ne[3]]);
                    }
                }
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
                    let (cell, ks) = cells[s * n_kv + j];
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a += w * v.at([i, cell, hk, ks]);
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    y.set([i, h, t, s], a / total);
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
        Op::FlashAttnExt(FlashAttnParams { scale, softcap, mask, paged, ragged: false })
    }

    fn run(op: &Op, inputs: &[RefTensor]) -> Result<RefTensor, KernelError> {
        let metas: Vec<TensorMeta> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let dt = if i == inputs.len() - 1 && matches!(op, Op::FlashAttnExt(p) if p.paged) {
                    DType::I32
                } else {
                    DType::F32
                };
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
}
