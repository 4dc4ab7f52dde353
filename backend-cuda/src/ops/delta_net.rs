//! gated_delta_net: `kernels/delta_net.cu`. The slots are validated by a one-block kernel, then
//! one kernel runs the recurrence with each state column held in registers (read and written
//! once, in place in its slot). Both algorithms run the exact token-serial form: the chunked
//! form computes the same values, and the f32 cases' bound (NMSE 1e-7) leaves no room for tf32
//! or bf16 tensor-core products.

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{HeadMap, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, config, dt, launch_error, unsupported};

const CHECK_SLOTS: Kernel = Kernel::new(Module::DeltaNet, "gdn_check_slots");
const GDN_N1: Kernel = Kernel::new(Module::DeltaNet, "gdn_n1");
const GDN_N2: Kernel = Kernel::new(Module::DeltaNet, "gdn_n2");
const GDN_N4: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4");
const GDN_N8: Kernel = Kernel::new(Module::DeltaNet, "gdn_n8");
const GDN_N4_VEC: Kernel = Kernel::new(Module::DeltaNet, "gdn_n4_vec");

/// GDN_WARPS * 32, GDN_COLS and GDN_TT in delta_net.cu.
const THREADS: u32 = 128;
const COLS: usize = 16;
const TT: usize = 16;
/// The largest key dimension the kernels hold in registers (32 NC for NC = 8).
const MAX_S_K: usize = 256;

const OP: &str = "gated_delta_net";

/// Inputs `[q, k, v, g, beta, state, slots]`; the state column must fit in registers.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    matches!(op, Op::GatedDeltaNet(_)) && inputs.len() == 7 && inputs[0].ne[0] <= MAX_S_K
}

pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
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

    let nc = s_k.div_ceil(32).next_power_of_two().max(1);
    let aligned = state.data % 16 == 0 && state.nb[0] == 4 && state.nb[1..].iter().all(|b| b % 16 == 0);
    let kernel = match nc {
        1 => GDN_N1,
        2 => GDN_N2,
        4 if s_k == 128 && aligned => GDN_N4_VEC,
        4 => GDN_N4,
        _ => GDN_N8,
    };
    let tt_cap = (v.ne[2] as usize).clamp(1, TT);
    let shared = (4 * tt_cap * (2 * 32 * nc + 2 * COLS + 2)) as u32;
    let tt_cap = tt_cap as i32;
    let grid = ((s_v as usize).div_ceil(COLS) as u32, h_v as u32, n_seq as u32);
    let cfg = config(grid, (THREADS, 1, 1), shared);
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    let (qdt, kdt, vdt, gdt, bdt) = (idt(0), idt(1), idt(2), idt(3), idt(4));
    let grouped = i32::from(p.head_map == HeadMap::Grouped);
    let f = cx.function(kernel)?;
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&out).arg(q).arg(&qdt).arg(k).arg(&kdt).arg(v).arg(&vdt).arg(g).arg(&gdt).arg(beta).arg(&bdt);
    a.arg(state).arg(slots).arg(&p.scale).arg(&grouped).arg(&tt_cap).arg(&err);
    // SAFETY: `gdn_*(out, q, qdt, k, kdt, v, vdt, g, gdt, beta, bdt, state, slots, scale, grouped,
    // tt_cap, err)`. The shape rules give q, k [S_k, H_k, n_t, n_seq], v and out [S_v, H_v, n_t, n_seq],
    // g, beta [1, H_v, n_t, n_seq], state [S_k, S_v, H_v, n_slots] and slots [n_seq]; the grid
    // covers (S_v / 16, H_v, n_seq) and every access is guarded by those extents; slots outside
    // [0, n_slots) are skipped; S_k <= 32 NC (NC chosen above); the vector kernel runs only on a
    // 16-byte aligned state with S_k = 128; shared memory is sized for tt_cap <= 16 tokens as the
    // kernel lays it out.
    unsafe { a.launch(cfg) }.map_err(|e| launch_error(kernel, e))?;
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
