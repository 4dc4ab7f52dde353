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
