//! `tessera run`: load a GGUF on a backend and generate tokens from token ids, optionally
//! dumping the logits of every processed position to a safetensors file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::{Dtype, tensor::TensorView};
use tessera_models::cache::SeqId;
use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig, Event, MemoryReport};
use tessera_models::model::{Model, ModelOptions};
use tessera_models::sample::SamplerParams;
use tessera_models::tokenizer::Tokenizer;
use tessera_ops::DType;

use crate::backend::{self, BackendChoice};
use crate::fusion::{self, FusionArgs};
use crate::inspect;
use crate::output;
use crate::text::{self, TextStream};

/// What `tessera run` was asked to do.
#[derive(Debug, Clone)]
pub struct RunArgs {
    /// One prompt per sequence; the sequences run batched together.
    pub prompts: Vec<Vec<u32>>,
    pub n_new: usize,
    pub params: SamplerParams,
    pub max_tokens_per_step: usize,
    pub kv_dtype: DType,
    /// Where to write the logits of every processed position (safetensors).
    pub dump_logits: Option<PathBuf>,
    /// Print the step time split (`--stats`).
    pub stats: bool,
    /// Prompts given as text (`--prompt`), after the `prompts` given as ids.
    pub texts: Vec<String>,
    /// Render each text prompt through the file's chat template (`--chat`).
    pub chat: bool,
    /// End a sequence's text at the first of these strings (`--stop`).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (`--ignore-eos`).
    pub ignore_eos: bool,
    pub fusion: FusionArgs,
    pub backend: BackendChoice,
}

/// KV cells per block in the caches `run` sizes.
const BLOCK_SIZE: usize = 16;

/// Loads `file`, generates `args.n_new` tokens after each prompt, prints memory, tokens, speed,
/// and writes the logits when asked.
pub fn run(file: &Path, args: &RunArgs) -> Result<(), String> {
    if args.prompts.iter().any(Vec::is_empty) || (args.prompts.is_empty() && args.texts.is_empty()) {
        return Err("--tokens: at least one prompt token is needed".into());
    }
    if args.chat && args.texts.is_empty() {
        return Err("--chat applies the chat template to --prompt texts; give at least one --prompt".into());
    }
    if args.n_new == 0 {
        return Err("-n: at least one new token".into());
    }
    args.params.validate().map_err(|e| e.to_string())?;
    // Before any work: the dump must not overwrite the model, and its directory must take it.
    if let Some(dump) = &args.dump_logits {
        tessera_files::check_output(dump, &[file]).map_err(|e| format!("{}: {e}", dump.display()))?;
    }
    let t0 = Instant::now();
    let gguf = inspect::open(file)?;
    let config = ModelConfig::from_gguf(&gguf).map_err(|e| format!("{}: model config: {e}", file.display()))?;
    // The tokenizer: needed for text prompts, and used to show the output as text when present.
    let tok =
        if args.texts.is_empty() { Tokenizer::from_gguf(&gguf).ok() } else { Some(text::tokenizer(&gguf, file)?) };
    let mut prompts = args.prompts.clone();
    for t in &args.texts {
        let tok = tok.as_ref().expect("loaded above for text prompts");
        prompts.push(text::encode_prompt(tok, &gguf, file, t, args.chat)?);
    }
    let prompts = &prompts;
    // Caches sized for these requests: every sequence's lifetime at once, within the context.
    let lens = sequence_lengths(prompts, args.n_new, config.n_ctx_train)
        .map_err(|e| format!("{e} ({}: {}.context_length)", file.display(), config.arch))?;
    let too_many =
        || format!("{} sequences of up to {} tokens are too many to size caches for", lens.len(), config.n_ctx_train);
    let max_context =
        lens.iter().copied().max().unwrap_or(1).checked_next_multiple_of(BLOCK_SIZE).ok_or_else(too_many)?;
    let kv_blocks =
        lens.iter().try_fold(0usize, |sum, l| sum.checked_add(l.div_ceil(BLOCK_SIZE))).ok_or_else(too_many)?;
    let backend::Opened { mut backend, description: device, kv_pad, .. } = backend::open(args.backend)?;
    let opts = ModelOptions {
        kv_blocks,
        block_size: BLOCK_SIZE,
        max_context,
        n_slots: prompts.len(),
        kv_dtype: args.kv_dtype,
        kv_pad,
        ..ModelOptions::default()
    };
    let mut model = Model::load(&gguf, backend.as_mut(), opts).map_err(|e| format!("{}: {e}", file.display()))?;
    fusion::apply(&mut model, &args.fusion)?;
    let fusion_summary = args.fusion.report.then(|| fusion::summary(&model, backend.as_ref(), kv_pad)).transpose()?;
    let launches = if args.fusion.report { fusion::launches(&mut model, backend.as_mut())? } else { None };
    let mut engine = Engine::new(model, backend, EngineConfig { max_tokens_per_step: args.max_tokens_per_step })
        .map_err(|e| e.to_string())?;
    engine.record_logits(args.dump_logits.is_some());
    if let (Some(tok), false) = (&tok, args.ignore_eos) {
        engine.set_stop_tokens(tok.eog_ids());
    }
    outln!("backend: {device}");
    outln!("model: {config}");
    outln!("loaded {} in {:.1} ms", file.display(), t0.elapsed().as_secs_f64() * 1e3);
    print_memory(&engine.memory());
    if let Some(s) = &fusion_summary {
        fusion::print(s);
    }
    if let Some(counts) = launches {
        fusion::print_launches(counts);
    }
    let mut ids = Vec::with_capacity(prompts.len());
    for p in prompts {
        ids.push(engine.submit(p, args.n_new, args.params).map_err(|e| e.to_string())?);
    }
    let generated = generate(&mut engine, &ids, tok.as_ref(), &args.stop)?;
    let mut dumped: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
    for (i, (prompt, g)) in prompts.iter().zip(generated).enumerate() {
        let label = if prompts.len() == 1 { String::new() } else { format!("seq{i} ") };
        outln!("{label}prompt: {}", join(prompt));
        outln!("{label}generated: {}", join(&g.tokens));
        if let (Some(text), true) = (&g.text, prompts.len() > 1) {
            outln!("{label}text: {text}");
        }
        if args.dump_logits.is_some() {
            // Fed tokens: the prompt and every generated token but the last.
            let mut fed = prompt.clone();
            fed.extend(&g.tokens[..g.tokens.len().saturating_sub(1)]);
            if g.logits.len() != fed.len() * config.n_vocab {
                return Err(format!(
                    "internal error: sequence {i} recorded {} logits for {} tokens of a {}-token vocab",
                    g.logits.len(),
                    fed.len(),
                    config.n_vocab
                ));
            }
            dumped.push((fed, g.logits));
        }
    }
    print_speed(engine.stats());
    if args.stats {
        print_stats(engine.stats(), &engine.model().step_cache_stats());
    }
    if let Some(path) = &args.dump_logits {
        write_logits(path, &dumped, config.n_vocab)?;
        let rows: Vec<String> = dumped.iter().map(|(t, _)| t.len().to_string()).collect();
        outln!(
            "dumped logits of {} sequence(s) ([{}] x {} f32) to {}",
            dumped.len(),
            rows.join(", "),
            config.n_vocab,
            path.display()
        );
    }
    Ok(())
}

/// What one sequence generated.
struct Generated {
    tokens: Vec<u32>,
    /// The tokens as text (with a tokenizer), ended at a `--stop` string.
    text: Option<String>,
    /// The recorded logits (with `--dump-logits`).
    logits: Vec<f32>,
}

/// Steps `engine` until every sequence in `ids` finished. With a tokenizer, a single sequence's
/// text is printed as it is generated, and a sequence whose text reaches a `stop` string is
/// cancelled there.
fn generate(
    engine: &mut Engine,
    ids: &[SeqId],
    tok: Option<&Tokenizer>,
    stop: &[String],
) -> Result<Vec<Generated>, String> {
    let mut out: Vec<Generated> =
        ids.iter().map(|_| Generated { tokens: Vec::new(), text: None, logits: Vec::new() }).collect();
    let mut streams: Vec<Option<TextStream<'_>>> = ids.iter().map(|_| tok.map(|t| TextStream::new(t, stop))).collect();
    let live = ids.len() == 1 && tok.is_some();
    if live {
        out!("text: ");
    }
    let index = |seq: SeqId| ids.iter().position(|&i| i == seq);
    while !engine.is_idle() {
        let mut cancel = Vec::new();
        for ev in engine.step().map_err(|e| e.to_string())? {
            let (Event::Token { seq, .. } | Event::Finished { seq, .. }) = ev;
            let Some(k) = index(seq) else { continue };
            match ev {
                Event::Token { token, .. } => {
                    out[k].tokens.push(token);
                    if let Some(ts) = streams[k].as_mut() {
                        let shown = ts.push(token)?;
                        if live {
                            out!("{shown}");
                            output::flush();
                        }
                        if ts.stopped() {
                            cancel.push(seq);
                        }
                    }
                }
                Event::Finished { .. } => {
                    out[k].logits = engine.take_logits(seq);
                    cancel.retain(|&c| c != seq);
                }
            }
        }
        for seq in cancel {
            let k = index(seq).expect("a sequence of this run");
            out[k].logits = engine.take_logits(seq);
            engine.cancel(seq).map_err(|e| e.to_string())?;
        }
    }
    for (g, ts) in out.iter_mut().zip(&mut streams) {
        if let Some(ts) = ts {
            let rest = ts.finish();
            if live {
                out!("{rest}");
            }
            g.text = Some(ts.text().to_string());
        }
    }
    if live {
        outln!();
    }
    Ok(out)
}

/// Writes `seqK.ids` (i32 `[n]`) and `seqK.logits` (f32 `[n, n_vocab]`) for each sequence.
fn write_logits(path: &Path, seqs: &[(Vec<u32>, Vec<f32>)], n_vocab: usize) -> Result<(), String> {
    let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, (ids, logits)) in seqs.iter().enumerate() {
        let id_bytes = ids
            .iter()
            .map(|&t| i32::try_from(t).map(i32::to_le_bytes))
            .collect::<Result<Vec<[u8; 4]>, _>>()
            .map_err(|_| format!("sequence {k}: a token id does not fit an i32"))?
            .concat();
        bufs.push((format!("seq{k}.ids"), Dtype::I32, vec![ids.len()], id_bytes));
        let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        bufs.push((format!("seq{k}.logits"), Dtype::F32, vec![ids.len(), n_vocab], logit_bytes));
    }
    let mut views = Vec::with_capacity(bufs.len());
    for (name, dtype, shape, data) in &bufs {
        let view = TensorView::new(*dtype, shape.clone(), data).map_err(|e| format!("{name}: {e}"))?;
        views.push((name.clone(), view));
    }
    let meta = HashMap::from([
        ("format".to_string(), "tessera logits dump".to_string()),
        ("n_sequences".to_string(), seqs.len().to_string()),
    ]);
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| e.to_string())?;
    tessera_files::write_atomic(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Each sequence's whole length (prompt + `n_new`), checked against the model's context length
/// `n_ctx` with checked arithmetic: `-n 18446744073709551615` is too many tokens, not an overflow.
pub fn sequence_lengths(prompts: &[Vec<u32>], n_new: usize, n_ctx: usize) -> Result<Vec<usize>, String> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let total = p.len().checked_add(n_new);
            match total {
                Some(t) if t <= n_ctx => Ok(t),
                _ => Err(format!(
                    "too many tokens: sequence {i}'s prompt of {} tokens plus -n {n_new} new tokens is {} tokens, \
                     which exceeds the model's context length of {n_ctx} tokens",
                    p.len(),
                    total.map_or_else(|| "more than 2^64".to_string(), |t| t.to_string()),
                )),
            }
        })
        .collect()
}

fn join(t: &[u32]) -> String {
    t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `1234567 bytes (1.18 MiB)`.
pub fn bytes(n: usize) -> String {
    let (v, unit) = if n >= 1 << 30 {
        (n as f64 / (1u64 << 30) as f64, "GiB")
    } else if n >= 1 << 20 {
        (n as f64 / (1u64 << 20) as f64, "MiB")
    } else {
        (n as f64 / 1024.0, "KiB")
    };
    format!("{n} bytes ({v:.2} {unit})")
}

/// The memory lines `run` and `demo` print.
pub fn print_memory(m: &MemoryReport) {
    outln!("memory: weights {}", bytes(m.weight_bytes));
    outln!("memory: kv cache per token {}", bytes(m.kv_bytes_per_token));
    outln!("memory: recurrent state per sequence {}", bytes(m.recurrent_bytes_per_sequence));
    outln!(
        "memory: caches {} (kv {}, recurrent {})",
        bytes(m.total_cache_bytes),
        bytes(m.kv_cache_bytes),
        bytes(m.recurrent_cache_bytes)
    );
}

/// Prefill and decode speed lines.
/// `--stats`: the mean time split of prefill and decode steps, and the step-graph cache.
fn print_stats(s: &tessera_models::engine::EngineStats, cache: &tessera_models::model::StepCacheStats) {
    for (what, steps, t) in [("prefill", s.prefill_steps, s.prefill_times), ("decode", s.decode_steps, s.decode_times)]
    {
        if steps == 0 {
            continue;
        }
        let us = |x: f64| x / steps as f64 * 1e6;
        outln!(
            "{what} steps: {steps}, per step: host prepare {:.0} us, launch {:.0} us, wait {:.0} us ({:.1}% on the host before the device)",
            us(t.prepare),
            us(t.launch),
            us(t.wait),
            100.0 * (t.prepare + t.launch) / t.total().max(1e-12)
        );
    }
    outln!(
        "step graphs: {} built and planned, {} reused, {} evicted; {:.1} MiB of arenas held",
        cache.built,
        cache.reused,
        cache.evicted,
        cache.arena_bytes as f64 / (1 << 20) as f64
    );
}

pub fn print_speed(s: &tessera_models::engine::EngineStats) {
    outln!(
        "prefill: {} tokens in {:.2} ms ({:.1} tokens/s)",
        s.prefill_tokens,
        s.prefill_secs * 1e3,
        s.prefill_tokens_per_sec()
    );
    outln!(
        "decode: {} tokens in {:.2} ms ({:.1} tokens/s)",
        s.decode_only_tokens,
        s.decode_secs * 1e3,
        s.decode_tokens_per_sec()
    );
}
