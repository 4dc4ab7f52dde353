//! Element access on host memory: move whole strided tensors between byte buffers and logical
//! (contiguous, ggml-order) f64 arrays, converting dtypes; block-quantized rows are quantized and
//! dequantized whole. Used by the f64 reference, by executors to read results, and by tests. Not a
//! fast path.

use crate::quant;
use crate::{DType, TensorMeta};

/// Decodes the element of a plain (one element per block) `dtype` stored at `bytes[at..]`.
fn read_plain(dtype: DType, bytes: &[u8], at: usize) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(take(bytes, at)) as f64,
        DType::F16 => half::f16::from_le_bytes(take(bytes, at)).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes(take(bytes, at)).to_f64(),
        DType::I32 => i32::from_le_bytes(take(bytes, at)) as f64,
        DType::Q8_0 | DType::NvFp4 => unreachable!("read_plain on block-quantized {dtype}"),
    }
}

/// Encodes `x` as a plain `dtype` at `bytes[at..]`, rounding to nearest (saturating for integers).
fn write_plain(dtype: DType, bytes: &mut [u8], at: usize, x: f64) {
    match dtype {
        DType::F32 => bytes[at..at + 4].copy_from_slice(&(x as f32).to_le_bytes()),
        DType::F16 => bytes[at..at + 2].copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
        DType::BF16 => bytes[at..at + 2].copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
        DType::I32 => bytes[at..at + 4].copy_from_slice(&(DType::I32.round(x) as i32).to_le_bytes()),
        DType::Q8_0 | DType::NvFp4 => unreachable!("write_plain on block-quantized {dtype}"),
    }
}

fn take<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut b = [0; N];
    b.copy_from_slice(&bytes[at..at + N]);
    b
}

/// Dequantizes one row of whole blocks.
fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f64]) {
    let r = match dtype {
        DType::Q8_0 => quant::dequantize_q8_0_f64(bytes, out),
        DType::NvFp4 => quant::dequantize_nvfp4_f64(bytes, out),
        _ => unreachable!("dequantize_row on plain {dtype}"),
    };
    debug_assert!(r.is_ok(), "row lengths are whole blocks by construction");
}

/// Quantizes one row of whole blocks.
fn quantize_row(dtype: DType, values: &[f64], out: &mut [u8]) {
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    let r = match dtype {
        DType::Q8_0 => quant::quantize_q8_0(&v, out),
        DType::NvFp4 => quant::quantize_nvfp4(&v, out),
        _ => unreachable!("quantize_row on plain {dtype}"),
    };
    debug_assert!(r.is_ok(), "row lengths are whole blocks by construction");
}

/// Visits every block of `meta` in logical ggml order (dimension 0 fastest), passing its byte
/// offset relative to the tensor's first byte. For plain dtypes a block is one element.
pub fn for_each_block(meta: &TensorMeta, mut f: impl FnMut(usize)) {
    let ne = meta.ne;
    let blocks = ne[0] / meta.dtype.block_size();
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                let row = i1 * meta.nb[1] + i2 * meta.nb[2] + i3 * meta.nb[3];
                for b in 0..blocks {
                    f(row + b * meta.nb[0]);
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
    let (bs, bb) = (meta.dtype.block_size(), meta.dtype.block_bytes());
    let mut block = vec![0.0; bs];
    for_each_block(meta, |at| {
        if bs == 1 {
            out.push(read_plain(meta.dtype, bytes, offset + at));
        } else {
            dequantize_row(meta.dtype, &bytes[offset + at..offset + at + bb], &mut block);
            out.extend_from_slice(&block);
        }
    });
    out
}

/// Writes logical-order `values` into the tensor described by `meta` at `bytes[offset..]`,
/// rounding each to `meta.dtype` (quantizing whole blocks for block-quantized dtypes).
///
/// # Panics
/// If `values` does not hold one value per element or the span does not fit in `bytes`.
pub fn scatter_f64(values: &[f64], bytes: &mut [u8], offset: usize, meta: &TensorMeta) {
    assert_eq!(values.len(), meta.nelements(), "scatter_f64: value count does not match the tensor");
    let (bs, bb) = (meta.dtype.block_size(), meta.dtype.block_bytes());
    let mut chunks = values.chunks_exact(bs);
    for_each_block(meta, |at| {
        if let Some(block) = chunks.next() {
            if bs == 1 {
                write_plain(meta.dtype, bytes, offset + at, block[0]);
            } else {
                quantize_row(meta.dtype, block, &mut bytes[offset + at..offset + at + bb]);
            }
        }
    });
}

/// Encodes logical-order `values` as a contiguous tensor of `dtype` (a trailing partial block of a
/// quantized dtype is dropped; callers pass whole rows).
pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
    let mut bytes = vec![0u8; values.len() / bs * bb];
    for (i, block) in values.chunks_exact(bs).enumerate() {
        if bs == 1 {
            write_plain(dtype, &mut bytes, i * bb, block[0]);
        } else {
            quantize_row(dtype, block, &mut bytes[i * bb..(i + 1) * bb]);
        }
    }
    bytes
}

/// Decodes a contiguous tensor of `dtype` into f64 values (a trailing partial block is ignored).
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
    let mut out = vec![0.0; bytes.len() / bb * bs];
    for (i, block) in bytes.chunks_exact(bb).enumerate() {
        if bs == 1 {
            out[i] = read_plain(dtype, block, 0);
        } else {
            dequantize_row(dtype, block, &mut out[i * bs..(i + 1) * bs]);
        }
    }
    out
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
    fn encode_decode_round_trip_each_plain_dtype() {
        for d in DType::PLAIN {
            let v = vec![1.0, -2.0, 3.0, 256.0];
            assert_eq!(decode(d, &encode(d, &v)), v, "{d}");
        }
    }

    #[test]
    fn quantized_rows_round_trip_within_the_format_error() {
        let v: Vec<f64> = (0..128).map(|i| ((i * 37 % 23) as f64 - 11.0) / 7.0).collect();
        for (d, tol) in [(DType::Q8_0, 0.01), (DType::NvFp4, 0.35)] {
            let bytes = encode(d, &v);
            assert_eq!(bytes.len(), d.row_bytes(128).unwrap());
            let back = decode(d, &bytes);
            let worst = v.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert!(worst <= tol, "{d}: worst error {worst}");
            // gather/scatter through a strided (row-padded) layout agree with encode/decode
            let meta =
                TensorMeta { dtype: d, ne: [64, 2, 1, 1], nb: [d.block_bytes(), 2 * d.row_bytes(64).unwrap(), 0, 0] };
            let meta = TensorMeta { nb: [meta.nb[0], meta.nb[1], 2 * meta.nb[1], 2 * meta.nb[1]], ..meta };
            let mut buf = vec![0u8; meta.span_bytes()];
            scatter_f64(&v, &mut buf, 0, &meta);
            assert_eq!(gather_f64(&buf, 0, &meta), back);
        }
    }
}
