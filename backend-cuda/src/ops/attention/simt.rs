//! flash_attn_ext's SIMT split-K kernel (`fa_partial_*`, kernels/attention.cu) and `fa_combine`,
//! which merges the split partials of it and of the decode kernel.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, TensorMeta};

use super::decode::DEC_TARGET_BLOCKS;
use super::{Optional, Plan, Tiling, Tokens, operands, rows_aligned, tile_plan};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config, dt};

const PARTIAL_ANY: Kernel = Kernel::new(Module::Attention, "fa_partial_any");
const PARTIAL_F32: Kernel = Kernel::new(Module::Attention, "fa_partial_f32");
const PARTIAL_F16: Kernel = Kernel::new(Module::Attention, "fa_partial_f16");
const PARTIAL_BF16: Kernel = Kernel::new(Module::Attention, "fa_partial_bf16");
const COMBINE: Kernel = Kernel::new(Module::Attention, "fa_combine");

/// TAG(fa-tile): FA_W and FA_R in attention.cu (FA_D: `MAX_D` in mod.rs).
const WARPS: u32 = 4;
const ROWS: usize = 8;
/// Blocks the split-K choice aims for (about one wave of 3 blocks per SM on an H100/H200;
/// fixed so that `scratch_bytes` can compute it from the task alone).
const TARGET_BLOCKS: usize = 384;
/// Fewest kv positions per split.
const MIN_SPLIT: usize = 128;
/// `fa_combine`'s threads a block, one output element each: a row's elements are spread over
/// d_v / 64 blocks, so that its partials are read through that many multiprocessors.
const COMBINE_THREADS: u32 = 64;
/// Most splits `fa_combine` merges: FC_SPLITS in attention.cu (TAG(fa-splits)). A plan's splits
/// never exceed its target block count.
const COMBINE_MAX_SPLITS: usize = 384;
const _: () = assert!(TARGET_BLOCKS <= COMBINE_MAX_SPLITS && DEC_TARGET_BLOCKS <= COMBINE_MAX_SPLITS);

const SIMT_TILING: Tiling = Tiling { rows: ROWS, target: TARGET_BLOCKS, min_split: MIN_SPLIT, align: 32 };

/// The SIMT kernel's geometry.
pub(super) fn plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>, tokens: Tokens) -> Plan {
    tile_plan(q, k, v, table, &SIMT_TILING, tokens)
}

/// The SIMT split-K kernel (and its combine).
pub(super) fn run_simt(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    tokens: Tokens,
) -> Result<(), BackendError> {
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (p, Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, table_meta }) = operands(task, ins)?;
    let pl = plan(meta(0), meta(1), meta(2), table_meta, tokens);
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
    let seq_stride = pl.seq_stride as i32;
    let (part, err, opcode) = (cx.scratch, cx.errors, crate::errors::op_code("flash_attn_ext"));
    let cfg = config((pl.tiles as u32, pl.splits as u32, pl.n_seq as u32), (WARPS * 32, 1, 1), 0);
    let mut a = cx.kernel(kernel)?;
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&offsets).arg(&kv_lens).arg(&out).arg(&gate);
    a.arg(&kdt).arg(&vdt).arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap);
    a.arg(&n_splits).arg(&split_len).arg(&hb).arg(&tb).arg(&h_blocks).arg(&t_blocks).arg(&seq_stride);
    a.arg(&part).arg(&err).arg(&opcode);
    // SAFETY: `fa_partial(q, k, v, mask, table, offsets, kv_lens, out, gate, kdt, vdt, mdt,
    // has_mask, paged, scale, softcap, n_splits, split_len, hb, tb, h_blocks, t_blocks,
    // seq_stride, part, err, opcode)`. The shape rules fix q [d_k, n_t, n_h, n_s] (n_s = 1
    // ragged), k/v [d, n_cells, n_h_kv, n_s or 1] with dense rows, the mask [n_kv, >= n_t, 1, 1
    // or n_s], the table [n_kv, n_s], offsets [n_s + 1] and kv_lens [n_s] (ragged; null data
    // otherwise), out [d_v, n_h, n_t, n_s] and the gate f32 of out's shape (null data ungated;
    // read only where out is written); `supports` keeps d_k, d_v <= 256 (the kernel's lane layout). The grid
    // is exactly tiles x splits x n_seq of `plan`; ragged blocks check every offset and kv length
    // before using one (and read positions below kv_lens[s] <= n_kv only); table entries are
    // checked against n_cells before any K/V read; the vector kernels run only on 16-byte aligned
    // rows of one dtype with dims multiple of 8; with n_splits > 1 `part` holds splits * rows *
    // (d_v + 2) f32 (`scratch_bytes`).
    unsafe { a.launch(cfg) }?;
    combine(cx, pl, q, offsets, kv_lens, out, gate)
}

/// Merges the split-K partials of `pl` into `out` (nothing with one split).
pub(super) fn combine(
    cx: &mut Cx<'_>,
    pl: Plan,
    q: TensorArg,
    offsets: TensorArg,
    kv_lens: TensorArg,
    out: TensorArg,
    gate: TensorArg,
) -> Result<(), BackendError> {
    if pl.splits > 1 {
        if pl.splits > COMBINE_MAX_SPLITS {
            let detail = format!("flash_attn_ext: {} splits, fa_combine merges {COMBINE_MAX_SPLITS}", pl.splits);
            return Err(BackendError::Device { backend: crate::errors::NAME.into(), detail });
        }
        let (part, n_splits, seq_stride) = (cx.scratch, pl.splits as i32, pl.seq_stride as i32);
        let (dv, n_tokens, n_head) = (pl.d_v as i32, q.ne[1] as i32, q.ne[2] as i32);
        let cfg = config((pl.rows as u32, (pl.d_v as u32).div_ceil(COMBINE_THREADS), 1), (COMBINE_THREADS, 1, 1), 0);
        let mut a = cx.kernel(COMBINE)?;
        a.arg(&part).arg(&out).arg(&gate).arg(&offsets).arg(&kv_lens).arg(&seq_stride);
        a.arg(&n_splits).arg(&dv).arg(&n_tokens).arg(&n_head);
        // SAFETY: `fa_combine(part, out, gate, offsets, kv_lens, seq_stride, n_splits, dv,
        // n_tokens, n_head)`: blocks (row, element group) over every output row and d_v elements
        // (threads past d_v write nothing; the gate, when not null, of out's shape);
        // n_splits <= FC_SPLITS (checked above); `part` holds n_splits * rows partials of d_v + 2
        // floats, all written above for the rows it merges (with a ragged batch tiled by sequence
        // it skips the rows of other launches, finding a row's sequence within offsets [n_seq + 1]).
        unsafe { a.launch(cfg) }?;
    }
    Ok(())
}
