//! Reference mul_mat and mul_mat_id.

use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    match op {
        Op::MulMat => Ok(mul_mat(inputs, out)),
        Op::MulMatId => mul_mat_id(inputs, out),
        _ => unreachable!("reference matmul::compute called for {op}"),
    }
}

/// `a [K, M, A2, A3]` times `b [K, N, B2, B3]` gives `out [M, N, B2, B3]` with
/// `out[m, n, i2, i3] = sum_k a[k, m, i2 / (B2 / A2), i3 / (B3 / A3)] * b[k, n, i2, i3]`.
///
/// This is ggml's batch broadcast: each weight matrix serves `B2 / A2` consecutive activation
/// batches (as grouped-query attention needs), not every `A2`-th one.
fn mul_mat(inputs: &[RefTensor], out: &TensorMeta) -> RefTensor {
    let (a, b) = (&inputs[0], &inputs[1]);
    let k_len = a.ne[0];
    let (r2, r3) = (b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]);
    let [m_len, n_len, b2, b3] = out.ne;
    let mut y = RefTensor::zeros(out.ne);
    for i3 in 0..b3 {
        for i2 in 0..b2 {
            let (a2, a3) = (i2 / r2, i3 / r3);
            for n in 0..n_len {
                let b_row = &b.data[b.index([0, n, i2, i3])..][..k_len];
                for m in 0..m_len {
                    let a_row = &a.data[a.index([0, m, a2, a3])..][..k_len];
                    // plain left-to-right f64 sum over k
                    let sum: f64 = a_row.iter().zip(b_row).map(|(x, w)| x * w).sum();
                    y.set([m, n, i2, i3], sum);
                }
            }
        }
    }
    y
}

/// `as [K, N, n_expert]`, `b [K, n_b, T]`, `ids [n_used, T]` give `out [N, n_used, T]` with
/// `out[n, u, t] = sum_k as[k, n, ids[u, t]] * b[k, u mod n_b, t]` (ggml's `mul_mat_id`).
///
/// Every id is checked against `0..n_expert` before anything is computed; the first bad one in
/// logical order (`u` fastest) is the error.
fn mul_mat_id(inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let (w, b, ids) = (&inputs[0], &inputs[1], &inputs[2]);
    let (k_len, n_expert, n_b) = (w.ne[0], w.ne[2], b.ne[1]);
    let [n_len, n_used, n_tokens, _] = out.ne;
    let mut experts = Vec::with_capacity(n_used * n_tokens);
    for &id in &ids.data {
        if id.fract() != 0.0 || id < 0.0 || id >= n_expert as f64 {
            return Err(KernelError::IndexOutOfRange {
                op: "mul_mat_id",
                index: id as i64,
                limit: n_expert,
                what: "expert id",
            });
        }
        experts.push(id as usize);
    }
    let mut y = RefTensor::zeros(out.ne);
    for t in 0..n_tokens {
        for u in 0..n_used {
            let e = experts[u + n_used * t];
            let b_row = &b.data[b.index([0, u % n_b, t, 0])..][..k_len];
            for n in 0..n_len {
                let w_row = &w.data[w.index([0, n, e, 0])..][..k_len];
                let sum: f64 = w_row.iter().zip(b_row).map(|(x, v)| x * v).sum();
                y.set([n, u, t, 0], sum);
            }
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use crate::reference::{RefTensor, compute};
    use crate::{DType, Op, TensorMeta, infer};

    fn mul_mat(a: ([usize; 4], Vec<f64>), b: ([usize; 4], Vec<f64>)) -> RefTensor {
        let am = TensorMeta::contiguous("t", DType::F32, a.0).unwrap();
        let bm = TensorMeta::contiguous("t", DType::F32, b.0).unwrap();
        let out = infer(&Op::MulMat, &[&am, &bm]).unwrap();
        let y = compute(&Op::MulMat, &[RefTensor::new(a.0, a.1), RefTensor::new(b.0, b.1)], &out).unwrap();
        assert_eq!(y.ne, out.ne);
        y
    }

    #[test]
    fn mul_mat_two_by_two() {
        // a rows (K = 2): m0 = [1, 2], m1 = [3, 4]; b columns: n0 = [5, 6], n1 = [7, 8]
        let y = mul_mat(([2, 2, 1, 1], vec![1., 2., 3., 4.]), ([2, 2, 1, 1], vec![5., 6., 7., 8.]));
        assert_eq!(y.ne, [2, 2, 1, 1]);
        // out[m, n] = a_m . b_n, m fastest
        assert_eq!(y.data, vec![17., 39., 23., 53.]);
    }

    #[test]
    fn mul_mat_rectangular() {
        // K = 3, M = 1, N = 2
        let y = mul_mat(([3, 1, 1, 1], vec![1., 0., -1.]), ([3, 2, 1, 1], vec![1., 2., 3., 4., 5., 6.]));
        assert_eq!(y.ne, [1, 2, 1, 1]);
        assert_eq!(y.data, vec![-2., -2.]);
    }

    #[test]
    fn mul_mat_batch_broadcast_groups_consecutive_batches() {
        // K = 1, M = 1: a has 2 batches (weights 1 and 10); b has 4 batches (values 1, 2, 3, 4).
        // ggml's rule: b batches 0, 1 use a batch 0; b batches 2, 3 use a batch 1.
        let y = mul_mat(([1, 1, 2, 1], vec![1., 10.]), ([1, 1, 4, 1], vec![1., 2., 3., 4.]));
        assert_eq!(y.ne, [1, 1, 4, 1]);
        assert_eq!(y.data, vec![1., 2., 30., 40.]);
    }

    #[test]
    fn mul_mat_broadcasts_dim3_too() {
        // a: one batch in dim 2, two in dim 3; b: two in dim 2, four in dim 3 (K = 2, M = 1, N = 1)
        let a = ([2, 1, 1, 2], vec![1., 1., 1., -1.]);
        let b = ([2, 1, 2, 4], (1..=16).map(f64::from).collect());
        let y = mul_mat(a, b);
        assert_eq!(y.ne, [1, 1, 2, 4]);
        // i3 = 0, 1 use a[.., 0] = [1, 1] (sums); i3 = 2, 3 use a[.., 1] = [1, -1] (differences)
        assert_eq!(y.data, vec![3., 7., 11., 15., -1., -1., -1., -1.]);
    }

    fn mul_mat_id(
        w: ([usize; 4], Vec<f64>),
        b: ([usize; 4], Vec<f64>),
        ids: ([usize; 4], Vec<f64>),
    ) -> Result<RefTensor, crate::KernelError> {
        let wm = TensorMeta::contiguous("t", DType::F32, w.0).unwrap();
        let bm = TensorMeta::contiguous("t", DType::F32, b.0).unwrap();
        let im = TensorMeta::contiguous("t", DType::I32, ids.0).unwrap();
        let out = infer(&Op::MulMatId, &[&wm, &bm, &im]).unwrap();
        let inputs = [RefTensor::new(w.0, w.1), RefTensor::new(b.0, b.1), RefTensor::new(ids.0, ids.1)];
        compute(&Op::MulMatId, &inputs, &out)
    }

    /// Three experts of shape K = 2, N = 1: e0 = [1, 0], e1 = [0, 1], e2 = [1, 1].
    const EXPERTS: ([usize; 4], [f64; 6]) = ([2, 1, 3, 1], [1., 0., 0., 1., 1., 1.]);

    #[test]
    fn mul_mat_id_routes_each_slot_to_its_expert() {
        // 2 tokens, 2 used experts each, one activation row per slot (n_b = n_used):
        // token 0: slots (e2, e0) on rows [1, 2], [3, 4]; token 1: (e1, e2) on [5, 6], [7, 8].
        let b = ([2, 2, 2, 1], vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let ids = ([2, 2, 1, 1], vec![2., 0., 1., 2.]);
        let y = mul_mat_id((EXPERTS.0, EXPERTS.1.to_vec()), b, ids).unwrap();
        assert_eq!(y.ne, [1, 2, 2, 1]);
        assert_eq!(y.data, vec![3., 3., 6., 15.]);
    }

    #[test]
    fn mul_mat_id_broadcasts_one_row_to_all_slots() {
        // n_b = 1: every slot of a token reads the same row.
        let b = ([2, 1, 2, 1], vec![1., 2., 5., 7.]);
        let ids = ([3, 2, 1, 1], vec![0., 1., 2., 2., 2., 1.]);
        let y = mul_mat_id((EXPERTS.0, EXPERTS.1.to_vec()), b, ids).unwrap();
        assert_eq!(y.data, vec![1., 2., 3., 12., 12., 7.]);
    }

    #[test]
    fn mul_mat_id_rejects_out_of_range_ids() {
        let b = ([2, 1, 1, 1], vec![1., 2.]);
        for bad in [3., -1.] {
            let e = mul_mat_id((EXPERTS.0, EXPERTS.1.to_vec()), b.clone(), ([2, 1, 1, 1], vec![0., bad])).unwrap_err();
            assert_eq!(
                e,
                crate::KernelError::IndexOutOfRange {
                    op: "mul_mat_id",
                    index: bad as i64,
                    limit: 3,
                    what: "expert id"
                }
            );
        }
    }

    #[test]
    fn mul_mat_of_quantized_weights_uses_their_dequantized_values() {
        // The reference sees gathered (dequantized) values: a q8_0 weight row equals its decode.
        let vals: Vec<f64> = (0..64).map(|i| f64::from(i) / 10.0 - 3.0).collect();
        let q = crate::host::encode(DType::Q8_0, &vals);
        let am = TensorMeta::contiguous("t", DType::Q8_0, [32, 2, 1, 1]).unwrap();
        let a = RefTensor::new(am.ne, crate::host::gather_f64(&q, 0, &am));
        let bm = TensorMeta::contiguous("t", DType::F32, [32, 1, 1, 1]).unwrap();
        let b = RefTensor::new(bm.ne, vec![1.0; 32]);
        let out = infer(&Op::MulMat, &[&am, &bm]).unwrap();
        let y = compute(&Op::MulMat, &[a.clone(), b], &out).unwrap();
        let want: Vec<f64> = a.data.chunks(32).map(|r| r.iter().sum()).collect();
        assert_eq!(y.data, want);
    }
}
