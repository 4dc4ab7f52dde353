//! Fused ops (`kernels/fused.cu`), one launch each: the norms (add_rms_norm_mul, rms_norm_mul,
//! gated_rms_norm) a warp or a block per row, rms_norm_mul_rope a warp per head row in blocks of
//! one token's heads (rope.cu's grid), the router (softmax_top_k and moe_router a block per row,
//! moe_weights a warp per row) over rows of up to [`ROUTER_MAX`] logits, its probabilities
//! computed as reduce.cu's softmax computes them (TAG(softmax-probs)).

use tessera_graph::{BackendError, Task};
use tessera_ops::{Op, RmsNormMulRopeParams, TensorMeta};

use super::rope::RopeGrid;
use crate::compile::{Kernel, Module};
use crate::errors::op_code;
use crate::launch::{Cx, TensorArg, blocks_for, config, unsupported};

/// One norm op's kernels: `_warp4` (rows up to [`WARP4_ROW_MAX`]), `_warp` (up to
/// [`WARP_ROW_MAX`]), `_block` (up to [`BLOCK_ROW_MAX`]), `_loop` (longer).
struct NormKernels {
    warp4: Kernel,
    warp: Kernel,
    block: Kernel,
    looped: Kernel,
}

macro_rules! norm_kernels {
    ($name:literal) => {
        NormKernels {
            warp4: Kernel::new(Module::Fused, concat!($name, "_warp4")),
            warp: Kernel::new(Module::Fused, concat!($name, "_warp")),
            block: Kernel::new(Module::Fused, concat!($name, "_block")),
            looped: Kernel::new(Module::Fused, concat!($name, "_loop")),
        }
    };
}

const RMS_NORM_MUL: NormKernels = norm_kernels!("rms_norm_mul");
const GATED_RMS_NORM: NormKernels = norm_kernels!("gated_rms_norm");
const ADD_RMS_NORM_MUL: NormKernels = norm_kernels!("add_rms_norm_mul");
const RMS_NORM_MUL_ROPE: Kernel = Kernel::new(Module::Fused, "rms_norm_mul_rope");
const MOE_WEIGHTS_VEC: Kernel = Kernel::new(Module::Fused, "moe_weights_vec");
const MOE_WEIGHTS_GEN: Kernel = Kernel::new(Module::Fused, "moe_weights_gen");

/// One router op's kernels, each as [gen, vec] (`router_vec`): a block a row, a warp a row with
/// 32 logits a lane, and a warp a row with 8 (rows of up to [`WARP8_ROUTER_MAX`]).
struct RouterKernels {
    block: [Kernel; 2],
    warp: [Kernel; 2],
    warp8: [Kernel; 2],
}

macro_rules! router_kernels {
    ($name:literal) => {
        RouterKernels {
            block: [
                Kernel::new(Module::Fused, concat!($name, "_gen")),
                Kernel::new(Module::Fused, concat!($name, "_vec")),
            ],
            warp: [
                Kernel::new(Module::Fused, concat!($name, "_warp_gen")),
                Kernel::new(Module::Fused, concat!($name, "_warp_vec")),
            ],
            warp8: [
                Kernel::new(Module::Fused, concat!($name, "_warp8_gen")),
                Kernel::new(Module::Fused, concat!($name, "_warp8_vec")),
            ],
        }
    };
}

const SOFTMAX_TOP_K: RouterKernels = router_kernels!("softmax_top_k");
const MOE_ROUTER: RouterKernels = router_kernels!("moe_router");

/// Elements a thread keeps in registers in the norm kernels (their `NV`).
const NV: i64 = 8;
/// Rows up to this long run a warp per row (`32 * NV`).
const WARP_ROW_MAX: i64 = 32 * NV;
/// Rows up to this long run the warp kernel with half the registers (`_warp4`, NV = 4).
const WARP4_ROW_MAX: i64 = 32 * 4;
/// Rows up to this long keep every element in registers of one block (`1024 * NV`).
const BLOCK_ROW_MAX: i64 = 1024 * NV;
/// Threads of a warp-per-row block (8 rows): `FZ_ROWS_PER_WARP_BLOCK` in fused.cu.
const WARP_BLOCK_THREADS: u32 = 256;
const ROWS_PER_WARP_BLOCK: u32 = 8;
/// Longest router row: `ROUTER_MAX` in fused.cu (32 logits a lane).
pub(crate) const ROUTER_MAX: usize = 1024;

/// The norms take any shape the rules accept; the router needs rows of at most [`ROUTER_MAX`]
/// logits (longer ones are not a router: the CPU runs them) and fewer than 2^31 ids.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    match op {
        Op::AddRmsNormMul(_) | Op::RmsNormMul(_) | Op::GatedRmsNorm(_) => true,
        // Head rows of one warp (the shape rules give n_rot <= head_dim), a block's heads
        // indexed in 32 bits as rope.cu's, sections summing within i32.
        Op::RmsNormMulRope(p) => inputs.first().is_some_and(|x| {
            let sections_fit = p.rope.sections.is_none_or(|s| {
                s.iter().try_fold(0usize, |a, &v| a.checked_add(v)).is_some_and(|t| t <= (i32::MAX / 4) as usize)
            });
            x.ne[0] <= ROPE_HEAD_MAX && x.ne[0].saturating_mul(x.ne[1]) <= i32::MAX as usize && sections_fit
        }),
        Op::SoftmaxTopK { .. } | Op::MoeRouter { .. } => inputs.first().is_some_and(|l| l.ne[0] <= ROUTER_MAX),
        Op::MoeWeights => match inputs {
            [logits, ids, ..] => logits.ne[0] <= ROUTER_MAX && ids.nelements() < (1 << 31),
            _ => false,
        },
        _ => false,
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let router = matches!(task.op, Op::SoftmaxTopK { .. } | Op::MoeWeights | Op::MoeRouter { .. });
    if router && ins.first().is_none_or(|l| l.ne[0] > ROUTER_MAX as i64) {
        return Err(unsupported(task, format!("router rows longer than {ROUTER_MAX} logits")));
    }
    match (task.op, ins) {
        (Op::RmsNormMul(p), &[x, w]) => norm(cx, &RMS_NORM_MUL, out, out, x, x, w, p.eps),
        (Op::RmsNormMulRope(p), &[x, w, pos]) => norm_rope(cx, p, out, x, w, pos),
        (Op::GatedRmsNorm(p), &[x, w, z]) => norm(cx, &GATED_RMS_NORM, out, out, x, z, w, p.eps),
        (Op::AddRmsNormMul(p), &[a, b, w]) => {
            // The output [E, n, 2, 1] as its two planes [E, n, 1, 1]: s = a + b, then the norm.
            let plane = |i: i64| TensorArg {
                data: out.data + (i * out.nb[2]) as u64,
                ne: [out.ne[0], out.ne[1], 1, 1],
                nb: out.nb,
            };
            norm(cx, &ADD_RMS_NORM_MUL, plane(1), plane(0), a, b, w, p.eps)
        }
        (Op::SoftmaxTopK { k }, &[logits, ref tail @ ..]) => {
            let (kernel, warp) = router_kernel(&SOFTMAX_TOP_K, &logits, *k);
            let k = *k as i32;
            let tail = tail.first().copied().unwrap_or(NO_ROWS);
            let mut a = cx.kernel(kernel)?;
            a.arg(&out).arg(&logits).arg(&k).arg(&tail);
            // SAFETY: `softmax_top_k_*(dst, src, k, tail)`; src f32 [n, rows, 1, 1] with n <=
            // ROUTER_MAX (supports), read at i < n of each row through its strides (the vec kernels
            // only when router_vec holds: dense 16-byte aligned rows, n % 4 == 0); 1 <= k <= n and
            // tail i32 [m, rows] or no rows (shape rules), so dst (i32 [k + m, rows]) gets k ids
            // then the m of tail per row, each row written by one block (at least a warp: warp 0
            // computes the probabilities) or, with k <= 32 (`warp_rows`), by one warp.
            unsafe { a.launch(if warp { router_config(logits.ne[1]) } else { top_k_config(&logits) }) }
        }
        (Op::MoeRouter { k }, &[logits, ref rest @ ..]) => {
            let (kernel, warp) = router_kernel(&MOE_ROUTER, &logits, *k);
            let k = *k as i32;
            let (tail, gate) = match rest {
                [tail, gate] => (*tail, *gate),
                _ => (NO_ROWS, NO_ROWS),
            };
            let mut a = cx.kernel(kernel)?;
            a.arg(&out).arg(&logits).arg(&k).arg(&tail).arg(&gate);
            // SAFETY: `moe_router_*(dst, src, k, tail, gate)`; src, k and tail as for
            // softmax_top_k, gate f32 of tail's shape [m, rows] or no rows (shape rules); dst i32
            // [k + m, rows, 2]: plane 0 as softmax_top_k's output, plane 1 (at nb[2]) the k + m
            // weights of each row, written by warp 0 of the row's block or by the row's warp.
            unsafe { a.launch(if warp { router_config(logits.ne[1]) } else { top_k_config(&logits) }) }
        }
        (Op::MoeWeights, &[logits, ids, ref gate @ ..]) => {
            let kernel = if router_vec(&logits) { MOE_WEIGHTS_VEC } else { MOE_WEIGHTS_GEN };
            let (err, op) = (cx.errors, op_code("moe_weights"));
            let gate = gate.first().copied().unwrap_or(NO_ROWS);
            let mut a = cx.kernel(kernel)?;
            a.arg(&out).arg(&logits).arg(&ids).arg(&gate).arg(&err).arg(&op);
            // SAFETY: `moe_weights_*(dst, src, ids, gate, err, op)`; src as for softmax_top_k; ids
            // i32 [k, rows] and gate f32 [1, rows] or no rows (shape rules); every id is checked
            // against 0..n before a logit is read at it, a bad one reported to the error record
            // and its row left unwritten; dst f32 [1, k (+ 1 with a gate), rows] gets k weights
            // (and the gate's sigmoid) per row.
            unsafe { a.launch(router_config(logits.ne[1])) }
        }
        _ => Err(unsupported(task, "not a fused op with its inputs")),
    }
}

/// An absent optional input of the router kernels: no rows (`ne[0] == 0`), never read.
const NO_ROWS: TensorArg = TensorArg { data: 0, ne: [0, 1, 1, 1], nb: [4, 4, 4, 4] };

/// Most threads of a `softmax_top_k` block (one block a row; each thread places n / threads of
/// its elements).
const TOP_K_THREADS: i64 = 256;

/// From this many rows `softmax_top_k` / `moe_router` run a warp per row (`fz_top_k_warp`: k
/// rounds of a warp minimum) instead of a block per row, whose other warps wait while warp 0
/// computes the probabilities. Rows of up to [`WARP8_ROUTER_MAX`] logits take the warp kernel
/// at any row count: with 8 slots a lane its k rounds are shorter than the block kernel's count
/// of the smaller ranks (a decode step's router, one to a few rows).
const WARP_ROUTER_ROWS: i64 = 64;

/// Whether a router launch takes the warp-per-row kernels: k <= 32 (each lane keeps one chosen
/// probability), and many rows or rows of at most [`WARP8_ROUTER_MAX`] logits.
fn warp_rows(logits: &TensorArg, k: usize) -> bool {
    k <= 32 && (logits.ne[1] >= WARP_ROUTER_ROWS || logits.ne[0] <= WARP8_ROUTER_MAX)
}

/// Longest row of the warp-per-row router kernels with 8 logits a lane (`fz_top_k_warp<.., 8>`).
const WARP8_ROUTER_MAX: i64 = 32 * 8;

/// A router op's kernel for these logits, and whether it runs a warp per row (`warp_rows`; the
/// vec kernels where `router_vec`).
fn router_kernel(kernels: &RouterKernels, logits: &TensorArg, k: usize) -> (Kernel, bool) {
    let warp = warp_rows(logits, k);
    let pair = match (warp, logits.ne[0] <= WARP8_ROUTER_MAX) {
        (false, _) => &kernels.block,
        (true, true) => &kernels.warp8,
        (true, false) => &kernels.warp,
    };
    (pair[usize::from(router_vec(logits))], warp)
}

/// A `softmax_top_k` / `moe_router` launch: a block per row of up to [`TOP_K_THREADS`].
fn top_k_config(logits: &TensorArg) -> cudarc::driver::LaunchConfig {
    let threads = (logits.ne[0].clamp(32, TOP_K_THREADS) as u32).next_multiple_of(32);
    let grid = (logits.ne[1].clamp(1, 1 << 30) as u32, 1, 1);
    config(grid, (threads, 1, 1), 0)
}

/// Rows (warps) a block of the warp-per-row router kernels. Two, not the norms' eight: a
/// 512-token step's 512 rows then spread over 256 blocks, where 64 blocks left half of an H200's
/// multiprocessors idle.
const ROUTER_ROWS_PER_BLOCK: u32 = 2;

/// A router launch: a warp per row, [`ROUTER_ROWS_PER_BLOCK`] rows a block, over a grid-stride
/// loop (any grid covers the rows).
fn router_config(rows: i64) -> cudarc::driver::LaunchConfig {
    config((blocks_for(rows, ROUTER_ROWS_PER_BLOCK).min(1 << 20), 1, 1), (32 * ROUTER_ROWS_PER_BLOCK, 1, 1), 0)
}

/// Rows softmax_vec_warp would read for this tensor (reduce.rs's `vec_rows` on f32 logits, and a
/// row short enough for its registers): the probabilities must come from the same kernel shape.
/// TAG(softmax-probs).
fn router_vec(t: &TensorArg) -> bool {
    t.nb[0] == 4
        && t.ne[0] % 4 == 0
        && t.ne[0] <= ROUTER_MAX as i64
        && t.data.is_multiple_of(16)
        && t.nb[1..].iter().all(|b| b % 16 == 0)
}

/// Launches one norm op: `y` the result, `s` the sum plane (add_rms_norm_mul; else unused), `x`
/// the normalised input (or the first addend), `b` the second addend or the gate (else unused),
/// `w` the weight.
#[allow(clippy::too_many_arguments)]
fn norm(
    cx: &mut Cx<'_>,
    k: &NormKernels,
    y: TensorArg,
    s: TensorArg,
    x: TensorArg,
    b: TensorArg,
    w: TensorArg,
    eps: f32,
) -> Result<(), BackendError> {
    let n = x.ne[0];
    let rows = x.ne[1] * x.ne[2] * x.ne[3];
    let (kernel, threads, blocks) = if n <= WARP_ROW_MAX {
        let kernel = if n <= WARP4_ROW_MAX { k.warp4 } else { k.warp };
        (kernel, WARP_BLOCK_THREADS, blocks_for(rows, ROWS_PER_WARP_BLOCK))
    } else if n <= BLOCK_ROW_MAX {
        let threads = ((n + NV - 1) / NV) as u32;
        let threads = threads.next_multiple_of(32);
        (k.block, threads, blocks_for(rows, 1))
    } else {
        (k.looped, 1024, blocks_for(rows, 1))
    };
    let mut a = cx.kernel(kernel)?;
    a.arg(&y).arg(&s).arg(&x).arg(&b).arg(&w).arg(&eps);
    // SAFETY: `*_{warp4,warp,block,loop}(y, s, x, b, w, eps)`; y, s and b have x's shape and
    // dense rows (shape rules; s is the output's plane 0, y its plane 1 or the output), every
    // access is i < n of a row < ne1 * ne2 * ne3 of its tensor through its strides; w broadcasts
    // to x (shape rules) and is read at (i mod w.ne0, row coordinates mod w's); the warp kernels
    // cover n <= 32 * 4 (`_warp4`) and n <= 32 * NV, the block kernel n <= NV * threads (threads
    // <= 1024, a multiple of 32 for block_sum), the loop kernel any n.
    unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
}

/// Longest head row of `rms_norm_mul_rope`: one warp's registers (`FZ_ROPE_HD_MAX` in fused.cu).
const ROPE_HEAD_MAX: usize = WARP_ROW_MAX as usize;
/// Warps of a `rms_norm_mul_rope` block (`FZ_ROPE_WARPS` in fused.cu), a head row each.
const ROPE_WARPS: i64 = 8;
const ROPE_THREADS: u32 = 32 * ROPE_WARPS as u32;

/// Launches `rms_norm_mul_rope` on a grid of (tokens, head groups) as rope.rs launches
/// rope_multi (about 512 blocks, each computing its token's angle table once), but with a head
/// for each of a block's warps where there are enough: rope_multi's one head a block at 32
/// tokens left 7 of 8 warps idle and computed each token's angles 16 times, slower than the
/// unfused ops (docs/perf-log/fusion.md).
fn norm_rope(
    cx: &mut Cx<'_>,
    p: &RmsNormMulRopeParams,
    y: TensorArg,
    x: TensorArg,
    w: TensorArg,
    pos: TensorArg,
) -> Result<(), BackendError> {
    let (n_head, n_tokens) = (x.ne[1], x.ne[2]);
    if y.nelements() == 0 {
        return Ok(());
    }
    let grid = RopeGrid::new(&p.rope, n_head, n_tokens, ROPE_WARPS);
    let mut a = cx.kernel(RMS_NORM_MUL_ROPE)?;
    a.arg(&y).arg(&x).arg(&w).arg(&pos).arg(&p.norm.eps);
    grid.angle_args(&mut a);
    a.arg(&grid.heads_per_block);
    // SAFETY: `rms_norm_mul_rope(y, x, w, pos, eps, n_rot, freq_base, pairing, has_sections,
    // s0..s3, heads_per_block)`; grid (n_tokens, groups) with groups * heads_per_block >= n_head,
    // each block's heads clipped to n_head; x f32 [hd, n_head, n_tokens, 1] with dense rows and hd
    // <= ROPE_HEAD_MAX = FZ_ROPE_HD_MAX (supports), read at i < hd of each row; the shared rows
    // and angle table hold FZ_ROPE_HD_MAX f32s each and n_rot <= hd (shape rules); w broadcasts
    // to x (read at i mod w.ne0, head mod w.ne1, token mod w.ne2); positions hold streams *
    // n_tokens i32 (shape rules), read at stream * n_tokens + t; y (contiguous, x's shape)
    // written at i < hd of each (head, token) row; 256 threads = FZ_ROPE_WARPS warps.
    unsafe { a.launch(config((n_tokens as u32, grid.groups, 1), (ROPE_THREADS, 1, 1), 0)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_rope_blocks_give_every_warp_a_head() {
        let p = tessera_ops::RopeParams {
            n_rot: 64,
            freq_base: 1e7,
            pairing: tessera_ops::RopePairing::Neox,
            sections: None,
        };
        let grid = |n_head: i64, n_tokens: i64| {
            let g = RopeGrid::new(&p, n_head, n_tokens, ROPE_WARPS);
            (g.groups, g.heads_per_block)
        };
        assert_eq!(grid(16, 32), (2, 8));
        assert_eq!(grid(16, 1), (2, 8));
        assert_eq!(grid(16, 512), (1, 16));
        assert_eq!(grid(4, 32), (1, 4));
        assert_eq!(grid(20, 8), (3, 8));
    }

    #[test]
    fn router_kernels_by_rows_k_and_alignment() {
        let logits =
            |rows: i64, data: u64| TensorArg { data, ne: [256, rows, 1, 1], nb: [4, 1024, 1024 * rows, 1024 * rows] };
        let v = &SOFTMAX_TOP_K;
        let name = |(k, warp): (Kernel, bool)| (k.name, warp);
        // rows of up to 256 logits: a warp a row, 8 logits a lane, at any row count (k <= 32)
        assert_eq!(name(router_kernel(v, &logits(1, 4096), 8)), ("softmax_top_k_warp8_vec", true));
        assert_eq!(name(router_kernel(v, &logits(32, 4096), 8)), ("softmax_top_k_warp8_vec", true));
        assert_eq!(name(router_kernel(v, &logits(512, 4100), 8)), ("softmax_top_k_warp8_gen", true));
        assert_eq!(name(router_kernel(v, &logits(8, 4100), 8)), ("softmax_top_k_warp8_gen", true));
        assert_eq!(name(router_kernel(v, &logits(512, 4096), 33)), ("softmax_top_k_vec", false));
        // longer rows: a block a row for a decode step's few, a warp a row from 64
        let wide = |rows: i64| TensorArg { data: 4096, ne: [512, rows, 1, 1], nb: [4, 2048, 2048 * rows, 2048 * rows] };
        assert_eq!(name(router_kernel(v, &wide(32), 8)), ("softmax_top_k_vec", false));
        assert_eq!(name(router_kernel(v, &wide(512), 8)), ("softmax_top_k_warp_vec", true));
    }
}
