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
