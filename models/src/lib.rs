//! # tessera-models: models on top of the graph
//!
//! - [`gguf`]: GGUF v3 reading (mmap, every field validated before use) and writing.
//! - [`config`]: [`config::ModelConfig`], the `qwen35` / `qwen35moe` hyperparameters read from and
//!   written to GGUF metadata with llama.cpp's keys, presets, and the weight tensor list.
//! - [`synth`]: synthetic checkpoints: a GGUF with seeded random weights for any config.
//! - [`cache`]: the paged KV cache (fixed-size blocks, free list, per-sequence block tables) and
//!   the recurrent-state cache (one conv + delta-rule slot per sequence).
//! - [`weights`]: [`weights::ModelWeights`], every tensor uploaded once to a backend and bound
//!   into step graphs as parameter leaves.
//! - [`batch`]: a step's packed (ragged) token layout, padded to a shape bucket.
//! - [`model`]: [`model::Model`], the runtime every family shares: resident weights and caches,
//!   one graph per step for any mix of sequences and lengths (built by the architecture, planned
//!   once per bucket and replayed), stepping and sampling.
//! - [`arch`]: [`arch::Architecture`], what a model family implements (per-layer cache needs,
//!   load-time weight preparation, the step graph's trunk), the registry of shipped families
//!   ([`arch::lookup`]) and the `qwen35` / `qwen35moe` family ([`arch::qwen35`]).
//! - [`layers`]: reusable layer builders: attention over the paged KV cache, gated DeltaNet over
//!   the recurrent cache, dense and MoE FFNs, norms, projections.
//! - [`sample`]: [`sample::Sampler`], greedy / temperature / top-k / top-p sampling with a seed.
//! - [`chat`]: [`chat::ChatTemplate`], a model's Jinja chat template rendered (as transformers does)
//!   into prompt text.
//! - [`tokenizer`]: [`tokenizer::Tokenizer`], the byte-level BPE tokenizer a GGUF carries
//!   (`qwen35` / `qwen2` pre-tokenizers): encode, decode, streaming decode.
//! - [`engine`]: [`engine::Engine`], continuous batching over a model: decode tokens first, then
//!   prompt chunks under a per-step token budget; events, memory accounting.
//!
//! ```
//! use tessera_cpu::CpuBackend;
//! use tessera_models::config::ModelConfig;
//! use tessera_models::engine::{Engine, EngineConfig};
//! use tessera_models::gguf::GgufFile;
//! use tessera_models::model::{Model, ModelOptions};
//! use tessera_models::sample::SamplerParams;
//! use tessera_models::synth::synthesize;
//! use tessera_ops::DType;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A synthetic tiny checkpoint with seeded random f32 weights.
//! let path = std::env::temp_dir().join(format!("tessera_doc_{}.gguf", std::process::id()));
//! synthesize(&ModelConfig::preset("tiny")?, DType::F32, 1, &path, None)?;
//! let file = GgufFile::open(&path)?;
//! let mut backend = CpuBackend::new();
//! let model = Model::load(&file, &mut backend, ModelOptions::default())?;
//! let mut engine = Engine::new(model, Box::new(backend), EngineConfig::default())?;
//! let id = engine.submit(&[1, 2, 3], 4, SamplerParams::greedy())?;
//! let out = engine.run_to_completion()?;
//! assert_eq!(out[&id].len(), 4);
//! # drop(file);
//! # std::fs::remove_file(&path)?;
//! # Ok(())
//! # }
//! ```

pub mod arch;
pub mod batch;
pub mod cache;
pub mod chat;
pub mod config;
pub mod convert;
pub mod engine;
pub mod gguf;
pub mod hf_vocab;
pub mod layers;
pub mod model;
pub mod sample;
pub mod synth;
pub mod tokenizer;
pub mod weights;
