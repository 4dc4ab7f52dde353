//! The hyperparameters of a `qwen35` / `qwen35moe` model, read from and written to GGUF metadata
//! with the keys llama.cpp uses, and the list of weight tensors (names and ggml-order shapes) such
//! a model has.
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
//! | `{arch}.ssm.conv_kernel` | `ssm_d_conv` | u32 | |
//! | `{arch}.ssm.state_size` | `ssm_d_state` (S_k) | u32 | |
//! | `{arch}.ssm.group_count` | `ssm_n_group` (H_k) | u32 | must divide H_v |
//! | `{arch}.ssm.time_step_rank` | `ssm_dt_rank` (H_v) | u32 | |
//! | `{arch}.ssm.inner_size` | `ssm_d_inner` (H_v·S_v) | u32 | a multiple of H_v; S_v = inner / H_v |
//! | `{arch}.full_attention_interval` | `full_attention_interval` | u32 | optional, default 4 (llama.cpp's default) |
//! | `{arch}.attention.recurrent_layers` | `recurrent_layers` | bool\[n_layer\] | optional, overrides the interval (newer llama.cpp) |
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

use std::collections::HashSet;
use std::fmt;

use crate::gguf::{Array, GgufError, GgufFile, GgufWriter, Value};

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

/// The two architectures this crate models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `qwen35`: dense FFN.
    Qwen35,
    /// `qwen35moe`: routed experts plus one gated shared expert.
    Qwen35Moe,
}

impl Arch {
    /// The `general.architecture` string (and the metadata key prefix).
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }

    /// The arch for a `general.architecture` string.
    pub fn from_name(name: &str) -> Option<Arch> {
        [Arch::Qwen35, Arch::Qwen35Moe].into_iter().find(|a| a.name() == name)
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
    /// Gated full attention with q/k norms and M-RoPE (notes §4.2).
    FullAttention,
    /// Gated DeltaNet linear attention (notes §2.2).
    GatedDeltaNet,
}

/// The feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ffn {
    /// SwiGLU with `n_ff` hidden units (`qwen35`).
    Dense { n_ff: usize },
    /// `n_expert` routed experts of `n_ff_exp` units, top `n_expert_used`, plus a sigmoid-gated
    /// shared expert of `n_ff_shexp` units (`qwen35moe`).
    Moe { n_expert: usize, n_expert_used: usize, n_ff_exp: usize, n_ff_shexp: usize },
}

/// Hyperparameters of a `qwen35` / `qwen35moe` model. Counts are element counts; see the module
/// doc for the metadata key of each field.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Blocks in the file (`block_count`), MTP blocks included.
    pub n_layer: usize,
    /// Training context length in tokens.
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Query heads of the full-attention layers.
    pub n_head: usize,
    /// KV heads of the full-attention layers (grouped: q head h uses kv head h / (n_head/n_head_kv)).
    pub n_head_kv: usize,
    /// Per-head dim of q, k and v (`key_length` = `value_length`).
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    /// Rotated dims per head (`rope.dimension_count`).
    pub n_rot: usize,
    /// M-RoPE sections (pairs per position stream).
    pub rope_sections: [usize; 4],
    /// Conv kernel width (`d_conv`).
    pub ssm_d_conv: usize,
    /// S_k, the GDN key head dim.
    pub ssm_d_state: usize,
    /// H_k, the GDN key heads.
    pub ssm_n_group: usize,
    /// H_v, the GDN value heads.
    pub ssm_dt_rank: usize,
    /// H_v · S_v.
    pub ssm_d_inner: usize,
    pub full_attention_interval: usize,
    /// Explicit per-layer "is recurrent" flags, when the file has them.
    pub recurrent_layers: Option<Vec<bool>>,
    pub nextn_predict_layers: usize,
    pub ffn: Ffn,
    /// True when there is no `output.weight` (the LM head is `token_embd.weight`).
    pub tied_embeddings: bool,
}

/// One weight tensor: its llama.cpp name and shape in ggml order (`ne[0]` innermost, padded with 1s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub ne: [usize; 4],
    /// Dimensions written to the file (1..=4).
    pub n_dims: usize,
}

impl TensorSpec {
    fn new(name: impl Into<String>, dims: &[usize]) -> TensorSpec {
        let mut ne = [1; 4];
        ne[..dims.len()].copy_from_slice(dims);
        TensorSpec { name: name.into(), ne, n_dims: dims.len() }
    }

    /// The dims as written (`ne[..n_dims]`).
    pub fn dims(&self) -> &[usize] {
        &self.ne[..self.n_dims]
    }

    /// Logical element count (saturating; specs of a validated config stay below 2^57).
    pub fn n_elements(&self) -> usize {
        self.ne.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
    }
}

/// A tensor of the file that does not match the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorProblem {
    /// The config needs it and the file lacks it.
    Missing { name: String },
    /// Present with another shape.
    WrongShape { name: String, expected: [usize; 4], found: [usize; 4] },
    /// The config has more main blocks than the file has `blk.N` tensors for (`found` is one more
    /// than the highest block index present, 0 when there is none). Reported alone, instead of
    /// every tensor of the missing blocks.
    Blocks { block_count: usize, main_layers: usize, found: usize },
    /// A tensor the config does not expect (an unknown name, or a block at or beyond
    /// `block_count`).
    Unexpected { name: String },
}

impl fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorProblem::Missing { name } => write!(f, "tensor `{name}` is missing"),
            TensorProblem::WrongShape { name, expected, found } => {
                write!(f, "tensor `{name}` has shape {found:?}, expected {expected:?}")
            }
            TensorProblem::Blocks { block_count, main_layers, found: 0 } => write!(
                f,
                "block_count is {block_count} ({main_layers} main blocks) but the file has no `blk.N` tensors"
            ),
            TensorProblem::Blocks { block_count, main_layers, found } => write!(
                f,
                "block_count is {block_count} ({main_layers} main blocks) but the file has tensors for blocks \
                 0..={} only",
                found - 1
            ),
            TensorProblem::Unexpected { name } => write!(f, "tensor `{name}` is not part of this config"),
        }
    }
}

/// Why a config could not be read, built or matched against a file. Every variant names the key,
/// tensor or preset at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key is missing or has the wrong type (the GGUF error names the key).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` is neither `qwen35` nor `qwen35moe`.
    #[error("unsupported architecture `{arch}` (general.architecture); expected qwen35 or qwen35moe")]
    UnknownArchitecture { arch: String },
    /// A key whose value contradicts another key, or is out of range.
    #[error("metadata key `{key}`: {reason}")]
    Inconsistent { key: String, reason: String },
    /// Tensors that do not match the config (the first few are shown).
    #[error("{} tensor problem(s): {}", problems.len(), summarize(problems))]
    Tensors { problems: Vec<TensorProblem> },
    /// [`ModelConfig::preset`] with an unknown name.
    #[error("unknown preset `{name}` (known: {})", ModelConfig::PRESETS.join(", "))]
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
    /// Names accepted by [`ModelConfig::preset`].
    pub const PRESETS: [&'static str; 4] = ["tiny", "tiny-moe", "qwen35-27b", "qwen35moe-35b-a3b"];

    /// A named configuration.
    ///
    /// - `tiny`: qwen35, 4 layers (interval 2: GDN, attention, GDN, attention), n_embd 64, vocab
    ///   256, n_ff 128, attention 2 q / 1 kv heads x 32 (n_rot 16, sections `[3,3,2,0]`), GDN 2 key /
    ///   4 value heads x 16, conv 4, untied output.
    /// - `tiny-moe`: qwen35moe, same trunk, 8 experts top-2 of 64 units, shared expert 64 units,
    ///   vocab 256, tied output (no `output.weight`).
    /// - `qwen35-27b`: n_embd 5120, 64 layers, n_ff 17408, attention 24/4 x 256, GDN 16/48 x 128,
    ///   vocab 248320 (from the brief). Unverified: context 262144, rope base 1e7, n_rot 64,
    ///   sections `[11,11,10,0]`, eps 1e-6, interval 4, untied.
    /// - `qwen35moe-35b-a3b`: n_embd 2048, 40 layers, 256 experts top-8 of 512, shared 512,
    ///   attention 16/2 x 256, GDN 16/32 x 128, vocab 248320 (from the brief). Unverified: the
    ///   same context, rope, eps, interval and untied output as above.
    pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
        let tiny = ModelConfig {
            arch: Arch::Qwen35,
            n_layer: 4,
            n_ctx_train: 4096,
            n_embd: 64,
            n_vocab: 256,
            n_head: 2,
            n_head_kv: 1,
            head_dim: 32,
            rms_eps: 1e-6,
            rope_freq_base: 10_000_000.0,
            n_rot: 16,
            rope_sections: [3, 3, 2, 0],
            ssm_d_conv: 4,
            ssm_d_state: 16,
            ssm_n_group: 2,
            ssm_dt_rank: 4,
            ssm_d_inner: 64,
            full_attention_interval: 2,
            recurrent_layers: None,
            nextn_predict_layers: 0,
            ffn: Ffn::Dense { n_ff: 128 },
            tied_embeddings: false,
        };
        // Values marked unverified in the doc above.
        let real = ModelConfig {
            n_ctx_train: 262_144,
            rope_freq_base: 10_000_000.0,
            n_rot: 64,
            rope_sections: [11, 11, 10, 0],
            full_attention_interval: 4,
            n_vocab: 248_320,
            ssm_d_conv: 4,
            ssm_d_state: 128,
            ssm_n_group: 16,
            head_dim: 256,
            ..tiny.clone()
        };
        let c = match name {
            "tiny" => tiny,
            "tiny-moe" => ModelConfig {
                arch: Arch::Qwen35Moe,
                ffn: Ffn::Moe { n_expert: 8, n_expert_used: 2, n_ff_exp: 64, n_ff_shexp: 64 },
                tied_embeddings: true,
                ..tiny
            },
            "qwen35-27b" => ModelConfig {
                n_layer: 64,
                n_embd: 5120,
                n_head: 24,
                n_head_kv: 4,
                ssm_dt_rank: 48,
                ssm_d_inner: 48 * 128,
                ffn: Ffn::Dense { n_ff: 17_408 },
                ..real
            },
            "qwen35moe-35b-a3b" => ModelConfig {
                arch: Arch::Qwen35Moe,
                n_layer: 40,
                n_embd: 2048,
                n_head: 16,
                n_head_kv: 2,
                ssm_dt_rank: 32,
                ssm_d_inner: 32 * 128,
                ffn: Ffn::Moe { n_expert: 256, n_expert_used: 8, n_ff_exp: 512, n_ff_shexp: 512 },
                ..real
            },
            _ => return Err(ConfigError::UnknownPreset { name: name.to_string() }),
        };
        c.validate()?;
        Ok(c)
    }

    /// Reads the config from a file's metadata (and `token_embd.weight` for the vocab size when
    /// `{arch}.vocab_size` is absent; `output.weight` presence for tying), then checks it.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ConfigError> {
        let tied = f.tensor("output.weight").is_none();
        let embd_vocab = f.tensor("token_embd.weight").map(|t| t.ne[1]);
        parse(f, tied, embd_vocab)
    }

    /// The metadata keys of this config (with `general.architecture` first), as
    /// [`ModelConfig::from_gguf`] reads them back. Counts are `u32`, floats `f32`.
    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        let a = self.arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let u = |x: usize| Value::U32(x as u32);
        let mut m = vec![
            ("general.architecture".to_string(), Value::String(a.to_string())),
            (k("block_count"), u(self.n_layer)),
            (k("context_length"), u(self.n_ctx_train)),
            (k("embedding_length"), u(self.n_embd)),
            (k("vocab_size"), u(self.n_vocab)),
        ];
        if let Ffn::Dense { n_ff } = self.ffn {
            m.push((k("feed_forward_length"), u(n_ff)));
        }
        m.extend([
            (k("attention.head_count"), u(self.n_head)),
            (k("attention.head_count_kv"), u(self.n_head_kv)),
            (k("attention.key_length"), u(self.head_dim)),
            (k("attention.value_length"), u(self.head_dim)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(self.rms_eps)),
            (k("rope.freq_base"), Value::F32(self.rope_freq_base)),
            (k("rope.dimension_count"), u(self.n_rot)),
            (
                k("rope.dimension_sections"),
                Value::Array(Array::I32(self.rope_sections.iter().map(|&s| s as i32).collect())),
            ),
            (k("ssm.conv_kernel"), u(self.ssm_d_conv)),
            (k("ssm.state_size"), u(self.ssm_d_state)),
            (k("ssm.group_count"), u(self.ssm_n_group)),
            (k("ssm.time_step_rank"), u(self.ssm_dt_rank)),
            (k("ssm.inner_size"), u(self.ssm_d_inner)),
            (k("full_attention_interval"), u(self.full_attention_interval)),
        ]);
        if let Some(r) = &self.recurrent_layers {
            m.push((k("attention.recurrent_layers"), Value::Array(Array::Bool(r.clone()))));
        }
        if self.nextn_predict_layers > 0 {
            m.push((k("nextn_predict_layers"), u(self.nextn_predict_layers)));
        }
        if let Ffn::Moe { n_expert, n_expert_used, n_ff_exp, n_ff_shexp } = self.ffn {
            m.extend([
                (k("expert_count"), u(n_expert)),
                (k("expert_used_count"), u(n_expert_used)),
                (k("expert_feed_forward_length"), u(n_ff_exp)),
                (k("expert_shared_feed_forward_length"), u(n_ff_shexp)),
            ]);
        }
        m
    }

    /// A copy with one metadata key replaced, `key` without the `{arch}.` prefix
    /// (`block_count`, `attention.head_count`, `rope.dimension_sections` as `11,11,10,0`, ...);
    /// `tied_embeddings` takes `true`/`false`. The result is re-checked.
    pub fn with_override(&self, key: &str, value: &str) -> Result<ModelConfig, ConfigError> {
        if key == "tied_embeddings" {
            let tied = value.parse().map_err(|_| bad(key, value, "bool"))?;
            return Ok(ModelConfig { tied_embeddings: tied, ..self.clone() });
        }
        let full = format!("{}.{key}", self.arch.name());
        let mut md = self.to_metadata();
        let Some((_, slot)) = md.iter_mut().find(|(k, _)| *k == full) else {
            let known: Vec<String> = md
                .iter()
                .filter_map(|(k, _)| k.strip_prefix(&format!("{}.", self.arch.name())).map(str::to_string))
                .collect();
            return Err(ConfigError::UnknownOverride { key: key.to_string(), known: known.join(", ") });
        };
        *slot = match slot {
            Value::U32(_) => Value::U32(value.parse().map_err(|_| bad(key, value, "u32"))?),
            Value::F32(_) => Value::F32(value.parse().map_err(|_| bad(key, value, "f32"))?),
            Value::Array(Array::I32(_)) => Value::Array(Array::I32(
                value
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad(key, value, "comma-separated i32 list"))?,
            )),
            Value::Array(Array::Bool(_)) => Value::Array(Array::Bool(
                value
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad(key, value, "comma-separated bool list"))?,
            )),
            other => return Err(bad(key, value, &other.type_description())),
        };
        let mut w = GgufWriter::new();
        for (k, v) in md {
            w.add_kv(k, v)?;
        }
        let f = GgufFile::from_bytes(w.to_bytes()?)?;
        parse(&f, self.tied_embeddings, None)
    }

    /// The kind of layer `il` (`il < n_layer`).
    pub fn layer_kind(&self, il: usize) -> LayerKind {
        let recurrent = match &self.recurrent_layers {
            Some(r) => r.get(il).copied().unwrap_or(false),
            None => !(il + 1).is_multiple_of(self.full_attention_interval),
        };
        if recurrent { LayerKind::GatedDeltaNet } else { LayerKind::FullAttention }
    }

    /// Blocks run in the main pass (`n_layer - nextn_predict_layers`).
    pub fn n_main_layers(&self) -> usize {
        self.n_layer.saturating_sub(self.nextn_predict_layers)
    }

    /// S_v, the GDN value head dim (`ssm.inner_size / ssm.time_step_rank`).
    pub fn ssm_head_v_dim(&self) -> usize {
        self.ssm_d_inner.checked_div(self.ssm_dt_rank).unwrap_or(0)
    }

    /// GDN conv channels: `2·H_k·S_k + H_v·S_v` (q, k, v concatenated).
    pub fn ssm_conv_dim(&self) -> usize {
        // Saturating, as tensor_specs: exact on a validated config.
        self.ssm_n_group.saturating_mul(self.ssm_d_state).saturating_mul(2).saturating_add(self.ssm_d_inner)
    }

    /// Checks every value the model uses (the list is in the module doc, "Validation"): counts
    /// nonzero and within the [limits](self#limits), floats finite and positive, rope dims and
    /// sections that fit, head counts that divide, the expert counts, and the total parameter
    /// count. All arithmetic is checked, so nothing wraps in a release build. Errors name the
    /// metadata key (`{arch}.key`) and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let a = self.arch.name();
        let k = |s: &str| format!("{a}.{s}");
        // (key, value, limit, what the limit counts)
        let mut counts = vec![
            ("block_count", self.n_layer, MAX_LAYERS, "layers"),
            ("context_length", self.n_ctx_train, MAX_CONTEXT, "tokens"),
            ("embedding_length", self.n_embd, MAX_WIDTH, "elements"),
            ("vocab_size", self.n_vocab, MAX_VOCAB, "tokens"),
            ("attention.head_count", self.n_head, MAX_HEADS, "heads"),
            ("attention.head_count_kv", self.n_head_kv, MAX_HEADS, "heads"),
            ("attention.key_length", self.head_dim, MAX_WIDTH, "elements"),
            ("ssm.conv_kernel", self.ssm_d_conv, MAX_CONV_KERNEL, "taps"),
            ("ssm.state_size", self.ssm_d_state, MAX_WIDTH, "elements"),
            ("ssm.group_count", self.ssm_n_group, MAX_HEADS, "heads"),
            ("ssm.time_step_rank", self.ssm_dt_rank, MAX_HEADS, "heads"),
            ("ssm.inner_size", self.ssm_d_inner, MAX_WIDTH, "elements"),
            ("full_attention_interval", self.full_attention_interval, MAX_LAYERS, "layers"),
        ];
        match self.ffn {
            Ffn::Dense { n_ff } => counts.push(("feed_forward_length", n_ff, MAX_WIDTH, "elements")),
            Ffn::Moe { n_expert, n_expert_used, n_ff_exp, n_ff_shexp } => counts.extend([
                ("expert_count", n_expert, MAX_EXPERTS, "experts"),
                ("expert_used_count", n_expert_used, MAX_EXPERTS, "experts"),
                ("expert_feed_forward_length", n_ff_exp, MAX_WIDTH, "elements"),
                ("expert_shared_feed_forward_length", n_ff_shexp, MAX_WIDTH, "elements"),
            ]),
        }
        for (key, v, limit, what) in counts {
            if v == 0 {
                return Err(inconsistent(k(key), "must be nonzero"));
            }
            if v > limit {
                return Err(inconsistent(
                    k(key),
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
        match self.rope_sections.iter().try_fold(0usize, |acc, &s| acc.checked_add(s)) {
            Some(sum) if sum > 0 && sum <= pairs => {}
            sum => {
                let sum = sum.map_or_else(|| "overflows".to_string(), |s| format!("is {s}"));
                return Err(inconsistent(
                    k("rope.dimension_sections"),
                    format!(
                        "{:?}: the sum {sum}; it must be > 0 and at most rope.dimension_count / 2 = {pairs} \
                         (rotated pairs)",
                        self.rope_sections
                    ),
                ));
            }
        }
        if self.ssm_d_conv < 2 {
            return Err(inconsistent(
                k("ssm.conv_kernel"),
                format!("{} must be at least 2 (the conv state keeps conv_kernel - 1 columns)", self.ssm_d_conv),
            ));
        }
        if !self.ssm_d_inner.is_multiple_of(self.ssm_dt_rank) {
            return Err(inconsistent(
                k("ssm.inner_size"),
                format!(
                    "{} is not ssm.time_step_rank {} x a head_v_dim (not a multiple)",
                    self.ssm_d_inner, self.ssm_dt_rank
                ),
            ));
        }
        if !self.ssm_dt_rank.is_multiple_of(self.ssm_n_group) {
            return Err(inconsistent(
                k("ssm.time_step_rank"),
                format!("{} value heads is not a multiple of ssm.group_count {}", self.ssm_dt_rank, self.ssm_n_group),
            ));
        }
        if self.nextn_predict_layers >= self.n_layer {
            return Err(inconsistent(
                k("nextn_predict_layers"),
                format!("{} leaves no main layers of block_count {}", self.nextn_predict_layers, self.n_layer),
            ));
        }
        if let Some(r) = &self.recurrent_layers
            && r.len() != self.n_layer
        {
            return Err(inconsistent(
                k("attention.recurrent_layers"),
                format!("has {} entries, block_count is {}", r.len(), self.n_layer),
            ));
        }
        match (self.arch, self.ffn) {
            (Arch::Qwen35, Ffn::Dense { .. }) => {}
            (Arch::Qwen35Moe, Ffn::Moe { n_expert, n_expert_used, .. }) => {
                if n_expert_used > n_expert {
                    return Err(inconsistent(
                        k("expert_used_count"),
                        format!("{n_expert_used} is more than expert_count {n_expert}"),
                    ));
                }
            }
            (arch, _) => {
                return Err(inconsistent("general.architecture", format!("{arch} does not match the FFN kind")));
            }
        }
        // Every dim is bounded above, so each product fits a u128 (and the largest tensor a u64).
        let params: u128 = self.tensor_specs().iter().map(|s| s.ne.iter().map(|&d| d as u128).product::<u128>()).sum();
        if params > MAX_PARAMS as u128 {
            return Err(ConfigError::TooManyParams { params: u64::try_from(params).unwrap_or(u64::MAX) });
        }
        Ok(())
    }

    /// Every weight tensor of the main layers, in file order: `token_embd`, `output_norm`,
    /// `output` (unless tied), then each block. Shapes in ggml order (notes §6.3).
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        // Saturating: on a validated config nothing comes near usize::MAX, and an unvalidated one
        // must not panic here.
        let m = |a: usize, b: usize| a.saturating_mul(b);
        let (e, v) = (self.n_embd, self.n_vocab);
        let mut t = vec![TensorSpec::new("token_embd.weight", &[e, v]), TensorSpec::new("output_norm.weight", &[e])];
        if !self.tied_embeddings {
            t.push(TensorSpec::new("output.weight", &[e, v]));
        }
        let hd = self.head_dim;
        let (hk, hv, sk, sv) = (self.ssm_n_group, self.ssm_dt_rank, self.ssm_d_state, self.ssm_head_v_dim());
        let value_dim = m(hv, sv);
        let qk_dim = m(2, m(hk, sk));
        let conv_dim = qk_dim.saturating_add(value_dim);
        let q_dim = m(hd, self.n_head);
        let kv_dim = m(hd, self.n_head_kv);
        for il in 0..self.n_main_layers() {
            let mut add = |name: &str, dims: &[usize]| t.push(TensorSpec::new(format!("blk.{il}.{name}"), dims));
            add("attn_norm.weight", &[e]);
            add("post_attention_norm.weight", &[e]);
            match self.layer_kind(il) {
                LayerKind::FullAttention => {
                    add("attn_q.weight", &[e, m(2, q_dim)]);
                    add("attn_k.weight", &[e, kv_dim]);
                    add("attn_v.weight", &[e, kv_dim]);
                    add("attn_output.weight", &[q_dim, e]);
                    add("attn_q_norm.weight", &[hd]);
                    add("attn_k_norm.weight", &[hd]);
                }
                LayerKind::GatedDeltaNet => {
                    add("attn_qkv.weight", &[e, conv_dim]);
                    add("attn_gate.weight", &[e, value_dim]);
                    add("ssm_conv1d.weight", &[self.ssm_d_conv, conv_dim]);
                    add("ssm_dt.bias", &[hv]);
                    add("ssm_a", &[hv]);
                    add("ssm_beta.weight", &[e, hv]);
                    add("ssm_alpha.weight", &[e, hv]);
                    add("ssm_norm.weight", &[sv]);
                    add("ssm_out.weight", &[value_dim, e]);
                }
            }
            match self.ffn {
                Ffn::Dense { n_ff } => {
                    add("ffn_gate.weight", &[e, n_ff]);
                    add("ffn_up.weight", &[e, n_ff]);
                    add("ffn_down.weight", &[n_ff, e]);
                }
                Ffn::Moe { n_expert, n_ff_exp, n_ff_shexp, .. } => {
                    add("ffn_gate_inp.weight", &[e, n_expert]);
                    add("ffn_gate_exps.weight", &[e, n_ff_exp, n_expert]);
                    add("ffn_up_exps.weight", &[e, n_ff_exp, n_expert]);
                    add("ffn_down_exps.weight", &[n_ff_exp, e, n_expert]);
                    add("ffn_gate_inp_shexp.weight", &[e]);
                    add("ffn_gate_shexp.weight", &[e, n_ff_shexp]);
                    add("ffn_up_shexp.weight", &[e, n_ff_shexp]);
                    add("ffn_down_shexp.weight", &[n_ff_shexp, e]);
                }
            }
        }
        t
    }

    /// Every way the tensors of `f` disagree with this config, after [`ModelConfig::validate`]
    /// (whose error is returned as is):
    ///
    /// 1. the file must have `blk.N` tensors up to the last main block, else the one problem is
    ///    [`TensorProblem::Blocks`] (so a huge `block_count` is reported in one line, and nothing
    ///    is sized from it);
    /// 2. every tensor of [`ModelConfig::tensor_specs`] present with its shape
    ///    ([`TensorProblem::Missing`], [`TensorProblem::WrongShape`]); a merged
    ///    `blk.N.ffn_gate_up_exps.weight` `[n_embd, 2·n_ff_exp, n_expert]` (gate rows first, then
    ///    up, per expert) stands in for the gate/up pair, as llama.cpp's loader accepts;
    /// 3. no other tensor ([`TensorProblem::Unexpected`]), except those of MTP blocks (`blk.N`,
    ///    `N` in `n_main_layers()..n_layer`), which are not checked.
    pub fn tensor_problems(&self, f: &GgufFile) -> Result<Vec<TensorProblem>, ConfigError> {
        self.validate()?;
        let n_main = self.n_main_layers();
        let found = f.tensors().iter().filter_map(|t| block_index(&t.name)).max().map_or(0, |b| b.saturating_add(1));
        if n_main > found {
            return Ok(vec![TensorProblem::Blocks { block_count: self.n_layer, main_layers: n_main, found }]);
        }
        let mut problems = Vec::new();
        let mut expected: HashSet<String> = HashSet::new();
        for spec in self.tensor_specs() {
            match f.tensor(&spec.name) {
                Some(info) if info.ne == spec.ne => {}
                Some(info) => problems.push(TensorProblem::WrongShape {
                    name: spec.name.clone(),
                    expected: spec.ne,
                    found: info.ne,
                }),
                None => match merged_gate_up(&spec) {
                    Some(merged) if f.tensor(&merged.name).is_some_and(|i| i.ne == merged.ne) => {
                        expected.insert(merged.name);
                    }
                    _ => problems.push(TensorProblem::Missing { name: spec.name.clone() }),
                },
            }
            expected.insert(spec.name);
        }
        for t in f.tensors() {
            let mtp = block_index(&t.name).is_some_and(|b| (n_main..self.n_layer).contains(&b));
            if !mtp && !expected.contains(&t.name) {
                problems.push(TensorProblem::Unexpected { name: t.name.clone() });
            }
        }
        Ok(problems)
    }

    /// [`ModelConfig::tensor_problems`] as a result: `Err(ConfigError::Tensors)` naming each.
    pub fn validate_tensors(&self, f: &GgufFile) -> Result<(), ConfigError> {
        let problems = self.tensor_problems(f)?;
        if problems.is_empty() { Ok(()) } else { Err(ConfigError::Tensors { problems }) }
    }

    /// Total logical weights (at most [`MAX_PARAMS`] on a validated config; saturating).
    pub fn n_params(&self) -> usize {
        self.tensor_specs().iter().fold(0usize, |acc, s| acc.saturating_add(s.n_elements()))
    }
}

/// The merged expert tensor that may replace `spec` when it is an expert gate or up tensor.
pub(crate) fn merged_gate_up(spec: &TensorSpec) -> Option<TensorSpec> {
    let prefix =
        spec.name.strip_suffix("ffn_gate_exps.weight").or_else(|| spec.name.strip_suffix("ffn_up_exps.weight"))?;
    let [e, ff, n, _] = spec.ne;
    Some(TensorSpec::new(format!("{prefix}ffn_gate_up_exps.weight"), &[e, ff.saturating_mul(2), n]))
}

/// `N` of a tensor named `blk.N.*`.
fn block_index(name: &str) -> Option<usize> {
    let (n, _) = name.strip_prefix("blk.")?.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

fn bad(key: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError::BadOverride { key: key.to_string(), value: value.to_string(), expected: expected.to_string() }
}

fn parse(f: &GgufFile, tied_embeddings: bool, embd_vocab: Option<usize>) -> Result<ModelConfig, ConfigError> {
    let arch_name = f.get_str("general.architecture")?;
    let arch = Arch::from_name(arch_name).ok_or_else(|| ConfigError::UnknownArchitecture { arch: arch_name.into() })?;
    let k = |s: &str| format!("{}.{s}", arch.name());
    let us = |s: &str| f.get_usize(&k(s));
    let n_vocab = match (f.get_usize_opt(&k("vocab_size"))?, embd_vocab) {
        (Some(v), Some(t)) if v != t => {
            return Err(inconsistent(k("vocab_size"), format!("{v} but token_embd.weight has {t} rows")));
        }
        (Some(v), _) | (None, Some(v)) => v,
        (None, None) => return Err(GgufError::MissingKey { key: k("vocab_size") }.into()),
    };
    let head_dim = us("attention.key_length")?;
    let value_length = us("attention.value_length")?;
    if value_length != head_dim {
        return Err(inconsistent(
            k("attention.value_length"),
            format!("{value_length} differs from attention.key_length {head_dim}"),
        ));
    }
    let sections_key = k("rope.dimension_sections");
    let sections = f.get_usize_array_max(&sections_key, 4)?;
    let mut rope_sections = [0; 4];
    rope_sections[..sections.len()].copy_from_slice(&sections);
    let n_layer = us("block_count")?;
    let recurrent_key = k("attention.recurrent_layers");
    let recurrent_layers = match f.get(&recurrent_key) {
        None => None,
        Some(_) => {
            // Checked before copying: one flag per block.
            let flags = f.get_array_of::<bool>(&recurrent_key)?;
            if flags.len() != n_layer {
                return Err(inconsistent(
                    recurrent_key,
                    format!("has {} entries, block_count is {n_layer}", flags.len()),
                ));
            }
            Some(flags.to_vec())
        }
    };
    let ffn = match arch {
        Arch::Qwen35 => Ffn::Dense { n_ff: us("feed_forward_length")? },
        Arch::Qwen35Moe => Ffn::Moe {
            n_expert: us("expert_count")?,
            n_expert_used: us("expert_used_count")?,
            n_ff_exp: us("expert_feed_forward_length")?,
            n_ff_shexp: us("expert_shared_feed_forward_length")?,
        },
    };
    let c = ModelConfig {
        arch,
        n_layer,
        n_ctx_train: us("context_length")?,
        n_embd: us("embedding_length")?,
        n_vocab,
        n_head: us("attention.head_count")?,
        n_head_kv: us("attention.head_count_kv")?,
        head_dim,
        rms_eps: f.get_float(&k("attention.layer_norm_rms_epsilon"))? as f32,
        rope_freq_base: f.get_float(&k("rope.freq_base"))? as f32,
        n_rot: us("rope.dimension_count")?,
        rope_sections,
        ssm_d_conv: us("ssm.conv_kernel")?,
        ssm_d_state: us("ssm.state_size")?,
        ssm_n_group: us("ssm.group_count")?,
        ssm_dt_rank: us("ssm.time_step_rank")?,
        ssm_d_inner: us("ssm.inner_size")?,
        full_attention_interval: f.get_usize_opt(&k("full_attention_interval"))?.unwrap_or(4),
        recurrent_layers,
        nextn_predict_layers: f.get_usize_opt(&k("nextn_predict_layers"))?.unwrap_or(0),
        ffn,
        tied_embeddings,
    };
    c.validate()?;
    Ok(c)
}

impl fmt::Display for ModelConfig {
    /// A multi-line human summary (used by `tessera inspect`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_attn = (0..self.n_main_layers()).filter(|&i| self.layer_kind(i) == LayerKind::FullAttention).count();
        let n_gdn = self.n_main_layers() - n_attn;
        write!(f, "arch {}: {} layers ({n_attn} full attention, {n_gdn} gated DeltaNet", self.arch, self.n_layer)?;
        if self.nextn_predict_layers > 0 {
            write!(f, ", {} MTP", self.nextn_predict_layers)?;
        }
        writeln!(f, "), interval {}", self.full_attention_interval)?;
        writeln!(
            f,
            "  n_embd {}, vocab {}, context {}, rms eps {:e}, {} output",
            self.n_embd,
            self.n_vocab,
            self.n_ctx_train,
            self.rms_eps,
            if self.tied_embeddings { "tied" } else { "separate" }
        )?;
        writeln!(
            f,
            "  attention: {} q / {} kv heads x {}, n_rot {}, sections {:?}, rope base {}",
            self.n_head, self.n_head_kv, self.head_dim, self.n_rot, self.rope_sections, self.rope_freq_base
        )?;
        writeln!(
            f,
            "  gated DeltaNet: {} key heads x {}, {} value heads x {}, conv {}",
            self.ssm_n_group,
            self.ssm_d_state,
            self.ssm_dt_rank,
            self.ssm_head_v_dim(),
            self.ssm_d_conv
        )?;
        match self.ffn {
            Ffn::Dense { n_ff } => writeln!(f, "  ffn: dense {n_ff}")?,
            Ffn::Moe { n_expert, n_expert_used, n_ff_exp, n_ff_shexp } => {
                writeln!(f, "  ffn: {n_expert} experts top-{n_expert_used} x {n_ff_exp}, shared expert {n_ff_shexp}")?
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
        for name in ModelConfig::PRESETS {
            let c = ModelConfig::preset(name).unwrap();
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
        assert_eq!(c.with_override("rope.dimension_sections", "4,2,2,0").unwrap().rope_sections, [4, 2, 2, 0]);
        let e = c.with_override("attention.head_count_kv", "3").unwrap_err().to_string();
        assert!(e.contains("qwen35.attention.head_count_kv"), "{e}");
        assert!(matches!(c.with_override("nope", "1"), Err(ConfigError::UnknownOverride { .. })));
        assert!(matches!(c.with_override("block_count", "x"), Err(ConfigError::BadOverride { .. })));
    }
}
