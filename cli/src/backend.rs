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

/// Opens the chosen backend. `auto` says on stderr why it fell back to the CPU.
pub fn open(choice: BackendChoice) -> Result<Box<dyn Backend>, String> {
    match choice {
        BackendChoice::Cpu => Ok(Box::new(CpuBackend::new())),
        BackendChoice::Cuda => cuda(),
        BackendChoice::Auto => cuda().or_else(|why| {
            eprintln!("note: running on the CPU: {why}");
            Ok(Box::new(CpuBackend::new()))
        }),
    }
}

/// One line describing the device of a backend opened by [`open`].
pub fn describe(backend: &dyn Backend) -> String {
    #[cfg(feature = "cuda")]
    if backend.name() == "cuda"
        && let Ok(info) = tessera_cuda::CudaBackend::probe()
    {
        return format!("cuda on {info}");
    }
    match backend.name() {
        "cpu" => format!("cpu ({} threads)", rayon_threads()),
        other => other.to_string(),
    }
}

/// The `ModelOptions::kv_pad` for a backend: 256 on a GPU, so decode steps keep one shape for
/// 256 tokens and their captured CUDA graph is replayed; exact (1) on the CPU, where the masked
/// padding would only cost time.
pub fn kv_pad(backend: &dyn Backend) -> usize {
    if backend.name() == "cuda" { 256 } else { 1 }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Box<dyn Backend>, String> {
    tessera_cuda::CudaBackend::new().map(|b| Box::new(b) as Box<dyn Backend>).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Box<dyn Backend>, String> {
    Err("this build has no CUDA backend (build tessera-cli with the `cuda` feature)".into())
}
