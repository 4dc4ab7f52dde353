//! # tessera-benches: shared helpers for the criterion benches
//!
//! The benches themselves live in `benches/cpu_ops.rs` (run them with
//! `cargo bench -p tessera-benches`, or `cargo bench -p tessera-benches -- mul_mat` for one
//! group). This library holds what they share: deterministic pseudo-random data and a fast way to
//! fill large leaves without going through f64.
//!
//! `examples/readme.rs` is the example of the top-level README, kept identical to it; the test
//! `tests/readme.rs` runs it and checks the README still contains it verbatim.

use tessera_graph::{ExecError, Session, Tensor};
use tessera_ops::DType;

/// `n` deterministic values uniform in `[-1, 1)`, from a 64-bit xorshift seeded by `seed`.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // top 24 bits -> [0, 1) exactly representable in f32, then to [-1, 1)
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Encodes `values` as contiguous little-endian bytes of `dtype` (i32 values are truncated toward
/// zero; block-quantized dtypes are quantized whole blocks at a time).
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.block_bytes());
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => values.iter().for_each(|&v| out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes())),
        DType::BF16 => values.iter().for_each(|&v| out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes())),
        DType::I32 => values.iter().for_each(|&v| out.extend_from_slice(&(v as i32).to_le_bytes())),
        DType::Q8_0 | DType::NvFp4 => {
            let wide: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
            out = tessera_ops::host::encode(dtype, &wide);
        }
    }
    out
}

/// Fills a float leaf of `session` with [`uniform`] values of its dtype, encoded directly (no f64
/// round trip, which matters for 100 MB embedding tables).
pub fn fill_uniform(session: &mut Session<'_, '_>, t: Tensor, seed: u64) -> Result<(), ExecError> {
    let values = uniform(t.meta().nelements(), seed);
    session.set(t, &encode(t.dtype(), &values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_deterministic_and_in_range() {
        let a = uniform(1000, 7);
        assert_eq!(a, uniform(1000, 7));
        assert_ne!(a, uniform(1000, 8));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.1, "mean {mean}");
    }

    #[test]
    fn encode_matches_the_host_encoder() {
        let v = [0.5f32, -1.25, 3.0];
        for d in [DType::F32, DType::F16, DType::BF16] {
            let want = tessera_ops::host::encode(d, &v.map(f64::from));
            assert_eq!(encode(d, &v), want, "{d}");
        }
    }
}
