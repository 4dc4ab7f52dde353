//! flash_attn_ext: shape/dtype rules and cost.
//!
//! Inputs (ggml order): `q [d_k, n_tokens, n_head, n_seq]` f32 (any strides), `k [d_k, n_kv,
//! n_head_kv, n_seq]` and `v [d_v, n_kv, n_head_kv, n_seq]` f32/f16/bf16 with dense rows (outer
//! strides free), then `mask [n_kv, >= n_tokens, 1, 1 or n_seq]` f32/f16 when `params.mask`, then
//! `block_table` i32 `[n_kv, n_seq, 1, 1]` when `params.paged` (K/V are then a shared cache
//! `[d, n_cells, n_head_kv, 1]`). Output f32 `[d_v, n_head, n_tokens, n_seq]`, contiguous.

use super::contiguous;
use crate::{DType, FlashAttnParams, Op, OpError, TensorMeta};

/// The parsed inputs of a flash_attn_ext node (after arity checks).
struct Inputs<'a> {
    q: &'a TensorMeta,
    k: &'a TensorMeta,
    v: &'a TensorMeta,
    mask: Option<&'a TensorMeta>,
    table: Option<&'a TensorMeta>,
}

fn split<'a>(op: &Op, p: &FlashAttnParams, inputs: &[&'a TensorMeta]) -> Result<Inputs<'a>, OpError> {
    let (want, expected) = match (p.mask, p.paged) {
        (false, false) => (3, "3 (q, k, v)"),
        (true, false) => (4, "4 (q, k, v, mask)"),
        (false, true) => (4, "4 (q, k, v, block_table)"),
        (true, true) => (5, "5 (q, k, v, mask, block_table)"),
    };
    if inputs.len() != want {
        return Err(OpError::Arity { op: op.name(), expected, got: inputs.len() });
    }
    Ok(Inputs {
        q: inputs[0],
        k: inputs[1],
        v: inputs[2],
        mask: p.mask.then(|| inputs[3]),
        table: p.paged.then(|| inputs[3 + usize::from(p.mask)]),
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
    let Inputs { q, k, v, mask, table } = split(op, p, inputs)?;
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
    let (n_tokens, n_head, n_seq) = (q.ne[1], q.ne[2], q.ne[3]);
    if !n_head.is_multiple_of(k.ne[2]) {
        return Err(mismatch(q, k, "the query head count ne[2] must be a multiple of the kv head count"));
    }
    let n_kv = match table {
        None => {
            if k.ne[3] != n_seq {
                return Err(mismatch(q, k, "q and k must have the same number of sequences ne[3]"));
            }
            k.ne[1]
        }
        Some(t) => {
            if t.dtype != DType::I32 {
                return Err(OpError::DType {
                    op: name,
                    input: inputs.len() - 1,
                    dtype: t.dtype,
                    expected: "i32 cells",
                });
            }
            if t.ne[1] != n_seq || t.ne[2] != 1 || t.ne[3] != 1 {
                return Err(mismatch(q, t, "the block table must be [n_kv, n_seq, 1, 1] with q's n_seq = ne[3]"));
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
        if m.ne[2] != 1 || (m.ne[3] != 1 && m.ne[3] != n_seq) {
            return Err(mismatch(m, q, &format!("the mask must be [n_kv, >= n_tokens, 1, 1 or n_seq = {n_seq}]")));
        }
    }
    contiguous(op, DType::F32, [v.ne[0], n_head, n_tokens, n_seq])
}

/// The number of logical kv positions: the block table's length when paged, else `k.ne[1]`.
/// (A trailing i32 input is the block table: masks are f32/f16.)
fn n_kv(inputs: &[&TensorMeta]) -> usize {
    match inputs.last() {
        Some(t) if inputs.len() > 3 && t.dtype == DType::I32 => t.ne[0],
        _ => inputs[1].ne[1],
    }
}

/// `n_seq * n_head * n_tokens * n_kv * (2 (d_k + d_v) + 5)`: the two products, plus about five
/// operations per logit for scaling, masking and the softmax.
pub(super) fn flops(inputs: &[&TensorMeta], _out: &TensorMeta) -> u64 {
    let (q, v) = (inputs[0], inputs[2]);
    let logits = [q.ne[1], q.ne[2], q.ne[3], n_kv(inputs)].iter().fold(1u64, |a, &x| a.saturating_mul(x as u64));
    logits.saturating_mul(2 * (q.ne[0] as u64 + v.ne[0] as u64) + 5)
}

/// q, the K/V rows actually read (`n_kv` rows per kv head per sequence, through the table when
/// paged), the mask rows read (`n_tokens` per mask sequence), the table and the output.
pub(super) fn bytes(inputs: &[&TensorMeta], out: &TensorMeta) -> u64 {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let n_kv = n_kv(inputs) as u64;
    let n_seq = q.ne[3] as u64;
    let rows = n_kv.saturating_mul(k.ne[2] as u64).saturating_mul(n_seq);
    let kv_row = (k.row_bytes() + v.row_bytes()) as u64;
    let mut total = (q.nbytes_contiguous() as u64)
        .saturating_add(rows.saturating_mul(kv_row))
        .saturating_add(out.nbytes_contiguous() as u64);
    for extra in &inputs[3..] {
        let b = if extra.dtype == DType::I32 {
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
        Op::FlashAttnExt(FlashAttnParams { scale: 0.125, softcap: 0.0, mask, paged, ragged: false })
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
        let bad = Op::FlashAttnExt(FlashAttnParams { scale: 1.0, softcap: -1.0, mask: false, paged: false, ragged: false });
        assert!(matches!(infer(&bad, &[&q, &k, &v]), Err(OpError::InvalidParam { .. })));
        // block table: dtype and shape
        let tf = meta(F32, [10, 1, 1, 1]);
        assert!(matches!(infer(&op(false, true), &[&q, &k, &v, &tf]), Err(OpError::DType { input: 3, .. })));
        let t2 = meta(DType::I32, [10, 2, 1, 1]);
        assert!(matches!(infer(&op(false, true), &[&q, &k, &v, &t2]), Err(OpError::ShapeMismatch { .. })));
    }
}
