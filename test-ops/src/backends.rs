//! The backends test-ops knows, each with its judge. Adding a backend is one entry in
//! [`registry`]. The CUDA backend is compiled in with the `cuda` feature; making it fails with a
//! message (not a panic) on a machine without a usable GPU.

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::Backend;

/// A backend test-ops can run, and the one it is checked against.
#[derive(Debug, Clone, Copy)]
pub struct BackendEntry {
    /// The backend's `Backend::name()`, used by `--backend`.
    pub name: &'static str,
    /// The name of the backend whose results this one must match; `None` for the f64 reference,
    /// which judges but is not judged.
    pub judge: Option<&'static str>,
    /// Makes a fresh instance, or says why this machine cannot (no GPU).
    pub make: fn() -> Result<Box<dyn Backend>, String>,
}

/// Every backend, judges first: the f64 reference judges the CPU backend, and the CPU backend
/// judges every other one.
pub fn registry() -> Vec<BackendEntry> {
    #[allow(unused_mut)]
    let mut all = vec![
        BackendEntry { name: "ref", judge: None, make: || Ok(Box::new(ReferenceBackend::new())) },
        BackendEntry { name: "cpu", judge: Some("ref"), make: || Ok(Box::new(CpuBackend::new())) },
    ];
    #[cfg(feature = "cuda")]
    all.push(BackendEntry {
        name: "cuda",
        judge: Some("cpu"),
        make: || match tessera_cuda::CudaBackend::new() {
            Ok(b) => Ok(Box::new(b)),
            Err(e) => Err(e.to_string()),
        },
    });
    all
}

/// The device's measured ceilings for perf reports: (copy bandwidth in GB/s, read + write;
/// bf16 tensor-core GEMM rate in TFLOP/s), for backends that have them.
pub fn ceilings(name: &str) -> Option<(String, f64, f64)> {
    #[cfg(feature = "cuda")]
    if name == "cuda" {
        let mut b = tessera_cuda::CudaBackend::new().ok()?;
        let c = b.measure_ceilings().ok()?;
        return Some((b.info().to_string(), c.copy_gb_per_s, c.bf16_tflop_per_s));
    }
    let _ = name;
    None
}

/// The entry named `name`.
pub fn find(name: &str) -> Option<BackendEntry> {
    registry().into_iter().find(|e| e.name == name)
}

/// Makes the backend named `name`.
pub fn make(name: &str) -> Result<Box<dyn Backend>, String> {
    let entry = find(name).ok_or_else(|| format!("unknown backend {name}"))?;
    (entry.make)()
}
