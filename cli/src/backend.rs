//! Which backend a command runs on: `--backend auto|cpu|cuda`. `auto` takes CUDA when this build
//! has it (the default `cuda` feature) and a GPU is usable, else the CPU.

use tessera_cpu::CpuBackend;
use tessera_graph::Backend;

/// The backend a command asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a GPU is usable, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// An opened backend, with what a command prints about it and the model options it wants.
pub struct Opened {
    pub backend: Box<dyn Backend>,
    /// One line naming the device (`cuda on NVIDIA H200 (...)`, `cpu (16 threads)`).
    pub description: String,
    /// The `ModelOptions::kv_pad` for this backend: 256 on a GPU, so decode steps keep one shape
    /// for 256 tokens and their captured CUDA graph is replayed; exact (1) on the CPU, where the
    /// masked padding would only cost time.
    pub kv_pad: usize,
}

/// Opens the chosen backend. `auto` says on stderr why it fell back to the CPU.
pub fn open(choice: BackendChoice) -> Result<Opened, String> {
    match choice {
        BackendChoice::Cpu => Ok(cpu()),
        BackendChoice::Cuda => cuda(),
        BackendChoice::Auto => cuda().or_else(|why| {
            errln!("note: running on the CPU: {why}");
            Ok(cpu())
        }),
    }
}

fn cpu() -> Opened {
    let b = CpuBackend::new();
    let description = format!("cpu ({} threads)", b.num_threads());
    Opened { backend: Box::new(b), description, kv_pad: 1 }
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Opened, String> {
    let b = tessera_cuda::CudaBackend::new().map_err(|e| e.to_string())?;
    let description = format!("cuda on {}", b.info());
    Ok(Opened { backend: Box::new(b), description, kv_pad: 256 })
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Opened, String> {
    Err("this build has no CUDA backend (build tessera-cli with the `cuda` feature)".into())
}
