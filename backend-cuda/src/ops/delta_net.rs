//! gated_delta_net: `kernels/delta_net.cu`. A one-block kernel validates the slots, a pre-pass
//! writes k, q (times scale) and k . q per token as padded f32 rows to scratch, then one kernel
//! runs the recurrence with each state column held in registers (read and written once, in place
//! in its slot); prefills of 128-key heads stage 16-token tiles of k and q in shared memory with
//! cp.async, double buffered. Chunked prefills of 128-key, 128-value heads (chunks of at most 64
//! tokens) run the WY / UT-transform form instead: `gdn_chunk_prep` builds every chunk's W, U,
//! masked Q K^T and gamma in parallel, then `gdn_chunk_scan` runs the chunks in order over 64-column
//! slices of the state in shared memory. All products are f32 on CUDA cores: the f32 cases' bound
//! (NMSE 1e-7) leaves no room for tf32 or bf16 tensor-core products.

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{DeltaNetAlgo, HeadMap, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, config, dt, launch_error, unsupported};

const CHECK_SLOTS: Kernel = Kernel::new(Module::DeltaNet, "gdn_check_slots");
const PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_prep");
const GDN_N1: Kernel = Kernel::new(Module::DeltaNet, "gdn_n1");
const GDN_N2: Kernel = Kernel::new(Module::DeltaNet, "gdn_n2");
const GDN_N4: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4");
const GDN_N8: Kernel = Kernel::new(Module::DeltaNet, "gdn_n8");
const GDN_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4_vec");
const GDN_TILED_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_tiled_n4_vec");
const CHUNK_PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_chunk_prep");
const CHUNK_SCAN: Kernel = Kernel::new(Module::DeltaNet, "gdn_chunk_scan");

/// GDN_WARPS * 32 and GDN_COLS in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;
/// GC_D, GC_C, GC_SLOT and GC_COLS in delta_net.cu: the chunked kernels' head size, largest
/// chunk, floats per chunk slot of scratch (W, U, QKm, gamma) and state columns per scan block.
const CHUNK_D: usize = 128;
const CHUNK_MAX: usize = 64;
const CHUNK_SLOT: usize = 2 * CHUNK_MAX * CHUNK_D + CHUNK_MAX * CHUNK_MAX + CHUNK_MAX;
const CHUNK_COLS: usize = 64;
/// gdn_chunk_prep's dynamic shared memory: k and v rows (padded to 132), A and T (padded to
/// 65) and three per-row vectors.
const CHUNK_PREP_SHARED: u32 =
    (4 * (2 * CHUNK_MAX * (CHUNK_D + 4) + 2 * CHUNK_MAX * (CHUNK_MAX + 1) + 3 * CHUNK_MAX)) as u32;
/// GC_SCAN_SHARED: W and Q rows, two buffers of K rows, QKm and gamma, the state slice, V_new
/// and the row weights (213 KiB: above the 163 KiB an sm_80 block may have, where the serial
/// kernels run instead).
const CHUNK_SCAN_SHARED: u32 = (4
    * (2 * CHUNK_MAX * (CHUNK_D + 4)
        + 2 * (CHUNK_MAX * (CHUNK_D + 4) + CHUNK_MAX * CHUNK_MAX + CHUNK_MAX)
        + CHUNK_D * CHUNK_COLS
        + CHUNK_MAX * CHUNK_COLS
        + CHUNK_MAX)) as u32;

/// The largest key dimension the kernels hold in registers (32 NC for NC = 8).
const MAX_S_K: usize = 256;

const OP: &str = "gated_delta_net";

/// Inputs `[q, k, v, g, beta, state, slots]`; the state column must fit in registers.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    matches!(op, Op::GatedDeltaNet(_)) && inputs.len() == 7 && inputs[0].ne[0] <= MAX_S_K
}

/// Float4 chunks per lane (the kernels' NC): the key dimension padded to 32 NC.
fn chunks(s_k: usize) -> usize {
    s_k.div_ceil(32).next_power_of_two().max(1)
}

/// gdn_prep's rows (one per token, key head and sequence) and their padded length.
fn prep_rows(q: &TensorMeta) -> (usize, usize) {
    let [s_k, h_k, n_t, n_seq] = q.ne;
    (h_k * n_t * n_seq, 32 * chunks(s_k))
}

/// Bytes of gdn_prep's buffers: k and q rows and k . q for every token, 4 (2 KS + 1) bytes per
/// row, rounded up to 256.
fn prep_bytes(q: &TensorMeta) -> usize {
    let (rows, ks) = prep_rows(q);
    (4 * rows * (2 * ks + 1)).next_multiple_of(256)
}

/// The chunk length and number of chunks when the chunked kernels run: a chunked prefill of
/// 128-key, 128-value heads with chunks of at most 64 tokens (the last may be shorter).
fn chunked_plan(op: &Op, q: &TensorMeta, v: &TensorMeta) -> Option<(usize, usize)> {
    let Op::GatedDeltaNet(p) = op else { return None };
    let DeltaNetAlgo::Chunked { chunk } = p.algo else { return None };
    let n_t = q.ne[2];
    let c = chunk.min(n_t);
    (n_t > 1 && (1..=CHUNK_MAX).contains(&c) && q.ne[0] == CHUNK_D && v.ne[0] == CHUNK_D).then(|| (c, n_t.div_ceil(c)))
}

/// gdn_prep's buffers, then (chunked) a slot of W, U, QKm and gamma per chunk of every (sequence,
/// value head).
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let (Some(q), Some(v)) = (task.inputs.first(), task.inputs.get(2)) else { return 0 };
    let chunks = chunked_plan(task.op, &q.meta, &v.meta).map_or(0, |(_, n)| n * v.meta.ne[1] * v.meta.ne[3]);
    prep_bytes(&q.meta) + 4 * CHUNK_SLOT * chunks
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let (Op::GatedDeltaNet(p), [q, k, v, g, beta, state, slots]) = (task.op, ins) else {
        return Err(unsupported(task, "expected gated_delta_net with 7 inputs"));
    };
    let s_k = k.ne[0] as usize;
    let (s_v, h_v, n_seq) = (v.ne[0], v.ne[1], v.ne[3]);
    if s_k > MAX_S_K || n_seq > 65535 || h_v > 65535 {
        return Err(unsupported(task, "S_k above 256 or more than 65535 heads or sequences"));
    }
    let (err, code) = (cx.errors, op_code(OP));
    check_slots(cx, *slots, state.ne[3], err, code)?;

    let (rows, ks) = prep_rows(&task.inputs[0].meta);
    let (kbuf, qbuf) = (cx.scratch, cx.scratch + (4 * rows * ks) as u64);
    let kq = qbuf + (4 * rows * ks) as u64;
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    let (qdt, kdt, vdt, gdt, bdt) = (idt(0), idt(1), idt(2), idt(3), idt(4));
    let ks_len = ks as i32;
    let f = cx.function(PREP)?;
    let mut a = cx.stream.launch_builder(&f);
    a.arg(q).arg(&qdt).arg(k).arg(&kdt).arg(&p.scale).arg(&ks_len).arg(&kbuf).arg(&qbuf).arg(&kq);
    let warps_per_block = THREADS as usize / 32;
    let cfg = config((rows.div_ceil(warps_per_block).clamp(1, 1 << 20) as u32, 1, 1), (THREADS, 1, 1), 0);
    // SAFETY: `gdn_prep(q, qdt, k, kdt, scale, ks_len, kbuf, qbuf, kq)`: q and k are [S_k, H_k,
    // n_t, n_seq] (shape rules), read within those extents; scratch holds (scratch_bytes) rows
    // = H_k n_t n_seq rows of ks_len floats for kbuf and for qbuf, then rows floats for kq.
    unsafe { a.launch(cfg) }.map_err(|e| launch_error(PREP, e))?;

    let (h_k, grouped) = (k.ne[1] as i32, i32::from(p.head_map == HeadMap::Grouped));
    let plan = chunked_plan(task.op, &task.inputs[0].meta, &task.inputs[2].meta);
    // The chunked kernels need more shared memory than some devices give a block.
    let chunked = plan.is_some()
        && cx.scratch.is_multiple_of(16)
        && cx.allow_shared(CHUNK_PREP, CHUNK_PREP_SHARED).is_ok()
        && cx.allow_shared(CHUNK_SCAN, CHUNK_SCAN_SHARED).is_ok();
    if let Some((chunk, n_chunks)) = plan.filter(|_| chunked) {
        let cbuf = cx.scratch + prep_bytes(&task.inputs[0].meta) as u64;
        let (chunk, n_chunks) = (chunk as i32, n_chunks as i32);
        let f = cx.function(CHUNK_PREP)?;
        let mut a = cx.stream.launch_builder(&f);
        a.arg(v).arg(&vdt).arg(g).arg(&gdt).arg(beta).arg(&bdt).arg(&h_k).arg(&grouped).arg(&chunk);
        a.arg(&kbuf).arg(&qbuf).arg(&cbuf).arg(&err);
        let grid = (n_chunks as u32, h_v as u32, n_seq as u32);
        // SAFETY: `gdn_chunk_prep(v, vdt, g, gdt, beta, bdt, h_k, grouped, chunk, kbuf, qbuf, cbuf,
        // err)`: S_k = S_v = 128 and 1 <= chunk <= 64 (chunked_plan); the grid covers (n_chunks,
        // H_v, n_seq) with n_chunks chunk >= n_t, and rows past n_t are neither read nor written
        // past the chunk slot; v, g and beta are read within their shape-rule extents; kbuf and
        // qbuf are gdn_prep's 16-byte aligned rows of 128 floats; cbuf holds (scratch_bytes)
        // n_seq H_v n_chunks slots of CHUNK_SLOT floats; the dynamic shared memory is the
        // kernel's layout, allowed just above.
        unsafe { a.launch(config(grid, (256, 1, 1), CHUNK_PREP_SHARED)) }.map_err(|e| launch_error(CHUNK_PREP, e))?;

        let f = cx.function(CHUNK_SCAN)?;
        let mut a = cx.stream.launch_builder(&f);
        a.arg(&out).arg(state).arg(slots).arg(&h_k).arg(&grouped).arg(&chunk).arg(&n_chunks);
        a.arg(&kbuf).arg(&qbuf).arg(&cbuf).arg(&err);
        let grid = ((CHUNK_D / CHUNK_COLS) as u32, h_v as u32, n_seq as u32);
        // SAFETY: `gdn_chunk_scan(out, state, slots, h_k, grouped, chunk, n_chunks, kbuf, qbuf,
        // cbuf, err)`: out is [128, H_v, n_t, n_seq] and state [128, 128, H_v, n_slots] (shape
        // rules, S_k = S_v = 128); the grid covers (128 / 64, H_v, n_seq); slots outside [0,
        // n_slots) are skipped; the prep rows (16-byte aligned) and chunk slots are those written
        // above, and only rows inside the sequence are copied; the dynamic shared memory is the
        // kernel's layout, allowed above.
        unsafe { a.launch(config(grid, (256, 1, 1), CHUNK_SCAN_SHARED)) }.map_err(|e| launch_error(CHUNK_SCAN, e))?;
        return Ok(());
    }

    let aligned = state.data.is_multiple_of(16) && state.nb[0] == 4 && state.nb[1..].iter().all(|b| b % 16 == 0);
    // Prefill of the model head size: tiles of 16 tokens staged in shared memory (double buffered).
    let tiled = v.ne[2] > 1 && s_k == 128 && aligned && cx.scratch.is_multiple_of(16);
    let tile_tokens = 64 / chunks(s_k);
    let shared =
        if tiled { (2 * 4 * (2 * tile_tokens * 128 + tile_tokens * COLS + 3 * tile_tokens)) as u32 } else { 0 };
    let kernel = match chunks(s_k) {
        4 if tiled => GDN_TILED_N4_VEC,
        1 => GDN_N1,
        2 => GDN_N2,
        4 if s_k == 128 && aligned => GDN_N4_VEC,
        4 => GDN_N4,
        _ => GDN_N8,
    };
    let grid = ((s_v as usize).div_ceil(COLS) as u32, h_v as u32, n_seq as u32);
    let f = cx.function(kernel)?;
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&out).arg(v).arg(&vdt).arg(g).arg(&gdt).arg(beta).arg(&bdt).arg(state).arg(slots);
    a.arg(&h_k).arg(&grouped).arg(&kbuf).arg(&qbuf).arg(&kq).arg(&err);
    // SAFETY: `gdn_*(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq,
    // err)`. The shape rules give v and out [S_v, H_v, n_t, n_seq], g, beta [1, H_v, n_t, n_seq],
    // state [S_k, S_v, H_v, n_slots] and slots [n_seq]; the grid covers (S_v / 16, H_v, n_seq) and
    // every access is guarded by those extents; slots outside [0, n_slots) are skipped; S_k <=
    // 32 NC = ks (chosen above) and the prep rows are those gdn_prep wrote; the vector kernel runs
    // only on a 16-byte aligned state with S_k = 128.
    // The tiled kernel stages 64 / NC tokens per buffer from 16-byte aligned prep buffers (checked
    // above) into two buffers of the shared memory given here.
    unsafe { a.launch(config(grid, (THREADS, 1, 1), shared)) }.map_err(|e| launch_error(kernel, e))?;
    Ok(())
}

/// Records the first out-of-range or repeated slot (in sequence order) before any state is
/// written; the main kernel then returns at once.
fn check_slots(cx: &mut Cx<'_>, slots: TensorArg, n_slots: i64, err: u64, code: u32) -> Result<(), BackendError> {
    let f = cx.function(CHECK_SLOTS)?;
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&slots).arg(&n_slots).arg(&err).arg(&code);
    // SAFETY: `gdn_check_slots(slots, n_slots, err, op)` reads the slots' ne[0] i32 values through
    // their stride and writes only the error record.
    unsafe { a.launch(config((1, 1, 1), (1024, 1, 1), 0)) }.map_err(|e| launch_error(CHECK_SLOTS, e))?;
    Ok(())
}
