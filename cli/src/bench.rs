//! `tessera bench`: llama-bench's counterpart. Loads a GGUF once on a backend and measures, through
//! the engine, prefill tokens/s of one long prompt and aggregate decode tokens/s at several batch
//! widths, with a warm-up run of every case excluded and mean ± sd over repetitions; with the
//! time of each step split into host preparation, launch and waiting for the device.

use std::path::PathBuf;

use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Model, ModelOptions, StepTimes};
use tessera_models::sample::SamplerParams;
use tessera_ops::DType;

use crate::backend::{self, BackendChoice};
use crate::fusion::{self, FusionArgs};

/// The model a bench runs.
#[derive(Debug, Clone)]
pub enum Source {
    /// A GGUF file.
    File(PathBuf),
    /// A preset's config with seeded weights uploaded straight to the backend.
    Preset { name: String, config: Box<ModelConfig>, dtype: DType, seed: u64 },
}

impl Source {
    fn label(&self) -> String {
        match self {
            Source::File(f) => f.display().to_string(),
            Source::Preset { name, dtype, seed, .. } => format!("preset {name}, {dtype} weights, seed {seed}"),
        }
    }
}

/// What `tessera bench` was asked to measure.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub model: Source,
    pub backend: BackendChoice,
    /// Prompt lengths of the prefill cases (one sequence each).
    pub prefill: Vec<usize>,
    /// Batch widths of the decode cases.
    pub widths: Vec<usize>,
    /// Tokens generated per sequence in a decode case.
    pub n_gen: usize,
    /// Prompt tokens of each sequence in a decode case.
    pub prompt: usize,
    /// Most tokens one step feeds (the micro-batch, llama.cpp's `n_ubatch`).
    pub ubatch: usize,
    pub reps: usize,
    pub kv_dtype: DType,
    /// Run every case with CUDA graphs on, off, or both.
    pub graphs: Vec<bool>,
    pub json: bool,
    pub fusion: FusionArgs,
}

/// One measured case.
#[derive(Debug, Clone)]
struct Row {
    case: String,
    graphs: Option<bool>,
    /// Tokens/s of each repetition.
    rates: Vec<f64>,
    /// Mean time split of one step over the repetitions, seconds.
    step: StepTimes,
    steps: usize,
    /// Over the measured repetitions, steps the backend captured into a new graph, captured and
    /// updated into one, and replayed ("graph_captures" / "_updates" / "_replays"; None when it
    /// counts none: the CPU).
    graph_steps: Option<[u64; 3]>,
}

/// The backend's graph counters: captures, updates, replays.
fn graph_counters(engine: &Engine) -> Option<[u64; 3]> {
    let c = engine.backend_counters();
    let get = |name: &str| c.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    Some([get("graph_captures")?, get("graph_updates")?, get("graph_replays")?])
}

impl Row {
    fn mean_sd(&self) -> (f64, f64) {
        let n = self.rates.len() as f64;
        let mean = self.rates.iter().sum::<f64>() / n;
        let var = if n > 1.0 { self.rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        (mean, var.sqrt())
    }
}

/// Tokens of a synthetic prompt: a fixed, seeded-looking spread over the vocabulary.
fn prompt_tokens(n: usize, salt: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + salt * 104_729 + 13) % n_vocab.max(1)) as u32).collect()
}

/// Runs every case of `args` and prints a table (or JSON).
pub fn bench(args: &BenchArgs) -> Result<(), String> {
    if args.reps == 0 || args.n_gen == 0 || args.prompt == 0 || args.ubatch == 0 {
        return Err("bench: --reps, --n-gen, --prompt and --ubatch must be at least 1".into());
    }
    let gguf = match &args.model {
        Source::File(f) => Some(GgufFile::open(f).map_err(|e| format!("{}: {e}", f.display()))?),
        Source::Preset { .. } => None,
    };
    let mut load_secs = 0.0;
    let mut rows = Vec::new();
    let mut device = String::new();
    let mut peak: Option<u64> = None;
    for &graphs in &args.graphs {
        let opened = backend::open_with(args.backend, graphs)?;
        let graph_label = opened.has_graphs.then_some(graphs);
        if !opened.has_graphs && graphs != args.graphs[0] {
            continue; // the CPU has no graphs to switch: one pass is enough
        }
        device = opened.description.clone();
        let t0 = std::time::Instant::now();
        let mut engine = load(gguf.as_ref(), args, opened.backend, opened.kv_pad)?;
        load_secs = t0.elapsed().as_secs_f64();
        for &n in &args.prefill {
            rows.push(run_case(&mut engine, args, Case::Prefill(n), graph_label)?);
        }
        for &w in &args.widths {
            rows.push(run_case(&mut engine, args, Case::Decode(w), graph_label)?);
        }
        peak = engine.backend_counters().iter().find(|(k, _)| *k == "pool_peak_bytes").map(|(_, v)| *v).or(peak);
    }
    if args.json {
        print_json(args, &device, peak, load_secs, &rows);
    } else {
        print_table(args, &device, peak, load_secs, &rows);
    }
    Ok(())
}

/// An engine over the model (`gguf` when it is a file) with caches for the largest case.
fn load(
    gguf: Option<&GgufFile>,
    args: &BenchArgs,
    backend: Box<dyn tessera_graph::Backend>,
    kv_pad: usize,
) -> Result<Engine, String> {
    const BLOCK: usize = 16;
    let max_width = args.widths.iter().copied().max().unwrap_or(1).max(1);
    let decode_len = args.prompt + args.n_gen;
    let prefill_len = args.prefill.iter().copied().max().unwrap_or(0) + 1;
    let max_context = decode_len.max(prefill_len).next_multiple_of(BLOCK).next_multiple_of(kv_pad);
    let kv_blocks = (max_width * decode_len.div_ceil(BLOCK)).max(prefill_len.div_ceil(BLOCK)) + max_width;
    let opts = ModelOptions {
        kv_blocks,
        block_size: BLOCK,
        max_context,
        n_slots: max_width,
        kv_dtype: args.kv_dtype,
        kv_pad,
        ..ModelOptions::default()
    };
    let mut backend = backend;
    let mut model = match (&args.model, gguf) {
        (Source::File(f), Some(g)) => {
            Model::load(g, backend.as_mut(), opts).map_err(|e| format!("{}: {e}", f.display()))
        }
        (Source::Preset { config, dtype, seed, .. }, _) => {
            Model::synthetic((**config).clone(), *dtype, *seed, backend.as_mut(), opts).map_err(|e| e.to_string())
        }
        (Source::File(f), None) => Err(format!("{}: not opened", f.display())),
    }?;
    fusion::apply(&mut model, &args.fusion)?;
    if args.fusion.report && !args.json {
        fusion::print(&fusion::summary(&model, backend.as_ref(), kv_pad)?);
        if let Some(counts) = fusion::launches(&mut model, backend.as_mut())? {
            fusion::print_launches(counts);
        }
    }
    Engine::new(model, backend, EngineConfig { max_tokens_per_step: args.ubatch }).map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Copy)]
enum Case {
    /// One sequence with a prompt of this many tokens (and one new token).
    Prefill(usize),
    /// This many sequences decoding together.
    Decode(usize),
}

/// A warm-up run, then `args.reps` measured runs of `case`.
fn run_case(engine: &mut Engine, args: &BenchArgs, case: Case, graphs: Option<bool>) -> Result<Row, String> {
    let n_vocab = engine.model().n_vocab();
    let params = SamplerParams::default();
    let mut row = Row {
        case: match case {
            Case::Prefill(n) => format!("pp{n}"),
            Case::Decode(w) => format!("tg{} x{w}", args.n_gen),
        },
        graphs,
        rates: Vec::new(),
        step: StepTimes::default(),
        steps: 0,
        graph_steps: None,
    };
    let mut counted = None;
    for rep in 0..=args.reps {
        engine.reset_stats();
        match case {
            Case::Prefill(n) => {
                engine.submit(&prompt_tokens(n, rep, n_vocab), 1, params).map_err(|e| e.to_string())?;
            }
            Case::Decode(w) => {
                for s in 0..w {
                    engine
                        .submit(&prompt_tokens(args.prompt, rep * 1000 + s, n_vocab), args.n_gen, params)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        engine.run_to_completion().map_err(|e| e.to_string())?;
        let d = *engine.stats();
        if rep == 0 {
            counted = graph_counters(engine);
            continue; // warm-up: first shapes are built, planned and captured here
        }
        let (rate, times, steps) = match case {
            Case::Prefill(n) => (n as f64 / d.prefill_secs.max(1e-12), d.prefill_times, d.prefill_steps),
            Case::Decode(_) => (d.decode_only_tokens as f64 / d.decode_secs.max(1e-12), d.decode_times, d.decode_steps),
        };
        row.rates.push(rate);
        if steps > 0 {
            let k = (steps * args.reps) as f64;
            row.step += StepTimes { prepare: times.prepare / k, launch: times.launch / k, wait: times.wait / k };
        }
        row.steps = steps;
    }
    if let (Some(a), Some(b)) = (counted, graph_counters(engine)) {
        row.graph_steps = Some([b[0] - a[0], b[1] - a[1], b[2] - a[2]]);
    }
    Ok(row)
}

fn print_table(args: &BenchArgs, device: &str, peak: Option<u64>, load_secs: f64, rows: &[Row]) {
    outln!("model: {} (loaded in {load_secs:.1} s)", args.model.label());
    outln!("backend: {device}");
    outln!(
        "micro-batch {} tokens, decode prompts {} tokens, {} repetitions after a warm-up",
        args.ubatch,
        args.prompt,
        args.reps
    );
    if let Some(p) = peak {
        outln!("peak device memory (pool): {:.2} GiB", p as f64 / (1u64 << 30) as f64);
    }
    outln!();
    outln!(
        "| case | graphs | tokens/s | ms/step | host prepare us | launch us | wait us | host share | graphs captured / updated / replayed |"
    );
    outln!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let (mean, sd) = r.mean_sd();
        let st = r.step;
        let host = (st.prepare + st.launch) / st.total().max(1e-12);
        let counts = r.graph_steps.map_or("-".to_string(), |[c, u, p]| format!("{c} / {u} / {p}"));
        outln!(
            "| {} | {} | {mean:.1} ± {sd:.1} | {:.3} | {:.0} | {:.0} | {:.0} | {:.1}% | {counts} |",
            r.case,
            r.graphs.map_or("-", |g| if g { "on" } else { "off" }),
            st.total() * 1e3,
            st.prepare * 1e6,
            st.launch * 1e6,
            st.wait * 1e6,
            host * 100.0
        );
    }
}

fn print_json(args: &BenchArgs, device: &str, peak: Option<u64>, load_secs: f64, rows: &[Row]) {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let (mean, sd) = r.mean_sd();
            serde_json::json!({
                "case": r.case,
                "graphs": r.graphs,
                "tokens_per_sec": { "mean": mean, "sd": sd, "reps": r.rates },
                "step_us": {
                    "prepare": r.step.prepare * 1e6,
                    "launch": r.step.launch * 1e6,
                    "wait": r.step.wait * 1e6,
                    "total": r.step.total() * 1e6,
                },
                "steps_per_rep": r.steps,
                "graph_steps": r.graph_steps.map(|[c, u, p]| serde_json::json!({ "captured": c, "updated": u, "replayed": p })),
            })
        })
        .collect();
    let doc = serde_json::json!({
        "model": args.model.label(),
        "load_secs": load_secs,
        "backend": device,
        "ubatch": args.ubatch,
        "decode_prompt_tokens": args.prompt,
        "n_gen": args.n_gen,
        "reps": args.reps,
        "peak_device_bytes": peak,
        "rows": rows,
    });
    outln!("{doc:#}");
}
