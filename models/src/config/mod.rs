//! The hyperparameters of a model of a shipped family, read from and written to GGUF metadata
//! with the keys llama.cpp uses, and the list of weight tensors (names and ggml-order shapes) such
//! a model has.
//!
//! Nothing here is coded per family: each family's [`ArchSpec`] declares its keys
//! ([`KeySpec`], walked by the reader and writer of `keys.rs`) and its tensors ([`TensorGroup`]s
//! of [`TensorTemplate`]s, walked by [`ModelConfig::tensor_specs`] in `tensors.rs`). A config has
//! the common hyperparameters plus the optional groups its family declares: M-RoPE
//! `rope_sections`, the gated DeltaNet [`SsmConfig`], a shared expert in [`Ffn::Moe`]. The tables
//! below are those of the `qwen35` / `qwen35moe` family ([`crate::arch::qwen35`]).
//!
//! # Metadata keys
//!
//! `{arch}` is the value of `general.architecture`: `qwen35` (dense) or `qwen35moe`. Key spellings
//! were checked against llama.cpp's `src/llama-arch.cpp` (`LLM_KV_NAMES`, stored copy id
//! 70225849277, read through the search tool) and `docs/notes/hybrid-ops.md` §6.2; meanings follow
//! the notes and the loaders (`ml.get_key(LLM_KV_SSM_*, hparams.ssm_*)`).
//!
//! | key | field | written as | notes |
//! | --- | --- | --- | --- |
//! | `general.architecture` | [`ModelConfig::arch`] | string | anything else is [`ConfigError::UnknownArchitecture`] |
//! | `{arch}.block_count` | `n_layer` | u32 | includes MTP blocks when `nextn_predict_layers > 0` |
//! | `{arch}.context_length` | `n_ctx_train` | u32 | |
//! | `{arch}.embedding_length` | `n_embd` | u32 | |
//! | `{arch}.vocab_size` | `n_vocab` | u32 | optional; else `token_embd.weight` ne1 |
//! | `{arch}.feed_forward_length` | [`Ffn::Dense`] `n_ff` | u32 | `qwen35` only |
//! | `{arch}.attention.head_count` | `n_head` | u32 | |
//! | `{arch}.attention.head_count_kv` | `n_head_kv` | u32 | must divide `n_head` |
//! | `{arch}.attention.key_length` | `head_dim` | u32 | |
//! | `{arch}.attention.value_length` | (= `head_dim`) | u32 | must equal `key_length` (the gate is `head_dim`·`n_head` wide) |
//! | `{arch}.attention.layer_norm_rms_epsilon` | `rms_eps` | f32 | also the GDN l2-norm eps |
//! | `{arch}.rope.freq_base` | `rope_freq_base` | f32 | |
//! | `{arch}.rope.dimension_count` | `n_rot` | u32 | even, at most `key_length` |
//! | `{arch}.rope.dimension_sections` | `rope_sections` | i32\[4\] | required (llama.cpp `get_key_or_arr(.., 4, true)`); shorter arrays are padded with 0 |
//! | `{arch}.ssm.conv_kernel` | `ssm.d_conv` | u32 | |
//! | `{arch}.ssm.state_size` | `ssm.d_state` (S_k) | u32 | |
//! | `{arch}.ssm.group_count` | `ssm.n_group` (H_k) | u32 | must divide H_v |
//! | `{arch}.ssm.time_step_rank` | `ssm.dt_rank` (H_v) | u32 | |
//! | `{arch}.ssm.inner_size` | `ssm.d_inner` (H_v·S_v) | u32 | a multiple of H_v; S_v = inner / H_v |
//! | `{arch}.full_attention_interval` | `ssm.full_attention_interval` | u32 | optional, default 4 (llama.cpp's default) |
//! | `{arch}.attention.recurrent_layers` | `ssm.recurrent_layers` | bool\[n_layer\] | optional, overrides the interval (newer llama.cpp) |
//! | `{arch}.nextn_predict_layers` | `nextn_predict_layers` | u32 | optional, default 0 |
//! | `{arch}.expert_count` | [`Ffn::Moe`] `n_expert` | u32 | `qwen35moe` only |
//! | `{arch}.expert_used_count` | `n_expert_used` | u32 | at most `expert_count` |
//! | `{arch}.expert_feed_forward_length` | `n_ff_exp` | u32 | |
//! | `{arch}.expert_shared_feed_forward_length` | `n_ff_shexp` | u32 | |
//!
//! Whether the output projection is tied to the embedding is not metadata: llama.cpp treats a
//! missing `output.weight` as tied, and so does [`ModelConfig::from_gguf`].
//!
//! # Layer kinds
//!
//! Layer `i` is full attention when `(i + 1) % full_attention_interval == 0`, else gated DeltaNet
//! (llama.cpp: `is_recurrent(il) = (il + 1) % full_attention_interval != 0`, notes §4.2), unless
//! `attention.recurrent_layers` is present, which names the recurrent layers explicitly.
//!
//! # Tensors
//!
//! [`ModelConfig::tensor_specs`] lists every weight with llama.cpp's names (`LLM_TENSOR_NAMES` in
//! llama-arch.cpp) and shapes in ggml order (notes §6.3). MTP (`nextn`) tensors are not listed;
//! the blocks at index `>= n_layer - nextn_predict_layers` are not specified here.
//!
//! # Limits
//!
//! Every count and width is bounded before anything is sized from it, so a file or a
//! `config.json` with an absurd value is an error naming the key and the value, not an allocation
//! that never ends. The limits sit far above every released model (largest known value in
//! brackets), so they only ever stop damaged or hostile input:
//!
//! | limit | value | applies to | largest real value |
//! | --- | --- | --- | --- |
//! | [`MAX_LAYERS`] | 4096 | `block_count`, `full_attention_interval` | 126 layers (Llama 3.1 405B) |
//! | [`MAX_EXPERTS`] | 65536 | `expert_count`, `expert_used_count` | 512 experts (Qwen3-Next) |
//! | [`MAX_HEADS`] | 4096 | `head_count`, `head_count_kv`, `ssm.group_count`, `ssm.time_step_rank` | 128 heads |
//! | [`MAX_VOCAB`] | 2^24 | `vocab_size` | 262144 tokens (Gemma 3) |
//! | [`MAX_WIDTH`] | 2^20 | `embedding_length`, the FFN widths, `key_length`, `ssm.state_size`, `ssm.inner_size` | 53248 (an FFN width of Llama 3.1 405B) |
//! | [`MAX_CONV_KERNEL`] | 1024 | `ssm.conv_kernel` | 4 |
//! | [`MAX_CONTEXT`] | 2^30 | `context_length` | about 10M tokens |
//! | [`MAX_PARAMS`] | 2^44 | the weights of all tensors together | about 2^40 (1T-parameter models) |
//!
//! With them every tensor dimension and byte size fits a `u64` with room to spare (the largest
//! tensor has at most 2^56 elements), every count fits the `u32` it is written as, and
//! [`ModelConfig::tensor_specs`] lists at most 4096 · 17 + 3 tensors.
//!
//! # Validation
//!
//! [`ModelConfig::validate`] is the one check every path runs (`from_gguf`, `with_override`,
//! `preset`, the converter, `synthesize`, `Model::load`, `ModelWeights::load`), with checked
//! arithmetic throughout. It requires:
//!
//! - every count nonzero and within its limit above, and the total parameter count within
//!   [`MAX_PARAMS`];
//! - `layer_norm_rms_epsilon` finite and > 0; `rope.freq_base` finite and > 0;
//! - `rope.dimension_count` > 0, even and at most `key_length`; the rope sections a sum that is
//!   positive and at most `dimension_count / 2` (each section counts rotated pairs);
//! - `head_count` a multiple of `head_count_kv`; `ssm.time_step_rank` a multiple of
//!   `ssm.group_count`; `ssm.inner_size` a multiple of `ssm.time_step_rank`; `ssm.conv_kernel` at
//!   least 2 (the conv state keeps `conv_kernel - 1` columns);
//! - `nextn_predict_layers` below `block_count`; `attention.recurrent_layers`, when present, one
//!   flag per block;
//! - for `qwen35moe`: `expert_used_count` in `1..=expert_count`, and nonzero FFN widths.
//!
//! [`ModelConfig::tensor_problems`] then checks a file's tensors against the config: first that
//! the file holds blocks up to `block_count - nextn_predict_layers - 1` at all (else one
//! [`TensorProblem::Blocks`]), then every expected tensor's presence and shape, then that the file
//! has no tensor the config does not expect ([`TensorProblem::Unexpected`]; llama.cpp's loader
//! refuses those too, "wrong number of tensors"). Tensors of MTP blocks
//! (`blk.N` with `N >= block_count - nextn_predict_layers`) are allowed and not checked.
//!
//! # Presets
//!
//! [`ModelConfig::preset`]: `tiny` and `tiny-moe` are made up for fast CPU tests. `qwen35-27b` and
//! `qwen35moe-35b-a3b` take their sizes from the project brief (the Qwen3.5 HF configs as reported
//! there): layer counts, widths, head counts and dims, expert counts and vocab. The values marked
//! *unverified* in [`ModelConfig::preset`] (context length, rope base, rope sections, tied
//! embeddings) follow the HF `Qwen3_5TextConfig` defaults quoted in the notes and were not checked
//! against a shipped GGUF.

use std::fmt;

use crate::arch::ArchSpec;
use crate::gguf::{Array, GgufError, GgufFile, GgufWriter, Value};

mod keys;
mod tensors;

pub use keys::{Field, KeySpec, Presence};
pub(crate) use tensors::merged_gate_up;
pub use tensors::{
    BlockPart, Dim, EMBEDDING_AND_FINAL_NORM, TensorGroup, TensorProblem, TensorSpec, TensorTemplate, UNTIED_HEAD, t,
};

/// Most blocks (`block_count`) a config may have; also the largest `full_attention_interval`.
pub const MAX_LAYERS: usize = 4096;
/// Most routed experts (`expert_count`, and so `expert_used_count`).
pub const MAX_EXPERTS: usize = 65_536;
/// Most heads of any kind (attention q and kv heads, gated DeltaNet key and value heads).
pub const MAX_HEADS: usize = 4096;
/// Largest vocabulary.
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest width: `n_embd`, the FFN and expert widths, the head dims, `ssm_d_state` and
/// `ssm_d_inner`.
pub const MAX_WIDTH: usize = 1 << 20;
/// Widest conv kernel (`ssm.conv_kernel`).
pub const MAX_CONV_KERNEL: usize = 1024;
/// Longest training context (`context_length`).
pub const MAX_CONTEXT: usize = 1 << 30;
/// Most weights (elements of every tensor together).
pub const MAX_PARAMS: u64 = 1 << 44;

/// A shipped model family ([`crate::arch::REGISTRY`]): its name and declarations. Compared and
/// hashed by name.
#[derive(Clone, Copy)]
pub struct Arch(&'static ArchSpec);

impl Arch {
    /// `qwen35`: dense FFN.
    pub const QWEN35: Arch = Arch(&crate::arch::qwen35::QWEN35);
    /// `qwen35moe`: routed experts plus one gated shared expert.
    pub const QWEN35MOE: Arch = Arch(&crate::arch::qwen35::QWEN35MOE);
    /// `qwen3`: plain GQA attention, dense FFN.
    pub const QWEN3: Arch = Arch(&crate::arch::qwen3::QWEN3);
    /// `qwen3moe`: plain GQA attention, routed experts without a shared expert.
    pub const QWEN3MOE: Arch = Arch(&crate::arch::qwen3::QWEN3MOE);

    /// The family `spec` declares.
    pub const fn of(spec: &'static ArchSpec) -> Arch {
        Arch(spec)
    }

    /// The `general.architecture` string (and the metadata key prefix).
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// The family's declarations.
    pub fn spec(self) -> &'static ArchSpec {
        self.0
    }

    /// The arch for a `general.architecture` string ([`crate::arch::lookup`]).
    pub fn from_name(name: &str) -> Option<Arch> {
        crate::arch::lookup(name).map(Arch)
    }
}

impl PartialEq for Arch {
    fn eq(&self, other: &Arch) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Arch {}

impl std::hash::Hash for Arch {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.name.hash(state);
    }
}

impl fmt::Debug for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Arch({})", self.0.name)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a layer's token mixer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Full attention over the paged KV cache (Qwen3.5: gated, with q/k norms and M-RoPE, notes
    /// §4.2).
    FullAttention,
    /// Gated DeltaNet linear attention (notes §2.2).
    GatedDeltaNet,
}

/// The feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ffn {
    /// SwiGLU with `n_ff` hidden units (`qwen35`).
    Dense { n_ff: usize },
    /// `n_expert` routed experts of `n_ff_exp` units, top `n_expert_used`, plus, when
    /// `n_ff_shexp` is set, a sigmoid-gated shared expert of that many units (`qwen35moe`).
    Moe { n_expert: usize, n_expert_used: usize, n_ff_exp: usize, n_ff_shexp: Option<usize> },
}

/// The gated DeltaNet layers of a hybrid model (`{arch}.ssm.*`) and which blocks they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsmConfig {
    /// Conv kernel width (`ssm.conv_kernel`, at least 2).
    pub d_conv: usize,
    /// S_k, the key head dim (`ssm.state_size`).
    pub d_state: usize,
    /// H_k, the key heads (`ssm.group_count`).
    pub n_group: usize,
    /// H_v, the value heads (`ssm.time_step_rank`).
    pub dt_rank: usize,
    /// H_v · S_v (`ssm.inner_size`).
    pub d_inner: usize,
    /// Block `i` is full attention when `(i + 1) % full_attention_interval == 0`.
    pub full_attention_interval: usize,
    /// Explicit per-block "is recurrent" flags, when the file has them (overrides the interval).
    pub recurrent_layers: Option<Vec<bool>>,
}

/// Hyperparameters of a model of a shipped family, read from and written to GGUF metadata with
/// the keys its [`ArchSpec`] declares. Counts are element counts; see the module doc for the
/// metadata key of each field. The optional groups (`rope_sections`, `ssm`, the shared expert)
/// are present exactly when the family declares their keys ([`ModelConfig::validate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family.
    pub arch: Arch,
    /// Blocks in the file (`block_count`), MTP blocks included.
    pub n_layer: usize,
    /// Training context length in tokens.
    pub n_ctx_train: usize,
    /// Hidden width.
    pub n_embd: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Query heads of the full-attention layers.
    pub n_head: usize,
    /// KV heads of the full-attention layers (grouped: q head h uses kv head h / (n_head/n_head_kv)).
    pub n_head_kv: usize,
    /// Per-head dim of q, k and v (`key_length` = `value_length`).
    pub head_dim: usize,
    /// Epsilon of every RMS norm (and of the gated DeltaNet's l2 norms).
    pub rms_eps: f32,
    /// Rope base frequency.
    pub rope_freq_base: f32,
    /// Rotated dims per head (`rope.dimension_count`).
    pub n_rot: usize,
    /// M-RoPE sections (pairs per position stream), for families with M-RoPE.
    pub rope_sections: Option<[usize; 4]>,
    /// The gated DeltaNet layers, for hybrid families.
    pub ssm: Option<SsmConfig>,
    /// MTP blocks at the end (not run in the main pass).
    pub nextn_predict_layers: usize,
    /// The feed-forward block of every main layer.
    pub ffn: Ffn,
    /// True when there is no `output.weight` (the LM head is `token_embd.weight`).
    pub tied_embeddings: bool,
}

/// Why a config could not be read, built or matched against a file. Every variant names the key,
/// tensor or preset at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key is missing or has the wrong type (the GGUF error names the key).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names no family of [`crate::arch::REGISTRY`].
    #[error("unsupported architecture `{arch}` (general.architecture); expected one of {}", crate::arch::known_names())]
    UnknownArchitecture { arch: String },
    /// A key whose value contradicts another key, or is out of range.
    #[error("metadata key `{key}`: {reason}")]
    Inconsistent { key: String, reason: String },
    /// Tensors that do not match the config (the first few are shown).
    #[error("{} tensor problem(s): {}", problems.len(), summarize(problems))]
    Tensors { problems: Vec<TensorProblem> },
    /// [`ModelConfig::preset`] with an unknown name.
    #[error("unknown preset `{name}` (known: {})", ModelConfig::preset_names().join(", "))]
    UnknownPreset { name: String },
    /// Every count is within its limit, but all the tensors together hold more than
    /// [`MAX_PARAMS`] weights.
    #[error(
        "the config has {params} weights in all, above Tessera's limit of {} (2^44; the largest released models \
         have about 2^40)",
        MAX_PARAMS
    )]
    TooManyParams { params: u64 },
    /// [`ModelConfig::with_override`] for a key the config does not write.
    #[error("cannot override `{key}`: not a key of this config (keys: {known})")]
    UnknownOverride { key: String, known: String },
    /// [`ModelConfig::with_override`] with a value that does not parse as the key's type.
    #[error("cannot override `{key}`: `{value}` is not a valid {expected}")]
    BadOverride { key: String, value: String, expected: String },
}

fn summarize(problems: &[TensorProblem]) -> String {
    let mut s: Vec<String> = problems.iter().take(4).map(ToString::to_string).collect();
    if problems.len() > 4 {
        s.push(format!("and {} more", problems.len() - 4));
    }
    s.join("; ")
}

fn inconsistent(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Inconsistent { key: key.into(), reason: reason.into() }
}

impl ModelConfig {
    /// Every name [`ModelConfig::preset`] accepts: each registered family's
    /// [`ArchSpec::presets`], in registry order.
    pub fn preset_names() -> Vec<&'static str> {
        crate::arch::REGISTRY.iter().flat_map(|s| s.presets.iter().map(|(n, _)| *n)).collect()
    }

    /// A named configuration, declared by its family ([`ArchSpec::presets`]):
    ///
    /// - `tiny`: qwen35, 4 layers (interval 2: GDN, attention, GDN, attention), n_embd 64, vocab
    ///   256, n_ff 128, attention 2 q / 1 kv heads x 32 (n_rot 16, sections `[3,3,2,0]`), GDN 2 key /
    ///   4 value heads x 16, conv 4, untied output.
    /// - `tiny-moe`: qwen35moe, same trunk, 8 experts top-2 of 64 units, shared expert 64 units,
    ///   vocab 256, tied output (no `output.weight`).
    /// - `qwen35-27b`, `qwen35moe-35b-a3b`: the Qwen3.6 27B and 35B-A3B shapes
    ///   ([`crate::arch::qwen35`]).
    /// - `qwen3-tiny` (4 layers, n_embd 64, 2/1 heads x 32, n_ff 128, vocab 256, untied),
    ///   `qwen3moe-tiny` (same trunk, 8 experts top-2 of 64, tied), `qwen3-32b` and
    ///   `qwen3moe-30b-a3b` (the shapes of Qwen/Qwen3-32B and Qwen/Qwen3-30B-A3B,
    ///   [`crate::arch::qwen3`]).
    pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
        let Some((_, make)) = crate::arch::REGISTRY.iter().flat_map(|s| s.presets.iter()).find(|(n, _)| *n == name)
        else {
            return Err(ConfigError::UnknownPreset { name: name.to_string() });
        };
        let c = make();
        c.validate()?;
        Ok(c)
    }

    /// Reads the config from a file's metadata with the declarations of the family its
    /// `general.architecture` names (and `token_embd.weight` for the vocab size when
    /// `{arch}.vocab_size` is absent; `output.weight` presence for tying), then checks it.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ConfigError> {
        let tied = f.tensor("output.weight").is_none();
        let embd_vocab = f.tensor("token_embd.weight").map(|t| t.ne[1]);
        parse(f, tied, embd_vocab)
    }

    /// The metadata keys of this config (with `general.architecture` first, then the family's
    /// keys in declaration order), as [`ModelConfig::from_gguf`] reads them back. Counts are
    /// `u32`, floats `f32`.
    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        keys::write(self)
    }

    /// A copy with one metadata key replaced, `key` without the `{arch}.` prefix
    /// (`block_count`, `attention.head_count`, `rope.dimension_sections` as `11,11,10,0`, ...);
    /// `tied_embeddings` takes `true`/`false`. The result is re-checked.
    pub fn with_override(&self, key: &str, value: &str) -> Result<ModelConfig, ConfigError> {
        self.with_overrides(&[(key, value)])
    }

    /// [`ModelConfig::with_override`] for several keys at once: all are replaced, then the result
    /// is checked once, so keys that must change together (`attention.key_length` and
    /// `attention.value_length`) can. A later entry for the same key wins.
    pub fn with_overrides(&self, overrides: &[(&str, &str)]) -> Result<ModelConfig, ConfigError> {
        let prefix = format!("{}.", self.arch.name());
        let mut md = self.to_metadata();
        let mut tied = self.tied_embeddings;
        for &(key, value) in overrides {
            if key == "tied_embeddings" {
                tied = value.parse().map_err(|_| bad(key, value, "bool"))?;
                continue;
            }
            let full = format!("{prefix}{key}");
            let Some((_, slot)) = md.iter_mut().find(|(k, _)| *k == full) else {
                let known: Vec<String> =
                    md.iter().filter_map(|(k, _)| k.strip_prefix(&prefix).map(str::to_string)).collect();
                return Err(ConfigError::UnknownOverride { key: key.to_string(), known: known.join(", ") });
            };
            *slot = override_value(slot, key, value)?;
        }
        let mut w = GgufWriter::new();
        for (k, v) in md {
            w.add_kv(k, v)?;
        }
        let f = GgufFile::from_bytes(w.to_bytes()?)?;
        parse(&f, tied, None)
    }

    /// The kind of layer `il` (`il < n_layer`): full attention unless the config has gated
    /// DeltaNet layers and `il` is one of them (explicit flags, else not every
    /// `full_attention_interval`-th block).
    pub fn layer_kind(&self, il: usize) -> LayerKind {
        let recurrent = match &self.ssm {
            None => false,
            Some(SsmConfig { recurrent_layers: Some(r), .. }) => r.get(il).copied().unwrap_or(false),
            Some(s) => !(il + 1).is_multiple_of(s.full_attention_interval),
        };
        if recurrent { LayerKind::GatedDeltaNet } else { LayerKind::FullAttention }
    }

    /// Blocks run in the main pass (`n_layer - nextn_predict_layers`).
    pub fn n_main_layers(&self) -> usize {
        self.n_layer.saturating_sub(self.nextn_predict_layers)
    }

    /// S_v, the GDN value head dim (`ssm.inner_size / ssm.time_step_rank`; 0 without GDN layers).
    pub fn ssm_head_v_dim(&self) -> usize {
        self.ssm.as_ref().and_then(|s| s.d_inner.checked_div(s.dt_rank)).unwrap_or(0)
    }

    /// GDN conv channels: `2·H_k·S_k + H_v·S_v` (q, k, v concatenated; 0 without GDN layers).
    pub fn ssm_conv_dim(&self) -> usize {
        // Saturating, as tensor_specs: exact on a validated config.
        self.ssm.as_ref().map_or(0, |s| s.n_group.saturating_mul(s.d_state).saturating_mul(2).saturating_add(s.d_inner))
    }

    /// Checks every value the model uses (the list is in the module doc, "Validation"): the
    /// optional groups present exactly as the family declares them, counts nonzero and within
    /// the [limits](self#limits) (walking the family's keys), floats finite and positive, rope
    /// dims and sections that fit, head counts that divide, the expert counts, and the total
    /// parameter count. All arithmetic is checked, so nothing wraps in a release build. Errors
    /// name the metadata key (`{arch}.key`) and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let spec = self.arch.spec();
        let a = spec.name;
        let k = |s: &str| format!("{a}.{s}");
        let declares = |field: Field| spec.keys.iter().any(|s| s.field == field);
        let shape = |what: &str| inconsistent("general.architecture", format!("{a} does not match the {what}"));
        let ffn_matches = match self.ffn {
            Ffn::Dense { .. } => declares(Field::FeedForwardLength) && !declares(Field::ExpertCount),
            Ffn::Moe { n_ff_shexp, .. } => {
                declares(Field::ExpertCount) && n_ff_shexp.is_some() == declares(Field::ExpertSharedFeedForwardLength)
            }
        };
        if !ffn_matches {
            return Err(shape("FFN kind"));
        }
        if self.ssm.is_some() != declares(Field::SsmConvKernel) {
            return Err(shape("presence of gated DeltaNet (ssm) layers"));
        }
        if self.rope_sections.is_some() != declares(Field::RopeSections) {
            return Err(shape("presence of rope sections"));
        }
        for ks in spec.keys {
            let (Some((limit, what)), Some(v)) = (ks.field.limit(), keys::count(self, ks.field)) else { continue };
            if v == 0 {
                return Err(inconsistent(k(ks.key), "must be nonzero"));
            }
            if v > limit {
                return Err(inconsistent(
                    k(ks.key),
                    format!("{v} is above Tessera's limit of {limit} {what} (far above any real model)"),
                ));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(inconsistent(
                k("attention.layer_norm_rms_epsilon"),
                format!("{} must be finite and > 0", self.rms_eps),
            ));
        }
        if !(self.rope_freq_base.is_finite() && self.rope_freq_base > 0.0) {
            return Err(inconsistent(k("rope.freq_base"), format!("{} must be finite and > 0", self.rope_freq_base)));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(inconsistent(
                k("attention.head_count_kv"),
                format!("head_count {} is not a multiple of head_count_kv {}", self.n_head, self.n_head_kv),
            ));
        }
        if self.n_rot == 0 || self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return Err(inconsistent(
                k("rope.dimension_count"),
                format!("{} must be even, > 0 and at most attention.key_length {}", self.n_rot, self.head_dim),
            ));
        }
        let pairs = self.n_rot / 2;
        if let Some(sections) = self.rope_sections {
            match sections.iter().try_fold(0usize, |acc, &s| acc.checked_add(s)) {
                Some(sum) if sum > 0 && sum <= pairs => {}
                sum => {
                    let sum = sum.map_or_else(|| "overflows".to_string(), |s| format!("is {s}"));
                    return Err(inconsistent(
                        k("rope.dimension_sections"),
                        format!(
                            "{sections:?}: the sum {sum}; it must be > 0 and at most rope.dimension_count / 2 = \
                             {pairs} (rotated pairs)"
                        ),
                    ));
                }
            }
        }
        if let Some(s) = &self.ssm {
            s.validate(&k, self.n_layer)?;
        }
        if self.nextn_predict_layers >= self.n_layer {
            return Err(inconsistent(
                k("nextn_predict_layers"),
                format!("{} leaves no main layers of block_count {}", self.nextn_predict_layers, self.n_layer),
            ));
        }
        if let Ffn::Moe { n_expert, n_expert_used, .. } = self.ffn
            && n_expert_used > n_expert
        {
            return Err(inconsistent(
                k("expert_used_count"),
                format!("{n_expert_used} is more than expert_count {n_expert}"),
            ));
        }
        // Every dim is bounded above, so each product fits a u128 (and the largest tensor a u64).
        let params: u128 = self.tensor_specs().iter().map(|s| s.ne.iter().map(|&d| d as u128).product::<u128>()).sum();
        if params > MAX_PARAMS as u128 {
            return Err(ConfigError::TooManyParams { params: u64::try_from(params).unwrap_or(u64::MAX) });
        }
        Ok(())
    }
}

impl SsmConfig {
    /// The checks of [`ModelConfig::validate`] that concern the gated DeltaNet (counts are
    /// checked there, nonzero): keys named through `k`.
    fn validate(&self, k: &dyn Fn(&str) -> String, n_layer: usize) -> Result<(), ConfigError> {
        if self.d_conv < 2 {
            return Err(inconsistent(
                k("ssm.conv_kernel"),
                format!("{} must be at least 2 (the conv state keeps conv_kernel - 1 columns)", self.d_conv),
            ));
        }
        if !self.d_inner.is_multiple_of(self.dt_rank) {
            return Err(inconsistent(
                k("ssm.inner_size"),
                format!("{} is not ssm.time_step_rank {} x a head_v_dim (not a multiple)", self.d_inner, self.dt_rank),
            ));
        }
        if !self.dt_rank.is_multiple_of(self.n_group) {
            return Err(inconsistent(
                k("ssm.time_step_rank"),
                format!("{} value heads is not a multiple of ssm.group_count {}", self.dt_rank, self.n_group),
            ));
        }
        if let Some(r) = &self.recurrent_layers
            && r.len() != n_layer
        {
            return Err(inconsistent(
                k("attention.recurrent_layers"),
                format!("has {} entries, block_count is {n_layer}", r.len()),
            ));
        }
        Ok(())
    }
}

fn bad(key: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError::BadOverride { key: key.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// `value` parsed as the type of the metadata value `slot` holds (`key` names it in errors).
fn override_value(slot: &Value, key: &str, value: &str) -> Result<Value, ConfigError> {
    Ok(match slot {
        Value::U32(_) => Value::U32(value.parse().map_err(|_| bad(key, value, "u32"))?),
        Value::F32(_) => Value::F32(value.parse().map_err(|_| bad(key, value, "f32"))?),
        Value::Array(Array::I32(_)) => Value::Array(Array::I32(list(key, value, "i32")?)),
        Value::Array(Array::Bool(_)) => Value::Array(Array::Bool(list(key, value, "bool")?)),
        other => return Err(bad(key, value, &other.type_description())),
    })
}

/// `value` as a comma-separated list of `T` (`what` names T in the error).
fn list<T: std::str::FromStr>(key: &str, value: &str, what: &str) -> Result<Vec<T>, ConfigError> {
    let parsed = value.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>();
    parsed.map_err(|_| bad(key, value, &format!("comma-separated {what} list")))
}

/// The config of `f`, read with the declarations of its family.
fn parse(f: &GgufFile, tied_embeddings: bool, embd_vocab: Option<usize>) -> Result<ModelConfig, ConfigError> {
    let arch_name = f.get_str("general.architecture")?;
    let spec =
        crate::arch::lookup(arch_name).ok_or_else(|| ConfigError::UnknownArchitecture { arch: arch_name.into() })?;
    keys::read(f, spec, tied_embeddings, embd_vocab)
}

impl fmt::Display for ModelConfig {
    /// A multi-line human summary (used by `tessera inspect`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_attn = (0..self.n_main_layers()).filter(|&i| self.layer_kind(i) == LayerKind::FullAttention).count();
        let n_gdn = self.n_main_layers() - n_attn;
        write!(f, "arch {}: {} layers ({n_attn} full attention", self.arch, self.n_layer)?;
        if self.ssm.is_some() {
            write!(f, ", {n_gdn} gated DeltaNet")?;
        }
        if self.nextn_predict_layers > 0 {
            write!(f, ", {} MTP", self.nextn_predict_layers)?;
        }
        match &self.ssm {
            Some(s) => writeln!(f, "), interval {}", s.full_attention_interval)?,
            None => writeln!(f, ")")?,
        }
        writeln!(
            f,
            "  n_embd {}, vocab {}, context {}, rms eps {:e}, {} output",
            self.n_embd,
            self.n_vocab,
            self.n_ctx_train,
            self.rms_eps,
            if self.tied_embeddings { "tied" } else { "separate" }
        )?;
        write!(
            f,
            "  attention: {} q / {} kv heads x {}, n_rot {}",
            self.n_head, self.n_head_kv, self.head_dim, self.n_rot
        )?;
        if let Some(sections) = self.rope_sections {
            write!(f, ", sections {sections:?}")?;
        }
        writeln!(f, ", rope base {}", self.rope_freq_base)?;
        if let Some(s) = &self.ssm {
            writeln!(
                f,
                "  gated DeltaNet: {} key heads x {}, {} value heads x {}, conv {}",
                s.n_group,
                s.d_state,
                s.dt_rank,
                self.ssm_head_v_dim(),
                s.d_conv
            )?;
        }
        match self.ffn {
            Ffn::Dense { n_ff } => writeln!(f, "  ffn: dense {n_ff}")?,
            Ffn::Moe { n_expert, n_expert_used, n_ff_exp, n_ff_shexp } => {
                write!(f, "  ffn: {n_expert} experts top-{n_expert_used} x {n_ff_exp}")?;
                match n_ff_shexp {
                    Some(sh) => writeln!(f, ", shared expert {sh}")?,
                    None => writeln!(f)?,
                }
            }
        }
        write!(f, "  parameters: {}", self.n_params())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_layer_kinds_follow_interval() {
        for name in ["tiny", "tiny-moe", "qwen35-27b", "qwen35moe-35b-a3b"] {
            let c = ModelConfig::preset(name).unwrap();
            assert!(c.ssm.is_some(), "{name}");
            assert!((0..c.n_layer).any(|i| c.layer_kind(i) == LayerKind::FullAttention), "{name}");
            assert!((0..c.n_layer).any(|i| c.layer_kind(i) == LayerKind::GatedDeltaNet), "{name}");
        }
        let c = ModelConfig::preset("qwen35-27b").unwrap();
        let attn: Vec<usize> = (0..12).filter(|&i| c.layer_kind(i) == LayerKind::FullAttention).collect();
        assert_eq!(attn, [3, 7, 11]);
        assert!(matches!(ModelConfig::preset("huge"), Err(ConfigError::UnknownPreset { .. })));
    }

    #[test]
    fn real_preset_shapes() {
        let c = ModelConfig::preset("qwen35-27b").unwrap();
        let specs = c.tensor_specs();
        let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap().ne;
        assert_eq!(get("blk.3.attn_q.weight"), [5120, 2 * 256 * 24, 1, 1]);
        assert_eq!(get("blk.0.attn_qkv.weight"), [5120, 2 * 16 * 128 + 48 * 128, 1, 1]);
        assert_eq!(get("blk.0.ssm_conv1d.weight"), [4, 10240, 1, 1]);
        let m = ModelConfig::preset("qwen35moe-35b-a3b").unwrap();
        let specs = m.tensor_specs();
        let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap().ne;
        assert_eq!(get("blk.0.ffn_down_exps.weight"), [512, 2048, 256, 1]);
        assert_eq!(get("blk.0.ssm_out.weight"), [4096, 2048, 1, 1]);
    }

    #[test]
    fn overrides_recheck() {
        let c = ModelConfig::preset("tiny").unwrap();
        assert_eq!(c.with_override("block_count", "8").unwrap().n_layer, 8);
        assert_eq!(c.with_override("rope.dimension_sections", "4,2,2,0").unwrap().rope_sections, Some([4, 2, 2, 0]));
        let e = c.with_override("attention.head_count_kv", "3").unwrap_err().to_string();
        assert!(e.contains("qwen35.attention.head_count_kv"), "{e}");
        assert!(matches!(c.with_override("nope", "1"), Err(ConfigError::UnknownOverride { .. })));
        // keys that must change together: one at a time fails, together they pass
        let q = ModelConfig::preset("qwen3-tiny").unwrap();
        assert!(q.with_override("attention.key_length", "128").is_err());
        let both = q.with_overrides(&[("attention.key_length", "128"), ("attention.value_length", "128")]).unwrap();
        assert_eq!(both.head_dim, 128);
        assert!(matches!(c.with_override("block_count", "x"), Err(ConfigError::BadOverride { .. })));
    }
}
