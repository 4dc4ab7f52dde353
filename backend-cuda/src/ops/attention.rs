//! flash_attn_ext: `kernels/attention.cu`.
//!
//! `fa_partial_*` runs a tile of query rows (heads of one kv group times tokens) over one range
//! of kv positions; long contexts are split over several blocks (split-K), whose partial
//! (max, sum, acc) rows go to scratch and are merged by `fa_combine`. The `_f32/_f16/_bf16`
//! entries read K/V rows with 16-byte loads (same K/V dtype, head dims multiples of 8, rows
//! 16-byte aligned); `fa_partial_any` takes any K/V dtypes and alignments.
//!
//! Prefills (at least [`MMA_MIN_TOKENS`] tokens) with f16/bf16 K/V and d_k = d_v = 128 or 256
//! run on tensor cores instead (`fa_mma_*`: mma.sync m16n8k16, 64 tokens of one head per block);
//! so do decodes and small prefills with such K/V (`fa_dec_*`: a kv group's query rows as the 16
//! M rows, K/V chunks copied to shared memory with cp.async, split-K merged by `fa_combine`).

use cudarc::driver::PushKernelArg;
use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, FlashAttnParams, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config, dt, launch_error, unsupported};

const PARTIAL_ANY: Kernel = Kernel::new(Module::Attention, "fa_partial_any");
const PARTIAL_F32: Kernel = Kernel::new(Module::Attention, "fa_partial_f32");
const PARTIAL_F16: Kernel = Kernel::new(Module::Attention, "fa_partial_f16");
const PARTIAL_BF16: Kernel = Kernel::new(Module::Attention, "fa_partial_bf16");
const COMBINE: Kernel = Kernel::new(Module::Attention, "fa_combine");
const MMA_F16_D128: Kernel = Kernel::new(Module::Attention, "fa_mma_f16_d128");
const MMA_F16_D256: Kernel = Kernel::new(Module::Attention, "fa_mma_f16_d256");
const MMA_BF16_D128: Kernel = Kernel::new(Module::Attention, "fa_mma_bf16_d128");
const MMA_BF16_D256: Kernel = Kernel::new(Module::Attention, "fa_mma_bf16_d256");
const DEC_F16_D128: Kernel = Kernel::new(Module::Attention, "fa_dec_f16_d128");
const DEC_F16_D256: Kernel = Kernel::new(Module::Attention, "fa_dec_f16_d256");
const DEC_BF16_D128: Kernel = Kernel::new(Module::Attention, "fa_dec_bf16_d128");
const DEC_BF16_D256: Kernel = Kernel::new(Module::Attention, "fa_dec_bf16_d256");

/// TAG(fa-tile): FA_W, FA_R and FA_D in attention.cu.
const WARPS: u32 = 4;
const ROWS: usize = 8;
const MAX_D: usize = 256;
/// Blocks the split-K choice aims for (about one wave of 3 blocks per SM on an H100/H200;
/// fixed so that `scratch_bytes` can compute it from the task alone).
const TARGET_BLOCKS: usize = 384;
/// Fewest kv positions per split.
const MIN_SPLIT: usize = 128;
const COMBINE_THREADS: u32 = 256;
/// TAG(fa-mma-tile): FT_BM, FT_BN and FT_PAD in attention.cu.
const MMA_BM: usize = 64;
const MMA_BN: usize = 64;
const MMA_PAD: usize = 8;
/// TAG(fa-dec-tile): FD_W, FD_S and FD_N in attention.cu (query rows per block: one mma M tile).
const DEC_WARPS: u32 = 4;
const DEC_STAGES: usize = 2;
const DEC_CHUNK: usize = 16;
const DEC_ROWS: usize = 16;
/// Blocks the decode kernel's split-K choice aims for: one per SM of an H100/H200 (at d 256 a
/// block takes 140 KiB of shared memory; fixed so that `scratch_bytes` can compute it from the
/// task alone).
const DEC_TARGET_BLOCKS: usize = 132;
/// Fewest query tokens for the tensor-core prefill kernel (below it the split-K kernels, which
/// share each K/V row between a kv group's heads, win).
const MMA_MIN_TOKENS: usize = 4;

/// The launch geometry of one task.
#[derive(Debug, Clone, Copy)]
struct Plan {
    hb: usize,
    tb: usize,
    h_blocks: usize,
    t_blocks: usize,
    tiles: usize,
    splits: usize,
    split_len: usize,
    n_seq: usize,
    /// Output rows (n_head * n_tokens * n_seq).
    rows: usize,
    d_v: usize,
}

/// A kernel's tiling rules: tiles of up to `rows` query rows (heads of one kv group times
/// tokens), and a split-K over the kv positions that brings tiles x splits x sequences up to at
/// most `target` blocks, with splits of at least `min_split` positions, multiples of `align`.
#[derive(Clone, Copy)]
struct Tiling {
    rows: usize,
    target: usize,
    min_split: usize,
    align: usize,
}

const SIMT_TILING: Tiling = Tiling { rows: ROWS, target: TARGET_BLOCKS, min_split: MIN_SPLIT, align: 32 };
/// 16-row tiles (one mma M tile), splits that are multiples of a block's chunks.
const DEC_TILING: Tiling = Tiling {
    rows: DEC_ROWS,
    target: DEC_TARGET_BLOCKS,
    min_split: DEC_WARPS as usize * DEC_CHUNK,
    align: DEC_WARPS as usize * DEC_CHUNK,
};

fn plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>) -> Plan {
    tile_plan(q, k, v, table, &SIMT_TILING)
}

/// The decode kernel's geometry.
fn dec_plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>) -> Plan {
    tile_plan(q, k, v, table, &DEC_TILING)
}

fn tile_plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>, t: &Tiling) -> Plan {
    let Tiling { rows, target, min_split, align } = *t;
    let [_, n_tokens, n_head, n_seq] = q.ne;
    let n_head_kv = k.ne[2].max(1);
    let n_kv = table.map_or(k.ne[1], |t| t.ne[0]);
    let group = (n_head / n_head_kv).max(1);
    let hb = group.min(rows);
    let tb = (rows / hb).clamp(1, n_tokens.max(1));
    let h_blocks = group.div_ceil(hb);
    let t_blocks = n_tokens.div_ceil(tb);
    let tiles = n_head_kv * h_blocks * t_blocks;
    let base = (tiles * n_seq).max(1);
    let want = (target / base).clamp(1, n_kv.div_ceil(min_split).max(1));
    let split_len = n_kv.div_ceil(want).div_ceil(align).max(1) * align;
    let splits = n_kv.div_ceil(split_len).max(1);
    Plan { hb, tb, h_blocks, t_blocks, tiles, splits, split_len, n_seq, rows: n_head * n_tokens * n_seq, d_v: v.ne[0] }
}

/// Head dims up to 256 and grid dimensions in range; anything else stays on the CPU.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    let Op::FlashAttnExt(p) = op else { return false };
    let [q, k, v, ..] = inputs else { return false };
    let table = if p.paged { inputs.last() } else { None };
    let pl = plan(q, k, v, table);
    q.ne[0] <= MAX_D
        && v.ne[0] <= MAX_D
        && q.dtype == DType::F32
        && [k, v].iter().all(|m| matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16))
        && pl.n_seq <= 65535
        && pl.splits <= 65535
        && pl.tiles < (1 << 31)
        && k.ne[1] < (1 << 31)
        && table.is_none_or(|t| t.ne[0] < (1 << 31))
}

/// Split-K partials: (max, sum, acc[d_v]) f32 per split and output row.
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let Op::FlashAttnExt(p) = task.op else { return 0 };
    let m: Vec<&TensorMeta> = task.inputs.iter().map(|t| &t.meta).collect();
    let [q, k, v, ..] = m.as_slice() else { return 0 };
    let table = if p.paged { m.last().copied() } else { None };
    // The decode kernel's choice depends on alignment (unknown here): room for either plan.
    [plan(q, k, v, table), dec_plan(q, k, v, table)]
        .iter()
        .map(|pl| if pl.splits == 1 { 0 } else { pl.splits * pl.rows * (pl.d_v + 2) * 4 })
        .max()
        .unwrap_or(0)
}

/// Whether a tensor's rows (at dims 1..3 offsets) all start 16-byte aligned.
fn rows_aligned(t: &TensorArg) -> bool {
    t.data.is_multiple_of(16) && t.nb[1..].iter().all(|&n| n % 16 == 0)
}

/// The tensor-core kernel for these K/V, if it applies: one f16/bf16 dtype, d_k = d_v = 128 or
/// 256, 16-byte aligned rows, enough tokens, sm_80 or newer.
fn mma_kernel(
    cx: &Cx<'_>,
    q: &TensorArg,
    k: &TensorArg,
    v: &TensorArg,
    kdt: DType,
    vdt: DType,
) -> Option<(Kernel, u32)> {
    let d = q.ne[0];
    if kdt != vdt
        || d != v.ne[0]
        || (q.ne[1] as usize) < MMA_MIN_TOKENS
        || q.ne[2] > 65535
        || cx.info.compute_capability < (8, 0)
    {
        return None;
    }
    if !(rows_aligned(k) && rows_aligned(v)) {
        return None;
    }
    let kernel = match (kdt, d) {
        (DType::F16, 128) => MMA_F16_D128,
        (DType::F16, 256) => MMA_F16_D256,
        (DType::BF16, 128) => MMA_BF16_D128,
        (DType::BF16, 256) => MMA_BF16_D256,
        _ => return None,
    };
    let shared = (MMA_BM + 2 * MMA_BN) * (d as usize + MMA_PAD) * 2;
    (shared <= cx.info.max_shared_per_block).then_some((kernel, shared as u32))
}

/// The tensor-core decode kernel for these K/V, if it applies: one f16/bf16 dtype, d_k = d_v =
/// 128 or 256, 16-byte aligned rows, fewer tokens than the prefill kernel takes, sm_80 or newer.
fn dec_kernel(
    cx: &Cx<'_>,
    q: &TensorArg,
    k: &TensorArg,
    v: &TensorArg,
    kdt: DType,
    vdt: DType,
) -> Option<(Kernel, u32)> {
    let d = q.ne[0];
    if kdt != vdt
        || d != v.ne[0]
        || (q.ne[1] as usize) >= MMA_MIN_TOKENS
        || cx.info.compute_capability < (8, 0)
        || !(rows_aligned(k) && rows_aligned(v))
    {
        return None;
    }
    let kernel = match (kdt, d) {
        (DType::F16, 128) => DEC_F16_D128,
        (DType::F16, 256) => DEC_F16_D256,
        (DType::BF16, 128) => DEC_BF16_D128,
        (DType::BF16, 256) => DEC_BF16_D256,
        _ => return None,
    };
    let row = (d as usize + MMA_PAD) * 2;
    let shared = (DEC_WARPS as usize * DEC_STAGES * 2 * DEC_CHUNK + DEC_ROWS) * row;
    (shared <= cx.info.max_shared_per_block).then_some((kernel, shared as u32))
}

/// The optional operands of a flash_attn_ext task as every kernel takes them: the mask and the
/// block table (an empty descriptor when absent), the mask's dtype code, and the table's
/// descriptor for planning.
struct Optional<'t> {
    mask: TensorArg,
    table: TensorArg,
    mask_dt: i32,
    table_meta: Option<&'t TensorMeta>,
}

fn optional_operands<'t>(p: &FlashAttnParams, task: &'t Task<'_>, ins: &[TensorArg]) -> Optional<'t> {
    let none = TensorArg { data: 0, ne: [1; 4], nb: [0; 4] };
    let table_at = 3 + usize::from(p.mask);
    Optional {
        mask: if p.mask { ins[3] } else { none },
        table: if p.paged { ins[table_at] } else { none },
        mask_dt: dt(if p.mask { task.inputs[3].meta.dtype } else { DType::F32 }),
        table_meta: p.paged.then(|| &task.inputs[table_at].meta),
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let (kdt, vdt) = (task.inputs[1].meta.dtype, task.inputs[2].meta.dtype);
    if let Some((kernel, shared)) = mma_kernel(cx, &ins[0], &ins[1], &ins[2], kdt, vdt) {
        return run_mma(cx, task, ins, out, kernel, shared);
    }
    if let Some((kernel, shared)) = dec_kernel(cx, &ins[0], &ins[1], &ins[2], kdt, vdt) {
        return run_dec(cx, task, ins, out, kernel, shared);
    }
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, mask_dt: mdt, table_meta } = optional_operands(p, task, ins);
    let pl = plan(meta(0), meta(1), meta(2), table_meta);
    let (kdt, vdt) = (meta(1).dtype, meta(2).dtype);
    let vec = kdt == vdt && q.ne[0] % 8 == 0 && v.ne[0] % 8 == 0 && rows_aligned(&k) && rows_aligned(&v);
    let kernel = match (vec, kdt) {
        (true, DType::F32) => PARTIAL_F32,
        (true, DType::F16) => PARTIAL_F16,
        (true, DType::BF16) => PARTIAL_BF16,
        _ => PARTIAL_ANY,
    };
    let (kdt, vdt) = (dt(kdt), dt(vdt));
    let (has_mask, paged) = (i32::from(p.mask), i32::from(p.paged));
    let (scale, softcap) = (p.scale, p.softcap);
    let (n_splits, split_len) = (pl.splits as i32, pl.split_len as i32);
    let (hb, tb, h_blocks, t_blocks) = (pl.hb as i32, pl.tb as i32, pl.h_blocks as i32, pl.t_blocks as i32);
    let (part, err, opcode) = (cx.scratch, cx.errors, crate::errors::op_code("flash_attn_ext"));
    let f = cx.function(kernel)?;
    let cfg = config((pl.tiles as u32, pl.splits as u32, pl.n_seq as u32), (WARPS * 32, 1, 1), 0);
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&out);
    a.arg(&kdt).arg(&vdt).arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap);
    a.arg(&n_splits).arg(&split_len).arg(&hb).arg(&tb).arg(&h_blocks).arg(&t_blocks);
    a.arg(&part).arg(&err).arg(&opcode);
    // SAFETY: `fa_partial(q, k, v, mask, table, out, kdt, vdt, mdt, has_mask, paged, scale,
    // softcap, n_splits, split_len, hb, tb, h_blocks, t_blocks, part, err, opcode)`. The shape
    // rules fix q [d_k, n_t, n_h, n_s], k/v [d, n_cells, n_h_kv, n_s or 1] with dense rows, the
    // mask [n_kv, >= n_t, 1, 1 or n_s], the table [n_kv, n_s] and out [d_v, n_h, n_t, n_s];
    // `supports` keeps d_k, d_v <= 256 (the kernel's lane layout). The grid is exactly tiles x
    // splits x n_seq of `plan`; table entries are checked against n_cells before any K/V read;
    // the vector kernels run only on 16-byte aligned rows of one dtype with dims multiple of 8;
    // with n_splits > 1 `part` holds splits * rows * (d_v + 2) f32 (`scratch_bytes`).
    unsafe { a.launch(cfg) }.map_err(|e| launch_error(kernel, e))?;
    combine(cx, pl, q, out)
}

/// Merges the split-K partials of `pl` into `out` (nothing with one split).
fn combine(cx: &mut Cx<'_>, pl: Plan, q: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    if pl.splits > 1 {
        let (part, n_splits) = (cx.scratch, pl.splits as i32);
        let f = cx.function(COMBINE)?;
        let (dv, n_tokens, n_head) = (pl.d_v as i32, q.ne[1] as i32, q.ne[2] as i32);
        let cfg = config((pl.rows as u32, 1, 1), (COMBINE_THREADS, 1, 1), 0);
        let mut a = cx.stream.launch_builder(&f);
        a.arg(&part).arg(&out).arg(&n_splits).arg(&dv).arg(&n_tokens).arg(&n_head);
        // SAFETY: `fa_combine(part, out, n_splits, dv, n_tokens, n_head)`: one block per output
        // row; `part` holds n_splits * rows partials of d_v + 2 floats, all written above.
        unsafe { a.launch(cfg) }.map_err(|e| launch_error(COMBINE, e))?;
    }
    Ok(())
}

/// The tensor-core prefill: one block per 64 tokens of one query head of one sequence.
fn run_mma(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    kernel: Kernel,
    shared: u32,
) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, mask_dt: mdt, .. } = optional_operands(p, task, ins);
    let (has_mask, paged) = (i32::from(p.mask), i32::from(p.paged));
    let (scale, softcap) = (p.scale, p.softcap);
    let (err, opcode) = (cx.errors, crate::errors::op_code("flash_attn_ext"));
    cx.allow_shared(kernel, shared)?;
    let f = cx.function(kernel)?;
    let grid = ((q.ne[1] as usize).div_ceil(MMA_BM) as u32, q.ne[2] as u32, q.ne[3] as u32);
    let cfg = config(grid, (128, 1, 1), shared);
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&out);
    a.arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap).arg(&err).arg(&opcode);
    // SAFETY: `fa_mma(q, k, v, mask, table, out, mdt, has_mask, paged, scale, softcap, err,
    // opcode)`: shapes as for `fa_partial` (shape rules); `mma_kernel` checked one f16/bf16 dtype,
    // d_k = d_v = the kernel's D and 16-byte aligned rows (its uint4 loads); `shared` is the
    // kernel's 3 * 64 * (D + 8) halves and within the device limit (raised above); the grid
    // covers ceil(n_tokens / 64) x n_head x n_seq and rows past n_tokens are not written; table
    // entries are checked before any K/V read.
    unsafe { a.launch(cfg) }.map_err(|e| launch_error(kernel, e))?;
    Ok(())
}

/// The tensor-core decode: one block per 16-row tile of a kv group, split and sequence.
fn run_dec(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    kernel: Kernel,
    shared: u32,
) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, mask_dt: mdt, table_meta } = optional_operands(p, task, ins);
    let pl = dec_plan(meta(0), meta(1), meta(2), table_meta);
    let (has_mask, paged) = (i32::from(p.mask), i32::from(p.paged));
    let (scale, softcap, split_len) = (p.scale, p.softcap, pl.split_len as i32);
    let (hb, tb, h_blocks, t_blocks) = (pl.hb as i32, pl.tb as i32, pl.h_blocks as i32, pl.t_blocks as i32);
    let (part, err, opcode) = (cx.scratch, cx.errors, crate::errors::op_code("flash_attn_ext"));
    cx.allow_shared(kernel, shared)?;
    let f = cx.function(kernel)?;
    let cfg = config((pl.tiles as u32, pl.splits as u32, pl.n_seq as u32), (DEC_WARPS * 32, 1, 1), shared);
    let mut a = cx.stream.launch_builder(&f);
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&out);
    a.arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap);
    a.arg(&split_len).arg(&hb).arg(&tb).arg(&h_blocks).arg(&t_blocks);
    a.arg(&part).arg(&err).arg(&opcode);
    // SAFETY: `fa_dec(q, k, v, mask, table, out, mdt, has_mask, paged, scale, softcap, split_len,
    // hb, tb, h_blocks, t_blocks, part, err, opcode)`: shapes as for `fa_partial` (shape rules);
    // `dec_kernel` checked one f16/bf16 dtype, d_k = d_v = the kernel's D and 16-byte aligned rows
    // (its 16-byte cp.async copies); `shared` is the kernel's (FD_W * FD_S * 2 * 16 + 16) rows of
    // D + 8 halves, within the device limit (raised above); the grid is exactly tiles x splits x
    // n_seq of `dec_plan`, whose tiles hold at most 16 rows (hb * tb <= 16); table entries are
    // checked against n_cells before any K/V read; with splits > 1 `part` holds
    // splits * rows * (d_v + 2) f32 (`scratch_bytes` takes the larger of both plans).
    unsafe { a.launch(cfg) }.map_err(|e| launch_error(kernel, e))?;
    combine(cx, pl, q, out)
}
