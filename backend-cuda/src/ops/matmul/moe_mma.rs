//! mul_mat_id with few pairs an expert on tensor cores: `kernels/moe_mma.cu`. `moe_prep` groups
//! the (slot, token) pairs by expert on the device and packs the activations as `mmq_pack_x` does
//! (one launch); `moe_mma_*` then reads each routed expert's rows once for all its pairs
//! (`mma.sync`). Dense products of a few tokens run on the same kernels as one expert
//! (`dense_mma`). `moe.rs` (mul_mat_id) and `mod.rs` (mul_mat) decide when these kernels take a
//! product; this file owns their launch rules.

use tessera_graph::BackendError;
use tessera_ops::DType;

use super::mmq::{pack_x, values_bytes};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, tiles};

const MOE_PREP: Kernel = Kernel::new(Module::MoeMma, "moe_prep");
/// `[weights q8_0, nvfp4]`.
const MOE_MMA: [Kernel; 2] =
    [Kernel::new(Module::MoeMma, "moe_mma_q8_0"), Kernel::new(Module::MoeMma, "moe_mma_nvfp4")];
/// The narrow entries (one n8 tile a pass, `NARROW_STAGES` stages, four blocks a multiprocessor),
/// for launches of at most `NARROW_PAIRS` pairs an expert.
const MOE_MMA_N1: [Kernel; 2] =
    [Kernel::new(Module::MoeMma, "moe_mma_q8_0_n1"), Kernel::new(Module::MoeMma, "moe_mma_nvfp4_n1")];
const NARROW_STAGES: usize = 2;
const NARROW_PAIRS: i64 = 8;
/// `moe_mma_*`: warps a block, weight rows a work item, stages of a warp's ring, values a k-chunk
/// (`ME_WARPS`, `ME_ROWS`, `ME_STAGES`, 64 `ME_UNITS` in moe_mma.cu). TAG(moe-mma-smem)
const ME_WARPS: u32 = 4;
const ME_ROWS: i64 = 32;
const ME_STAGES: usize = 3;
const ME_CHUNK: i64 = 256;
/// Experts whose pair counts `moe_prep` keeps in shared memory: `ME_SHARED_EXPERTS`.
const ME_SHARED_EXPERTS: i64 = 4096;
/// Threads of a `moe_prep` block (its last block groups; a warp packs a row in the others).
const PREP_THREADS: u32 = 256;

/// Raw bytes of one row's 64 values: two q8_0 blocks or one nvfp4 block (`mq_raw_bytes`).
fn unit_bytes(d: DType) -> usize {
    if d == DType::Q8_0 { 68 } else { 36 }
}

/// Dynamic shared memory of a `moe_mma_*` block: TAG(moe-mma-smem), each warp's ring of
/// `ME_STAGES` stages (the narrow entries: `NARROW_STAGES`) of `ME_ROWS` rows of a k-chunk, 16
/// bytes of padding a row.
fn moe_shared_bytes(d: DType, narrow: bool) -> usize {
    let row = (ME_CHUNK / 64) as usize * unit_bytes(d) + 16;
    ME_WARPS as usize * if narrow { NARROW_STAGES } else { ME_STAGES } * ME_ROWS as usize * row
}

/// The `moe_mma_*` entry for experts of `d` and at most `max_pairs` pairs an expert (the narrow
/// one up to `NARROW_PAIRS`), and whether it is the narrow one. `TESSERA_MOE_NARROW=0` (read once
/// a process) turns the narrow entries off; `=N` takes them for routed experts (`routed`: more
/// than one slot a token) of up to N pairs, to measure them where experts have more pairs than
/// one n8 tile holds at most but few on average (a dense product keeps `NARROW_PAIRS`).
fn moe_kernel(d: DType, max_pairs: i64, routed: bool) -> (Kernel, bool) {
    static SET: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    let limit = match crate::launch::env_number(&SET, "TESSERA_MOE_NARROW") {
        Some(n) if n <= 0 => 0,
        Some(n) if routed => n,
        _ => NARROW_PAIRS,
    };
    let narrow = max_pairs <= limit;
    let i = usize::from(d == DType::NvFp4);
    (if narrow { MOE_MMA_N1[i] } else { MOE_MMA[i] }, narrow)
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
        && moe_shared_bytes(d, false) <= cx.info.max_shared_per_block
        && n_pairs <= i64::from(i32::MAX)
        && items <= i64::from(i32::MAX)
}

/// The pair lists of a dense mul_mat of 1 ..= `DensePairs::MAX` tokens run by `moe_mma_*` as one
/// expert with one slot: pair t is token t. Constant, so the backend writes them once
/// ([`DensePairs::table`]) and a step reads them in place (no grouping launch).
pub(crate) struct DensePairs;

impl DensePairs {
    pub const MAX: usize = 32;
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

/// `dense_mma`'s default least 32-row items for `n` tokens on `sms` multiprocessors: fewer leave
/// the device waiting on a few warps' streams. At 2 tokens 16 a multiprocessor: it must beat the
/// ring GEMV run twice, which only wide matrices' many warps let it do (the 151936-row output
/// projection, 36 a multiprocessor, by 18%; 17408 x 5120, 4 a multiprocessor, lost). At 3-16
/// tokens 1.5 a multiprocessor (17408 x 5120 beat the ring GEMV thrice and four times, and 8192
/// rows, 256 items, `gemv_fast` at 8 tokens and mmq at 16 on 132), 2 beyond (the 17-32-token
/// passes do twice the products a row: there 256 items lost to mmq;
/// docs/perf-log/kernels-matmul.md).
pub(super) fn dense_mma_min_items(sms: i64, n: i64) -> i64 {
    match n {
        ..=2 => 16 * sms,
        3..=16 => (3 * sms + 1) / 2,
        _ => 2 * sms,
    }
}
/// `dense_mma`'s fewest tokens: one token takes the ring GEMV, which reads a row nearer the copy
/// rate than a warp's stream of 32-row items.
pub(super) const DENSE_MMA_MIN_TOKENS: i64 = 2;

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
    // at most one pair a token an expert with distinct routing: the narrow entry up to 8 tokens
    // (correct for any pairs: more than 8 take more passes)
    let (kernel, narrow) = moe_kernel(d, n_pairs / n_used.max(1), n_used > 1);
    let shared = moe_shared_bytes(d, narrow) as u32;
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
    fn the_dense_pair_lists_name_one_expert_with_n_pairs() {
        let t = DensePairs::table();
        let int = |at: usize| i32::from_le_bytes(t[at..at + 4].try_into().unwrap());
        assert_eq!(
            (0..DensePairs::MAX).map(|i| int(4 * i)).collect::<Vec<_>>(),
            (0..DensePairs::MAX as i32).collect::<Vec<_>>()
        );
        for n in 1..=DensePairs::MAX {
            let g = DensePairs::groups(1 << 20, n);
            let at = (g.listed - (1 << 20)) as usize;
            assert_eq!(at % 16, 0);
            assert_eq!([int(at), int(at + 16), int(at + 20), int(at + 24)], [1, 0, 0, n as i32]);
        }
    }

    #[test]
    fn dense_mma_takes_fewer_items_a_multiprocessor_from_3_to_16_tokens() {
        // 132 multiprocessors: the 151936-row output projection (4748 items) from 2 tokens;
        // 17408 rows (544 items) from 3; 8192 rows (256 items) at 3-16 tokens, not at 2 or 32
        assert!(dense_mma_min_items(132, 2) <= 4748 && dense_mma_min_items(132, 2) > 544);
        assert!(dense_mma_min_items(132, 3) <= 256 && dense_mma_min_items(132, 16) <= 256);
        assert!(dense_mma_min_items(132, 32) > 256 && dense_mma_min_items(132, 32) <= 4748);
        assert!(dense_mma_min_items(132, 17) > dense_mma_min_items(132, 16));
    }

    #[test]
    fn the_narrow_entries_take_at_most_8_pairs_an_expert() {
        for d in [DType::Q8_0, DType::NvFp4] {
            for routed in [false, true] {
                assert_eq!(moe_kernel(d, 8, routed), (MOE_MMA_N1[usize::from(d == DType::NvFp4)], true));
                assert_eq!(moe_kernel(d, 9, routed), (MOE_MMA[usize::from(d == DType::NvFp4)], false));
            }
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
    fn every_kernel_is_defined_in_its_module() {
        for k in [MOE_PREP].into_iter().chain(MOE_MMA).chain(MOE_MMA_N1) {
            assert!(super::super::defined_in_its_module(k), "{k:?}");
        }
    }

    #[test]
    fn moe_mma_blocks_fit_hopper_and_ampere() {
        // three nvfp4 blocks an SM on Hopper (227 KiB a block, 228 an SM), one q8_0 block even on
        // an A100 (163 KiB)
        assert_eq!(moe_shared_bytes(DType::NvFp4, false), 4 * 3 * 32 * 160);
        assert_eq!(moe_shared_bytes(DType::Q8_0, false), 4 * 3 * 32 * 288);
        assert!(3 * moe_shared_bytes(DType::NvFp4, false) <= 228 * 1024);
        assert!(moe_shared_bytes(DType::Q8_0, false) <= 163 * 1024);
        // the narrow nvfp4 entry: four blocks a Hopper multiprocessor (its register bound)
        assert!(4 * moe_shared_bytes(DType::NvFp4, true) <= 228 * 1024);
    }
}
