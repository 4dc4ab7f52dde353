//! rope_multi: rotary position embedding (`kernels/rope.cu`). One block per (token, group of
//! heads) computes the token's angles once (in f64, like the CPU) and writes its heads.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, RopePairing, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config, dt, unsupported};

const ROPE_MULTI: Kernel = Kernel::new(Module::Rope, "rope_multi");

const THREADS: u32 = 256;
/// The angle table (n_rot f32s) lives in shared memory: keep it within the default 48 KiB.
const MAX_N_ROT: usize = 8192;

/// Float x and i32 positions (the shape rules check both); `n_rot` and the sections must fit the
/// kernel's shared table and i32 arithmetic.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    let Op::RopeMulti(p) = op else { return false };
    let float_x = inputs.first().is_some_and(|m| matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16));
    let sections_fit = p.sections.is_none_or(|s| {
        s.iter().try_fold(0usize, |a, &v| a.checked_add(v)).is_some_and(|t| t <= (i32::MAX / 4) as usize)
    });
    // The kernel indexes one block's heads (up to all of a token's) with 32-bit math.
    let small = inputs.first().is_some_and(|m| m.ne[0].saturating_mul(m.ne[1]) <= i32::MAX as usize);
    float_x && small && p.n_rot <= MAX_N_ROT && sections_fit
}

#[allow(dead_code)]
pub(crate) fn scratch_bytes(_task: &Task<'_>) -> usize {
    0
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let Op::RopeMulti(p) = task.op else { return Err(unsupported(task, "not rope_multi")) };
    let [x, pos] = ins else { return Err(unsupported(task, "rope_multi takes x and positions")) };
    let (x, pos) = (*x, *pos);
    let sdt = dt(task.inputs[0].meta.dtype);
    let (n_head, n_tokens) = (x.ne[1], x.ne[2]);
    if out.nelements() == 0 {
        return Ok(());
    }
    // About 512 blocks: enough to fill the chip at decode, and at prefill one angle table per
    // token (its f64 sines and cosines are the slow part of a block).
    let groups = (512 / n_tokens.max(1)).clamp(1, n_head.max(1));
    let heads_per_block = ((n_head + groups - 1) / groups).max((n_head + 65534) / 65535).max(1);
    let groups = ((n_head + heads_per_block - 1) / heads_per_block).max(1) as u32;
    let n_rot = p.n_rot as i32;
    let pairing: i32 = match p.pairing {
        RopePairing::Neox => 0,
        RopePairing::Adjacent => 1,
    };
    let (has_sections, sec) = match p.sections {
        Some(s) => (1i32, s.map(|v| v as i32)),
        None => (0i32, [0; 4]),
    };
    let hpb = heads_per_block as i32;
    let mut a = cx.kernel(ROPE_MULTI)?;
    a.arg(&out).arg(&x).arg(&sdt).arg(&pos).arg(&n_rot).arg(&p.freq_base).arg(&pairing).arg(&has_sections);
    a.arg(&sec[0]).arg(&sec[1]).arg(&sec[2]).arg(&sec[3]).arg(&hpb);
    let shared = (p.n_rot * 4) as u32;
    // SAFETY: `rope_multi(dst, src, src_dt, pos, n_rot, freq_base, pairing, has_sections, s0..s3,
    // heads_per_block)`; grid (n_tokens, groups) with groups * heads_per_block >= n_head; dst has
    // x's shape; positions hold streams * n_tokens i32 (shape rules), read at stream * n_tokens +
    // t; n_rot <= head_dim and the shared table is n_rot f32s (<= 32 KiB, supports).
    unsafe { a.launch(config((n_tokens as u32, groups, 1), (THREADS, 1, 1), shared)) }
}
