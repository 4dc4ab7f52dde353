//! Element access on host memory: decode and encode one element, and move whole strided tensors
//! between byte buffers and logical (contiguous, ggml-order) f64 arrays. Used by the f64 reference,
//! by executors to read results, and by tests. Not a fast path.

use crate::{DType, TensorMeta};

/// Decodes the element of `dtype` stored at `bytes[at..]`.
///
/// # Panics
/// If `bytes` is shorter than `at + dtype.block_bytes()`; callers check spans first.
pub fn read_f64(dtype: DType, bytes: &[u8], at: usize) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(take(bytes, at)) as f64,
        DType::F16 => half::f16::from_le_bytes(take(bytes, at)).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes(take(bytes, at)).to_f64(),
        DType::I32 => i32::from_le_bytes(take(bytes, at)) as f64,
    }
}

/// Encodes `x` as `dtype` at `bytes[at..]`, rounding to nearest (saturating for integers).
pub fn write_f64(dtype: DType, bytes: &mut [u8], at: usize, x: f64) {
    match dtype {
        DType::F32 => bytes[at..at + 4].copy_from_slice(&(x as f32).to_le_bytes()),
        DType::F16 => bytes[at..at + 2].copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
        DType::BF16 => bytes[at..at + 2].copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
        DType::I32 => bytes[at..at + 4].copy_from_slice(&(DType::I32.round(x) as i32).to_le_bytes()),
    }
}

fn take<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut b = [0; N];
    b.copy_from_slice(&bytes[at..at + N]);
    b
}

/// Visits every element of `meta` in logical ggml order (i0 fastest), passing its byte offset
/// relative to the tensor's first byte.
pub fn for_each_offset(meta: &TensorMeta, mut f: impl FnMut(usize)) {
    let ne = meta.ne;
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                let row = i1 * meta.nb[1] + i2 * meta.nb[2] + i3 * meta.nb[3];
                for i0 in 0..ne[0] {
                    f(row + i0 * meta.nb[0]);
                }
            }
        }
    }
}

/// Reads the tensor described by `meta` starting at `bytes[offset..]` into logical order.
///
/// # Panics
/// If the tensor's span does not fit in `bytes`; executors validate spans before calling.
pub fn gather_f64(bytes: &[u8], offset: usize, meta: &TensorMeta) -> Vec<f64> {
    let mut out = Vec::with_capacity(meta.nelements());
    for_each_offset(meta, |at| out.push(read_f64(meta.dtype, bytes, offset + at)));
    out
}

/// Writes logical-order `values` into the tensor described by `meta` at `bytes[offset..]`,
/// rounding each to `meta.dtype`.
pub fn scatter_f64(values: &[f64], bytes: &mut [u8], offset: usize, meta: &TensorMeta) {
    assert_eq!(values.len(), meta.nelements(), "scatter_f64: value count does not match the tensor");
    let mut it = values.iter();
    for_each_offset(meta, |at| {
        if let Some(&x) = it.next() {
            write_f64(meta.dtype, bytes, offset + at, x);
        }
    });
}

/// Encodes logical-order `values` as a contiguous tensor of `dtype`.
pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut bytes = vec![0u8; values.len() * dtype.block_bytes()];
    for (i, &x) in values.iter().enumerate() {
        write_f64(dtype, &mut bytes, i * dtype.block_bytes(), x);
    }
    bytes
}

/// Decodes a contiguous tensor of `dtype` into f64 values.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    (0..bytes.len() / dtype.block_bytes()).map(|i| read_f64(dtype, bytes, i * dtype.block_bytes())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_follows_strides() {
        // a 2x3 f32 matrix, read transposed
        let m = TensorMeta::contiguous("t", DType::F32, [2, 3, 1, 1]).unwrap();
        let bytes = encode(DType::F32, &[0., 1., 2., 3., 4., 5.]);
        let t = TensorMeta { dtype: DType::F32, ne: [3, 2, 1, 1], nb: [8, 4, 24, 24] };
        assert_eq!(gather_f64(&bytes, 0, &m), vec![0., 1., 2., 3., 4., 5.]);
        assert_eq!(gather_f64(&bytes, 0, &t), vec![0., 2., 4., 1., 3., 5.]);
    }

    #[test]
    fn encode_decode_round_trip_each_dtype() {
        for d in DType::ALL {
            let v = vec![1.0, -2.0, 3.0, 256.0];
            assert_eq!(decode(d, &encode(d, &v)), v, "{d}");
        }
    }
}
