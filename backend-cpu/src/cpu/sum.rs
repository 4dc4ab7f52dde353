//! Accurate f32 reductions: sums, sums of squares and dot products that stay precise on rows of
//! hundreds of thousands of elements.
//!
//! A plain left-to-right f32 sum of `n` terms has an error bound growing like `n * eps`. Here each
//! block of [`BLOCK`] elements is summed in [`LANES`] independent accumulators (which also lets
//! the compiler vectorise it), and the block sums are combined pairwise by a [`Cascade`] (a binary
//! counter: no recursion, no allocation), so the bound grows like
//! `(BLOCK / LANES + log2(n / BLOCK)) * eps`.
//!
//! The weight-times-activation dot product, the hot loop of matrix-vector products, has AVX2 + FMA
//! (+ F16C) kernels that read f32, f16 or bf16 weights straight from their bytes (unaligned loads,
//! conversion in registers), picked at run time when the CPU has the features.

use tessera_ops::DType;

use super::strided::decode;

/// Elements per leaf block.
pub(super) const BLOCK: usize = 256;
/// Independent accumulators inside a block.
const LANES: usize = 16;

/// Pairwise combination of block sums: after each push, equal-sized partial sums merge as the
/// trailing one-bits of the block count carry, exactly like a binary counter.
pub(super) struct Cascade {
    stack: [f32; usize::BITS as usize],
    depth: usize,
    count: usize,
}

impl Cascade {
    #[inline(always)]
    pub(super) fn new() -> Self {
        Cascade { stack: [0.0; usize::BITS as usize], depth: 0, count: 0 }
    }

    #[inline(always)]
    pub(super) fn push(&mut self, mut s: f32) {
        self.count += 1;
        let mut c = self.count;
        while c & 1 == 0 {
            self.depth -= 1;
            s += self.stack[self.depth];
            c >>= 1;
        }
        self.stack[self.depth] = s;
        self.depth += 1;
    }

    /// The total: the remaining partials, smallest (latest) first. (By reference: taking `self`
    /// by value made the compiler copy the whole stack, 272 bytes, on every call.)
    #[inline(always)]
    pub(super) fn finish(&mut self) -> f32 {
        let mut total = 0.0;
        while self.depth > 0 {
            self.depth -= 1;
            total += self.stack[self.depth];
        }
        total
    }
}

/// Sums lane accumulators pairwise.
#[inline(always)]
fn reduce_lanes(mut v: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            v[j] += v[j + width];
        }
    }
    v[0]
}

/// `sum_i f(x_i)` of one block, in [`LANES`] accumulators.
#[inline(always)]
fn block_map_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += f(c[j]);
        }
    }
    for (j, &v) in chunks.remainder().iter().enumerate() {
        acc[j] += f(v);
    }
    reduce_lanes(acc)
}

/// `sum_i f(x_i)`: block sums combined by a [`Cascade`]. A single block skips the cascade, whose
/// total would be `0.0 + s` (the same bits: `-0.0` becomes `+0.0` either way).
#[inline(always)]
fn map_sum(x: &[f32], f: impl Fn(f32) -> f32 + Copy) -> f32 {
    if x.len() <= BLOCK {
        return 0.0 + block_map_sum(x, f);
    }
    let mut c = Cascade::new();
    for block in x.chunks(BLOCK) {
        c.push(block_map_sum(block, f));
    }
    c.finish()
}

/// `sum x_i`.
pub(crate) fn sum(x: &[f32]) -> f32 {
    map_sum(x, |v| v)
}

/// `sum x_i^2`.
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    map_sum(x, |v| v * v)
}

/// `sum a_i * b_i` over one block (portable version).
fn block_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    for (j, (&x, &y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[j] += x * y;
    }
    reduce_lanes(acc)
}

/// `sum a_i * b_i` over the common length (portable version).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    if a.len().min(b.len()) <= BLOCK {
        return 0.0 + block_dot(a, b);
    }
    let mut c = Cascade::new();
    for (a, b) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        c.push(block_dot(a, b));
    }
    c.finish()
}

/// `sum_k w[k] * x[k]` over `x.len()` elements, where `w` holds at least that many dense
/// little-endian elements of `dtype` (f32, f16 or bf16). `scratch` is used by the portable path
/// to convert the weights.
pub(crate) fn dot_weights(dtype: DType, w: &[u8], x: &[f32], scratch: &mut Vec<f32>) -> f32 {
    let n = x.len().min(w.len() / dtype.block_bytes());
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = x86::dot_for(dtype) {
        // SAFETY: `dot_for` only returns a kernel whose target features the CPU has.
        return unsafe { d(&w[..n * dtype.block_bytes()], &x[..n]) };
    }
    scratch.resize(n, 0.0);
    decode(dtype, w, dtype.block_bytes(), scratch);
    dot(scratch, &x[..n])
}

/// `out[i] = dot_weights(dtype, row i, x)` for the rows of `w` that start `stride` bytes apart
/// (each `x.len()` dense elements of `dtype`, f32, f16 or bf16), with the same value per row as
/// [`dot_weights`] gives; the kernel is chosen once for all the rows.
pub(crate) fn dot_rows(dtype: DType, w: &[u8], stride: usize, x: &[f32], out: &mut [f32], scratch: &mut Vec<f32>) {
    let len = x.len() * dtype.block_bytes();
    if out.is_empty() {
        return;
    }
    assert!(w.len() >= (out.len() - 1) * stride + len, "dot_rows: {} rows of {len} bytes do not fit", out.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = x86::dot_rows_for(dtype) {
        // SAFETY: `dot_rows_for` only returns a kernel whose target features the CPU has.
        return unsafe { d(w, stride, x, out) };
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_weights(dtype, &w[i * stride..i * stride + len], x, scratch);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + FMA (+ F16C) dot kernels over raw weight bytes. Each reads 32 weights per step into
    //! four 8-lane FMA accumulators, reduces them per [`BLOCK`] and feeds the [`Cascade`].

    use std::arch::x86_64::*;

    use half::{bf16, f16};
    use tessera_ops::DType;

    use super::{BLOCK, Cascade};

    /// A dot kernel: `w` holds exactly `x.len()` elements.
    pub(super) type DotFn = unsafe fn(&[u8], &[f32]) -> f32;
    /// A dot kernel over `out.len()` rows `stride` bytes apart: `out[i] = dot(row i, x)`.
    pub(super) type DotRowsFn = unsafe fn(&[u8], usize, &[f32], &mut [f32]);

    /// The kernel for `dtype` if the CPU has its features.
    pub(super) fn dot_for(dtype: DType) -> Option<DotFn> {
        let base = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match dtype {
            DType::F32 if base => Some(dot_f32),
            DType::F16 if base && is_x86_feature_detected!("f16c") => Some(dot_f16),
            DType::BF16 if base => Some(dot_bf16),
            _ => None,
        }
    }

    /// The rows kernel for `dtype` if the CPU has its features.
    pub(super) fn dot_rows_for(dtype: DType) -> Option<DotRowsFn> {
        let base = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match dtype {
            DType::F32 if base => Some(dot_rows_f32),
            DType::F16 if base && is_x86_feature_detected!("f16c") => Some(dot_rows_f16),
            DType::BF16 if base => Some(dot_rows_bf16),
            _ => None,
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The sum over elements `start..end` (at most one [`BLOCK`]) of `w[k] * x[k]`: 32 weights per
    /// step into four 8-lane FMA accumulators, then the scalar tail. `$load(ptr)` turns 8 weights at
    /// byte pointer `ptr` into an `__m256`, `$scalar(bytes)` decodes one weight. Used only inside
    /// functions compiled with the kernel's features; the single and the rows kernels expand the
    /// same text, so they give the same bits.
    macro_rules! block_sum {
        ($w:expr, $x:expr, $start:expr, $end:expr, $eb:expr, $load:ident, $scalar:ident) => {{
            let (w, x, end): (&[u8], &[f32], usize) = ($w, $x, $end);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = $start;
            while i + 32 <= end {
                for (j, a) in acc.iter_mut().enumerate() {
                    let k = i + 8 * j;
                    // SAFETY: elements k..k + 8 are below `end <= x.len()`, and `w` holds x.len()
                    // elements of $eb bytes (asserted by the caller); the loads are unaligned.
                    let (wv, xv) = unsafe { ($load(w.as_ptr().add(k * $eb)), _mm256_loadu_ps(x.as_ptr().add(k))) };
                    *a = _mm256_fmadd_ps(wv, xv, *a);
                }
                i += 32;
            }
            let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut s = hsum(sum);
            for k in i..end {
                s += $scalar(&w[k * $eb..(k + 1) * $eb]) * x[k];
            }
            s
        }};
    }

    /// The dot of `w` (at least `x.len()` elements) and `x`: block sums combined by a [`Cascade`],
    /// or, for a single block, `0.0 + s` (the cascade's total of one block, the same bits).
    macro_rules! dot_body {
        ($w:expr, $x:expr, $eb:expr, $load:ident, $scalar:ident) => {{
            let (w, x): (&[u8], &[f32]) = ($w, $x);
            let n = x.len();
            assert!(w.len() >= n * $eb, "dot kernel: weights shorter than activations");
            if n <= BLOCK {
                0.0 + block_sum!(w, x, 0, n, $eb, $load, $scalar)
            } else {
                let mut cascade = Cascade::new();
                let mut start = 0;
                while start < n {
                    let end = (start + BLOCK).min(n);
                    cascade.push(block_sum!(w, x, start, end, $eb, $load, $scalar));
                    start = end;
                }
                cascade.finish()
            }
        }};
    }

    /// Generates a dot kernel and its rows kernel.
    macro_rules! dot_kernel {
        ($name:ident, $rows:ident, $features:literal, $eb:expr, $load:ident, $scalar:ident) => {
            /// # Safety
            /// The CPU has the features this kernel is compiled for.
            #[target_feature(enable = $features)]
            unsafe fn $name(w: &[u8], x: &[f32]) -> f32 {
                dot_body!(w, x, $eb, $load, $scalar)
            }

            /// # Safety
            /// The CPU has the features this kernel is compiled for.
            #[target_feature(enable = $features)]
            unsafe fn $rows(w: &[u8], stride: usize, x: &[f32], out: &mut [f32]) {
                let len = x.len() * $eb;
                for (i, o) in out.iter_mut().enumerate() {
                    *o = dot_body!(&w[i * stride..i * stride + len], x, $eb, $load, $scalar);
                }
            }
        };
    }

    /// 8 f32 weights.
    ///
    /// # Safety
    /// `p` points at 32 readable bytes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load_f32(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 32 readable bytes; the load is unaligned.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    /// 8 f16 weights, converted by F16C.
    ///
    /// # Safety
    /// `p` points at 16 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    /// 8 bf16 weights: bf16 is the top half of an f32, so widen to 32 bits and shift into place.
    ///
    /// # Safety
    /// `p` points at 16 readable bytes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load_bf16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes; the load is unaligned.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    fn scalar_f32(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    fn scalar_f16(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }

    fn scalar_bf16(b: &[u8]) -> f32 {
        bf16::from_le_bytes([b[0], b[1]]).to_f32()
    }

    dot_kernel!(dot_f32, dot_rows_f32, "avx2,fma", 4, load_f32, scalar_f32);
    dot_kernel!(dot_f16, dot_rows_f16, "avx2,fma,f16c", 2, load_f16, scalar_f16);
    dot_kernel!(dot_bf16, dot_rows_bf16, "avx2,fma", 2, load_bf16, scalar_bf16);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact_sum(x: &[f32]) -> f64 {
        x.iter().map(|&v| v as f64).sum()
    }

    #[test]
    fn sums_and_dots_match_f64_on_odd_lengths() {
        let mut scratch = Vec::new();
        for n in [0, 1, 15, 16, 17, 31, 33, 255, 256, 257, 1000, 4097] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 16.0 - 3.0).collect();
            let want = exact_sum(&x);
            assert!((sum(&x) as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "n = {n}");
            let sq: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
            assert!((sum_squares(&x) as f64 - sq).abs() <= 1e-6 * sq.max(1.0), "n = {n}");
            let y: Vec<f32> = x.iter().map(|v| v * 0.5 + 1.0).collect();
            let d: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((dot(&x, &y) as f64 - d).abs() <= 1e-5 * d.abs().max(1.0), "n = {n}");
            // the weights x are exact in f16 and bf16 (multiples of 1/16 below 8)
            let dt_bytes: [(DType, Vec<u8>); 3] = [
                (DType::F32, x.iter().flat_map(|v| v.to_le_bytes()).collect()),
                (DType::F16, x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()),
                (DType::BF16, x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()),
            ];
            for (dt, mut w) in dt_bytes {
                w.insert(0, 0); // misaligned on purpose
                let got = dot_weights(dt, &w[1..], &y, &mut scratch) as f64;
                assert!((got - d).abs() <= 1e-5 * d.abs().max(1.0), "{dt} n = {n}: {got} vs {d}");
            }
        }
    }

    /// The cascade over block sums, written out: what the single-block shortcuts must equal.
    fn cascaded(x: &[f32], f: impl Fn(f32) -> f32 + Copy) -> f32 {
        let mut c = Cascade::new();
        for block in x.chunks(BLOCK) {
            c.push(block_map_sum(block, f));
        }
        c.finish()
    }

    #[test]
    fn single_block_shortcuts_give_the_cascade_bits() {
        for n in [0, 1, 7, 64, 255, 256, 257, 600] {
            let mut x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 16.0 - 3.5).collect();
            if n == 1 {
                x[0] = -0.0; // 0.0 + -0.0 is +0.0, in both
            }
            assert_eq!(sum(&x).to_bits(), cascaded(&x, |v| v).to_bits(), "n = {n}");
            assert_eq!(sum_squares(&x).to_bits(), cascaded(&x, |v| v * v).to_bits(), "n = {n}");
        }
    }

    #[test]
    fn dot_rows_gives_each_row_the_bits_of_dot_weights() {
        let mut scratch = Vec::new();
        for n in [1, 31, 32, 64, 100, 256, 257, 700] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 97) as f32 / 32.0 - 1.5).collect();
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let eb = dt.block_bytes();
                // 5 rows, 3 bytes of padding between them, misaligned on purpose
                let stride = n * eb + 3;
                let mut w = vec![0u8; 1 + 5 * stride];
                for (i, b) in w[1..].iter_mut().enumerate() {
                    *b = ((i * 31 + 7) % 251) as u8 & if eb == 4 { 0xbf } else { 0x3f };
                }
                let w = &w[1..];
                let mut out = [0f32; 5];
                dot_rows(dt, w, stride, &x, &mut out, &mut scratch);
                for (r, &got) in out.iter().enumerate() {
                    let want = dot_weights(dt, &w[r * stride..r * stride + n * eb], &x, &mut scratch);
                    assert_eq!(got.to_bits(), want.to_bits(), "{dt} n = {n} row {r}");
                }
            }
        }
    }

    #[test]
    fn long_sum_keeps_precision_where_a_naive_sum_drifts() {
        // 1e6 copies of 0.1 plus a large head: the naive f32 sum is off by percent.
        let mut x = vec![0.1f32; 1_000_000];
        x[0] = 1000.0;
        let want = exact_sum(&x);
        let naive: f32 = x.iter().sum();
        let got = sum(&x) as f64;
        assert!((got - want).abs() / want < 1e-6, "cascade sum {got} vs {want}");
        assert!((naive as f64 - want).abs() / want > 1e-4, "the test would not catch a naive sum");
    }
}
