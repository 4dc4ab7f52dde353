//! The plain f64 reference: every op as scalar loops over logical (contiguous, ggml-order)
//! values, written for clarity, not speed. It is the judge of the CPU backend in unit tests and
//! in test-ops. Views never reach it: callers gather strided inputs into [`RefTensor`]s first and
//! scatter the result into the output's layout (which also rounds it to the output dtype).

mod data;
mod elementwise;
mod matmul;
mod reduce;

use crate::{KernelError, Op, TensorMeta};

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
/// (`set_rows`, `cpy`) the result is the new value of the written input. Views are not computed
/// here (see the module doc).
pub fn compute(op: &Op, inputs: &[RefTensor], out: &TensorMeta) -> Result<RefTensor, KernelError> {
    match op {
        Op::GetRows | Op::SetRows | Op::Cpy | Op::Cast(_) | Op::Cont | Op::Concat { .. } | Op::Repeat { .. } => {
            data::compute(op, inputs, out)
        }
        Op::Unary(_) | Op::Binary(_) | Op::Scale(_) | Op::Swiglu => Ok(elementwise::compute(op, inputs, out)),
        Op::RmsNorm(_) | Op::SumRows | Op::Softmax(_) | Op::Argmax => Ok(reduce::compute(op, inputs, out)),
        Op::MulMat => Ok(matmul::compute(inputs, out)),
        Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose => Err(KernelError::Unsupported {
            op: op.name(),
            why: "views are resolved by the executor, not computed".into(),
        }),
    }
}
