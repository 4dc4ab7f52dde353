//! gated_delta_net and gated_delta_net_fused: which kernels a call runs ([`Plan`], from the
//! shapes alone), the slot check, the fused op's input preparation, and a file of launches per
//! kernel module: `serial.rs` (`kernels/delta_net.cu`: the token-serial form, which serves the
//! serial algorithm, decode and the chunked shapes the chunked kernels do not cover) and
//! `chunked.rs` (`kernels/delta_net_chunked.cu`: chunked prefills of 128-key, 128-value heads in
//! the WY / UT-transform form on tensor cores in bf16x3). A ragged call runs its long sequences
//! on the chunked kernels and its short ones on the serial kernels.

mod chunked;
mod serial;

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetFusedParams, GatedDeltaNetParams, HeadMap, Op, TensorMeta};

use self::chunked::{CW_C, CW_D, ChunkScratch, scan_shared};
use self::serial::prep_bytes;
use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const CHECK_SLOTS: Kernel = Kernel::new(Module::DeltaNet, "gdn_check_slots");
const INPUT_PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_input_prep");
const DECODE_FUSED: Kernel = Kernel::new(Module::DeltaNet, "gdn_decode_fused");
/// The most sequences (and ragged tokens) `gdn_decode_fused` takes by default
/// (`decode_fused_max`): as far as it measured faster than the three launches
/// (docs/perf-log/delta-net.md).
const DECODE_FUSED_SEQS: i64 = 8;
/// gdn_input_prep's block size (norm.cuh's sub-row walk assumes 256).
const PREP_THREADS: u32 = 256;

/// The largest key dimension the kernels hold in registers (32 NC for NC = 8).
const MAX_S_K: usize = 256;

/// In a ragged call, sequences of at most this many tokens run on the plain serial kernel (decode
/// tokens, short chunks: a 64-token chunk of the chunked kernels costs about as much whatever its
/// length, and the tiled kernel's staging pays off over longer runs); longer ones on the chunked
/// kernels (chunked algorithm) or the tiled serial kernel.
const SHORT: i64 = 16;

/// The seq_offsets argument of a dense call: a null tensor.
const DENSE: TensorArg = TensorArg { data: 0, ne: [0; 4], nb: [0; 4] };

/// Inputs `[q, k, v, g, beta, state, slots]` (+ `seq_offsets` ragged); the state column must fit
/// in registers.
/// gated_delta_net_fused: `[qk, v, alpha, dt_bias, a, beta, state, slots]` (+ `seq_offsets`),
/// the same bound on S_k.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match op {
        Op::GatedDeltaNet(p) => inputs.len() == if p.ragged { 8 } else { 7 } && inputs[0].ne[0] <= MAX_S_K,
        Op::GatedDeltaNetFused(p) => {
            inputs.len() == if p.net.ragged { 9 } else { 8 }
                && inputs[0].ne[0] <= MAX_S_K
                && inputs[..6].iter().all(|m| m.dtype == DType::F32)
        }
        _ => false,
    }
}

/// One call of the delta rule as its kernels take it: `args` = `[q, k, v, g, beta, state, slots]`,
/// the seq_offsets ([`DENSE`] when not ragged), the descriptors of q, k, v, g and beta and their
/// dtype codes, the head map, the output, and where a data error goes.
struct Call<'a> {
    p: &'a GatedDeltaNetParams,
    args: [TensorArg; 7],
    offsets: TensorArg,
    metas: &'a [TensorMeta; 5],
    dts: [i32; 5],
    h_k: i32,
    grouped: i32,
    out: TensorArg,
    err: u64,
    code: u32,
}

/// What one call runs, from the shapes alone (the same for every replay of a captured graph).
struct Plan {
    ragged: bool,
    /// Sequences (blocks in z of the serial kernels).
    n_seq: usize,
    /// Ragged: a bound on the sequences longer than [`SHORT`] (blocks in z of the tiled and the
    /// chunked in-order kernels, which read the work list); dense: `n_seq`.
    n_long: usize,
    /// The chunked kernels' buffers and their grid: (chunks, sequences) dense, (a bound on the
    /// chunks, a bound on the sequences longer than [`SHORT`]) ragged; `None` when they do not
    /// run.
    chunked: Option<(ChunkScratch, usize, usize)>,
    /// Offsets in the scratch arena of gdn_prep's buffers and of the ragged work list.
    prep: usize,
    table: usize,
    end: usize,
}

impl Plan {
    /// `chunked`: the chunked kernels may run (the device has the shared memory for them and the
    /// scratch is 256-byte aligned).
    fn new(p: &GatedDeltaNetParams, q: &TensorMeta, v: &TensorMeta, n_seq: usize, chunked: bool) -> Plan {
        let n_t = q.ne[2];
        let square = q.ne[0] == CW_D && v.ne[0] == CW_D && matches!(p.algo, DeltaNetAlgo::Chunked { .. });
        // At most n_t / (SHORT + 1) sequences are long.
        let n_long = if p.ragged { n_seq.min(n_t / (SHORT as usize + 1)) } else { n_seq };
        let grid = if p.ragged {
            // Every long sequence adds at most one partial chunk.
            (n_long > 0).then(|| ((n_t + (CW_C - 1) * n_long) / CW_C, n_long))
        } else {
            (n_t > 1).then(|| (n_t.div_ceil(CW_C) * n_seq, n_seq))
        };
        // The grid's y is the chunk count (ragged) or the chunks of one sequence (dense).
        let fits = |n_chunks: usize, seqs: usize| if p.ragged { n_chunks } else { n_chunks / seqs } <= 65535;
        let chunked = grid
            .filter(|&(n_chunks, long)| square && chunked && fits(n_chunks, long) && long <= 65535)
            .map(|(n_chunks, long)| (ChunkScratch::new(q, v, n_chunks), n_chunks, long));
        let after_chunks = chunked.as_ref().map_or(0, |c| c.0.end.next_multiple_of(256));
        // Dense calls run either the chunked or the serial kernels; ragged ones the serial kernels
        // always (for the short sequences, or all).
        let prep = if p.ragged || chunked.is_none() { prep_bytes(q) } else { 0 };
        let table = after_chunks + prep;
        let table_bytes = if p.ragged { 4 * (2 * n_seq + 2) } else { 0 };
        Plan { ragged: p.ragged, n_seq, n_long, chunked, prep: after_chunks, table, end: table + table_bytes }
    }
}

/// The scratch of whichever [`Plan`] the call makes (with or without the chunked kernels).
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    if let (Op::GatedDeltaNetFused(p), Some(qk), Some(v), Some(alpha), Some(slots)) =
        (task.op, task.inputs.first(), task.inputs.get(1), task.inputs.get(2), task.inputs.get(7))
    {
        let prep = PrepLayout::new(&qk.meta, &alpha.meta);
        let n_seq = slots.meta.ne[0];
        let with = Plan::new(&p.net, &prep.q, &v.meta, n_seq, true).end;
        return prep.end + with.max(Plan::new(&p.net, &prep.q, &v.meta, n_seq, false).end);
    }
    let (Op::GatedDeltaNet(p), Some(q), Some(v), Some(slots)) =
        (task.op, task.inputs.first(), task.inputs.get(2), task.inputs.get(6))
    else {
        return 0;
    };
    let n_seq = slots.meta.ne[0];
    let with = Plan::new(p, &q.meta, &v.meta, n_seq, true).end;
    with.max(Plan::new(p, &q.meta, &v.meta, n_seq, false).end)
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    if let Op::GatedDeltaNetFused(p) = task.op {
        return run_fused(cx, task, p, ins, out);
    }
    let (p, args, offsets) = (match (task.op, ins) {
        (Op::GatedDeltaNet(p), [q, k, v, g, beta, state, slots]) if !p.ragged => {
            Some((p, [*q, *k, *v, *g, *beta, *state, *slots], DENSE))
        }
        (Op::GatedDeltaNet(p), [q, k, v, g, beta, state, slots, offsets]) if p.ragged => {
            Some((p, [*q, *k, *v, *g, *beta, *state, *slots], *offsets))
        }
        _ => None,
    })
    .ok_or_else(|| unsupported(task, "expected gated_delta_net with 7 inputs (8 ragged)"))?;
    let metas = [0, 1, 2, 3, 4].map(|i| task.inputs[i].meta);
    delta_rule(cx, task, p, args, offsets, &metas, out)
}

/// The delta rule's kernels on `[q, k, v, g, beta, state, slots]` (+ `offsets`, [`DENSE`] when
/// not ragged), `metas` the descriptors of q, k, v, g and beta; scratch from `cx.scratch` on
/// ([`Plan`]).
fn delta_rule(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    p: &GatedDeltaNetParams,
    args: [TensorArg; 7],
    offsets: TensorArg,
    metas: &[TensorMeta; 5],
    out: TensorArg,
) -> Result<(), BackendError> {
    let [_, k, v, _, _, state, slots] = args;
    let s_k = k.ne[0] as usize;
    let (h_v, n_t, n_seq) = (v.ne[1], v.ne[2], slots.ne[0] as usize);
    if s_k > MAX_S_K || n_seq > 65535 || h_v > 65535 || n_seq == 0 {
        return Err(unsupported(task, "S_k above 256, no sequence, or more than 65535 heads or sequences"));
    }
    // (errors name the op the graph holds: gated_delta_net or gated_delta_net_fused)
    let (err, code) = (cx.errors, op_code(task.op.name()));
    let idt = |i: usize| dt(metas[i].dtype);
    let (qdt, kdt, vdt, gdt, bdt) = (idt(0), idt(1), idt(2), idt(3), idt(4));
    let (h_k, grouped) = (k.ne[1] as i32, i32::from(p.head_map == HeadMap::Grouped));
    let (qm, vm) = (&metas[0], &metas[2]);
    // (the in-order pass needs 213 KiB of shared memory a block: Hopper and later; sm_80 parts
    // run the serial kernels)
    let chunked_ok = cx.info.max_shared_per_block >= scan_shared(8) as usize && cx.scratch.is_multiple_of(256);
    let plan = Plan::new(p, qm, vm, n_seq, chunked_ok);
    let table = if plan.ragged { cx.scratch + plan.table as u64 } else { 0 };
    // The chunked kernels need the check's work list before their first kernel; otherwise
    // gdn_prep's first block runs the check (one launch fewer a decode step).
    if plan.chunked.is_some() {
        check(cx, slots, offsets, (n_t, state.ne[3]), SHORT, table, (err, code))?;
    }

    let call = Call { p, args, offsets, metas, dts: [qdt, kdt, vdt, gdt, bdt], h_k, grouped, out, err, code };
    if let Some(chunk) = &plan.chunked {
        chunked::run(cx, &call, &plan, chunk, table)?;
        if !plan.ragged {
            return Ok(());
        }
    }
    serial::run(cx, &call, &plan, table)
}

/// gated_delta_net_fused's preparation buffers at the start of the scratch (each 256-byte
/// aligned): the normalised qk, the decays g and the betas, and the descriptors the delta rule
/// reads them through.
struct PrepLayout {
    /// Byte offsets of qn (`[S_k, 2 H_k, n_t, n_seq]`), g and b (each `[H_v, n_t, n_seq]`) and
    /// the end (where the delta rule's scratch starts).
    qn: usize,
    g: usize,
    b: usize,
    end: usize,
    /// q as the delta rule reads it (k: the same descriptor, `H_k S_k` floats on).
    q: TensorMeta,
    /// g and beta as the delta rule reads them: `[1, H_v, n_t, n_seq]`, contiguous.
    per_head: TensorMeta,
}

impl PrepLayout {
    fn new(qk: &TensorMeta, alpha: &TensorMeta) -> PrepLayout {
        let [s_k, two_h_k, n_t, n_seq] = qk.ne;
        let qn_bytes = 4 * qk.nelements();
        let heads = 4 * alpha.nelements();
        let (g, b) = (qn_bytes.next_multiple_of(256), (qn_bytes.next_multiple_of(256) + heads).next_multiple_of(256));
        let end = (b + heads).next_multiple_of(256);
        let contiguous = |ne: [usize; 4]| TensorMeta {
            dtype: DType::F32,
            ne,
            nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
        };
        let mut q = contiguous([s_k, two_h_k / 2, n_t, n_seq]);
        q.nb = contiguous(qk.ne).nb;
        let per_head = contiguous([1, alpha.ne[0], alpha.ne[1], alpha.ne[2]]);
        PrepLayout { qn: 0, g, b, end, q, per_head }
    }
}

/// A device tensor argument for `meta`'s layout at `data`.
fn arg(data: u64, meta: &TensorMeta) -> TensorArg {
    TensorArg { data, ne: meta.ne.map(|x| x as i64), nb: meta.nb.map(|x| x as i64) }
}

/// gated_delta_net_fused: `gdn_input_prep` writes l2_norm(qk), the decays and sigmoid(beta) into
/// the scratch ([`PrepLayout`]), then the delta rule's kernels run on them with the scratch after
/// those buffers.
fn run_fused(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    p: &GatedDeltaNetFusedParams,
    ins: &[TensorArg],
    out: TensorArg,
) -> Result<(), BackendError> {
    if ins.len() != if p.net.ragged { 9 } else { 8 } || task.inputs.len() != ins.len() {
        return Err(unsupported(task, "expected gated_delta_net_fused with 8 inputs (9 ragged)"));
    }
    let (qk, v, alpha, dt_bias, a, beta, state, slots) =
        (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], ins[6], ins[7]);
    let offsets = if p.net.ragged { ins[8] } else { DENSE };
    if decode_fused_fits(p, &qk, &state, &slots) {
        return decode_fused(cx, task, p, [qk, v, alpha, dt_bias, a, beta, state, slots], offsets, out);
    }
    let (qk_meta, alpha_meta) = (&task.inputs[0].meta, &task.inputs[2].meta);
    let lay = PrepLayout::new(qk_meta, alpha_meta);
    let base = cx.scratch;
    let mut qn_meta = lay.q;
    qn_meta.ne = qk_meta.ne;
    let qn = arg(base + lay.qn as u64, &qn_meta);
    let heads = TensorMeta { ne: alpha_meta.ne, ..lay.per_head };
    let heads = TensorMeta {
        nb: [4, 4 * heads.ne[0], 4 * heads.ne[0] * heads.ne[1], 4 * heads.ne[0] * heads.ne[1] * heads.ne[2]],
        ..heads
    };
    let (g, b) = (arg(base + lay.g as u64, &heads), arg(base + lay.b as u64, &heads));

    // l2_norm's choice of kernel (ops/reduce.rs `norm`): dense aligned rows of up to 256 floats
    // take the 8- or 16-lane rows, others the warp rows (S_k <= MAX_S_K = 256 here).
    let n = qk.ne[0];
    let dense = super::reduce::vec_rows(&qk, DType::F32) && super::reduce::vec_rows(&qn, DType::F32) && n <= 256;
    let norm_kind: i32 = match (dense, n <= 128) {
        (true, true) => 8,
        (true, false) => 16,
        (false, _) => 0,
    };
    let rows = qk.ne[1] * qk.ne[2] * qk.ne[3];
    let rows_per_block = if norm_kind == 0 { 8 } else { PREP_THREADS / norm_kind as u32 };
    let blocks = blocks_for(rows, rows_per_block).max(blocks_for(heads.nelements() as i64, PREP_THREADS));
    let mut l = cx.kernel(INPUT_PREP)?;
    l.arg(&qn).arg(&qk).arg(&norm_kind).arg(&p.eps).arg(&g).arg(&alpha).arg(&dt_bias).arg(&a).arg(&b).arg(&beta);
    // SAFETY: `gdn_input_prep(qn, qk, norm_kind, eps, g, alpha, dt_bias, a, b, beta)`: qk is f32
    // [S_k, 2 H_k, n_t, n_seq] with dense rows (shape rules), qn the contiguous f32 tensor of its
    // shape at the start of the scratch (PrepLayout, within scratch_bytes); the norm rows are
    // those of l2_norm's kernels (norm_kind 8/16 only for dense 16-byte aligned f32 rows with
    // ne0 % 4 == 0 and ne0 <= 4 * 4 * L, as `norm` requires; 256 threads a block as they assume);
    // the scalar blocks (y = 1) read alpha and beta ([H_v, n_t, n_seq, 1], shape rules) at each
    // index below their element count, dt_bias and a at the index modulo their extents (they
    // broadcast to alpha), and write g and b, contiguous f32 of alpha's element count in the
    // scratch (PrepLayout).
    unsafe { l.launch(config((blocks, 2, 1), (PREP_THREADS, 1, 1), 0)) }?;

    let h_k_bytes = lay.q.ne[1] as u64 * lay.q.nb[1] as u64;
    let q = arg(qn.data, &lay.q);
    let k = arg(qn.data + h_k_bytes, &lay.q);
    let (gr, br) = (arg(g.data, &lay.per_head), arg(b.data, &lay.per_head));
    let metas = [lay.q, lay.q, task.inputs[1].meta, lay.per_head, lay.per_head];
    cx.scratch = base + lay.end as u64;
    let r = delta_rule(cx, task, &p.net, [q, k, v, gr, br, state, slots], offsets, &metas, out);
    cx.scratch = base;
    r
}

/// The most sequences `gdn_decode_fused` takes: [`DECODE_FUSED_SEQS`], or
/// `TESSERA_GDN_DECODE_FUSED=N` (read once a process; 0 keeps the three launches: input
/// preparation, gdn_prep, the recurrence).
fn decode_fused_max() -> i64 {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_GDN_DECODE_FUSED").unwrap_or(DECODE_FUSED_SEQS)
}

/// Whether gated_delta_net_fused runs as the one `gdn_decode_fused` launch: at most
/// `decode_fused_max` sequences, each short (dense single tokens, or a ragged batch of no more
/// tokens than that, nor than its sequences or 4: a decode step's bucket, never a prompt's
/// chunk beyond 4 tokens, which would run token by token in one block), 128-key heads, a
/// 16-byte aligned state and qk rows as gdn_n4_vec and its float4 loads need. Each block checks
/// all the offsets and slots once for the sequences it takes (`decode_fused`: a grid of at most
/// the blocks the device holds at once), which is what limits it to a few sequences
/// (docs/perf-log/delta-net.md).
fn decode_fused_fits(p: &GatedDeltaNetFusedParams, qk: &TensorArg, state: &TensorArg, slots: &TensorArg) -> bool {
    let aligned = |t: &TensorArg| t.data.is_multiple_of(16) && t.nb[0] == 4 && t.nb[1..].iter().all(|b| b % 16 == 0);
    let (n_t, max) = (qk.ne[2], decode_fused_max());
    (1..=max).contains(&slots.ne[0])
        && if p.net.ragged { (1..=max.min(slots.ne[0].max(4))).contains(&n_t) } else { n_t == 1 }
        && qk.ne[0] == 128
        && state.ne[0] == 128
        && aligned(qk)
        && aligned(state)
}

/// gated_delta_net_fused as one launch (`decode_fused_fits`): `[qk, v, alpha, dt_bias, a, beta,
/// state, slots]` and the offsets ([`DENSE`] when not ragged).
fn decode_fused(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    p: &GatedDeltaNetFusedParams,
    [qk, v, alpha, dt_bias, a, beta, state, slots]: [TensorArg; 8],
    offsets: TensorArg,
    out: TensorArg,
) -> Result<(), BackendError> {
    let (s_v, h_v, n_seq) = (v.ne[0], v.ne[1], slots.ne[0]);
    if h_v > 65535 || qk.ne[1] % 2 != 0 {
        return Err(unsupported(task, "more than 65535 value heads, or qk without its two halves"));
    }
    let (err, code) = (cx.errors, op_code(task.op.name()));
    let (h_k, grouped) = ((qk.ne[1] / 2) as i32, i32::from(p.net.head_map == HeadMap::Grouped));
    let mut l = cx.kernel(DECODE_FUSED)?;
    l.arg(&out).arg(&qk).arg(&v).arg(&alpha).arg(&dt_bias).arg(&a).arg(&beta).arg(&state).arg(&slots);
    l.arg(&h_k).arg(&grouped).arg(&p.eps).arg(&p.net.scale).arg(&offsets).arg(&err).arg(&code);
    // as many sequences' blocks as the device holds at once; each block takes every gridDim.z-th
    // sequence from its own (one pass of checks for all of them)
    let blocks = crate::launch::tiles(s_v, 16) as u64 * h_v as u64;
    let resident = cx.resident_blocks(DECODE_FUSED, 128, 0)?;
    let z = (resident / blocks.max(1)).clamp(1, 65535).min(n_seq as u64);
    let grid = (crate::launch::tiles(s_v, 16) as u32, h_v as u32, z as u32);
    // SAFETY: `gdn_decode_fused(out, qk, v, alpha, dt_bias, a, beta, state, slots, h_k, grouped, eps,
    // scale, offsets, err, op)`: the shape rules give qk f32 [128, 2 H_k, n_t, n_outer] (rows
    // 16-byte aligned, checked: float4 loads of whole rows), v and out [S_v, H_v, n_t, n_outer],
    // alpha and beta [H_v, n_t, n_outer, 1] with dt_bias and a broadcasting to them (read at the
    // indices modulo their extents), state [128, S_v, H_v, n_slots] 16-byte aligned (checked),
    // slots [n_seq] and offsets [n_seq + 1] (null dense); every block checks the offsets and slots
    // before it writes anything (returning on a bad one), reads tokens within its sequences'
    // clamped spans (sequences z, z + grid z, .. < n_seq), columns below S_v and its own slots'
    // state, and zeroes only rows of `out`'s n_t tokens (ragged padding); the grid (S_v / 16, H_v,
    // 1 ..= min(n_seq, 65535)) is within limits (H_v checked).
    unsafe { l.launch(config(grid, (128, 1, 1), 0)) }?;
    Ok(())
}

/// Records the first bad offset or slot (in order) before any state is written (the main kernels
/// then return at once); ragged, also writes the work list of the sequences longer than
/// `serial_max` (for the tiled and the chunked kernels) to `table`.
fn check(
    cx: &mut Cx<'_>,
    slots: TensorArg,
    offsets: TensorArg,
    (n_t, n_slots): (i64, i64),
    serial_max: i64,
    table: u64,
    (err, code): (u64, u32),
) -> Result<(), BackendError> {
    let mut a = cx.kernel(CHECK_SLOTS)?;
    a.arg(&slots).arg(&offsets).arg(&n_t).arg(&n_slots).arg(&serial_max).arg(&table).arg(&err).arg(&code);
    // SAFETY: `gdn_check_slots(slots, offsets, n_tokens, n_slots, serial_max, table, err, op)` reads
    // the slots' ne[0] = n_seq i32 values and (unless null) the offsets' n_seq + 1 through their
    // strides, and writes the error record and, when `table` is not null, the 2 n_seq + 2 i32 of
    // the work list that Plan::table reserves in the scratch.
    unsafe { a.launch(config((1, 1, 1), (1024, 1, 1), 0)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The chunked kernels against the CPU backend over many chunks (the eval cases are at most one
    //! chunk long), inputs drawn as test-ops draws them. Skips without a GPU.

    use tessera_cpu::CpuBackend;
    use tessera_graph::{Backend, Graph, Session};
    use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetParams, HeadMap};

    use crate::CudaBackend;

    /// `[s_k = s_v, h_k, h_v, n_t, n_seq]`, the head map and the chunk length.
    type Shape = ([usize; 5], HeadMap, usize);

    fn nmse(got: &[f32], want: &[f32]) -> f64 {
        let (mut err, mut norm) = (0.0, 0.0);
        for (&g, &w) in got.iter().zip(want) {
            err += (f64::from(g) - f64::from(w)).powi(2);
            norm += f64::from(w).powi(2);
        }
        if err == 0.0 { 0.0 } else { err / norm }
    }

    /// n values uniform in [lo, hi) a call, from an xorshift stream seeded by `seed`.
    fn uniform_draws(seed: u64) -> impl FnMut(usize, f32, f32) -> Vec<f32> {
        let mut x = seed;
        move |n, lo, hi| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect()
        }
    }

    /// Runs one gated_delta_net on `backend`; returns the output and the whole state after.
    fn run(backend: &mut dyn Backend, (dims, map, chunk): Shape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let [d, h_k, h_v, n_t, n_seq] = dims;
        let n_slots = n_seq + 1;
        let mut uniform = uniform_draws(seed);
        let kr = (1.5 / d as f32).sqrt();
        let mut g = Graph::new();
        let p = GatedDeltaNetParams {
            scale: 1.0 / (d as f32).sqrt(),
            head_map: map,
            algo: DeltaNetAlgo::Chunked { chunk },
            ragged: false,
        };
        let tq = g.input("q", DType::F32, [d, h_k, n_t, n_seq]).expect("q");
        let tk = g.input("k", DType::F32, [d, h_k, n_t, n_seq]).expect("k");
        let tv = g.input("v", DType::F32, [d, h_v, n_t, n_seq]).expect("v");
        let tg = g.input("g", DType::F32, [1, h_v, n_t, n_seq]).expect("g");
        let tb = g.input("beta", DType::F32, [1, h_v, n_t, n_seq]).expect("beta");
        let ts = g.state("state", DType::F32, [d, d, h_v, n_slots]).expect("state");
        let tsl = g.input("slots", DType::I32, [n_seq, 1, 1, 1]).expect("slots");
        let o = g.gated_delta_net(tq, tk, tv, tg, tb, ts, tsl, p).expect("op");
        g.mark_output(o).expect("output");
        g.mark_output(ts).expect("output");
        let mut s = Session::new(&g, backend).expect("session");
        s.set_f32(tq, &uniform(d * h_k * n_t * n_seq, -1.0, 1.0)).expect("set");
        s.set_f32(tk, &uniform(d * h_k * n_t * n_seq, -kr, kr)).expect("set");
        s.set_f32(tv, &uniform(d * h_v * n_t * n_seq, -1.0, 1.0)).expect("set");
        s.set_f32(tg, &uniform(h_v * n_t * n_seq, -1.0, 0.0)).expect("set");
        s.set_f32(tb, &uniform(h_v * n_t * n_seq, 0.0, 1.0)).expect("set");
        s.set_f32(ts, &uniform(d * d * h_v * n_slots, -1.0, 1.0)).expect("set");
        // Sequences in reversed slots, the last slot untouched.
        let slots: Vec<i32> = (0..n_seq as i32).rev().collect();
        s.set_i32(tsl, &slots).expect("set");
        s.run().expect("run");
        (s.get_f32(o).expect("out"), s.get_f32(ts).expect("state"))
    }

    /// Runs one ragged gated_delta_net on `backend`: `lens` tokens per sequence (sequence s in slot
    /// `lens.len() - 1 - s`, one spare slot), then `pad` padding tokens; returns the output and the
    /// whole state after.
    fn run_ragged(
        backend: &mut dyn Backend,
        [d, h_k, h_v]: [usize; 3],
        lens: &[usize],
        pad: usize,
        algo: DeltaNetAlgo,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        let n_seq = lens.len();
        let n_t = lens.iter().sum::<usize>() + pad;
        let n_slots = n_seq + 1;
        let mut uniform = uniform_draws(seed);
        let kr = (1.5 / d as f32).sqrt();
        let mut g = Graph::new();
        let p = GatedDeltaNetParams { scale: 1.0 / (d as f32).sqrt(), head_map: HeadMap::Tiled, algo, ragged: true };
        let tq = g.input("q", DType::F32, [d, h_k, n_t, 1]).expect("q");
        let tk = g.input("k", DType::F32, [d, h_k, n_t, 1]).expect("k");
        let tv = g.input("v", DType::F32, [d, h_v, n_t, 1]).expect("v");
        let tg = g.input("g", DType::F32, [1, h_v, n_t, 1]).expect("g");
        let tb = g.input("beta", DType::F32, [1, h_v, n_t, 1]).expect("beta");
        let ts = g.state("state", DType::F32, [d, d, h_v, n_slots]).expect("state");
        let tsl = g.input("slots", DType::I32, [n_seq, 1, 1, 1]).expect("slots");
        let tof = g.input("seq_offsets", DType::I32, [n_seq + 1, 1, 1, 1]).expect("offsets");
        let o = g.gated_delta_net_ragged(tq, tk, tv, tg, tb, ts, tsl, tof, p).expect("op");
        g.mark_output(o).expect("output");
        g.mark_output(ts).expect("output");
        let mut s = Session::new(&g, backend).expect("session");
        s.set_f32(tq, &uniform(d * h_k * n_t, -1.0, 1.0)).expect("set");
        s.set_f32(tk, &uniform(d * h_k * n_t, -kr, kr)).expect("set");
        s.set_f32(tv, &uniform(d * h_v * n_t, -1.0, 1.0)).expect("set");
        s.set_f32(tg, &uniform(h_v * n_t, -1.0, 0.0)).expect("set");
        s.set_f32(tb, &uniform(h_v * n_t, 0.0, 1.0)).expect("set");
        s.set_f32(ts, &uniform(d * d * h_v * n_slots, -1.0, 1.0)).expect("set");
        let slots: Vec<i32> = (0..n_seq as i32).rev().collect();
        let mut offsets = vec![0i32];
        for &l in lens {
            offsets.push(offsets.last().expect("offsets") + l as i32);
        }
        s.set_i32(tsl, &slots).expect("set");
        s.set_i32(tof, &offsets).expect("set");
        s.run().expect("run");
        (s.get_f32(o).expect("out"), s.get_f32(ts).expect("state"))
    }

    #[test]
    fn ragged_batches_match_the_cpu() {
        let mut cuda = match CudaBackend::new() {
            Ok(b) => b,
            Err(e) => return eprintln!("skipping: {e}"),
        };
        // Long sequences over several chunks (partial last ones), sequences just above and at the
        // serial kernel's limit of 16 tokens, decode tokens, an empty sequence, padding.
        let lens = [700, 1, 1, 0, 65, 17, 16, 1, 130];
        for (i, algo) in [DeltaNetAlgo::Chunked { chunk: 64 }, DeltaNetAlgo::Serial].into_iter().enumerate() {
            let seed = 0x51ed_2701_9e37_79b9 + i as u64;
            let (o_gpu, s_gpu) = run_ragged(&mut cuda, [128, 16, 32], &lens, 3, algo, seed);
            let (o_cpu, s_cpu) = run_ragged(&mut CpuBackend::new(), [128, 16, 32], &lens, 3, algo, seed);
            let (eo, es) = (nmse(&o_gpu, &o_cpu), nmse(&s_gpu, &s_cpu));
            eprintln!("ragged {algo:?}: out nmse {eo:.3e}, state nmse {es:.3e}");
            assert!(eo < 1e-8 && es < 1e-8, "ragged {algo:?}: out nmse {eo:.3e}, state nmse {es:.3e}");
            let pad = &o_gpu[o_gpu.len() - 3 * 128 * 32..];
            assert!(pad.iter().all(|&x| x == 0.0), "padding outputs 0");
        }
    }

    #[test]
    fn chunked_kernels_match_the_cpu_over_many_chunks() {
        let mut cuda = match CudaBackend::new() {
            Ok(b) => b,
            Err(e) => return eprintln!("skipping: {e}"),
        };
        let shapes: [Shape; 4] = [
            ([128, 2, 6, 300, 2], HeadMap::Tiled, 64),
            ([128, 2, 4, 130, 1], HeadMap::Grouped, 16),
            ([128, 1, 2, 64, 1], HeadMap::Tiled, 64),
            ([128, 16, 48, 2048, 1], HeadMap::Tiled, 64),
        ];
        for (i, shape) in shapes.into_iter().enumerate() {
            let (o_gpu, s_gpu) = run(&mut cuda, shape, 0x9e37_79b9_7f4a_7c15 + i as u64);
            let (o_cpu, s_cpu) = run(&mut CpuBackend::new(), shape, 0x9e37_79b9_7f4a_7c15 + i as u64);
            let (eo, es) = (nmse(&o_gpu, &o_cpu), nmse(&s_gpu, &s_cpu));
            eprintln!("{:?}: out nmse {eo:.3e}, state nmse {es:.3e}", shape.0);
            assert!(eo < 1e-8 && es < 1e-8, "{:?}: out nmse {eo:.3e}, state nmse {es:.3e}", shape.0);
        }
    }
}
