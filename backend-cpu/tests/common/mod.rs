//! Helpers shared by the integration tests of this crate.

#![allow(dead_code)] // each test binary uses a subset

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::Backend;

/// Deterministic values in `[-1, 1)` (xorshift), exactly representable in f32.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            2.0 * u - 1.0
        })
        .collect()
}

/// The CPU backend and the f64 reference, which every property is checked on.
pub fn backends() -> Vec<(&'static str, Box<dyn Backend>)> {
    vec![("cpu", Box::new(CpuBackend::new())), ("ref", Box::new(ReferenceBackend::new()))]
}

/// splitmix64: seeded test data and choices.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (n >= 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
