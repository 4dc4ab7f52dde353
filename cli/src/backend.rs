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
    /// The `ModelOptions::kv_pad` for this backend: decode steps keep one shape for this many
    /// tokens, so their planned step graph (and on a GPU the captured CUDA graph) is replayed
    /// rather than built again. 256 on every backend: attention reads only each sequence's own
    /// positions, so the padding costs a longer block table and nothing else.
    pub kv_pad: usize,
    /// Whether the backend captures steps into graphs that `open_with` can switch (CUDA).
    pub has_graphs: bool,
}

/// [`Opened::kv_pad`].
const KV_PAD: usize = 256;

/// Opens the chosen backend. `auto` says on stderr why it fell back to the CPU.
pub fn open(choice: BackendChoice) -> Result<Opened, String> {
    open_with(choice, true)
}

/// [`open`], with CUDA graph capture on or off (the CPU has none).
pub fn open_with(choice: BackendChoice, graphs: bool) -> Result<Opened, String> {
    match choice {
        BackendChoice::Cpu => Ok(cpu()),
        BackendChoice::Cuda => cuda(graphs),
        BackendChoice::Auto => cuda(graphs).or_else(|why| {
            errln!("note: running on the CPU: {why}");
            Ok(cpu())
        }),
    }
}

fn cpu() -> Opened {
    let b = CpuBackend::new();
    let description = format!("cpu ({} threads)", b.num_threads());
    Opened { backend: Box::new(b), description, kv_pad: KV_PAD, has_graphs: false }
}

#[cfg(feature = "cuda")]
fn cuda(graphs: bool) -> Result<Opened, String> {
    let mut b = tessera_cuda::CudaBackend::new().map_err(|e| e.to_string())?;
    if !graphs {
        b.set_graphs(false);
    }
    let description = format!("cuda on {}", b.info());
    Ok(Opened { backend: Box::new(b), description, kv_pad: KV_PAD, has_graphs: true })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_graphs: bool) -> Result<Opened, String> {
    Err("this build has no CUDA backend (build tessera-cli with the `cuda` feature)".into())
}
