//! gated_delta_net: `kernels/delta_net.cu` and `kernels/delta_net_chunked.cu` (what both share:
//! `delta_net.cuh`). A one-block kernel validates the slots, a pre-pass
//! writes k, q (times scale) and k . q per token as padded f32 rows to scratch, then one kernel
//! runs the recurrence with each state column held in registers (read and written once, in place
//! in its slot); prefills of 128-key heads stage 16-token tiles of k and q in shared memory with
//! cp.async, double buffered. That exact token-serial form serves the serial algorithm, decode and
//! chunked shapes the chunked kernels do not cover. Chunked prefills of 128-key, 128-value heads
//! run the WY / UT-transform form on tensor cores in bf16x3 instead (`delta_net_chunked.cu`):
//! `gdn_cw_prep` builds every 64-token chunk's W, U, masked Q K^T and decays in parallel, then
//! `gdn_cw_scan*` runs the chunks in order over column blocks of the state, writing the outputs
//! (on Hopper's sm_90a target `gdn_cw_scan_wg*`, the same pass on warpgroup products).

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, DeltaNetAlgo, GatedDeltaNetFusedParams, GatedDeltaNetParams, HeadMap, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const CHECK_SLOTS: Kernel = Kernel::new(Module::DeltaNet, "gdn_check_slots");
const PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_prep");
const GDN_N1: Kernel = Kernel::new(Module::DeltaNet, "gdn_n1");
const GDN_N2: Kernel = Kernel::new(Module::DeltaNet, "gdn_n2");
const GDN_N4: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4");
const GDN_N8: Kernel = Kernel::new(Module::DeltaNet, "gdn_n8");
const GDN_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4_vec");
const GDN_TILED_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_tiled_n4_vec");
const CW_PREP: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_prep");
const CW_PREP_VEC: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_prep_vec");
const CW_SCAN: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan");
const CW_SCAN4: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan4");
const CW_SCAN_WG: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan_wg");
const CW_SCAN_WG32: Kernel = Kernel::new(Module::DeltaNetChunked, "gdn_cw_scan_wg32");
const INPUT_PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_input_prep");
/// gdn_input_prep's block size (norm.cuh's sub-row walk assumes 256).
const PREP_THREADS: u32 = 256;

/// GDN_WARPS * 32 and GDN_COLS in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;
/// CW_C and CW_D in delta_net_chunked.cu: the chunked kernels' chunk length and head size (S_k = S_v).
const CW_C: usize = 64;
const CW_D: usize = 128;
/// CW_PREP_SHARED: gdn_cw_prep's k and q rows (padded to 136), A and T (padded to 72), the
/// solve's partial products and three per-token vectors (two blocks per SM).
const CW_PREP_SHARED: u32 = (4 * (2 * CW_C * (CW_D + 8) + 2 * CW_C * (CW_C + 8) + 3 * 256 + 3 * CW_C)) as u32;
/// CW_STAGE_BYTES: both in-order passes' staging of a chunk's A tiles: W and Q (32 tiles of 1 KiB
/// each), two buffers of K^T (32 tiles) and of P (10 tiles), and two chunks' decays.
const SCAN_STAGE_BYTES: usize = 1024 * (32 + 32 + 2 * 32 + 2 * 10) + 4 * 2 * 2 * CW_C;

/// gdn_cw_scan's shared memory for NT column tiles a block (8 NT state columns): the staging, then
/// S, V_new and scaled V_new of the block's columns as pre-split B tiles (213 KiB at NT = 8, 185 at
/// NT = 4: one block per SM).
const fn scan_shared(nt: usize) -> u32 {
    (SCAN_STAGE_BYTES + 512 * nt * (8 + 4 + 4)) as u32
}

/// CW_WG_SHARED(NC): gdn_cw_scan_wg*'s S, V_new and scaled V_new tiles (hi and lo bf16, NC
/// columns), the staging, and 1 KiB to align the tiles to 1024 bytes (214 KiB at NC = 64, 185 at
/// 32).
const fn wg_shared(nc: usize) -> u32 {
    (1024 + 4 * (CW_D * nc + 2 * CW_C * nc) + SCAN_STAGE_BYTES) as u32
}

/// The in-order pass's kernel, its grid's column blocks, threads a block and shared memory. The
/// columns a block are the mma.sync kernels' choice ([`scan_tiles`]: 64, or 32 where that grid
/// fits one wave); where the module runs its sm_90a path, the wgmma kernel of the same columns
/// runs them (`gdn_cw_scan_wg`, `gdn_cw_scan_wg32`), unless `TESSERA_GDN_SCAN=0` asks for the
/// mma.sync kernels (to measure one against the other).
fn scan_kernel(cx: &mut Cx<'_>, heads_x_seqs: usize) -> (Kernel, usize, u32, u32) {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let nt = scan_tiles(heads_x_seqs, cx.info.multiprocessors);
    let (nc, col_blocks) = (8 * nt, CW_D / (8 * nt));
    let wg = crate::launch::env_number(&SET, "TESSERA_GDN_SCAN") != Some(0)
        && cx.kernels.arch_specific_for(Module::DeltaNetChunked)
        && cx.info.max_shared_per_block >= wg_shared(nc) as usize;
    if wg {
        return (if nc == 32 { CW_SCAN_WG32 } else { CW_SCAN_WG }, col_blocks, 256, wg_shared(nc));
    }
    (if nt == 4 { CW_SCAN4 } else { CW_SCAN }, col_blocks, 64 * nt as u32, scan_shared(nt))
}

/// gdn_cw_scan's column tiles a block: 4 (`gdn_cw_scan4`: S_v / 32 blocks a head and sequence,
/// each with a quarter of the state columns but the whole per-chunk loads) where that grid still
/// fits one wave (a 32-head prefill: 128 blocks, where NT = 8 left half of 132 multiprocessors
/// idle), else 8 (`gdn_cw_scan`; a second wave would cost more than the idle ones).
fn scan_tiles(heads_x_seqs: usize, multiprocessors: usize) -> usize {
    if (CW_D / 32) * heads_x_seqs <= multiprocessors { 4 } else { 8 }
}

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

/// Float4 chunks per lane (the kernels' NC): the key dimension padded to 32 NC.
fn chunks(s_k: usize) -> usize {
    s_k.div_ceil(32).next_power_of_two().max(1)
}

/// gdn_prep's rows (one per token, key head and outer index) and their padded length.
fn prep_rows(q: &TensorMeta) -> (usize, usize) {
    let [s_k, h_k, n_t, n_outer] = q.ne;
    (h_k * n_t * n_outer, 32 * chunks(s_k))
}

/// Bytes of gdn_prep's buffers: k and q rows and k . q for every token, 4 (2 KS + 1) bytes per
/// row, rounded up to 256.
fn prep_bytes(q: &TensorMeta) -> usize {
    let (rows, ks) = prep_rows(q);
    (4 * rows * (2 * ks + 1)).next_multiple_of(256)
}

/// The chunked kernels' scratch for `n_chunks` chunks, as byte offsets: per (chunk, value head) W
/// and P as pre-split A tiles (32 and 16 KiB), U (32 KiB) and the decays (512 B); per (chunk, key
/// head) Q and K^T as pre-split A tiles (32 KiB each).
struct ChunkScratch {
    wf: usize,
    pf: usize,
    uf: usize,
    gm: usize,
    qf: usize,
    ktf: usize,
    end: usize,
}

impl ChunkScratch {
    fn new(q: &TensorMeta, v: &TensorMeta, n_chunks: usize) -> Self {
        let (vch, kch) = (v.ne[1] * n_chunks, q.ne[1] * n_chunks);
        let wf = 0;
        let pf = wf + vch * 32768;
        let uf = pf + vch * 16384;
        let gm = uf + vch * 32768;
        let qf = gm + vch * 512;
        let ktf = qf + kch * 32768;
        ChunkScratch { wf, pf, uf, gm, qf, ktf, end: ktf + kch * 32768 }
    }
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

/// True when a q, k or v argument is f32 with 16-byte aligned rows of contiguous floats.
fn f32_rows(t: &TensorArg, meta: &TensorMeta) -> bool {
    meta.dtype == DType::F32 && t.nb[0] == 4 && t.data.is_multiple_of(16) && t.nb[1..].iter().all(|b| b % 16 == 0)
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
    let [q, k, v, g, beta, state, slots] = args;
    let s_k = k.ne[0] as usize;
    let (s_v, h_v, n_t, n_seq) = (v.ne[0], v.ne[1], v.ne[2], slots.ne[0] as usize);
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

    if let Some((sc, n_chunks, n_long)) = &plan.chunked {
        let at = |off: usize| cx.scratch + off as u64;
        let (wf, pf, uf, gm, qf, ktf) = (at(sc.wf), at(sc.pf), at(sc.uf), at(sc.gm), at(sc.qf), at(sc.ktf));
        let vec = [(q, 0), (k, 1), (v, 2)].iter().all(|(t, i)| f32_rows(t, &metas[*i]));
        let prep = if vec { CW_PREP_VEC } else { CW_PREP };
        cx.allow_shared(prep, CW_PREP_SHARED)?;
        let mut a = cx.kernel(prep)?;
        a.arg(&q).arg(&qdt).arg(&k).arg(&kdt).arg(&v).arg(&vdt).arg(&g).arg(&gdt).arg(&beta).arg(&bdt).arg(&p.scale);
        a.arg(&h_k).arg(&grouped).arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&offsets).arg(&table);
        a.arg(&err);
        // Dense: (H_v, chunks of a sequence, sequences); ragged: (H_v, the chunk bound, 1).
        let grid = if plan.ragged {
            (h_v as u32, *n_chunks as u32, 1)
        } else {
            (h_v as u32, (*n_chunks / plan.n_seq) as u32, plan.n_seq as u32)
        };
        // SAFETY: `gdn_cw_prep*(q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, scale, h_k, grouped, wf,
        // pf, uf, gm, qf, ktf, offsets, table, err)`: S_k = S_v = 128 (Plan::new); q, k, v, g and
        // beta are read within their shape-rule extents (tokens past a chunk's sequence are not
        // read; ragged offsets are clamped to 0..=n_tokens); the vector kernel runs only on f32 q,
        // k and v with 16-byte aligned rows of contiguous floats (f32_rows); each block writes only
        // the entries of its chunk gc < n_chunks (dense: the grid's; ragged: the work list's,
        // whose total is at most the bound n_chunks the buffers are sized for, blocks past it
        // return) in the ChunkScratch buffers, sized for n_chunks (scratch_bytes) and 256-byte
        // aligned (checked above); the work list is gdn_check_slots' (in the scratch, after the
        // buffers), null dense; the dynamic shared memory is CW_PREP_SHARED, allowed above.
        unsafe { a.launch(config(grid, (256, 1, 1), CW_PREP_SHARED)) }?;

        let (scan, col_blocks, threads, shared) = scan_kernel(cx, h_v as usize * *n_long);
        cx.allow_shared(scan, shared)?;
        let mut a = cx.kernel(scan)?;
        a.arg(&out).arg(&state).arg(&slots).arg(&h_k).arg(&grouped);
        a.arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&offsets).arg(&table).arg(&err);
        let grid = (col_blocks as u32, h_v as u32, *n_long as u32);
        // SAFETY: `gdn_cw_scan{,4,_wg}(out, state, slots, h_k, grouped, wf, pf, uf, gm, qf, ktf,
        // offsets, table, err)`: out is [128, H_v, n_t, n_outer] and state [128, 128, H_v,
        // n_slots] (shape rules); the grid covers (column blocks, H_v, sequences: dense all,
        // ragged the bound on the work list's long ones, blocks past its count return), each block
        // 128 / col_blocks columns with the threads scan_kernel gives; slots outside [0, n_slots)
        // are skipped and outputs past a sequence's tokens not written; the chunk buffers are those
        // gdn_cw_prep filled for every chunk of the block's sequence, 16-byte aligned for its
        // cp.async copies; the dynamic shared memory is scan_kernel's, allowed just above (the wg
        // kernel runs only where its module was compiled for sm_90a).
        unsafe { a.launch(config(grid, (threads, 1, 1), shared)) }?;
        if !plan.ragged {
            return Ok(());
        }
    }

    // The serial kernels: every sequence (dense, or ragged without the chunked kernels), or the
    // short ones of a ragged call whose long ones the chunked kernels ran.
    let serial_max = if plan.chunked.is_some() { SHORT } else { i64::MAX };
    let (rows, ks) = prep_rows(qm);
    let kbuf = cx.scratch + plan.prep as u64;
    let (qbuf, kq) = (kbuf + (4 * rows * ks) as u64, kbuf + (8 * rows * ks) as u64);
    let ks_len = ks as i32;
    let mut a = cx.kernel(PREP)?;
    a.arg(&q).arg(&qdt).arg(&k).arg(&kdt).arg(&p.scale).arg(&ks_len).arg(&kbuf).arg(&qbuf).arg(&kq);
    let (n_slots, check_here) = (state.ne[3], i32::from(plan.chunked.is_none()));
    a.arg(&offsets).arg(&serial_max).arg(&out).arg(&slots).arg(&n_slots).arg(&SHORT).arg(&table).arg(&check_here);
    a.arg(&err).arg(&code);
    let warps_per_block = THREADS as usize / 32;
    let cfg = config((rows.div_ceil(warps_per_block).clamp(1, 1 << 20) as u32, 1, 1), (THREADS, 1, 1), 0);
    // SAFETY: `gdn_prep(q, qdt, k, kdt, scale, ks_len, kbuf, qbuf, kq, offsets, serial_max, out,
    // slots, n_slots, list_min, table, check, err, op)`: with `check`, block 0 runs the slot check
    // as `check` below describes it (reads the slots and offsets, writes the error record and the
    // work list);
    // q and k are [S_k, H_k, n_t, n_outer] (shape rules), read within those extents; scratch holds
    // (scratch_bytes, Plan::prep) rows = H_k n_t n_outer rows of ks_len floats for kbuf and for
    // qbuf, then rows floats for kq; offsets (null dense) are read clamped to 0..=n_t; ragged, it
    // zeroes the rows of padding tokens of `out`, the op's contiguous f32 [S_v, H_v, n_t, 1]
    // output (grid-stride, within its n_t rows).
    unsafe { a.launch(cfg) }?;

    let aligned = state.data.is_multiple_of(16) && state.nb[0] == 4 && state.nb[1..].iter().all(|b| b % 16 == 0);
    // Prefill of the model head size: tiles of 16 tokens staged in shared memory (double
    // buffered). Ragged: only for sequences longer than SHORT, the plain kernel taking the rest.
    let tiled = n_t > 1 && s_k == 128 && aligned && kbuf.is_multiple_of(16) && serial_max > SHORT;
    let plain = match chunks(s_k) {
        1 => GDN_N1,
        2 => GDN_N2,
        4 if s_k == 128 && aligned => GDN_N4_VEC,
        4 => GDN_N4,
        _ => GDN_N8,
    };
    // (kernel, sequence lengths it takes, blocks in z, work list): the tiled kernel takes a ragged
    // call's long sequences through the work list, the plain one every sequence up to its length.
    let launches: &[(Kernel, i64, i64, usize, u64)] = match (tiled, plan.ragged) {
        (false, _) => &[(plain, 1, serial_max, n_seq, 0)],
        (true, false) => &[(GDN_TILED_N4_VEC, 1, i64::MAX, n_seq, 0)],
        (true, true) => &[(plain, 1, SHORT, n_seq, 0), (GDN_TILED_N4_VEC, SHORT + 1, i64::MAX, plan.n_long, table)],
    };
    for &(kernel, len_min, len_max, blocks_z, list) in launches.iter().filter(|l| l.3 > 0) {
        let grid = ((s_v as usize).div_ceil(COLS) as u32, h_v as u32, blocks_z as u32);
        let mut a = cx.kernel(kernel)?;
        a.arg(&out).arg(&v).arg(&vdt).arg(&g).arg(&gdt).arg(&beta).arg(&bdt).arg(&state).arg(&slots);
        a.arg(&h_k).arg(&grouped).arg(&kbuf).arg(&qbuf).arg(&kq).arg(&offsets);
        let shared = if kernel == GDN_TILED_N4_VEC {
            a.arg(&list);
            let tile_tokens = 64 / chunks(s_k);
            (2 * 4 * (2 * tile_tokens * 128 + tile_tokens * COLS + 3 * tile_tokens)) as u32
        } else {
            0
        };
        a.arg(&len_min).arg(&len_max).arg(&err);
        // SAFETY: `gdn_*(out, v, vdt, g, gdt, beta, bdt, state, slots, h_k, grouped, kbuf, qbuf, kq,
        // offsets, [table,] len_min, len_max, err)` (the tiled kernel takes the work list). The shape
        // rules give v and out [S_v, H_v, n_t, n_outer], g, beta [1, H_v, n_t, n_outer], state
        // [S_k, S_v, H_v, n_slots], slots [n_seq] and offsets [n_seq + 1] (null dense); the grid
        // covers (S_v / 16, H_v, sequences: n_seq, or the bound on the work list's long ones, blocks
        // past its count returning) and every access is guarded by those extents (ragged token
        // ranges clamped to 0..=n_t); slots outside [0, n_slots) are skipped; S_k <= 32 NC = ks
        // (chosen above) and the prep rows read are those gdn_prep wrote (the same length filter:
        // serial_max >= len_max); the vector kernels run only on a 16-byte aligned state with
        // S_k = 128. The tiled kernel stages 64 / NC tokens per buffer from 16-byte aligned prep
        // buffers (checked above) into two buffers of the shared memory given here; its work
        // list is gdn_check_slots' (in the scratch), null dense.
        unsafe { a.launch(config(grid, (THREADS, 1, 1), shared)) }?;
    }
    Ok(())
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

    /// Runs one gated_delta_net on `backend`; returns the output and the whole state after.
    fn run(backend: &mut dyn Backend, (dims, map, chunk): Shape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let [d, h_k, h_v, n_t, n_seq] = dims;
        let n_slots = n_seq + 1;
        let mut x = seed;
        let mut uniform = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect()
        };
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
        let mut x = seed;
        let mut uniform = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect()
        };
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
    fn scan_shared_memory_is_what_the_kernels_lay_out() {
        // gdn_cw_scan{,4}: 152576 bytes of staging and 32 NT B tiles of 512 bytes; the wg
        // kernels: 1 KiB of alignment and NC-column hi / lo tiles of S, V_new and scaled V_new.
        assert_eq!(super::scan_shared(8), 152576 + 65536);
        assert_eq!(super::scan_shared(4), 152576 + 32768);
        assert_eq!(super::wg_shared(64), 1024 + 65536 + 152576);
        assert_eq!(super::wg_shared(32), 1024 + 32768 + 152576);
    }

    #[test]
    fn scan_blocks_halve_where_the_grid_fits_a_wave() {
        assert_eq!(super::scan_tiles(32, 132), 4); // 128 blocks of 32 columns
        assert_eq!(super::scan_tiles(33, 132), 4); // 132 blocks
        assert_eq!(super::scan_tiles(34, 132), 8);
        assert_eq!(super::scan_tiles(48, 132), 8); // 96 blocks of 64 columns, not 192
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
