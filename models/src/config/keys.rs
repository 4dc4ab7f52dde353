//! The GGUF metadata keys of a family as data: each [`ArchSpec`](crate::arch::ArchSpec) lists
//! [`KeySpec`]s (the key after `{arch}.`, the [`ModelConfig`] field it fills, whether it is
//! required), and one reader ([`read`]) and one writer ([`write`]) walk the list. The groups a
//! family declares decide the config's shape: declaring the `ssm.*` keys gives it an
//! [`SsmConfig`], `expert_count` a [`Ffn::Moe`], `expert_shared_feed_forward_length` a shared
//! expert, `rope.dimension_sections` M-RoPE sections.

use std::collections::HashMap;

use super::{ConfigError, Ffn, ModelConfig, SsmConfig, inconsistent};
use super::{MAX_CONTEXT, MAX_CONV_KERNEL, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH};
use crate::arch::ArchSpec;
use crate::gguf::{Array, GgufError, GgufFile, Value};

/// The [`ModelConfig`] value a metadata key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// [`ModelConfig::n_layer`] (u32).
    BlockCount,
    /// [`ModelConfig::n_ctx_train`] (u32).
    ContextLength,
    /// [`ModelConfig::n_embd`] (u32).
    EmbeddingLength,
    /// [`ModelConfig::n_vocab`] (u32); when absent, the row count of `token_embd.weight`.
    VocabSize,
    /// [`Ffn::Dense`] `n_ff` (u32).
    FeedForwardLength,
    /// [`ModelConfig::n_head`] (u32).
    HeadCount,
    /// [`ModelConfig::n_head_kv`] (u32).
    HeadCountKv,
    /// [`ModelConfig::head_dim`] (u32).
    KeyLength,
    /// Must equal `key_length` (u32; written as [`ModelConfig::head_dim`]).
    ValueLength,
    /// [`ModelConfig::rms_eps`] (f32).
    RmsEps,
    /// [`ModelConfig::rope_freq_base`] (f32).
    RopeFreqBase,
    /// [`ModelConfig::n_rot`] (u32).
    RopeDimensionCount,
    /// [`ModelConfig::rope_sections`] (i32 array of at most 4, padded with 0).
    RopeSections,
    /// [`SsmConfig::d_conv`] (u32).
    SsmConvKernel,
    /// [`SsmConfig::d_state`] (u32).
    SsmStateSize,
    /// [`SsmConfig::n_group`] (u32).
    SsmGroupCount,
    /// [`SsmConfig::dt_rank`] (u32).
    SsmTimeStepRank,
    /// [`SsmConfig::d_inner`] (u32).
    SsmInnerSize,
    /// [`SsmConfig::full_attention_interval`] (u32).
    FullAttentionInterval,
    /// [`SsmConfig::recurrent_layers`] (bool array, one per block).
    RecurrentLayers,
    /// [`ModelConfig::nextn_predict_layers`] (u32).
    NextnPredictLayers,
    /// [`Ffn::Moe`] `n_expert` (u32).
    ExpertCount,
    /// [`Ffn::Moe`] `n_expert_used` (u32).
    ExpertUsedCount,
    /// [`Ffn::Moe`] `n_ff_exp` (u32).
    ExpertFeedForwardLength,
    /// [`Ffn::Moe`] `n_ff_shexp` (u32).
    ExpertSharedFeedForwardLength,
}

impl Field {
    /// The limit of a count (and what it counts), checked by [`ModelConfig::validate`] with
    /// "nonzero"; `None` for values that are not counts or are checked otherwise.
    pub fn limit(self) -> Option<(usize, &'static str)> {
        use Field::*;
        Some(match self {
            BlockCount | FullAttentionInterval => (MAX_LAYERS, "layers"),
            ContextLength => (MAX_CONTEXT, "tokens"),
            VocabSize => (MAX_VOCAB, "tokens"),
            EmbeddingLength
            | FeedForwardLength
            | KeyLength
            | SsmStateSize
            | SsmInnerSize
            | ExpertFeedForwardLength
            | ExpertSharedFeedForwardLength => (MAX_WIDTH, "elements"),
            HeadCount | HeadCountKv | SsmGroupCount | SsmTimeStepRank => (MAX_HEADS, "heads"),
            SsmConvKernel => (MAX_CONV_KERNEL, "taps"),
            ExpertCount | ExpertUsedCount => (MAX_EXPERTS, "experts"),
            ValueLength | RmsEps | RopeFreqBase | RopeDimensionCount | RopeSections | RecurrentLayers
            | NextnPredictLayers => return None,
        })
    }
}

/// Whether a key must be present, and when it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Must be present; always written.
    Required,
    /// Absent reads as this value; always written.
    Default(usize),
    /// Absent reads as unset (`None`, or 0 for a count); written only when set.
    Optional,
}

/// One metadata key of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpec {
    /// The key after `{arch}.` (`attention.head_count`), spelled as llama.cpp's
    /// `LLM_KV_NAMES`.
    pub key: &'static str,
    /// The config value it holds.
    pub field: Field,
    /// Required, defaulted or optional.
    pub presence: Presence,
}

impl KeySpec {
    /// A required key.
    pub const fn required(key: &'static str, field: Field) -> KeySpec {
        KeySpec { key, field, presence: Presence::Required }
    }

    /// A key read as `default` when absent.
    pub const fn default(key: &'static str, field: Field, default: usize) -> KeySpec {
        KeySpec { key, field, presence: Presence::Default(default) }
    }

    /// A key that may be absent.
    pub const fn optional(key: &'static str, field: Field) -> KeySpec {
        KeySpec { key, field, presence: Presence::Optional }
    }
}

/// A value read from a key.
#[derive(Debug, Clone, PartialEq)]
enum Raw {
    Count(usize),
    Float(f32),
    Sections([usize; 4]),
    Flags(Vec<bool>),
}

/// Reads a config of family `spec` from `f`'s metadata: every declared key by its presence, then
/// the config assembled from the groups the family declares, then validated.
/// `embd_vocab` (the rows of `token_embd.weight`) stands in for an absent `vocab_size`.
pub(super) fn read(
    f: &GgufFile,
    spec: &'static ArchSpec,
    tied_embeddings: bool,
    embd_vocab: Option<usize>,
) -> Result<ModelConfig, ConfigError> {
    let k = |s: &str| format!("{}.{s}", spec.name);
    let mut raw: HashMap<Field, Raw> = HashMap::new();
    // block_count first: the per-block flags are checked against it before they are copied
    let n_layer = match spec.keys.iter().find(|s| s.field == Field::BlockCount) {
        Some(s) => f.get_usize(&k(s.key))?,
        None => return Err(inconsistent(k("block_count"), "the family declares no block count")),
    };
    for ks in spec.keys {
        let key = k(ks.key);
        let present = f.get(&key).is_some();
        let value = match ks.field {
            Field::VocabSize => Some(Raw::Count(match (f.get_usize_opt(&key)?, embd_vocab) {
                (Some(v), Some(t)) if v != t => {
                    return Err(inconsistent(key, format!("{v} but token_embd.weight has {t} rows")));
                }
                (Some(v), _) | (None, Some(v)) => v,
                (None, None) => return Err(GgufError::MissingKey { key }.into()),
            })),
            _ if !present => match ks.presence {
                Presence::Required => return Err(GgufError::MissingKey { key }.into()),
                Presence::Default(d) => Some(Raw::Count(d)),
                Presence::Optional => None,
            },
            Field::RmsEps | Field::RopeFreqBase => Some(Raw::Float(f.get_float(&key)? as f32)),
            Field::RopeSections => {
                let sections = f.get_usize_array_max(&key, 4)?;
                let mut s = [0; 4];
                s[..sections.len()].copy_from_slice(&sections);
                Some(Raw::Sections(s))
            }
            Field::RecurrentLayers => {
                // Checked before copying: one flag per block.
                let flags = f.get_array_of::<bool>(&key)?;
                if flags.len() != n_layer {
                    return Err(inconsistent(key, format!("has {} entries, block_count is {n_layer}", flags.len())));
                }
                Some(Raw::Flags(flags.to_vec()))
            }
            _ => Some(Raw::Count(f.get_usize(&key)?)),
        };
        if let Some(v) = value {
            raw.insert(ks.field, v);
        }
    }
    let count = |field: Field| match raw.get(&field) {
        Some(Raw::Count(v)) => *v,
        _ => 0,
    };
    let float = |field: Field| match raw.get(&field) {
        Some(Raw::Float(v)) => *v,
        _ => 0.0,
    };
    let declares = |field: Field| spec.keys.iter().any(|s| s.field == field);
    let head_dim = count(Field::KeyLength);
    if declares(Field::ValueLength) && count(Field::ValueLength) != head_dim {
        return Err(inconsistent(
            k("attention.value_length"),
            format!("{} differs from attention.key_length {head_dim}", count(Field::ValueLength)),
        ));
    }
    let ssm = declares(Field::SsmConvKernel).then(|| SsmConfig {
        d_conv: count(Field::SsmConvKernel),
        d_state: count(Field::SsmStateSize),
        n_group: count(Field::SsmGroupCount),
        dt_rank: count(Field::SsmTimeStepRank),
        d_inner: count(Field::SsmInnerSize),
        full_attention_interval: count(Field::FullAttentionInterval),
        recurrent_layers: match raw.get(&Field::RecurrentLayers) {
            Some(Raw::Flags(f)) => Some(f.clone()),
            _ => None,
        },
    });
    let ffn = if declares(Field::ExpertCount) {
        Ffn::Moe {
            n_expert: count(Field::ExpertCount),
            n_expert_used: count(Field::ExpertUsedCount),
            n_ff_exp: count(Field::ExpertFeedForwardLength),
            n_ff_shexp: declares(Field::ExpertSharedFeedForwardLength)
                .then(|| count(Field::ExpertSharedFeedForwardLength)),
        }
    } else {
        Ffn::Dense { n_ff: count(Field::FeedForwardLength) }
    };
    let c = ModelConfig {
        arch: super::Arch::of(spec),
        n_layer,
        n_ctx_train: count(Field::ContextLength),
        n_embd: count(Field::EmbeddingLength),
        n_vocab: count(Field::VocabSize),
        n_head: count(Field::HeadCount),
        n_head_kv: count(Field::HeadCountKv),
        head_dim,
        rms_eps: float(Field::RmsEps),
        rope_freq_base: float(Field::RopeFreqBase),
        // llama.cpp: an absent `rope.dimension_count` is the key (head) length
        n_rot: match raw.get(&Field::RopeDimensionCount) {
            Some(Raw::Count(v)) => *v,
            _ => head_dim,
        },
        rope_sections: match raw.get(&Field::RopeSections) {
            Some(Raw::Sections(s)) => Some(*s),
            _ => None,
        },
        ssm,
        nextn_predict_layers: count(Field::NextnPredictLayers),
        ffn,
        tied_embeddings,
    };
    c.validate()?;
    Ok(c)
}

/// The value of `field` in `c`, or `None` when the config does not have it (the group is absent,
/// or an optional value is unset).
fn get(c: &ModelConfig, field: Field) -> Option<Raw> {
    let n = |x: usize| Some(Raw::Count(x));
    let ssm = c.ssm.as_ref();
    match (field, c.ffn) {
        (Field::BlockCount, _) => n(c.n_layer),
        (Field::ContextLength, _) => n(c.n_ctx_train),
        (Field::EmbeddingLength, _) => n(c.n_embd),
        (Field::VocabSize, _) => n(c.n_vocab),
        (Field::FeedForwardLength, Ffn::Dense { n_ff }) => n(n_ff),
        (Field::HeadCount, _) => n(c.n_head),
        (Field::HeadCountKv, _) => n(c.n_head_kv),
        (Field::KeyLength | Field::ValueLength, _) => n(c.head_dim),
        (Field::RmsEps, _) => Some(Raw::Float(c.rms_eps)),
        (Field::RopeFreqBase, _) => Some(Raw::Float(c.rope_freq_base)),
        (Field::RopeDimensionCount, _) => n(c.n_rot),
        (Field::RopeSections, _) => c.rope_sections.map(Raw::Sections),
        (Field::SsmConvKernel, _) => ssm.and_then(|s| n(s.d_conv)),
        (Field::SsmStateSize, _) => ssm.and_then(|s| n(s.d_state)),
        (Field::SsmGroupCount, _) => ssm.and_then(|s| n(s.n_group)),
        (Field::SsmTimeStepRank, _) => ssm.and_then(|s| n(s.dt_rank)),
        (Field::SsmInnerSize, _) => ssm.and_then(|s| n(s.d_inner)),
        (Field::FullAttentionInterval, _) => ssm.and_then(|s| n(s.full_attention_interval)),
        (Field::RecurrentLayers, _) => ssm.and_then(|s| s.recurrent_layers.clone()).map(Raw::Flags),
        (Field::NextnPredictLayers, _) => (c.nextn_predict_layers > 0).then_some(Raw::Count(c.nextn_predict_layers)),
        (Field::ExpertCount, Ffn::Moe { n_expert, .. }) => n(n_expert),
        (Field::ExpertUsedCount, Ffn::Moe { n_expert_used, .. }) => n(n_expert_used),
        (Field::ExpertFeedForwardLength, Ffn::Moe { n_ff_exp, .. }) => n(n_ff_exp),
        (Field::ExpertSharedFeedForwardLength, Ffn::Moe { n_ff_shexp, .. }) => n_ff_shexp.and_then(n),
        _ => None,
    }
}

/// The value of a count field (for validation, unrounded): `None` when the config does not have
/// it.
pub(super) fn count(c: &ModelConfig, field: Field) -> Option<usize> {
    match get(c, field) {
        Some(Raw::Count(v)) => Some(v),
        _ => None,
    }
}

/// The metadata of `c`: `general.architecture`, then every key its family declares that `c`
/// has, in declaration order. Counts are written as u32 (a validated config's fit), floats as
/// f32, sections as i32.
pub(super) fn write(c: &ModelConfig) -> Vec<(String, Value)> {
    let spec = c.arch.spec();
    let mut m = vec![("general.architecture".to_string(), Value::String(spec.name.to_string()))];
    for ks in spec.keys {
        let v = match get(c, ks.field) {
            None => continue,
            Some(Raw::Count(x)) => Value::U32(x as u32),
            Some(Raw::Float(x)) => Value::F32(x),
            Some(Raw::Sections(s)) => Value::Array(Array::I32(s.iter().map(|&s| s as i32).collect())),
            Some(Raw::Flags(f)) => Value::Array(Array::Bool(f)),
        };
        m.push((format!("{}.{}", spec.name, ks.key), v));
    }
    m
}
