//! flash_attn_ext: shape/dtype rules and cost.
//!
//! Inputs (ggml order): `q [d_k, n_tokens, n_head, n_seq]` f32 (any strides), `k [d_k, n_kv,
//! n_head_kv, n_seq]` and `v [d_v, n_kv, n_head_kv, n_seq]` f32/f16/bf16 with dense rows (outer
//! strides free), then `mask [n_kv, >= n_tokens, 1, 1 or n_seq]` f32/f16 when `params.mask`, then
//! `block_table` i32 `[n_kv, n_seq, 1, 1]` when `params.paged` (K/V are then a shared cache
//! `[d, n_cells, n_head_kv, 1]`). Output f32 `[d_v, n_head, n_tokens, n_seq]`, contiguous.
//!
//! Ragged (`params.ragged`): `q [d_k, n_tokens, n_head, 1]` packs every sequence's tokens, two
//! i32 inputs come last, `seq_offsets [n_seq + 1, 1, 1, 1]` and `kv_lens [n_seq, 1, 1, 1]` (n_seq
//! comes from the offsets), the mask is `[n_kv, >= n_tokens, 1, 1]` and the output
//! `[d_v, n_head, n_tokens, 1]`. Their values are checked at run time.
//!
//! Gated (`params.gate`): a last input `gate` f32 of the output's shape (any strides); the
//! output is multiplied by `sigmoid(gate)`.

use super::contiguous;
use crate::{DType, FlashAttnParams, Op, OpError, TensorMeta};

/// The parsed inputs of a flash_attn_ext node (after arity checks).
struct Inputs<'a> {
    q: &'a TensorMeta,
    k: &'a TensorMeta,
    v: &'a TensorMeta,
    mask: Option<&'a TensorMeta>,
    table: Option<&'a TensorMeta>,
    /// `(seq_offsets, kv_lens)` when ragged.
    ragged: Option<(&'a TensorMeta, &'a TensorMeta)>,
    gate: Option<&'a TensorMeta>,
}

/// How an arity error names the inputs a node with these params takes.
fn arity_text(p: &FlashAttnParams) -> &'static str {
    match (p.mask, p.paged, p.ragged, p.gate) {
        (false, false, false, false) => "3 (q, k, v)",
        (true, false, false, false) => "4 (q, k, v, mask)",
        (false, true, false, false) => "4 (q, k, v, block_table)",
        (true, true, false, false) => "5 (q, k, v, mask, block_table)",
        (false, false, true, false) => "5 (q, k, v, seq_offsets, kv_lens)",
        (true, false, true, false) => "6 (q, k, v, mask, seq_offsets, kv_lens)",
        (false, true, true, false) => "6 (q, k, v, block_table, seq_offsets, kv_lens)",
        (true, true, true, false) => "7 (q, k, v, mask, block_table, seq_offsets, kv_lens)",
        (false, false, false, true) => "4 (q, k, v, gate)",
        (true, false, false, true) => "5 (q, k, v, mask, gate)",
        (false, true, false, true) => "5 (q, k, v, block_table, gate)",
        (true, true, false, true) => "6 (q, k, v, mask, block_table, gate)",
        (false, false, true, true) => "6 (q, k, v, seq_offsets, kv_lens, gate)",
        (true, false, true, true) => "7 (q, k, v, mask, seq_offsets, kv_lens, gate)",
        (false, true, true, true) => "7 (q, k, v, block_table, seq_offsets, kv_lens, gate)",
        (true, true, true, true) => "8 (q, k, v, mask, block_table, seq_offsets, kv_lens, gate)",
    }
}

fn split<'a>(op: &Op, p: &FlashAttnParams, inputs: &[&'a TensorMeta]) -> Result<Inputs<'a>, OpError> {
    let at = p.inputs();
    if inputs.len() != at.count {
        return Err(OpError::Arity { op: op.name(), expected: arity_text(p), got: inputs.len() });
    }
    Ok(Inputs {
        q: inputs[0],
        k: inputs[1],
        v: inputs[2],
        mask: at.mask.map(|i| inputs[i]),
        table: at.table.map(|i| inputs[i]),
        ragged: at.ragged.map(|i| (inputs[i], inputs[i + 1])),
        gate: at.gate.map(|i| inputs[i]),
    })
}

pub(super) fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    let Op::FlashAttnExt(p) = op else { unreachable!("attention::infer called for {op}") };
    let name = op.name();
    if !p.scale.is_finite() {
        return Err(OpError::InvalidParam { op: name, why: format!("scale must be finite, got {}", p.scale) });
    }
    if !(p.softcap.is_finite() && p.softcap >= 0.0) {
        return Err(OpError::InvalidParam {
            op: name,
            why: format!("softcap must be finite and >= 0 (0 turns it off), got {}", p.softcap),
        });
    }
    let Inputs { q, k, v, mask, table, ragged, gate } = split(op, p, inputs)?;
    if q.dtype != DType::F32 {
        return Err(OpError::DType { op: name, input: 0, dtype: q.dtype, expected: "f32 queries" });
    }
    for (i, m) in [(1, k), (2, v)] {
        if !matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(OpError::DType {
                op: name,
                input: i,
                dtype: m.dtype,
                expected: "f32, f16 or bf16 keys/values",
            });
        }
        if !m.has_contiguous_rows() {
            return Err(OpError::NotContiguous { op: name, input: i, shape: m.ne, nb: m.nb });
        }
    }
    let mismatch = |lhs: &TensorMeta, rhs: &TensorMeta, why: &str| OpError::ShapeMismatch {
        op: name,
        lhs: lhs.ne,
        rhs: rhs.ne,
        why: why.into(),
    };
    if k.ne[0] != q.ne[0] {
        return Err(mismatch(q, k, "q and k must have the same head dim ne[0] (d_k)"));
    }
    if k.ne[1] != v.ne[1] || k.ne[2] != v.ne[2] || k.ne[3] != v.ne[3] {
        return Err(mismatch(k, v, "k and v must agree in dims 1..3 (kv positions, kv heads, sequences)"));
    }
    let (n_tokens, n_head) = (q.ne[1], q.ne[2]);
    let n_seq = match ragged {
        None => q.ne[3],
        Some((offsets, kv_lens)) => ragged_n_seq(op, q, offsets, kv_lens, p.inputs().ragged.unwrap_or(3))?,
    };
    if !n_head.is_multiple_of(k.ne[2]) {
        return Err(mismatch(q, k, "the query head count ne[2] must be a multiple of the kv head count"));
    }
    let n_kv = match table {
        None => {
            if k.ne[3] != n_seq {
                let why = if ragged.is_some() {
                    "ragged k/v must have n_seq = seq_offsets.ne[0] - 1 sequences in ne[3]"
                } else {
                    "q and k must have the same number of sequences ne[3]"
                };
                return Err(mismatch(q, k, why));
            }
            k.ne[1]
        }
        Some(t) => {
            if t.dtype != DType::I32 {
                return Err(OpError::DType {
                    op: name,
                    input: p.inputs().table.unwrap_or(3),
                    dtype: t.dtype,
                    expected: "i32 cells",
                });
            }
            if t.ne[1] != n_seq || t.ne[2] != 1 || t.ne[3] != 1 {
                let why = if ragged.is_some() {
                    "the block table must be [n_kv, n_seq, 1, 1] with n_seq = seq_offsets.ne[0] - 1"
                } else {
                    "the block table must be [n_kv, n_seq, 1, 1] with q's n_seq = ne[3]"
                };
                return Err(mismatch(q, t, why));
            }
            if k.ne[3] != 1 {
                return Err(mismatch(k, t, "a paged k/v cache must be [d, n_cells, n_head_kv, 1]"));
            }
            t.ne[0]
        }
    };
    if let Some(m) = mask {
        if !matches!(m.dtype, DType::F32 | DType::F16) {
            return Err(OpError::DType { op: name, input: 3, dtype: m.dtype, expected: "an f32 or f16 mask" });
        }
        if m.ne[0] != n_kv {
            return Err(mismatch(m, k, &format!("the mask's ne[0] must be the number of kv positions {n_kv}")));
        }
        if m.ne[1] < n_tokens {
            return Err(mismatch(m, q, &format!("the mask needs at least n_tokens = {n_tokens} rows (ne[1])")));
        }
        if ragged.is_some() && (m.ne[2] != 1 || m.ne[3] != 1) {
            return Err(mismatch(m, q, "a ragged batch's mask must be [n_kv, >= n_tokens, 1, 1] (row t for token t)"));
        }
        if m.ne[2] != 1 || (m.ne[3] != 1 && m.ne[3] != n_seq) {
            return Err(mismatch(m, q, &format!("the mask must be [n_kv, >= n_tokens, 1, 1 or n_seq = {n_seq}]")));
        }
    }
    let out = contiguous(op, DType::F32, [v.ne[0], n_head, n_tokens, q.ne[3]])?;
    if let Some(g) = gate {
        let input = p.inputs().gate.unwrap_or(3);
        if g.dtype != DType::F32 {
            return Err(OpError::DType { op: name, input, dtype: g.dtype, expected: "f32 gate logits" });
        }
        if g.ne != out.ne {
            return Err(mismatch(g, &out, "the gate must have the output's shape [d_v, n_head, n_tokens, n_seq]"));
        }
    }
    Ok(out)
}

/// A ragged batch's n_seq (`seq_offsets.ne[0] - 1`), after checking q's single sequence and the
/// dtypes and shapes of `seq_offsets [n_seq + 1, 1, 1, 1]` and `kv_lens [n_seq, 1, 1, 1]`.
fn ragged_n_seq(
    op: &Op,
    q: &TensorMeta,
    offsets: &TensorMeta,
    kv_lens: &TensorMeta,
    at: usize,
) -> Result<usize, OpError> {
    let name = op.name();
    let mismatch = |lhs: &TensorMeta, rhs: &TensorMeta, why: &str| OpError::ShapeMismatch {
        op: name,
        lhs: lhs.ne,
        rhs: rhs.ne,
        why: why.into(),
    };
    if q.ne[3] != 1 {
        return Err(mismatch(q, offsets, "ragged q packs every sequence's tokens: [d_k, n_tokens, n_head, 1]"));
    }
    for (i, m, what) in [(at, offsets, "i32 seq_offsets"), (at + 1, kv_lens, "i32 kv_lens")] {
        if m.dtype != DType::I32 {
            return Err(OpError::DType { op: name, input: i, dtype: m.dtype, expected: what });
        }
    }
    if offsets.ne[0] < 2 || offsets.ne[1..] != [1, 1, 1] {
        return Err(mismatch(offsets, q, "seq_offsets must be [n_seq + 1, 1, 1, 1] with n_seq >= 1"));
    }
    let n_seq = offsets.ne[0] - 1;
    if kv_lens.ne != [n_seq, 1, 1, 1] {
        return Err(mismatch(kv_lens, offsets, &format!("kv_lens must be [n_seq = {n_seq}, 1, 1, 1]")));
    }
    Ok(n_seq)
}

/// The number of logical kv positions (the block table's length when paged, else `k.ne[1]`) and
/// the number of sequences.
fn kv_and_seqs(p: &FlashAttnParams, inputs: &[&TensorMeta]) -> (usize, usize) {
    let at = p.inputs();
    let n_kv = at.table.map_or(inputs[1].ne[1], |i| inputs[i].ne[0]);
    let n_seq = at.ragged.map_or(inputs[0].ne[3], |i| inputs[i].ne[0].saturating_sub(1));
    (n_kv, n_seq)
}

/// `n_seq * n_head * n_tokens * n_kv * (2 (d_k + d_v) + 5)`: the two products, plus about five
/// operations per logit for scaling, masking and the softmax (and 7 per output element gated). A ragged batch counts its packed
/// `n_tokens` over all `n_kv` positions (the same count as the dense layout of that work: its
/// causal rule skips positions, as a dense call's mask does).
pub(super) fn flops(p: &FlashAttnParams, inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let (q, v) = (inputs[0], inputs[2]);
    let (n_kv, _) = kv_and_seqs(p, inputs);
    let logits = [q.ne[1], q.ne[2], q.ne[3], n_kv].iter().fold(1u64, |a, &x| a.saturating_mul(x as u64));
    // the gate: sigmoid's 6 and the product's 1 per output element
    let gate = if p.gate { 7 * out.nelements() as u64 } else { 0 };
    logits.saturating_mul(2 * (q.ne[0] as u64 + v.ne[0] as u64) + 5).saturating_add(gate)
}

/// q, the K/V rows actually read (`n_kv` rows per kv head per sequence, through the table when
/// paged), the mask rows read (`n_tokens` per mask sequence), the table, the ragged offsets and
/// kv lengths, the gate, and the output.
pub(super) fn bytes(p: &FlashAttnParams, inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let (n_kv, n_seq) = kv_and_seqs(p, inputs);
    let rows = (n_kv as u64).saturating_mul(k.ne[2] as u64).saturating_mul(n_seq as u64);
    let kv_row = (k.row_bytes() + v.row_bytes()) as u64;
    let mut total = (q.nbytes_contiguous() as u64)
        .saturating_add(rows.saturating_mul(kv_row))
        .saturating_add(out.nbytes_contiguous() as u64);
    let gate = p.inputs().gate;
    for (i, extra) in inputs.iter().enumerate().skip(3) {
        let b = if extra.dtype == DType::I32 || Some(i) == gate {
            extra.nbytes_contiguous() as u64
        } else {
            // the mask: n_tokens rows of n_kv per mask sequence
            (extra.row_bytes() as u64).saturating_mul(q.ne[1] as u64).saturating_mul(extra.ne[3] as u64)
        };
        total = total.saturating_add(b);
    }
    total
}

#[cfg(test)]
mod tests {
    use crate::{DType, FlashAttnParams, Op, OpError, TensorMeta, cost, infer};

    fn meta(dtype: DType, ne: [usize; 4]) -> TensorMeta {
        TensorMeta::contiguous("t", dtype, ne).unwrap()
    }

    fn op(mask: bool, paged: bool) -> Op {
        Op::FlashAttnExt(FlashAttnParams { scale: 0.125, softcap: 0.0, mask, paged, ragged: false, gate: false })
    }

    const F32: DType = DType::F32;
    const F16: DType = DType::F16;

    #[test]
    fn output_is_permuted_head_before_token() {
        let (q, k, v) = (meta(F32, [256, 7, 24, 2]), meta(F16, [256, 300, 4, 2]), meta(F16, [128, 300, 4, 2]));
        let out = infer(&op(false, false), &[&q, &k, &v]).unwrap();
        assert_eq!(out, meta(F32, [128, 24, 7, 2]));
        let m = meta(DType::F16, [300, 8, 1, 2]);
        assert_eq!(infer(&op(true, false), &[&q, &k, &v, &m]).unwrap().ne, [128, 24, 7, 2]);
    }

    #[test]
    fn paged_cache_reads_n_kv_from_the_table() {
        let (q, k, v) = (meta(F32, [64, 1, 8, 3]), meta(F16, [64, 1000, 2, 1]), meta(F16, [64, 1000, 2, 1]));
        let t = meta(DType::I32, [77, 3, 1, 1]);
        let m = meta(F32, [77, 1, 1, 3]);
        assert_eq!(infer(&op(false, true), &[&q, &k, &v, &t]).unwrap().ne, [64, 8, 1, 3]);
        assert_eq!(infer(&op(true, true), &[&q, &k, &v, &m, &t]).unwrap().ne, [64, 8, 1, 3]);
        // cost: 77 positions per kv head per sequence, not the 1000 cells
        let c = cost(&op(true, true), &[&q, &k, &v, &m, &t], &meta(F32, [64, 8, 1, 3]));
        assert_eq!(c.flops, 8 * 3 * 77 * (2 * 128 + 5));
        let kv = 3 * 2 * 77 * (128 + 128);
        assert_eq!(c.bytes, (64 * 8 * 3 * 4) + kv + 77 * 4 * 3 + 77 * 3 * 4 + 64 * 8 * 3 * 4);
        // a wrong mask width names the table's n_kv
        let wide = meta(F32, [1000, 1, 1, 3]);
        let e = infer(&op(true, true), &[&q, &k, &v, &wide, &t]).unwrap_err();
        assert!(e.to_string().contains("77"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let (q, k, v) = (meta(F32, [64, 2, 6, 1]), meta(F16, [64, 10, 4, 1]), meta(F16, [64, 10, 4, 1]));
        let e = infer(&op(false, false), &[&q, &k, &v]).unwrap_err();
        assert!(matches!(e, OpError::ShapeMismatch { .. }) && e.to_string().contains("multiple"), "{e}");
        let (q, k32) = (meta(F32, [64, 2, 8, 1]), meta(F16, [32, 10, 4, 1]));
        assert!(infer(&op(false, false), &[&q, &k32, &v]).unwrap_err().to_string().contains("d_k"));
        let short = meta(F32, [10, 1, 1, 1]);
        let e = infer(&op(true, false), &[&q, &k, &v, &short]).unwrap_err();
        assert!(e.to_string().contains("n_tokens = 2"), "{e}");
        assert!(matches!(infer(&op(true, false), &[&q, &k, &v]), Err(OpError::Arity { got: 3, .. })));
        let qh = meta(F16, [64, 2, 8, 1]);
        assert!(matches!(infer(&op(false, false), &[&qh, &k, &v]), Err(OpError::DType { input: 0, .. })));
        let kq = meta(DType::Q8_0, [64, 10, 4, 1]);
        assert!(matches!(infer(&op(false, false), &[&q, &kq, &v]), Err(OpError::DType { input: 1, .. })));
        let mut kt = k;
        kt.nb = [128, 2, 1280, 5120]; // transposed rows
        assert!(matches!(infer(&op(false, false), &[&q, &kt, &v]), Err(OpError::NotContiguous { input: 1, .. })));
        let bad = Op::FlashAttnExt(FlashAttnParams {
            scale: 1.0,
            softcap: -1.0,
            mask: false,
            paged: false,
            ragged: false,
            gate: false,
        });
        assert!(matches!(infer(&bad, &[&q, &k, &v]), Err(OpError::InvalidParam { .. })));
        // block table: dtype and shape
        let tf = meta(F32, [10, 1, 1, 1]);
        assert!(matches!(infer(&op(false, true), &[&q, &k, &v, &tf]), Err(OpError::DType { input: 3, .. })));
        let t2 = meta(DType::I32, [10, 2, 1, 1]);
        assert!(matches!(infer(&op(false, true), &[&q, &k, &v, &t2]), Err(OpError::ShapeMismatch { .. })));
    }

    #[test]
    fn ragged_packs_tokens_and_takes_n_seq_from_the_offsets() {
        let ragged = |mask, paged| {
            Op::FlashAttnExt(FlashAttnParams { scale: 0.125, softcap: 0.0, mask, paged, ragged: true, gate: false })
        };
        let (q, k) = (meta(F32, [256, 40, 16, 1]), meta(F16, [256, 5000, 2, 1]));
        let (t, o, l) =
            (meta(DType::I32, [512, 3, 1, 1]), meta(DType::I32, [4, 1, 1, 1]), meta(DType::I32, [3, 1, 1, 1]));
        let m = meta(F16, [512, 48, 1, 1]);
        let out = infer(&ragged(true, true), &[&q, &k, &k, &m, &t, &o, &l]).unwrap();
        assert_eq!(out, meta(F32, [256, 16, 40, 1]));
        // cost: the packed tokens over all n_kv positions; n_kv rows per kv head per sequence
        let c = cost(&ragged(false, true), &[&q, &k, &k, &t, &o, &l], &out);
        assert_eq!(c.flops, 40 * 16 * 512 * (2 * 512 + 5));
        let kv = 3 * 2 * 512 * (512 + 512);
        assert_eq!(c.bytes, (256 * 40 * 16 * 4) + kv + 512 * 3 * 4 + 4 * 4 + 3 * 4 + 256 * 16 * 40 * 4);
        // per-sequence k/v: ne[3] = n_seq
        let kd = meta(F16, [256, 512, 2, 3]);
        assert_eq!(infer(&ragged(false, false), &[&q, &kd, &kd, &o, &l]).unwrap().ne, [256, 16, 40, 1]);
        // arity, dtypes and shapes
        let e = infer(&ragged(false, false), &[&q, &kd, &kd, &o]).unwrap_err();
        assert!(matches!(e, OpError::Arity { got: 4, .. }) && e.to_string().contains("seq_offsets, kv_lens"), "{e}");
        let of = meta(F32, [4, 1, 1, 1]);
        assert!(matches!(infer(&ragged(false, false), &[&q, &kd, &kd, &of, &l]), Err(OpError::DType { input: 3, .. })));
        let one = meta(DType::I32, [1, 1, 1, 1]);
        let e = infer(&ragged(false, false), &[&q, &kd, &kd, &one, &l]).unwrap_err();
        assert!(e.to_string().contains("n_seq >= 1"), "{e}");
        let l4 = meta(DType::I32, [4, 1, 1, 1]);
        assert!(infer(&ragged(false, false), &[&q, &kd, &kd, &o, &l4]).unwrap_err().to_string().contains("kv_lens"));
        let q2 = meta(F32, [256, 40, 16, 2]);
        assert!(infer(&ragged(false, false), &[&q2, &kd, &kd, &o, &l]).unwrap_err().to_string().contains("packs"));
        let m3 = meta(F16, [512, 48, 1, 3]);
        let e = infer(&ragged(true, true), &[&q, &k, &k, &m3, &t, &o, &l]).unwrap_err();
        assert!(e.to_string().contains("ragged batch's mask"), "{e}");
    }
}
