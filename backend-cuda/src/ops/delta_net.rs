//! gated_delta_net: `kernels/delta_net.cu`. A one-block kernel validates the slots, a pre-pass
//! writes k, q (times scale) and k . q per token as padded f32 rows to scratch, then one kernel
//! runs the recurrence with each state column held in registers (read and written once, in place
//! in its slot); prefills of 128-key heads stage 16-token tiles of k and q in shared memory with
//! cp.async, double buffered. That exact token-serial form serves the serial algorithm, decode and
//! chunked shapes the chunked kernels do not cover. Chunked prefills of 128-key, 128-value heads
//! run the WY / UT-transform form on tensor cores in bf16x3 instead (see the end of the .cu file):
//! `gdn_cw_prep` builds every 64-token chunk's W, U, masked Q K^T and decays in parallel, then
//! `gdn_cw_scan*` runs the chunks in order over column blocks of the state, writing the outputs.

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, DeltaNetAlgo, HeadMap, Op, TensorMeta};

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
const CW_PREP: Kernel = Kernel::new(Module::DeltaNet, "gdn_cw_prep");
const CW_PREP_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_cw_prep_vec");
const CW_SCAN: Kernel = Kernel::new(Module::DeltaNet, "gdn_cw_scan");

/// GDN_WARPS * 32 and GDN_COLS in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;
/// CW_C and CW_D in delta_net.cu: the chunked kernels' chunk length and head size (S_k = S_v).
const CW_C: usize = 64;
const CW_D: usize = 128;
/// CW_PREP_SHARED: gdn_cw_prep's k and q rows (padded to 136), A and T (padded to 72), the
/// solve's partial products and three per-token vectors (two blocks per SM).
const CW_PREP_SHARED: u32 = (4 * (2 * CW_C * (CW_D + 8) + 2 * CW_C * (CW_C + 8) + 3 * 256 + 3 * CW_C)) as u32;
/// CW_NT * 8 in delta_net.cu: state columns per gdn_cw_scan block.
const CW_COLS: usize = 64;
/// CW_SCAN_SHARED: W and Q (32 tiles of 1 KiB each), two buffers of K^T (32 tiles) and of P (10
/// tiles), S, V_new and scaled V_new of the block's columns, and two chunks' decays (213 KiB,
/// one block per SM).
const CW_SCAN_SHARED: u32 = (16 * (64 * (32 + 32 + 2 * 32 + 2 * 10) + 4 * CW_COLS * (8 + 4 + 4) + 2 * 32)) as u32;

/// The largest key dimension the kernels hold in registers (32 NC for NC = 8).
const MAX_S_K: usize = 256;

const OP: &str = "gated_delta_net";

/// Inputs `[q, k, v, g, beta, state, slots]`; the state column must fit in registers.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    matches!(op, Op::GatedDeltaNet(p) if !p.ragged) && inputs.len() == 7 && inputs[0].ne[0] <= MAX_S_K
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

/// The chunked kernels' scratch, as byte offsets: per (sequence, value head, chunk) W and P as
/// pre-split A tiles (32 and 16 KiB), U (32 KiB) and the decays (512 B); per (sequence, key head,
/// chunk) Q and K^T as pre-split A tiles (32 KiB each).
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
    fn new(q: &TensorMeta, v: &TensorMeta) -> Self {
        let n_chunks = q.ne[2].div_ceil(CW_C);
        let (vch, kch) = (v.ne[1] * v.ne[3] * n_chunks, q.ne[1] * q.ne[3] * n_chunks);
        let wf = 0;
        let pf = wf + vch * 32768;
        let uf = pf + vch * 16384;
        let gm = uf + vch * 32768;
        let qf = gm + vch * 512;
        let ktf = qf + kch * 32768;
        ChunkScratch { wf, pf, uf, gm, qf, ktf, end: ktf + kch * 32768 }
    }
}

/// True when the chunked kernels run: a chunked prefill (more than one token, at most 65535
/// chunks: the grid's y) of 128-key, 128-value heads.
fn chunked_kernels(op: &Op, q: &TensorMeta, v: &TensorMeta) -> bool {
    let Op::GatedDeltaNet(p) = op else { return false };
    let n_t = q.ne[2];
    matches!(p.algo, DeltaNetAlgo::Chunked { .. })
        && q.ne[0] == CW_D
        && v.ne[0] == CW_D
        && n_t > 1
        && n_t.div_ceil(CW_C) <= 65535
}

/// gdn_prep's buffers or (chunked kernels) [`ChunkScratch`], whichever is larger: the serial
/// kernels stand in when the scratch is not 256-byte aligned.
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let (Some(q), Some(v)) = (task.inputs.first(), task.inputs.get(2)) else { return 0 };
    let chunked = if chunked_kernels(task.op, &q.meta, &v.meta) { ChunkScratch::new(&q.meta, &v.meta).end } else { 0 };
    prep_bytes(&q.meta).max(chunked)
}

/// True when a q, k or v argument is f32 with 16-byte aligned rows of contiguous floats.
fn f32_rows(t: &TensorArg, meta: &TensorMeta) -> bool {
    meta.dtype == DType::F32 && t.nb[0] == 4 && t.data.is_multiple_of(16) && t.nb[1..].iter().all(|b| b % 16 == 0)
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
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    let (qdt, kdt, vdt, gdt, bdt) = (idt(0), idt(1), idt(2), idt(3), idt(4));
    let (h_k, grouped) = (k.ne[1] as i32, i32::from(p.head_map == HeadMap::Grouped));
    let (qm, vm) = (&task.inputs[0].meta, &task.inputs[2].meta);
    // (the in-order pass needs 213 KiB of shared memory a block: Hopper and later; sm_80 parts
    // run the serial kernel)
    let shared_fits = cx.info.max_shared_per_block >= CW_SCAN_SHARED as usize;
    if chunked_kernels(task.op, qm, vm) && shared_fits && cx.scratch.is_multiple_of(256) {
        let sc = ChunkScratch::new(qm, vm);
        let at = |off: usize| cx.scratch + off as u64;
        let (wf, pf, uf, gm, qf, ktf) = (at(sc.wf), at(sc.pf), at(sc.uf), at(sc.gm), at(sc.qf), at(sc.ktf));
        let vec = [0, 1, 2].iter().all(|&i| f32_rows(&ins[i], &task.inputs[i].meta));
        let prep = if vec { CW_PREP_VEC } else { CW_PREP };
        cx.allow_shared(prep, CW_PREP_SHARED)?;
        let f = cx.function(prep)?;
        let mut a = cx.stream.launch_builder(&f);
        a.arg(q).arg(&qdt).arg(k).arg(&kdt).arg(v).arg(&vdt).arg(g).arg(&gdt).arg(beta).arg(&bdt).arg(&p.scale);
        a.arg(&h_k).arg(&grouped).arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&err);
        let n_chunks = (v.ne[2] as usize).div_ceil(CW_C) as u32;
        let grid = (h_v as u32, n_chunks, n_seq as u32);
        // SAFETY: `gdn_cw_prep*(q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, scale, h_k, grouped, wf,
        // pf, uf, gm, qf, ktf, err)`: S_k = S_v = 128 (chunked_kernels); q, k, v, g and beta are
        // read within their shape-rule extents (tokens past n_t are not read); the vector kernel
        // runs only on f32 q, k and v with 16-byte aligned rows of contiguous floats (f32_rows);
        // the grid covers (H_v, n_chunks, n_seq) and each block writes only its (sequence, value
        // head, chunk) and (sequence, key head, chunk) entries of the ChunkScratch buffers, sized
        // for exactly those (scratch_bytes) and 256-byte aligned (checked above); the dynamic
        // shared memory is the kernel's CW_PREP_SHARED, allowed above.
        unsafe { a.launch(config(grid, (256, 1, 1), CW_PREP_SHARED)) }.map_err(|e| launch_error(prep, e))?;

        cx.allow_shared(CW_SCAN, CW_SCAN_SHARED)?;
        let f = cx.function(CW_SCAN)?;
        let mut a = cx.stream.launch_builder(&f);
        a.arg(&out).arg(state).arg(slots).arg(&h_k).arg(&grouped);
        a.arg(&wf).arg(&pf).arg(&uf).arg(&gm).arg(&qf).arg(&ktf).arg(&err);
        let grid = ((CW_D / CW_COLS) as u32, h_v as u32, n_seq as u32);
        // SAFETY: `gdn_cw_scan(out, state, slots, h_k, grouped, wf, pf, uf, gm, qf, ktf, err)`: out
        // is [128, H_v, n_t, n_seq] and state [128, 128, H_v, n_slots] (shape rules); the grid
        // covers (128 / 64, H_v, n_seq), each block 64 columns; slots outside [0, n_slots) are
        // skipped and outputs past n_t not written; the chunk buffers are those gdn_cw_prep filled
        // for every (sequence, head, chunk), 16-byte aligned for its cp.async copies; the dynamic
        // shared memory is CW_SCAN_SHARED, allowed just above.
        unsafe { a.launch(config(grid, (512, 1, 1), CW_SCAN_SHARED)) }.map_err(|e| launch_error(CW_SCAN, e))?;
        return Ok(());
    }

    let (rows, ks) = prep_rows(&task.inputs[0].meta);
    let (kbuf, qbuf) = (cx.scratch, cx.scratch + (4 * rows * ks) as u64);
    let kq = qbuf + (4 * rows * ks) as u64;
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
