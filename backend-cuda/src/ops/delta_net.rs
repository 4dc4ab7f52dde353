//! gated_delta_net: `kernels/delta_net.cu`. A one-block kernel validates the slots, a pre-pass
//! writes k, q (times scale) and k . q per token as padded f32 rows to scratch, then one kernel
//! runs the recurrence with each state column held in registers (read and written once, in place
//! in its slot); prefills of 128-key heads stage 16-token tiles of k and q in shared memory with
//! cp.async, double buffered. Both algorithms run the exact token-serial form: the chunked form
//! computes the same values, and the f32 cases' bound (NMSE 1e-7) leaves no room for tf32 or bf16
//! tensor-core products.

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{HeadMap, Op, TensorMeta};

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

/// GDN_WARPS * 32 and GDN_COLS in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;
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

/// k and q rows and k . q for every token: 4 (2 KS + 1) bytes per row.
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    task.inputs.first().map_or(0, |q| {
        let (rows, ks) = prep_rows(&q.meta);
        4 * rows * (2 * ks + 1)
    })
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
    let (h_k, grouped) = (k.ne[1] as i32, i32::from(p.head_map == HeadMap::Grouped));
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
