//! Architectures: what a model family implements, and the registry of the families this crate
//! ships.
//!
//! # How the pieces fit
//!
//! [`crate::model::Model`] is the runtime every family shares: resident weights, the paged KV
//! cache and the recurrent-state cache, the per-layer cache memory, the planned step graphs kept
//! per shape bucket, the fusion passes, stepping and sampling. It drives one
//! [`Architecture`], which says
//!
//! 1. what cache each main layer needs ([`Architecture::layer_caches`]): the runtime sizes the
//!    caches from it, allocates each layer's cache memory and zeroes a sequence's recurrent slots
//!    before its first step;
//! 2. how to prepare the weights once at load ([`Architecture::prepare_weights`], default
//!    nothing): stacking projections, routing a shared expert as one more expert;
//! 3. how to build a step graph ([`Architecture::build`]): given a [`StepBuilder`] (the graph,
//!    resident weights bound by name, the step's input leaves and each layer's cache tensors), the
//!    final hidden state of every packed token. The runtime then gathers each sequence's last
//!    row, applies the LM head ([`Architecture::lm_head`], tied or not) and, for sampling steps,
//!    the `sample` op.
//!
//! The layer builders of [`crate::layers`] (attention over the paged cache, gated DeltaNet,
//! dense and MoE FFNs, norms, projections) are what a family's `build` is made of.
//!
//! A family that ships here also declares its GGUF metadata keys and its tensors as data
//! ([`ArchSpec`]), which one generic reader, writer and validator walk
//! ([`crate::config::ModelConfig`]); [`lookup`] finds it by llama.cpp's `general.architecture`
//! name, and [`crate::model::Model::load`] picks the family from the file that way. An
//! architecture defined outside the crate implements [`Architecture`] and hands it, with its
//! weights, to [`crate::model::Model::from_arch`].

mod builder;
pub mod qwen3;
pub mod qwen35;

pub use builder::{KvCacheTensors, StepBuilder, StepLeaves};

use std::fmt;

use tessera_graph::{Backend, Tensor};

use crate::config::{ConfigError, KeySpec, ModelConfig, TensorGroup};
use crate::model::{ModelError, ModelOptions};
use crate::weights::{ModelWeights, WeightsError};

/// What cache one main layer needs. Every [`LayerCacheNeed::Attention`] layer of a model must
/// declare the same shape (one paged KV cache serves them all), and so must every
/// [`LayerCacheNeed::Recurrent`] layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerCacheNeed {
    /// No per-sequence state (an MLP block, say).
    None,
    /// K and V rows per token in the paged KV cache: `n_head_kv` heads of `k_dim` (keys) and
    /// `v_dim` (values) elements, stored in [`crate::model::ModelOptions::kv_dtype`].
    Attention {
        /// KV heads per token.
        n_head_kv: usize,
        /// Elements per key head.
        k_dim: usize,
        /// Elements per value head.
        v_dim: usize,
    },
    /// f32 state per sequence slot: a conv ring `conv = [d_conv - 1, channels]` and a recurrent
    /// state `state = [S_k, S_v, H_v]` (ggml order), read and written in place by
    /// `ssm_conv_update_inplace` and `gated_delta_net`.
    Recurrent {
        /// `[d_conv - 1, channels]`: conv samples kept per channel, and channels.
        conv: [usize; 2],
        /// `[S_k, S_v, H_v]`: key dim, value dim, value heads.
        state: [usize; 3],
    },
}

/// A model family's forward pass and cache needs: what the runtime
/// ([`crate::model::Model`]) drives. See the module doc for how the pieces fit.
///
/// Implementations are immutable after construction (the runtime shares one between steps and
/// threads), and every method but [`Architecture::build`] must be cheap.
pub trait Architecture: Send + Sync + fmt::Debug {
    /// The family's name (llama.cpp's `general.architecture` value for those that have one),
    /// for messages.
    fn name(&self) -> &str;

    /// Vocabulary size: token ids are `0..n_vocab`, and the LM head has `n_vocab` rows.
    fn n_vocab(&self) -> usize;

    /// The GGUF-declared config, for the families this crate ships (`None` for architectures
    /// defined elsewhere).
    fn config(&self) -> Option<&ModelConfig> {
        None
    }

    /// One entry per main layer `0..n`, in order: the cache that layer reads and writes. The
    /// runtime allocates the memory (zeroed) and hands the layer its tensors through
    /// [`StepBuilder::kv_cache`] and [`StepBuilder::recurrent_state`].
    fn layer_caches(&self) -> Vec<LayerCacheNeed>;

    /// Prepares the weights once, after they are resident and before any step graph is built
    /// (stacking the projections that read one input, see [`crate::layers::project`]). `opts`
    /// says which preparations are wanted. The default does nothing.
    fn prepare_weights(
        &self,
        weights: &mut ModelWeights,
        backend: &mut dyn Backend,
        opts: &ModelOptions,
    ) -> Result<(), WeightsError> {
        let _ = (weights, backend, opts);
        Ok(())
    }

    /// Builds the trunk of one step graph: from the step's token ids
    /// ([`StepLeaves::tokens`]) to the final hidden state, f32 `[n_embd, n_tokens]` (after the
    /// final norm), column `j` the packed token `j`. The runtime adds the last-row gather, the
    /// LM head and sampling.
    fn build(&self, b: &mut StepBuilder<'_>) -> Result<Tensor, ModelError>;

    /// The weight the logits are `mul_mat(head, hidden)` of, `[n_embd, n_vocab]`:
    /// `output.weight`, or `token_embd.weight` when the head is tied to the embedding.
    fn lm_head(&self) -> &str {
        "output.weight"
    }
}

/// A family this crate ships: its names, its GGUF metadata keys and tensors (as data, walked by
/// [`ModelConfig`]'s generic reader, writer and validator), and how to make its
/// [`Architecture`] from a config.
pub struct ArchSpec {
    /// llama.cpp's `general.architecture` value, also the `{arch}.` prefix of its keys.
    pub name: &'static str,
    /// The Hugging Face `architectures` / `model_type` names of `config.json` it converts from.
    pub hf_names: &'static [&'static str],
    /// Every metadata key after `{arch}.`, in the order [`ModelConfig::to_metadata`] writes them
    /// (keep llama.cpp's spelling: files must load in llama.cpp too).
    pub keys: &'static [KeySpec],
    /// The tensors of each part of the model, in file order ([`ModelConfig::tensor_specs`]).
    pub tensors: &'static [TensorGroup],
    /// The family's architecture for a config whose `arch` is this family (validated).
    pub make: fn(ModelConfig) -> Result<Box<dyn Architecture>, ConfigError>,
    /// The family's named configurations ([`ModelConfig::preset`]): name and maker. The
    /// result is validated by [`ModelConfig::preset`].
    pub presets: &'static [Preset],
}

impl fmt::Debug for ArchSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArchSpec").field("name", &self.name).field("hf_names", &self.hf_names).finish_non_exhaustive()
    }
}

/// A named config of a family ([`ArchSpec::presets`]): its name and the function that makes it.
pub type Preset = (&'static str, fn() -> ModelConfig);

/// Every family this crate ships, in the order messages list them.
pub static REGISTRY: &[&ArchSpec] = &[&qwen35::QWEN35, &qwen35::QWEN35MOE, &qwen3::QWEN3, &qwen3::QWEN3MOE];

/// The family whose `general.architecture` name is `name`.
pub fn lookup(name: &str) -> Option<&'static ArchSpec> {
    REGISTRY.iter().copied().find(|s| s.name == name)
}

/// The family a Hugging Face `architectures` entry or `model_type` names.
pub fn lookup_hf(name: &str) -> Option<&'static ArchSpec> {
    REGISTRY.iter().copied().find(|s| s.hf_names.contains(&name))
}

/// The names of every shipped family, comma-separated (for messages).
pub fn known_names() -> String {
    REGISTRY.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
}

/// The architecture of a config of a shipped family.
pub fn for_config(config: ModelConfig) -> Result<Box<dyn Architecture>, ConfigError> {
    (config.arch.spec().make)(config)
}
