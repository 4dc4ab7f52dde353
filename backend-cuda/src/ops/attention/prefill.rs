//! flash_attn_ext's tensor-core prefill (`fa_mma_*`, `fa_mma_pair_*`: kernels/attention_prefill.cu).

use tessera_graph::{BackendError, Task};
use tessera_ops::DType;

use super::{Optional, ROW_PAD, operands, tensor_core_dims};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config};

const MMA_F16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_f16_d128");
const MMA_F16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_f16_d256");
const MMA_BF16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_bf16_d128");
const MMA_BF16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_bf16_d256");
const PAIR_F16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_f16_d128");
const PAIR_F16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_f16_d256");
const PAIR_BF16_D128: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_bf16_d128");
const PAIR_BF16_D256: Kernel = Kernel::new(Module::AttentionPrefill, "fa_mma_pair_bf16_d256");
/// TAG(fa-mma-tile): FT_BM, FT_BN and FT_MLD in attention_prefill.cu (FT_PAD: `ROW_PAD` in mod.rs).
const MMA_BM: usize = 64;
const MMA_BN: usize = 64;
/// Halves between the rows of the prefill kernel's staged mask tile (MMA_BM rows).
const MMA_MASK_LD: usize = 72;

/// The ragged prefill kernel's grid width: at most `(n_tokens + 63 k) / 64` tiles for the `k <=
/// min(n_seq, n_tokens / min_len)` sequences of at least `min_len` tokens, plus one spare tile
/// whose blocks zero the padding tokens' rows.
fn ragged_mma_tiles(n_tokens: usize, n_seq: usize, min_len: usize) -> usize {
    let k = n_seq.min(n_tokens / min_len.max(1));
    (n_tokens + (MMA_BM - 1) * k) / MMA_BM + 1
}

/// The tensor-core prefill kernels for some K/V: the one-head entry, the head-pair entry, their
/// head dim and whether they are the sm_90a build, whose blocks may be two warp groups (FT_WG),
/// each taking half of a block's kv tiles, or two heads' groups sharing them (`fa_mma_pair_*`).
#[derive(Clone, Copy)]
pub(super) struct MmaLaunch {
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
            (MMA_BM + 2 * MMA_BN) * (d + ROW_PAD) * 2 + MMA_BM * MMA_MASK_LD * 2
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
pub(super) fn mma_kernel(
    cx: &Cx<'_>,
    q: &TensorArg,
    k: &TensorArg,
    v: &TensorArg,
    kdt: DType,
    vdt: DType,
) -> Option<MmaLaunch> {
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

/// The tensor-core prefill: one block per 64 tokens of one query head (or of a head pair: see
/// [`MmaLaunch::blocks`]) of one sequence. `min_len` > 0 runs a ragged batch's sequences of at
/// least that many tokens (and zeroes its padding).
pub(super) fn run_mma(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    launch: MmaLaunch,
    min_len: usize,
) -> Result<(), BackendError> {
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (p, Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, .. }) = operands(task, ins)?;
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

#[cfg(test)]
mod tests {
    use super::super::MMA_MIN_TOKENS;
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
