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
mod quant;
mod reduce;
mod rope;
mod sample;

use tessera_graph::{BackendError, Task};
use tessera_ops::{Family, Op, TensorMeta};

pub(crate) use self::matmul::moe_mma::DensePairs;
use crate::launch::{Cx, TensorArg, unsupported};

/// The matmul fusions (family `Fused`) run in `matmul/` with mul_mat and mul_mat_id: their GEMV
/// and MoE kernels apply the GLU or the weighted sum. Every matmul module (`pack`, `gemv`,
/// `gemv_one`, `moe`, `gemm_f32`, the f32 tensor-core GEMM, and `mmq`, the quantized one) serves
/// `matmul/`, whose dispatch picks the path.
fn matmul_fusion(op: &Op) -> bool {
    matches!(op, Op::MulMatSwiglu | Op::MulMatIdSwiglu | Op::MulMatIdWeightedSum)
}

/// The DeltaNet fusion (family `Fused`) runs in `delta_net.rs`: one preparation kernel, then the
/// delta rule's kernels.
fn delta_net_fusion(op: &Op) -> bool {
    matches!(op, Op::GatedDeltaNetFused(_))
}

/// Whether a kernel exists for `op` on inputs with these descriptors (the shape rules have
/// already accepted them).
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match op.family() {
        Family::Matmul => matmul::supports(op, inputs),
        Family::Fused if matmul_fusion(op) => matmul::supports(op, inputs),
        Family::Fused if delta_net_fusion(op) => delta_net::supports(op, inputs),
        Family::Fused => fused::supports(op, inputs),
        Family::Elementwise => elementwise::supports(op, inputs),
        Family::Data => data::supports(op, inputs),
        Family::Reduce => reduce::supports(op, inputs),
        Family::Rope => rope::supports(op, inputs),
        Family::Quant => quant::supports(op, inputs),
        Family::Attention => attention::supports(op, inputs),
        Family::Conv => conv::supports(op, inputs),
        Family::DeltaNet => delta_net::supports(op, inputs),
        Family::Sample => sample::supports(op, inputs),
        // Generated per program (ops/elemfuse.rs), not a module of kernels/.
        Family::ElemFuse => elemfuse::supports(op, inputs),
        Family::View => false,
    }
}

/// Scratch device memory the task needs while it runs (shared by all tasks of a step, one at a
/// time, so the step gets the largest of them).
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    match task.op.family() {
        Family::Matmul => matmul::scratch_bytes(task),
        Family::Fused if matmul_fusion(task.op) => matmul::scratch_bytes(task),
        Family::Fused if delta_net_fusion(task.op) => delta_net::scratch_bytes(task),
        Family::Attention => attention::scratch_bytes(task),
        Family::DeltaNet => delta_net::scratch_bytes(task),
        Family::Reduce => reduce::scratch_bytes(task),
        Family::Sample => sample::scratch_bytes(task),
        Family::Fused
        | Family::Elementwise
        | Family::Data
        | Family::Rope
        | Family::Quant
        | Family::Conv
        | Family::ElemFuse
        | Family::View => 0,
    }
}

/// Enqueues the task's kernels.
pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    match task.op.family() {
        Family::Matmul => matmul::run(cx, task, ins, out),
        Family::Fused if matmul_fusion(task.op) => matmul::run(cx, task, ins, out),
        Family::Fused if delta_net_fusion(task.op) => delta_net::run(cx, task, ins, out),
        Family::Fused => fused::run(cx, task, ins, out),
        Family::Elementwise => elementwise::run(cx, task, ins, out),
        Family::Data => data::run(cx, task, ins, out),
        Family::Reduce => reduce::run(cx, task, ins, out),
        Family::Rope => rope::run(cx, task, ins, out),
        Family::Quant => quant::run(cx, task, ins, out),
        Family::Attention => attention::run(cx, task, ins, out),
        Family::Conv => conv::run(cx, task, ins, out),
        Family::DeltaNet => delta_net::run(cx, task, ins, out),
        Family::Sample => sample::run(cx, task, ins, out),
        Family::ElemFuse => elemfuse::run(cx, task, ins, out),
        Family::View => Err(unsupported(task, "views are resolved by the executor, never computed")),
    }
}
