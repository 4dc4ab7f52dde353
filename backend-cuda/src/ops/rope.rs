//! rope_multi: rotary position embedding (`kernels/rope.cu`). One block per (token, group of
//! heads) computes the token's angles once (in f64, like the CPU) and writes its heads.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, RopePairing, RopeParams, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, Launch, TensorArg, config, dt, unsupported};

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

/// The grid of a rope kernel over `n_head` heads of `n_tokens` tokens and the angle arguments of
/// `rope.cuh`, as rope_multi and rms_norm_mul_rope take them. About 512 blocks: enough to fill
/// the chip at decode, and at prefill one angle table per token (its f64 sines and cosines are the
/// slow part of a block).
pub(super) struct RopeGrid {
    /// Head groups: grid (n_tokens, groups), groups * heads_per_block >= n_head.
    pub groups: u32,
    pub heads_per_block: i32,
    n_rot: i32,
    freq_base: f32,
    pairing: i32,
    has_sections: i32,
    sections: [i32; 4],
}

impl RopeGrid {
    /// About 512 blocks, with at least `min_heads` heads a block where there are that many (a
    /// kernel whose warps each take a head wants one for each).
    pub(super) fn new(p: &RopeParams, n_head: i64, n_tokens: i64, min_heads: i64) -> RopeGrid {
        let groups = (512 / n_tokens.max(1)).clamp(1, n_head.max(1));
        let heads_per_block =
            ((n_head + groups - 1) / groups).max((n_head + 65534) / 65535).max(min_heads.min(n_head)).max(1);
        let groups = ((n_head + heads_per_block - 1) / heads_per_block).max(1) as u32;
        let pairing = match p.pairing {
            RopePairing::Neox => 0,
            RopePairing::Adjacent => 1,
        };
        let (has_sections, sections) = match p.sections {
            Some(s) => (1, s.map(|v| v as i32)),
            None => (0, [0; 4]),
        };
        RopeGrid {
            groups,
            heads_per_block: heads_per_block as i32,
            n_rot: p.n_rot as i32,
            freq_base: p.freq_base,
            pairing,
            has_sections,
            sections,
        }
    }

    /// Adds `n_rot, freq_base, pairing, has_sections, s0, s1, s2, s3` to a launch.
    pub(super) fn angle_args<'a>(&'a self, a: &mut Launch<'a>) {
        a.arg(&self.n_rot).arg(&self.freq_base).arg(&self.pairing).arg(&self.has_sections);
        for s in &self.sections {
            a.arg(s);
        }
    }
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
    let grid = RopeGrid::new(p, n_head, n_tokens, 1);
    let mut a = cx.kernel(ROPE_MULTI)?;
    a.arg(&out).arg(&x).arg(&sdt).arg(&pos);
    grid.angle_args(&mut a);
    a.arg(&grid.heads_per_block);
    let shared = (p.n_rot * 4) as u32;
    // SAFETY: `rope_multi(dst, src, src_dt, pos, n_rot, freq_base, pairing, has_sections, s0..s3,
    // heads_per_block)`; grid (n_tokens, groups) with groups * heads_per_block >= n_head; dst has
    // x's shape; positions hold streams * n_tokens i32 (shape rules), read at stream * n_tokens +
    // t; n_rot <= head_dim and the shared table is n_rot f32s (<= 32 KiB, supports).
    unsafe { a.launch(config((n_tokens as u32, grid.groups, 1), (THREADS, 1, 1), shared)) }
}
