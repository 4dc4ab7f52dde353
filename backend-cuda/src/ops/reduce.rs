//! Row-wise ops over `ne[0]`: rms_norm, l2_norm, sum_rows, softmax, argmax, top_k and argsort
//! (`kernels/reduce.cu`).
//!
//! Rows of up to [`WARP_ROW_MAX`] elements run one warp per row, longer ones one block per row;
//! dense aligned f32 rows (the model's) keep the row in registers (`*_vec_*`; rms/l2 rows of up
//! to 256 run 8 or 16 lanes per row so that a warp has several rows in flight); long rows with
//! few of them (a vocabulary softmax or argmax) split over several blocks per row through scratch
//! partials. top_k and argsort sort u64 ranks (key, index): a warp selection in registers for
//! small k of short rows, a shared-memory bitonic sort of one tile for rows of up to
//! [`SORT_TILE`], a tournament of tiles for small k of longer rows, else tiles then merge passes
//! through scratch.

use tessera_graph::{BackendError, Task};
use tessera_ops::{DType, Op, SortOrder, TensorMeta};

use crate::compile::{Kernel, Module};
use crate::launch::{Cx, TensorArg, blocks_for, config, dt, unsupported};

const NORM_WARP: Kernel = Kernel::new(Module::Reduce, "norm_warp");
const NORM_BLOCK: Kernel = Kernel::new(Module::Reduce, "norm_block");
const NORM_VEC_WARP: Kernel = Kernel::new(Module::Reduce, "norm_vec_warp");
const NORM_VEC_BLOCK: Kernel = Kernel::new(Module::Reduce, "norm_vec_block");
const SUM_ROWS_WARP: Kernel = Kernel::new(Module::Reduce, "sum_rows_warp");
const SUM_ROWS_BLOCK: Kernel = Kernel::new(Module::Reduce, "sum_rows_block");
const SOFTMAX_WARP: Kernel = Kernel::new(Module::Reduce, "softmax_warp");
const SOFTMAX_BLOCK: Kernel = Kernel::new(Module::Reduce, "softmax_block");
const SOFTMAX_VEC_WARP: Kernel = Kernel::new(Module::Reduce, "softmax_vec_warp");
const SOFTMAX_VEC_BLOCK: Kernel = Kernel::new(Module::Reduce, "softmax_vec_block");
const NORM_VEC_SUB8: Kernel = Kernel::new(Module::Reduce, "norm_vec_sub8");
const NORM_VEC_SUB16: Kernel = Kernel::new(Module::Reduce, "norm_vec_sub16");
const SOFTMAX_SPLIT_PARTIAL: Kernel = Kernel::new(Module::Reduce, "softmax_split_partial");
const SOFTMAX_SPLIT_WRITE: Kernel = Kernel::new(Module::Reduce, "softmax_split_write");
const ARGMAX_WARP: Kernel = Kernel::new(Module::Reduce, "argmax_warp");
const ARGMAX_BLOCK: Kernel = Kernel::new(Module::Reduce, "argmax_block");
const ARGMAX_SPLIT_PARTIAL: Kernel = Kernel::new(Module::Reduce, "argmax_split_partial");
const ARGMAX_SPLIT_FINAL: Kernel = Kernel::new(Module::Reduce, "argmax_split_final");
const TOPK_WARP8: Kernel = Kernel::new(Module::Reduce, "topk_warp8");
const TOPK_WARP16: Kernel = Kernel::new(Module::Reduce, "topk_warp16");
const SORT_TILE_K: Kernel = Kernel::new(Module::Reduce, "sort_tile");
const MERGE_RUNS: Kernel = Kernel::new(Module::Reduce, "merge_runs");

/// Rows up to this long run one warp per row.
const WARP_ROW_MAX: i64 = 1024;
/// Threads of a block in warp mode (8 rows per block): `ROWS_PER_WARP_BLOCK` in reduce.cu.
const WARP_BLOCK_THREADS: u32 = 256;
const ROWS_PER_WARP_BLOCK: i64 = 8;
/// Rows at least this long, when there are at most [`SPLIT_MAX_ROWS`] of them, split over blocks
/// of [`SPLIT_CHUNK`] elements.
const SPLIT_MIN_ROW: i64 = 32768;
const SPLIT_MAX_ROWS: i64 = 256;
const SPLIT_CHUNK: i64 = 2048;
const SPLIT_THREADS: u32 = 256;
/// Elements sorted per block in shared memory: `SORT_TILE` in reduce.cu.
const SORT_TILE: i64 = 2048;
/// f32x4 registers per thread of the `*_vec_warp` / `*_vec_block` kernels (their `NV`).
const VEC_WARP: i64 = 8;
const VEC_BLOCK: i64 = 4;
/// TAG(norm-mode): `NORM_RMS` and `NORM_L2` in reduce.cu.
const NORM_RMS: i32 = 0;
const NORM_L2: i32 = 1;

/// Plain float inputs (the shape rules refuse the rest); for the sorts, rows and row counts the
/// i32 indices and the (rows, tiles) grid can address.
pub(crate) fn supports(op: &Op, inputs: &[TensorMeta]) -> bool {
    let Some(x) = inputs.first() else { return false };
    let plain = inputs.iter().all(|m| matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16));
    let n = x.ne[0] as i64;
    let rows = x.ne[1].saturating_mul(x.ne[2]).saturating_mul(x.ne[3]);
    match op {
        Op::TopK { .. } | Op::Argsort(_) => {
            plain && ceil_div(n, SORT_TILE) <= 65535 && n <= i32::MAX as i64 && rows <= i32::MAX as usize
        }
        _ => plain,
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

fn rows_of(ne: [i64; 4]) -> i64 {
    ne[1] * ne[2] * ne[3]
}

/// Long rows, few of them: split each over several blocks (softmax and argmax).
fn split_chunks(ne: [i64; 4]) -> Option<i64> {
    (ne[0] >= SPLIT_MIN_ROW && rows_of(ne) <= SPLIT_MAX_ROWS).then(|| ceil_div(ne[0], SPLIT_CHUNK))
}

/// How top_k / argsort runs a row of `n` for the first `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SortPlan {
    /// One warp per row, `E` ranks per lane (8 or 16).
    Warp(u32),
    /// One block sorts the whole row padded to `p` (a power of two <= SORT_TILE).
    Tile(u32),
    /// Small k of long rows: tiles keep their first k, and the kept ranks are tiled again until
    /// one tile is left (two scratch buffers of `rows * tournament_len(n, k)` ranks).
    Tournament,
    /// Tiles, then merge passes through two scratch buffers of `rows * n` ranks.
    Merge,
}

/// Ranks kept per row by the first tournament stage over a row of `n`.
fn tournament_len(n: i64, k: i64) -> i64 {
    let tiles = ceil_div(n, SORT_TILE);
    (tiles - 1) * k + k.min(n - (tiles - 1) * SORT_TILE)
}

fn sort_plan(n: i64, k: i64) -> SortPlan {
    if k <= 16 && n <= 256 {
        SortPlan::Warp(8)
    } else if k <= 16 && n <= 512 {
        SortPlan::Warp(16)
    } else if n <= SORT_TILE {
        SortPlan::Tile(pow2(n))
    } else if k <= SORT_TILE / 4 {
        SortPlan::Tournament
    } else {
        SortPlan::Merge
    }
}

fn pow2(n: i64) -> u32 {
    (n.max(1) as u64).next_power_of_two() as u32
}

fn sort_args(task: &Task<'_>) -> Option<(bool, i64)> {
    let n = task.inputs.first()?.meta.ne[0] as i64;
    match task.op {
        Op::TopK { k } => Some((true, *k as i64)),
        Op::Argsort(order) => Some((*order == SortOrder::Descending, n)),
        _ => None,
    }
}

pub(crate) fn scratch_bytes(task: &Task<'_>) -> usize {
    let Some(x) = task.inputs.first() else { return 0 };
    let ne = x.meta.ne.map(|v| v as i64);
    let bytes = match task.op {
        Op::Softmax(_) | Op::Argmax => split_chunks(ne).map_or(0, |c| c * rows_of(ne) * 8),
        Op::TopK { .. } | Op::Argsort(_) => match sort_args(task) {
            Some((_, k)) => match sort_plan(ne[0], k) {
                SortPlan::Merge => 2 * rows_of(ne) * ne[0] * 8,
                SortPlan::Tournament => 2 * rows_of(ne) * tournament_len(ne[0], k) * 8,
                _ => 0,
            },
            None => 0,
        },
        _ => 0,
    };
    bytes.max(0) as usize
}

/// Warp mode (8 rows per block) or block mode (threads per block) for rows of `n`.
fn row_launch(n: i64, rows: i64) -> (bool, u32, u32) {
    if n <= WARP_ROW_MAX {
        (true, WARP_BLOCK_THREADS, blocks_for(rows, ROWS_PER_WARP_BLOCK as u32))
    } else {
        let threads = if n <= 4096 {
            256
        } else if n <= 16384 {
            512
        } else {
            1024
        };
        (false, threads, blocks_for(rows, 1))
    }
}

/// The launch of a `*_vec_*` kernel for rows of `n` (a multiple of 4): a warp per row holding
/// up to VEC_WARP f32x4 per lane, or a block per row with VEC_BLOCK per thread; None when the row
/// does not fit in registers.
fn vec_launch(n: i64, rows: i64) -> Option<(bool, u32, u32)> {
    let n4 = n / 4;
    if n <= WARP_ROW_MAX {
        return (n4 <= VEC_WARP * 32).then(|| (true, WARP_BLOCK_THREADS, blocks_for(rows, ROWS_PER_WARP_BLOCK as u32)));
    }
    let threads = (ceil_div(n4, VEC_BLOCK) + 31) / 32 * 32;
    (threads <= 1024).then(|| (false, threads as u32, blocks_for(rows, 1)))
}

/// Rows of f32 that are dense and 16-byte aligned, as `norm_vec_*` reads and writes them.
pub(super) fn vec_rows(t: &TensorArg, dtype: DType) -> bool {
    dtype == DType::F32
        && t.nb[0] == 4
        && t.ne[0] % 4 == 0
        && t.data.is_multiple_of(16)
        && t.nb[1..].iter().all(|b| b % 16 == 0)
}

/// f16 rows that are dense and 8-byte aligned with ne0 % 4 == 0 (read 4 at a time).
fn half_rows(t: &TensorArg) -> bool {
    t.nb[0] == 2 && t.ne[0] % 4 == 0 && t.data.is_multiple_of(8) && t.nb[1..].iter().all(|b| b % 8 == 0)
}

pub(crate) fn run(cx: &mut Cx<'_>, task: &Task<'_>, ins: &[TensorArg], out: TensorArg) -> Result<(), BackendError> {
    let Some(&src) = ins.first() else { return Err(unsupported(task, "a row op takes an input")) };
    let sdt = dt(task.inputs[0].meta.dtype);
    let (n, rows) = (src.ne[0], rows_of(src.ne));
    if n == 0 || rows == 0 {
        return Ok(());
    }
    match task.op {
        Op::RmsNorm(p) => norm(cx, out, src, task.inputs[0].meta.dtype, p.eps, NORM_RMS),
        Op::L2Norm { eps } => norm(cx, out, src, task.inputs[0].meta.dtype, *eps, NORM_L2),
        Op::SumRows => {
            let (warp, threads, blocks) = row_launch(n, rows);
            let k = if warp { SUM_ROWS_WARP } else { SUM_ROWS_BLOCK };
            let mut a = cx.kernel(k)?;
            let vec = vec_rows(&src, task.inputs[0].meta.dtype) as i32;
            a.arg(&out).arg(&src).arg(&sdt).arg(&vec);
            // SAFETY: `sum_rows_*(dst, src, src_dt, vec)`; dst is [1, ne1, ne2, ne3] of src's rows,
            // the kernel reads i0 < ne0 of each row (as float4 only when vec_rows holds) and
            // writes element 0 of each dst row.
            unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
        }
        Op::Softmax(p) => {
            let (mask, mdt, has_mask) = match ins.get(1) {
                Some(m) => (*m, dt(task.inputs[1].meta.dtype), 1i32),
                None => (out, dt(DType::F32), 0i32),
            };
            softmax(cx, out, src, sdt, mask, mdt, has_mask, p.scale)
        }
        Op::Argmax => argmax(cx, out, src, sdt),
        Op::TopK { .. } | Op::Argsort(_) => {
            let Some((desc, k)) = sort_args(task) else { return Err(unsupported(task, "not a sort")) };
            sort(cx, out, src, sdt, desc as i32, k)
        }
        _ => Err(unsupported(task, "not a row op")),
    }
}

fn norm(
    cx: &mut Cx<'_>,
    out: TensorArg,
    src: TensorArg,
    sdtype: DType,
    eps: f32,
    mode: i32,
) -> Result<(), BackendError> {
    let (n, rows) = (src.ne[0], rows_of(src.ne));
    let dense = vec_rows(&src, sdtype) && vec_rows(&out, DType::F32);
    // Rows of up to 64 f32x4: 8 or 16 lanes per row, 4 f32x4 per lane (`norm_vec_sub*`).
    if dense && n <= 256 {
        let (k, lanes) = if n <= 128 { (NORM_VEC_SUB8, 8) } else { (NORM_VEC_SUB16, 16) };
        let mut a = cx.kernel(k)?;
        a.arg(&out).arg(&src).arg(&eps).arg(&mode);
        let per_block = WARP_BLOCK_THREADS / lanes;
        // SAFETY: `norm_vec_sub*(dst, src, eps, mode)`; dense 16-byte aligned f32 rows with
        // ne0 % 4 == 0 (vec_rows) and ne0 / 4 <= 4 * lanes, so the float4 accesses stay in each
        // row; lanes of rows >= ne1 * ne2 * ne3 touch no memory.
        return unsafe { a.launch(config((blocks_for(rows, per_block), 1, 1), (WARP_BLOCK_THREADS, 1, 1), 0)) };
    }
    if let Some((warp, threads, blocks)) = vec_launch(n, rows).filter(|_| dense) {
        let k = if warp { NORM_VEC_WARP } else { NORM_VEC_BLOCK };
        let mut a = cx.kernel(k)?;
        a.arg(&out).arg(&src).arg(&eps).arg(&mode);
        // SAFETY: `norm_vec_*(dst, src, eps, mode)`; both are f32 rows with nb0 = 4, ne0 % 4 == 0
        // and 16-byte aligned rows (checked above), so the float4 accesses i < ne0 / 4 stay in
        // each row; ne0 / 4 <= NV * group size (vec_launch), so the registers cover the row.
        unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
    } else {
        let (warp, threads, blocks) = row_launch(n, rows);
        let k = if warp { NORM_WARP } else { NORM_BLOCK };
        let sdt = dt(sdtype);
        let mut a = cx.kernel(k)?;
        a.arg(&out).arg(&src).arg(&sdt).arg(&eps).arg(&mode);
        // SAFETY: `norm_*(dst, src, src_dt, eps, mode)`; dst has src's shape (shape rules), every
        // access is i0 < ne0 of a row < ne1 * ne2 * ne3 through the tensors' strides.
        unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
    }
}

#[allow(clippy::too_many_arguments)]
fn softmax(
    cx: &mut Cx<'_>,
    out: TensorArg,
    src: TensorArg,
    sdt: i32,
    mask: TensorArg,
    mdt: i32,
    has_mask: i32,
    scale: f32,
) -> Result<(), BackendError> {
    let (n, rows) = (src.ne[0], rows_of(src.ne));
    if let Some(chunks) = split_chunks(src.ne) {
        let cfg = config((chunks as u32, rows as u32, 1), (SPLIT_THREADS, 1, 1), 0);
        let part = cx.scratch;
        for k in [SOFTMAX_SPLIT_PARTIAL, SOFTMAX_SPLIT_WRITE] {
            let mut a = cx.kernel(k)?;
            if k == SOFTMAX_SPLIT_WRITE {
                a.arg(&out);
            }
            a.arg(&src).arg(&sdt).arg(&mask).arg(&mdt).arg(&has_mask).arg(&scale).arg(&SPLIT_CHUNK).arg(&part);
            // SAFETY: `softmax_split_partial(src, src_dt, mask, mask_dt, has_mask, scale, chunk,
            // part)` and `softmax_split_write(dst, ...same)`; grid (chunks, rows) with chunks *
            // chunk >= ne0 and rows <= SPLIT_MAX_ROWS; `part` is scratch of chunks * rows float2
            // (scratch_bytes). The mask (when present) has ne0 columns and >= ne1 rows and its
            // dims 2, 3 divide src's (shape rules).
            unsafe { a.launch(cfg) }?;
        }
        return Ok(());
    }
    let mask_ok = has_mask == 0
        || match mdt {
            m if m == dt(DType::F16) => half_rows(&mask),
            _ => vec_rows(&mask, DType::F32),
        };
    let vec = vec_launch(n, rows)
        .filter(|_| sdt == dt(DType::F32) && vec_rows(&src, DType::F32) && vec_rows(&out, DType::F32) && mask_ok);
    if let Some((warp, threads, blocks)) = vec {
        let k = if warp { SOFTMAX_VEC_WARP } else { SOFTMAX_VEC_BLOCK };
        let mut a = cx.kernel(k)?;
        a.arg(&out).arg(&src).arg(&mask).arg(&mdt).arg(&has_mask).arg(&scale);
        // SAFETY: `softmax_vec_*(dst, src, mask, mask_dt, has_mask, scale)`; x, dst (and an f32
        // mask) are dense 16-byte aligned f32 rows, an f16 mask dense 8-byte aligned rows, ne0 %
        // 4 == 0 (checked above); the registers cover the row (vec_launch); the mask fits the
        // rows as the shape rules require.
        return unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) };
    }
    let (warp, threads, blocks) = row_launch(n, rows);
    let k = if warp { SOFTMAX_WARP } else { SOFTMAX_BLOCK };
    let mut a = cx.kernel(k)?;
    a.arg(&out).arg(&src).arg(&sdt).arg(&mask).arg(&mdt).arg(&has_mask).arg(&scale);
    // SAFETY: `softmax_*(dst, src, src_dt, mask, mask_dt, has_mask, scale)`; dst has src's shape,
    // the mask is read only when has_mask and then fits the rows as the shape rules require.
    unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
}

fn argmax(cx: &mut Cx<'_>, out: TensorArg, src: TensorArg, sdt: i32) -> Result<(), BackendError> {
    let (n, rows) = (src.ne[0], rows_of(src.ne));
    if let Some(chunks) = split_chunks(src.ne) {
        let part = cx.scratch;
        let mut a = cx.kernel(ARGMAX_SPLIT_PARTIAL)?;
        a.arg(&src).arg(&sdt).arg(&SPLIT_CHUNK).arg(&part);
        // SAFETY: `argmax_split_partial(src, src_dt, chunk, part)`; grid (chunks, rows), part is
        // scratch of chunks * rows int2 (scratch_bytes).
        unsafe { a.launch(config((chunks as u32, rows as u32, 1), (SPLIT_THREADS, 1, 1), 0)) }?;
        let mut a = cx.kernel(ARGMAX_SPLIT_FINAL)?;
        a.arg(&out).arg(&chunks).arg(&part);
        // SAFETY: `argmax_split_final(dst, chunks, part)`; one warp per dst row reads that row's
        // `chunks` partials written above.
        let blocks = blocks_for(rows, ROWS_PER_WARP_BLOCK as u32);
        return unsafe { a.launch(config((blocks, 1, 1), (WARP_BLOCK_THREADS, 1, 1), 0)) };
    }
    let (warp, threads, blocks) = row_launch(n, rows);
    let k = if warp { ARGMAX_WARP } else { ARGMAX_BLOCK };
    let mut a = cx.kernel(k)?;
    a.arg(&out).arg(&src).arg(&sdt);
    // SAFETY: `argmax_*(dst, src, src_dt)`; dst is i32 [1, ne1, ne2, ne3] of src's rows.
    unsafe { a.launch(config((blocks, 1, 1), (threads, 1, 1), 0)) }
}

fn sort(cx: &mut Cx<'_>, out: TensorArg, src: TensorArg, sdt: i32, desc: i32, k: i64) -> Result<(), BackendError> {
    let (n, rows) = (src.ne[0], rows_of(src.ne));
    let k32 = k as i32;
    match sort_plan(n, k) {
        SortPlan::Warp(e) => {
            let kernel = if e == 8 { TOPK_WARP8 } else { TOPK_WARP16 };
            let mut a = cx.kernel(kernel)?;
            a.arg(&out).arg(&src).arg(&sdt).arg(&desc).arg(&k32);
            // SAFETY: `topk_warp*(dst, src, src_dt, desc, k)`; ne0 <= 32 * E and k <= 16 <= ne0
            // (sort_plan, shape rules); dst rows hold k indices.
            let blocks = blocks_for(rows, ROWS_PER_WARP_BLOCK as u32);
            unsafe { a.launch(config((blocks, 1, 1), (WARP_BLOCK_THREADS, 1, 1), 0)) }
        }
        SortPlan::Tile(_) => {
            let stage = Stage { input: (0, n, n), output: (0, 0, 0), cap: k };
            sort_tiles(cx, out, src, sdt, desc, k, stage, true)
        }
        SortPlan::Tournament => {
            // Stage 0 reads src; each stage keeps k of every tile, compacted (run offset k).
            let stride = tournament_len(n, k);
            let buf = [cx.scratch, cx.scratch + (rows * stride * 8) as u64];
            let (mut len, mut from) = (n, None::<usize>);
            while len > SORT_TILE {
                let to = from.map_or(0, |f| 1 - f);
                let input = from.map_or((0, n, n), |f| (buf[f], len, stride));
                let stage = Stage { input, output: (buf[to], stride, k), cap: k };
                sort_tiles(cx, out, src, sdt, desc, k, stage, false)?;
                len = tournament_len(len, k);
                from = Some(to);
            }
            let input = from.map_or((0, n, n), |f| (buf[f], len, stride));
            sort_tiles(cx, out, src, sdt, desc, k, Stage { input, output: (0, 0, 0), cap: k }, true)
        }
        SortPlan::Merge => {
            let buf = [cx.scratch, cx.scratch + (rows * n * 8) as u64];
            let stage = Stage { input: (0, n, n), output: (buf[0], n, SORT_TILE), cap: k };
            sort_tiles(cx, out, src, sdt, desc, k, stage, false)?;
            let (mut s, mut from) = (SORT_TILE, 0usize);
            while s < n {
                let last = 2 * s >= n;
                let fin = last as i32;
                let (input, output) = (buf[from], buf[1 - from]);
                let mut a = cx.kernel(MERGE_RUNS)?;
                let (nruns, width) = (ceil_div(n, s), k.min(s));
                a.arg(&input)
                    .arg(&output)
                    .arg(&rows)
                    .arg(&n)
                    .arg(&s)
                    .arg(&k)
                    .arg(&nruns)
                    .arg(&width)
                    .arg(&out)
                    .arg(&fin);
                // SAFETY: `merge_runs(in, out, rows, n, s, cap, nruns, width, dst, final)`; threads
                // cover nruns * width places per row and skip those past their run; both buffers are
                // rows * n u64 of scratch (scratch_bytes); runs of stride s truncated to cap = k
                // were written by the previous pass, and places < cap < n stay in the row.
                unsafe { a.launch(config((blocks_for(rows * nruns * width, 256), 1, 1), (256, 1, 1), 0)) }?;
                s *= 2;
                from = 1 - from;
            }
            Ok(())
        }
    }
}

/// Where a `sort_tile` stage reads its rows: src's values, or ranks of an earlier stage.
#[derive(Debug, Clone, Copy)]
struct Stage {
    /// Ranks buffer (0: read src), its row length and row stride.
    input: (u64, i64, i64),
    /// Output ranks buffer, its row stride and the offset between consecutive tiles' runs.
    output: (u64, i64, i64),
    /// Ranks kept per tile.
    cap: i64,
}

#[allow(clippy::too_many_arguments)]
fn sort_tiles(
    cx: &mut Cx<'_>,
    out: TensorArg,
    src: TensorArg,
    sdt: i32,
    desc: i32,
    k: i64,
    stage: Stage,
    fin: bool,
) -> Result<(), BackendError> {
    let rows = rows_of(src.ne);
    let (input, in_n, in_stride) = stage.input;
    let (runs, out_stride, out_run) = stage.output;
    let n = if input == 0 { src.ne[0] } else { in_n };
    let tiles = ceil_div(n, SORT_TILE).max(1) as u32;
    let p = if tiles > 1 { SORT_TILE as i32 } else { pow2(n) as i32 };
    let threads = (p as u32 / 2).clamp(32, 1024);
    let (k32, fin) = (k as i32, fin as i32);
    let mut a = cx.kernel(SORT_TILE_K)?;
    a.arg(&src).arg(&sdt).arg(&input).arg(&in_n).arg(&in_stride).arg(&desc).arg(&p).arg(&stage.cap);
    a.arg(&runs).arg(&out_stride).arg(&out_run).arg(&out).arg(&k32).arg(&fin);
    // SAFETY: `sort_tile(src, src_dt, in, in_n, in_stride, desc, p, cap, runs, out_stride,
    // out_run, dst, k, final)`; grid (rows, tiles) with tiles * SORT_TILE >= the row length and p
    // a power of two <= SORT_TILE covering each tile; an input buffer holds rows * in_stride
    // ranks (in_n <= in_stride per row); with final there is one tile and k <= its length indices
    // go to each dst row, else each tile writes min(cap, len) <= out_run ranks at tile * out_run
    // of a row of out_stride (the callers size them so, within scratch_bytes).
    unsafe { a.launch(config((rows as u32, tiles, 1), (threads, 1, 1), 0)) }
}
