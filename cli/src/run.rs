//! `tessera run`: load a GGUF on the CPU backend and generate tokens from token ids.

use std::path::Path;
use std::time::Instant;

use tessera_cpu::CpuBackend;
use tessera_models::engine::{Engine, EngineConfig, MemoryReport};
use tessera_models::gguf::GgufFile;
use tessera_models::qwen35::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;

/// What `tessera run` was asked to do.
#[derive(Debug, Clone)]
pub struct RunArgs {
    pub tokens: Vec<u32>,
    pub n_new: usize,
    pub params: SamplerParams,
    pub max_tokens_per_step: usize,
}

/// KV cells per block in the caches `run` sizes.
const BLOCK_SIZE: usize = 16;

/// Loads `file`, generates `args.n_new` tokens after `args.tokens`, prints memory, tokens, speed.
pub fn run(file: &Path, args: &RunArgs) -> Result<(), String> {
    if args.tokens.is_empty() {
        return Err("--tokens: at least one prompt token is needed".into());
    }
    if args.n_new == 0 {
        return Err("-n: at least one new token".into());
    }
    args.params.validate().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let gguf = GgufFile::open(file).map_err(|e| e.to_string())?;
    // Caches sized for this one request.
    let max_context = (args.tokens.len() + args.n_new).next_multiple_of(BLOCK_SIZE);
    let opts = ModelOptions {
        kv_blocks: max_context / BLOCK_SIZE,
        block_size: BLOCK_SIZE,
        max_context,
        n_slots: 1,
        ..ModelOptions::default()
    };
    let mut backend = CpuBackend::new();
    let model = Model::load(&gguf, &mut backend, opts).map_err(|e| format!("{}: {e}", file.display()))?;
    let config = model.config.clone();
    let mut engine =
        Engine::new(model, Box::new(backend), EngineConfig { max_tokens_per_step: args.max_tokens_per_step })
            .map_err(|e| e.to_string())?;
    println!("backend: {} (CUDA comes in a later issue)", engine.backend_name());
    println!("model: {config}");
    println!("loaded {} in {:.1} ms", file.display(), t0.elapsed().as_secs_f64() * 1e3);
    print_memory(&engine.memory());
    let id = engine.submit(&args.tokens, args.n_new, args.params).map_err(|e| e.to_string())?;
    let mut out = engine.run_to_completion().map_err(|e| e.to_string())?;
    let generated = out.remove(&id).unwrap_or_default();
    println!("prompt: {}", join(&args.tokens));
    println!("generated: {}", join(&generated));
    print_speed(engine.stats());
    Ok(())
}

fn join(t: &[u32]) -> String {
    t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `1234567 bytes (1.18 MiB)`.
pub fn bytes(n: usize) -> String {
    let (v, unit) = if n >= 1 << 30 {
        (n as f64 / (1u64 << 30) as f64, "GiB")
    } else if n >= 1 << 20 {
        (n as f64 / (1u64 << 20) as f64, "MiB")
    } else {
        (n as f64 / 1024.0, "KiB")
    };
    format!("{n} bytes ({v:.2} {unit})")
}

/// The memory lines `run` and `demo` print.
pub fn print_memory(m: &MemoryReport) {
    println!("memory: weights {}", bytes(m.weight_bytes));
    println!("memory: kv cache per token {}", bytes(m.kv_bytes_per_token));
    println!("memory: recurrent state per sequence {}", bytes(m.recurrent_bytes_per_sequence));
    println!(
        "memory: caches {} (kv {}, recurrent {})",
        bytes(m.total_cache_bytes),
        bytes(m.kv_cache_bytes),
        bytes(m.recurrent_cache_bytes)
    );
}

/// Prefill and decode speed lines.
pub fn print_speed(s: &tessera_models::engine::EngineStats) {
    println!(
        "prefill: {} tokens in {:.2} ms ({:.1} tokens/s)",
        s.prefill_tokens,
        s.prefill_secs * 1e3,
        s.prefill_tokens_per_sec()
    );
    println!(
        "decode: {} tokens in {:.2} ms ({:.1} tokens/s)",
        s.decode_only_tokens,
        s.decode_secs * 1e3,
        s.decode_tokens_per_sec()
    );
}
