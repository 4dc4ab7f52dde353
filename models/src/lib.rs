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
//! - [`qwen35`]: [`qwen35::Model`], the `qwen35` / `qwen35moe` forward pass: one graph per step
//!   over resident weights and caches.

pub mod cache;
pub mod config;
pub mod gguf;
pub mod qwen35;
pub mod synth;
pub mod weights;
