//! Conversion of Hugging Face checkpoints to GGUF: Qwen3.5 (`Qwen3_5ForCausalLM` / `qwen3_5_text`
//! → `qwen35`, `Qwen3_5MoeForCausalLM` / `qwen3_5_moe_text` → `qwen35moe`, `qwen35.rs`) and Qwen3
//! (`Qwen3ForCausalLM` → `qwen3`, `Qwen3MoeForCausalLM` → `qwen3moe`, `qwen3.rs`: every tensor
//! copied, see that module).
//!
//! Each family has a `config.json` reader and either a declarative tensor table (`HfTensor`: GGUF
//! name ← checkpoint name template + transform) or hand-coded plans; everything else here (the
//! checkpoint, the checks, streaming, the output) is shared.
//!
//! The Qwen3.5 transforms follow `docs/notes/hybrid-ops.md` (§2.2, §2.4, §3.3, §5, §6) and llama.cpp's
//! `conversion/qwen.py` (semantics only):
//!
//! - every RMS norm weight gets `+1` (HF stores `w` and computes `x·(1 + w)`), except
//!   `linear_attn.norm` (the gated norm, stored as is);
//! - `ssm_a = -exp(A_log)`, `ssm_dt.bias = dt_bias`;
//! - the value heads of the gated DeltaNet are reordered from HF's grouped order to the tiled
//!   order: GGUF value head `r·H_k + k` ← HF head `k·R + r` (`R = H_v / H_k`), on the V rows of
//!   `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, the V
//!   channels of `conv1d` and the columns of `out_proj`;
//! - `conv1d.weight` `[C, 1, d_conv]` is stored as ggml `[d_conv, C]` (same bytes, no flip);
//! - `q_proj` (q and gate interleaved per head) is kept as is;
//! - experts, either per expert (`mlp.experts.N.{gate,up,down}_proj.weight`) or fused
//!   (`mlp.experts.gate_up_proj` `[E, 2·ff, n_embd]`, gate rows first, and `mlp.experts.down_proj`
//!   `[E, n_embd, ff]`) become `ffn_{gate,up}_exps` `[n_embd, ff, E]` and `ffn_down_exps`
//!   `[ff, n_embd, E]`.
//!
//! The vocabulary: when the checkpoint has a `tokenizer.json`, its tokens, merges, special token
//! ids and chat template are written as the `tokenizer.*` keys llama.cpp's converter writes
//! ([`crate::hf_vocab`]: `tokenizer_config.json`, `chat_template.jinja` / `.json` and
//! `config.json`'s `*_token_id` are read too), so the GGUF loads with text in llama.cpp and in
//! Tessera; without it the GGUF has no vocabulary ([`ConvertReport::vocab_tokens`] is `None`).
//!
//! Matrices are stored in the requested dtype; 1-D tensors, `ssm_conv1d` and the router stay f32
//! (as [`crate::synth::storage_dtype`]), and a matrix whose rows are not whole blocks of the
//! requested quantized dtype falls back to f32.
//!
//! # Checks before anything is written
//!
//! `config.json` is read into a [`ModelConfig`] and validated ([`ModelConfig::validate`]: counts
//! within the limits, floats finite and positive, rope dims that fit, ...; [`config_from_hf`]
//! names the `config.json` key). Then every tensor the GGUF needs is located in the checkpoint
//! and its dtype (f32, f16, bf16) and shape checked, and the checkpoint's tensors are checked
//! against the config:
//!
//! | checkpoint | result |
//! | --- | --- |
//! | a tensor the config needs is missing | error naming it and the GGUF tensor it feeds |
//! | no `lm_head.weight` although `tie_word_embeddings` is false | error ([`ConvertError::UntiedWithoutLmHead`]; transformers would leave the head random) |
//! | `lm_head.weight` although `tie_word_embeddings` is true | warning (transformers ties it to the embedding and ignores it), unless its bytes are the embedding's |
//! | tensors of layers at or beyond `num_hidden_layers` | error naming them ([`ConvertError::ExtraLayers`]) |
//! | any other tensor the conversion does not use | error naming it ([`ConvertError::UnknownTensors`]), as llama.cpp's converter refuses a tensor it cannot map |
//! | `mtp.*` (multi-token prediction), `model.visual.*` / `visual.*` (vision), `*.rotary_emb.inv_freq` | skipped, as documented |
//!
//! # Values that do not fit
//!
//! Each value is checked as it is converted: NaN, ±inf, and finite values out of the storage
//! dtype's range (they would be stored as inf or clipped) make the conversion fail with
//! [`ConvertError::NonFinite`], which names the GGUF tensor, the checkpoint tensor, how many values
//! and the first one. The range is: f32 any finite value; f16 `|x| < 65520` (larger rounds to inf);
//! bf16 what rounds to a finite bf16; q8_0 `|x| < 127 · 65520` (the block scale `amax / 127` is an
//! f16); nvfp4 `|x| <= 6 · 448 = 2688` (the largest E2M1 value times the largest UE4M3 scale;
//! larger values are clipped). With [`ConvertOptions::allow_nonfinite`] (`tessera convert
//! --allow-nonfinite`) they are stored as the codec stores them (f32/f16/bf16 keep NaN and inf,
//! q8_0 turns a block with a NaN into NaNs, nvfp4 stores NaN as 0 and clips) and each such tensor is
//! reported in [`ConvertReport::warnings`].
//!
//! # Memory
//!
//! The checkpoint is memory-mapped and each GGUF tensor is produced in chunks of whole rows
//! ([`CHUNK_ELEMS`] values or one row): decoded from the mapped bytes straight into its place (the
//! head reorders and expert stacking are index maps, not copies), checked, encoded and written.
//! Beyond the mapping, memory holds one chunk of f32 values and its encoded bytes. The source
//! pages of each chunk are released from the process once it is written (`MADV_DONTNEED`; they
//! stay in the page cache), those of head-reordered tensors (a few MB each) after the tensor, so
//! the resident set does not grow with the checkpoint or its largest tensor either.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

mod qwen3;
mod qwen35;

use rayon::prelude::*;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value as Json;
use tessera_ops::DType;

use crate::config::{Arch, ConfigError, ModelConfig, TensorSpec};
use crate::gguf::{GgufError, GgufWriter};
use crate::hf_vocab::{VocabError, read_hf_vocab};
use crate::synth::{WEIGHT_DTYPES, check_free_space, storage_dtype};

/// Values converted per chunk (rounded to whole rows, at least one row).
pub const CHUNK_ELEMS: usize = 1 << 20;

/// Tensor names listed in an error before the rest is counted.
const NAMES_SHOWN: usize = 8;

/// Why a checkpoint could not be converted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConvertError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: bad JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: bad safetensors file: {why}")]
    SafeTensors { path: PathBuf, why: String },
    #[error("config.json: {why}")]
    Config { why: String },
    #[error(
        "unsupported architecture `{name}` (expected Qwen3_5ForCausalLM / qwen3_5_text or Qwen3_5MoeForCausalLM / qwen3_5_moe_text)"
    )]
    UnknownArchitecture { name: String },
    #[error("checkpoint lacks tensor `{name}` (needed for `{gguf}`)")]
    MissingTensor { name: String, gguf: String },
    /// `tie_word_embeddings` is false and there is no `lm_head.weight`.
    #[error(
        "config.json has tie_word_embeddings: false but the checkpoint has no `lm_head.weight` (needed for \
         `output.weight`); if the output projection is the embedding, set tie_word_embeddings to true"
    )]
    UntiedWithoutLmHead,
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` has unsupported dtype {dtype} (f32, f16 and bf16 are read)")]
    UnsupportedTensorDtype { name: String, dtype: String },
    #[error("unsupported output dtype {dtype} (f32, f16, bf16, q8_0, nvfp4)")]
    UnsupportedDType { dtype: DType },
    /// The checkpoint has tensors of layers at or beyond `num_hidden_layers`.
    #[error(
        "the checkpoint has {count} tensor(s) of layers at or beyond num_hidden_layers = {n_layer} (config.json): {}",
        list(names, *count)
    )]
    ExtraLayers { n_layer: usize, names: Vec<String>, count: usize },
    /// The checkpoint has tensors the conversion would not use (and does not skip by rule).
    #[error("the checkpoint has {count} tensor(s) that a {arch} conversion does not use: {}", list(names, *count))]
    UnknownTensors { arch: Arch, names: Vec<String>, count: usize },
    /// A tensor with values that are NaN, infinite or out of the storage dtype's range.
    #[error(
        "tensor `{gguf}` (from `{source_name}`): {count} value(s) are NaN, infinite or out of the {dtype} range; the \
         first is {first:e} at row {row}, column {col}; pass --allow-nonfinite (ConvertOptions::allow_nonfinite) to \
         store them anyway"
    )]
    NonFinite { gguf: String, source_name: String, dtype: DType, count: u64, first: f32, row: usize, col: usize },
    /// The output would not fit on its file system.
    #[error("{path}: the output needs {needed} bytes but its file system has {available} bytes free")]
    NoSpace { path: PathBuf, needed: u64, available: u64 },
    /// The checkpoint's tokenizer files could not be converted ([`crate::hf_vocab`]).
    #[error(transparent)]
    Vocab(#[from] VocabError),
    #[error(transparent)]
    ModelConfig(#[from] ConfigError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

type R<T> = Result<T, ConvertError>;

fn cfg_err(why: impl Into<String>) -> ConvertError {
    ConvertError::Config { why: why.into() }
}

/// The first [`NAMES_SHOWN`] of `names`, then how many more.
fn list(names: &[String], count: usize) -> String {
    let mut s: Vec<String> = names.iter().take(NAMES_SHOWN).map(|n| format!("`{n}`")).collect();
    if count > s.len() {
        s.push(format!("and {} more", count - s.len()));
    }
    s.join(", ")
}

/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertOptions {
    /// The storage dtype of the matrices (one of [`WEIGHT_DTYPES`]).
    pub dtype: DType,
    /// Store NaN, infinite and out-of-range values instead of failing (each affected tensor is
    /// listed in [`ConvertReport::warnings`]).
    pub allow_nonfinite: bool,
}

impl ConvertOptions {
    /// Matrices in `dtype`, non-finite values refused.
    pub fn new(dtype: DType) -> ConvertOptions {
        ConvertOptions { dtype, allow_nonfinite: false }
    }
}

/// What [`convert`] wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub config: ModelConfig,
    pub n_tensors: usize,
    pub data_bytes: u64,
    /// The number of tokens of the vocabulary written (`tokenizer.*` keys, from the checkpoint's
    /// `tokenizer.json`), or `None` when the checkpoint has no `tokenizer.json`.
    pub vocab_tokens: Option<usize>,
    /// Things the conversion accepted but the user should know (an ignored `lm_head.weight`,
    /// non-finite values stored under [`ConvertOptions::allow_nonfinite`]), one line each.
    pub warnings: Vec<String>,
}

/// The text config object and the arch of a parsed `config.json`.
fn text_config(json: &Json) -> R<(Arch, &Json)> {
    // The families the converter maps ([`family`]).
    let arch_of = |name: &str| crate::arch::lookup_hf(name).map(Arch::of).filter(|&a| family(a).is_some());
    let mut names: Vec<String> = Vec::new();
    if let Some(a) = json.get("architectures").and_then(Json::as_array) {
        names.extend(a.iter().filter_map(Json::as_str).map(str::to_string));
    }
    if let Some(m) = json.get("model_type").and_then(Json::as_str) {
        names.push(m.to_string());
    }
    if names.is_empty() {
        return Err(cfg_err("neither `architectures` nor `model_type` is present"));
    }
    let arch = names
        .iter()
        .find_map(|n| arch_of(n))
        .ok_or_else(|| ConvertError::UnknownArchitecture { name: names.join(", ") })?;
    Ok((arch, json.get("text_config").filter(|t| !t.is_null()).unwrap_or(json)))
}

/// `c[key]`, treating `null` as absent.
fn field<'j>(c: &'j Json, key: &str) -> Option<&'j Json> {
    c.get(key).filter(|v| !v.is_null())
}

fn get_usize(c: &Json, key: &str) -> R<usize> {
    opt_usize(c, key)?.ok_or_else(|| cfg_err(format!("`{key}` is missing")))
}

/// An optional non-negative integer: absent is `None`, anything else than such an integer an error.
fn opt_usize(c: &Json, key: &str) -> R<Option<usize>> {
    field(c, key)
        .map(|v| {
            v.as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| cfg_err(format!("`{key}` is {v}, expected a non-negative integer")))
        })
        .transpose()
}

/// An optional number: absent is `None`, a non-number an error.
fn opt_f64(c: &Json, key: &str) -> R<Option<f64>> {
    field(c, key).map(|v| v.as_f64().ok_or_else(|| cfg_err(format!("`{key}` is {v}, expected a number")))).transpose()
}

/// A number that must be finite and positive (`what` says of what).
fn positive(key: &str, v: f64) -> R<f64> {
    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(cfg_err(format!("`{key}` is {v}, must be finite and > 0"))) }
}

/// The `config.json` key (or keys) a GGUF metadata key of [`ModelConfig`] comes from, for errors.
fn hf_key(gguf_key: &str) -> &'static str {
    let key = gguf_key.split_once('.').map_or(gguf_key, |(_, k)| k);
    match key {
        "block_count" => "num_hidden_layers",
        "context_length" => "max_position_embeddings",
        "embedding_length" => "hidden_size",
        "vocab_size" => "vocab_size",
        "feed_forward_length" => "intermediate_size",
        "attention.head_count" => "num_attention_heads",
        "attention.head_count_kv" => "num_key_value_heads",
        "attention.key_length" => "head_dim",
        "attention.layer_norm_rms_epsilon" => "rms_norm_eps",
        "rope.freq_base" => "rope_theta",
        "rope.dimension_count" => "head_dim x partial_rotary_factor",
        "rope.dimension_sections" => "mrope_section",
        "ssm.conv_kernel" => "linear_conv_kernel_dim",
        "ssm.state_size" => "linear_key_head_dim",
        "ssm.group_count" => "linear_num_key_heads",
        "ssm.time_step_rank" => "linear_num_value_heads",
        "ssm.inner_size" => "linear_num_value_heads x linear_value_head_dim",
        "full_attention_interval" => "full_attention_interval",
        "attention.recurrent_layers" => "layer_types",
        "expert_count" => "num_experts",
        "expert_used_count" => "num_experts_per_tok",
        "expert_feed_forward_length" => "moe_intermediate_size",
        "expert_shared_feed_forward_length" => "shared_expert_intermediate_size",
        _ => "",
    }
}

/// How the converter maps one family: its `config.json` reader and how each GGUF tensor is made.
struct Family {
    /// The config of a `config.json` of this family (`json` the whole file, `c` its text config),
    /// not yet validated.
    config: fn(arch: Arch, json: &Json, c: &Json) -> R<ModelConfig>,
    /// How the GGUF tensors are made.
    tensors: Tensors,
}

/// How a family's GGUF tensors are made from the checkpoint.
enum Tensors {
    /// A table: one row per GGUF tensor ([`HfTensor`]).
    Table(&'static [HfTensor]),
    /// Coded by hand (transforms that depend on the config's head counts).
    Coded(for<'c> fn(&'c Checkpoint, &ModelConfig, &str, &'c TensorSpec, DType, u64) -> R<TensorPlan<'c>>),
}

/// The converter of `arch`, when there is one.
fn family(arch: Arch) -> Option<Family> {
    let coded = |config| Family { config, tensors: Tensors::Coded(qwen35::plan_tensor) };
    match arch.name() {
        "qwen35" | "qwen35moe" => Some(coded(qwen35::config_from_hf)),
        "qwen3" | "qwen3moe" => Some(Family { config: qwen3::config_from_hf, tensors: Tensors::Table(qwen3::TENSORS) }),
        _ => None,
    }
}

/// The [`ModelConfig`] of a HF `config.json` (parsed) of a family the converter maps, validated
/// ([`ModelConfig::validate`]). A key that is present with the wrong type is an error, never a
/// default; `null` counts as absent. Errors name the `config.json` key and its value (and the GGUF
/// key when the check is [`ModelConfig::validate`]'s).
pub fn config_from_hf(json: &Json) -> R<ModelConfig> {
    let (arch, c) = text_config(json)?;
    let fam = family(arch).ok_or_else(|| ConvertError::UnknownArchitecture { name: arch.name().into() })?;
    let config = (fam.config)(arch, json, c)?;
    validated(&config)?;
    Ok(config)
}

/// [`ModelConfig::validate`], its errors naming the `config.json` key as well.
fn validated(config: &ModelConfig) -> R<()> {
    config.validate().map_err(|e| match e {
        ConfigError::Inconsistent { key, reason } if !hf_key(&key).is_empty() => {
            cfg_err(format!("`{}` ({key} in the GGUF): {reason}", hf_key(&key)))
        }
        e => e.into(),
    })
}

/// One row of a family's converter table: how one GGUF tensor is made.
///
/// Checkpoint names are templates: `{p}` is the text model's prefix (`model.` or
/// `model.language_model.`), `{i}` the block and `{e}` the expert. A tensor's expected checkpoint
/// shape is its GGUF shape reversed (torch order), per expert for stacked experts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HfTensor {
    /// The GGUF name, without `blk.N.` for block tensors.
    pub gguf: &'static str,
    /// The checkpoint name (template).
    pub hf: &'static str,
    /// The transform.
    pub how: HfHow,
}

/// The transform of an [`HfTensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HfHow {
    /// The values as they are.
    Same,
    /// Experts stacked along the GGUF tensor's last dim, one checkpoint tensor per expert (`{e}` in
    /// the name); or, when the checkpoint has `fused` instead (transformers' fused experts), that
    /// one `[E, rows, cols]` tensor, or with `half` the half `half` (0 gate, 1 up) of the rows of
    /// each expert's `[E, 2·rows, cols]`.
    Experts { fused: &'static str, half: Option<usize> },
}

/// `HfTensor { gguf, hf, how }`.
pub(crate) const fn hf(gguf: &'static str, hf: &'static str, how: HfHow) -> HfTensor {
    HfTensor { gguf, hf, how }
}

/// The plan of `spec` from a family's `table` (see [`HfTensor`]).
fn plan_from_table<'c>(
    ck: &'c Checkpoint,
    table: &[HfTensor],
    prefix: &str,
    spec: &'c TensorSpec,
    dtype: DType,
    size: u64,
) -> R<TensorPlan<'c>> {
    let name = spec.name.as_str();
    let (block, short) = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some((il, t)) => (il, t),
        None => ("", name),
    };
    let row = table.iter().find(|r| r.gguf == short).ok_or_else(|| cfg_err(format!("unexpected tensor {name}")))?;
    let fill = |t: &str, e: usize| t.replace("{p}", prefix).replace("{i}", block).replace("{e}", &e.to_string());
    let torch: Vec<usize> = spec.dims().iter().rev().copied().collect();
    let n_rows = spec.ne[1..].iter().product::<usize>();
    let plan = |sources: Vec<&'c Entry>, rows: RowMap, map: Map| {
        let rows_each = n_rows.div_ceil(sources.len().max(1)).max(1);
        TensorPlan { spec, dtype, size, sources, rows_each, rows, cols: None, map }
    };
    match row.how {
        HfHow::Same => Ok(plan(vec![ck.source(&fill(row.hf, 0), name, &torch)?], RowMap::Same, Map::None)),
        HfHow::Experts { fused, half } => {
            let fused = fill(fused, 0);
            let (n_expert, rows, cols) = (spec.ne[2], spec.ne[1], spec.ne[0]);
            match half {
                _ if !ck.has(&fused) => {
                    let sources = (0..n_expert)
                        .map(|e| ck.source(&fill(row.hf, e), name, &[rows, cols]))
                        .collect::<R<Vec<_>>>()?;
                    Ok(plan(sources, RowMap::Same, Map::None))
                }
                None => Ok(plan(vec![ck.source(&fused, name, &[n_expert, rows, cols])?], RowMap::Same, Map::None)),
                Some(h) => {
                    let src = ck.source(&fused, name, &[n_expert, 2 * rows, cols])?;
                    Ok(plan(vec![src], RowMap::Half { ff: rows, off: h * rows }, Map::None))
                }
            }
        }
    }
}

/// A tensor of the checkpoint: where its bytes are in which mapped file.
#[derive(Debug)]
struct Entry {
    name: String,
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range in the file's map.
    start: usize,
    end: usize,
}

impl Entry {
    /// Bytes per element of a dtype the converter reads.
    fn elem_bytes(&self) -> usize {
        if self.dtype == StDtype::F32 { 4 } else { 2 }
    }
}

/// The tensors of a checkpoint: every `*.safetensors` of the directory (the index's files when
/// `model.safetensors.index.json` exists), memory-mapped, with each tensor's place parsed once.
struct Checkpoint {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → where it is.
    index: HashMap<String, Entry>,
}

impl Checkpoint {
    fn open(dir: &Path) -> R<Checkpoint> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ConvertError::Io { path, source }
        };
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = tessera_files::read_input_to_string(&index_path).map_err(io(&index_path))?;
            let json: Json = serde_json::from_str(&text)
                .map_err(|source| ConvertError::Json { path: index_path.clone(), source })?;
            let mut f: Vec<String> = json
                .get("weight_map")
                .and_then(Json::as_object)
                .ok_or_else(|| cfg_err("model.safetensors.index.json has no weight_map"))?
                .values()
                .filter_map(Json::as_str)
                .map(str::to_string)
                .collect();
            f.sort();
            f.dedup();
            f.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if single.exists() {
                vec![single]
            } else {
                let mut f: Vec<PathBuf> = std::fs::read_dir(dir)
                    .map_err(io(dir))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
                    })
                    .collect();
                f.sort();
                f
            }
        };
        if files.is_empty() {
            return Err(ConvertError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no model*.safetensors files"),
            });
        }
        let mut maps: Vec<(PathBuf, memmap2::Mmap)> = Vec::new();
        let mut index: HashMap<String, Entry> = HashMap::new();
        for path in files {
            let file = tessera_files::open_input(&path).map_err(io(&path))?;
            // SAFETY: the file is opened read-only and only read while mapped; a concurrent writer
            // would be the caller's error, as with any mmap'd input.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| ConvertError::SafeTensors { path: path.clone(), why: e.to_string() })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.iter() {
                // The view's bytes lie inside the map (the safetensors reader checked the offsets).
                let start = view.data().as_ptr() as usize - base;
                let entry = Entry {
                    name: name.to_string(),
                    file: maps.len(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                };
                if let Some(first) = index.insert(name.to_string(), entry) {
                    return Err(ConvertError::SafeTensors {
                        path: path.clone(),
                        why: format!("tensor `{name}` is also in {}", maps[first.file].0.display()),
                    });
                }
            }
            maps.push((path, map));
        }
        Ok(Checkpoint { maps, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The bytes of `e`.
    fn bytes(&self, e: &Entry) -> &[u8] {
        // In range: `open` took the range from the map it indexes.
        &self.maps[e.file].1[e.start..e.end]
    }

    /// Releases the pages of bytes `[from, to)` of `e` from this process (they stay in the page
    /// cache and are read again if touched), so the resident set does not grow with the part of
    /// the checkpoint already converted. The pages at either end may hold neighbouring bytes
    /// too; those are read again if needed.
    fn release(&self, e: &Entry, from: usize, to: usize) {
        let (start, end) = ((e.start + from).min(e.end), (e.start + to).min(e.end));
        if start >= end {
            return;
        }
        #[cfg(unix)]
        {
            // SAFETY: the map is a read-only shared mapping of a file: after MADV_DONTNEED a page
            // reads back the file's bytes, so no reference into the map sees different data. The
            // range lies inside the map (clamped to `e`'s, which `open` took from it). Failure only
            // means the pages stay resident.
            let _ = unsafe {
                self.maps[e.file].1.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// The tensor `name` for GGUF tensor `gguf`: present, of a dtype the converter reads, and with
    /// `expected` (a torch-order shape; size-1 axes are ignored when comparing) as its shape.
    fn source(&self, name: &str, gguf: &str, expected: &[usize]) -> R<&Entry> {
        let e = self
            .index
            .get(name)
            .ok_or_else(|| ConvertError::MissingTensor { name: name.to_string(), gguf: gguf.to_string() })?;
        if !matches!(e.dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
            return Err(ConvertError::UnsupportedTensorDtype {
                name: name.to_string(),
                dtype: format!("{:?}", e.dtype),
            });
        }
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&e.shape) != squeeze(expected) {
            return Err(ConvertError::WrongShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }
}

/// The value-head reorder from HF's grouped order to the tiled order along one axis, within
/// `[start, start + h_k·r·d)`: new head `ri·h_k + k` ← old head `k·r + ri`, each head `d` wide.
#[derive(Debug, Clone, Copy)]
struct VHeads {
    start: usize,
    h_k: usize,
    r: usize,
    d: usize,
}

impl VHeads {
    /// The source index of destination index `i` along the axis.
    fn source(&self, i: usize) -> usize {
        let n = self.h_k * self.r * self.d;
        if i < self.start || i >= self.start + n {
            return i;
        }
        let new = i - self.start;
        let (head, off) = (new / self.d, new % self.d);
        let (ri, k) = (head / self.h_k, head % self.h_k);
        self.start + (k * self.r + ri) * self.d + off
    }
}

/// Which source row an output row is (within its source tensor).
#[derive(Debug, Clone, Copy)]
enum RowMap {
    Same,
    VHeads(VHeads),
    /// A fused `[E, 2·ff, n]` gate/up tensor: output row `ex·ff + j` is source row
    /// `ex·2·ff + off + j`.
    Half {
        ff: usize,
        off: usize,
    },
}

/// A function applied to every value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Map {
    None,
    PlusOne,
    NegExp,
}

/// How one GGUF tensor is produced: output row `r` (ne\[0\] values) is row
/// `rows.source(r % rows_each)` of `sources[r / rows_each]`, its columns reordered by `cols`,
/// then `map` applied.
struct TensorPlan<'c> {
    spec: &'c TensorSpec,
    dtype: DType,
    size: u64,
    sources: Vec<&'c Entry>,
    rows_each: usize,
    rows: RowMap,
    cols: Option<VHeads>,
    map: Map,
}

impl TensorPlan<'_> {
    fn n_rows(&self) -> usize {
        self.spec.ne[1..].iter().product()
    }

    /// The checkpoint tensor output row `r` comes from.
    fn source_of(&self, r: usize) -> &Entry {
        self.sources[self.source_row(r).0]
    }

    /// The index in `sources` and the row within that tensor of output row `r`.
    fn source_row(&self, r: usize) -> (usize, usize) {
        let si = (r / self.rows_each).min(self.sources.len() - 1);
        let local = r % self.rows_each;
        let sr = match self.rows {
            RowMap::Same => local,
            RowMap::VHeads(v) => v.source(local),
            RowMap::Half { ff, off } => (local / ff) * 2 * ff + off + local % ff,
        };
        (si, sr)
    }

    /// Releases the source rows of output rows `[a, b)` (runs of consecutive source rows, one
    /// call each); nothing for head-reordered rows, which are not read in order (their tensors
    /// are released whole at the end).
    fn release_rows(&self, ck: &Checkpoint, a: usize, b: usize) {
        if matches!(self.rows, RowMap::VHeads(_)) {
            return;
        }
        let row_bytes = |si: usize| self.spec.ne[0] * self.sources[si].elem_bytes();
        let mut run: Option<(usize, usize, usize)> = None; // (source, first row, end row)
        for r in a..b {
            let (si, sr) = self.source_row(r);
            match run {
                Some((s, first, end)) if s == si && end == sr => run = Some((s, first, end + 1)),
                _ => {
                    if let Some((s, first, end)) = run {
                        ck.release(self.sources[s], first * row_bytes(s), end * row_bytes(s));
                    }
                    run = Some((si, sr, sr + 1));
                }
            }
        }
        if let Some((s, first, end)) = run {
            ck.release(self.sources[s], first * row_bytes(s), end * row_bytes(s));
        }
    }

    /// Writes output row `r` into `out` (`ne[0]` values); `tmp` is scratch of the same length
    /// when `cols` is set.
    fn fill_row(&self, ck: &Checkpoint, r: usize, out: &mut [f32], tmp: &mut [f32]) -> std::io::Result<()> {
        let n = out.len();
        let (si, sr) = self.source_row(r);
        let src = self.sources[si];
        let es = src.elem_bytes();
        let bytes = ck.bytes(src).get(sr * n * es..(sr + 1) * n * es).ok_or_else(|| {
            std::io::Error::other(format!("row {sr} of `{}` is outside the tensor (a converter bug)", src.name))
        })?;
        match self.cols {
            None => decode(src.dtype, bytes, out),
            Some(v) => {
                decode(src.dtype, bytes, tmp);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = tmp[v.source(i)];
                }
            }
        }
        match self.map {
            Map::None => {}
            Map::PlusOne => out.iter_mut().for_each(|x| *x += 1.0),
            Map::NegExp => out.iter_mut().for_each(|x| *x = -x.exp()),
        }
        Ok(())
    }
}

/// Decodes little-endian f32 / f16 / bf16 `bytes` into `out` (same element count).
fn decode(dtype: StDtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        StDtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        StDtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            // BF16: the only other dtype `Checkpoint::source` lets through.
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// Whether `x` can be stored in `dtype` as itself (see the module doc, "Values that do not fit").
fn fits(dtype: DType, x: f32) -> bool {
    match dtype {
        DType::F16 => half::f16::from_f64(x.into()).is_finite(),
        DType::BF16 => half::bf16::from_f64(x.into()).is_finite(),
        DType::Q8_0 => x.is_finite() && half::f16::from_f32(x.abs() / 127.0).is_finite(),
        DType::NvFp4 => x.is_finite() && x.abs() <= NVFP4_MAX,
        _ => x.is_finite(),
    }
}

/// The largest magnitude nvfp4 stores unclipped: E2M1's 6 times UE4M3's 448.
const NVFP4_MAX: f32 = 6.0 * 448.0;

/// Encodes whole rows of `n` values as `dtype` into `out` (replacing its contents).
fn encode_rows(dtype: DType, values: &[f32], n: usize, out: &mut Vec<u8>) -> std::io::Result<()> {
    let rows = values.len() / n;
    let row_bytes = dtype.row_bytes(n).ok_or_else(|| std::io::Error::other(format!("{dtype} row of {n} overflows")))?;
    out.clear();
    out.resize(rows * row_bytes, 0);
    let quant_err = |e: tessera_ops::quant::QuantError| std::io::Error::other(e.to_string());
    out.par_chunks_mut(row_bytes).zip(values.par_chunks(n)).try_for_each(|(o, v)| match dtype {
        DType::F32 => {
            o.chunks_exact_mut(4).zip(v).for_each(|(b, x)| b.copy_from_slice(&x.to_le_bytes()));
            Ok(())
        }
        // Through f64, as `tessera_ops::host::encode`: half's `bf16::from_f32` does not round
        // ties to even, its `from_f64` does (exact for f32 inputs, one rounding).
        DType::F16 => {
            o.chunks_exact_mut(2)
                .zip(v)
                .for_each(|(b, &x)| b.copy_from_slice(&half::f16::from_f64(x.into()).to_le_bytes()));
            Ok(())
        }
        DType::BF16 => {
            o.chunks_exact_mut(2)
                .zip(v)
                .for_each(|(b, &x)| b.copy_from_slice(&half::bf16::from_f64(x.into()).to_le_bytes()));
            Ok(())
        }
        DType::Q8_0 => tessera_ops::quant::quantize_q8_0(v, o).map_err(quant_err),
        DType::NvFp4 => tessera_ops::quant::quantize_nvfp4(v, o).map_err(quant_err),
        DType::I32 => Err(std::io::Error::other("i32 is not a weight dtype")),
    })
}

/// Values that [`fits`] rejected in one tensor: how many, the first (value, row, column).
#[derive(Debug, Clone, Copy)]
struct Misfits {
    count: u64,
    first: (f32, usize, usize),
}

/// Streams `plan`'s tensor to `sink` in chunks of whole rows. Returns the values that do not fit
/// its dtype (`None` when all do); unless `allow`, nothing more is written once one is found (the
/// rest of the tensor is only scanned, to count them).
fn write_tensor(
    ck: &Checkpoint,
    plan: &TensorPlan<'_>,
    allow: bool,
    sink: &mut dyn Write,
) -> std::io::Result<Option<Misfits>> {
    let n = plan.spec.ne[0];
    let rows = plan.n_rows();
    let per = (CHUNK_ELEMS / n).max(1).min(rows);
    let mut values = vec![0f32; per * n];
    let mut bytes = Vec::new();
    let mut misfits: Option<Misfits> = None;
    let scratch = if plan.cols.is_some() { n } else { 0 };
    for a in (0..rows).step_by(per) {
        let b = (a + per).min(rows);
        let v = &mut values[..(b - a) * n];
        v.par_chunks_mut(n)
            .enumerate()
            .try_for_each_init(|| vec![0f32; scratch], |tmp, (i, row)| plan.fill_row(ck, a + i, row, tmp))?;
        let bad = v.par_iter().filter(|&&x| !fits(plan.dtype, x)).count() as u64;
        if bad > 0 {
            let m = misfits.get_or_insert_with(|| {
                // Cannot miss: `bad > 0` values do not fit.
                let i = v.iter().position(|&x| !fits(plan.dtype, x)).unwrap_or(0);
                Misfits { count: 0, first: (v[i], a + i / n, i % n) }
            });
            m.count += bad;
        }
        if misfits.is_none() || allow {
            encode_rows(plan.dtype, v, n, &mut bytes)?;
            sink.write_all(&bytes)?;
        }
        plan.release_rows(ck, a, b);
    }
    for s in &plan.sources {
        ck.release(s, 0, s.end - s.start);
    }
    Ok(misfits)
}

/// Skipped by rule: MTP, vision, and rotary buffers older transformers saved.
fn skipped(name: &str) -> bool {
    name.starts_with("mtp.")
        || name.starts_with("model.visual.")
        || name.starts_with("visual.")
        || name.ends_with(".rotary_emb.inv_freq")
}

/// The layer index of `{prefix}layers.N.*`.
fn layer_of(name: &str, prefix: &str) -> Option<usize> {
    let (n, _) = name.strip_prefix(prefix)?.strip_prefix("layers.")?.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // A number too large for usize is still beyond any layer.
    Some(n.parse().unwrap_or(usize::MAX))
}

/// Progress of [`convert_with_progress`], reported once before the first tensor and after each
/// tensor is converted and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertProgress {
    pub tensors_done: usize,
    pub n_tensors: usize,
    /// Tensor data bytes written so far (without header and padding).
    pub bytes_written: u64,
    pub total_bytes: u64,
}

/// Converts the checkpoint in `dir` to a GGUF at `out`, matrices in `dtype`.
pub fn convert(dir: &Path, out: &Path, dtype: DType) -> R<ConvertReport> {
    convert_with_options(dir, out, &ConvertOptions::new(dtype), None)
}

/// [`convert`], calling `progress` as tensors are written.
pub fn convert_with_progress(
    dir: &Path,
    out: &Path,
    dtype: DType,
    progress: Option<&mut dyn FnMut(ConvertProgress)>,
) -> R<ConvertReport> {
    convert_with_options(dir, out, &ConvertOptions::new(dtype), progress)
}

/// Converts the checkpoint in `dir` to a GGUF at `out` as `opts` says, calling `progress` as
/// tensors are written.
///
/// Everything that can be checked before writing is (see the module doc): the config, every
/// needed tensor's presence, dtype and shape, the checkpoint's other tensors, and the space on
/// `out`'s file system. `out` is checked before any work (not an input, its directory writable)
/// and written atomically ([`tessera_files::AtomicFile`]): on an error an existing file at `out`
/// is left as it was, and no temporary file remains. Tensors are streamed (module doc, "Memory").
pub fn convert_with_options(
    dir: &Path,
    out: &Path,
    opts: &ConvertOptions,
    mut progress: Option<&mut dyn FnMut(ConvertProgress)>,
) -> R<ConvertReport> {
    let dtype = opts.dtype;
    if !WEIGHT_DTYPES.contains(&dtype) {
        return Err(ConvertError::UnsupportedDType { dtype });
    }
    let cfg_path = dir.join("config.json");
    let text = tessera_files::read_input_to_string(&cfg_path)
        .map_err(|source| ConvertError::Io { path: cfg_path.clone(), source })?;
    let json: Json =
        serde_json::from_str(&text).map_err(|source| ConvertError::Json { path: cfg_path.clone(), source })?;
    let config = config_from_hf(&json)?;
    let fam =
        family(config.arch).ok_or_else(|| ConvertError::UnknownArchitecture { name: config.arch.name().into() })?;
    let ck = Checkpoint::open(dir)?;
    // Before any work: `out` must not be one of the inputs, and its directory must take a file.
    let index_path = dir.join("model.safetensors.index.json");
    // The vocabulary (tokenizer.json & co.), read and checked before anything is written.
    let vocab = read_hf_vocab(dir, config.n_vocab, &json)?;
    let tokenizer_files: Vec<PathBuf> =
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json"]
            .iter()
            .map(|f| dir.join(f))
            .collect();
    let mut inputs = vec![cfg_path.as_path(), index_path.as_path()];
    inputs.extend(tokenizer_files.iter().map(PathBuf::as_path));
    inputs.extend(ck.maps.iter().map(|(p, _)| p.as_path()));
    tessera_files::check_output(out, &inputs).map_err(|source| ConvertError::Io { path: out.to_path_buf(), source })?;
    let prefix = ["model.language_model.", "model."]
        .into_iter()
        .find(|p| ck.has(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| ConvertError::MissingTensor {
        name: "model.embed_tokens.weight".into(),
        gguf: "token_embd.weight".into(),
    })?;
    let mut warnings: Vec<String> = vocab.iter().flat_map(|v| v.notes.iter().cloned()).collect();
    if !config.tied_embeddings && !ck.has("lm_head.weight") {
        return Err(ConvertError::UntiedWithoutLmHead);
    }
    let specs = config.tensor_specs();
    // Every tensor located and checked before the output is created.
    let mut used: HashSet<&str> = HashSet::new();
    let mut plans: Vec<TensorPlan<'_>> = Vec::with_capacity(specs.len());
    let mut total_bytes = 0u64;
    for spec in &specs {
        let mut d = storage_dtype(spec, dtype);
        if !spec.ne[0].is_multiple_of(d.block_size()) {
            d = DType::F32;
        }
        let rows: u64 = spec.ne[1..].iter().map(|&x| x as u64).product();
        let row = d.row_bytes(spec.ne[0]).ok_or_else(|| cfg_err(format!("{}: bad row size", spec.name)))? as u64;
        let size = row * rows;
        let plan = match fam.tensors {
            Tensors::Table(table) => plan_from_table(&ck, table, prefix, spec, d, size)?,
            Tensors::Coded(plan) => plan(&ck, &config, prefix, spec, d, size)?,
        };
        used.extend(plan.sources.iter().map(|e| e.name.as_str()));
        plans.push(plan);
        total_bytes += size;
    }
    check_unused(&ck, &config, prefix, &used, &mut warnings)?;
    check_free_space(out, total_bytes).map_err(|(needed, available)| ConvertError::NoSpace {
        path: out.to_path_buf(),
        needed,
        available,
    })?;

    let mut w = GgufWriter::new();
    for (k, v) in config.to_metadata() {
        w.add_kv(k, v)?;
    }
    if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
        w.add_kv("general.name", name)?;
    }
    for (k, v) in vocab.iter().flat_map(|v| v.to_metadata()) {
        w.add_kv(k, v)?;
    }
    for p in &plans {
        w.add_tensor_info(p.spec.name.clone(), p.dtype, p.spec.dims())?;
    }
    let n_tensors = specs.len();
    let mut report = |tensors_done: usize, bytes_written: u64| {
        if let Some(p) = progress.as_mut() {
            p(ConvertProgress { tensors_done, n_tensors, bytes_written, total_bytes });
        }
    };
    report(0, 0);
    let mut failure: Option<ConvertError> = None;
    let (mut done, mut written) = (0usize, 0u64);
    let result = w.write_file_with(out, |name, sink| {
        // Tensors are asked for in insertion order, which is `plans` order.
        let Some(plan) = plans.get(done).filter(|p| p.spec.name == name) else {
            return Err(std::io::Error::other(format!("writer asked for unexpected tensor {name}")));
        };
        if let Some(m) = write_tensor(&ck, plan, opts.allow_nonfinite, sink)? {
            let (first, row, col) = m.first;
            let source_name = plan.source_of(row).name.clone();
            if !opts.allow_nonfinite {
                let e = ConvertError::NonFinite {
                    gguf: plan.spec.name.clone(),
                    source_name,
                    dtype: plan.dtype,
                    count: m.count,
                    first,
                    row,
                    col,
                };
                let msg = e.to_string();
                failure = Some(e);
                return Err(std::io::Error::other(msg));
            }
            warnings.push(format!(
                "tensor `{}` (from `{source_name}`): {} value(s) NaN, infinite or out of the {} range stored as the \
                 codec stores them (first {first:e} at row {row}, column {col})",
                plan.spec.name, m.count, plan.dtype
            ));
        }
        done += 1;
        written += plan.size;
        report(done, written);
        Ok(())
    });
    if let Err(e) = result {
        return Err(failure.unwrap_or(e.into()));
    }
    let vocab_tokens = vocab.map(|v| v.tokens.len());
    Ok(ConvertReport { config, n_tensors, data_bytes: total_bytes, vocab_tokens, warnings })
}

/// The checkpoint's tensors that no plan uses: `lm_head.weight` of a tied model is a warning
/// (unless it equals the embedding), layers beyond the config and anything else not skipped by
/// rule are errors.
fn check_unused(
    ck: &Checkpoint,
    c: &ModelConfig,
    prefix: &str,
    used: &HashSet<&str>,
    warnings: &mut Vec<String>,
) -> R<()> {
    let mut unused: Vec<&str> =
        ck.index.keys().map(String::as_str).filter(|n| !used.contains(n) && !skipped(n)).collect();
    unused.sort_unstable();
    let mut extra_layers = Vec::new();
    let mut unknown = Vec::new();
    for name in unused {
        if name == "lm_head.weight" && c.tied_embeddings {
            let embd = &ck.index[&format!("{prefix}embed_tokens.weight")];
            let head = &ck.index[name];
            if head.dtype != embd.dtype || ck.bytes(head) != ck.bytes(embd) {
                warnings.push(
                    "`lm_head.weight` is ignored: config.json has tie_word_embeddings: true, so the output \
                     projection is the embedding (as in transformers)"
                        .into(),
                );
            }
        } else if layer_of(name, prefix).is_some_and(|l| l >= c.n_layer) {
            extra_layers.push(name.to_string());
        } else {
            unknown.push(name.to_string());
        }
    }
    if !extra_layers.is_empty() {
        let count = extra_layers.len();
        extra_layers.truncate(NAMES_SHOWN);
        return Err(ConvertError::ExtraLayers { n_layer: c.n_layer, names: extra_layers, count });
    }
    if !unknown.is_empty() {
        let count = unknown.len();
        unknown.truncate(NAMES_SHOWN);
        return Err(ConvertError::UnknownTensors { arch: c.arch, names: unknown, count });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_head_reorder_is_tiled() {
        // H_k = 2, R = 2, d = 1: HF heads [k0r0, k0r1, k1r0, k1r1] -> [k0r0, k1r0, k0r1, k1r1].
        let v = VHeads { start: 0, h_k: 2, r: 2, d: 1 };
        assert_eq!((0..4).map(|i| v.source(i)).collect::<Vec<_>>(), [0, 2, 1, 3]);
        // Outside the range, and with an offset.
        let v = VHeads { start: 1, h_k: 2, r: 2, d: 1 };
        assert_eq!((0..5).map(|i| v.source(i)).collect::<Vec<_>>(), [0, 1, 3, 2, 4]);
        // Heads 2 wide move whole.
        let v = VHeads { start: 0, h_k: 2, r: 2, d: 2 };
        assert_eq!((0..8).map(|i| v.source(i)).collect::<Vec<_>>(), [0, 1, 4, 5, 2, 3, 6, 7]);
        // R = 1 is the identity.
        let v = VHeads { start: 0, h_k: 4, r: 1, d: 3 };
        assert!((0..12).all(|i| v.source(i) == i));
    }

    #[test]
    fn ranges_of_the_storage_dtypes() {
        assert!(fits(DType::F32, 1e30) && !fits(DType::F32, f32::NAN) && !fits(DType::F32, f32::INFINITY));
        assert!(fits(DType::F16, 65504.0) && fits(DType::F16, 65519.0) && !fits(DType::F16, 65520.0));
        assert!(fits(DType::BF16, 1e30) && !fits(DType::BF16, f32::MAX) && !fits(DType::BF16, f32::NEG_INFINITY));
        assert!(fits(DType::Q8_0, 127.0 * 65504.0) && !fits(DType::Q8_0, 1e30) && !fits(DType::Q8_0, f32::NAN));
        assert!(fits(DType::NvFp4, -2688.0) && !fits(DType::NvFp4, 2689.0) && !fits(DType::NvFp4, f32::NAN));
    }

    #[test]
    fn layer_index_of_names() {
        assert_eq!(layer_of("model.layers.12.mlp.gate.weight", "model."), Some(12));
        assert_eq!(layer_of("model.layers.99999999999999999999999.x", "model."), Some(usize::MAX));
        assert_eq!(layer_of("model.layers.x.y", "model."), None);
        assert_eq!(layer_of("model.norm.weight", "model."), None);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let j: Json = serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"});
        let e = config_from_hf(&j).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM"), "{e}");
    }
}
