//! The backends test-ops knows, each with its judge. Adding a backend is one entry in
//! [`registry`].

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
    /// Makes a fresh instance.
    pub make: fn() -> Box<dyn Backend>,
}

/// Every backend, judges first: the f64 reference judges the CPU backend, and the CPU backend
/// judges every other one.
pub fn registry() -> Vec<BackendEntry> {
    vec![
        BackendEntry { name: "ref", judge: None, make: || Box::new(ReferenceBackend::new()) },
        BackendEntry { name: "cpu", judge: Some("ref"), make: || Box::new(CpuBackend::new()) },
    ]
}

/// The entry named `name`.
pub fn find(name: &str) -> Option<BackendEntry> {
    registry().into_iter().find(|e| e.name == name)
}

/// Makes the backend named `name`.
pub fn make(name: &str) -> Option<Box<dyn Backend>> {
    find(name).map(|e| (e.make)())
}
