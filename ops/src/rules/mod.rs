//! Shape/dtype inference and cost, one file per op family. [`infer`] is pure: it sees only the
//! op and its inputs' descriptors and either returns the output descriptor or says what is wrong.

mod data;
mod elementwise;
mod matmul;
mod reduce;
mod view;

use crate::{DType, Op, OpError, TensorMeta};

/// What an op costs to run once: arithmetic and the memory traffic it cannot avoid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Floating-point operations (a multiply-add counts as 2).
    pub flops: u64,
    /// Bytes read plus bytes written, each tensor counted once at its dtype's size.
    pub bytes: u64,
}

/// The output descriptor of `op` applied to `inputs`, or an error naming the op and the offending
/// inputs. Views get the strides of the window they describe; every other op gets a contiguous
/// output, except in-place ops whose output is the tensor they write.
pub fn infer(op: &Op, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
    match op {
        Op::GetRows | Op::SetRows | Op::Cpy | Op::Cast(_) | Op::Cont | Op::Concat { .. } | Op::Repeat { .. } => {
            data::infer(op, inputs)
        }
        Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose => view::infer(op, inputs),
        Op::Unary(_) | Op::Binary(_) | Op::Scale(_) | Op::Swiglu => elementwise::infer(op, inputs),
        Op::RmsNorm(_) | Op::SumRows | Op::Softmax(_) | Op::Argmax => reduce::infer(op, inputs),
        Op::MulMat => matmul::infer(op, inputs),
    }
}

/// The cost of `op` on `inputs` producing `out` (as returned by [`infer`]).
pub fn cost(op: &Op, inputs: &[&TensorMeta], out: &TensorMeta) -> Cost {
    if op.is_view() {
        return Cost::default();
    }
    let bytes_in: usize = inputs.iter().map(|m| m.nbytes_contiguous()).sum();
    let mut bytes = bytes_in + out.nbytes_contiguous();
    let n = out.nelements() as u64;
    let flops = match op {
        Op::MulMat => matmul::flops(inputs, out),
        Op::Unary(u) => n * elementwise::unary_flops(*u),
        Op::Binary(_) => n,
        Op::Scale(_) => 2 * n,
        Op::Swiglu => 6 * n,
        Op::RmsNorm(_) => 3 * inputs[0].nelements() as u64,
        Op::SumRows => inputs[0].nelements() as u64,
        Op::Softmax(_) => 5 * inputs[0].nelements() as u64,
        Op::Argmax => inputs[0].nelements() as u64,
        _ => 0,
    };
    match op {
        // Only the gathered rows of the source are read.
        Op::GetRows => bytes = inputs[1].nbytes_contiguous() + 2 * out.nbytes_contiguous(),
        // Only the written rows of the destination are touched.
        Op::SetRows => bytes = 2 * inputs[1].nbytes_contiguous() + inputs[2].nbytes_contiguous(),
        Op::Cpy => bytes = inputs[0].nbytes_contiguous() + inputs[1].nbytes_contiguous(),
        _ => {}
    }
    Cost { flops, bytes: bytes as u64 }
}

// ---- helpers shared by the family files ----

pub(crate) fn expect_arity(op: &Op, inputs: &[&TensorMeta], n: usize) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::Arity { op: op.name(), expected: ARITY_NAMES[n.min(3)], got: inputs.len() });
    }
    Ok(())
}

const ARITY_NAMES: [&str; 4] = ["0", "1", "2", "3"];

pub(crate) fn expect_float(op: &Op, input: usize, m: &TensorMeta) -> Result<(), OpError> {
    if !m.dtype.is_float() {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected: "a float type (f32, f16, bf16)" });
    }
    Ok(())
}

pub(crate) fn expect_dtype(
    op: &Op,
    input: usize,
    m: &TensorMeta,
    want: DType,
    expected: &'static str,
) -> Result<(), OpError> {
    if m.dtype != want {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected });
    }
    Ok(())
}

/// Block-quantized tensors are weights: only ops that read them by rows accept them.
pub(crate) fn expect_not_quantized(op: &Op, input: usize, m: &TensorMeta) -> Result<(), OpError> {
    if m.dtype.is_quantized() {
        return Err(OpError::DType { op: op.name(), input, dtype: m.dtype, expected: "a non-quantized type" });
    }
    Ok(())
}

pub(crate) fn contiguous(op: &Op, dtype: DType, ne: [usize; 4]) -> Result<TensorMeta, OpError> {
    TensorMeta::contiguous(op.name(), dtype, ne)
}

/// ggml's repeat rule: `small` can be tiled to `big` when each dimension divides.
pub(crate) fn can_repeat(small: &[usize; 4], big: &[usize; 4]) -> bool {
    small.iter().zip(big).all(|(s, b)| b % s == 0)
}
