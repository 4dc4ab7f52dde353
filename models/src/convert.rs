//! Conversion of Hugging Face Qwen3.5 checkpoints (`Qwen3_5ForCausalLM` / `qwen3_5_text` →
//! `qwen35`, `Qwen3_5MoeForCausalLM` / `qwen3_5_moe_text` → `qwen35moe`) to GGUF.
//!
//! The transforms follow `docs/notes/hybrid-ops.md` (§2.2, §2.4, §3.3, §5, §6) and llama.cpp's
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
//! Matrices are stored in the requested dtype; 1-D tensors, `ssm_conv1d` and the router stay f32
//! (as [`crate::synth::storage_dtype`]), and a matrix whose rows are not whole blocks of the
//! requested quantized dtype falls back to f32. MTP (`mtp.*`) and vision tensors are skipped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value as Json;
use tessera_ops::DType;

use crate::config::{Arch, ConfigError, Ffn, LayerKind, ModelConfig, TensorSpec};
use crate::gguf::{GgufError, GgufWriter};
use crate::synth::{WEIGHT_DTYPES, storage_dtype};

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
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedTensorDtype { name: String, dtype: String },
    #[error("unsupported output dtype {dtype} (f32, f16, bf16, q8_0, nvfp4)")]
    UnsupportedDType { dtype: DType },
    #[error(transparent)]
    ModelConfig(#[from] ConfigError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

type R<T> = Result<T, ConvertError>;

fn cfg_err(why: impl Into<String>) -> ConvertError {
    ConvertError::Config { why: why.into() }
}

/// What [`convert`] wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub config: ModelConfig,
    pub n_tensors: usize,
    pub data_bytes: u64,
}

/// The text config object and the arch of a parsed `config.json`.
fn text_config(json: &Json) -> R<(Arch, &Json)> {
    let arch_of = |name: &str| match name {
        "Qwen3_5ForCausalLM" | "qwen3_5_text" | "Qwen3_5ForConditionalGeneration" | "qwen3_5" => Some(Arch::Qwen35),
        "Qwen3_5MoeForCausalLM" | "qwen3_5_moe_text" | "Qwen3_5MoeForConditionalGeneration" | "qwen3_5_moe" => {
            Some(Arch::Qwen35Moe)
        }
        _ => None,
    };
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
    Ok((arch, json.get("text_config").unwrap_or(json)))
}

fn get_usize(c: &Json, key: &str) -> R<usize> {
    c.get(key)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| cfg_err(format!("`{key}` is missing or not a non-negative integer")))
}

fn get_f64(c: &Json, key: &str) -> Option<f64> {
    c.get(key).and_then(Json::as_f64)
}

/// The [`ModelConfig`] of a HF Qwen3.5 `config.json` (parsed).
pub fn config_from_hf(json: &Json) -> R<ModelConfig> {
    let (arch, c) = text_config(json)?;
    let n_layer = get_usize(c, "num_hidden_layers")?;
    let head_dim = get_usize(c, "head_dim")?;
    let rope = c.get("rope_parameters").or_else(|| c.get("rope_scaling"));
    let rope_get = |key: &str| rope.and_then(|r| get_f64(r, key)).or_else(|| get_f64(c, key));
    let partial = rope_get("partial_rotary_factor").unwrap_or(1.0);
    let rope_theta = rope_get("rope_theta").unwrap_or(10_000.0);
    let n_rot = (head_dim as f64 * partial).round() as usize;
    let mut rope_sections = [0usize; 4];
    if let Some(s) = rope.and_then(|r| r.get("mrope_section")).and_then(Json::as_array) {
        if s.len() > 4 {
            return Err(cfg_err(format!("mrope_section has {} entries, at most 4", s.len())));
        }
        for (i, v) in s.iter().enumerate() {
            rope_sections[i] = v.as_u64().ok_or_else(|| cfg_err("mrope_section entries must be integers"))? as usize;
        }
    } else {
        rope_sections[0] = n_rot / 2;
    }
    let interval = c.get("full_attention_interval").and_then(Json::as_u64).map(|v| v as usize).unwrap_or(4);
    let recurrent: Option<Vec<bool>> = match c.get("layer_types").and_then(Json::as_array) {
        None => None,
        Some(types) => {
            if types.len() != n_layer {
                return Err(cfg_err(format!(
                    "layer_types has {} entries, num_hidden_layers is {n_layer}",
                    types.len()
                )));
            }
            let mut flags = Vec::with_capacity(n_layer);
            for t in types {
                match t.as_str() {
                    Some("linear_attention") => flags.push(true),
                    Some("full_attention") => flags.push(false),
                    other => return Err(cfg_err(format!("unknown layer type {other:?} in layer_types"))),
                }
            }
            Some(flags)
        }
    };
    let ffn = match arch {
        Arch::Qwen35 => Ffn::Dense { n_ff: get_usize(c, "intermediate_size")? },
        Arch::Qwen35Moe => Ffn::Moe {
            n_expert: get_usize(c, "num_experts")?,
            n_expert_used: get_usize(c, "num_experts_per_tok")?,
            n_ff_exp: get_usize(c, "moe_intermediate_size")?,
            n_ff_shexp: get_usize(c, "shared_expert_intermediate_size")?,
        },
    };
    let n_head = get_usize(c, "num_attention_heads")?;
    let ssm_dt_rank = get_usize(c, "linear_num_value_heads")?;
    let mut config = ModelConfig {
        arch,
        n_layer,
        n_ctx_train: c.get("max_position_embeddings").and_then(Json::as_u64).unwrap_or(4096) as usize,
        n_embd: get_usize(c, "hidden_size")?,
        n_vocab: get_usize(c, "vocab_size")?,
        n_head,
        n_head_kv: get_usize(c, "num_key_value_heads")?,
        head_dim,
        rms_eps: get_f64(c, "rms_norm_eps").unwrap_or(1e-6) as f32,
        rope_freq_base: rope_theta as f32,
        n_rot,
        rope_sections,
        ssm_d_conv: get_usize(c, "linear_conv_kernel_dim")?,
        ssm_d_state: get_usize(c, "linear_key_head_dim")?,
        ssm_n_group: get_usize(c, "linear_num_key_heads")?,
        ssm_dt_rank,
        ssm_d_inner: ssm_dt_rank * get_usize(c, "linear_value_head_dim")?,
        full_attention_interval: interval,
        recurrent_layers: None,
        nextn_predict_layers: 0,
        ffn,
        tied_embeddings: c.get("tie_word_embeddings").and_then(Json::as_bool).unwrap_or(false),
    };
    // Keep the explicit per-layer flags only when the interval does not already say the same.
    if let Some(flags) = recurrent {
        let by_interval: Vec<bool> = (0..n_layer).map(|i| config.layer_kind(i) == LayerKind::GatedDeltaNet).collect();
        if by_interval != flags {
            config.recurrent_layers = Some(flags);
        }
    }
    config.validate()?;
    Ok(config)
}

/// The tensors of a checkpoint: every `*.safetensors` of the directory (the index's files when
/// `model.safetensors.index.json` exists), memory-mapped.
struct Checkpoint {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → index into `maps`.
    index: HashMap<String, usize>,
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
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = tessera_files::open_input(&path).map_err(io(&path))?;
            // SAFETY: the file is opened read-only and only read while mapped; a concurrent writer
            // would be the caller's error, as with any mmap'd input.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| ConvertError::SafeTensors { path: path.clone(), why: e.to_string() })?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Checkpoint { maps, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The tensor as f32 values (row-major, torch order) with its shape.
    fn get(&self, name: &str, gguf: &str) -> R<(Vec<usize>, Vec<f32>)> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| ConvertError::MissingTensor { name: name.to_string(), gguf: gguf.to_string() })?;
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map)
            .map_err(|e| ConvertError::SafeTensors { path: path.clone(), why: e.to_string() })?;
        let view = st.tensor(name).map_err(|e| ConvertError::SafeTensors { path: path.clone(), why: e.to_string() })?;
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            StDtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            StDtype::F16 => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            StDtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            d => return Err(ConvertError::UnsupportedTensorDtype { name: name.to_string(), dtype: format!("{d:?}") }),
        };
        Ok((view.shape().to_vec(), values))
    }

    /// [`Checkpoint::get`], checking the element count against `expected` (a torch-order shape;
    /// size-1 axes are ignored when comparing).
    fn get_shaped(&self, name: &str, gguf: &str, expected: &[usize]) -> R<Vec<f32>> {
        let (shape, v) = self.get(name, gguf)?;
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&shape) != squeeze(expected) {
            return Err(ConvertError::WrongShape { name: name.to_string(), expected: expected.to_vec(), found: shape });
        }
        Ok(v)
    }
}

/// Reorders value heads of a row-major `[rows, cols]` matrix from HF grouped order to tiled
/// order, along rows (`by_rows`) or columns, within the `[start, start + h_k·r·d)` range of that
/// axis: new head `ri·h_k + k` ← old head `k·r + ri`, each head `d` wide.
#[allow(clippy::too_many_arguments)]
fn reorder_v_heads(
    v: &mut [f32],
    rows: usize,
    cols: usize,
    by_rows: bool,
    start: usize,
    h_k: usize,
    r: usize,
    d: usize,
) {
    if r <= 1 {
        return;
    }
    let old = v.to_vec();
    let map = |new: usize| -> usize {
        let (head, off) = (new / d, new % d);
        let (ri, k) = (head / h_k, head % h_k);
        (k * r + ri) * d + off
    };
    let n = h_k * r * d;
    for i in 0..n {
        let src = start + map(i);
        let dst = start + i;
        if by_rows {
            v[dst * cols..(dst + 1) * cols].copy_from_slice(&old[src * cols..(src + 1) * cols]);
        } else {
            for row in 0..rows {
                v[row * cols + dst] = old[row * cols + src];
            }
        }
    }
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
    convert_with_progress(dir, out, dtype, None)
}

/// [`convert`], calling `progress` as tensors are written. Tensors are converted one at a time
/// while the file is written, so memory holds one tensor (plus the memory-mapped checkpoint), not
/// the whole model. `out` is checked before any work (not an input, its directory writable) and
/// written atomically ([`tessera_files::AtomicFile`]): on an error an existing file at `out` is
/// left as it was, and no temporary file remains.
pub fn convert_with_progress(
    dir: &Path,
    out: &Path,
    dtype: DType,
    mut progress: Option<&mut dyn FnMut(ConvertProgress)>,
) -> R<ConvertReport> {
    if !WEIGHT_DTYPES.contains(&dtype) {
        return Err(ConvertError::UnsupportedDType { dtype });
    }
    let cfg_path = dir.join("config.json");
    let text = tessera_files::read_input_to_string(&cfg_path)
        .map_err(|source| ConvertError::Io { path: cfg_path.clone(), source })?;
    let json: Json =
        serde_json::from_str(&text).map_err(|source| ConvertError::Json { path: cfg_path.clone(), source })?;
    let mut config = config_from_hf(&json)?;
    let ck = Checkpoint::open(dir)?;
    // Before any work: `out` must not be one of the inputs, and its directory must take a file.
    let index_path = dir.join("model.safetensors.index.json");
    let mut inputs = vec![cfg_path.as_path(), index_path.as_path()];
    inputs.extend(ck.maps.iter().map(|(p, _)| p.as_path()));
    tessera_files::check_output(out, &inputs).map_err(|source| ConvertError::Io { path: out.to_path_buf(), source })?;
    let prefix = ["model.language_model.", "model."]
        .into_iter()
        .find(|p| ck.has(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| ConvertError::MissingTensor {
        name: "model.embed_tokens.weight".into(),
        gguf: "token_embd.weight".into(),
    })?;
    if !config.tied_embeddings && !ck.has("lm_head.weight") {
        config.tied_embeddings = true;
    }
    let specs = config.tensor_specs();
    let mut w = GgufWriter::new();
    for (k, v) in config.to_metadata() {
        w.add_kv(k, v)?;
    }
    if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
        w.add_kv("general.name", name)?;
    }
    // Each tensor's storage dtype and byte size, declared up front; the bytes are produced while
    // writing.
    let mut plan: Vec<(&TensorSpec, DType, u64)> = Vec::with_capacity(specs.len());
    let mut total_bytes = 0u64;
    for spec in &specs {
        let mut d = storage_dtype(spec, dtype);
        if !spec.ne[0].is_multiple_of(d.block_size()) {
            d = DType::F32;
        }
        w.add_tensor_info(spec.name.clone(), d, spec.dims())?;
        let rows: usize = spec.ne[1..].iter().product();
        let row = d.row_bytes(spec.ne[0]).ok_or_else(|| cfg_err(format!("{}: bad row size", spec.name)))?;
        let size = (row * rows) as u64;
        plan.push((spec, d, size));
        total_bytes += size;
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
        // Tensors are asked for in insertion order, which is `plan` order.
        let Some(&(spec, d, size)) = plan.get(done).filter(|(s, _, _)| s.name == name) else {
            return Err(std::io::Error::other(format!("writer asked for unexpected tensor {name}")));
        };
        let values = match tensor_values(&ck, &config, prefix, spec) {
            Ok(v) => v,
            Err(e) => {
                let msg = e.to_string();
                failure = Some(e);
                return Err(std::io::Error::other(msg));
            }
        };
        debug_assert_eq!(values.len(), spec.n_elements());
        sink.write_all(&encode(d, &values))?;
        done += 1;
        written += size;
        report(done, written);
        Ok(())
    });
    if let Err(e) = result {
        return Err(failure.unwrap_or(e.into()));
    }
    Ok(ConvertReport { config, n_tensors, data_bytes: total_bytes })
}

fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        _ => tessera_ops::host::encode(dtype, &values.iter().map(|&x| x as f64).collect::<Vec<_>>()),
    }
}

/// The values of one GGUF tensor (ggml order = torch row-major with the axes reversed).
fn tensor_values(ck: &Checkpoint, c: &ModelConfig, prefix: &str, spec: &TensorSpec) -> R<Vec<f32>> {
    let name = spec.name.as_str();
    let (e, v) = (c.n_embd, c.n_vocab);
    let get = |hf: &str, shape: &[usize]| ck.get_shaped(hf, name, shape);
    let plus_one = |mut x: Vec<f32>| {
        x.iter_mut().for_each(|w| *w += 1.0);
        x
    };
    match name {
        "token_embd.weight" => return get(&format!("{prefix}embed_tokens.weight"), &[v, e]),
        "output_norm.weight" => return Ok(plus_one(get(&format!("{prefix}norm.weight"), &[e])?)),
        "output.weight" => return get("lm_head.weight", &[v, e]),
        _ => {}
    }
    let rest = name.strip_prefix("blk.").ok_or_else(|| cfg_err(format!("unexpected tensor {name}")))?;
    let (il, t) = rest.split_once('.').ok_or_else(|| cfg_err(format!("unexpected tensor {name}")))?;
    let lp = format!("{prefix}layers.{il}.");
    let (hk, hv, sk, sv) = (c.ssm_n_group, c.ssm_dt_rank, c.ssm_d_state, c.ssm_head_v_dim());
    let r = hv / hk;
    let qk_dim = 2 * hk * sk;
    let value_dim = hv * sv;
    let conv_dim = c.ssm_conv_dim();
    let hd = c.head_dim;
    let la = |s: &str| format!("{lp}linear_attn.{s}");
    let sa = |s: &str| format!("{lp}self_attn.{s}");
    let mlp = |s: &str| format!("{lp}mlp.{s}");
    Ok(match t {
        "attn_norm.weight" => plus_one(get(&format!("{lp}input_layernorm.weight"), &[e])?),
        "post_attention_norm.weight" => plus_one(get(&format!("{lp}post_attention_layernorm.weight"), &[e])?),
        // Full attention.
        "attn_q.weight" => get(&sa("q_proj.weight"), &[2 * hd * c.n_head, e])?,
        "attn_k.weight" => get(&sa("k_proj.weight"), &[hd * c.n_head_kv, e])?,
        "attn_v.weight" => get(&sa("v_proj.weight"), &[hd * c.n_head_kv, e])?,
        "attn_output.weight" => get(&sa("o_proj.weight"), &[e, hd * c.n_head])?,
        "attn_q_norm.weight" => plus_one(get(&sa("q_norm.weight"), &[hd])?),
        "attn_k_norm.weight" => plus_one(get(&sa("k_norm.weight"), &[hd])?),
        // Gated DeltaNet.
        "attn_qkv.weight" => {
            let mut x = get(&la("in_proj_qkv.weight"), &[qk_dim + value_dim, e])?;
            reorder_v_heads(&mut x, qk_dim + value_dim, e, true, qk_dim, hk, r, sv);
            x
        }
        "attn_gate.weight" => {
            let mut x = get(&la("in_proj_z.weight"), &[value_dim, e])?;
            reorder_v_heads(&mut x, value_dim, e, true, 0, hk, r, sv);
            x
        }
        "ssm_conv1d.weight" => {
            let mut x = get(&la("conv1d.weight"), &[conv_dim, 1, c.ssm_d_conv])?;
            reorder_v_heads(&mut x, conv_dim, c.ssm_d_conv, true, qk_dim, hk, r, sv);
            x
        }
        "ssm_dt.bias" => {
            let mut x = get(&la("dt_bias"), &[hv])?;
            reorder_v_heads(&mut x, hv, 1, true, 0, hk, r, 1);
            x
        }
        "ssm_a" => {
            let mut x: Vec<f32> = get(&la("A_log"), &[hv])?.into_iter().map(|a| -a.exp()).collect();
            reorder_v_heads(&mut x, hv, 1, true, 0, hk, r, 1);
            x
        }
        "ssm_beta.weight" => {
            let mut x = get(&la("in_proj_b.weight"), &[hv, e])?;
            reorder_v_heads(&mut x, hv, e, true, 0, hk, r, 1);
            x
        }
        "ssm_alpha.weight" => {
            let mut x = get(&la("in_proj_a.weight"), &[hv, e])?;
            reorder_v_heads(&mut x, hv, e, true, 0, hk, r, 1);
            x
        }
        "ssm_norm.weight" => get(&la("norm.weight"), &[sv])?,
        "ssm_out.weight" => {
            let mut x = get(&la("out_proj.weight"), &[e, value_dim])?;
            reorder_v_heads(&mut x, e, value_dim, false, 0, hk, r, sv);
            x
        }
        // Dense FFN.
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => {
            let Ffn::Dense { n_ff } = c.ffn else { unreachable!("dense tensors only for Ffn::Dense") };
            match t {
                "ffn_gate.weight" => get(&mlp("gate_proj.weight"), &[n_ff, e])?,
                "ffn_up.weight" => get(&mlp("up_proj.weight"), &[n_ff, e])?,
                _ => get(&mlp("down_proj.weight"), &[e, n_ff])?,
            }
        }
        // MoE.
        _ => {
            let Ffn::Moe { n_expert, n_ff_exp, n_ff_shexp, .. } = c.ffn else {
                return Err(cfg_err(format!("unexpected tensor {name}")));
            };
            match t {
                "ffn_gate_inp.weight" => get(&mlp("gate.weight"), &[n_expert, e])?,
                "ffn_gate_inp_shexp.weight" => get(&mlp("shared_expert_gate.weight"), &[1, e])?,
                "ffn_gate_shexp.weight" => get(&mlp("shared_expert.gate_proj.weight"), &[n_ff_shexp, e])?,
                "ffn_up_shexp.weight" => get(&mlp("shared_expert.up_proj.weight"), &[n_ff_shexp, e])?,
                "ffn_down_shexp.weight" => get(&mlp("shared_expert.down_proj.weight"), &[e, n_ff_shexp])?,
                "ffn_gate_exps.weight" | "ffn_up_exps.weight" => {
                    let gate = t == "ffn_gate_exps.weight";
                    let fused = mlp("experts.gate_up_proj");
                    if ck.has(&fused) {
                        // [E, 2·ff, n_embd], gate rows first then up.
                        let x = get(&fused, &[n_expert, 2 * n_ff_exp, e])?;
                        let per = 2 * n_ff_exp * e;
                        let half = n_ff_exp * e;
                        let off = if gate { 0 } else { half };
                        (0..n_expert).flat_map(|ex| x[ex * per + off..ex * per + off + half].to_vec()).collect()
                    } else {
                        let which = if gate { "gate_proj" } else { "up_proj" };
                        let mut out = Vec::with_capacity(n_expert * n_ff_exp * e);
                        for ex in 0..n_expert {
                            out.extend(get(&mlp(&format!("experts.{ex}.{which}.weight")), &[n_ff_exp, e])?);
                        }
                        out
                    }
                }
                "ffn_down_exps.weight" => {
                    let fused = mlp("experts.down_proj");
                    if ck.has(&fused) {
                        get(&fused, &[n_expert, e, n_ff_exp])?
                    } else {
                        let mut out = Vec::with_capacity(n_expert * n_ff_exp * e);
                        for ex in 0..n_expert {
                            out.extend(get(&mlp(&format!("experts.{ex}.down_proj.weight")), &[e, n_ff_exp])?);
                        }
                        out
                    }
                }
                _ => return Err(cfg_err(format!("unexpected tensor {name}"))),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_head_reorder_is_tiled() {
        // H_k = 2, R = 2, d = 1: HF heads [k0r0, k0r1, k1r0, k1r1] -> [k0r0, k1r0, k0r1, k1r1].
        let mut x = vec![0.0, 1.0, 2.0, 3.0];
        reorder_v_heads(&mut x, 4, 1, true, 0, 2, 2, 1);
        assert_eq!(x, [0.0, 2.0, 1.0, 3.0]);
        let mut y = vec![9.0, 0.0, 1.0, 2.0, 3.0];
        reorder_v_heads(&mut y, 1, 5, false, 1, 2, 2, 1);
        assert_eq!(y, [9.0, 0.0, 2.0, 1.0, 3.0]);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let j: Json = serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"});
        let e = config_from_hf(&j).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM"), "{e}");
    }
}
