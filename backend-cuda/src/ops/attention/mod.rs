//! flash_attn_ext: `kernels/attention.cu` (SIMT and combine), `attention_prefill.cu` and
//! `attention_decode.cu` (tensor cores), sharing `attention.cuh`; their launches in [`simt`],
//! [`prefill`] and [`decode`], and here what they share: the tiling of query rows and kv
//! splits, the choice of kernels for a task, and the ragged plan.
//!
//! `fa_partial_*` runs a tile of query rows (heads of one kv group times tokens) over one range
//! of kv positions; long contexts are split over several blocks (split-K), whose partial
//! (max, sum, acc) rows go to scratch and are merged by `fa_combine`. The `_f32/_f16/_bf16`
//! entries read K/V rows with 16-byte loads (same K/V dtype, head dims multiples of 8, rows
//! 16-byte aligned); `fa_partial_any` takes any K/V dtypes and alignments.
//!
//! Prefills (at least [`MMA_MIN_TOKENS`] tokens) with f16/bf16 K/V and d_k = d_v = 128 or 256
//! run on tensor cores instead (`fa_mma_*`: 64 tokens of one head per block; on sm_90a two warp
//! groups on wgmma, each taking half of the kv tiles, or `fa_mma_pair_*`: the same 64 tokens of
//! two heads of one kv head, sharing the K/V tiles; elsewhere four warps on mma.sync m16n8k16);
//! so do decodes and small prefills with such K/V (`fa_dec_*`: a kv group's query rows as the 8
//! N columns of transposed products, K/V chunks copied to shared memory with cp.async, split-K
//! merged by `fa_combine`, or on sm_90+, for 2-8 splits, by the splits themselves as one cluster
//! of blocks: `fa_dec_x{2,4,8}_*`, see `decode::dec_cluster`).
//!
//! Ragged batches (`params.ragged`) run on the same kernels with other tilings, picked from the
//! shapes alone (the offsets are device values that change under a replayed CUDA graph; nothing
//! is read back): one token per split-K tile (packed token `t`, or token `i` of sequence `s` for
//! the short sequences), 64 tokens of one sequence per tensor-core prefill tile. See
//! [`RaggedPlan`] for which launches a batch gets.

mod decode;
mod prefill;
mod simt;

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, FlashAttnParams, Op, TensorMeta};

use crate::launch::{Cx, TensorArg, dt, unsupported};
use decode::{dec_kernel, dec_plan, run_dec};
use prefill::{mma_kernel, run_mma};
use simt::{plan, run_simt};

/// Largest head dim (d_k and d_v) any kernel takes: TAG(fa-tile), FA_D in attention.cu.
const MAX_D: usize = 256;
/// Halves after each K/V row the tensor-core kernels stage in shared memory, so that ldmatrix's
/// 8 rows meet 8 bank groups (FT_PAD in attention.cuh; TAG(fa-mma-tile)).
const ROW_PAD: usize = 8;

/// Fewest query tokens for the tensor-core prefill kernel (below it the split-K kernels, which
/// share each K/V row between a kv group's heads, win). In a ragged batch that runs both, the
/// decode kernel takes the sequences of fewer tokens.
const MMA_MIN_TOKENS: usize = 4;

/// How a split-K launch lays out query tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tokens {
    /// Up to `rows / hb` consecutive tokens of one sequence per tile, sequences on the grid's z.
    Dense,
    /// A ragged batch, one token per tile: `slots` tile slots per (kv head, head block), packed
    /// token `t` when `seq_stride == 0`, else token `i < seq_stride` of sequence `s` at slot
    /// `s * seq_stride + i` (`fa_ragged_token` / `fa_ragged_local` in attention.cuh).
    Ragged { slots: usize, seq_stride: usize },
}

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
    seq_stride: usize,
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

fn tile_plan(
    q: &TensorMeta,
    k: &TensorMeta,
    v: &TensorMeta,
    table: Option<&TensorMeta>,
    t: &Tiling,
    tokens: Tokens,
) -> Plan {
    let Tiling { rows, target, min_split, align } = *t;
    let [_, n_tokens, n_head, q_seq] = q.ne;
    let n_head_kv = k.ne[2].max(1);
    let n_kv = table.map_or(k.ne[1], |t| t.ne[0]);
    let group = (n_head / n_head_kv).max(1);
    let hb = group.min(rows);
    let (tb, t_blocks, n_seq, seq_stride) = match tokens {
        Tokens::Dense => {
            let tb = (rows / hb).clamp(1, n_tokens.max(1));
            (tb, n_tokens.div_ceil(tb), q_seq, 0)
        }
        Tokens::Ragged { slots, seq_stride } => (1, slots.max(1), 1, seq_stride),
    };
    let h_blocks = group.div_ceil(hb);
    let tiles = n_head_kv * h_blocks * t_blocks;
    // Split for the tiles that work: all of them, except that a ragged launch over the short
    // sequences counts on about one token per sequence (its other slots are mostly idle).
    let working = tiles.checked_div(seq_stride).unwrap_or(tiles);
    let base = (working * n_seq).max(1);
    let want = (target / base).clamp(1, n_kv.div_ceil(min_split).max(1));
    let split_len = n_kv.div_ceil(want).div_ceil(align).max(1) * align;
    let splits = n_kv.div_ceil(split_len).max(1);
    let rows = n_head * n_tokens * q_seq;
    Plan { hb, tb, h_blocks, t_blocks, tiles, splits, split_len, n_seq, rows, d_v: v.ne[0], seq_stride }
}

/// The launches of a ragged task, chosen from its shapes alone (any offsets must run correctly
/// on them; the choice only decides what is fast). Decode-like batches (`n_tokens < 2 n_seq`)
/// run the split-K kernel alone, one packed token per tile, exactly the grid of the dense decode
/// of that many sequences; a single sequence with enough tokens runs the tensor-core prefill
/// alone; other batches run both, the decode kernel over the sequences of fewer than
/// [`MMA_MIN_TOKENS`] tokens (slot `s * 3 + i`) and the prefill kernel over the rest (and the
/// padding). Without the tensor-core kernels (f32 or mixed K/V, other head dims, unaligned rows)
/// the SIMT split-K kernel runs alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RaggedPlan {
    /// The split-K launch's token layout, if there is one.
    split: Option<Tokens>,
    /// The tensor-core prefill's fewest tokens per sequence, if it runs.
    mma_min: Option<usize>,
}

fn ragged_plan(n_tokens: usize, n_seq: usize, tensor_cores: bool) -> RaggedPlan {
    let flat = Tokens::Ragged { slots: n_tokens, seq_stride: 0 };
    if !tensor_cores || n_tokens < MMA_MIN_TOKENS || n_tokens < 2 * n_seq {
        return RaggedPlan { split: Some(flat), mma_min: None };
    }
    if n_seq == 1 {
        return RaggedPlan { split: None, mma_min: Some(1) };
    }
    let short = MMA_MIN_TOKENS - 1;
    RaggedPlan {
        split: Some(Tokens::Ragged { slots: n_seq * short, seq_stride: short }),
        mma_min: Some(MMA_MIN_TOKENS),
    }
}

/// The (seq_offsets, kv_lens) inputs of a ragged task.
fn ragged_inputs<'t>(p: &FlashAttnParams, inputs: &'t [TensorMeta]) -> Option<(&'t TensorMeta, &'t TensorMeta)> {
    let at = p.inputs().ragged?;
    Some((inputs.get(at)?, inputs.get(at + 1)?))
}

/// Head dims up to 256 and grid dimensions in range; anything else stays on the CPU.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    let Op::FlashAttnExt(p) = op else { return false };
    let [q, k, v, ..] = inputs else { return false };
    let table = p.inputs().table.and_then(|i| inputs.get(i));
    let tokens = if p.ragged { Tokens::Ragged { slots: q.ne[1], seq_stride: 0 } } else { Tokens::Dense };
    let pl = plan(q, k, v, table, tokens);
    let n_seq = ragged_inputs(p, inputs).map_or(q.ne[3], |(o, _)| o.ne[0].saturating_sub(1));
    q.ne[0] <= MAX_D
        && v.ne[0] <= MAX_D
        && q.dtype == DType::F32
        && [k, v].iter().all(|m| matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16))
        && pl.n_seq <= 65535
        && pl.splits <= 65535
        && pl.tiles < (1 << 31)
        && n_seq < (1 << 24)
        && q.ne[1] < (1 << 31)
        && k.ne[1] < (1 << 31)
        && table.is_none_or(|t| t.ne[0] < (1 << 31))
}

/// Split-K partials: (max, sum, acc\[d_v\]) f32 per split and output row.
pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let Op::FlashAttnExt(p) = task.op else { return 0 };
    let m: Vec<TensorMeta> = task.inputs.iter().map(|t| t.meta).collect();
    let [q, k, v, ..] = m.as_slice() else { return 0 };
    let table = p.inputs().table.and_then(|i| m.get(i));
    // The kernels' choice depends on alignment (unknown here): room for every plan that may run.
    let plans = match ragged_inputs(p, &m) {
        None => vec![plan(q, k, v, table, Tokens::Dense), dec_plan(q, k, v, table, Tokens::Dense)],
        Some((offsets, _)) => {
            let n_seq = offsets.ne[0].saturating_sub(1);
            let flat = Tokens::Ragged { slots: q.ne[1], seq_stride: 0 };
            let mut plans = vec![plan(q, k, v, table, flat), dec_plan(q, k, v, table, flat)];
            if let Some(tokens) = ragged_plan(q.ne[1], n_seq, true).split {
                plans.push(dec_plan(q, k, v, table, tokens));
            }
            plans
        }
    };
    plans.iter().map(|pl| if pl.splits == 1 { 0 } else { pl.splits * pl.rows * (pl.d_v + 2) * 4 }).max().unwrap_or(0)
}

/// Whether a tensor's rows (at dims 1..3 offsets) all start 16-byte aligned.
fn rows_aligned(t: &TensorArg) -> bool {
    t.data.is_multiple_of(16) && t.nb[1..].iter().all(|&n| n % 16 == 0)
}

/// The tensor-core kernels' common conditions: one f16/bf16 dtype, d_k = d_v = 128 or 256,
/// 16-byte aligned rows, sm_80 or newer. Returns the head dim.
fn tensor_core_dims(cx: &Cx<'_>, q: &TensorArg, k: &TensorArg, v: &TensorArg, kdt: DType, vdt: DType) -> Option<usize> {
    let d = q.ne[0];
    let ok = kdt == vdt
        && matches!(kdt, DType::F16 | DType::BF16)
        && d == v.ne[0]
        && (d == 128 || d == 256)
        && cx.info.compute_capability >= (8, 0)
        && rows_aligned(k)
        && rows_aligned(v);
    ok.then_some(d as usize)
}

/// The optional operands of a flash_attn_ext task as every kernel takes them: the mask, the
/// block table, the ragged offsets and kv lengths and the gate (an empty descriptor, null data,
/// when absent: the kernels' dense, ungated layout), the mask's dtype code, and the table's
/// descriptor for planning; with the op's params (`operands`).
struct Optional<'t> {
    mask: TensorArg,
    table: TensorArg,
    offsets: TensorArg,
    kv_lens: TensorArg,
    gate: TensorArg,
    mask_dt: i32,
    table_meta: Option<&'t TensorMeta>,
}

/// A flash_attn_ext task's params and [`Optional`] operands: every launch's first step.
fn operands<'t>(task: &'t Task<'_>, ins: &[TensorArg]) -> Result<(&'t FlashAttnParams, Optional<'t>), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    Ok((p, optional_operands(p, task, ins)))
}

fn optional_operands<'t>(p: &FlashAttnParams, task: &'t Task<'_>, ins: &[TensorArg]) -> Optional<'t> {
    let none = TensorArg { data: 0, ne: [1; 4], nb: [0; 4] };
    let at = p.inputs();
    let arg = |i: Option<usize>| i.map_or(none, |i| ins[i]);
    Optional {
        mask: arg(at.mask),
        table: arg(at.table),
        offsets: arg(at.ragged),
        kv_lens: arg(at.ragged.map(|i| i + 1)),
        gate: arg(at.gate),
        mask_dt: dt(at.mask.map_or(DType::F32, |i| task.inputs[i].meta.dtype)),
        table_meta: at.table.map(|i| &task.inputs[i].meta),
    }
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let (kdt, vdt) = (task.inputs[1].meta.dtype, task.inputs[2].meta.dtype);
    let (q, k, v) = (&ins[0], &ins[1], &ins[2]);
    if p.ragged {
        return run_ragged(cx, task, ins, out);
    }
    if (q.ne[1] as usize) >= MMA_MIN_TOKENS
        && let Some(launch) = mma_kernel(cx, q, k, v, kdt, vdt)
    {
        return run_mma(cx, task, ins, out, launch, 0);
    }
    if (q.ne[1] as usize) < MMA_MIN_TOKENS
        && let Some((entry, shared)) = dec_kernel(cx, q, k, v, kdt, vdt)
    {
        return run_dec(cx, task, ins, out, entry, shared, Tokens::Dense);
    }
    run_simt(cx, task, ins, out, Tokens::Dense)
}

/// A ragged task: the launches of [`ragged_plan`], the split-K one (and its combine) first.
fn run_ragged(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let (kdt, vdt) = (task.inputs[1].meta.dtype, task.inputs[2].meta.dtype);
    let (q, k, v) = (&ins[0], &ins[1], &ins[2]);
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let n_seq = p.inputs().ragged.map_or(0, |i| (ins[i].ne[0] as usize).saturating_sub(1));
    let (mma, dec) = (mma_kernel(cx, q, k, v, kdt, vdt), dec_kernel(cx, q, k, v, kdt, vdt));
    let tensor_cores = mma.is_some() && dec.is_some();
    let rp = ragged_plan(q.ne[1] as usize, n_seq, tensor_cores);
    if let Some(tokens) = rp.split {
        match dec {
            Some((entry, shared)) if tensor_cores => run_dec(cx, task, ins, out, entry, shared, tokens)?,
            _ => run_simt(cx, task, ins, out, tokens)?,
        }
    }
    if let (Some(min_len), Some(launch)) = (rp.mma_min, mma) {
        run_mma(cx, task, ins, out, launch, min_len)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_launches_follow_the_shapes() {
        let flat = |n| Some(Tokens::Ragged { slots: n, seq_stride: 0 });
        // decode-like batches: the split-K kernel alone, one tile slot per packed token
        assert_eq!(ragged_plan(32, 32, true), RaggedPlan { split: flat(32), mma_min: None });
        assert_eq!(ragged_plan(3, 1, true), RaggedPlan { split: flat(3), mma_min: None });
        assert_eq!(ragged_plan(63, 32, true), RaggedPlan { split: flat(63), mma_min: None });
        // one sequence: the prefill kernel alone
        assert_eq!(ragged_plan(512, 1, true), RaggedPlan { split: None, mma_min: Some(1) });
        // a mix: short sequences on the decode kernel, the rest on the prefill kernel
        let both = RaggedPlan { split: Some(Tokens::Ragged { slots: 96, seq_stride: 3 }), mma_min: Some(4) };
        assert_eq!(ragged_plan(331, 32, true), both);
        // no tensor cores: the SIMT kernel over every token
        assert_eq!(ragged_plan(331, 32, false), RaggedPlan { split: flat(331), mma_min: None });
    }
}
