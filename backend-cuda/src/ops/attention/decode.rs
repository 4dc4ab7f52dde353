//! flash_attn_ext's tensor-core decode (`fa_dec_*`, kernels/attention_decode.cu), its splits merged
//! by `fa_combine` or, on sm_90+, by a cluster of their blocks (`fa_dec_x{2,4,8}_*`).

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, TensorMeta};

use super::simt::combine;
use super::{Optional, Plan, ROW_PAD, Tiling, Tokens, operands, tensor_core_dims, tile_plan};
use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, config};

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
/// The decode entries by K/V dtype and head dim (f16 d128, f16 d256, bf16 d128, bf16 d256).
const DEC_ENTRIES: [Kernel; 4] = [DEC_F16_D128, DEC_F16_D256, DEC_BF16_D128, DEC_BF16_D256];
/// Most blocks a decode cluster has (the portable cluster size).
const DEC_MAX_CLUSTER: usize = 8;
/// Most positions a split may take in a smaller cluster than its plan's (two chunks a warp).
const DEC_CLUSTER_MAX_SPLIT: usize = 2 * DEC_WARPS as usize * DEC_CHUNK;
/// TAG(fa-dec-tile): FD_W, FD_S, FD_N and FD_R in attention_decode.cu (query rows per block: one mma N
/// tile).
const DEC_WARPS: u32 = 4;
const DEC_STAGES: usize = 2;
const DEC_CHUNK: usize = 16;
const DEC_ROWS: usize = 8;
/// Blocks the decode kernel's split-K choice aims for: one per SM of an H100/H200 (at d 256 a
/// block takes 132 KiB of shared memory; fixed so that `scratch_bytes` can compute it from the
/// task alone).
pub(super) const DEC_TARGET_BLOCKS: usize = 132;
/// 8-row tiles (one mma N tile), splits that are multiples of a block's chunks.
const DEC_TILING: Tiling = Tiling {
    rows: DEC_ROWS,
    target: DEC_TARGET_BLOCKS,
    min_split: DEC_WARPS as usize * DEC_CHUNK,
    align: DEC_WARPS as usize * DEC_CHUNK,
};

/// The decode kernel's geometry.
pub(super) fn dec_plan(
    q: &TensorMeta,
    k: &TensorMeta,
    v: &TensorMeta,
    table: Option<&TensorMeta>,
    tokens: Tokens,
) -> Plan {
    tile_plan(q, k, v, table, &DEC_TILING, tokens)
}

/// The tensor-core decode kernel for these K/V, if it applies (see [`tensor_core_dims`]): its
/// index in [`DEC_ENTRIES`] and its dynamic shared memory.
pub(super) fn dec_kernel(
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
    let row = (d + ROW_PAD) * 2;
    let shared = DEC_WARPS as usize * DEC_STAGES * 2 * DEC_CHUNK * row;
    (shared <= cx.info.max_shared_per_block).then_some((kernel, shared as u32))
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
pub(super) fn run_dec(
    cx: &mut Cx<'_>,
    task: &Task<'_>,
    ins: &[TensorArg],
    out: TensorArg,
    entry: usize,
    shared: u32,
    tokens: Tokens,
) -> Result<(), BackendError> {
    let meta = |i: usize| &task.inputs[i].meta;
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let (p, Optional { mask, table, offsets, kv_lens, gate, mask_dt: mdt, table_meta }) = operands(task, ins)?;
    let pl = dec_plan(meta(0), meta(1), meta(2), table_meta, tokens);
    let n_kv = table_meta.map_or(meta(1).ne[1], |t| t.ne[0]);
    let kernel_of = |c: usize| match c {
        2 => DEC_CLUSTER_ENTRIES[0][entry],
        4 => DEC_CLUSTER_ENTRIES[1][entry],
        8 => DEC_CLUSTER_ENTRIES[2][entry],
        _ => DEC_ENTRIES[entry],
    };
    let (pl, cluster) = if cx.info.compute_capability.0 >= 9 {
        let mut resident =
            |c: usize| Ok(cx.kernels.resident_clusters(kernel_of(c), c as u32, DEC_WARPS * 32, shared)?);
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
}
