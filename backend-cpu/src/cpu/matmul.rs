//! mul_mat: `a [K, M, A2, A3]` (weights: f32, f16, bf16, q8_0 or nvfp4, dense rows, any outer
//! strides) times `b [K, N, B2, B3]` (f32 activations, any strides) gives f32 `out [M, N, B2, B3]`
//! with `out[m, n, i2, i3] = sum_k a[k, m, i2 / (B2 / A2), i3 / (B3 / A3)] * b[k, n, i2, i3]`.
//!
//! Two paths:
//! - **GEMV** (`N <= GEMV_MAX_N`, decode): one dot product per output, parallel over weight rows.
//!   Each weight row is read from memory once for all `N` columns; the dots
//!   ([`super::sum::dot_weights`], and [`super::quant::dot_quantized`] for q8_0 / nvfp4) convert
//!   f16/bf16 weights and decode quantized blocks in registers, so nothing is converted to memory
//!   first.
//! - **GEMM**: `matrixmultiply::sgemm` (single-threaded, packed, AVX2/FMA/AVX-512 kernels picked at
//!   run time) on tiles of the output, run in parallel by rayon. sgemm takes arbitrary element
//!   strides, so f32 weights and activations are passed in place (`a` as the transposed
//!   `M x K` matrix); f16/bf16 and quantized weights are converted (dequantized) tile by tile (a
//!   bounded block of rows per task) into f32 scratch first.
//!
//! mul_mat_id ([`mul_mat_id`]) groups the routed (slot, token) pairs by expert and runs one
//! mul_mat per routed expert on a view of its weights, so each expert's weights are read once per
//! call whatever the number of tokens routed to it.

use rayon::prelude::*;
use smallvec::SmallVec;
use tessera_ops::{DType, KernelError, TensorMeta};

use super::par;
use super::quant::dot_quantized;
use super::strided::{Dst, SendPtr, Src, cast_f32, cast_f32_mut, row_coords, rows_per_task};
use super::sum::{dot_rows, dot_weights};

/// Largest `N` that takes the dot-product path (the quantized dots serve this many columns per
/// pass over a row).
const GEMV_MAX_N: usize = super::quant::MAX_COLS;
/// Largest `N` that takes the dot-product path with quantized weights: decoding a block in
/// registers for every 4 columns beats dequantizing whole weight panels for sgemm up to here.
const QUANT_GEMV_MAX_N: usize = 16;
/// Weight elements a GEMV task should at least read.
const GEMV_GRAIN: usize = 1 << 16;
/// f32 elements of converted weights one GEMM tile may hold (4 MiB), bounding scratch memory.
const CONVERT_ELEMS: usize = 1 << 20;
/// Output rows (`m`) per GEMM tile are a multiple of this: 16 f32 = one 64-byte cache line, so
/// tiles of the same columns do not share lines.
const M_ALIGN: usize = 16;

/// Sizes of one mul_mat.
struct Dims {
    k: usize,
    m: usize,
    n: usize,
    a_ne: [usize; 4],
    b_ne: [usize; 4],
}

impl Dims {
    fn of(a: &Src<'_>, b: &Src<'_>) -> Self {
        let (a_ne, b_ne) = (a.ne(), b.ne());
        Dims { k: a_ne[0], m: a_ne[1], n: b_ne[1], a_ne, b_ne }
    }

    fn batches(&self) -> usize {
        self.b_ne[2] * self.b_ne[3]
    }

    /// `(i2, i3)` of activation batch `batch`, and the weight batch `(a2, a3)` serving it: ggml's
    /// broadcast, each weight matrix serving `B2 / A2` consecutive activation batches.
    fn batch(&self, batch: usize) -> ([usize; 2], [usize; 2]) {
        let (i2, i3) = (batch % self.b_ne[2], batch / self.b_ne[2]);
        let (r2, r3) = (self.b_ne[2] / self.a_ne[2], self.b_ne[3] / self.a_ne[3]);
        ([i2, i3], [i2 / r2, i3 / r3])
    }
}

/// Writes `a * b` into `out` (the output span, f32 `[M, N, B2, B3]`). The shape rules have
/// checked the operands; an output that is not contiguous, aligned f32 (only hand-built tasks)
/// is computed into scratch first.
pub(super) fn mul_mat(a: Src<'_>, b: Src<'_>, out: &mut [u8], out_meta: &TensorMeta) -> Result<(), KernelError> {
    let count = out_meta.nelements();
    if out_meta.dtype == DType::F32
        && out_meta.is_contiguous()
        && let Some(c) = out.get_mut(..count * 4).and_then(cast_f32_mut)
    {
        compute(&a, &b, c);
        return Ok(());
    }
    let mut tmp = vec![0f32; count];
    compute(&a, &b, &mut tmp);
    let mut dst = Dst::new(out, *out_meta)?;
    let m = out_meta.ne[0];
    dst.for_each_row(m, || (), |_, r, mut row| row.store(&tmp[r * m..(r + 1) * m]));
    Ok(())
}

fn compute(a: &Src<'_>, b: &Src<'_>, c: &mut [f32]) {
    let d = Dims::of(a, b);
    let gemv_max = if a.dtype().is_quantized() { QUANT_GEMV_MAX_N } else { GEMV_MAX_N };
    if d.n <= gemv_max { gemv(a, b, &d, c) } else { gemm(a, b, &d, c) }
}

/// A tensor's data as f32 values with element strides (0 for dimensions of extent 1, whose byte
/// stride is never used and may be anything).
struct F32Layout<'a> {
    data: &'a [f32],
    strides: [usize; 4],
}

impl<'a> F32Layout<'a> {
    /// `src` in place, when it is f32, aligned, and every used stride is a whole number of
    /// elements.
    fn of(src: &Src<'a>) -> Option<Self> {
        let m = &src.meta;
        if m.dtype != DType::F32 || (0..4).any(|d| m.ne[d] > 1 && !m.nb[d].is_multiple_of(4)) {
            return None;
        }
        let strides = std::array::from_fn(|d| if m.ne[d] > 1 { m.nb[d] / 4 } else { 0 });
        let data = cast_f32(src.bytes().get(..src.bytes().len() / 4 * 4)?)?;
        Some(F32Layout { data, strides })
    }

    /// Element offset of `(0, i1, i2, i3)`.
    fn offset(&self, i1: usize, i2: usize, i3: usize) -> usize {
        i1 * self.strides[1] + i2 * self.strides[2] + i3 * self.strides[3]
    }
}

/// `src`'s rows decoded into one contiguous f32 buffer, in flat row order.
fn pack_rows(src: &Src<'_>) -> Vec<f32> {
    let (ne, k) = (src.ne(), src.ne()[0]);
    let mut packed = vec![0f32; src.meta.nelements()];
    par::chunks_mut(&mut packed, k, rows_per_task(k), || (), |_, r, row| src.load_row(row_coords(ne, r), row));
    packed
}

/// Activation columns `0..N` of batch `(i2, i3)` as one `[K, N]` f32 slice: borrowed in place when
/// they are dense, aligned f32 rows one after the other, else decoded into `scratch`.
fn columns<'s>(b: &Src<'s>, n_len: usize, [i2, i3]: [usize; 2], scratch: &'s mut Vec<f32>) -> &'s [f32] {
    let (k, nb) = (b.ne()[0], b.meta.nb);
    if b.dtype() == DType::F32 && nb[0] == 4 && (n_len == 1 || nb[1] == 4 * k) {
        let start = b.row_start([0, i2, i3]);
        // The span covers row N - 1, which ends at start + N * K * 4 (the rows are adjacent).
        if let Some(cols) = b.bytes().get(start..start + n_len * k * 4).and_then(cast_f32) {
            return cols;
        }
    }
    scratch.resize(n_len * k, 0.0);
    for (n, col) in scratch.chunks_exact_mut(k).enumerate() {
        b.load_row([n, i2, i3], col);
    }
    scratch
}

/// Per-task scratch of the GEMV rows.
#[derive(Default)]
struct GemvScratch {
    /// A weight row decoded to f32 (strided weights only).
    row: Vec<f32>,
    /// The portable dot's conversion buffer.
    conv: Vec<f32>,
}

/// Bytes of weight rows one pass over the columns covers (so that, with several columns, the
/// block stays in L1 between columns).
const GEMV_BLOCK_BYTES: usize = 32 << 10;
/// Most weight rows in one block.
const GEMV_BLOCK_ROWS: usize = 32;

/// `put(n, m0, &dots)` with `dots[i] = dot(a[:, m0 + i, a2, a3], cols[n])` for blocks of weight
/// rows `m0..` covering `rows`, for every column `n` of `cols` (`[K, N]`, `N <= QUANT_GEMV_MAX_N`
/// for quantized weights). A block of rows is read from memory once for all the columns; the dots
/// are [`dot_rows`] (the values of [`dot_weights`]) and [`dot_quantized`], so a value does not
/// depend on which block or task computed it.
fn gemv_rows(
    a: &Src<'_>,
    [a2, a3]: [usize; 2],
    cols: &[f32],
    rows: std::ops::Range<usize>,
    sc: &mut GemvScratch,
    mut put: impl FnMut(usize, usize, &[f32]),
) {
    let k = a.ne()[0];
    let n_len = cols.len() / k;
    let (dtype, row_bytes, stride) = (a.dtype(), a.meta.row_bytes(), a.meta.nb[1]);
    if dtype.is_quantized() {
        for m in rows {
            // Fused dequantize-dot: each block decoded once, in registers, for all columns.
            let start = a.row_start([m, a2, a3]);
            let w = &a.bytes()[start..start + row_bytes];
            let mut dots = [0f32; QUANT_GEMV_MAX_N];
            dot_quantized(dtype, w, cols, &mut dots[..n_len]);
            for (n, v) in dots[..n_len].iter().enumerate() {
                put(n, m, std::slice::from_ref(v));
            }
        }
        return;
    }
    if !a.dense_rows() {
        for m in rows {
            sc.row.resize(k, 0.0);
            a.load_row([m, a2, a3], &mut sc.row);
            for (n, col) in cols.chunks_exact(k).enumerate() {
                let v = dot_weights(DType::F32, bytemuck::cast_slice(&sc.row), col, &mut sc.conv);
                put(n, m, &[v]);
            }
        }
        return;
    }
    // Dense rows (the shape rules require it of weights): blocks read as raw bytes of their dtype.
    let per_block = (GEMV_BLOCK_BYTES / stride.max(row_bytes).max(1)).clamp(1, GEMV_BLOCK_ROWS);
    let mut dots = [0f32; GEMV_BLOCK_ROWS];
    for m0 in rows.clone().step_by(per_block) {
        let count = per_block.min(rows.end - m0);
        let start = a.row_start([m0, a2, a3]);
        let w = &a.bytes()[start..start + (count - 1) * stride + row_bytes];
        for (n, col) in cols.chunks_exact(k).enumerate() {
            dot_rows(dtype, w, stride, col, &mut dots[..count], &mut sc.conv);
            put(n, m0, &dots[..count]);
        }
    }
}

/// Dot-product path for small `N`: blocks of weight rows per batch, in parallel when there is
/// more than one block's worth of work, else serially straight into `c`.
fn gemv(a: &Src<'_>, b: &Src<'_>, d: &Dims, c: &mut [f32]) {
    let (k, m_len, n_len) = (d.k, d.m, d.n);
    let rows_per_task = (GEMV_GRAIN / k).clamp(1, m_len);
    let m_tasks = m_len.div_ceil(rows_per_task);
    if !par::split(d.batches() * m_tasks, 1) {
        let (mut sc, mut packed) = (GemvScratch::default(), Vec::new());
        for (batch, c) in c.chunks_exact_mut(m_len * n_len).enumerate() {
            let (bi, ai) = d.batch(batch);
            let cols = columns(b, n_len, bi, &mut packed);
            gemv_rows(a, ai, cols, 0..m_len, &mut sc, |n, m, v| {
                c[n * m_len + m..][..v.len()].copy_from_slice(v);
            });
        }
        return;
    }
    // Activation rows (columns of b), contiguous f32: row (n, i2, i3) at flat index n + N * batch.
    let packed;
    let b_rows = match F32Layout::of(b) {
        Some(l) if b.meta.is_contiguous() => l.data,
        _ => {
            packed = pack_rows(b);
            &packed
        }
    };
    let results: Vec<Vec<f32>> = (0..d.batches() * m_tasks)
        .into_par_iter()
        .map_init(GemvScratch::default, |sc, t| {
            let (batch, m0) = (t / m_tasks, t % m_tasks * rows_per_task);
            let m1 = (m0 + rows_per_task).min(m_len);
            let (_, ai) = d.batch(batch);
            let cols = &b_rows[batch * n_len * k..(batch + 1) * n_len * k];
            // res[n * len + (m - m0)]: this task's part of each output column.
            let len = m1 - m0;
            let mut res = vec![0f32; len * n_len];
            gemv_rows(a, ai, cols, m0..m1, sc, |n, m, v| {
                res[n * len + m - m0..][..v.len()].copy_from_slice(v);
            });
            res
        })
        .collect();
    for (t, res) in results.iter().enumerate() {
        let (batch, m0) = (t / m_tasks, t % m_tasks * rows_per_task);
        let len = res.len() / n_len;
        for (n, part) in res.chunks_exact(len).enumerate() {
            let at = batch * m_len * n_len + n * m_len + m0;
            c[at..at + len].copy_from_slice(part);
        }
    }
}

/// One GEMM task: output rows `m0..m1`, columns `n0..n1` of activation batch `batch`.
#[derive(Clone, Copy)]
struct Tile {
    batch: usize,
    m0: usize,
    m1: usize,
    n0: usize,
    n1: usize,
}

/// Splits the output into about `4 x threads` tiles: rows first (weights are then converted or
/// packed once per tile), columns only when there are too few row blocks.
fn plan_tiles(d: &Dims, threads: usize, converted: bool) -> Vec<Tile> {
    let target = if threads <= 1 { 1 } else { 4 * threads };
    let per_batch = target.div_ceil(d.batches()).max(1);
    let mut mc = d.m.div_ceil(per_batch).next_multiple_of(M_ALIGN).max(4 * M_ALIGN);
    if converted {
        mc = mc.min((CONVERT_ELEMS / d.k / M_ALIGN * M_ALIGN).max(M_ALIGN));
    }
    let mc = mc.min(d.m);
    let m_tiles = d.m.div_ceil(mc);
    let n_split = per_batch.div_ceil(m_tiles);
    let nc = if n_split <= 1 { d.n } else { d.n.div_ceil(n_split).max(64).min(d.n) };
    let mut tiles = Vec::new();
    for batch in 0..d.batches() {
        for m0 in (0..d.m).step_by(mc) {
            for n0 in (0..d.n).step_by(nc) {
                tiles.push(Tile { batch, m0, m1: (m0 + mc).min(d.m), n0, n1: (n0 + nc).min(d.n) });
            }
        }
    }
    tiles
}

/// sgemm path: tiles of the output in parallel.
fn gemm(a: &Src<'_>, b: &Src<'_>, d: &Dims, c: &mut [f32]) {
    let packed_b;
    let b_layout = match F32Layout::of(b) {
        Some(l) => l,
        None => {
            packed_b = pack_rows(b);
            let (k, n, b2) = (d.k, d.n, d.b_ne[2]);
            F32Layout { data: &packed_b, strides: [1, k, k * n, k * n * b2] }
        }
    };
    let a_layout = F32Layout::of(a);
    let tiles = plan_tiles(d, par::threads(), a_layout.is_none());
    let (c_len, c_ptr) = (c.len(), SendPtr(c.as_mut_ptr()));
    let (k, m_len, n_len) = (d.k, d.m, d.n);
    par::for_each_init(tiles.len(), 1, Vec::new, |scratch: &mut Vec<f32>, i| {
        let t = &tiles[i];
        let ([i2, i3], [a2, a3]) = d.batch(t.batch);
        let rows = t.m1 - t.m0;
        // The weights of rows m0..m1 as an (m x k) matrix: in place, or converted into scratch.
        let (a_rows, rsa, csa): (&[f32], usize, usize) = match &a_layout {
            Some(l) => (&l.data[l.offset(t.m0, a2, a3)..], l.strides[1], l.strides[0]),
            None => {
                scratch.resize(rows * k, 0.0);
                for (i, row) in scratch.chunks_exact_mut(k).enumerate() {
                    a.load_row([t.m0 + i, a2, a3], row);
                }
                (&scratch[..], k, 1)
            }
        };
        let bs = b_layout.strides;
        let b_cols = &b_layout.data[b_layout.offset(t.n0, i2, i3)..];
        let c_off = t.batch * m_len * n_len + t.n0 * m_len + t.m0;
        // The last element this tile writes must lie in `c`.
        assert!(c_off + (rows - 1) + (t.n1 - t.n0 - 1) * m_len < c_len, "mul_mat tile outside the output");
        // SAFETY: `a_rows` holds `rows` rows of `k` elements at strides (rsa, csa): the rows of a
        // validated weight span (the span check covers every (k, m) element) or of the scratch
        // sized `rows * k`. `b_cols` likewise covers `k x (n1 - n0)` elements of the validated
        // activation span or of the packed copy. The C block (rows x cols at strides 1 and M)
        // lies inside `c` (asserted above), and tiles cover disjoint (batch, m, n) ranges, so no
        // two tasks write the same element; `c` is borrowed mutably for the whole call. beta = 0,
        // so C is written without being read.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                t.n1 - t.n0,
                1.0,
                a_rows.as_ptr(),
                rsa as isize,
                csa as isize,
                b_cols.as_ptr(),
                bs[0] as isize,
                bs[1] as isize,
                0.0,
                c_ptr.get().add(c_off),
                1,
                m_len as isize,
            );
        }
    });
}

/// `out[:, u, t] = experts[:, :, ids[u, t]]^T b[:, u mod n_b, t]` (ggml's mul_mat_id) for
/// `experts [K, N, n_expert]` (dense rows, any dtype mul_mat takes), `b [K, n_b, T]` f32 (any
/// strides), `ids` i32 `[n_used, T]`, into f32 `out [N, n_used, T]`.
///
/// Every id is checked before anything is computed (the first bad one in logical order is the
/// `IndexOutOfRange` error, as in the reference). The (slot, token) pairs are grouped by expert;
/// each routed expert's pairs gather their activation rows into one contiguous `[K, pairs]`
/// matrix, multiplied by a view of the expert's weights with [`compute`] (GEMV for up to
/// `GEMV_MAX_N` pairs, GEMM beyond), experts in parallel.
pub(super) fn mul_mat_id(
    experts: Src<'_>,
    b: Src<'_>,
    ids: Src<'_>,
    out: &mut [u8],
    out_meta: &TensorMeta,
) -> Result<(), KernelError> {
    let [k, n_rows, n_expert, _] = experts.ne();
    let n_b = b.ne()[1];
    let [n_used, n_tokens, _, _] = ids.ne();
    if out_meta.ne != [n_rows, n_used, n_tokens, 1] || n_b == 0 || !n_used.is_multiple_of(n_b) {
        return Err(KernelError::Unsupported {
            op: "mul_mat_id",
            why: format!("output {:?} does not match the inputs", out_meta.ne),
        });
    }
    // (expert, flat slot `u + n_used * t`) of every routed pair, sorted by expert and, within an
    // expert, by slot (the pairs are listed in slot order and the sort is stable).
    let mut pairs: SmallVec<[(usize, usize); 16]> = SmallVec::with_capacity(n_used * n_tokens);
    for t in 0..n_tokens {
        for u in 0..n_used {
            let id = ids.elem_i32([u, t, 0, 0]);
            match usize::try_from(id) {
                Ok(e) if e < n_expert => pairs.push((e, u + n_used * t)),
                _ => {
                    return Err(KernelError::IndexOutOfRange {
                        op: "mul_mat_id",
                        index: i64::from(id),
                        limit: n_expert,
                        what: "expert id",
                    });
                }
            }
        }
    }
    pairs.sort_by_key(|&(e, _)| e);
    let slots: SmallVec<[usize; 16]> = pairs.iter().map(|&(_, s)| s).collect();
    // groups[g] = (expert, start, end): expert g serves slots[start..end].
    let mut groups: SmallVec<[(usize, usize, usize); 16]> = SmallVec::new();
    for (i, &(e, _)) in pairs.iter().enumerate() {
        match groups.last_mut() {
            Some((last, _, end)) if *last == e => *end = i + 1,
            _ => groups.push((e, i, i + 1)),
        }
    }
    let emeta = experts.meta;
    let expert_meta = TensorMeta { ne: [k, n_rows, 1, 1], ..emeta };
    let bad = |why: &str| KernelError::Unsupported { op: "mul_mat_id", why: why.into() };
    // An expert's rows lie inside the validated span of all experts.
    let weights = |e: usize| {
        experts
            .bytes()
            .get(e * emeta.nb[2]..)
            .and_then(|bytes| Src::new(bytes, expert_meta))
            .ok_or_else(|| bad("expert weights outside their span"))
    };
    // Writes every routed output column into `c` (the f32 output, contiguous).
    let fill = |c: &mut [f32]| -> Result<(), KernelError> {
        let gemv_max = if experts.dtype().is_quantized() { QUANT_GEMV_MAX_N } else { GEMV_MAX_N };
        // Experts in parallel when there is more than about one GEMV task's worth of work.
        let per_task = (GEMV_GRAIN * groups.len() / (k * n_rows * slots.len()).max(1)).max(1);
        if !par::split(groups.len(), per_task) {
            let (mut sc, mut act, mut res) = (GemvScratch::default(), Vec::new(), Vec::new());
            for &(e, start, end) in &groups {
                let w = weights(e)?;
                let slots = &slots[start..end];
                let cols = expert_columns(&b, slots, n_used, &mut act);
                if slots.len() <= gemv_max {
                    gemv_rows(&w, [0, 0], cols, 0..n_rows, &mut sc, |n, m, v| {
                        c[slots[n] * n_rows + m..][..v.len()].copy_from_slice(v);
                    });
                    continue;
                }
                let act_src = columns_src(cols, k, slots.len()).ok_or_else(|| bad("packed activations do not fit"))?;
                res.resize(n_rows * slots.len(), 0.0);
                compute(&w, &act_src, &mut res);
                for (&s, col) in slots.iter().zip(res.chunks_exact(n_rows)) {
                    c[s * n_rows..(s + 1) * n_rows].copy_from_slice(col);
                }
            }
        } else {
            let results: Vec<Vec<f32>> = par::try_map(groups.len(), 1, |g| {
                let (e, start, end) = groups[g];
                let w = weights(e)?;
                let slots = &slots[start..end];
                let mut act = Vec::new();
                let cols = expert_columns(&b, slots, n_used, &mut act);
                let act_src = columns_src(cols, k, slots.len()).ok_or_else(|| bad("packed activations do not fit"))?;
                let mut res = vec![0f32; n_rows * slots.len()];
                compute(&w, &act_src, &mut res);
                Ok(res)
            })?;
            for (&(_, start, end), res) in groups.iter().zip(&results) {
                for (&s, col) in slots[start..end].iter().zip(res.chunks_exact(n_rows)) {
                    c[s * n_rows..(s + 1) * n_rows].copy_from_slice(col);
                }
            }
        }
        Ok(())
    };
    let count = out_meta.nelements();
    if out_meta.dtype == DType::F32
        && out_meta.is_contiguous()
        && let Some(c) = out.get_mut(..count * 4).and_then(cast_f32_mut)
    {
        return fill(c);
    }
    let mut tmp = vec![0f32; count];
    fill(&mut tmp)?;
    let mut dst = Dst::new(out, *out_meta)?;
    dst.for_each_row(n_rows, || (), |_, r, mut row| row.store(&tmp[r * n_rows..(r + 1) * n_rows]));
    Ok(())
}

/// The activation rows `b[:, u mod n_b, t]` of flat slots `u + n_used * t`, as one `[K, slots]`
/// f32 slice: borrowed for a single dense aligned f32 row, else decoded into `scratch`.
fn expert_columns<'s>(b: &Src<'s>, slots: &[usize], n_used: usize, scratch: &'s mut Vec<f32>) -> &'s [f32] {
    let (k, n_b) = (b.ne()[0], b.ne()[1]);
    let coords = |s: usize| [s % n_used % n_b, s / n_used, 0];
    if let [s] = slots
        && let Some(col) = b.row_f32(coords(*s))
    {
        return col;
    }
    scratch.resize(k * slots.len(), 0.0);
    for (col, &s) in scratch.chunks_exact_mut(k).zip(slots) {
        b.load_row(coords(s), col);
    }
    scratch
}

/// `cols` (`n` columns of `k` f32) as a contiguous `[k, n]` tensor.
fn columns_src(cols: &[f32], k: usize, n: usize) -> Option<Src<'_>> {
    let meta = TensorMeta::contiguous("mul_mat_id", DType::F32, [k, n, 1, 1]).ok()?;
    Src::new(bytemuck::cast_slice(cols), meta)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tessera_graph::{Graph, Session};
    use tessera_ops::DType;

    use crate::CpuBackend;
    use crate::cpu::testutil::{F32, FLOATS, check};

    /// f32 accumulation over K terms: allow a little more than rounding noise.
    const BOUND: f64 = 1e-11;

    #[test]
    fn gemm_and_gemv_of_each_weight_dtype_on_odd_sizes() {
        for dt in FLOATS {
            for n in [1, 2, 3, 4, 5, 9, 33] {
                check(40 + n as u64, BOUND, |g, l| {
                    let a = l.random(g.parameter("w", dt, [37, 19, 1, 1])?);
                    let b = l.random(g.input("x", F32, [37, n, 1, 1])?);
                    Ok(vec![g.mul_mat(a, b)?])
                });
            }
        }
    }

    #[test]
    fn batches_broadcast_weights_over_dims_2_and_3() {
        for (dt, n) in [(F32, 6), (DType::F16, 6), (F32, 2), (DType::BF16, 1)] {
            check(50, BOUND, |g, l| {
                let a = l.random(g.parameter("w", dt, [16, 8, 2, 1])?);
                let b = l.random(g.input("x", F32, [16, n, 4, 3])?);
                let a3 = l.random(g.parameter("w3", dt, [16, 8, 2, 3])?);
                Ok(vec![g.mul_mat(a, b)?, g.mul_mat(a3, b)?])
            });
        }
    }

    #[test]
    fn strided_activations_and_weights() {
        for n in [3, 11] {
            check(51, BOUND, |g, l| {
                // weights: rows of 20 inside rows of 24, batch dims swapped by a permute
                let base = l.random(g.parameter("w", F32, [24, 7, 2, 3])?);
                let a = g.view(base, [20, 7, 2, 3], [4, 96, 672, 1344], 8)?;
                let a = g.permute(a, [0, 1, 3, 2])?; // [20, 7, 3, 2]
                // activations: transposed (nb[0] = n elements) and permuted batches
                let x = l.random(g.input("x", F32, [n, 20, 3, 2])?);
                let b = g.transpose(x)?; // [20, n, 3, 2]
                let h = l.random(g.parameter("h", DType::F16, [20, 7, 3, 2])?);
                Ok(vec![g.mul_mat(a, b)?, g.mul_mat(h, b)?])
            });
        }
    }

    #[test]
    fn large_tiles_split_over_rows_and_columns() {
        // Enough work for several tiles per thread; M not a multiple of the tile alignment.
        for (dt, m, n) in [(F32, 300, 70), (DType::F16, 300, 70), (F32, 40, 700)] {
            check(52, BOUND, |g, l| {
                let a = l.random(g.parameter("w", dt, [129, m, 1, 1])?);
                let b = l.random(g.input("x", F32, [129, n, 1, 1])?);
                Ok(vec![g.mul_mat(a, b)?])
            });
        }
    }

    #[test]
    fn long_dot_products_keep_precision() {
        for n in [2, 8] {
            check(53, 1e-12, |g, l| {
                let a = l.random(g.parameter("w", F32, [20_000, 3, 1, 1])?);
                let b = l.random_in(g.input("x", F32, [20_000, n, 1, 1])?, 0.0, 1.0);
                Ok(vec![g.mul_mat(a, b)?])
            });
        }
    }

    const QUANT: [DType; 2] = [DType::Q8_0, DType::NvFp4];

    #[test]
    fn quantized_weights_on_both_paths() {
        // The judge reads the same quantized bytes, so the bound is that of f32 weights.
        for dt in QUANT {
            for n in [1, 2, 4, 5, 17] {
                check(60 + n as u64, BOUND, |g, l| {
                    let a = l.random(g.parameter("w", dt, [192, 37, 1, 1])?);
                    let b = l.random(g.input("x", F32, [192, n, 1, 1])?);
                    Ok(vec![g.mul_mat(a, b)?])
                });
            }
            // batch broadcast and a window of whole blocks (rows of 128 inside rows of 192)
            check(61, BOUND, |g, l| {
                let a = l.random(g.parameter("w", dt, [128, 8, 2, 1])?);
                let b = l.random(g.input("x", F32, [128, 6, 4, 1])?);
                let base = l.random(g.parameter("wb", dt, [192, 9, 1, 1])?);
                let row = base.meta().nb[1];
                let v = g.view(base, [128, 8, 1, 1], [dt.block_bytes(), row, 8 * row, 8 * row], row)?;
                let x = l.random(g.input("x1", F32, [128, 3, 1, 1])?);
                Ok(vec![g.mul_mat(a, b)?, g.mul_mat(v, x)?])
            });
        }
    }

    #[test]
    fn mul_mat_id_of_each_weight_dtype() {
        for dt in [F32, DType::F16, DType::BF16, DType::Q8_0, DType::NvFp4] {
            // (n_expert, n_used, n_tokens, n_b): decode, prefill (GEMM groups), broadcast.
            for (n_expert, n_used, n_tokens, n_b) in [(8, 2, 1, 2), (8, 4, 9, 4), (16, 8, 3, 1), (4, 4, 5, 1)] {
                check(70 + n_tokens as u64, BOUND, |g, l| {
                    let w = l.random(g.parameter("w", dt, [64, 24, n_expert, 1])?);
                    let b = l.random(g.input("x", F32, [64, n_b, n_tokens, 1])?);
                    let ids = g.input("ids", DType::I32, [n_used, n_tokens, 1, 1])?;
                    // distinct experts per token, as top-k gives
                    let mut v = Vec::new();
                    for _ in 0..n_tokens {
                        let start = l.rng.below(n_expert);
                        v.extend((0..n_used).map(|u| ((start + 3 * u) % n_expert) as f64));
                    }
                    let ids = l.values(ids, v);
                    Ok(vec![g.mul_mat_id(w, b, ids)?])
                });
            }
        }
    }

    #[test]
    fn mul_mat_id_with_strided_activations_and_repeated_experts() {
        check(80, BOUND, |g, l| {
            let w = l.random(g.parameter("w", DType::Q8_0, [96, 10, 6, 1])?);
            // activations [96, 2, 7] read through a permute of [96, 7, 2]
            let x = l.random(g.input("x", F32, [96, 7, 2, 1])?);
            let b = g.permute(x, [0, 2, 1, 3])?;
            let ids = g.input("ids", DType::I32, [2, 7, 1, 1])?;
            let ids = l.ids(ids, 6); // repeats allowed: both slots may name one expert
            Ok(vec![g.mul_mat_id(w, b, ids)?])
        });
    }

    #[test]
    fn mul_mat_id_rejects_out_of_range_ids_like_the_reference() {
        for bad in [-1.0, 4.0] {
            let e = crate::cpu::testutil::check_error(|g, l| {
                let w = l.random(g.parameter("w", F32, [32, 4, 4, 1])?);
                let b = l.random(g.input("x", F32, [32, 1, 2, 1])?);
                let ids = g.input("ids", DType::I32, [2, 2, 1, 1])?;
                let ids = l.values(ids, vec![0.0, 1.0, bad, 2.0]);
                Ok(vec![g.mul_mat_id(w, b, ids)?])
            });
            assert!(e.to_string().contains("expert id"), "{e}");
        }
    }

    /// GFLOP/s of `a [k, m] (dtype) x b [k, n]` on `backend`, best of `reps` runs.
    fn gflops(backend: &mut CpuBackend, dtype: DType, k: usize, m: usize, n: usize, reps: usize) -> f64 {
        let mut g = Graph::new();
        let a = g.parameter("w", dtype, [k, m, 1, 1]).unwrap();
        let b = g.input("x", F32, [k, n, 1, 1]).unwrap();
        let y = g.mul_mat(a, b).unwrap();
        g.mark_output(y).unwrap();
        let mut s = Session::new(&g, backend).unwrap();
        let wa: Vec<f32> = (0..k * m).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let wb: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect();
        s.set_f32(a, &wa).unwrap();
        s.set_f32(b, &wb).unwrap();
        s.run().unwrap(); // warm up
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            s.run().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        2.0 * (k * m * n) as f64 / best / 1e9
    }

    #[test]
    #[ignore = "timing, run by hand with --release"]
    fn timing_mul_mat_id() {
        let mut cpu = CpuBackend::new();
        // The Qwen3.6 MoE gate/up experts (2048 -> 512), 64 of them, top-8.
        for (dtype, n_tokens) in
            [(DType::Q8_0, 1), (DType::NvFp4, 1), (DType::Q8_0, 64), (DType::NvFp4, 64), (DType::Q8_0, 512)]
        {
            let (k, n, n_expert, n_used) = (2048, 512, 64, 8);
            let mut g = Graph::new();
            let w = g.parameter("w", dtype, [k, n, n_expert, 1]).unwrap();
            let b = g.input("x", F32, [k, 1, n_tokens, 1]).unwrap();
            let ids = g.input("ids", DType::I32, [n_used, n_tokens, 1, 1]).unwrap();
            let y = g.mul_mat_id(w, b, ids).unwrap();
            g.mark_output(y).unwrap();
            let mut s = Session::new(&g, &mut cpu).unwrap();
            let wv: Vec<f32> = (0..k * n * n_expert).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            s.set_f32(w, &wv).unwrap();
            s.set_f32(b, &vec![0.25; k * n_tokens]).unwrap();
            let iv: Vec<i32> = (0..n_used * n_tokens).map(|i| ((i % n_used) * 7 + i / n_used) as i32 % 64).collect();
            s.set_i32(ids, &iv).unwrap();
            s.run().unwrap();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t = Instant::now();
                s.run().unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            let flops = 2.0 * (k * n * n_used * n_tokens) as f64;
            println!("mul_mat_id {dtype} tokens={n_tokens}: {:.0} us, {:.1} GFLOP/s", best * 1e6, flops / best / 1e9);
        }
    }

    #[test]
    #[ignore = "timing, run by hand with --release"]
    fn timing_mul_mat() {
        let mut cpu = CpuBackend::new();
        println!("threads: {}", cpu.num_threads());
        for (dt, k, m, n) in [
            (F32, 1024, 1024, 1024),
            (DType::F16, 1024, 1024, 1024),
            (DType::BF16, 1024, 1024, 1024),
            (F32, 4096, 4096, 1),
            (DType::F16, 4096, 4096, 1),
            (DType::F16, 4096, 4096, 4),
            (DType::BF16, 4096, 4096, 1),
            (F32, 4096, 4096, 64),
            (DType::F16, 4096, 4096, 64),
            (DType::Q8_0, 4096, 4096, 1),
            (DType::Q8_0, 4096, 4096, 4),
            (DType::Q8_0, 4096, 4096, 8),
            (DType::Q8_0, 4096, 4096, 16),
            (DType::Q8_0, 4096, 4096, 17),
            (DType::NvFp4, 4096, 4096, 1),
            (DType::NvFp4, 4096, 4096, 16),
            (DType::NvFp4, 4096, 4096, 17),
            (DType::Q8_0, 4096, 4096, 64),
            (DType::NvFp4, 4096, 4096, 64),
        ] {
            let gf = gflops(&mut cpu, dt, k, m, n, 10);
            println!("mul_mat {dt} K={k} M={m} N={n}: {gf:.1} GFLOP/s");
        }
    }
}
