//! mul_mat and mul_mat_id with q8_0 / nvfp4 weights for many tokens: `kernels/mmq.cu`, a tiled
//! tensor-core GEMM (f16 operands, f32 accumulators) that dequantizes each weight tile in shared
//! memory (`wgmma` on Hopper, `mma.sync` elsewhere). The activations are packed once per call
//! (`mmq_pack_x`) into f16 rows scaled by powers of two, which keeps results within the f32 bound
//! of the CPU oracle (the file comment of mmq.cu has the error budget). `mod.rs` (mul_mat) and
//! `moe.rs` (mul_mat_id) decide when these kernels take a product; this file owns their launch
//! rules. mul_mat_id with few pairs an expert: `moe_mma.rs`.

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
/// Block tile: weight rows, activation columns, k per step (`MQ_BM`, `MQ_BN`, `MQ_BK`).
const BM: i64 = 128;
const BN: i64 = 128;
/// Columns of mul_mat's wide tiles (`MQ_BN_WIDE`), and their ring slots (the `mmq_wide_*_s4`
/// entries).
const BN_WIDE: i64 = 256;
const WIDE_STAGES: usize = 4;
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
        && shared_bytes(d, WIDE_STAGES, BN_WIDE) + static_shared(BN_WIDE) <= cx.info.max_shared_per_block
}

/// Whether these kernels can take weights `a` (dtype `d`): q8_0 / nvfp4 rows of whole k-tiles
/// starting 4-byte aligned (a row's k-tile is copied as the 16-byte blocks that hold it, which
/// are 3 or 5 at any 4-byte offset, each with some of its bytes).
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

pub(super) fn values_bytes(n: usize) -> usize {
    (n * 2).next_multiple_of(256)
}

/// Packs `b` (k a multiple of 64) into `x` as `mmq_pack_x` lays it out; returns where the row
/// scales are.
pub(super) fn pack_x(cx: &mut Cx<'_>, b: TensorArg, x: u64) -> Result<u64, BackendError> {
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
        (MMQ_WIDE[ty], shared_bytes(d, WIDE_STAGES, BN_WIDE) as u32, BN_WIDE, MAX_SPLIT_BLOCKS as i64 / 2)
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
    fn every_kernel_is_defined_in_its_module() {
        for k in [PACK_X].into_iter().chain(MMQ.into_iter().flatten()).chain(MMQ_WIDE) {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
        // an `_id` entry comes with its mul_mat entry from `MQ_ENTRY`
        for k in MMQ_ID.into_iter().flatten() {
            let base = k.name.strip_suffix("_id").unwrap();
            assert!(k.module.source_from(None).contains(&format!("\nMQ_ENTRY({base},")), "{k:?}");
        }
    }

    #[test]
    fn mmq_blocks_fit_hopper_and_ampere() {
        let (hopper, ampere) = (227 * 1024, 163 * 1024);
        for d in [DType::Q8_0, DType::NvFp4] {
            assert!(shared_bytes(d, 5, BN) + static_shared(BN) <= hopper);
            assert!(shared_bytes(d, 4, BN) + static_shared(BN) <= ampere);
            assert!(shared_bytes(d, WIDE_STAGES, BN_WIDE) + static_shared(BN_WIDE) <= hopper);
        }
        // q8_0's wide block: 4 slots of 43 KiB, 3 decoded tiles, 1 KiB of alignment
        assert_eq!(shared_bytes(DType::Q8_0, WIDE_STAGES, BN_WIDE), 4 * 43 * 1024 + 3 * 16384 + 1024);
    }
}
