//! [`CpuBackend`]: every op in f32 with rayon, the oracle other backends are checked against.
//!
//! # How a task runs
//!
//! 1. Its descriptors are validated ([`check_task`]): every dimension non-zero, spans computable
//!    without overflow, and `tessera_ops::infer` must accept the inputs and agree with the output's
//!    shape and dtype. Kernels may then rely on the shape rules (a hand-built bad task is an error,
//!    not a panic). A task list kept by `Backend::prepare` was validated once, when it was kept;
//!    what depends on the buffers (each exists and holds its spans) is checked on every run.
//! 2. The output buffer is taken out of the buffer table ([`HostBuffers::take`]), so it can be
//!    written while the inputs are borrowed from the table.
//! 3. The input an in-place op writes (`Op::writes_input`) is read from the output bytes themselves
//!    when its placement is the output's (the executor's contract). Other inputs in the output's
//!    buffer are read in place when their bytes are disjoint from the output's (an arena holding
//!    many tensors), and copied out first when they overlap (only hand-built tasks do that), so
//!    every task computes as if its inputs were read before its output is written.
//! 4. The kernel of the op family writes the output (`data`, `elementwise`, `reduce`, `matmul`),
//!    parallel over rows or tiles where the work is worth splitting ([`par`]); the buffer is put
//!    back even when the kernel fails.
//!
//! A backend with one thread runs its task lists on the calling thread, every loop serial.
//!
//! Data-dependent failures (row ids out of range) are `BackendError::Kernel` and are detected
//! before anything is written.

mod attention;
mod conv;
mod data;
mod delta_net;
mod elementwise;
mod elemfuse;
mod fused;
mod math;
mod matmul;
mod par;
mod quant;
mod reduce;
mod rope;
mod sample;
mod strided;
mod sum;
#[cfg(test)]
mod testutil;

use smallvec::SmallVec;
use tessera_graph::{Backend, BackendError, PreparedId, Task, TensorRef, check_range};
use tessera_ops::{KernelError, Op, TensorMeta};

use crate::buffers::{HostBuffer, HostBuffers};
use strided::{Dst, Src, checked_span};

const NAME: &str = "cpu";

/// The fast CPU backend: f32 compute with f32 accumulation in precision-keeping summation order,
/// parallel with rayon.
pub struct CpuBackend {
    buffers: HostBuffers,
    /// Our own thread pool, or `None` for rayon's global one.
    pool: Option<rayon::ThreadPool>,
    /// Task lists kept by `prepare`, by `PreparedId` (`None`: released).
    kept: Vec<Option<Vec<KeptTask>>>,
}

/// A task checked by `prepare` ([`check_task`]), with owned copies of what running it needs.
struct KeptTask {
    op: Op,
    inputs: SmallVec<[TensorRef; 4]>,
    output: TensorRef,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend running on rayon's global thread pool.
    pub fn new() -> Self {
        CpuBackend { buffers: HostBuffers::new(NAME), pool: None, kept: Vec::new() }
    }

    /// A backend with its own pool of `threads` threads (at least 1).
    pub fn with_threads(threads: usize) -> Result<Self, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("tessera-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device { backend: NAME.into(), detail: e.to_string() })?;
        Ok(CpuBackend { buffers: HostBuffers::new(NAME), pool: Some(pool), kept: Vec::new() })
    }

    /// Threads the kernels run on.
    pub fn num_threads(&self) -> usize {
        self.pool.as_ref().map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    /// Bytes currently allocated.
    pub fn allocated(&self) -> usize {
        self.buffers.allocated
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        NAME
    }

    /// Every op with a kernel (all but the views) whose inputs the shape rules accept; a
    /// block-quantized input only where the kernel reads it by whole rows (`reads_quantized`).
    fn supports(&self, op: &Op, inputs: &[TensorMeta]) -> bool {
        let refs: SmallVec<[&TensorMeta; 4]> = inputs.iter().collect();
        !op.is_view()
            && inputs
                .iter()
                .enumerate()
                .all(|(i, m)| (!m.dtype.is_quantized() || reads_quantized(op, i)) && checked_span(m).is_some())
            && tessera_ops::infer(op, &refs).is_ok()
    }

    crate::buffers::host_buffer_methods!();

    /// `allocated_bytes` (bytes of the buffers not yet freed) and `buffers` (how many).
    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![("allocated_bytes", self.buffers.allocated as u64), ("buffers", self.buffers.live() as u64)]
    }

    fn compute(&mut self, tasks: &[Task<'_>]) -> Result<(), BackendError> {
        self.run_list(|buffers| tasks.iter().try_for_each(|t| run_task(buffers, t.op, &t.inputs, &t.output)))
    }

    /// Checks every task once (`check_task`) and keeps owned copies; running them again skips
    /// those checks and the executor's per-run task list. The checks that depend on buffers (the
    /// buffer exists, the span lies inside it) and on data (row and expert ids, state slots) run
    /// every time. A list with a task the checks refuse is not kept, so `compute` reports the
    /// error where it always has, after the tasks before it ran.
    fn prepare(&mut self, tasks: &[Task<'_>]) -> Result<Option<PreparedId>, BackendError> {
        if tasks.iter().any(|t| check_task(t.op, &t.inputs, &t.output).is_err()) {
            return Ok(None);
        }
        let list = tasks.iter().map(|t| KeptTask { op: t.op.clone(), inputs: t.inputs.clone(), output: t.output });
        let list = Some(list.collect());
        let id = match self.kept.iter().position(Option::is_none) {
            Some(i) => {
                self.kept[i] = list;
                i
            }
            None => {
                self.kept.push(list);
                self.kept.len() - 1
            }
        };
        let id = u32::try_from(id).map_err(|_| BackendError::Device {
            backend: NAME.into(),
            detail: "too many prepared task lists".into(),
        })?;
        Ok(Some(PreparedId(id)))
    }

    fn compute_prepared(&mut self, id: PreparedId) -> Result<(), BackendError> {
        let i = id.0 as usize;
        let Some(list) = self.kept.get_mut(i).and_then(Option::take) else {
            return Err(unsupported_list(id));
        };
        let result =
            self.run_list(|buffers| list.iter().try_for_each(|t| run_checked(buffers, &t.op, &t.inputs, &t.output)));
        self.kept[i] = Some(list);
        result
    }

    fn release_prepared(&mut self, id: PreparedId) {
        if let Some(slot) = self.kept.get_mut(id.0 as usize) {
            *slot = None;
        }
    }
}

impl CpuBackend {
    /// Runs `run` (a task list) with the buffer table. With one thread it runs on the calling
    /// thread with every kernel loop serial ([`par::serially`]). Otherwise the whole list runs on
    /// one worker of the pool, so each kernel's parallel loop starts from inside the pool: entered
    /// from outside, every loop would be injected into the pool and the caller put to sleep until
    /// it finished, a futex round trip per op, which at decode sizes cost more than the kernels.
    fn run_list(
        &mut self,
        run: impl FnOnce(&mut HostBuffers) -> Result<(), BackendError> + Send,
    ) -> Result<(), BackendError> {
        let threads = self.num_threads();
        let buffers = &mut self.buffers;
        match &self.pool {
            _ if threads <= 1 => par::serially(|| run(buffers)),
            Some(pool) => pool.install(|| run(buffers)),
            None => rayon::scope(|_| run(buffers)),
        }
    }
}

fn unsupported_list(id: PreparedId) -> BackendError {
    BackendError::Unsupported {
        backend: NAME.into(),
        op: "prepared task list",
        why: format!("{id:?} is not a task list this backend kept"),
    }
}

/// True when input `input` of `op` may be block-quantized on this backend: the kernels that read
/// whole dense rows of blocks (get_rows and set_rows sources, mul_mat / mul_mat_id weights and
/// the gate and up weights of their swiglu fusions, dequantize). The shape rules decide the rest
/// (e.g. they refuse quantized elementwise inputs); this list keeps a kernel that reads elements
/// one by one from ever seeing blocks.
fn reads_quantized(op: &Op, input: usize) -> bool {
    matches!(
        (op, input),
        (Op::GetRows | Op::MulMat | Op::MulMatId | Op::Dequantize, 0)
            | (Op::SetRows, 1)
            | (Op::MulMatSwiglu | Op::MulMatIdSwiglu, 0 | 1)
            | (Op::MulMatIdWeightedSum, 0)
    )
}

/// True when `op` may write a block-quantized output (quantize; whole rows of blocks).
fn writes_quantized(op: &Op) -> bool {
    matches!(op, Op::Quantize(_))
}

fn unsupported(op: &Op, why: String) -> BackendError {
    BackendError::Unsupported { backend: NAME.into(), op: op.name(), why }
}

/// Validates a task ([`check_task`]), then runs it ([`run_checked`]).
fn run_task(buffers: &mut HostBuffers, op: &Op, inputs: &[TensorRef], out: &TensorRef) -> Result<(), BackendError> {
    check_task(op, inputs, out)?;
    run_checked(buffers, op, inputs, out)
}

/// The checks of a task that depend only on its op and descriptors (`prepare` runs them once):
/// no view, block-quantized data only where a kernel reads whole blocks, every span computable,
/// `tessera_ops::infer` accepts the inputs and agrees with the output's shape and dtype, and
/// updated state does not share the output's buffer. Kernels may then rely on the shape rules.
fn check_task(op: &Op, inputs: &[TensorRef], out: &TensorRef) -> Result<(), BackendError> {
    if op.is_view() {
        return Err(unsupported(op, "views are resolved by the executor, not computed".into()));
    }
    let n_inputs = inputs.len();
    for (i, r) in inputs.iter().chain([out]).enumerate() {
        let allowed = if i < n_inputs { reads_quantized(op, i) } else { writes_quantized(op) };
        if r.meta.dtype.is_quantized() && !allowed {
            let which = if i < n_inputs { format!("input {i}") } else { "the output".into() };
            return Err(unsupported(op, format!("block-quantized {} as {which} has no CPU kernel", r.meta.dtype)));
        }
        if checked_span(&r.meta).is_none() {
            let why = format!("descriptor ne {:?} nb {:?} has an empty dimension or overflows", r.meta.ne, r.meta.nb);
            return Err(unsupported(op, why));
        }
    }
    let metas: SmallVec<[&TensorMeta; 4]> = inputs.iter().map(|r| &r.meta).collect();
    let inferred = tessera_ops::infer(op, &metas).map_err(|e| unsupported(op, e.to_string()))?;
    if inferred.ne != out.meta.ne || inferred.dtype != out.meta.dtype {
        let why = format!(
            "output is {} {:?}, but the inputs give {} {:?}",
            out.meta.dtype, out.meta.ne, inferred.dtype, inferred.ne
        );
        return Err(unsupported(op, why));
    }
    // State an op updates as a side effect must not share the output's buffer (the executor gives
    // outputs their own): both are taken out of the table while the kernel runs.
    if let Some(state) = op.updates_input().and_then(|u| inputs.get(u))
        && state.buffer == out.buffer
    {
        return Err(unsupported(op, "the updated state shares the output's buffer".into()));
    }
    Ok(())
}

/// Runs the kernel of a task that passed [`check_task`], with the output buffer taken out of the
/// table; checks that the buffers exist and hold the spans.
fn run_checked(buffers: &mut HostBuffers, op: &Op, inputs: &[TensorRef], out: &TensorRef) -> Result<(), BackendError> {
    // The written input is read in place only when it is exactly the output's placement.
    let in_place = op.writes_input().filter(|&w| inputs.get(w) == Some(out));
    // State an op updates as a side effect is taken out of the table too, so it can be written
    // while the other inputs are read; other inputs in its buffer are not readable meanwhile (an
    // error).
    let updated = op.updates_input().and_then(|u| inputs.get(u).copied());
    let mut state_buf = updated.map(|s| buffers.take(s.buffer)).transpose()?;
    let mut out_buf = match buffers.take(out.buffer) {
        Ok(b) => b,
        Err(e) => {
            if let (Some(s), Some(b)) = (&updated, state_buf.take()) {
                buffers.restore(s.buffer, b);
            }
            return Err(e);
        }
    };
    let state = match (&updated, state_buf.as_mut()) {
        (Some(s), Some(b)) => Some((s, b)),
        _ => None,
    };
    let result = run_with_output(buffers, &mut out_buf, op, inputs, out, in_place, state);
    buffers.restore(out.buffer, out_buf);
    if let (Some(s), Some(b)) = (&updated, state_buf) {
        buffers.restore(s.buffer, b);
    }
    result
}

/// 8-byte aligned owned bytes, so copied-out inputs keep the aligned fast paths.
struct AlignedCopy(Vec<u64>, usize);

impl AlignedCopy {
    fn new(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        AlignedCopy(words, bytes.len())
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.0)[..self.1]
    }
}

fn run_with_output(
    buffers: &HostBuffers,
    out_buf: &mut HostBuffer,
    op: &Op,
    inputs: &[TensorRef],
    out: &TensorRef,
    in_place: Option<usize>,
    state: Option<(&TensorRef, &mut HostBuffer)>,
) -> Result<(), BackendError> {
    let span = out.meta.span_bytes();
    check_range(NAME, out.buffer, out_buf.len(), out.offset, span)?;
    let state = match state {
        Some((r, buf)) => {
            let len = r.meta.span_bytes();
            check_range(NAME, r.buffer, buf.len(), r.offset, len)?;
            Some(StateMut { bytes: &mut buf.bytes_mut()[r.offset..r.offset + len], meta: r.meta })
        }
        None => None,
    };
    let updated = op.updates_input();
    // Where each input in the output's buffer lies; inputs whose bytes overlap the output's
    // (only hand-built tasks do that) are copied before anything is written.
    let mut same_buffer: SmallVec<[Option<(usize, usize)>; 4]> = SmallVec::new();
    let mut copies: SmallVec<[Option<AlignedCopy>; 4]> = SmallVec::new();
    for (i, r) in inputs.iter().enumerate() {
        let (mut range, mut copy) = (None, None);
        if Some(i) != in_place && r.buffer == out.buffer {
            let len = r.meta.span_bytes();
            check_range(NAME, r.buffer, out_buf.len(), r.offset, len)?;
            if r.offset < out.offset + span && out.offset < r.offset + len {
                copy = Some(AlignedCopy::new(&out_buf.bytes()[r.offset..r.offset + len]));
            } else {
                range = Some((r.offset, len));
            }
        }
        same_buffer.push(range);
        copies.push(copy);
    }
    // The output's bytes, and the rest of its buffer (readable by inputs that lie there).
    let (before, rest) = out_buf.bytes_mut().split_at_mut(out.offset);
    let (out_bytes, after) = rest.split_at_mut(span);
    let (before, after): (&[u8], &[u8]) = (before, after);
    let mut srcs: SmallVec<[Option<Src<'_>>; 4]> = SmallVec::new();
    for (i, r) in inputs.iter().enumerate() {
        if Some(i) == in_place || Some(i) == updated {
            srcs.push(None);
            continue;
        }
        let bytes = match (&copies[i], same_buffer[i]) {
            (Some(c), _) => c.bytes(),
            // Disjoint from the output: wholly before it or wholly after it.
            (None, Some((at, len))) if at < out.offset => &before[at..at + len],
            (None, Some((at, len))) => &after[at - out.offset - span..][..len],
            (None, None) => buffers.tensor_bytes(r)?,
        };
        srcs.push(Some(src(op, bytes, r)?));
    }
    dispatch(op, &srcs, state, out_bytes, &out.meta).map_err(BackendError::from)
}

fn src<'a>(op: &Op, bytes: &'a [u8], r: &TensorRef) -> Result<Src<'a>, BackendError> {
    Src::new(bytes, r.meta).ok_or_else(|| unsupported(op, format!("input span of {:?} does not fit", r.meta.ne)))
}

/// State an op updates in place (`Op::updates_input`): the bytes of its span and its descriptor.
pub(crate) struct StateMut<'a> {
    pub bytes: &'a mut [u8],
    pub meta: TensorMeta,
}

/// Runs the kernel of `op`. `srcs[i]` is `None` only for the input written in place (whose current
/// contents are the output bytes) and for the state the op updates (passed as `state`).
fn dispatch(
    op: &Op,
    srcs: &[Option<Src<'_>>],
    state: Option<StateMut<'_>>,
    out: &mut [u8],
    out_meta: &TensorMeta,
) -> Result<(), KernelError> {
    let input = |i: usize| {
        srcs.get(i).copied().flatten().ok_or_else(|| KernelError::Unsupported {
            op: op.name(),
            why: format!("input {i} is missing or is the in-place output"),
        })
    };
    let optional = |i: usize| srcs.get(i).copied().flatten();
    let state =
        || state.ok_or_else(|| KernelError::Unsupported { op: op.name(), why: "its state input is missing".into() });
    match op {
        Op::MulMat => return matmul::mul_mat(input(0)?, input(1)?, out, out_meta),
        Op::MulMatId => return matmul::mul_mat_id(input(0)?, input(1)?, input(2)?, out, out_meta),
        // These address their output's bytes themselves (two planes; rows of k weights).
        Op::AddRmsNormMul(p) => {
            return fused::add_rms_norm_mul(p.eps, input(0)?, input(1)?, input(2)?, out, out_meta);
        }
        Op::MoeWeights => return fused::moe_weights(input(0)?, input(1)?, optional(2), out, out_meta),
        Op::MoeRouter { k } => return fused::moe_router(*k, input(0)?, optional(1), optional(2), out, out_meta),
        Op::MulMatIdWeightedSum => {
            return fused::mul_mat_id_weighted_sum(input(0)?, input(1)?, input(2)?, input(3)?, out, out_meta);
        }
        // The rest write through a `Dst` (the exhaustive match below).
        _ => {}
    }
    let mut dst = Dst::new(out, *out_meta)?;
    match op {
        Op::L2Norm { eps } => reduce::l2_norm(*eps, input(0)?, &mut dst),
        Op::TopK { k } => reduce::top_k(*k, input(0)?, &mut dst),
        Op::Argsort(order) => reduce::argsort(*order, input(0)?, &mut dst),
        Op::Quantize(_) | Op::Dequantize => quant::convert(input(0)?, &mut dst),
        Op::RopeMulti(p) => rope::rope_multi(p, input(0)?, input(1)?, &mut dst),
        Op::FlashAttnExt(p) => {
            let at = p.inputs();
            let mask = at.mask.map(input).transpose()?;
            let table = at.table.map(input).transpose()?;
            let ragged = at.ragged.map(|i| Ok((input(i)?, input(i + 1)?))).transpose()?;
            let x = attention::Operands { q: input(0)?, k: input(1)?, v: input(2)?, mask, table, ragged };
            match at.gate {
                None => attention::flash_attn_ext(p, x, &mut dst),
                Some(g) => fused::gated_attention(p, x, input(g)?, &mut dst),
            }
        }
        Op::SsmConv => conv::ssm_conv(input(0)?, input(1)?, &mut dst),
        Op::Sample => sample::sample(input(0)?, input(1)?, &mut dst),
        Op::RmsNormMul(p) => fused::rms_norm_mul(p.eps, input(0)?, input(1)?, &mut dst),
        Op::RmsNormMulRope(p) => fused::rms_norm_mul_rope(p, input(0)?, input(1)?, input(2)?, &mut dst),
        Op::GatedRmsNorm(p) => fused::gated_rms_norm(p.eps, input(0)?, input(1)?, input(2)?, &mut dst),
        Op::SoftmaxTopK { k } => fused::softmax_top_k(*k, input(0)?, optional(1), &mut dst),
        Op::MulMatSwiglu => fused::mul_mat_swiglu(input(0)?, input(1)?, input(2)?, &mut dst),
        Op::MulMatIdSwiglu => fused::mul_mat_id_swiglu(input(0)?, input(1)?, input(2)?, input(3)?, &mut dst),
        Op::Elementwise(p) => {
            let xs: SmallVec<[Src<'_>; 6]> = (0..p.n_inputs()).map(input).collect::<Result<_, _>>()?;
            elemfuse::elementwise(p, &xs, &mut dst);
            Ok(())
        }
        Op::SsmConvUpdate { silu, ragged } => {
            let offsets = if *ragged { Some(input(4)?) } else { None };
            conv::ssm_conv_update(*silu, input(0)?, state()?, input(2)?, input(3)?, offsets, &mut dst)
        }
        Op::GatedDeltaNet(p) => {
            let qkvgb = [input(0)?, input(1)?, input(2)?, input(3)?, input(4)?];
            let offsets = if p.ragged { Some(input(7)?) } else { None };
            delta_net::gated_delta_net(p, qkvgb, state()?, input(6)?, offsets, &mut dst)
        }
        Op::GatedDeltaNetFused(p) => {
            let xs = [input(0)?, input(1)?, input(2)?, input(3)?, input(4)?, input(5)?];
            let offsets = if p.net.ragged { Some(input(8)?) } else { None };
            fused::gated_delta_net_fused(p, xs, state()?, input(7)?, offsets, &mut dst)
        }
        Op::GetRows => data::get_rows(input(0)?, input(1)?, &mut dst),
        Op::SetRows => data::set_rows(srcs.first().copied().flatten(), input(1)?, input(2)?, &mut dst),
        // The destination input of cpy is only a placement: its old values are never read.
        Op::Cpy | Op::Cast(_) | Op::Cont => {
            data::copy(input(0)?, &mut dst);
            Ok(())
        }
        Op::Concat { dim } => data::concat(input(0)?, input(1)?, *dim, &mut dst),
        Op::Repeat { .. } => {
            data::repeat(input(0)?, &mut dst);
            Ok(())
        }
        Op::Unary(u) => {
            elementwise::unary(*u, input(0)?, &mut dst);
            Ok(())
        }
        Op::Binary(b) => {
            elementwise::binary(*b, input(0)?, input(1)?, &mut dst);
            Ok(())
        }
        Op::Scale(p) => {
            elementwise::scale(*p, input(0)?, &mut dst);
            Ok(())
        }
        Op::Swiglu => {
            elementwise::swiglu(input(0)?, srcs.get(1).copied().flatten(), &mut dst);
            Ok(())
        }
        Op::RmsNorm(p) => {
            reduce::rms_norm(p.eps, input(0)?, &mut dst);
            Ok(())
        }
        Op::SumRows => {
            reduce::sum_rows(input(0)?, &mut dst);
            Ok(())
        }
        Op::Softmax(p) => {
            reduce::softmax(p.scale, input(0)?, optional(1), &mut dst);
            Ok(())
        }
        Op::Argmax => {
            reduce::argmax(input(0)?, &mut dst);
            Ok(())
        }
        // Returned above: they address their output's bytes themselves.
        Op::MulMat
        | Op::MulMatId
        | Op::AddRmsNormMul(_)
        | Op::MoeWeights
        | Op::MoeRouter { .. }
        | Op::MulMatIdWeightedSum => {
            unreachable!("{op} is computed before the row kernels")
        }
        // `check_task` refuses views: the executor resolves them.
        Op::View(_) | Op::Reshape { .. } | Op::Permute { .. } | Op::Transpose | Op::Bitcast(_) => {
            Err(KernelError::Unsupported { op: op.name(), why: "not computed by a row kernel".into() })
        }
    }
}

#[cfg(test)]
mod tests;
