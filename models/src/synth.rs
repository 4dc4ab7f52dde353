//! Synthetic checkpoints: a GGUF with a config's metadata and every tensor of
//! [`ModelConfig::tensor_specs`] filled with seeded random weights, for tests and benchmarks
//! without real weights.
//!
//! # Determinism
//!
//! A tensor's values depend only on `(seed, tensor name, shape)`: each tensor is cut into chunks of
//! whole rows ([`CHUNK_ELEMS`] elements or one row, whichever is more) and chunk `c` is drawn from
//! its own generator seeded with a hash of `(seed, name, c)`. Chunks are generated in parallel and
//! written in order, so files are byte-identical across runs and thread counts, and one tensor can
//! be regenerated alone ([`tensor_bytes`]). Tensors are streamed one chunk batch at a time through
//! [`GgufWriter::write_file_with`]: memory stays bounded for real sizes (tens of GB).
//!
//! # Values (the final stored multipliers)
//!
//! | tensor | distribution |
//! | --- | --- |
//! | `token_embd` | normal(0, 1) |
//! | other matrices (ne0 = fan-in, incl. experts and `ffn_gate_inp_shexp`) | normal(0, 1/sqrt(ne0)) |
//! | `*_norm.weight` (incl. `ssm_norm`) | uniform [0.9, 1.1] (GGUF norms are plain multipliers: the converter's +1 is already applied) |
//! | `ssm_a` | -exp(A_log), A_log uniform [0, 2] |
//! | `ssm_dt.bias` | normal(0, 0.1) |
//! | `ssm_conv1d` | normal(0, 0.3) |
//!
//! # Storage types
//!
//! The requested weight dtype applies to tensors with 2 or more dims except `ssm_conv1d` (its rows
//! are `d_conv` wide) and the router `ffn_gate_inp`, which stay F32 as llama.cpp's quantizer keeps
//! them; 1-D tensors (norms, `ssm_a`, `ssm_dt`, `ffn_gate_inp_shexp`) stay F32 too. For Q8_0 (32)
//! and NvFp4 (64) every converted tensor's ne0 must be a whole number of blocks, else
//! [`SynthError::NotBlockAligned`] names the tensor before anything is written.
//!
//! # A real vocabulary
//!
//! [`synthesize_with_vocab`] also copies the `tokenizer.*` keys of another GGUF ([`SynthVocab`]:
//! a model or a vocabulary-only file such as llama.cpp's `ggml-vocab-qwen35.gguf`), so that a
//! synthetic model tokenizes, renders its chat template and detokenizes real text in demos and
//! benchmarks (its outputs stay random). The config's `vocab_size` must be the vocabulary's token
//! count (`tessera synth --vocab FILE` sets it).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal, Uniform};
use rayon::prelude::*;
use tessera_graph::{Backend, BufferId, TensorMeta, TensorRef};
use tessera_ops::DType;

use crate::config::{ConfigError, ModelConfig, TensorSpec};
use crate::gguf::{GgufError, GgufFile, GgufWriter, Value};
use crate::weights::ModelWeights;

/// Elements per generated chunk (rounded up to whole rows).
pub const CHUNK_ELEMS: usize = 1 << 20;

/// The weight dtypes [`synthesize`] accepts.
pub const WEIGHT_DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::NvFp4];

/// Why synthesis failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A weight dtype outside [`WEIGHT_DTYPES`].
    #[error("weight dtype {dtype} is not supported for synthesis (use f32, f16, bf16, q8_0 or nvfp4)")]
    UnsupportedDType { dtype: DType },
    /// A tensor whose rows cannot be stored in the block-quantized dtype.
    #[error("tensor `{name}`: ne0 = {ne0} is not a multiple of the {dtype} block size {block}")]
    NotBlockAligned { name: String, dtype: DType, ne0: usize, block: usize },
    /// Uploading a synthetic tensor to a backend failed.
    #[error("uploading `{name}`: {why}")]
    Upload { name: String, why: String },
    /// The vocabulary to copy is missing or does not fit the config.
    #[error("vocabulary: {why}")]
    Vocab { why: String },
    /// The file would not fit on its file system (checked before anything is written).
    #[error("{path}: the file needs {needed} bytes of tensor data but its file system has {available} bytes free")]
    NoSpace { path: PathBuf, needed: u64, available: u64 },
}

/// Progress of [`synthesize`]: tensor data bytes written so far, of the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthProgress {
    pub bytes_written: u64,
    pub total_bytes: u64,
}

/// What [`synthesize`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthReport {
    pub n_tensors: usize,
    /// Tensor data bytes (without header and padding).
    pub data_bytes: u64,
}

/// The dtype `spec` is stored in when the weights are `weight`.
pub fn storage_dtype(spec: &TensorSpec, weight: DType) -> DType {
    let keep_f32 =
        spec.n_dims < 2 || spec.name.ends_with("ssm_conv1d.weight") || spec.name.ends_with("ffn_gate_inp.weight");
    if keep_f32 { DType::F32 } else { weight }
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    Normal(f64),
    Uniform(f64, f64),
    NegExpUniform(f64, f64),
}

fn init_for(spec: &TensorSpec) -> Init {
    let n = &spec.name;
    if n == "token_embd.weight" {
        Init::Normal(1.0)
    } else if n.ends_with("_norm.weight") {
        Init::Uniform(0.9, 1.1)
    } else if n.ends_with(".ssm_a") {
        Init::NegExpUniform(0.0, 2.0)
    } else if n.ends_with("ssm_dt.bias") {
        Init::Normal(0.1)
    } else if n.ends_with("ssm_conv1d.weight") {
        Init::Normal(0.3)
    } else {
        Init::Normal(1.0 / (spec.ne[0] as f64).sqrt())
    }
}

/// 64-bit FNV-1a, stable across platforms and releases (std's hasher is not).
fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn chunk_seed(seed: u64, name: &str, chunk: u64) -> u64 {
    let h = fnv1a(&seed.to_le_bytes(), 0xcbf2_9ce4_8422_2325);
    let h = fnv1a(name.as_bytes(), h);
    fnv1a(&chunk.to_le_bytes(), h)
}

/// Rows per chunk for a tensor whose rows are `ne0` wide.
fn rows_per_chunk(ne0: usize) -> usize {
    (CHUNK_ELEMS / ne0).max(1)
}

/// The encoded bytes of chunk `chunk` of `spec` (`n_rows` rows).
fn chunk_bytes(spec: &TensorSpec, dtype: DType, seed: u64, chunk: usize, n_rows: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(chunk_seed(seed, &spec.name, chunk as u64));
    let n = n_rows * spec.ne[0];
    let values: Vec<f32> = match init_for(spec) {
        Init::Normal(std) => {
            // Cannot fail: std is finite and positive.
            let d = Normal::new(0.0, std).expect("finite positive std");
            (0..n).map(|_| d.sample(&mut rng) as f32).collect()
        }
        Init::Uniform(lo, hi) => {
            let d = Uniform::new(lo, hi).expect("lo < hi");
            (0..n).map(|_| d.sample(&mut rng) as f32).collect()
        }
        Init::NegExpUniform(lo, hi) => {
            let d = Uniform::new(lo, hi).expect("lo < hi");
            (0..n).map(|_| -d.sample(&mut rng).exp() as f32).collect()
        }
    };
    encode(dtype, &values)
}

fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        DType::Q8_0 | DType::NvFp4 => {
            let mut out = vec![0u8; values.len() / dtype.block_size() * dtype.block_bytes()];
            // Cannot fail: `check_dtypes` made every row whole blocks and `out` is sized to match.
            let r = if dtype == DType::Q8_0 {
                tessera_ops::quant::quantize_q8_0(values, &mut out)
            } else {
                tessera_ops::quant::quantize_nvfp4(values, &mut out)
            };
            r.expect("rows checked to be whole blocks");
            out
        }
        DType::I32 => unreachable!("I32 is rejected by check_dtypes"),
    }
}

/// Streams the bytes of `spec` (stored as `dtype`) to `out`, `batch` chunks at a time,
/// generated in parallel; calls `on_bytes` after each write.
fn write_tensor(
    spec: &TensorSpec,
    dtype: DType,
    seed: u64,
    out: &mut dyn Write,
    on_bytes: &mut dyn FnMut(u64),
) -> io::Result<()> {
    let rows: usize = spec.ne[1..].iter().product();
    let per = rows_per_chunk(spec.ne[0]);
    let n_chunks = rows.div_ceil(per);
    let batch = rayon::current_num_threads().max(1) * 2;
    for start in (0..n_chunks).step_by(batch) {
        let end = (start + batch).min(n_chunks);
        let bufs: Vec<Vec<u8>> =
            (start..end).into_par_iter().map(|c| chunk_bytes(spec, dtype, seed, c, per.min(rows - c * per))).collect();
        for b in bufs {
            out.write_all(&b)?;
            on_bytes(b.len() as u64);
        }
    }
    Ok(())
}

/// Uploads the weights [`synthesize`] would write for `config` (same dtype rules, same seed,
/// same bytes) straight into `backend` memory, a tensor at a time in chunks generated in
/// parallel: a model to run or measure with no file, no disk and no read back. On an error the
/// tensors uploaded so far are freed.
pub fn upload_weights(
    config: &ModelConfig,
    weight: DType,
    seed: u64,
    backend: &mut dyn Backend,
) -> Result<ModelWeights, SynthError> {
    output_bytes(config, weight)?; // validates the config and the dtypes, bounds the size
    let mut weights = ModelWeights::default();
    for spec in config.tensor_specs() {
        let dtype = storage_dtype(&spec, weight);
        let upload = |backend: &mut dyn Backend| -> Result<TensorRef, String> {
            let meta = TensorMeta::contiguous("weight", dtype, spec.ne).map_err(|e| e.to_string())?;
            let buffer = backend.alloc(meta.nbytes_contiguous()).map_err(|e| e.to_string())?;
            let mut out = BackendWriter { backend: &mut *backend, buffer, at: 0 };
            match write_tensor(&spec, dtype, seed, &mut out, &mut |_| {}) {
                Ok(()) => Ok(TensorRef { buffer, offset: 0, meta }),
                Err(e) => {
                    backend.free(buffer);
                    Err(e.to_string())
                }
            }
        };
        match upload(backend) {
            Ok(place) => weights.insert(spec.name.clone(), place),
            Err(why) => {
                weights.free(backend);
                return Err(SynthError::Upload { name: spec.name.clone(), why });
            }
        }
    }
    Ok(weights)
}

/// Writes into a backend buffer from offset 0 on, as a file would be written.
struct BackendWriter<'b> {
    backend: &'b mut dyn Backend,
    buffer: BufferId,
    at: usize,
}

impl Write for BackendWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.backend.write(self.buffer, self.at, buf).map_err(io::Error::other)?;
        self.at += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The bytes [`synthesize`] writes for `spec` when the weights are `weight` (for tests and for
/// checking a file tensor by tensor). Holds the whole tensor: for small models.
pub fn tensor_bytes(spec: &TensorSpec, weight: DType, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    write_tensor(spec, storage_dtype(spec, weight), seed, &mut out, &mut |_| {}).expect("Vec write");
    out
}

fn check_dtypes(specs: &[TensorSpec], weight: DType) -> Result<(), SynthError> {
    if !WEIGHT_DTYPES.contains(&weight) {
        return Err(SynthError::UnsupportedDType { dtype: weight });
    }
    for s in specs {
        let d = storage_dtype(s, weight);
        if !s.ne[0].is_multiple_of(d.block_size()) {
            return Err(SynthError::NotBlockAligned {
                name: s.name.clone(),
                dtype: d,
                ne0: s.ne[0],
                block: d.block_size(),
            });
        }
    }
    Ok(())
}

/// The tensor data bytes [`synthesize`] would write for `config` with `weight` matrices, computed
/// from the config alone (nothing is allocated per weight). Validates the config and the dtypes
/// first, so it is also the whole up-front check of `synthesize`.
pub fn output_bytes(config: &ModelConfig, weight: DType) -> Result<u64, SynthError> {
    config.validate()?;
    let specs = config.tensor_specs();
    check_dtypes(&specs, weight)?;
    Ok(total_bytes(&specs, weight))
}

/// The tensor data bytes of `specs` (dtypes checked, sizes within a validated config's limits).
fn total_bytes(specs: &[TensorSpec], weight: DType) -> u64 {
    specs
        .iter()
        .map(|s| {
            let d = storage_dtype(s, weight);
            let rows: u64 = s.ne[1..].iter().map(|&n| n as u64).product();
            // Rows are whole blocks (check_dtypes) and ne0 <= MAX_WIDTH, so the row size exists.
            d.row_bytes(s.ne[0]).map_or(u64::MAX, |r| r as u64).saturating_mul(rows)
        })
        .fold(0u64, u64::saturating_add)
}

/// Checks that `needed` more bytes fit on the file system that `path` will be written to (its
/// parent directory's), as far as the system says (`statvfs`: blocks available to unprivileged
/// users). `Err((needed, available))` when they do not; `Ok` when they do or when the free space
/// cannot be read (the write itself then reports a full disk).
pub(crate) fn check_free_space(path: &Path, needed: u64) -> Result<(), (u64, u64)> {
    match free_space(path) {
        Some(available) if needed > available => Err((needed, available)),
        _ => Ok(()),
    }
}

#[cfg(unix)]
fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `s` points to writable memory of the right type;
    // statvfs fills it completely when it returns 0.
    if unsafe { libc::statvfs(c.as_ptr(), s.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so `s` is initialized.
    let s = unsafe { s.assume_init() };
    #[allow(clippy::useless_conversion)] // the field types differ between platforms
    Some(u64::from(s.f_bavail).saturating_mul(u64::from(s.f_frsize)))
}

#[cfg(not(unix))]
fn free_space(_: &Path) -> Option<u64> {
    None
}

/// The `tokenizer.*` metadata of a GGUF, to be copied into a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthVocab {
    /// Every `tokenizer.*` key-value pair, in the file's order.
    pub kvs: Vec<(String, Value)>,
    /// The length of `tokenizer.ggml.tokens`: the config's `vocab_size` must be this.
    pub n_tokens: usize,
}

impl SynthVocab {
    /// The vocabulary of `file`; an error when it has no `tokenizer.ggml.tokens` string array.
    pub fn from_gguf(file: &GgufFile) -> Result<SynthVocab, SynthError> {
        let n_tokens = file
            .get_str_array("tokenizer.ggml.tokens")
            .map_err(|e| SynthError::Vocab { why: format!("the file has no token list: {e}") })?
            .len();
        if n_tokens == 0 {
            return Err(SynthError::Vocab { why: "`tokenizer.ggml.tokens` is empty".into() });
        }
        let kvs = file.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")).cloned().collect();
        Ok(SynthVocab { kvs, n_tokens })
    }
}

/// [`synthesize`] with the `tokenizer.*` keys of `vocab` (when given) after the config's
/// metadata; `config.n_vocab` must be `vocab.n_tokens` ([`SynthError::Vocab`] otherwise, before
/// anything is written).
pub fn synthesize_with_vocab(
    config: &ModelConfig,
    weight: DType,
    seed: u64,
    path: impl AsRef<Path>,
    vocab: Option<&SynthVocab>,
    progress: Option<&mut dyn FnMut(SynthProgress)>,
) -> Result<SynthReport, SynthError> {
    if let Some(v) = vocab
        && v.n_tokens != config.n_vocab
    {
        return Err(SynthError::Vocab {
            why: format!("it has {} tokens but the config's vocab_size is {}", v.n_tokens, config.n_vocab),
        });
    }
    write_synthetic(config, weight, seed, path.as_ref(), vocab.map_or(&[], |v| &v.kvs), progress)
}

/// Writes a GGUF at `path`: `general.name`, the config's metadata ([`ModelConfig::to_metadata`])
/// and every tensor of [`ModelConfig::tensor_specs`] with seeded weights (see the module doc).
/// `progress` is called as tensor data is written.
///
/// Before anything is written the config is validated ([`ModelConfig::validate`]: every count
/// within its limit), the total size computed ([`output_bytes`]) and compared with the free space
/// of `path`'s file system: a model that cannot fit is [`SynthError::NoSpace`] at once, not a
/// disk filled for minutes.
pub fn synthesize(
    config: &ModelConfig,
    weight: DType,
    seed: u64,
    path: impl AsRef<Path>,
    progress: Option<&mut dyn FnMut(SynthProgress)>,
) -> Result<SynthReport, SynthError> {
    write_synthetic(config, weight, seed, path.as_ref(), &[], progress)
}

/// [`synthesize`] with `extra` key-value pairs after the config's metadata and the name.
fn write_synthetic(
    config: &ModelConfig,
    weight: DType,
    seed: u64,
    path: &Path,
    extra: &[(String, Value)],
    mut progress: Option<&mut dyn FnMut(SynthProgress)>,
) -> Result<SynthReport, SynthError> {
    let total = output_bytes(config, weight)?;
    check_free_space(path, total).map_err(|(needed, available)| SynthError::NoSpace {
        path: path.to_path_buf(),
        needed,
        available,
    })?;
    let specs = config.tensor_specs();
    let mut w = GgufWriter::new();
    for (k, v) in config.to_metadata() {
        w.add_kv(k, v)?;
    }
    w.add_kv("general.name", format!("tessera synthetic {} (seed {seed}, {weight})", config.arch).as_str())?;
    for (k, v) in extra {
        w.add_kv(k.clone(), v.clone())?;
    }
    for s in &specs {
        w.add_tensor_info(s.name.clone(), storage_dtype(s, weight), s.dims())?;
    }
    let mut done = 0u64;
    if let Some(p) = progress.as_mut() {
        p(SynthProgress { bytes_written: 0, total_bytes: total });
    }
    w.write_file_with(path, |name, out| {
        // Tensors are asked for in insertion order, which is `specs` order.
        let spec = specs
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| io::Error::other(format!("writer asked for unknown tensor {name}")))?;
        write_tensor(spec, storage_dtype(spec, weight), seed, out, &mut |n| {
            done += n;
            if let Some(p) = progress.as_mut() {
                p(SynthProgress { bytes_written: done, total_bytes: total });
            }
        })
    })?;
    Ok(SynthReport { n_tensors: specs.len(), data_bytes: total })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_rows_and_regenerate_identically() {
        let spec = TensorSpec { name: "blk.0.ffn_up.weight".into(), ne: [64, 40_000, 1, 1], n_dims: 2 };
        let a = tensor_bytes(&spec, DType::Q8_0, 7);
        assert_eq!(a.len(), 40_000 * 2 * 34);
        assert_eq!(a, tensor_bytes(&spec, DType::Q8_0, 7));
        assert_ne!(a, tensor_bytes(&spec, DType::Q8_0, 8));
    }

    #[test]
    fn storage_rules() {
        let c = ModelConfig::preset("tiny-moe").unwrap();
        for s in c.tensor_specs() {
            let d = storage_dtype(&s, DType::NvFp4);
            let f32_expected =
                s.n_dims == 1 || s.name.contains("ssm_conv1d") || s.name.ends_with("ffn_gate_inp.weight");
            assert_eq!(d == DType::F32, f32_expected, "{}", s.name);
        }
    }

    #[test]
    fn ssm_a_is_negative_and_norms_near_one() {
        let a = TensorSpec { name: "blk.0.ssm_a".into(), ne: [8, 1, 1, 1], n_dims: 1 };
        let v = tessera_ops::host::decode(DType::F32, &tensor_bytes(&a, DType::F16, 1));
        assert!(v.iter().all(|&x| (-(2f64.exp())..=-1.0).contains(&x)), "{v:?}");
        let n = TensorSpec { name: "blk.0.ssm_norm.weight".into(), ne: [8, 1, 1, 1], n_dims: 1 };
        let v = tessera_ops::host::decode(DType::F32, &tensor_bytes(&n, DType::F16, 1));
        assert!(v.iter().all(|&x| (0.9..=1.1).contains(&x)), "{v:?}");
    }

    #[test]
    fn misaligned_rows_are_named() {
        let c = ModelConfig::preset("tiny").unwrap().with_override("feed_forward_length", "96").unwrap();
        let path = std::env::temp_dir().join(format!("tessera_synth_misaligned_{}.gguf", std::process::id()));
        let e = synthesize(&c, DType::NvFp4, 1, &path, None).unwrap_err();
        assert!(e.to_string().contains("blk.0.ffn_down.weight"), "{e}");
        assert!(!path.exists());
    }
}
