//! Reference mul_mat and mul_mat_id.

use super::RefTensor;
use crate::{KernelError, Op, TensorMeta};

pub(super) fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    match op {
        Op::MulMat => Ok(mul_mat(inputs, out)),
        Op::MulMatId => todo!("mul_mat_id reference"),
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
}
