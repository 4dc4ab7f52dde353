//! mul_mat of f32 weights against more than `GEMV_MAX_N` tokens on tensor cores
//! (`kernels/gemm_f32.cu`): split tf32 (3xTF32, about 21 significant bits a product) with f32
//! accumulation, reading both operands in place. It takes one matrix of K-contiguous, 16-byte
//! aligned rows and columns (K % 4 == 0); batches and other layouts stay on cuBLAS (`blas.rs`).
//! Products of few output tiles (the MoE router: 256 x 512 outputs, 32 tiles) split K so that
//! about two blocks a multiprocessor run, and add the splits up in a fixed order. It is taken
//! only there, few tiles of at least `MIN_TOKENS` tokens, where it was measured faster than
//! cuBLAS; at 1024^3 and at decode widths cuBLAS was faster (docs/perf-log/prefill-step.md).

use std::sync::OnceLock;

use tessera_graph::BackendError;
use tessera_ops::{DType, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{COUNTER_BYTES, Cx, TensorArg, config, env_number, tiles};

const GEMM_F32: Kernel = Kernel::new(Module::GemmF32, "gemm_f32");

/// Block tile (weight rows x tokens), values a k-tile, threads a block: `GF_BM`, `GF_BN`,
/// `GF_BK`, `GF_THREADS` in gemm_f32.cu.
const BM: i64 = 64;
const BN: i64 = 64;
const BK: i64 = 32;
const THREADS: u32 = 128;

/// Dynamic shared memory: `GF_STAGES` (4) stages of `GF_BM + GF_BN` rows of `GF_LD` (36) floats.
/// TAG(gemm-f32-smem)
const SHARED: u32 = 4 * (64 + 64) * 36 * 4;

/// Static shared memory of the kernel (its last-block flag), kept out of the dynamic budget.
const STATIC_SHARED: usize = 16;

/// Blocks a multiprocessor a split product aims at: 8 warps, so that one warp's loads and
/// conversions overlap another's mma (a split also costs its partial sums' round trip).
const BLOCKS_PER_SM: i64 = 2;

/// Split limits: at most `MAX_SPLITS` splits of at least `MIN_KTILES` k-tiles each; only
/// products of at most `MAX_SPLIT_TILES` tiles split (one zeroed block counter a tile), into at
/// most `MAX_SPLIT_BLOCKS` blocks (their partial sums are scratch: 4 MiB at most).
const MAX_SPLITS: i64 = 16;
const MIN_KTILES: i64 = 4;
const MAX_SPLIT_TILES: i64 = (COUNTER_BYTES / 4) as i64;
const MAX_SPLIT_BLOCKS: i64 = 256;

/// Fewest tokens (columns) `gemm_f32` takes; with at most `MAX_SPLIT_TILES` tiles, the shapes
/// where it was measured faster than cuBLAS.
const MIN_TOKENS: i64 = 256;

/// Bytes of one split block's partial sums: 32 f32 a thread.
const SPLIT_BLOCK_BYTES: usize = 32 * 4 * THREADS as usize;

/// `TESSERA_GEMM_F32`, read once a process: `0` leaves f32 weights to cuBLAS (to measure one
/// against the other), `N` >= 1 asks for N splits along K wherever the shape allows that many.
fn setting() -> Option<i64> {
    static SET: OnceLock<Option<i64>> = OnceLock::new();
    env_number(&SET, "TESSERA_GEMM_F32")
}

/// The most splits along K a product of M x N outputs over K may take (1: it does not split).
fn max_splits(m: i64, n: i64, k: i64) -> i64 {
    let all = tiles(m, BM) * tiles(n, BN);
    if all > MAX_SPLIT_TILES {
        return 1;
    }
    (tiles(k, BK) / MIN_KTILES).min(MAX_SPLITS).min(MAX_SPLIT_BLOCKS / all).max(1)
}

/// How `gemm_f32` covers a product: tiles along M (M fastest), tiles in all, splits along K a
/// tile, k-tiles a split (the last split may have fewer, none has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    tiles_m: i32,
    tiles: i64,
    splits: i32,
    kper: i32,
}

/// The plan for M x N outputs over K with `target` blocks wanted in all (`asked`: splits
/// asked for instead), within `max_splits`.
fn plan(m: i64, n: i64, k: i64, target: i64, asked: Option<i64>) -> Plan {
    let (tiles_m, all) = (tiles(m, BM), tiles(m, BM) * tiles(n, BN));
    let ktiles = tiles(k, BK).max(1);
    let splits = asked.unwrap_or(target / all.max(1)).clamp(1, max_splits(m, n, k));
    let kper = tiles(ktiles, splits);
    Plan { tiles_m: tiles_m as i32, tiles: all, splits: tiles(ktiles, kper) as i32, kper: kper as i32 }
}

/// Scratch for the split blocks' partial sums of f32 weights `a` against `b` (0 when the product
/// never splits).
pub(super) fn gemm_f32_scratch(a: &TensorMeta, b: &TensorMeta) -> usize {
    let (m, n, k) = (a.ne[1] as i64, b.ne[1] as i64, a.ne[0] as i64);
    let splits = max_splits(m, n, k);
    if a.dtype != DType::F32 || splits < 2 {
        return 0;
    }
    (tiles(m, BM) * tiles(n, BN) * splits) as usize * SPLIT_BLOCK_BYTES
}

/// Whether `gemm_f32` takes the product: f32 weights, one matrix each (no batch dimensions),
/// weight rows and activation columns of K contiguous f32 (K % 4 == 0) from 16-byte aligned
/// addresses, f32 output elements, at least `MIN_TOKENS` columns in at most `MAX_SPLIT_TILES`
/// tiles, its shared memory within `max_shared` bytes a block, and not turned off
/// (`TESSERA_GEMM_F32=0`).
pub(super) fn gemm_f32_fits(a: &TensorArg, d: DType, b: &TensorArg, out: &TensorArg, max_shared: usize) -> bool {
    let single = |t: &TensorArg| t.ne[2] == 1 && t.ne[3] == 1;
    let rows16 = |t: &TensorArg| t.nb[0] == 4 && t.nb[1] % 16 == 0 && t.data.is_multiple_of(16);
    let (m, n, k) = (a.ne[1], b.ne[1], a.ne[0]);
    d == DType::F32
        && setting() != Some(0)
        && single(a)
        && single(b)
        && single(out)
        && rows16(a)
        && rows16(b)
        && out.nb[0] == 4
        && out.nb[1] % 4 == 0
        && out.data.is_multiple_of(4)
        && m > 0
        && n > 0
        && k > 0
        && k % 4 == 0
        && n >= MIN_TOKENS
        && tiles(m, BM).saturating_mul(tiles(n, BN)) <= MAX_SPLIT_TILES
        && SHARED as usize + STATIC_SHARED <= max_shared
}

/// `out = a^T b` on `gemm_f32` for a product that `gemm_f32_fits`, split along K by `plan` with
/// the partial sums in scratch (`gemm_f32_scratch`).
pub(super) fn gemm_f32(cx: &mut Cx<'_>, a: TensorArg, b: TensorArg, out: TensorArg) -> Result<(), BackendError> {
    let target = BLOCKS_PER_SM * cx.info.multiprocessors.max(1) as i64;
    let p = plan(a.ne[1], b.ne[1], a.ne[0], target, setting());
    let blocks = (p.tiles * i64::from(p.splits)) as u32;
    cx.allow_shared(GEMM_F32, SHARED)?;
    let (partial, count) = (cx.scratch, cx.counters);
    let mut args = cx.kernel(GEMM_F32)?;
    args.arg(&a).arg(&b).arg(&out).arg(&p.tiles_m).arg(&p.splits).arg(&p.kper).arg(&partial).arg(&count);
    // SAFETY: `gemm_f32(a, b, out, tiles_m, splits, kper, partial, count)`: a [K, M] and b [K, N]
    // are single matrices of K contiguous f32 a row / column at 16-byte aligned addresses, K % 4
    // == 0 (`gemm_f32_fits`), read in whole 16-byte pieces inside rows < M, columns < N and k < K
    // only (the rest zero-filled without a read); out [M, N] f32 is written at rows < M, columns
    // < N only; blocks = tiles * splits, each split over kper >= 1 k-tiles inside K (`plan`);
    // with splits > 1 there are at most MAX_SPLIT_TILES tiles (count: zeroed block counters, one
    // a tile, left zeroed) and at most MAX_SPLIT_BLOCKS blocks of SPLIT_BLOCK_BYTES partial sums,
    // which `gemm_f32_scratch` sized at scratch; `SHARED` bytes were allowed above.
    unsafe { args.launch(config((blocks, 1, 1), (THREADS, 1, 1), SHARED)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_tiles_split_along_k_to_fill_the_gpu() {
        // the MoE router, 256 x 512 outputs over 2048 on 132 SMs: 32 tiles, 8 splits of 8 k-tiles
        let router = plan(256, 512, 2048, 2 * 132, None);
        assert_eq!(router, Plan { tiles_m: 4, tiles: 32, splits: 8, kper: 8 });
        // 1024^3: 256 tiles, more than there are counters: no split
        assert_eq!(plan(1024, 1024, 1024, 2 * 132, None), Plan { tiles_m: 16, tiles: 256, splits: 1, kper: 32 });
        // short K: no split below 2 * MIN_KTILES k-tiles
        assert_eq!(plan(64, 16, 128, 2 * 132, None).splits, 1);
        // tails: 33 k-tiles over 6 tiles, at most 8 splits of >= 4: 5 k-tiles a split, 7 splits
        assert_eq!(plan(130, 72, 1028, 2 * 132, None), Plan { tiles_m: 3, tiles: 6, splits: 7, kper: 5 });
        // asked-for splits stay within the limits
        assert_eq!(plan(256, 512, 2048, 2 * 132, Some(4)).splits, 4);
        assert_eq!(plan(256, 512, 2048, 2 * 132, Some(100)).splits, 8);
        assert_eq!(plan(1024, 1024, 1024, 2 * 132, Some(4)).splits, 1);
    }

    #[test]
    fn every_plan_fits_its_scratch_and_counters() {
        let meta = |ne: [usize; 2]| TensorMeta::contiguous("mul_mat", DType::F32, [ne[0], ne[1], 1, 1]).expect("meta");
        for (m, n, k) in
            [(256, 512, 2048), (130, 72, 1028), (67, 45, 100), (1, 9, 4), (4096, 9, 65536), (640, 520, 512)]
        {
            let scratch = gemm_f32_scratch(&meta([k, m]), &meta([k, n]));
            for target in [1, 64, 264, 1 << 20] {
                for asked in [None, Some(1), Some(3), Some(64)] {
                    let p = plan(m as i64, n as i64, k as i64, target, asked);
                    let ktiles = tiles(k as i64, BK);
                    assert!(p.splits >= 1 && p.kper >= 1, "{p:?}");
                    // every split has k-tiles, together all of them
                    assert!(i64::from(p.splits - 1) * i64::from(p.kper) < ktiles, "{p:?}");
                    assert!(i64::from(p.splits) * i64::from(p.kper) >= ktiles, "{p:?}");
                    if p.splits > 1 {
                        assert!(p.tiles <= MAX_SPLIT_TILES, "{p:?}");
                        assert!(p.tiles * i64::from(p.splits) * SPLIT_BLOCK_BYTES as i64 <= scratch as i64, "{p:?}");
                    }
                }
            }
        }
        // the largest split scratch
        assert_eq!(gemm_f32_scratch(&meta([2048, 256]), &meta([2048, 512])), 4 << 20);
    }

    #[test]
    fn the_kernel_is_in_its_module() {
        assert!(super::super::defined_in_its_module(GEMM_F32));
    }

    #[test]
    fn only_aligned_single_f32_matrices_fit() {
        let dense = |data: u64, ne: [i64; 2]| TensorArg {
            data,
            ne: [ne[0], ne[1], 1, 1],
            nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1]],
        };
        let (a, b, out) = (dense(256, [2048, 256]), dense(1 << 20, [2048, 512]), dense(1 << 24, [256, 512]));
        let fits = |a: &TensorArg, d: DType, b: &TensorArg| gemm_f32_fits(a, d, b, &out, 227 << 10);
        assert!(fits(&a, DType::F32, &b));
        assert!(!fits(&a, DType::F16, &b));
        assert!(!gemm_f32_fits(&a, DType::F32, &b, &out, 48 << 10));
        // K % 4, row strides and starts off 16 bytes, strided elements, batches
        assert!(!fits(&dense(256, [2046, 256]), DType::F32, &dense(1 << 20, [2046, 512])));
        assert!(!fits(&TensorArg { nb: [4, 8200, 0, 0], ..a }, DType::F32, &b));
        assert!(!fits(&TensorArg { data: 260, ..a }, DType::F32, &b));
        assert!(!fits(&a, DType::F32, &TensorArg { nb: [8, 8192, 0, 0], ..b }));
        assert!(!fits(&a, DType::F32, &TensorArg { ne: [2048, 512, 2, 1], ..b }));
        // decode widths and products of many tiles stay on cuBLAS
        assert!(!fits(&a, DType::F32, &dense(1 << 20, [2048, 255])));
        assert!(!gemm_f32_fits(&dense(256, [1024, 1024]), DType::F32, &dense(1 << 24, [1024, 1024]), &out, 227 << 10));
        // windows with aligned strides and starts fit
        assert!(fits(&TensorArg { data: 256 + 16, nb: [4, 8208, 0, 0], ..a }, DType::F32, &b));
    }
}
