//! # tessera-models: models on top of the graph
//!
//! - [`gguf`]: GGUF v3 reading (mmap, every field validated before use) and writing.
//! - [`cache`]: the paged KV cache (fixed-size blocks, free list, per-sequence block tables) and
//!   the recurrent-state cache (one conv + delta-rule slot per sequence).

pub mod cache;
pub mod gguf;
