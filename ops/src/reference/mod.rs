//! The plain f64 reference: every op as scalar loops over logical (contiguous, ggml-order)
//! values, written for clarity, not speed. It is the judge of the CPU backend in unit tests and
//! in test-ops. Views never reach it: callers gather strided inputs into [`RefTensor`]s first and
//! scatter the result into the output's layout (which also rounds it to the output dtype).

mod attention;
mod conv;
mod data;
mod delta_net;
mod elementwise;
mod elemfuse;
mod fused;
mod matmul;
mod quant;
mod reduce;
mod rope;
mod sample;
#[cfg(test)]
mod testutil;

use crate::{Family, KernelError, Op, TensorMeta};

pub use sample::sample_accepts;

/// A tensor's logical values in ggml order (`ne[0]` fastest), as f64.
#[derive(Debug, Clone, PartialEq)]
pub struct RefTensor {
    pub ne: [usize; 4],
    pub data: Vec<f64>,
}

impl RefTensor {
    pub fn new(ne: [usize; 4], data: Vec<f64>) -> Self {
        assert_eq!(
            ne.iter().product::<usize>(),
            data.len(),
            "RefTensor: shape {ne:?} does not match {} values",
            data.len()
        );
        RefTensor { ne, data }
    }

    pub fn zeros(ne: [usize; 4]) -> Self {
        RefTensor { ne, data: vec![0.0; ne.iter().product()] }
    }

    /// Index of logical element `(i0, i1, i2, i3)` in `data`.
    pub fn index(&self, i: [usize; 4]) -> usize {
        i[0] + self.ne[0] * (i[1] + self.ne[1] * (i[2] + self.ne[2] * i[3]))
    }

    pub fn at(&self, i: [usize; 4]) -> f64 {
        self.data[self.index(i)]
    }

    pub fn set(&mut self, i: [usize; 4], x: f64) {
        let k = self.index(i);
        self.data[k] = x;
    }

    /// Every index in logical order.
    pub fn indices(ne: [usize; 4]) -> impl Iterator<Item = [usize; 4]> {
        (0..ne[3]).flat_map(move |i3| {
            (0..ne[2]).flat_map(move |i2| (0..ne[1]).flat_map(move |i1| (0..ne[0]).map(move |i0| [i0, i1, i2, i3])))
        })
    }
}

/// Computes `op` on logical `inputs` producing a tensor of shape `out.ne`. For in-place ops
/// (`set_rows`, `cpy`) the result is the new value of the written input. Ops that update an input
/// as a side effect (`Op::updates_input`) go through [`compute_updating`]. Views are not computed
/// here (see the module doc).
///
/// Precondition: `inputs` are the values of tensors whose descriptors [`crate::infer`] accepted
/// for `op`, and `out` is what it returned (`ReferenceBackend` and the executor guarantee this;
/// the session never hands an unvalidated task to a backend). Data-dependent problems (ids out of
/// range) are errors, not panics.
pub fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    let updating = || KernelError::Unsupported {
        op: op.name(),
        why: "it updates an input in place: use reference::compute_updating".into(),
    };
    match op.family() {
        Family::Data => data::compute(op, inputs, out),
        Family::Elementwise => Ok(elementwise::compute(op, inputs, out)),
        Family::Reduce => Ok(reduce::compute(op, inputs, out)),
        Family::Matmul => matmul::compute(op, inputs, out),
        Family::Quant => Ok(quant::compute(op, inputs, out)),
        Family::Rope => rope::compute(op, inputs, out),
        Family::Attention => attention::compute(op, inputs, out),
        // ssm_conv_update_inplace and gated_delta_net update their state in place.
        Family::Conv if op.updates_input().is_some() => Err(updating()),
        Family::Conv => conv::compute(op, inputs, out),
        Family::DeltaNet => Err(updating()),
        Family::Sample => sample::compute(inputs, out),
        Family::Fused if op.updates_input().is_some() => Err(updating()),
        Family::Fused => fused::compute_fused(op, inputs, out),
        Family::ElemFuse => elemfuse::compute_program(op, inputs, out),
        Family::View => Err(KernelError::Unsupported {
            op: op.name(),
            why: "views are resolved by the executor, not computed".into(),
        }),
    }
}

/// For ops that update an input in place (`Op::updates_input`): returns the output and the new
/// value of the updated input (the whole tensor, all slots).
pub fn compute_updating(
    op: &Op,
    inputs: &[RefTensor],
    out: &TensorMeta,
) -> Result<(RefTensor, RefTensor), KernelError> {
    match op {
        Op::SsmConvUpdate { silu, ragged } => conv::update(*silu, *ragged, inputs, out),
        Op::GatedDeltaNet(p) => delta_net::compute(p, inputs, out),
        Op::GatedDeltaNetFused(p) => fused::delta_net_fused(op, p, inputs, out),
        _ => Err(KernelError::Unsupported { op: op.name(), why: "it does not update an input".into() }),
    }
}
