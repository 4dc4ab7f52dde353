//! flash_attn_ext: `kernels/attention.cu` (SIMT and combine), `attention_prefill.cu` and
//! `attention_decode.cu` (tensor cores), sharing `attention.cuh`.
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
//! of blocks: `fa_dec_x{2,4,8}_*`, see [`dec_cluster`]).
//!
//! Ragged batches (`params.ragged`) run on the same kernels with other tilings, picked from the
//! shapes alone (the offsets are device values that change under a replayed CUDA graph; nothing
//! is read back): one token per split-K tile (packed token `t`, or token `i` of sequence `s` for
//! the short sequences), 64 tokens of one sequence per tensor-core prefill tile. See
//! [`RaggedPlan`] for which launches a batch gets.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, FlashAttnParams, Op, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config, dt, unsupported};

const PARTIAL_ANY: Kernel = Kernel::new(Module::Attention, "fa_partial_any");
const PARTIAL_F32: Kernel = Kernel::new(Module::Attention, "fa_partial_f32");
const PARTIAL_F16: Kernel = Kernel::new(Module::Attention, "fa_partial_f16");
const PARTIAL_BF16: Kernel = Kernel::new(Module::Attention, "fa_partial_bf16");
const COMBINE: Kernel = Kernel::new(Module::Attention, "fa_combine");
const MMA_F16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_f16_d128");
const MMA_F16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_f16_d256");
const MMA_BF16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_bf16_d128");
const MMA_BF16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_bf16_d256");
const PAIR_F16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_f16_d128");
const PAIR_F16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_f16_d256");
const PAIR_BF16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_bf16_d128");
const PAIR_BF16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_bf16_d256");
const DEC_F16_D128: Kernel = Kernel::new(Module::AttentionDecode, "fa_dec_f16_d128");
const DEC_F16_D256: Kernel = Kernel::new(Module::AttentionDecode, "fa_dec_f16_d256");
const DEC_BF16_D128: Kernel = Kernel::new(Module::AttentionDecode, "fa_dec_bf16_d128");
const DEC_BF16_D256: Kernel = Kernel::new(Module::AttentionDecode, "fa_dec_bf16_d256");
/// The decode entries whose splits merge as one cluster of 2, 4 or 8 blocks (sm_90+), in the
/// order of [`DEC_ENTRIES`].
const DEC_CLUSTER_ENTRIES: [[Kernel; 4]; 3] = [
    [
        Kernel::new(Module::AttentionDecode, "fa_dec_x2_f16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x2_f16_d256"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x2_bf16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x2_bf16_d256"),
    ],
    [
        Kernel::new(Module::AttentionDecode, "fa_dec_x4_f16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x4_f16_d256"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x4_bf16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x4_bf16_d256"),
    ],
    [
        Kernel::new(Module::AttentionDecode, "fa_dec_x8_f16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x8_f16_d256"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x8_bf16_d128"),
        Kernel::new(Module::AttentionDecode, "fa_dec_x8_bf16_d256"),
    ],
];
const DEC_ENTRIES: [Kernel; 4] = [DEC_F16_D128, DEC_F16_D256, DEC_BF16_D128, DEC_BF16_D256];
/// Most blocks a decode cluster has (the portable cluster size).
const DEC_MAX_CLUSTER: usize = 8;
/// Most positions a split may take in a smaller cluster than its plan's (two chunks a warp).
const DEC_CLUSTER_MAX_SPLIT: usize = 2 * DEC_WARPS as usize * DEC_CHUNK;

/// TAG(fa-tile): FA_W, FA_R and FA_D in attention.cu.
const WARPS: u32 = 4;
const ROWS: usize = 8;
const MAX_D: usize = 256;
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
/// TAG(fa-mma-tile): FT_BM, FT_BN and FT_MLD in attention_prefill.cu, FT_PAD in attention.cuh.
const MMA_BM: usize = 64;
const MMA_BN: usize = 64;
const MMA_PAD: usize = 8;
/// Halves between the rows of the prefill kernel's staged mask tile (MMA_BM rows).
const MMA_MASK_LD: usize = 72;
/// TAG(fa-dec-tile): FD_W, FD_S, FD_N and FD_R in attention_decode.cu (query rows per block: one mma N
/// tile).
const DEC_WARPS: u32 = 4;
const DEC_STAGES: usize = 2;
const DEC_CHUNK: usize = 16;
const DEC_ROWS: usize = 8;
/// Blocks the decode kernel's split-K choice aims for: one per SM of an H100/H200 (at d 256 a
/// block takes 132 KiB of shared memory; fixed so that `scratch_bytes` can compute it from the
/// task alone).
const DEC_TARGET_BLOCKS: usize = 132;
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

const SIMT_TILING: Tiling = Tiling { rows: ROWS, target: TARGET_BLOCKS, min_split: MIN_SPLIT, align: 32 };
/// 8-row tiles (one mma N tile), splits that are multiples of a block's chunks.
const DEC_TILING: Tiling = Tiling {
    rows: DEC_ROWS,
    target: DEC_TARGET_BLOCKS,
    min_split: DEC_WARPS as usize * DEC_CHUNK,
    align: DEC_WARPS as usize * DEC_CHUNK,
};

/// The SIMT kernel's geometry.
fn plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>, tokens: Tokens) -> Plan {
    tile_plan(q, k, v, table, &SIMT_TILING, tokens)
}

/// The decode kernel's geometry.
fn dec_plan(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, table: Option<&TensorMeta>, tokens: Tokens) -> Plan {
    tile_plan(q, k, v, table, &DEC_TILING, tokens)
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

/// The ragged prefill kernel's grid width: at most `(n_tokens + 63 k) / 64` tiles for the `k <=
/// min(n_seq, n_tokens / min_len)` sequences of at least `min_len` tokens, plus one spare tile
/// whose blocks zero the padding tokens' rows.
fn ragged_mma_tiles(n_tokens: usize, n_seq: usize, min_len: usize) -> usize {
    let k = n_seq.min(n_tokens / min_len.max(1));
    (n_tokens + (MMA_BM - 1) * k) / MMA_BM + 1
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

/// Split-K partials: (max, sum, acc[d_v]) f32 per split and output row.
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

/// The tensor-core prefill kernels for some K/V: the one-head entry, the head-pair entry, their
/// head dim and whether they are the sm_90a build, whose blocks may be two warp groups (FT_WG),
/// each taking half of a block's kv tiles, or two heads' groups sharing them (`fa_mma_pair_*`).
#[derive(Clone, Copy)]
struct MmaLaunch {
    kernel: Kernel,
    pair: Kernel,
    d: usize,
    wgmma: bool,
}

/// How a prefill launch cuts its work into blocks ([`MmaLaunch::blocks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MmaBlocks {
    /// One warp group on 64 tokens of one head.
    One,
    /// Two warp groups on 64 tokens of one head, each half of the kv tiles.
    SplitKv,
    /// Two warp groups on the same 64 tokens of two heads of one kv head, each walking every kv
    /// tile, copied once for both.
    HeadPair,
}

impl MmaLaunch {
    /// Dynamic shared memory of a block laid out as `b`. sm_90a: the Q tile (one a head), then
    /// each tile set's K, V and mask tiles (one a group, or a head pair's two stages), unpadded,
    /// 1024-byte aligned. Elsewhere one group, rows padded for ldmatrix.
    fn shared(&self, b: MmaBlocks) -> usize {
        let d = self.d;
        let (q_tiles, tile_sets) = match b {
            MmaBlocks::One => (1, 1),
            MmaBlocks::SplitKv => (1, 2),
            MmaBlocks::HeadPair => (2, 2),
        };
        if self.wgmma {
            1024 + (q_tiles * MMA_BM + 2 * tile_sets * MMA_BN) * d * 2 + tile_sets * MMA_BM * MMA_MASK_LD * 2
        } else {
            (MMA_BM + 2 * MMA_BN) * (d + MMA_PAD) * 2 + MMA_BM * MMA_MASK_LD * 2
        }
    }

    /// The block layout for `blocks` one-head blocks of work. sm_90a only: kv tiles split over
    /// two groups where the grid alone would leave multiprocessors with one group or none (at
    /// most 5/4 of a block each); else head pairs where a kv head's query heads pair up
    /// (`heads_per_kv` even: a pair's producer group copies each K/V tile once for two consumer
    /// groups); else split kv tiles where a ragged batch's causal blocks see up to 32 kv tiles or
    /// more (the longest blocks set the time). Else (and elsewhere) one group, so that two blocks
    /// fit a multiprocessor. `pair_override` (from `TESSERA_FA_PAIR`: [`pair_override`])
    /// overrides the pairs, to measure and to test them: 0 never, 1 wherever heads pair up.
    /// (Measurements: docs/perf-log/kernels-attention.md.)
    fn blocks(
        &self,
        blocks: usize,
        multiprocessors: usize,
        ragged: bool,
        n_kv: usize,
        heads_per_kv: usize,
        pair_override: Option<i64>,
    ) -> MmaBlocks {
        let small_grid = 4 * blocks <= 5 * multiprocessors;
        let long_causal = ragged && n_kv >= 32 * MMA_BN;
        let pairs = self.wgmma && heads_per_kv.is_multiple_of(2);
        match pair_override {
            _ if !self.wgmma => MmaBlocks::One,
            Some(1) if pairs => MmaBlocks::HeadPair,
            _ if small_grid => MmaBlocks::SplitKv,
            None if pairs => MmaBlocks::HeadPair,
            _ if long_causal => MmaBlocks::SplitKv,
            _ => MmaBlocks::One,
        }
    }
}

/// The one-head blocks of a prefill grid that have work, for the layout rule: dense, the whole
/// grid; ragged, the tokens in whole tiles times the heads (the grid's bound gives every sequence
/// a tile of its own, where most of a mixed batch's may be decodes that the split-K kernel takes
/// and whose blocks return at once).
fn mma_work_blocks(ragged: bool, n_tokens: usize, grid: (u32, u32, u32)) -> usize {
    if ragged {
        n_tokens.div_ceil(MMA_BM) * grid.1 as usize
    } else {
        grid.0 as usize * grid.1 as usize * grid.2 as usize
    }
}

/// `TESSERA_FA_PAIR`, read once a process: the override of [`MmaLaunch::blocks`]'s head pairs.
fn pair_override() -> Option<i64> {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_FA_PAIR")
}

/// The tensor-core prefill kernel for these K/V, if it applies (see [`tensor_core_dims`]; at
/// most 65535 heads, its grid's y).
fn mma_kernel(cx: &Cx<'_>, q: &TensorArg, k: &TensorArg, v: &TensorArg, kdt: DType, vdt: DType) -> Option<MmaLaunch> {
    let d = tensor_core_dims(cx, q, k, v, kdt, vdt)?;
    if q.ne[2] > 65535 || !mma_row_offsets_fit(k) || !mma_row_offsets_fit(v) {
        return None;
    }
    let (kernel, pair) = match (kdt, d) {
        (DType::F16, 128) => (MMA_F16_D128, PAIR_F16_D128),
        (DType::F16, 256) => (MMA_F16_D256, PAIR_F16_D256),
        (DType::BF16, 128) => (MMA_BF16_D128, PAIR_BF16_D128),
        _ => (MMA_BF16_D256, PAIR_BF16_D256),
    };
    let launch = MmaLaunch { kernel, pair, d, wgmma: cx.kernels.arch_specific_for(Module::AttentionPrefill) };
    let most = launch.shared(MmaBlocks::SplitKv).max(launch.shared(MmaBlocks::HeadPair));
    (most <= cx.info.max_shared_per_block).then_some(launch)
}

/// Whether the prefill kernel can address every row of K or V: it keeps a row's offset as a
/// 32-bit count of 16-byte units, all ones reserved for "no row" (`FT_NO_CELL`).
fn mma_row_offsets_fit(t: &TensorArg) -> bool {
    t.ne[1] >= 0 && t.nb[1] >= 0 && (t.ne[1] as u128) * (t.nb[1] as u128) < 1 << 36
}

/// The tensor-core decode kernel for these K/V, if it applies (see [`tensor_core_dims`]): its
/// index in [`DEC_ENTRIES`] and its dynamic shared memory.
fn dec_kernel(
    cx: &Cx<'_>,
    q: &TensorArg,
    k: &TensorArg,
    v: &TensorArg,
    kdt: DType,
    vdt: DType,
) -> Option<(usize, u32)> {
    let d = tensor_core_dims(cx, q, k, v, kdt, vdt)?;
    // the kernel's row offsets are 32-bit strides times cell indices
    if k.nb[1] >= 1 << 31 || v.nb[1] >= 1 << 31 {
        return None;
    }
    let kernel = match (kdt, d) {
        (DType::F16, 128) => 0,
        (DType::F16, 256) => 1,
        (DType::BF16, 128) => 2,
        _ => 3,
    };
    let row = (d + MMA_PAD) * 2;
    let shared = DEC_WARPS as usize * DEC_STAGES * 2 * DEC_CHUNK * row;
    (shared <= cx.info.max_shared_per_block).then_some((kernel, shared as u32))
}

/// The optional operands of a flash_attn_ext task as every kernel takes them: the mask, the
/// block table, the ragged offsets and kv lengths and the gate (an empty descriptor, null data,
/// when absent: the kernels' dense, ungated layout), the mask's dtype code, and the table's
/// descriptor for planning.
struct Optional<'t> {
    mask: TensorArg,
    table: TensorArg,
    offsets: TensorArg,
    kv_lens: TensorArg,
    gate: TensorArg,
    mask_dt: i32,
    table_meta: Option<&'t TensorMeta>,
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

/// The SIMT split-K kernel (and its combine).
fn run_simt(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    tokens: Tokens,
) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, table_meta } = optional_operands(p, task, ins);
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
fn combine(
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

/// The tensor-core prefill: one block per 64 tokens of one query head (or of a head pair: see
/// [`MmaLaunch::blocks`]) of one sequence. `min_len` > 0 runs a ragged batch's sequences of at
/// least that many tokens (and zeroes its padding).
fn run_mma(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    launch: MmaLaunch,
    min_len: usize,
) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, .. } = optional_operands(p, task, ins);
    let (has_mask, paged) = (i32::from(p.mask), i32::from(p.paged));
    let (scale, softcap, l_min) = (p.scale, p.softcap, min_len as i32);
    let (err, opcode) = (cx.errors, crate::errors::op_code("flash_attn_ext"));
    let n_tokens = q.ne[1] as usize;
    let grid = if p.ragged {
        let n_seq = (offsets.ne[0] as usize).saturating_sub(1);
        (ragged_mma_tiles(n_tokens, n_seq, min_len) as u32, q.ne[2] as u32, 1)
    } else {
        (n_tokens.div_ceil(MMA_BM) as u32, q.ne[2] as u32, q.ne[3] as u32)
    };
    let blocks = mma_work_blocks(p.ragged, n_tokens, grid);
    let n_kv = if p.paged { table.ne[0] } else { k.ne[1] } as usize;
    let heads_per_kv = (q.ne[2] / k.ne[2].max(1)) as usize;
    let layout = launch.blocks(blocks, cx.info.multiprocessors, p.ragged, n_kv, heads_per_kv, pair_override());
    let (kernel, grid, threads) = match layout {
        MmaBlocks::One => (launch.kernel, grid, 128),
        MmaBlocks::SplitKv => (launch.kernel, grid, 256),
        MmaBlocks::HeadPair => (launch.pair, (grid.0, grid.1 / 2, grid.2), 384),
    };
    // the function's limit at the largest block either choice may launch (a captured graph may
    // hold launches of both)
    let limit = if layout == MmaBlocks::HeadPair { MmaBlocks::HeadPair } else { MmaBlocks::SplitKv };
    cx.allow_shared(kernel, launch.shared(limit) as u32)?;
    let cfg = config(grid, (threads, 1, 1), launch.shared(layout) as u32);
    let mut a = cx.kernel(kernel)?;
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&offsets).arg(&kv_lens).arg(&out).arg(&gate);
    a.arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap).arg(&l_min).arg(&err).arg(&opcode);
    // SAFETY: `fa_mma(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged,
    // scale, softcap, l_min, err, opcode)`: shapes as for `fa_partial` (shape rules); `mma_kernel`
    // checked one f16/bf16 dtype, d_k = d_v = the kernel's D and 16-byte aligned rows (its uint4
    // loads); `shared` holds the tiles of its layout (`MmaLaunch::shared`, at most the split-kv
    // size that `mma_kernel` checked against the device limit, raised above); the kernel takes its
    // group count from its threads; the pair entry runs only where `blocks` saw the sm_90a build
    // (which has it), with y = n_head / 2 and the kv head's query heads even in number, so that
    // heads 2y and 2y + 1 share a kv head. Dense: the grid covers ceil(n_tokens / 64) x n_head
    // (pairs: n_head / 2) x n_seq and rows past n_tokens are not written. Ragged: blocks
    // check every offset and kv length first, take the tiles of `ragged_mma_tiles` (a bound on
    // their count, plus a spare row) and write only their sequence's rows (or padding rows);
    // positions read stay below kv_lens[s] <= n_kv. Table entries are checked before any K/V read.
    unsafe { a.launch(cfg) }?;
    Ok(())
}

/// `TESSERA_FA_CLUSTER`, read once a process: 0 turns [`dec_cluster`]'s clusters off, 2, 4 or 8
/// takes that cluster size for every split decode (at most that many splits).
fn cluster_override() -> Option<i64> {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    crate::launch::env_number(&SET, "TESSERA_FA_CLUSTER")
}

/// The cluster a split decode's splits merge in, and the plan with its splits, or `pl` and 1 (no
/// cluster: one split, or `fa_combine` after the launch). A plan of 2 to 8 splits takes a
/// cluster of the next power of two, each split `n_kv / c` positions rounded up to a block's
/// chunks (trailing splits may be empty), or a smaller one while the GPU cannot hold all of the
/// launch's clusters at once (`resident(c)`: clusters of c blocks it holds; a second wave costs
/// more than `fa_combine`), as long as a split stays within [`DEC_CLUSTER_MAX_SPLIT`] positions
/// (longer ones, fewer blocks, cost more than the combine saves). `forced` (2, 4 or 8) takes that
/// size for any plan of more than one split; 0 none.
fn dec_cluster(
    pl: Plan,
    n_kv: usize,
    forced: Option<i64>,
    resident: &mut dyn FnMut(usize) -> Result<u64, BackendError>,
) -> Result<(Plan, usize), BackendError> {
    let split_len = |c: usize| n_kv.div_ceil(c).div_ceil(DEC_TILING.align).max(1) * DEC_TILING.align;
    let c = match forced {
        _ if pl.splits < 2 => 1,
        Some(f @ (2 | 4 | 8)) => f as usize,
        Some(_) => 1,
        None if pl.splits > DEC_MAX_CLUSTER => 1,
        None => {
            let clusters = (pl.tiles * pl.n_seq) as u64;
            let mut c = pl.splits.next_power_of_two();
            while c >= 2 && clusters > resident(c)? {
                c /= 2;
                if split_len(c) > DEC_CLUSTER_MAX_SPLIT.max(pl.split_len) {
                    c = 1;
                }
            }
            c
        }
    };
    if c < 2 {
        return Ok((pl, 1));
    }
    let split_len = split_len(c);
    if n_kv.div_ceil(split_len) < 2 {
        return Ok((Plan { splits: 1, split_len, ..pl }, 1));
    }
    Ok((Plan { splits: c, split_len, ..pl }, c))
}

/// The tensor-core decode: one block per 8-row tile of a kv group, split and sequence (dense),
/// or per one-token tile and split (ragged); the splits of a tile merged by their cluster
/// ([`dec_cluster`]) or by `fa_combine`.
fn run_dec(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    entry: usize,
    shared: u32,
    tokens: Tokens,
) -> Result<(), BackendError> {
    let Op::FlashAttnExt(p) = task.op else { return Err(unsupported(task, "not flash_attn_ext")) };
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, table_meta } = optional_operands(p, task, ins);
    let pl = dec_plan(meta(0), meta(1), meta(2), table_meta, tokens);
    let n_kv = table_meta.map_or(meta(1).ne[1], |t| t.ne[0]);
    let kernel_of = |c: usize| match c {
        2 => DEC_CLUSTER_ENTRIES[0][entry],
        4 => DEC_CLUSTER_ENTRIES[1][entry],
        8 => DEC_CLUSTER_ENTRIES[2][entry],
        _ => DEC_ENTRIES[entry],
    };
    let (pl, cluster) = if cx.info.compute_capability.0 >= 9 {
        let mut resident = |c: usize| {
            cx.allow_shared(kernel_of(c), shared)?;
            Ok(cx.kernels.resident_clusters(kernel_of(c), c as u32, DEC_WARPS * 32, shared)?)
        };
        dec_cluster(pl, n_kv, cluster_override(), &mut resident)?
    } else {
        (pl, 1)
    };
    let kernel = kernel_of(cluster);
    let (has_mask, paged) = (i32::from(p.mask), i32::from(p.paged));
    let (scale, softcap, split_len) = (p.scale, p.softcap, pl.split_len as i32);
    let (hb, tb, h_blocks, t_blocks) = (pl.hb as i32, pl.tb as i32, pl.h_blocks as i32, pl.t_blocks as i32);
    let seq_stride = pl.seq_stride as i32;
    let (part, err, opcode) = (cx.scratch, cx.errors, crate::errors::op_code("flash_attn_ext"));
    cx.allow_shared(kernel, shared)?;
    let cfg = config((pl.tiles as u32, pl.splits as u32, pl.n_seq as u32), (DEC_WARPS * 32, 1, 1), shared);
    let mut a = cx.kernel(kernel)?;
    a.arg(&q).arg(&k).arg(&v).arg(&mask).arg(&table).arg(&offsets).arg(&kv_lens).arg(&out).arg(&gate);
    a.arg(&mdt).arg(&has_mask).arg(&paged).arg(&scale).arg(&softcap);
    a.arg(&split_len).arg(&hb).arg(&tb).arg(&h_blocks).arg(&t_blocks).arg(&seq_stride);
    a.arg(&part).arg(&err).arg(&opcode);
    // SAFETY: `fa_dec(q, k, v, mask, table, offsets, kv_lens, out, gate, mdt, has_mask, paged,
    // scale, softcap, split_len, hb, tb, h_blocks, t_blocks, seq_stride, part, err, opcode)`: shapes as
    // for `fa_partial` (shape rules); `dec_kernel` checked one f16/bf16 dtype, d_k = d_v = the
    // kernel's D and 16-byte aligned rows (its 16-byte cp.async copies); `shared` is the kernel's
    // FD_W * FD_S * 2 * 16 rows of D + 8 halves, within the device limit (raised above);
    // the grid is exactly tiles x splits x n_seq of `dec_plan`, whose tiles hold at most 8 rows
    // (hb * tb <= 8); ragged blocks check every offset and kv length before using one and read
    // positions below kv_lens[s] <= n_kv only; table entries are checked against n_cells before
    // any K/V read; with splits > 1 `part` holds splits * rows * (d_v + 2) f32 (`scratch_bytes`
    // takes the largest plan), unless the splits are one cluster (the kernel's own, grid y =
    // splits = its cluster size: they merge in shared memory and write the output).
    unsafe { a.launch(cfg) }?;
    if cluster > 1 { Ok(()) } else { combine(cx, pl, q, offsets, kv_lens, out, gate) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_kernel_takes_k_and_v_whose_row_offsets_fit_32_bits() {
        let kv = |cells: i64, nb1: i64| TensorArg { data: 0, ne: [256, cells, 4, 1], nb: [2, nb1, 512, 512 * cells] };
        assert!(mma_row_offsets_fit(&kv(1 << 20, 2048)));
        // 2^36 bytes of rows (32 Mi cells of 2 KiB) is one too many
        assert!(mma_row_offsets_fit(&kv((1 << 25) - 1, 2048)));
        assert!(!mma_row_offsets_fit(&kv(1 << 25, 2048)));
    }

    #[test]
    fn decode_splits_merge_in_a_cluster_when_there_are_2_to_8() {
        let meta = |ne: [usize; 4]| TensorMeta::contiguous("flash_attn_ext", DType::F16, ne).unwrap();
        let kv = |n: usize| meta([256, n, 2, 1]);
        let (q1, q8) = (meta([256, 1, 16, 1]), meta([256, 1, 16, 8]));
        // the GPU holds any number of clusters, or 15 of 8, 30 of 4 and 60 of 2 blocks
        let any = &mut |_| Ok(u64::MAX);
        let some = &mut |c: usize| Ok(120 / c as u64);
        let cl = |pl, n_kv, forced, resident: &mut dyn FnMut(usize) -> Result<u64, BackendError>| {
            let (p, c): (Plan, usize) = dec_cluster(pl, n_kv, forced, resident).unwrap();
            (c, p.splits, p.split_len)
        };
        // one sequence over 256 positions, 2 kv heads: 4 splits of 64, one cluster of 4 a tile
        let pl = dec_plan(&q1, &kv(256), &kv(256), None, Tokens::Dense);
        assert_eq!((pl.tiles, pl.splits, pl.split_len), (2, 4, 64));
        assert_eq!(cl(pl, 256, None, any), (4, 4, 64));
        // eight sequences: 16 tiles x 4 splits; 16 clusters of 4 fit
        assert_eq!(cl(dec_plan(&q8, &kv(256), &kv(256), None, Tokens::Dense), 256, None, some), (4, 4, 64));
        // 8 splits of 64 for 16 tiles: 16 clusters of 8 do not fit, 16 of 4 (128 positions) do
        let p8 = dec_plan(&q8, &kv(512), &kv(512), None, Tokens::Dense);
        assert_eq!((p8.splits, p8.split_len), (8, 64));
        assert_eq!(cl(p8, 512, None, any), (8, 8, 64));
        assert_eq!(cl(p8, 512, None, some), (4, 4, 128));
        // ... but splits of 1024 positions would cost more than fa_combine
        let p8 = dec_plan(&q8, &kv(4096), &kv(4096), None, Tokens::Dense);
        assert_eq!((p8.splits, p8.split_len), (8, 512));
        assert_eq!(cl(p8, 4096, None, some).0, 1);
        // 3 splits take a cluster of 4 (one split empty), or of 2 where 4s do not fit, or none
        let three = Plan { splits: 3, split_len: 64, ..pl };
        assert_eq!(cl(three, 192, None, any), (4, 4, 64));
        assert_eq!(cl(Plan { tiles: 40, ..three }, 192, None, some), (2, 2, 128));
        assert_eq!(cl(Plan { tiles: 61, ..three }, 192, None, some).0, 1);
        // long contexts keep fa_combine, unless a size is forced
        let long = dec_plan(&q1, &kv(4096), &kv(4096), None, Tokens::Dense);
        assert_eq!(long.splits, 64);
        assert_eq!(cl(long, 4096, None, any).0, 1);
        assert_eq!(cl(long, 4096, Some(8), some), (8, 8, 512));
        assert_eq!(cl(pl, 256, Some(0), any).0, 1);
        // one split, or too few positions for two after rounding: no cluster
        assert_eq!(cl(Plan { splits: 1, ..pl }, 256, None, any).0, 1);
        assert_eq!(cl(Plan { splits: 2, ..pl }, 64, Some(8), any), (1, 1, 64));
    }

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

    #[test]
    fn the_prefill_splits_kv_for_small_grids_and_long_ragged_batches_and_else_pairs_heads() {
        use crate::compile::{Kernel, Module};
        use MmaBlocks::{HeadPair, One, SplitKv};
        let wgmma = MmaLaunch {
            kernel: Kernel::new(Module::AttentionPrefill, "fa_mma_f16_d256"),
            pair: Kernel::new(Module::AttentionPrefill, "fa_mma_pair_f16_d256"),
            d: 256,
            wgmma: true,
        };
        assert_eq!(wgmma.blocks(128, 132, false, 2048, 8, None), SplitKv);
        assert_eq!(wgmma.blocks(165, 132, false, 512, 6, None), SplitKv);
        // 96 pairs leave 36 of 132 multiprocessors idle and still beat 192 one-head blocks
        assert_eq!(wgmma.blocks(192, 132, false, 512, 6, None), HeadPair);
        assert_eq!(wgmma.blocks(192, 132, false, 512, 3, None), One);
        assert_eq!(wgmma.blocks(256, 132, false, 512, 8, None), HeadPair);
        assert_eq!(wgmma.blocks(256, 132, false, 512, 3, None), One);
        assert_eq!(wgmma.blocks(512, 132, true, 2048, 8, None), HeadPair);
        assert_eq!(wgmma.blocks(512, 132, true, 2048, 3, None), SplitKv);
        assert_eq!(wgmma.blocks(512, 132, false, 2048, 8, None), HeadPair);
        for d in [128, 256] {
            let l = MmaLaunch { d, ..wgmma };
            assert!(l.shared(SplitKv) <= 227 * 1024 && 2 * l.shared(One) <= 228 * 1024);
            assert!(l.shared(HeadPair) <= 227 * 1024);
        }
        // the override: pairs everywhere they can be, or nowhere
        assert_eq!(wgmma.blocks(24, 132, false, 200, 4, Some(1)), HeadPair);
        assert_eq!(wgmma.blocks(24, 132, false, 200, 1, Some(1)), SplitKv);
        assert_eq!(wgmma.blocks(192, 132, false, 512, 6, Some(0)), One);
        assert_eq!(wgmma.blocks(128, 132, false, 2048, 8, Some(0)), SplitKv);
        // a 300-token chunk with 31 decodes at 16 heads: the grid's bound is 37 tiles, the work
        // 6 tiles (96 blocks: a small grid, kv tiles split)
        let (n_tokens, n_seq) = (331, 32);
        let grid = (ragged_mma_tiles(n_tokens, n_seq, MMA_MIN_TOKENS) as u32, 16, 1);
        assert_eq!((grid.0, mma_work_blocks(true, n_tokens, grid)), (37, 96));
        assert_eq!(wgmma.blocks(96, 132, true, 4096, 8, None), SplitKv);
        assert_eq!(mma_work_blocks(false, 512, (8, 24, 1)), 192);
        let portable = MmaLaunch { wgmma: false, ..wgmma };
        assert_eq!(portable.blocks(512, 132, false, 512, 8, Some(1)), One);
        assert_eq!(portable.blocks(128, 132, true, 4096, 8, None), One);
        assert_eq!(portable.blocks(512, 132, false, 512, 8, None), One);
    }

    #[test]
    fn the_prefill_grid_covers_every_tile_and_a_spare() {
        // Every way of cutting n_tokens into n_seq sequences (small sizes, exhaustive over a
        // pseudo-random sample): the tiles of the sequences of at least `min_len` tokens fit.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        for _ in 0..20_000 {
            let (n_tokens, n_seq, min_len) = (1 + next(700), 1 + next(40), 1 + next(5));
            let mut lens = vec![0; n_seq];
            let mut left = n_tokens - next(n_tokens.min(8)); // some padding
            for (i, l) in lens.iter_mut().enumerate() {
                *l = if i + 1 == n_seq { left } else { next(left + 1) };
                left -= *l;
            }
            let tiles: usize = lens.iter().filter(|&&l| l >= min_len).map(|l| l.div_ceil(MMA_BM)).sum();
            assert!(tiles < ragged_mma_tiles(n_tokens, n_seq, min_len), "{lens:?} min {min_len}");
        }
        assert_eq!(ragged_mma_tiles(512, 1, 1), 8 + 1);
        assert_eq!(ragged_mma_tiles(2048, 1, 1), 32 + 1);
    }
}
