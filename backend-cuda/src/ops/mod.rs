//! Op dispatch: which family's wrappers run a task, whether the family has a kernel for the inputs,
//! and how much scratch memory it needs. One file per family, as in `kernels/`.

mod attention;
mod conv;
mod data;
mod delta_net;
mod elementwise;
mod elemfuse;
mod fused;
mod matmul;
pub(crate) mod mmq;
mod quant;
mod reduce;
mod rope;
mod sample;

use tessera_graph::{BackendError, Task};
use tessera_ops::{Op, TensorMeta};

use crate::compile::Module as Family;
use crate::launch::{Cx, TensorArg, unsupported};

/// The kernel module (`kernels/<family>.cu`) whose wrappers run `op`; `None` for views. The matmul
/// ops name `gemv` (mul_mat) or `moe` (mul_mat_id), but every matmul module (`pack`, `gemv`,
/// `gemv_one`, `moe`, and `mmq`, the quantized tensor-core GEMM) serves them under `matmul/`, whose
/// dispatch picks the path.
fn family(op: &Op) -> Option<Family> {
    Some(match op {
        Op::Unary(_) | Op::Binary(_) | Op::Scale(_) | Op::Swiglu => Family::Elementwise,
        Op::GetRows | Op::SetRows | Op::Cpy | Op::Cast(_) | Op::Cont | Op::Concat { .. } | Op::Repeat { .. } => {
            Family::Data
        }
        Op::RmsNorm(_)
        | Op::L2Norm { .. }
        | Op::SumRows
        | Op::Softmax(_)
        | Op::Argmax
        | Op::TopK { .. }
        | Op::Argsort(_) => Family::Reduce,
        Op::RopeMulti(_) => Family::Rope,
        Op::Quantize(_) | Op::Dequantize => Family::Quant,
        Op::MulMat => Family::Gemv,
        Op::MulMatId => Family::Moe,
        Op::FlashAttnExt(_) => Family::Attention,
        Op::SsmConv | Op::SsmConvUpdate { .. } => Family::Conv,
        Op::GatedDeltaNet(_) => Family::DeltaNet,
        Op::Sample => Family::Sample,
        Op::AddRmsNormMul(_) | Op::RmsNormMul(_) | Op::GatedRmsNorm(_) | Op::SoftmaxTopK { .. } | Op::MoeWeights => {
            Family::Fused
        }
        // Generated per program (ops/elemfuse.rs), not a module of kernels/.
        Op::Elementwise(_) => return None,
        Op::MulMatSwiglu => Family::Gemv,
        Op::MulMatIdSwiglu | Op::MulMatIdWeightedSum => Family::Moe,
        Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose => return None,
    })
}

/// Whether a kernel exists for `op` on inputs with these descriptors (the shape rules have
/// already accepted them).
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    if let Op::Elementwise(_) = op {
        return elemfuse::supports(op, inputs);
    }
    match family(op) {
        Some(Family::Elementwise) => elementwise::supports(op, inputs),
        Some(Family::Data) => data::supports(op, inputs),
        Some(Family::Reduce) => reduce::supports(op, inputs),
        Some(Family::Rope) => rope::supports(op, inputs),
        Some(Family::Quant) => quant::supports(op, inputs),
        Some(Family::Pack | Family::Gemv | Family::GemvOne | Family::Moe | Family::Mmq) => matmul::supports(op, inputs),
        Some(Family::Attention) => attention::supports(op, inputs),
        Some(Family::Conv) => conv::supports(op, inputs),
        Some(Family::DeltaNet) => delta_net::supports(op, inputs),
        Some(Family::Sample) => sample::supports(op, inputs),
        Some(Family::Fused) => fused::supports(op, inputs),
        None => false,
    }
}

/// Scratch device memory the task needs while it runs (shared by all tasks of a step, one at a
/// time, so the step gets the largest of them).
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    match family(task.op) {
        Some(Family::Gemv | Family::Moe) => matmul::scratch_bytes(task),
        Some(Family::Attention) => attention::scratch_bytes(task),
        Some(Family::DeltaNet) => delta_net::scratch_bytes(task),
        Some(Family::Reduce) => reduce::scratch_bytes(task),
        Some(Family::Sample) => sample::scratch_bytes(task),
        _ => 0,
    }
}

/// Enqueues the task's kernels.
pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    if let Op::Elementwise(_) = task.op {
        return elemfuse::run(cx, task, ins, out);
    }
    match family(task.op) {
        Some(Family::Elementwise) => elementwise::run(cx, task, ins, out),
        Some(Family::Data) => data::run(cx, task, ins, out),
        Some(Family::Reduce) => reduce::run(cx, task, ins, out),
        Some(Family::Rope) => rope::run(cx, task, ins, out),
        Some(Family::Quant) => quant::run(cx, task, ins, out),
        Some(Family::Pack | Family::Gemv | Family::GemvOne | Family::Moe | Family::Mmq) => {
            matmul::run(cx, task, ins, out)
        }
        Some(Family::Attention) => attention::run(cx, task, ins, out),
        Some(Family::Conv) => conv::run(cx, task, ins, out),
        Some(Family::DeltaNet) => delta_net::run(cx, task, ins, out),
        Some(Family::Sample) => sample::run(cx, task, ins, out),
        Some(Family::Fused) => fused::run(cx, task, ins, out),
        None => Err(unsupported(task, "views are resolved by the executor, never computed")),
    }
}
