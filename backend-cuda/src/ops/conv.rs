//! ssm_conv and ssm_conv_update_inplace: `kernels/conv.cu`. Channels run across threads;
//! ssm_conv stages a (32 channels x 64 outputs) window tile in shared memory so that both the
//! time-innermost input and the channel-innermost output move coalesced. The update's kernels
//! take dense and ragged batches alike (a null seq_offsets tensor means dense): tokens are
//! packed, each finds its sequence (ragged: a binary search of the offsets on the device, so a
//! captured CUDA graph replays with new offsets), padding outputs 0. A decode step (at most a token
//! a sequence on average) runs as one kernel, `conv_update_seq`; longer steps compute the outputs
//! (`conv_update_out`, tokens in parallel) and then move the state (`conv_update_state`).

use tessera_graph::{BackendError, Task};
use tessera_ops::{Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const CONV_TILED: Kernel = Kernel::new(Module::Conv, "ssm_conv_tiled");
const CONV_DIRECT: Kernel = Kernel::new(Module::Conv, "ssm_conv_direct");
const UPDATE_OUT: Kernel = Kernel::new(Module::Conv, "conv_update_out");
const UPDATE_STATE: Kernel = Kernel::new(Module::Conv, "conv_update_state");
const UPDATE_SEQ: Kernel = Kernel::new(Module::Conv, "conv_update_seq");

/// CONV_CH and CONV_TT in conv.cu; the tile's block size.
const TILE_CH: usize = 32;
const TILE_TT: usize = 64;
const TILE_THREADS: u32 = 256;
/// Kernels longer than this take the direct path (the tile's window, 64 + d_conv - 1 samples,
/// is read as at most 96).
const MAX_TILED_D_CONV: usize = 33;
/// conv_update_out: tokens per thread (`UPD_T` in conv.cu).
const UPDATE_TOKENS: usize = 32;
/// Longest kernel of the register-window update kernels: `UPD_MAXD` in conv.cu.
const UPDATE_MAX_D_CONV: usize = 8;
const THREADS: u32 = 256;

pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match op {
        Op::SsmConv => inputs.len() == 2,
        Op::SsmConvUpdate { ragged, .. } => inputs.len() == if *ragged { 5 } else { 4 },
        _ => false,
    }
}

#[allow(dead_code)]
pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let idt = |i: usize| dt(task.inputs[i].meta.dtype);
    match (task.op, ins) {
        (Op::SsmConv, [sx, kern]) => ssm_conv(cx, out, *sx, idt(0), *kern, idt(1)),
        (Op::SsmConvUpdate { silu, ragged: false }, [x, state, kern, slots]) => {
            update(cx, out, (*x, idt(0)), *state, (*kern, idt(2)), (*slots, DENSE), *silu)
        }
        (Op::SsmConvUpdate { silu, ragged: true }, [x, state, kern, slots, offsets]) => {
            update(cx, out, (*x, idt(0)), *state, (*kern, idt(2)), (*slots, *offsets), *silu)
        }
        _ => Err(unsupported(
            task,
            "expected ssm_conv [sx, kernel] or ssm_conv_update_inplace [x, state, kernel, slots] (+ seq_offsets)",
        )),
    }
}

fn ssm_conv(
    cx: &mut Cx<'_>,
    out: TensorArg,
    sx: TensorArg,
    sdt: i32,
    kern: TensorArg,
    kdt: i32,
) -> Result<(), BackendError> {
    let d_conv = kern.ne[0] as usize;
    let [channels, n_t, n_seq, _] = out.ne.map(|n| n as usize);
    if d_conv > MAX_TILED_D_CONV || n_seq > 65535 || n_t.div_ceil(TILE_TT) > 65535 {
        let mut a = cx.kernel(CONV_DIRECT)?;
        a.arg(&out).arg(&sx).arg(&sdt).arg(&kern).arg(&kdt);
        let cfg = config((blocks_for(out.nelements(), THREADS), 1, 1), (THREADS, 1, 1), 0);
        // SAFETY: `ssm_conv_direct(out, sx, sdt, kern, kdt)`: the shape rules give sx
        // [d_conv - 1 + n_t, C, n_seq], kernel [d_conv, C] and out [C, n_t, n_seq]; the grid-stride
        // loop stays inside out, and t + i < d_conv - 1 + n_t.
        unsafe { a.launch(cfg) }?;
        return Ok(());
    }
    let w = (TILE_TT + d_conv - 1) | 1;
    let shared = (4 * (TILE_CH * w + TILE_CH * d_conv)) as u32;
    let grid = (channels.div_ceil(TILE_CH) as u32, n_t.div_ceil(TILE_TT) as u32, n_seq as u32);
    let time_fastest = i32::from(sx.nb[0].abs() <= sx.nb[1].abs());
    let mut a = cx.kernel(CONV_TILED)?;
    a.arg(&out).arg(&sx).arg(&sdt).arg(&kern).arg(&kdt).arg(&time_fastest);
    // SAFETY: `ssm_conv_tiled(out, sx, sdt, kern, kdt, time_fastest)`: shapes as for the direct
    // kernel; the grid covers (C / 32, n_t / 64, n_seq) and every load and store is guarded by C,
    // n_t and the window's d_conv - 1 + n_t samples; d_conv <= 33 keeps the window within the 96
    // samples the kernel reads and shared memory (sized as the kernel lays it out) small.
    unsafe { a.launch(config(grid, (TILE_THREADS, 1, 1), shared)) }?;
    Ok(())
}

/// The seq_offsets argument of a dense batch: a null tensor.
const DENSE: TensorArg = TensorArg { data: 0, ne: [0; 4], nb: [0; 4] };

fn update(
    cx: &mut Cx<'_>,
    out: TensorArg,
    (x, xdt): (TensorArg, i32),
    state: TensorArg,
    (kern, kdt): (TensorArg, i32),
    (slots, offsets): (TensorArg, TensorArg),
    silu: bool,
) -> Result<(), BackendError> {
    let [channels, n_t, n_outer, _] = out.ne.map(|n| n as usize);
    let (n_seq, n_all) = (slots.ne[0] as usize, n_t * n_outer);
    if n_seq > 65535 || n_all.div_ceil(UPDATE_TOKENS) > 65535 {
        return Err(BackendError::Unsupported {
            backend: crate::errors::NAME.into(),
            op: "ssm_conv_update_inplace",
            why: "more than 65535 sequences or 524280 tokens".into(),
        });
    }
    let (err, code) = (cx.errors, op_code("ssm_conv_update_inplace"));
    let silu = i32::from(silu);
    let blocks = channels.div_ceil(THREADS as usize) as u32;
    // A decode step (at most a token a sequence on average) runs in one launch, a thread per
    // channel and sequence running its tokens in order; otherwise the outputs, then the state.
    let one_launch = n_all <= n_seq && kern.ne[0] as usize <= UPDATE_MAX_D_CONV;
    let mut a = cx.kernel(if one_launch { UPDATE_SEQ } else { UPDATE_OUT })?;
    a.arg(&out)
        .arg(&x)
        .arg(&xdt)
        .arg(&state)
        .arg(&kern)
        .arg(&kdt)
        .arg(&slots)
        .arg(&offsets)
        .arg(&silu)
        .arg(&err)
        .arg(&code);
    if one_launch {
        // SAFETY: `conv_update_seq(out, x, xdt, state, kern, kdt, slots, offsets, silu, err, op)`:
        // shapes as for conv_update_out below; every block checks the slots and offsets through
        // their strides and returns before touching memory unless they pass, so the rows
        // s < n_seq own distinct in-range slots; offsets are clamped to 0..=n_all, so every
        // token read or written lies in 0..n_all; threads past C do nothing; d_conv <= UPD_MAXD.
        unsafe { a.launch(config((blocks, n_seq as u32 + 1, 1), (THREADS, 1, 1), 0)) }?;
        return Ok(());
    }
    let grid = (blocks, n_all.div_ceil(UPDATE_TOKENS) as u32, 1);
    // SAFETY: `conv_update_out(out, x, xdt, state, kern, kdt, slots, offsets, silu, err, op)`: the
    // shape rules give x and out [C, n_t, n_outer] (n_all = n_t n_outer packed tokens), state
    // [d_conv - 1, C, n_slots], kernel [d_conv, C], slots [n_seq] and offsets [n_seq + 1] (or
    // null: dense); block (0, 0) first checks the slots and offsets through their strides,
    // writing only the error record; threads past C or n_all do nothing; offsets are clamped to
    // 0..=n_all, so every x sample read is a token in 0..n_all, and state samples are read at
    // 0..d_conv - 1 of slots in [0, n_slots) only. It only reads the state.
    unsafe { a.launch(config(grid, (THREADS, 1, 1), 0)) }?;

    let d_conv = kern.ne[0];
    let mut a = cx.kernel(UPDATE_STATE)?;
    a.arg(&x).arg(&xdt).arg(&state).arg(&slots).arg(&offsets).arg(&d_conv).arg(&err);
    // SAFETY: `conv_update_state(x, xdt, state, slots, offsets, d_conv, err)`: one thread per
    // (channel < C, sequence < n_seq) owns its slot's d_conv - 1 samples (the slots of sequences
    // with tokens are distinct and in range, or nothing runs; sequences without tokens return
    // before reading theirs); the window samples it reads are inside the state or x (offsets
    // clamped to 0..=n_all).
    unsafe { a.launch(config((blocks, n_seq as u32, 1), (THREADS, 1, 1), 0)) }?;
    Ok(())
}
