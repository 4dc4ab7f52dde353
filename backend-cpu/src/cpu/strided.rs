//! Strided element access on host bytes: reading rows of tensors of any layout ([`Src`]) and
//! writing rows of any injective layout from parallel tasks ([`Dst`]).
//!
//! Every kernel of the CPU backend is written row by row (a row is `ne[0]` elements), so these two
//! types are the only place that knows about byte strides and dtypes. Rows whose elements are
//! dense get slice fast paths (`&[f32]` borrows, memcpy, half's SIMD f16 conversion); everything
//! else decodes element by element at its byte offset.
//!
//! Host data is little-endian (as `tessera_ops::host` reads it). The zero-copy `&[f32]` and
//! `&[f16]` views are only taken on little-endian targets and when the bytes happen to be aligned;
//! misaligned data (a tensor at an odd byte offset) takes the decoding path and gives the same
//! values.

use std::marker::PhantomData;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use tessera_ops::{DType, KernelError, TensorMeta, quant};

/// Elements a rayon task should at least process, so that tiny rows are batched into tasks
/// worth their scheduling cost.
pub(crate) const GRAIN: usize = 1 << 14;

/// Minimum rows per rayon task when each row costs about `work_per_row` elements.
pub(crate) fn rows_per_task(work_per_row: usize) -> usize {
    (GRAIN / work_per_row.max(1)).max(1)
}

/// The coordinates `(i1, i2, i3)` of flat row `r` of a tensor of shape `ne` (rows in logical
/// order: `i1` fastest).
#[inline]
pub(crate) fn row_coords(ne: [usize; 4], r: usize) -> [usize; 3] {
    // The rows of the first matrix (every row of a 2-d tensor) need no division.
    if r < ne[1] {
        return [r, 0, 0];
    }
    [r % ne[1], (r / ne[1]) % ne[2], r / (ne[1] * ne[2])]
}

/// Bytes from a tensor's first byte to one past its last, like `TensorMeta::span_bytes`, but
/// `None` (instead of a panic or a wrapped value) when a dimension is empty or the arithmetic
/// overflows. Backends call this on hand-built descriptors before trusting them.
pub(crate) fn checked_span(meta: &TensorMeta) -> Option<usize> {
    let bs = meta.dtype.block_size();
    let blocks0 = if bs == 1 { meta.ne[0] } else { meta.ne[0] / bs };
    let mut span = meta.dtype.block_bytes();
    for (d, (&ne, &nb)) in meta.ne.iter().zip(&meta.nb).enumerate() {
        let count = if d == 0 { blocks0 } else { ne };
        if count == 0 {
            return None;
        }
        span = span.checked_add((count - 1).checked_mul(nb)?)?;
    }
    Some(span)
}

/// `bytes` as f32 values, when the target is little-endian and `bytes` is 4-byte aligned with a
/// length that is a multiple of 4.
pub(crate) fn cast_f32(bytes: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "little") { bytemuck::try_cast_slice(bytes).ok() } else { None }
}

/// Mutable version of [`cast_f32`].
pub(crate) fn cast_f32_mut(bytes: &mut [u8]) -> Option<&mut [f32]> {
    if cfg!(target_endian = "little") { bytemuck::try_cast_slice_mut(bytes).ok() } else { None }
}

fn cast_f16(bytes: &[u8]) -> Option<&[f16]> {
    if cfg!(target_endian = "little") { bytemuck::try_cast_slice(bytes).ok() } else { None }
}

fn cast_f16_mut(bytes: &mut [u8]) -> Option<&mut [f16]> {
    if cfg!(target_endian = "little") { bytemuck::try_cast_slice_mut(bytes).ok() } else { None }
}

/// Decodes one element of `dtype` from the start of `b` (which holds at least one element).
#[inline]
fn read_elem(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32,
        DType::Q8_0 | DType::NvFp4 => unreachable!("{dtype} is read by whole blocks (decode)"),
    }
}

/// Encodes `x` as one element of `dtype` at the start of `b`, rounding to nearest (integers:
/// rounded, saturating, NaN to 0).
#[inline]
fn write_elem(dtype: DType, b: &mut [u8], x: f32) {
    match dtype {
        DType::F32 => b[..4].copy_from_slice(&x.to_le_bytes()),
        DType::F16 => b[..2].copy_from_slice(&f16::from_f32(x).to_le_bytes()),
        DType::BF16 => b[..2].copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
        DType::I32 => b[..4].copy_from_slice(&(x.round() as i32).to_le_bytes()),
        DType::Q8_0 | DType::NvFp4 => unreachable!("{dtype} is written by whole blocks (encode)"),
    }
}

/// Decodes `out.len()` elements of `dtype`, spaced `stride` bytes apart from the start of
/// `bytes`, into f32.
pub(crate) fn decode(dtype: DType, bytes: &[u8], stride: usize, out: &mut [f32]) {
    let eb = dtype.block_bytes();
    if out.is_empty() {
        return;
    }
    if dtype.is_quantized() {
        // Quantized rows are dense whole blocks (the shape rules require it): `out.len()` values.
        let raw = &bytes[..out.len() / dtype.block_size() * eb];
        let done = match dtype {
            DType::Q8_0 => quant::dequantize_q8_0(raw, out),
            _ => quant::dequantize_nvfp4(raw, out),
        };
        debug_assert!(done.is_ok(), "quantized rows are whole blocks");
        return;
    }
    if stride != eb {
        if dtype == DType::F32 && stride >= 4 {
            // One loop without a dtype match or an offset multiplication per element (strided f32
            // rows: transposed activations, conv taps and states).
            assert!(bytes.len() >= (out.len() - 1) * stride + 4, "decode: strided row outside its bytes");
            for (o, b) in out.iter_mut().zip(bytes.chunks(stride)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = read_elem(dtype, &bytes[i * stride..]);
        }
        return;
    }
    let raw = &bytes[..out.len() * eb];
    // One loop per dtype, so each vectorises without a per-element dtype match.
    match dtype {
        DType::F32 => match cast_f32(raw) {
            Some(v) => out.copy_from_slice(v),
            None => {
                for (o, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        },
        DType::F16 => match cast_f16(raw) {
            #[cfg(target_arch = "x86_64")]
            _ if is_x86_feature_detected!("avx") && is_x86_feature_detected!("f16c") => {
                // SAFETY: the CPU has AVX and F16C (checked).
                unsafe { x86::f16_to_f32(raw, out) }
            }
            Some(v) => v.convert_to_f32_slice(out),
            None => {
                // Misaligned: gather into an aligned block, then convert it with SIMD.
                let mut block = [f16::ZERO; 64];
                for (o, b) in out.chunks_mut(64).zip(raw.chunks(128)) {
                    for (h, e) in block.iter_mut().zip(b.chunks_exact(2)) {
                        *h = f16::from_le_bytes([e[0], e[1]]);
                    }
                    block[..o.len()].convert_to_f32_slice(o);
                }
            }
        },
        // bf16 is the top half of an f32.
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        DType::I32 => {
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32;
            }
        }
        DType::Q8_0 | DType::NvFp4 => unreachable!("handled above"),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Converts the `out.len()` f16 values at the start of `raw` (any alignment) with F16C, 8 at a
    /// time; the tail goes through a zero-padded block, as in `half`'s slice conversion (the
    /// conversion is exact, and a NaN comes out as the instruction makes it, in every position).
    ///
    /// # Safety
    /// The CPU has AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_to_f32(raw: &[u8], out: &mut [f32]) {
        let n = out.len();
        assert!(raw.len() >= 2 * n, "f16_to_f32: {} bytes for {n} values", raw.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: values i..i + 8 are within `raw` (asserted) and `out`; unaligned accesses.
            unsafe {
                let h = _mm_loadu_si128(raw.as_ptr().add(2 * i).cast());
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        if i < n {
            let mut h = [0u8; 16];
            h[..2 * (n - i)].copy_from_slice(&raw[2 * i..2 * n]);
            let mut f = [0f32; 8];
            // SAFETY: `h` holds 16 bytes and `f` 8 floats; unaligned accesses.
            unsafe { _mm256_storeu_ps(f.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()))) };
            out[i..].copy_from_slice(&f[..n - i]);
        }
    }
}

/// Encodes `vals` as dense elements of `dtype` into `out` (exactly `vals.len()` elements long;
/// whole blocks for block-quantized dtypes).
pub(crate) fn encode(dtype: DType, vals: &[f32], out: &mut [u8]) {
    let eb = dtype.block_bytes();
    if dtype.is_quantized() {
        let done = match dtype {
            DType::Q8_0 => quant::quantize_q8_0(vals, out),
            _ => quant::quantize_nvfp4(vals, out),
        };
        debug_assert!(done.is_ok(), "quantized rows are whole blocks");
        return;
    }
    debug_assert_eq!(out.len(), vals.len() * eb);
    match dtype {
        DType::F32 if let Some(o) = cast_f32_mut(out) => o.copy_from_slice(vals),
        DType::F16 if let Some(o) = cast_f16_mut(out) => o.convert_from_f32_slice(vals),
        _ => {
            for (b, &x) in out.chunks_exact_mut(eb).zip(vals) {
                write_elem(dtype, b, x);
            }
        }
    }
}

/// A tensor to read: the bytes from its first element to the end of its span, and its
/// descriptor.
///
/// Invariant (checked by [`Src::new`]): every dimension is at least 1 and the span fits in
/// `bytes`, so every in-range element offset indexes `bytes` without panicking.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    bytes: &'a [u8],
    pub meta: TensorMeta,
}

impl<'a> Src<'a> {
    pub fn new(bytes: &'a [u8], meta: TensorMeta) -> Option<Self> {
        (checked_span(&meta)? <= bytes.len()).then_some(Src { bytes, meta })
    }

    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    pub fn ne(&self) -> [usize; 4] {
        self.meta.ne
    }

    /// Bytes per element.
    fn eb(&self) -> usize {
        self.meta.dtype.block_bytes()
    }

    /// The bytes of the whole span (for the matmul kernels, which address it themselves).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Byte offset of the first element of row `(i1, i2, i3)`.
    pub fn row_start(&self, c: [usize; 3]) -> usize {
        c[0] * self.meta.nb[1] + c[1] * self.meta.nb[2] + c[2] * self.meta.nb[3]
    }

    /// True when the elements of each row are adjacent.
    pub fn dense_rows(&self) -> bool {
        self.meta.nb[0] == self.eb()
    }

    /// The raw bytes of row `c`, when its elements are dense.
    pub fn row_raw(&self, c: [usize; 3]) -> Option<&'a [u8]> {
        let start = self.row_start(c);
        // `row_bytes` counts whole blocks, so quantized rows get their real length.
        self.dense_rows().then(|| &self.bytes[start..start + self.meta.row_bytes()])
    }

    /// Row `c` borrowed as f32 values, when the tensor is f32 with dense, aligned rows.
    pub fn row_f32(&self, c: [usize; 3]) -> Option<&'a [f32]> {
        if self.meta.dtype != DType::F32 {
            return None;
        }
        self.row_raw(c).and_then(cast_f32)
    }

    /// Decodes row `c` into `out` (`ne[0]` long) as f32.
    pub fn load_row(&self, c: [usize; 3], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.meta.ne[0]);
        decode(self.meta.dtype, &self.bytes[self.row_start(c)..], self.meta.nb[0], out);
    }

    /// Copies the raw elements of row `c` densely into `out` (`ne[0]` elements long).
    pub fn load_row_raw(&self, c: [usize; 3], out: &mut [u8]) {
        self.copy_run_raw(self.row_start(c), out);
    }

    /// Copies `out.len() / eb` raw elements spaced `nb[0]` apart from byte `at` densely into `out`.
    fn copy_run_raw(&self, at: usize, out: &mut [u8]) {
        let eb = self.eb();
        if self.dense_rows() {
            out.copy_from_slice(&self.bytes[at..at + out.len()]);
        } else {
            for (i, o) in out.chunks_exact_mut(eb).enumerate() {
                let p = at + i * self.meta.nb[0];
                o.copy_from_slice(&self.bytes[p..p + eb]);
            }
        }
    }

    /// Byte offset of element `(i0, i1, i2, i3)`.
    pub fn offset_of(&self, i: [usize; 4]) -> usize {
        self.meta.offset_of(i)
    }

    /// Element `i` of an i32 tensor (exact, unlike going through f32).
    pub fn elem_i32(&self, i: [usize; 4]) -> i32 {
        let b = &self.bytes[self.offset_of(i)..];
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Calls `f(byte_offset, run_len, out_start)` for the runs of elements (each within one row)
    /// that make up logical elements `start .. start + count` (flat, ggml order).
    fn for_each_run(&self, start: usize, count: usize, mut f: impl FnMut(usize, usize, usize)) {
        let ne = self.meta.ne;
        let (mut flat, mut done) = (start, 0);
        while done < count {
            let (r, i0) = (flat / ne[0], flat % ne[0]);
            let run = (ne[0] - i0).min(count - done);
            f(self.row_start(row_coords(ne, r)) + i0 * self.meta.nb[0], run, done);
            done += run;
            flat += run;
        }
    }

    /// Copies logical elements `start ..` (flat, ggml order) densely into `out`, raw bytes.
    /// `start + out.len() / eb` must not exceed the element count.
    pub fn gather_flat_raw(&self, start: usize, out: &mut [u8]) {
        let eb = self.eb();
        self.for_each_run(start, out.len() / eb, |at, run, done| {
            self.copy_run_raw(at, &mut out[done * eb..(done + run) * eb]);
        });
    }

    /// Decodes logical elements `start .. start + out.len()` (flat, ggml order) into `out`.
    pub fn gather_flat_f32(&self, start: usize, out: &mut [f32]) {
        self.for_each_run(start, out.len(), |at, run, done| {
            decode(self.meta.dtype, &self.bytes[at..], self.meta.nb[0], &mut out[done..done + run]);
        });
    }
}

/// A raw pointer that rayon tasks may share. Only [`Dst`] and the matmul kernels use it, each
/// under an argument that the tasks touch disjoint memory.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);

// SAFETY: the pointer is only dereferenced by code that proves its tasks touch disjoint
// elements (see `Dst::row` and `matmul::gemm`).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// A tensor to write, possibly non-contiguous, whose rows parallel tasks fill.
///
/// Invariants (checked by [`Dst::new`]): every dimension is at least 1, the span fits in the
/// borrowed bytes, and the layout is injective (no two elements share a byte). Hence distinct
/// rows own disjoint bytes, and [`Dst::for_each_row`], which hands out each row exactly once,
/// lets tasks write them concurrently.
pub(crate) struct Dst<'a> {
    base: SendPtr<u8>,
    meta: TensorMeta,
    _bytes: PhantomData<&'a mut [u8]>,
}

impl<'a> Dst<'a> {
    pub fn new(bytes: &'a mut [u8], meta: TensorMeta) -> Result<Self, KernelError> {
        let fits = checked_span(&meta).is_some_and(|span| span <= bytes.len());
        // (A contiguous layout is injective; `is_injective` sorts the dimensions in a vector.)
        if !fits || !(meta.is_contiguous() || meta.is_injective()) {
            return Err(KernelError::Unsupported {
                op: "cpu",
                why: format!("output layout ne {:?} nb {:?} is not a writable tensor", meta.ne, meta.nb),
            });
        }
        Ok(Dst { base: SendPtr(bytes.as_mut_ptr()), meta, _bytes: PhantomData })
    }

    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    pub fn ne(&self) -> [usize; 4] {
        self.meta.ne
    }

    /// The writer of flat row `r`.
    ///
    /// # Safety
    /// `r < nrows`, and no other live `DstRow` of this tensor has the same `r`.
    unsafe fn row(&self, r: usize) -> DstRow<'_> {
        let c = row_coords(self.meta.ne, r);
        let start = c[0] * self.meta.nb[1] + c[1] * self.meta.nb[2] + c[2] * self.meta.nb[3];
        DstRow {
            // SAFETY: `start` is within the span (r < nrows), which `new` checked fits the buffer.
            ptr: unsafe { self.base.get().add(start) },
            ne0: self.meta.ne[0],
            stride: self.meta.nb[0],
            dtype: self.meta.dtype,
            _row: PhantomData,
        }
    }

    /// Calls `f(state, r, row)` once for every flat row `r`, in parallel; `init` makes the
    /// per-task scratch state. `work_per_row` (elements) sets the task granularity.
    pub fn for_each_row<S>(
        &mut self,
        work_per_row: usize,
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize, DstRow<'_>) + Sync + Send,
    ) {
        let this = &*self;
        super::par::for_each_init(
            self.meta.nrows(),
            rows_per_task(work_per_row),
            init,
            // SAFETY: each r in 0..nrows is visited exactly once, and `&mut self` keeps any other
            // writer of this tensor from existing meanwhile.
            |s, r| f(s, r, unsafe { this.row(r) }),
        );
    }

    /// Calls `f(state, k, row)` for row `rows[k]`, for every `k`, in parallel. `rows` must be
    /// strictly increasing and within the tensor (so each row is handed out once).
    pub fn for_listed_rows<S>(
        &mut self,
        rows: &[usize],
        work_per_row: usize,
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize, DstRow<'_>) + Sync + Send,
    ) -> Result<(), KernelError> {
        let increasing = rows.windows(2).all(|w| w[0] < w[1]);
        if !increasing || rows.last().is_some_and(|&r| r >= self.meta.nrows()) {
            return Err(KernelError::Unsupported { op: "cpu", why: "row list is not increasing and in range".into() });
        }
        let this = &*self;
        super::par::for_each_init(
            rows.len(),
            rows_per_task(work_per_row),
            init,
            // SAFETY: the rows are distinct (strictly increasing) and in range (checked above).
            |s, k| f(s, k, unsafe { this.row(rows[k]) }),
        );
        Ok(())
    }
}

/// The writer of one row of a [`Dst`]: exclusive access to that row's elements.
pub(crate) struct DstRow<'r> {
    /// First byte of the row's first element.
    ptr: *mut u8,
    ne0: usize,
    /// Byte distance between consecutive elements (`nb[0]`).
    stride: usize,
    dtype: DType,
    _row: PhantomData<&'r mut [u8]>,
}

impl DstRow<'_> {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn eb(&self) -> usize {
        self.dtype.block_bytes()
    }

    /// Bytes of the row's elements when dense: whole blocks for block-quantized dtypes.
    fn dense_len(&self) -> usize {
        self.ne0 / self.dtype.block_size() * self.eb()
    }

    /// The row's bytes when its elements are dense.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.stride != self.eb() {
            return None;
        }
        // SAFETY: with dense elements the row's `dense_len()` bytes (whole blocks) are exactly its
        // elements: inside the buffer (span checked by `Dst::new`) and owned by this row alone
        // (injective layout, each row handed out once).
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.dense_len()) })
    }

    /// The row as f32 values, when it is f32, dense and aligned.
    pub fn f32_mut(&mut self) -> Option<&mut [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        self.bytes_mut().and_then(cast_f32_mut)
    }

    /// Writes raw element `i0` (`eb` bytes of this row's dtype).
    fn put_raw(&mut self, i0: usize, raw: &[u8]) {
        assert!(i0 < self.ne0 && raw.len() == self.eb(), "DstRow: element {i0} out of row");
        // SAFETY: element i0 < ne0 of this row lies in the buffer and belongs to this row alone
        // (see `bytes_mut`); `raw` is a separate slice of exactly one element.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), self.ptr.add(i0 * self.stride), raw.len()) }
    }

    /// Stores `vals` (the whole row) converted to the row's dtype.
    pub fn store(&mut self, vals: &[f32]) {
        assert_eq!(vals.len(), self.ne0, "DstRow::store: row length");
        let dtype = self.dtype;
        if let Some(b) = self.bytes_mut() {
            return encode(dtype, vals, b);
        }
        let mut tmp = [0u8; 4];
        let eb = self.eb();
        for (i, &x) in vals.iter().enumerate() {
            write_elem(dtype, &mut tmp, x);
            self.put_raw(i, &tmp[..eb]);
        }
    }

    /// Stores i32 values (the whole row) into an i32 row.
    pub fn store_i32(&mut self, vals: &[i32]) {
        assert!(vals.len() == self.ne0 && self.dtype == DType::I32, "DstRow::store_i32: row mismatch");
        for (i, &v) in vals.iter().enumerate() {
            self.put_raw(i, &v.to_le_bytes());
        }
    }

    /// Stores dense raw elements of the row's own dtype (the whole row).
    pub fn store_raw(&mut self, raw: &[u8]) {
        let eb = self.eb();
        assert_eq!(raw.len(), self.dense_len(), "DstRow::store_raw: row length");
        if let Some(b) = self.bytes_mut() {
            return b.copy_from_slice(raw);
        }
        for (i, e) in raw.chunks_exact(eb).enumerate() {
            self.put_raw(i, e);
        }
    }

    /// Lets `f` fill the row as f32 values: in place when the row is dense aligned f32, else in
    /// `scratch` and then stored with conversion.
    pub fn fill_f32(&mut self, scratch: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
        if let Some(out) = self.f32_mut() {
            return f(out);
        }
        scratch.resize(self.ne0, 0.0);
        f(scratch);
        self.store(scratch);
    }

    /// Lets `f` fill the row with dense raw elements: in place when the row is dense, else in
    /// `scratch` and then scattered.
    pub fn fill_raw(&mut self, scratch: &mut Vec<u8>, f: impl FnOnce(&mut [u8])) {
        if let Some(out) = self.bytes_mut() {
            return f(out);
        }
        scratch.resize(self.dense_len(), 0);
        f(scratch);
        self.store_raw(scratch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(dtype: DType, ne: [usize; 4], nb: [usize; 4]) -> TensorMeta {
        TensorMeta { dtype, ne, nb }
    }

    #[test]
    fn checked_span_rejects_empty_and_overflowing_shapes() {
        assert_eq!(checked_span(&meta(DType::F32, [2, 3, 1, 1], [4, 8, 24, 24])), Some(24));
        assert_eq!(checked_span(&meta(DType::F32, [0, 3, 1, 1], [4, 8, 24, 24])), None);
        assert_eq!(checked_span(&meta(DType::F32, [2, 3, 1, 1], [4, usize::MAX / 2, 24, 24])), None);
    }

    #[test]
    fn transposed_rows_and_flat_gather_follow_strides() {
        // a 2x3 f32 matrix [[0, 1], [2, 3], [4, 5]] read transposed at an odd byte offset
        let mut bytes = vec![0u8; 1];
        bytes.extend((0..6).flat_map(|v| (v as f32).to_le_bytes()));
        let t = Src::new(&bytes[1..], meta(DType::F32, [3, 2, 1, 1], [8, 4, 24, 24])).unwrap();
        let mut row = [0f32; 3];
        t.load_row([1, 0, 0], &mut row);
        assert_eq!(row, [1., 3., 5.]);
        assert!(t.row_f32([0, 0, 0]).is_none());
        let mut flat = [0f32; 4];
        t.gather_flat_f32(2, &mut flat);
        assert_eq!(flat, [4., 1., 3., 5.]);
    }

    #[test]
    fn f16_rows_decode_exactly_at_any_alignment_and_length() {
        // every f16 bit pattern, then short rows at odd offsets (the tail paths)
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let check = |raw: &[u8], n: usize| {
            let mut out = vec![0f32; n];
            decode(DType::F16, raw, 2, &mut out);
            for (i, &got) in out.iter().enumerate() {
                let want = f16::from_le_bytes([raw[2 * i], raw[2 * i + 1]]).to_f32();
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{i}: {got} vs {want}");
            }
        };
        check(&all, 1 << 16);
        for n in 1..20 {
            check(&all[1..], n);
            check(&all[2 * 1000..], n);
        }
    }

    #[test]
    fn dst_rejects_overlapping_layouts_and_writes_strided_rows() {
        let mut buf = vec![0u8; 12];
        assert!(Dst::new(&mut buf, meta(DType::F16, [3, 2, 1, 1], [2, 2, 12, 12])).is_err());
        assert!(Dst::new(&mut buf, meta(DType::F16, [3, 3, 1, 1], [2, 6, 18, 18])).is_err(), "span too big");
        // a transposed 3x2 f16 matrix: rows are strided
        let mut dst = Dst::new(&mut buf, meta(DType::F16, [3, 2, 1, 1], [4, 2, 12, 12])).unwrap();
        dst.for_each_row(1, Vec::new, |s, r, mut row| {
            assert!(row.bytes_mut().is_none());
            row.fill_f32(s, |v| v.iter_mut().enumerate().for_each(|(i, x)| *x = (10 * r + i) as f32));
        });
        let vals: Vec<f32> = buf.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert_eq!(vals, [0., 10., 1., 11., 2., 12.]);
    }
}
