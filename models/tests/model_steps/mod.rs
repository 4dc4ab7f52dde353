//! Helpers of the model-level CPU tests (`qwen35_model.rs`, `qwen3_model.rs`, `fusion.rs`): a preset's f32
//! checkpoint loaded on the CPU backend, seeded token streams, NMSE, and prompts fed in chunks.
//! The test file declares `mod synth_file;` beside `mod model_steps;`.

#![allow(dead_code)] // each test binary uses a part

use tessera_cpu::CpuBackend;
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_ops::DType;

use crate::synth_file::synth_file;

/// The `preset` checkpoint with f32 weights from seed 42.
pub fn file(preset: &str) -> GgufFile {
    synth_file(preset, DType::F32, 42)
}

/// [`file`]'s model, loaded on a fresh CPU backend.
pub fn load(preset: &str, opts: ModelOptions) -> (Model, CpuBackend) {
    let mut be = CpuBackend::new();
    let m = Model::load(&file(preset), &mut be, opts).unwrap();
    (m, be)
}

/// The small models' options: 32 blocks of 4 cells (64 tokens of context), f32 KV, the
/// projections stacked, a MoE block's shared expert routed with the experts (for a family with
/// one).
pub fn opts() -> ModelOptions {
    ModelOptions {
        kv_blocks: 32,
        block_size: 4,
        max_context: 64,
        kv_dtype: DType::F32,
        merge_projections: true,
        route_shared_expert: 64,
        ..ModelOptions::default()
    }
}

/// `n` token ids below 256 (every tiny preset's vocabulary), a different stream per `seed`.
pub fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 256).collect()
}

/// Normalised mean squared error of `a` against `b`.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num / den.max(f64::MIN_POSITIVE)
}

/// `a` equals `b` up to f32 reassociation (NMSE at most 1e-8).
pub fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let e = nmse(a, b);
    assert!(e <= 1e-8, "{what}: nmse {e:e}");
}

/// Last logits after feeding `toks` to a fresh sequence in chunks of `chunk`.
pub fn run_chunks(preset: &str, toks: &[u32], chunk: usize, opts: ModelOptions) -> Vec<f32> {
    let (mut m, mut be) = load(preset, opts);
    let mut last = Vec::new();
    for c in toks.chunks(chunk) {
        last = m.step(&mut be, &[(0, c)], Logits::Last).unwrap().remove(0);
    }
    last
}
