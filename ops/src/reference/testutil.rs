//! Helpers shared by the reference unit tests.

use super::{RefTensor, compute};
use crate::{DType, KernelError, Op, TensorMeta, infer};

/// Infers the output of `op` on `(dtype, ne, values)` inputs and runs the reference on them,
/// checking the result has the inferred shape.
pub(super) fn run_typed(op: &Op, inputs: &[(DType, [usize; 4], Vec<f64>)]) -> Result<RefTensor, KernelError> {
    let metas: Vec<TensorMeta> =
        inputs.iter().map(|(d, ne, _)| TensorMeta::contiguous("t", *d, *ne).expect("valid test shape")).collect();
    let meta_refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = infer(op, &meta_refs).expect("valid test op");
    let tensors: Vec<RefTensor> = inputs.iter().map(|(_, ne, v)| RefTensor::new(*ne, v.clone())).collect();
    let y = compute(op, &tensors, &out)?;
    assert_eq!(y.ne, out.ne, "result shape must be the inferred one");
    Ok(y)
}

/// [`run_typed`] with every input f32, for ops that cannot fail on their data.
pub(super) fn run(op: &Op, inputs: &[([usize; 4], Vec<f64>)]) -> RefTensor {
    let typed: Vec<_> = inputs.iter().map(|(ne, v)| (DType::F32, *ne, v.clone())).collect();
    run_typed(op, &typed).expect("the op cannot fail on these values")
}

/// Element-wise agreement to 1e-12, relative for values above 1.
pub(super) fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "element {i}: got {g}, want {w}");
    }
}
