//! mul_mat and mul_mat_id with q8_0 / nvfp4 weights for many tokens: `kernels/mmq.cu`, a tiled
//! tensor-core GEMM (f16 operands, f32 accumulators) that dequantizes each weight tile in shared
//! memory (`wgmma` on Hopper, `mma.sync` elsewhere). The activations are packed once per call
//! (`mmq_pack_x`) into f16 rows scaled by powers of two, which keeps results within the f32 bound
//! of the CPU oracle (the file comment of mmq.cu has the error budget). mul_mat_id with few pairs
//! an expert takes `moe_prep` (the pairs grouped by expert and the activations packed, one launch)
//! and `moe_mma_*` (each routed expert's rows read once for all its pairs, `mma.sync`). `matmul/`
//! (`mod.rs` for mul_mat, `moe.rs` for mul_mat_id) decides when these kernels take a product; this file owns their launch rules.

use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, GRID_YZ, TensorArg, blocks_for, config, tiles};

const PACK_X: Kernel = Kernel::new(Module::Mmq, "mmq_pack_x");
/// `[weights q8_0, nvfp4][4 ring slots, 5]`.
const MMQ: [[Kernel; 2]; 2] = [
    [Kernel::new(Module::Mmq, "mmq_q8_0_s4"), Kernel::new(Module::Mmq, "mmq_q8_0_s5")],
    [Kernel::new(Module::Mmq, "mmq_nvfp4_s4"), Kernel::new(Module::Mmq, "mmq_nvfp4_s5")],
];
/// mul_mat's wide tiles (`MQ_BN_WIDE` columns, 4 ring slots), `[q8_0, nvfp4]`.
const MMQ_WIDE: [Kernel; 2] =
    [Kernel::new(Module::Mmq, "mmq_wide_q8_0_s4"), Kernel::new(Module::Mmq, "mmq_wide_nvfp4_s4")];
const MMQ_ID: [[Kernel; 2]; 2] = [
    [Kernel::new(Module::Mmq, "mmq_q8_0_s4_id"), Kernel::new(Module::Mmq, "mmq_q8_0_s5_id")],
    [Kernel::new(Module::Mmq, "mmq_nvfp4_s4_id"), Kernel::new(Module::Mmq, "mmq_nvfp4_s5_id")],
];
/// Decoded weight tiles in shared memory: `MQ_DECODED`.
const DECODED: usize = 3;
const MOE_PREP: Kernel = Kernel::new(Module::Mmq, "moe_prep");
/// `[weights q8_0, nvfp4]`.
const MOE_MMA: [Kernel; 2] = [Kernel::new(Module::Mmq, "moe_mma_q8_0"), Kernel::new(Module::Mmq, "moe_mma_nvfp4")];
/// `moe_mma_*`: warps a block, weight rows a work item, stages of a warp's ring, values a k-chunk
/// (`ME_WARPS`, `ME_ROWS`, `ME_STAGES`, 64 `ME_UNITS` in mmq.cu). TAG(moe-mma-smem)
const ME_WARPS: u32 = 4;
const ME_ROWS: i64 = 32;
const ME_STAGES: usize = 3;
const ME_CHUNK: i64 = 256;
/// Experts whose pair counts `moe_prep` keeps in shared memory: `ME_SHARED_EXPERTS`.
const ME_SHARED_EXPERTS: i64 = 4096;
/// Threads of a `moe_prep` block (its last block groups; a warp packs a row in the others).
const PREP_THREADS: u32 = 256;

/// Block tile: weight rows, activation columns, k per step (`MQ_BM`, `MQ_BN`, `MQ_BK`).
const BM: i64 = 128;
const BN: i64 = 128;
/// Columns of mul_mat's wide tiles (`MQ_BN_WIDE`).
const BN_WIDE: i64 = 256;
const BK: i64 = 64;
const THREADS: u32 = 256;
/// Bytes of one 128-row shared tile of 64 f16 (`MQ_TILE`).
const TILE: usize = 128 * 128;
/// Bytes of the entry points' static shared arrays (column tables) for tiles of `bn` columns.
fn static_shared(bn: i64) -> usize {
    bn as usize * (8 + 4 + 8)
}
/// Split blocks of the last tiles of a mul_mat at most (their partial sums are scratch), and the
/// tiles that may be split (one zeroed block counter each).
const MAX_SPLIT_BLOCKS: usize = 128;
const MAX_SPLIT_TILES: i64 = (crate::launch::COUNTER_BYTES / 4) as i64;
/// Bytes of one split block's partial sums of a narrow tile: 64 f32 a thread (a wide tile's
/// are twice that, so at most half as many wide blocks split).
const SPLIT_BLOCK_BYTES: usize = 64 * 4 * THREADS as usize;

/// Bytes of one row's raw weights in a slot (`mq_raw_stride`: the 16-byte blocks that hold a
/// row's 64 values at any 4-byte offset, 5 for q8_0's 68 bytes and 3 for nvfp4's 36).
fn raw_stride(d: DType) -> usize {
    if d == DType::Q8_0 { 80 } else { 48 }
}

/// Dynamic shared memory of a block of `bn` columns with `stages` ring slots: TAG(mmq-smem),
/// `mq_shared_bytes` (slots of an activation tile and the raw weights, the decoded weight tiles,
/// 1 KiB to align the base).
fn shared_bytes(d: DType, stages: usize, bn: i64) -> usize {
    let slot = (bn as usize * 128 + BM as usize * raw_stride(d) + 16).next_multiple_of(1024);
    stages * slot + DECODED * TILE + 1024
}

/// The narrow kernel variant for `d` on this device (mul_mat_id's, and mul_mat's where wide tiles
/// do not fit): 5 ring slots where a block may have that much shared memory (Hopper: 184 KiB for
/// q8_0), else 4 (158 KiB: sm_80's 163 KiB fits). The static shared arrays of the entry points
/// (column tables, 2.5 KiB) come on top. (weight type index, slots index, dynamic shared bytes)
fn variant(cx: &Cx<'_>, d: DType) -> Option<(usize, usize, u32)> {
    let ty = usize::from(d == DType::NvFp4);
    let fits = |stages| shared_bytes(d, stages, BN) + static_shared(BN) <= cx.info.max_shared_per_block;
    let stages = [5, 4].into_iter().find(|&s| fits(s))?;
    Some((ty, stages - 4, shared_bytes(d, stages, BN) as u32))
}

/// Whether mul_mat of `n` columns and `wide_tiles` wide tiles takes the wide tiles: where they fit
/// the device's shared memory (221 KiB for q8_0: Hopper), cover the columns with no more padding
/// than narrow tiles (an even number of narrow tiles), and fill at least half a wave of the
/// multiprocessors (one block each). Each decoded weight tile then serves 256 columns instead of
/// 128, half the decode work a product; a smaller grid keeps the narrow tiles, which split along
/// k over twice the blocks. `TESSERA_MMQ_WIDE` (read once a process) overrides the last rule:
/// `0` never takes wide tiles, `1` takes them wherever they fit.
fn wide(cx: &Cx<'_>, d: DType, n: i64, wide_tiles: i64) -> bool {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let fills = match crate::launch::env_number(&SET, "TESSERA_MMQ_WIDE") {
        Some(0) => return false,
        Some(1) => true,
        _ => 2 * wide_tiles >= cx.info.multiprocessors as i64,
    };
    fills
        && tiles(n, BN) % 2 == 0
        && shared_bytes(d, 4, BN_WIDE) + static_shared(BN_WIDE) <= cx.info.max_shared_per_block
}

/// Raw bytes of one row's 64 values: two q8_0 blocks or one nvfp4 block (`mq_raw_bytes`).
fn unit_bytes(d: DType) -> usize {
    if d == DType::Q8_0 { 68 } else { 36 }
}

/// Dynamic shared memory of a `moe_mma_*` block: TAG(moe-mma-smem), each warp's ring of
/// `ME_STAGES` stages of `ME_ROWS` rows of a k-chunk, 16 bytes of padding a row.
fn moe_shared_bytes(d: DType) -> usize {
    let row = (ME_CHUNK / 64) as usize * unit_bytes(d) + 16;
    ME_WARPS as usize * ME_STAGES * ME_ROWS as usize * row
}

/// Whether these kernels can take weights `a` (dtype `d`): q8_0 / nvfp4 rows of whole k-tiles
/// starting 4-byte aligned (the raw tiles are copied in words).
pub(super) fn weights_fit(a: &TensorArg, d: DType) -> bool {
    matches!(d, DType::Q8_0 | DType::NvFp4)
        && a.ne[0] > 0
        && a.ne[0] % BK == 0
        && a.data.is_multiple_of(4)
        && (1..4).all(|i| a.nb[i] % 4 == 0)
        && tiles(a.ne[1], BM) <= GRID_YZ
}

/// Scratch bytes of the packed activations of `b`: f16 values, then an f32 scale per row.
pub(super) fn packed_bytes(b: &TensorMeta) -> usize {
    packed_size(b.nelements(), b.ne[0])
}

fn packed_size(elements: usize, k: usize) -> usize {
    values_bytes(elements) + (elements / k.max(1) * 4).next_multiple_of(256)
}

/// Scratch bytes of `mul_mat`: the packed activations, then the split blocks' partial sums.
pub(super) fn mul_mat_scratch_bytes(b: &TensorMeta) -> usize {
    packed_bytes(b) + MAX_SPLIT_BLOCKS * SPLIT_BLOCK_BYTES
}

/// How `mul_mat` covers `tiles` output tiles of `ktiles` k-tiles with `blocks` blocks resident
/// at once: (tiles with a block each, split blocks a remaining tile, k-tiles a split block). A
/// grid of whole waves and a few tiles would leave most multiprocessors idle while the last few
/// run (as does a grid of fewer tiles than a wave); those tiles are split along k instead, over
/// about a wave of blocks.
fn split_plan(tiles: i64, ktiles: i64, blocks: i64, max_split_blocks: i64) -> (i64, i32, i32) {
    let tail = tiles % blocks.max(1);
    let splits = (blocks / tail.max(1)).min(max_split_blocks / tail.max(1)).min(ktiles).min(16);
    if tail == 0 || tail > MAX_SPLIT_TILES || splits < 2 {
        return (tiles, 1, ktiles as i32);
    }
    let kper = (ktiles + splits - 1) / splits;
    // every split block gets at least one k-tile
    let splits = (ktiles + kper - 1) / kper;
    (tiles - tail, splits as i32, kper as i32)
}

fn values_bytes(n: usize) -> usize {
    (n * 2).next_multiple_of(256)
}

/// Packs `b` (k a multiple of 64) into `x` as `mmq_pack_x` lays it out; returns where the row
/// scales are.
fn pack_x(cx: &mut Cx<'_>, b: TensorArg, x: u64) -> Result<u64, BackendError> {
    let xs = x + values_bytes(b.nelements() as usize) as u64;
    let rows = b.nelements() / b.ne[0].max(1);
    let mut args = cx.kernel(PACK_X)?;
    args.arg(&b).arg(&x).arg(&xs);
    // SAFETY: `mmq_pack_x(b, x, xs)` reads b inside its span (row_coords) and writes 2 bytes per
    // element of b at x and 4 per row at xs, which `packed_bytes` sized.
    unsafe { args.launch(config((blocks_for(rows, THREADS / 32), 1, 1), (THREADS, 1, 1), 0)) }?;
    Ok(xs)
}

/// `out = a^T b` for weights that `weights_fit`, with the packed activations at `x` (scratch of
/// `packed_bytes(b)`); with `up = Some((a_up, out_up))` also `out_up = a_up^T b` in the same
/// launch (weights of a's shape and strides, out_up of out's shape: mul_mat_swiglu's two
/// products, the activations packed once and the tiles of both splitting as one grid). `None`
/// when the device cannot hold a block's tiles or the batch count exceeds the grid: the caller
/// takes another path.
pub(super) fn mul_mat(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    x: u64,
    up: Option<(TensorArg, TensorArg)>,
) -> Option<Result<(), BackendError>> {
    let (ty, s, shared) = variant(cx, d)?;
    if up.is_some_and(|(a_up, out_up)| a_up.ne != a.ne || a_up.nb != a.nb || out_up.ne != out.ne) {
        return None;
    }
    let (n, b2, b3) = (b.ne[1], b.ne[2], b.ne[3]);
    let products = if up.is_some() { 2 } else { 1 };
    let wide_tiles = tiles(n, BN_WIDE) * tiles(a.ne[1], BM) * b2 * b3 * products;
    // a split wide block's partial sums take the room of two narrow ones
    let (kernel, shared, bn, max_split_blocks) = if wide(cx, d, n, wide_tiles) {
        (MMQ_WIDE[ty], shared_bytes(d, 4, BN_WIDE) as u32, BN_WIDE, MAX_SPLIT_BLOCKS as i64 / 2)
    } else {
        (MMQ[ty][s], shared, BN, MAX_SPLIT_BLOCKS as i64)
    };
    let all_tiles = tiles(n, bn) * tiles(a.ne[1], BM) * b2 * b3 * products;
    if all_tiles > i64::from(i32::MAX) - MAX_SPLIT_BLOCKS as i64 {
        return None;
    }
    let run = |cx: &mut Cx<'_>| {
        let xs = pack_x(cx, b, x)?;
        cx.allow_shared(kernel, shared)?;
        let resident = cx.resident_blocks(kernel, THREADS, shared)? as i64;
        let (dp, splits, kper) = split_plan(all_tiles, a.ne[0] / BK, resident, max_split_blocks);
        let blocks = dp + (all_tiles - dp) * i64::from(splits);
        let packed = packed_size(b.nelements() as usize, b.ne[0] as usize);
        let (partial, count) = (x + packed as u64, cx.counters);
        let (a_up, out_up) = match up {
            Some((a_up, out_up)) => (a_up.data, out_up),
            None => (0, out),
        };
        let mut args = cx.kernel(kernel)?;
        args.arg(&a).arg(&a_up).arg(&x).arg(&xs).arg(&n).arg(&b2).arg(&b3).arg(&out).arg(&out_up);
        args.arg(&dp).arg(&splits).arg(&kper).arg(&partial).arg(&count);
        // SAFETY: `mmq_*(a, a_up, x, xs, n, b2, b3, out, out_up, dp, splits, kper, partial,
        // count)`: a's rows are whole 64-value k-tiles, 4-byte aligned (`weights_fit`), and rows
        // past ne[1] are never read; a_up (null, or weights of a's shape and strides, checked
        // above, read as a's) and out_up (out's shape) take the second half of the tiles; batch
        // (i2, i3) reads weight batch (i2 / (b2 / A2), i3 / (b3 / A3)) inside a (shape rules); x,
        // xs hold the b2 * b3 * n packed rows; columns past n and rows past M are neither read
        // nor written; out is [M, n, b2, b3] f32 at its strides; the blocks past dp
        // split at most MAX_SPLIT_TILES tiles (count: zeroed block counters, one a tile, left
        // zeroed) into at most MAX_SPLIT_BLOCKS narrow blocks or half as many wide ones (twice
        // the sums) of kper >= 1 k-tiles inside K (`split_plan`), whose sums fit the scratch
        // after the packed activations (`mul_mat_scratch_bytes`); `shared` bytes were allowed
        // above.
        unsafe { args.launch(config((blocks as u32, 1, 1), (THREADS, 1, 1), shared)) }?;
        Ok(())
    };
    Some(run(cx))
}

/// Whether `mul_mat_id` (the tiled kernels) can take experts `w` on this device.
pub(super) fn tiled_id_fits(cx: &Cx<'_>, w: &TensorArg, d: DType) -> bool {
    weights_fit(w, d) && variant(cx, d).is_some() && w.ne[2] <= GRID_YZ
}

/// mul_mat_id's experts on tensor cores: for each expert e, the pairs listed at
/// `list[offsets[e] .. offsets[e + 1]]` (by `moe_prep`, device memory) when there are more than
/// `min_pairs` of them; the others are left to the caller. `x` is scratch of `packed_bytes(b)`;
/// `packed`: where the row scales are when `moe_prep` already packed b there (else this packs it).
#[allow(clippy::too_many_arguments)]
pub(super) fn mul_mat_id(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    b: TensorArg,
    n_used: i64,
    n_pairs: i64,
    offsets: u64,
    list: u64,
    min_pairs: i32,
    out: TensorArg,
    x: u64,
    packed: Option<u64>,
) -> Option<Result<(), BackendError>> {
    let (ty, s, shared) = variant(cx, d)?;
    if w.ne[2] > GRID_YZ {
        return None;
    }
    let kernel = MMQ_ID[ty][s];
    let run = |cx: &mut Cx<'_>| {
        let xs = match packed {
            Some(xs) => xs,
            None => pack_x(cx, b, x)?,
        };
        cx.allow_shared(kernel, shared)?;
        // Column blocks per expert for twice the average pairs (the kernel loops over any more):
        // with many experts most have one tile's worth, and empty blocks still cost a launch slot
        // (docs/perf-log/kernels-mmid.md).
        let per_expert = tiles(2 * n_pairs / w.ne[2].max(1), BN).clamp(1, tiles(n_pairs, BN).max(1));
        let grid = (per_expert as u32, tiles(w.ne[1], BM) as u32, w.ne[2] as u32);
        let n_b = b.ne[1];
        let mut args = cx.kernel(kernel)?;
        args.arg(&w).arg(&x).arg(&xs).arg(&n_b).arg(&n_used).arg(&offsets).arg(&list).arg(&min_pairs).arg(&out);
        // SAFETY: `mmq_*_id(as, x, xs, n_b, n_used, offsets, list, min_pairs, out)`: expert e =
        // blockIdx.z < n_expert reads its own rows of as (whole aligned k-tiles, `weights_fit`);
        // offsets has n_expert + 1 entries and list the valid pairs s = u + n_used t only, so the
        // packed row (u mod n_b) + n_b t exists in x, xs and out[:, u, t] lies in out.
        unsafe { args.launch(config(grid, (THREADS, 1, 1), shared)) }?;
        Ok(())
    };
    Some(run(cx))
}

/// Where mul_mat_id's pairs, grouped by expert, live in scratch (written by `moe_prep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MoeGroups {
    /// n_expert + 1 i32: expert e's pairs are `list[offsets[e] .. offsets[e + 1]]`.
    pub offsets: u64,
    /// n_expert i32 (the counts, when there are too many experts for shared memory).
    pub cursor: u64,
    /// n_used * T i32: the pairs s = u + n_used t, grouped by expert.
    pub list: u64,
    /// n_expert + 1 entries of 16 bytes: how many experts `moe_mma_*` takes, then those experts
    /// (id, first list entry, pair count).
    pub listed: u64,
}

impl MoeGroups {
    /// The grouping at `base` (256-byte aligned) for `n_expert` experts and `n_pairs` pairs, and
    /// its bytes (each array 256-byte aligned).
    pub(super) fn at(base: u64, n_expert: usize, n_pairs: usize) -> (MoeGroups, usize) {
        let ints = |n: usize| (n * 4).next_multiple_of(256) as u64;
        let offsets = base;
        let cursor = offsets + ints(n_expert + 1);
        let list = cursor + ints(n_expert);
        let listed = list + ints(n_pairs);
        let end = listed + ((n_expert + 1) * 16).next_multiple_of(256) as u64;
        (MoeGroups { offsets, cursor, list, listed }, (end - base) as usize)
    }
}

/// Whether `moe_mma_*` can take experts `w` on this device: q8_0 / nvfp4 with K a multiple of
/// 256 (whole k-chunks), rows and experts 16-byte aligned (the chunks are copied in 16-byte
/// pieces), a block's rings within the device's shared memory, and pair and item counts that fit
/// the kernels' ints.
pub(super) fn moe_fits(cx: &Cx<'_>, w: &TensorArg, d: DType, n_pairs: i64) -> bool {
    let items = w.ne[2].saturating_mul(tiles(w.ne[1], ME_ROWS));
    matches!(d, DType::Q8_0 | DType::NvFp4)
        && w.ne[0] > 0
        && w.ne[0] % ME_CHUNK == 0
        && w.data.is_multiple_of(16)
        && w.nb[1] % 16 == 0
        && w.nb[2] % 16 == 0
        && moe_shared_bytes(d) <= cx.info.max_shared_per_block
        && n_pairs <= i64::from(i32::MAX)
        && items <= i64::from(i32::MAX)
}

/// The pair lists of a dense mul_mat of 1 ..= `DensePairs::MAX` tokens run by `moe_mma_*` as one
/// expert with one slot: pair t is token t. Constant, so the backend writes them once
/// ([`DensePairs::table`]) and a step reads them in place (no grouping launch).
pub(crate) struct DensePairs;

impl DensePairs {
    pub const MAX: usize = 8;
    /// Offset of the listed-expert entries for n tokens (two `MeExpert`s: the count, then expert
    /// 0 with its n pairs from list entry 0).
    fn listed_at(n: usize) -> usize {
        256 + (n - 1) * 32
    }

    /// The bytes: the list 0 .. MAX (i32), then for each n its two listed entries.
    pub fn table() -> Vec<u8> {
        let mut t = vec![0u8; Self::listed_at(Self::MAX + 1)];
        for i in 0..Self::MAX {
            t[4 * i..4 * i + 4].copy_from_slice(&(i as i32).to_le_bytes());
        }
        for n in 1..=Self::MAX {
            let at = Self::listed_at(n);
            let entries: [i32; 8] = [1, 0, 0, 0, 0, 0, n as i32, 0];
            for (j, v) in entries.iter().enumerate() {
                t[at + 4 * j..at + 4 * j + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        t
    }

    /// The groups of n tokens in the table at `base`.
    pub(super) fn groups(base: u64, n: usize) -> MoeGroups {
        MoeGroups { offsets: 0, cursor: 0, list: base, listed: base + Self::listed_at(n) as u64 }
    }
}

/// Dense `out = a^T b` for `min_tokens ..= DensePairs::MAX` tokens on `moe_mma_*`'s tensor cores,
/// `a` as one expert (whole 32-row items streamed through shared memory, each row's bytes read once
/// for all the tokens); `None` where it does not fit or has fewer than `min_items` items.
pub(super) fn dense_mma(
    cx: &mut Cx<'_>,
    a: TensorArg,
    d: DType,
    b: TensorArg,
    out: TensorArg,
    min_items: i64,
    min_tokens: i64,
) -> Option<Result<(), BackendError>> {
    let n = b.ne[1];
    let items = tiles(a.ne[1], ME_ROWS);
    let contiguous_out = out.nb[0] == 4 && out.nb[1] == 4 * out.ne[0];
    let single = a.ne[2] * a.ne[3] * b.ne[2] * b.ne[3] == 1;
    if !(min_tokens.max(1)..=DensePairs::MAX as i64).contains(&n)
        || !single
        || !contiguous_out
        || items < min_items
        || !moe_fits(cx, &a, d, n)
        || b.ne[0] % 64 != 0
    {
        return None;
    }
    let run = |cx: &mut Cx<'_>| {
        let x = cx.scratch;
        let xs = pack_x(cx, b, x)?;
        let g = DensePairs::groups(cx.dense_pairs, n as usize);
        // out [M, n] as [M, 1 slot, n tokens]; b [K, n] as n tokens of one shared row
        let out3 = TensorArg {
            data: out.data,
            ne: [out.ne[0], 1, n, 1],
            nb: [4, 4 * out.ne[0], 4 * out.ne[0], 4 * out.ne[0] * n],
        };
        moe_mma(cx, a, d, 1, 1, n, &g, x, xs, out3, None)
    };
    Some(run(cx))
}

/// `dense_mma`'s default least 32-row items a multiprocessor (fewer leave the device waiting on a
/// few warps' streams).
pub(super) const DENSE_MMA_MIN_ITEMS_PER_SM: i64 = 2;
/// `dense_mma`'s fewest tokens: from 5 the GEMV's integer dot products, which grow with the tokens,
/// bound it more than the weight read; at 2-4 the GEMV was as fast or faster
/// (docs/perf-log/kernels-matmul.md).
pub(super) const DENSE_MMA_MIN_TOKENS: i64 = 5;

/// Groups the pairs of `ids` [n_used, T] by expert into `g` (every id checked; a bad one is
/// reported and its pair dropped), listing for `moe_mma_*` the experts with 1 ..= `max_pairs`
/// pairs; with `x`, also packs `b` there as `mmq_pack_x` does (scratch of `packed_bytes(b)`, K a
/// multiple of 64) and returns where the row scales are (else 0).
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_prep(
    cx: &mut Cx<'_>,
    ids: TensorArg,
    n_expert: i64,
    g: &MoeGroups,
    max_pairs: i32,
    b: TensorArg,
    x: Option<u64>,
    op: u32,
) -> Result<u64, BackendError> {
    let rows = b.nelements() / b.ne[0].max(1);
    let (xp, xs, pack_blocks) = match x {
        Some(x) => (x, x + values_bytes(b.nelements() as usize) as u64, blocks_for(rows, PREP_THREADS / 32)),
        None => (0, 0, 0),
    };
    let shared = if n_expert <= ME_SHARED_EXPERTS { n_expert as u32 * 4 } else { 0 };
    let err = cx.errors;
    let mut args = cx.kernel(MOE_PREP)?;
    args.arg(&ids).arg(&n_expert).arg(&g.offsets).arg(&g.cursor).arg(&g.list).arg(&g.listed).arg(&max_pairs);
    args.arg(&b).arg(&xp).arg(&xs).arg(&err).arg(&op);
    // SAFETY: `moe_prep(ids, n_expert, offsets, cursor, list, listed, max_pairs, b, x, xs, err,
    // op)`: the last block reads ids [n_used, T] inside its span and writes n_expert + 1 offsets,
    // at most n_expert counts (shared memory of n_expert ints when n_expert <= ME_SHARED_EXPERTS,
    // else `cursor`), n_used * T list entries and n_expert + 1 listed entries, all inside the
    // regions of `MoeGroups::at` that scratch_bytes sized; ids outside [0, n_expert) are
    // reported, not used. The other blocks (none without x) pack b's rows at x, xs as `pack_x`.
    unsafe { args.launch(config((pack_blocks + 1, 1, 1), (PREP_THREADS, 1, 1), shared)) }?;
    Ok(xs)
}

/// `out` for the pairs of the experts `moe_prep` listed in `g` (experts `w` that `moe_fits`),
/// with b packed at `x`, `xs`: a grid of one wave, or fewer blocks when there are fewer items
/// (32-row tiles of the at most min(n_expert, n_pairs) routed experts) than warps. With `up` (a
/// second set of experts of w's shape and strides, and its output of out's shape), the same
/// launch also writes those products: mul_mat_id_swiglu's gate and up over one grouping.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_mma(
    cx: &mut Cx<'_>,
    w: TensorArg,
    d: DType,
    n_b: i64,
    n_used: i64,
    n_pairs: i64,
    g: &MoeGroups,
    x: u64,
    xs: u64,
    out: TensorArg,
    up: Option<(TensorArg, TensorArg)>,
) -> Result<(), BackendError> {
    if up.is_some_and(|(wu, ou)| wu.ne != w.ne || wu.nb != w.nb || ou.ne != out.ne) {
        return Err(BackendError::Device {
            backend: crate::errors::NAME.into(),
            detail: "moe_mma: the up experts or their output differ in shape from the gate's".into(),
        });
    }
    let kernel = MOE_MMA[usize::from(d == DType::NvFp4)];
    let shared = moe_shared_bytes(d) as u32;
    cx.allow_shared(kernel, shared)?;
    let resident = cx.resident_blocks(kernel, ME_WARPS * 32, shared)?;
    let sets = if up.is_some() { 2 } else { 1 };
    let items = sets * w.ne[2].min(n_pairs).max(1) as u64 * tiles(w.ne[1], ME_ROWS).max(1) as u64;
    let blocks = items.div_ceil(u64::from(ME_WARPS)).min(resident).max(1) as u32;
    let (w_up, out_up) = up.map_or((0, out), |(wu, ou)| (wu.data, ou));
    let mut args = cx.kernel(kernel)?;
    args.arg(&w).arg(&w_up).arg(&x).arg(&xs).arg(&n_used).arg(&n_b).arg(&g.list).arg(&g.listed);
    args.arg(&out).arg(&out_up);
    // SAFETY: `moe_mma_*(as, as_up, x, xs, n_used, n_b, list, listed, out, out_up)`: work item i <
    // listed[0] * ceil(N / ME_ROWS) (twice that with as_up, checked above to have as's shape and
    // strides) reads rows of its listed expert e < n_expert only, in whole 16-byte pieces of
    // k-chunks inside each row (`moe_fits`: K % 256 == 0, rows 16-byte aligned), rows past N
    // zero-filled instead; its pairs list[first .. first + count) are valid pairs s = u + n_used t
    // (`moe_prep`), so the packed row (u mod n_b) + n_b t exists in x, xs (`packed_bytes(b)`) and
    // out[:, u, t] lies in out [N, n_used, T] (out_up likewise); `shared` bytes (each warp's ring)
    // were allowed above.
    unsafe { args.launch(config((blocks, 1, 1), (ME_WARPS * 32, 1, 1), shared)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_partial_last_wave_is_split_along_k() {
        // 512 tokens x 17408 rows on 132 SMs: 4 full waves, then 16 tiles over 128 blocks
        assert_eq!(split_plan(544, 80, 132, 128), (528, 8, 10));
        // whole waves stay as they are
        assert_eq!(split_plan(264, 80, 132, 128), (264, 1, 80));
        // fewer tiles than a wave: 16 tokens x 2048 rows
        assert_eq!(split_plan(16, 32, 132, 128), (0, 8, 4));
        // 60 tiles left: split in two, 16 k-tiles each
        assert_eq!(split_plan(192, 32, 132, 128), (132, 2, 16));
        // more tiles left than there are counters, or too few k-tiles to split
        assert_eq!(split_plan(100, 80, 132, 128), (100, 1, 80));
        assert_eq!(split_plan(136, 1, 132, 128), (136, 1, 1));
        // every split block gets k-tiles: 5 k-tiles over up to 16 splits -> 5 blocks of 1
        assert_eq!(split_plan(4, 5, 132, 128), (0, 5, 1));
        // wide tiles (at most 64 split blocks): 512 tokens x 17408 rows, 2 full waves, then 8
        // tiles over 64 blocks
        assert_eq!(split_plan(272, 80, 132, 64), (264, 8, 10));
    }

    #[test]
    fn mmq_blocks_fit_hopper_and_ampere() {
        let (hopper, ampere) = (227 * 1024, 163 * 1024);
        for d in [DType::Q8_0, DType::NvFp4] {
            assert!(shared_bytes(d, 5, BN) + static_shared(BN) <= hopper);
            assert!(shared_bytes(d, 4, BN) + static_shared(BN) <= ampere);
            assert!(shared_bytes(d, 4, BN_WIDE) + static_shared(BN_WIDE) <= hopper);
        }
        // q8_0's wide block: 4 slots of 43 KiB, 3 decoded tiles, 1 KiB of alignment
        assert_eq!(shared_bytes(DType::Q8_0, 4, BN_WIDE), 4 * 43 * 1024 + 3 * 16384 + 1024);
    }

    #[test]
    fn the_dense_pair_lists_name_one_expert_with_n_pairs() {
        let t = DensePairs::table();
        let int = |at: usize| i32::from_le_bytes(t[at..at + 4].try_into().unwrap());
        assert_eq!((0..8).map(|i| int(4 * i)).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        for n in 1..=DensePairs::MAX {
            let g = DensePairs::groups(1 << 20, n);
            let at = (g.listed - (1 << 20)) as usize;
            assert_eq!(at % 16, 0);
            assert_eq!([int(at), int(at + 16), int(at + 20), int(at + 24)], [1, 0, 0, n as i32]);
        }
    }

    #[test]
    fn moe_groups_are_aligned_and_disjoint() {
        let base = 1 << 20;
        let (g, bytes) = MoeGroups::at(base, 256, 1024);
        let regions = [(g.offsets, 257 * 4), (g.cursor, 256 * 4), (g.list, 1024 * 4), (g.listed, 257 * 16)];
        for w in regions.windows(2) {
            assert!(w[0].0 + w[0].1 as u64 <= w[1].0, "{g:?}");
        }
        assert!(regions.iter().all(|&(at, _)| at % 256 == 0));
        assert!(g.listed + 257 * 16 <= base + bytes as u64, "{g:?}");
    }

    #[test]
    fn moe_mma_blocks_fit_hopper_and_ampere() {
        // three nvfp4 blocks an SM on Hopper (227 KiB a block, 228 an SM), one q8_0 block even on
        // an A100 (163 KiB)
        assert_eq!(moe_shared_bytes(DType::NvFp4), 4 * 3 * 32 * 160);
        assert_eq!(moe_shared_bytes(DType::Q8_0), 4 * 3 * 32 * 288);
        assert!(3 * moe_shared_bytes(DType::NvFp4) <= 228 * 1024);
        assert!(moe_shared_bytes(DType::Q8_0) <= 163 * 1024);
    }
}
