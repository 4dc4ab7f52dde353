//! mul_mat of one token against one weight matrix (`kernels/gemv_one.cu`), a decode step's
//! projections: the product is one pass over the weights, so these kernels hold the activations
//! in registers and keep the weight stream near the copy bandwidth. q8_0 / nvfp4 take the ring
//! GEMV `gemv_ring_*` (`gemv_ring_plan` sizes its shared-memory stages and thread groups for the
//! device), f16 / bf16 the word GEMVs `gemv_f16w` / `gemv_bf16w[_long]`. One token against the
//! experts it was routed to (mul_mat_id and its fused forms) takes the same ring over the
//! gathered experts, `moe_ring_*` (`moe_ring_plan`).

use tessera_graph::BackendError;
use tessera_ops::DType;

use super::pack::{pack_b, packed_already, packed_len};
use super::rows_vectorizable;
use crate::compile::{Kernel, Module};
use crate::device::DeviceInfo;
use crate::launch::{Cx, TensorArg, config};

/// `moe_ring_*` entry points: `[q8_0, nvfp4][id, glu, sum]` (`MoeRingMode`).
const MOE_RING: [[Kernel; 3]; 2] = [
    [
        Kernel::new(Module::GemvOne, "moe_ring_q8_0_id"),
        Kernel::new(Module::GemvOne, "moe_ring_q8_0_glu"),
        Kernel::new(Module::GemvOne, "moe_ring_q8_0_sum"),
    ],
    [
        Kernel::new(Module::GemvOne, "moe_ring_nvfp4_id"),
        Kernel::new(Module::GemvOne, "moe_ring_nvfp4_glu"),
        Kernel::new(Module::GemvOne, "moe_ring_nvfp4_sum"),
    ],
];

/// `gemv_ring_*` entry points: `[tokens - 1][q8_0, nvfp4][3 stages, 4]` (from two tokens the
/// `_tN_` entries, each row read once for all N), and nvfp4's one-token entry with a producer warp.
const GEMV_RING: [[[Kernel; 2]; 2]; 4] = [
    [
        [Kernel::new(Module::GemvOne, "gemv_ring_q8_0_s3"), Kernel::new(Module::GemvOne, "gemv_ring_q8_0_s4")],
        [Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_s3"), Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_s4")],
    ],
    [
        [Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t2_s3"), Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t2_s4")],
        [Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t2_s3"), Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t2_s4")],
    ],
    [
        [Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t3_s3"), Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t3_s4")],
        [Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t3_s3"), Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t3_s4")],
    ],
    [
        [Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t4_s3"), Kernel::new(Module::GemvOne, "gemv_ring_q8_0_t4_s4")],
        [Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t4_s3"), Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_t4_s4")],
    ],
];
const GEMV_RING_NVFP4_PRODUCER: Kernel = Kernel::new(Module::GemvOne, "gemv_ring_nvfp4_producer_s4");
const GEMV_F16W: Kernel = Kernel::new(Module::GemvOne, "gemv_f16w");
const GEMV_BF16W: Kernel = Kernel::new(Module::GemvOne, "gemv_bf16w");
const GEMV_F16W_LONG: Kernel = Kernel::new(Module::GemvOne, "gemv_f16w_long");
const GEMV_BF16W_LONG: Kernel = Kernel::new(Module::GemvOne, "gemv_bf16w_long");
const GEMV_F32W: Kernel = Kernel::new(Module::GemvOne, "gemv_f32w");
const GEMV_F32W_LONG: Kernel = Kernel::new(Module::GemvOne, "gemv_f32w_long");

/// The fewest values a row of f32 weights needs for the word GEMV: shorter rows (small models'
/// matrices) stay on `gemv_warp`, a warp a row.
const F32W_MIN_K: i64 = 1024;

/// Whether f32 weights may take the word GEMV: yes unless `TESSERA_F32_WORDS=0` (read once a
/// process), which keeps them on `gemv_warp`, to measure one against the other.
fn f32_words() -> bool {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_F32_WORDS") != Some(0)
}

/// 16-byte words of a weight row per `gemv_f16w` / `gemv_bf16w` thread (gemv_one.cu).
const GH_WORDS: u64 = 2;

/// Words per thread and most threads of `gemv_f16w_long` / `gemv_bf16w_long`: 5 and
/// `GH_LONG_THREADS` in gemv_one.cu.
const GH_LONG_WORDS: u64 = 5;
const GH_LONG_THREADS: u64 = 448;

/// Most threads of a `gemv_f16w` / `gemv_bf16w` block: `GW_MAX_THREADS` in gemv_one.cu.
const GW_MAX_THREADS: u64 = 512;

/// Weight rows a `gemv_f16w` block takes per step: `GW_R` in gemv_one.cu.
const GW_R: u64 = 4;

/// `gemv_ring_*` (gemv_one.cu): most threads a block (`GR_MAX_THREADS`, nvfp4's
/// `GR_MAX_THREADS_NVFP4`, the two-token entries' `GR_MAX_THREADS_T2`, the three- and four-token
/// ones' `GR_MAX_THREADS_T4`), staged f32 activation bytes per 64-value unit (`GR_XSTRIDE`).
/// TAG(gemv-ring-consts)
const GR_MAX_THREADS: usize = 576;
const GR_MAX_THREADS_NVFP4: usize = 640;
const GR_MAX_THREADS_T2: usize = 512;
const GR_MAX_THREADS_T4: usize = 256;
const GR_XSTRIDE: usize = 272;

/// Bytes of weight rows a `gemv_ring_*` stage aims at: nvfp4 gets two rows a thread a stage
/// (smaller stages were markedly slower for it; larger ones lost the gain of fewer stages in flight
/// on an H100, their first stage arriving later: docs/perf-log/kernels-matmul.md).
const GR_STAGE_BYTES: usize = 48 << 10;

/// Peak DRAM bandwidth (bytes/s) from which `gemv_ring_*` keeps 3 stages in flight instead of 2:
/// on an H100 (3.35 TB/s) 2 in flight beat 3 and 4, on an H200 (4.8 TB/s) 3 beat or tied 2
/// (docs/perf-log/kernels-matmul.md).
const GR_DEEP_BANDWIDTH: u64 = 4_000_000_000_000;

/// Static shared memory of `gemv_ring_*` (its stage barriers), kept out of the dynamic budget.
const GR_STATIC_SHARED: usize = 64;

/// `moe_ring_*` (gemv_one.cu): its ring stages and most slots (`MR_STAGES`, `MR_MAX_SLOTS`), and
/// a bound on its static shared memory (the slots' expert offsets and weights, the barriers).
/// TAG(moe-ring-consts)
const MR_STAGES: usize = 4;
const MR_MAX_SLOTS: i64 = 32;
const MR_STATIC_SHARED: usize = 512;

/// Shared-memory stages of the `gemv_ring_*` ring on a device of peak DRAM bandwidth `bandwidth`.
pub(super) fn gemv_ring_stages(bandwidth: u64) -> usize {
    if bandwidth >= GR_DEEP_BANDWIDTH { 4 } else { 3 }
}

/// How `gemv_ring_q8_0_s*` / `gemv_ring_nvfp4_s*` run one product: tokens (1, or 2-4 on the
/// `_t2_` / `_t3_` / `_t4_` entries), ring stages (`gemv_ring_stages`), threads a block, thread
/// groups (each takes every row of a stage once), rows a stage, whether a warp of its own copies
/// and adds up (`producer`), dynamic shared memory bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RingPlan {
    tokens: usize,
    stages: usize,
    threads: u32,
    groups: i32,
    rows_stage: i32,
    producer: bool,
    shared: u32,
}

/// The `gemv_ring_*` plan when one takes the product: one token (or 2-4, on the `_t2_` / `_t3_` /
/// `_t4_` entries: at most `GR_MAX_THREADS_T2` / `GR_MAX_THREADS_T4` threads, every token's
/// partials and staged activations) against one q8_0 / nvfp4 matrix of contiguous rows (row r at
/// r * row_bytes from a 16-byte aligned start), k % 256 == 0 (rows of whole 16-byte pieces), at
/// most `GR_MAX_THREADS` (nvfp4: `GR_MAX_THREADS_NVFP4`) 64-value units a row, and a plan whose
/// stages fit `max_shared` (fewer rows a stage, then fewer groups, until they do). Groups: as many as those threads hold; rows a stage: about
/// `GR_STAGE_BYTES`, a multiple of groups. With bulk copies (`bulk`, sm_90+) and 3 stages in
/// flight (`stages` 4, the H200) nvfp4 takes a producer warp where the threads have a warp to
/// spare beside the groups: long rows (one token only). Taking a group for it, giving one to
/// q8_0, or one with 2 stages in flight (the H100) were slower (docs/perf-log/kernels-matmul.md).
pub(super) fn gemv_ring_plan(
    a: &TensorArg,
    d: DType,
    b: &TensorArg,
    max_shared: usize,
    stages: usize,
    bulk: bool,
) -> Option<RingPlan> {
    let tokens = usize::try_from(b.ne[1]).ok()?;
    let single = (1..=GEMV_RING.len()).contains(&tokens) && b.ne[2] * b.ne[3] == 1 && a.ne[2] * a.ne[3] == 1;
    let (unit_bytes, max_threads) = match d {
        DType::Q8_0 => (2 * d.block_bytes(), GR_MAX_THREADS),
        DType::NvFp4 => (d.block_bytes(), GR_MAX_THREADS_NVFP4),
        _ => return None,
    };
    let max_threads = match tokens {
        2 => GR_MAX_THREADS_T2,
        3 | 4 => GR_MAX_THREADS_T4,
        _ => max_threads,
    };
    let k = usize::try_from(a.ne[0]).ok()?;
    let nu = k / 64;
    let row_bytes = nu * unit_bytes;
    let contiguous = a.nb[1] == row_bytes as i64 && a.data.is_multiple_of(16);
    if !single || !contiguous || k % 256 != 0 || nu == 0 || nu > max_threads {
        return None;
    }
    let producer = tokens == 1
        && bulk
        && stages == 4
        && d == DType::NvFp4
        && (max_threads / nu * nu).next_multiple_of(32) + 32 <= max_threads;
    for groups in (1..=max_threads / nu).rev() {
        for per_group in (1..=(GR_STAGE_BYTES / (groups * row_bytes)).max(1)).rev() {
            let rows_stage = groups * per_group;
            let stage = rows_stage * row_bytes;
            let partials = if producer { stages + 1 } else { 2 } * tokens * (rows_stage | 1) * nu * 4;
            let shared = (stages - 1) * stage + (stage + partials).max(tokens * nu * GR_XSTRIDE);
            if shared + GR_STATIC_SHARED <= max_shared {
                return Some(RingPlan {
                    tokens,
                    stages,
                    threads: ((groups * nu).next_multiple_of(32) + if producer { 32 } else { 0 }) as u32,
                    groups: groups as i32,
                    rows_stage: rows_stage as i32,
                    producer,
                    shared: u32::try_from(shared).ok()?,
                });
            }
        }
    }
    None
}

/// The ring GEMV `gemv_ring_q8_0_s*` / `gemv_ring_nvfp4_s*` (activations quantized in the kernel;
/// no scratch), one block per multiprocessor (as many as fit), each over an even share of the
/// rows.
pub(super) fn gemv_ring(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    plan: RingPlan,
) -> Result<(), BackendError> {
    let kernel = if plan.producer {
        GEMV_RING_NVFP4_PRODUCER
    } else {
        GEMV_RING[plan.tokens - 1][usize::from(d == DType::NvFp4)][plan.stages - 3]
    };
    cx.allow_shared(kernel, plan.shared)?;
    let resident = cx.resident_blocks(kernel, plan.threads, plan.shared)?;
    let grid = ((a.ne[1] as u64).min(resident).clamp(1, i32::MAX as u64) as u32, 1, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&b).arg(&out).arg(&plan.groups).arg(&plan.rows_stage);
    // SAFETY: `gemv_ring_*(a, b, out, groups, rows_stage)`: a is one [k, M] q8_0 / nvfp4 matrix of
    // contiguous rows from a 16-byte aligned start, k % 256 == 0, k / 64 <= groups * (k / 64) <=
    // threads <= GR_MAX_THREADS, GR_MAX_THREADS_NVFP4 or (two / three or four tokens)
    // GR_MAX_THREADS_T2 / GR_MAX_THREADS_T4, the entry point's launch bound, with a whole warp
    // beyond the groups' threads for the producer entry points (taken on sm_90+ only, one token)
    // (`gemv_ring_plan`); block i copies (and on sm_90+ prefetches into L2) whole 16-byte pieces
    // of its rows [i M / grid, (i + 1) M / grid) only; `shared` holds plan.stages stages of
    // rows_stage rows plus 2 (producer: stages + 1) x tokens x (rows_stage | 1) x k / 64 f32
    // partials, or the staged activations (tokens x k / 64 x GR_XSTRIDE bytes) if larger, and is
    // within the device limit (raised above); b is the entry's 1-4 f32 columns of k values
    // (plan.tokens == b.ne[1]) read through their strides (16-byte loads only where the kernel
    // finds them aligned); out is [M, tokens] f32, written at rows < M.
    unsafe { args.launch(config(grid, (plan.threads, 1, 1), plan.shared)) }?;
    Ok(())
}

/// Which product `moe_ring_*` runs: mul_mat_id, mul_mat_id_swiglu, mul_mat_id_weighted_sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MoeRingMode {
    Id = 0,
    Glu = 1,
    Sum = 2,
}

/// How `moe_ring_*` runs one product: threads a block, thread groups, output rows a stage,
/// dynamic shared memory bytes, blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MoeRingPlan {
    mode: MoeRingMode,
    threads: u32,
    groups: i32,
    rows_stage: i32,
    shared: u32,
    blocks: u32,
}

/// The `moe_ring_*` plan when one takes the product on `dev`: sm_90+ (the kernels copy with bulk
/// copies only), one token (`ids` [n_used, 1], 1 ..= `MR_MAX_SLOTS` slots), q8_0 / nvfp4 experts
/// of contiguous rows from 16-byte aligned starts, k % 256 == 0, and activations of one row (`Id`
/// / `Glu`) or at most one a slot (`Sum`). Groups: as many as the threads hold (`Sum`: a whole
/// number a slot); output rows a stage: enough that a block's share (the rows over the blocks, one
/// a multiprocessor) fits the `MR_STAGES` - 1 stages in flight, rounded up to give every
/// group the same number of rows, fewer where the stages would not fit the device's shared memory.
pub(super) fn moe_ring_plan(
    w: &TensorArg,
    d: DType,
    b: &TensorArg,
    ids: &TensorArg,
    mode: MoeRingMode,
    dev: &DeviceInfo,
) -> Option<MoeRingPlan> {
    let (max_shared, blocks) = (dev.max_shared_per_block, dev.multiprocessors);
    let bulk = dev.compute_capability.0 >= 9;
    let (unit_bytes, max_threads) = match d {
        DType::Q8_0 => (2 * d.block_bytes(), GR_MAX_THREADS),
        DType::NvFp4 => (d.block_bytes(), GR_MAX_THREADS_NVFP4),
        _ => return None,
    };
    let n_used = ids.ne[0];
    let one_token = ids.ne[1] * ids.ne[2] * ids.ne[3] == 1 && b.ne[2] * b.ne[3] == 1;
    let n_x = if mode == MoeRingMode::Sum { b.ne[1] } else { 1 };
    let k = usize::try_from(w.ne[0]).ok()?;
    let nu = k / 64;
    let row_bytes = nu * unit_bytes;
    let contiguous = w.nb[1] == row_bytes as i64 && w.data.is_multiple_of(16) && w.nb[2] % 16 == 0;
    if !bulk || !one_token || !(1..=MR_MAX_SLOTS).contains(&n_used) || b.ne[1] != n_x || n_x > n_used {
        return None;
    }
    let slots_fit = mode != MoeRingMode::Sum || nu * n_used as usize <= max_threads;
    if !contiguous || k % 256 != 0 || nu == 0 || nu > max_threads || !slots_fit || w.ne[1] < 1 {
        return None;
    }
    let (n_used, n_x) = (n_used as usize, n_x as usize);
    let m = usize::try_from(w.ne[1]).ok()?;
    let rows = if mode == MoeRingMode::Sum { m } else { n_used * m };
    let groups = match mode {
        MoeRingMode::Sum => max_threads / (nu * n_used) * n_used,
        _ => max_threads / nu,
    };
    // weight rows a stage per output row
    let per_row = match mode {
        MoeRingMode::Id => 1,
        MoeRingMode::Glu => 2,
        MoeRingMode::Sum => n_used,
    };
    // a whole number of rows a group a stage, where that fits (`Sum`: of each slot's groups)
    let whole = match mode {
        MoeRingMode::Id => groups,
        MoeRingMode::Glu => groups / gcd(groups, 2),
        MoeRingMode::Sum => groups / n_used,
    };
    let blocks = blocks.clamp(1, rows);
    let share = rows.div_ceil(blocks);
    let most = share.div_ceil(MR_STAGES - 1).next_multiple_of(whole);
    for rows_stage in (1..=most).rev().filter(|rs| rs % whole == 0 || *rs < whole) {
        let stage_rows = per_row * rows_stage;
        let shared = MR_STAGES * stage_rows * row_bytes + 2 * (stage_rows | 1) * nu * 4 + n_x * nu * GR_XSTRIDE;
        if shared + MR_STATIC_SHARED <= max_shared {
            return Some(MoeRingPlan {
                mode,
                threads: (groups * nu).next_multiple_of(32) as u32,
                groups: groups as i32,
                rows_stage: rows_stage as i32,
                shared: u32::try_from(shared).ok()?,
                blocks: u32::try_from(blocks).ok()?,
            });
        }
    }
    None
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// mul_mat_id (`MoeRingMode::Id`), mul_mat_id_swiglu (`Glu`, `up` its up experts, of w's shape)
/// or mul_mat_id_weighted_sum (`Sum`, `weights` the router weights [1, n_used, T]) on
/// `moe_ring_*`, one launch a token (activations quantized in the kernel; no scratch), where the
/// kernels take the product: `moe_ring_plan` for one token's columns, at most `max_tokens` tokens.
/// `op` names the op in a device error (a bad expert id). `None` when they do not take it.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_rings(
    cx: &mut Cx<'_>,
    mode: MoeRingMode,
    w: TensorArg,
    up: Option<TensorArg>,
    d: DType,
    b: TensorArg,
    ids: TensorArg,
    weights: Option<TensorArg>,
    out: TensorArg,
    op: u32,
    max_tokens: i64,
) -> Option<Result<(), BackendError>> {
    let tokens = ids.ne[1];
    let columns = ids.ne[2] * ids.ne[3] == 1 && b.ne[2] == tokens && b.ne[3] == 1;
    let up_fits = up.is_none_or(|u| u.nb == w.nb && u.data.is_multiple_of(16));
    if !columns || !up_fits || !(1..=max_tokens).contains(&tokens) {
        return None;
    }
    // token t's column of a tensor whose tokens run along `dim`
    let col = |t: &TensorArg, dim: usize, i: i64| {
        let mut c = *t;
        c.data += (i * t.nb[dim]) as u64;
        c.ne[dim] = 1;
        c
    };
    let plan = moe_ring_plan(&w, d, &col(&b, 2, 0), &col(&ids, 1, 0), mode, cx.info)?;
    let out_dim = if mode == MoeRingMode::Sum { 1 } else { 2 };
    let kernel = MOE_RING[usize::from(d == DType::NvFp4)][plan.mode as usize];
    let (up, err) = (up.unwrap_or(w), cx.errors);
    let launch = |cx: &mut Cx<'_>, t: i64| -> Result<(), BackendError> {
        let (b, ids, out) = (col(&b, 2, t), col(&ids, 1, t), col(&out, out_dim, t));
        let rw = weights.map_or(b, |rw| col(&rw, 2, t));
        let mut args = cx.kernel(kernel)?;
        args.arg(&w).arg(&up).arg(&b).arg(&ids).arg(&rw).arg(&out).arg(&plan.groups).arg(&plan.rows_stage);
        args.arg(&err).arg(&op);
        // SAFETY: `moe_ring_*(as, as_up, b, ids, rw, out, groups, rs, err, op)` (`moe_ring_plan`,
        // token t's columns): as (and as_up, of its shape and strides, for `_glu`) are q8_0 /
        // nvfp4 experts [k, M, E] of contiguous rows from 16-byte aligned starts with 16-byte
        // aligned expert strides, k % 256 == 0; ids [n_used, 1] i32 with 1 <= n_used <=
        // MR_MAX_SLOTS, every id checked against E before any copy (a bad one is read as expert
        // 0); groups * k / 64 <= threads <= the entry point's launch bound, `_sum`'s groups a
        // multiple of n_used; b is f32 [k, n_x, 1, 1] read through its strides (n_x = 1, or for
        // `_sum` at most n_used); rw (`_sum`) f32 [1, n_used, 1]; `shared` holds MR_STAGES stages
        // of the output rows' weight rows plus 2 x (stage rows | 1) x k / 64 f32 partials and n_x
        // x k / 64 x GR_XSTRIDE bytes of activations, within the device limit (raised above); the
        // kernels copy only whole rows of the slots' experts (bulk copies: sm_90+, checked by
        // `moe_ring_plan`); out is f32 [M, n_used, 1] (`_id`, `_glu`) or [M, 1], written at rows
        // < M.
        unsafe { args.launch(config((plan.blocks, 1, 1), (plan.threads, 1, 1), plan.shared)) }?;
        Ok(())
    };
    Some(cx.allow_shared(kernel, plan.shared).and_then(|()| (0..tokens).try_for_each(|t| launch(cx, t))))
}

/// The word GEMV kernel and its threads, when one takes the product: one token, one f16 / bf16
/// weight matrix (or f32 of rows of at least `F32W_MIN_K` values: the MoE router's logits)
/// whose rows are 16-byte aligned whole words. `gemv_f16w` / `gemv_bf16w` / `gemv_f32w`:
/// `GH_WORDS` words a thread, at most `GW_MAX_THREADS` threads; longer rows `gemv_*w_long`
/// (`GH_LONG_WORDS` words, at most `GH_LONG_THREADS` threads). Threads are rounded up to whole
/// warps.
pub(super) fn word_gemv(a: &TensorArg, d: DType, b: &TensorArg) -> Option<(Kernel, u32)> {
    let single = b.ne[1] == 1 && b.ne[2] * b.ne[3] == 1 && a.ne[2] * a.ne[3] == 1;
    if !single || !rows_vectorizable(a, d) {
        return None;
    }
    // [short rows, long rows]
    let kernels = match d {
        DType::F16 => [GEMV_F16W, GEMV_F16W_LONG],
        DType::BF16 => [GEMV_BF16W, GEMV_BF16W_LONG],
        DType::F32 if a.ne[0] >= F32W_MIN_K && f32_words() => [GEMV_F32W, GEMV_F32W_LONG],
        _ => return None,
    };
    let words = d.row_bytes(a.ne[0] as usize)? as u64 / 16;
    let (kernel, threads) = if words.div_ceil(GH_WORDS) <= GW_MAX_THREADS {
        (kernels[0], words.div_ceil(GH_WORDS))
    } else if words.div_ceil(GH_LONG_WORDS).next_multiple_of(32) <= GH_LONG_THREADS {
        (kernels[1], words.div_ceil(GH_LONG_WORDS))
    } else {
        return None;
    };
    Some((kernel, threads.next_multiple_of(32) as u32))
}

/// The decode GEMV over whole words: `gemv_f16w` / `gemv_bf16w` / `gemv_f32w` (`[_long]`) on a
/// grid of the blocks that fit the GPU at once, reading the activations where they are when
/// they are one dense row already (`packed_already`), else after `pack_b` (a launch more).
pub(super) fn gemv_words(
    cx: &mut Cx<'_>,
    a: TensorArg,
    b: TensorArg,
    out: TensorArg,
    (kernel, threads): (Kernel, u32),
) -> Result<(), BackendError> {
    let x = match packed_already(&b) {
        Some(_) => b.data,
        None => {
            pack_b(cx, b, cx.scratch, 0, 0, 0, packed_len(b.ne[0] as usize) as i64)?;
            cx.scratch
        }
    };
    let resident = cx.resident_blocks(kernel, threads, 0)?;
    let grid = ((a.ne[1] as u64).div_ceil(GW_R).min(resident).max(1) as u32, 1, 1);
    let mut args = cx.kernel(kernel)?;
    args.arg(&a).arg(&x).arg(&out);
    // SAFETY: `gemv_f16w` / `gemv_bf16w` / `gemv_f32w[_long](a, x, out)`: a is one [k, M] f16 /
    // bf16 / f32 matrix (the kernel's type) of 16-byte aligned rows of whole words, row_bytes /
    // 16 <= words a thread * threads, threads <= the kernel's launch bound (`word_gemv`); x is one
    // dense f32 row of k values: b itself (`packed_already`) or its `pack_b` copy in scratch
    // (scratch_bytes). Row reads are clamped to row M - 1; out is [M, 1, 1, 1] f32.
    unsafe { args.launch(config(grid, (threads, 1, 1), 0)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_kernels_are_entry_points_of_gemv_one_cu() {
        let words = [
            GEMV_F16W,
            GEMV_BF16W,
            GEMV_F16W_LONG,
            GEMV_BF16W_LONG,
            GEMV_F32W,
            GEMV_F32W_LONG,
            GEMV_RING_NVFP4_PRODUCER,
        ];
        let rings = GEMV_RING.iter().flatten().flatten();
        for &k in rings.chain(MOE_RING.iter().flatten()).chain(&words) {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
    }

    /// One contiguous [k, m] matrix of `d` at a 16-byte aligned address.
    fn weights(d: DType, k: usize, m: usize) -> TensorArg {
        let row = (k / d.block_size() * d.block_bytes()) as i64;
        TensorArg { data: 1 << 20, ne: [k as i64, m as i64, 1, 1], nb: [1, row, row * m as i64, row * m as i64] }
    }

    /// One f32 activation row of k values.
    fn activations(k: usize) -> TensorArg {
        TensorArg { data: 1 << 30, ne: [k as i64, 1, 1, 1], nb: [4, 4 * k as i64, 4 * k as i64, 4 * k as i64] }
    }

    #[test]
    fn word_gemvs_take_half_rows_and_long_f32_rows() {
        let plain = |d: DType, k: usize, m: usize| {
            let row = d.row_bytes(k).unwrap() as i64;
            TensorArg {
                data: 1 << 20,
                ne: [k as i64, m as i64, 1, 1],
                nb: [d.block_bytes() as i64, row, row * m as i64, row * m as i64],
            }
        };
        // the stacked router: 512 words of 4 floats, 2 a thread
        assert_eq!(word_gemv(&plain(DType::F32, 2048, 260), DType::F32, &activations(2048)), Some((GEMV_F32W, 256)));
        // 1280 words: 5 a thread
        assert_eq!(
            word_gemv(&plain(DType::F32, 5120, 512), DType::F32, &activations(5120)),
            Some((GEMV_F32W_LONG, 256))
        );
        // short f32 rows stay on gemv_warp; f16 as before
        assert_eq!(word_gemv(&plain(DType::F32, 512, 64), DType::F32, &activations(512)), None);
        assert_eq!(word_gemv(&plain(DType::F16, 2048, 64), DType::F16, &activations(2048)), Some((GEMV_F16W, 128)));
        assert_eq!(
            word_gemv(&plain(DType::BF16, 17408, 64), DType::BF16, &activations(17408)),
            Some((GEMV_BF16W_LONG, 448))
        );
        assert_eq!(word_gemv(&plain(DType::F16, 32768, 64), DType::F16, &activations(32768)), None);
        assert_eq!(word_gemv(&plain(DType::BF16, 5120, 64), DType::BF16, &activations(5120)), Some((GEMV_BF16W, 320)));
    }

    #[test]
    fn gemv_ring_keeps_two_stages_in_flight_below_4_tb_s() {
        // the peaks an H100 SXM and an H200 report (memory clock x bus width), and none
        assert_eq!(gemv_ring_stages(3_352_320_000_000), 3);
        assert_eq!(gemv_ring_stages(4_812_800_000_000), 4);
        assert_eq!(gemv_ring_stages(0), 3);
    }

    #[test]
    fn gemv_ring_plans_of_the_model_shapes_fit_and_give_nvfp4_two_rows_a_stage() {
        // (ring stages, opt-in shared memory, bulk copies): Hopper with either ring, Ampere (A100)
        // with 3
        for (stages, max_shared, bulk) in [(3, 232_448, true), (4, 232_448, true), (3, 166_912, false)] {
            for d in [DType::Q8_0, DType::NvFp4] {
                for (k, m) in [(5120, 17408), (17408, 5120), (2048, 6144)] {
                    let plan = gemv_ring_plan(&weights(d, k, m), d, &activations(k), max_shared, stages, bulk)
                        .unwrap_or_else(|| panic!("no plan for {d:?} k={k} stages={stages}"));
                    let (groups, rows_stage) = (plan.groups as usize, plan.rows_stage as usize);
                    assert_eq!(plan.stages, stages);
                    assert!(plan.shared as usize + GR_STATIC_SHARED <= max_shared, "{plan:?}");
                    let max = if d == DType::NvFp4 { GR_MAX_THREADS_NVFP4 } else { GR_MAX_THREADS };
                    let producer_warp = if plan.producer { 32 } else { 0 };
                    assert!(groups * k / 64 + producer_warp <= plan.threads as usize && plan.threads as usize <= max);
                    assert_eq!(plan.threads % 32, 0);
                    // a producer warp only for nvfp4 with bulk copies and the ring of 4, and only
                    // where it costs no group: the long rows of 272 units (2 groups, 544 + 32
                    // threads)
                    let producer = bulk && stages == 4 && d == DType::NvFp4 && k == 17408;
                    assert_eq!(plan.producer, producer, "{d:?} k={k} stages={stages}: {plan:?}");
                    assert_eq!(rows_stage % groups, 0, "{plan:?}");
                    if d == DType::NvFp4 && max_shared > 200_000 {
                        assert_eq!(rows_stage, 2 * groups, "{d:?} k={k}: {plan:?}");
                    }
                    if k == 5120 {
                        // nvfp4's 640 threads hold 8 groups of 80 units, q8_0's 576 hold 7
                        assert_eq!(groups, if d == DType::NvFp4 { 8 } else { 7 }, "{d:?}: {plan:?}");
                    }
                }
            }
        }
        // five tokens, or rows that are not contiguous: no plan
        let mut five = activations(5120);
        five.ne[1] = 5;
        assert!(gemv_ring_plan(&weights(DType::Q8_0, 5120, 64), DType::Q8_0, &five, 232_448, 3, true).is_none());
        let mut strided = weights(DType::Q8_0, 5120, 64);
        strided.nb[1] += 16;
        assert!(gemv_ring_plan(&strided, DType::Q8_0, &activations(5120), 232_448, 3, true).is_none());
    }

    #[test]
    fn two_token_ring_plans_fit_without_a_producer_and_stage_both_tokens() {
        for (stages, max_shared, bulk) in [(3, 232_448, true), (4, 232_448, true), (3, 166_912, false)] {
            for d in [DType::Q8_0, DType::NvFp4] {
                for (k, m) in [(2048, 8192), (4096, 2048), (5120, 17408), (2048, 512)] {
                    let mut b = activations(k);
                    b.ne[1] = 2;
                    let plan = gemv_ring_plan(&weights(d, k, m), d, &b, max_shared, stages, bulk)
                        .unwrap_or_else(|| panic!("no plan for {d:?} k={k} stages={stages}"));
                    assert_eq!((plan.tokens, plan.producer), (2, false), "{plan:?}");
                    assert!(plan.threads as usize <= GR_MAX_THREADS_T2, "{plan:?}");
                    assert!(plan.groups as usize * k / 64 <= plan.threads as usize, "{plan:?}");
                    assert!(plan.shared as usize + GR_STATIC_SHARED <= max_shared, "{plan:?}");
                    // both tokens' staged activations fit over the last stage and the partials
                    let stage = plan.rows_stage as usize * k / 64 * if d == DType::Q8_0 { 68 } else { 36 };
                    assert!(2 * k / 64 * GR_XSTRIDE <= plan.shared as usize - (stages - 1) * stage, "{plan:?}");
                }
            }
        }
    }

    #[test]
    fn three_and_four_token_ring_plans_fit_the_model_shapes_but_not_the_longest_rows() {
        for (stages, max_shared, bulk) in [(3, 232_448, true), (4, 232_448, true), (3, 166_912, false)] {
            for d in [DType::Q8_0, DType::NvFp4] {
                for (k, m) in [(2048, 8192), (4096, 2048), (5120, 17408), (2048, 512)] {
                    for n in [3, 4] {
                        let mut b = activations(k);
                        b.ne[1] = n as i64;
                        let plan = gemv_ring_plan(&weights(d, k, m), d, &b, max_shared, stages, bulk)
                            .unwrap_or_else(|| panic!("no plan for {d:?} k={k} n={n} stages={stages}"));
                        assert_eq!((plan.tokens, plan.producer), (n, false), "{plan:?}");
                        assert!(plan.threads as usize <= GR_MAX_THREADS_T4, "{plan:?}");
                        assert!(plan.groups as usize * k / 64 <= plan.threads as usize, "{plan:?}");
                        assert!(plan.shared as usize + GR_STATIC_SHARED <= max_shared, "{plan:?}");
                        let stage = plan.rows_stage as usize * k / 64 * if d == DType::Q8_0 { 68 } else { 36 };
                        assert!(n * k / 64 * GR_XSTRIDE <= plan.shared as usize - (stages - 1) * stage, "{plan:?}");
                    }
                }
                // three or four tokens' staged activations of 272 units (222 / 296 KB) fit no
                // device: the caller takes pairs
                for n in [3, 4] {
                    let mut b = activations(17408);
                    b.ne[1] = n;
                    assert!(gemv_ring_plan(&weights(d, 17408, 5120), d, &b, 232_448, stages, bulk).is_none());
                }
            }
        }
    }

    #[test]
    fn moe_ring_plans_of_the_model_shapes_fit_and_share_the_rows() {
        // experts [k, m, 256]; activations [k, n_x]; ids [n_used, tokens]
        let experts = |d: DType, k: usize, m: usize| {
            let mut w = weights(d, k, m);
            w.ne[2] = 256;
            w.nb[3] = w.nb[2] * 256;
            w
        };
        let rows = |k: usize, n: i64| TensorArg { ne: [k as i64, n, 1, 1], ..activations(k) };
        let ids =
            |n_used: i64, tokens: i64| TensorArg { data: 0, ne: [n_used, tokens, 1, 1], nb: [4, 4 * n_used, 0, 0] };
        let max_shared = 232_448;
        let hopper = DeviceInfo {
            ordinal: 0,
            name: "H200".into(),
            compute_capability: (9, 0),
            multiprocessors: 132,
            total_memory: 141 << 30,
            l2_bytes: 60 << 20,
            max_shared_per_block: max_shared,
            peak_memory_bandwidth: 4_812_800_000_000,
            nvrtc_version: (13, 0),
        };
        let ampere = DeviceInfo { compute_capability: (8, 0), ..hopper.clone() };
        for d in [DType::Q8_0, DType::NvFp4] {
            // qwen35moe's gate/up (2048 -> 512) and down (512 -> 2048), 8 routed + the shared expert
            for (mode, k, m, n_x) in
                [(MoeRingMode::Glu, 2048, 512, 1), (MoeRingMode::Id, 2048, 512, 1), (MoeRingMode::Sum, 512, 2048, 9)]
            {
                let plan = moe_ring_plan(&experts(d, k, m), d, &rows(k, n_x), &ids(9, 1), mode, &hopper)
                    .unwrap_or_else(|| panic!("no plan for {d:?} {mode:?}"));
                let (nu, groups, rs) = (k / 64, plan.groups as usize, plan.rows_stage as usize);
                let max = if d == DType::NvFp4 { GR_MAX_THREADS_NVFP4 } else { GR_MAX_THREADS };
                assert!(groups * nu <= plan.threads as usize && plan.threads as usize <= max, "{plan:?}");
                assert_eq!(plan.threads % 32, 0);
                assert!(plan.shared as usize + MR_STATIC_SHARED <= max_shared, "{plan:?}");
                assert_eq!(plan.blocks, 132);
                let out_rows = if mode == MoeRingMode::Sum { m } else { 9 * m };
                // nvfp4: a block's share of the rows is in flight at once (the stages in flight
                // hold it); q8_0's rows are too long for that
                if d == DType::NvFp4 {
                    assert!((MR_STAGES - 1) * rs >= out_rows.div_ceil(132), "{plan:?}");
                }
                // every group the same number of weight rows a stage
                match mode {
                    MoeRingMode::Id => assert_eq!(rs % groups, 0, "{plan:?}"),
                    MoeRingMode::Glu => assert_eq!(2 * rs % groups, 0, "{plan:?}"),
                    MoeRingMode::Sum => {
                        assert_eq!(groups % 9, 0, "{plan:?}");
                        assert_eq!(rs % (groups / 9), 0, "{plan:?}");
                    }
                }
            }
        }
        let (d, w) = (DType::NvFp4, experts(DType::NvFp4, 2048, 512));
        let plan = |b: &TensorArg, ids: &TensorArg, mode, dev: &DeviceInfo| moe_ring_plan(&w, d, b, ids, mode, dev);
        // two tokens, a slot's own activations outside `Sum`, more than MR_MAX_SLOTS slots, no
        // bulk copies (before sm_90): no plan
        assert!(plan(&rows(2048, 1), &ids(8, 2), MoeRingMode::Glu, &hopper).is_none());
        assert!(plan(&rows(2048, 8), &ids(8, 1), MoeRingMode::Glu, &hopper).is_none());
        assert!(plan(&rows(2048, 1), &ids(33, 1), MoeRingMode::Id, &hopper).is_none());
        assert!(plan(&rows(2048, 1), &ids(8, 1), MoeRingMode::Id, &ampere).is_none());
        assert!(plan(&rows(2048, 1), &ids(8, 1), MoeRingMode::Id, &hopper).is_some());
        // strided rows: no plan
        let mut strided = w;
        strided.nb[1] += 16;
        assert!(moe_ring_plan(&strided, d, &rows(2048, 1), &ids(8, 1), MoeRingMode::Id, &hopper).is_none());
    }
}
