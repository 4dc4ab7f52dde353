//! # tessera-cpu: the CPU backends
//!
//! [`CpuBackend`] runs every op with rayon in f32 (the oracle every other backend is checked
//! against); [`ReferenceBackend`] runs the plain f64 reference (the judge of the CPU backend).

mod buffers;
mod cpu;
mod reference;

pub use buffers::{HostBuffer, HostBuffers};
pub use cpu::CpuBackend;
pub use reference::ReferenceBackend;
