//! Reusable layer builders: the pieces a family's step graph is made of, one family of layers a
//! file.
//!
//! Each builder takes the [`StepBuilder`](crate::arch::StepBuilder) of the step graph under
//! construction, a small spec of the layer's shape (no model config), the block's weight prefix
//! (`blk.N`, llama.cpp's naming) and its input; it binds the resident weights it reads by name
//! (each module's doc lists them, with their ggml-order shapes) and returns its output node.
//! Activations are f32 `[n_embd, n_tokens]`: column `j` is the step's packed token `j`
//! ([`crate::batch`]).
//!
//! - [`norm`]: `rms_norm(x) * w`, the token embedding lookup.
//! - [`project`]: projections of one input, one matmul per group stacked at load.
//! - [`attention`]: attention over the paged KV cache (q/k norms, rope or M-RoPE, optional
//!   output gate).
//! - [`delta_net`]: gated DeltaNet over the recurrent cache.
//! - [`ffn`]: dense SwiGLU; top-k routed experts with an optional sigmoid-gated shared expert.
//!
//! Load-time preparation that a builder can take advantage of (stacking projections, routing a
//! shared expert as one more expert) lives beside the builder and is called from
//! [`Architecture::prepare_weights`](crate::arch::Architecture::prepare_weights); the builders
//! check which stacked weights are resident and fall back to the plain ones, so both give the
//! same result.

pub mod attention;
pub mod delta_net;
pub mod ffn;
pub mod norm;
pub mod project;
