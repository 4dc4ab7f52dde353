//! What the GPU test binaries share.

use tessera_cuda::CudaBackend;

/// The backend on the first GPU, or `None` with a message on stderr when no GPU is usable (the
/// caller's test then passes without checking anything).
pub fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// Normalised mean squared error of `got` against `want` (0 when equal).
#[allow(dead_code)] // not every test binary compares values
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    if err == 0.0 { 0.0 } else { err / norm }
}

/// splitmix64 in [0, 1): the tests' seeded inputs.
#[allow(dead_code)] // not every test binary makes inputs
pub fn unit(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / 16_777_216.0
}

/// The same in [-1, 1).
#[allow(dead_code)]
pub fn value(state: &mut u64) -> f32 {
    2.0 * unit(state) - 1.0
}
