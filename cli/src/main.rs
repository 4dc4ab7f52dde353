//! `tessera`: the Tessera command line.
//!
//! - `tessera synth --preset NAME [--dtype f16] [--seed 1] [--set key=value]... -o FILE` writes a
//!   synthetic `qwen35` / `qwen35moe` GGUF (see `tessera_models::synth`) with a progress bar over
//!   the tensor bytes written. `--set` overrides a metadata key of the preset, named without the
//!   `{arch}.` prefix (`block_count=8`, `attention.head_count=4`, `rope.dimension_sections=4,2,2,0`,
//!   `tied_embeddings=true`). `--vocab FILE.gguf` copies the `tokenizer.*` keys of another GGUF
//!   (a model or a vocabulary-only file) and sets `vocab_size` to its token count, so the
//!   synthetic model speaks a real vocabulary (its outputs stay random).
//! - `tessera inspect FILE` prints the header, every metadata kv (long arrays summarised), a tensor
//!   table, the parsed model config and whether the tensors match it.
//! - `tessera run FILE --tokens 1,2,3 [--tokens 4,5]... [-n N] [--seed S] [--temperature T]
//!   [--top-k K] [--top-p P] [--kv-dtype f16|f32|bf16] [--dump-logits OUT.safetensors]
//!   [--backend auto|cpu|cuda]` loads the GGUF on the backend (`auto`: CUDA when a GPU is usable,
//!   else the CPU) and generates `N` tokens for each prompt (one `--tokens` per
//!   sequence, batched together) through the engine (`tessera_models::engine`), printing memory
//!   accounting, the token ids and prefill / decode tokens/s. `--dump-logits` writes the f32
//!   logits of every processed position (`seqK.logits` `[n_tokens, n_vocab]`, `seqK.ids` i32: the
//!   prompt and every generated token but the last) to a safetensors file.
//! - `tessera convert --from-hf DIR --out FILE [--dtype f32] [--allow-nonfinite] [-q]` converts a
//!   Hugging Face Qwen3.5 checkpoint (`config.json` + `*.safetensors`, dense or MoE) to a GGUF
//!   (`tessera_models::convert`), with a progress bar on a terminal. NaN, infinite or out-of-range
//!   weights are an error naming the tensor unless `--allow-nonfinite`; warnings go to stderr.
//! - `tessera tokenize FILE "text" | --file PATH [--json] [--no-parse-special]` prints the ids of
//!   the text under the GGUF's tokenizer (`tessera_models::tokenizer`), comma-separated, or with
//!   `--json` the ids and each token's text; a file without tokenizer metadata is an error that
//!   says so.
//! - `tessera serve FILE [--host 127.0.0.1] [--port 8080] [--backend ...] [--max-seqs N] [--ctx N]
//!   [--cache-tokens N] [--queue N]` serves the model over HTTP with OpenAI's completions and chat
//!   completions API, streamed as server-sent events, batched on an engine thread (see `serve`
//!   and docs/SERVE.md).
//! - `tessera demo [--backend auto|cpu|cuda]` synthesizes a tiny `qwen35moe`, batches three prompts
//!   through chunked prefill and decode on the best backend present, prints what it did, and
//!   checks the batched tokens against each sequence alone and, on a GPU, the tokens and logits
//!   against the CPU oracle.
//! - `tessera loadgen --url http://127.0.0.1:PORT [--clients N] [--requests M] [--max-tokens T]
//!   [--prompt TEXT | --prompt-tokens K] [--chat] [--stream] [--timeout S] [--json]` sends M
//!   completion requests from N concurrent clients to an OpenAI-compatible server on the loopback
//!   address (see `loadgen`) and reports throughput and TTFT / ITL / latency percentiles; any
//!   failed request makes the exit status 1.
//!
//! Files: every output (`synth -o`, `convert --out`, `run --dump-logits`) is checked before any
//! work (not an input file, not a directory, its directory exists and is writable) and written
//! atomically: to a temporary file beside it, renamed over it only when complete and synced, so
//! an error or an interrupt leaves an existing file as it was and no temporary behind (see
//! `tessera_files` and docs/MODELS.md, "Files Tessera writes"). Inputs must be regular files: a
//! directory, FIFO or device is an error that says so, never a hang. `run` refuses prompts plus
//! `-n` beyond the model's context length before loading anything.
//!
//! Exit status:
//!
//! - 0 on success, and when stdout is closed early (`tessera inspect F | head -1`): the program
//!   stops quietly;
//! - 1 for every error, with one `error:` line on stderr naming the file and what was wrong: a
//!   file that cannot be read or written, an output refused, an input that is not a regular file,
//!   a config that is not a valid qwen35 / qwen35moe config, tensors that do not match, too many
//!   tokens for the context, a failed `run`, a failed `demo` self-check;
//! - 2 for usage errors (clap);
//! - 130 on SIGINT and 143 on SIGTERM during `synth`, `convert` and `run`, after removing the
//!   unfinished output.

#[macro_use]
mod output;

mod backend;
mod bench;
mod chat;
mod convert;
mod demo;
mod fusion;
mod inspect;
mod loadgen;
mod run;
mod serve;
mod text;
mod tokenize;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_models::config::ModelConfig;
use tessera_models::gguf::GgufFile;
use tessera_models::sample::SamplerParams;
use tessera_models::synth::{SynthProgress, SynthVocab, synthesize_with_vocab};
use tessera_ops::DType;

#[derive(Parser, Debug)]
#[command(name = "tessera", version, about = "Tessera: qwen35 / qwen35moe / qwen3 / qwen3moe GGUF tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The synthetic weights of a preset: `tessera synth` and `tessera bench --preset`.
#[derive(clap::Args, Debug)]
struct SynthWeights {
    /// Dtype of the weight matrices (norms and small vectors stay f32).
    #[arg(long, value_enum, default_value_t = WeightDType::F16)]
    dtype: WeightDType,
    /// Seed of the weights: the same seed gives the same weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Override a metadata key, without the arch prefix (repeatable): block_count=8.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a GGUF with a preset's metadata and seeded random weights.
    Synth {
        /// tiny, tiny-moe, qwen35-27b, qwen35moe-35b-a3b, qwen3-tiny, qwen3moe-tiny, qwen3-32b or
        /// qwen3moe-30b-a3b.
        #[arg(long)]
        preset: String,
        #[command(flatten)]
        weights: SynthWeights,
        /// Copy the vocabulary (tokenizer.* keys) of this GGUF and set vocab_size to its size.
        #[arg(long, value_name = "FILE.gguf")]
        vocab: Option<PathBuf>,
        /// Output file.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
        /// No progress bar.
        #[arg(long, short = 'q')]
        quiet: bool,
    },
    /// Print a GGUF's metadata, tensors, model config and tensor check.
    Inspect {
        /// The GGUF file.
        file: PathBuf,
    },
    /// Generate tokens from token ids with a GGUF on the chosen backend, one sequence per
    /// --tokens, batched. Prints memory accounting, the generated
    /// ids and prefill / decode tokens/s; --dump-logits also writes every position's logits.
    Run {
        /// The GGUF file.
        file: PathBuf,
        /// Prompt token ids, comma separated: 1,2,3. Repeat for several sequences (batched
        /// together).
        #[arg(long, value_name = "IDS", value_parser = parse_ids, required_unless_present = "prompt")]
        tokens: Vec<Ids>,
        /// A prompt as text, encoded with the file's tokenizer. Repeat for several sequences
        /// (batched with any --tokens). One sequence's output is printed as it is generated.
        #[arg(long, value_name = "TEXT")]
        prompt: Vec<String>,
        /// Send each --prompt as a user message through the file's chat template.
        #[arg(long)]
        chat: bool,
        /// End a sequence's output at this string (repeatable; needs the file's tokenizer).
        #[arg(long, value_name = "STRING")]
        stop: Vec<String>,
        /// Keep generating past end-of-generation tokens (benchmarks).
        #[arg(long = "ignore-eos")]
        ignore_eos: bool,
        /// Tokens to generate.
        #[arg(short = 'n', long = "n-new", default_value_t = 16)]
        n_new: usize,
        /// Seed of the sampler.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Softmax temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Keep only the K most likely tokens.
        #[arg(long = "top-k")]
        top_k: Option<usize>,
        /// Nucleus sampling: keep the most likely tokens up to this total probability, in (0, 1].
        #[arg(long = "top-p", default_value_t = 1.0)]
        top_p: f32,
        /// Most tokens fed in one step (prompts are fed in chunks of this size).
        #[arg(long, default_value_t = 64)]
        max_tokens_per_step: usize,
        /// Element type of the KV cache (f32 for the closest comparison with an f32 reference).
        #[arg(long = "kv-dtype", value_enum, default_value_t = KvDType::F16)]
        kv_dtype: KvDType,
        /// Write the f32 logits of every processed position to this safetensors file:
        /// `seqK.logits` [n_tokens, n_vocab] and `seqK.ids` (i32) per sequence.
        #[arg(long = "dump-logits", value_name = "OUT.safetensors")]
        dump_logits: Option<PathBuf>,
        /// Print where each step's time went: host preparation, launch, waiting for the device,
        /// per prefill and decode step, and the planned step graphs built and reused.
        #[arg(long)]
        stats: bool,
        #[command(flatten)]
        fusion: fusion::FusionArgs,
        /// Where to run: CUDA when a GPU is usable (auto), or a named backend.
        #[arg(long, value_enum, default_value_t = backend::BackendChoice::Auto)]
        backend: backend::BackendChoice,
    },
    /// Measure prefill and batched decode throughput of a GGUF through the engine (llama-bench's
    /// counterpart): warm-up excluded, mean ± sd over repetitions, each step's time split into
    /// host preparation, launch and waiting for the device.
    Bench {
        /// The GGUF file (or --preset).
        #[arg(required_unless_present = "preset", conflicts_with = "preset")]
        file: Option<PathBuf>,
        /// Instead of a file: a preset (tiny, tiny-moe, qwen35-27b, qwen35moe-35b-a3b, qwen3-*) with seeded
        /// weights uploaded straight to the backend, the ones `tessera synth` would write.
        #[arg(long)]
        preset: Option<String>,
        /// With --preset: the weights, as `tessera synth` takes them.
        #[command(flatten)]
        weights: SynthWeights,
        /// Prompt lengths of the prefill cases, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "512,2048")]
        prefill: Vec<usize>,
        /// Batch widths of the decode cases, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
        widths: Vec<usize>,
        /// Tokens generated per sequence in a decode case.
        #[arg(long = "n-gen", default_value_t = 128)]
        n_gen: usize,
        /// Prompt tokens of each sequence in a decode case.
        #[arg(long, default_value_t = 16)]
        prompt: usize,
        /// Most tokens one step feeds (llama.cpp's n_ubatch).
        #[arg(long, default_value_t = 512)]
        ubatch: usize,
        /// Measured repetitions of each case (after one warm-up).
        #[arg(short = 'r', long, default_value_t = 3)]
        reps: usize,
        /// Element type of the KV cache.
        #[arg(long = "kv-dtype", value_enum, default_value_t = KvDType::F16)]
        kv_dtype: KvDType,
        /// CUDA graphs: on, off, or both (every case twice).
        #[arg(long, value_enum, default_value_t = GraphsChoice::On)]
        graphs: GraphsChoice,
        /// Print JSON instead of a markdown table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        fusion: fusion::FusionArgs,
        /// Where to run.
        #[arg(long, value_enum, default_value_t = backend::BackendChoice::Auto)]
        backend: backend::BackendChoice,
    },
    /// Talk with a model: each line of stdin is a user message, the reply is streamed as it is
    /// generated, and the conversation stays in the caches (`/reset` starts over).
    Chat {
        /// The GGUF file (with a tokenizer and a chat template).
        file: PathBuf,
        /// Softmax temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.7)]
        temperature: f32,
        /// Keep only the K most likely tokens.
        #[arg(long = "top-k", default_value = "20")]
        top_k: Option<usize>,
        /// Nucleus sampling, in (0, 1].
        #[arg(long = "top-p", default_value_t = 0.8)]
        top_p: f32,
        /// Seed of the sampler.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Most tokens a reply may have.
        #[arg(short = 'n', long = "max-reply", default_value_t = 512)]
        max_reply: usize,
        /// Tokens the conversation may hold in all (at most the model's context length).
        #[arg(long, default_value_t = 4096)]
        context: usize,
        /// A system message put first.
        #[arg(long)]
        system: Option<String>,
        /// Where to run.
        #[arg(long, value_enum, default_value_t = backend::BackendChoice::Auto)]
        backend: backend::BackendChoice,
    },
    /// Serve the model over HTTP with OpenAI's completions and chat completions API
    /// (docs/SERVE.md): continuous batching on an engine thread, streaming as server-sent events.
    Serve {
        /// The GGUF file (with a tokenizer; a chat template for /v1/chat/completions).
        file: PathBuf,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on; 0 takes a free one (printed as `listening on http://ADDR`).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Sequences generated at once.
        #[arg(long = "max-seqs", default_value_t = 4)]
        max_seqs: usize,
        /// Most tokens one sequence holds, prompt and generated (at most the model's context).
        #[arg(long, default_value_t = 4096)]
        ctx: usize,
        /// Tokens the KV cache holds in all (default: max-seqs x ctx). Smaller: requests wait for
        /// space in the queue.
        #[arg(long = "cache-tokens")]
        cache_tokens: Option<usize>,
        /// Accepted requests that may wait beyond the running ones; past them, 503.
        #[arg(long, default_value_t = 64)]
        queue: usize,
        /// Most tokens one engine step feeds (prompts are fed in chunks of this size).
        #[arg(long, default_value_t = 512)]
        max_tokens_per_step: usize,
        /// Largest request body in bytes; larger ones get 413.
        #[arg(long = "max-body", default_value_t = 4 << 20)]
        max_body: usize,
        /// Where to run.
        #[arg(long, value_enum, default_value_t = backend::BackendChoice::Auto)]
        backend: backend::BackendChoice,
    },
    /// Build a tiny qwen35moe in memory, batch three prompts through prefill and decode, print
    /// what happened and self-check the batched tokens against each sequence run alone (and, on
    /// a GPU, against the CPU oracle).
    Demo {
        /// Where to run: CUDA when a GPU is usable (auto), or a named backend.
        #[arg(long, value_enum, default_value_t = backend::BackendChoice::Auto)]
        backend: backend::BackendChoice,
    },
    /// Print the token ids of a text under a GGUF's tokenizer, comma-separated (as
    /// llama-tokenize does).
    Tokenize {
        /// The GGUF file (a model, or a vocabulary-only file).
        file: PathBuf,
        /// The text to tokenize.
        #[arg(required_unless_present = "text_file", conflicts_with = "text_file")]
        text: Option<String>,
        /// Read the text from this file instead.
        #[arg(long = "file", value_name = "PATH")]
        text_file: Option<PathBuf>,
        /// Print {"ids": [..], "pieces": [..]} instead.
        #[arg(long)]
        json: bool,
        /// Encode control-token texts (<|im_start|>) as plain text instead of as their tokens.
        #[arg(long = "no-parse-special")]
        no_parse_special: bool,
    },
    /// Load an OpenAI-compatible server on this machine (loopback only) with concurrent clients
    /// and a fixed number of requests; report throughput and TTFT / ITL / latency percentiles.
    Loadgen(loadgen::LoadgenArgs),
    /// Convert a Hugging Face Qwen3.5 checkpoint (dense or MoE) to GGUF.
    Convert {
        /// The checkpoint directory (config.json and *.safetensors).
        #[arg(long = "from-hf")]
        from_hf: PathBuf,
        /// Output GGUF file.
        #[arg(long = "out", short = 'o')]
        out: PathBuf,
        /// Dtype of the weight matrices (norms, small vectors, conv and router stay f32).
        #[arg(long, value_enum, default_value_t = WeightDType::F16)]
        dtype: WeightDType,
        /// Store NaN, infinite and out-of-range weights (for the chosen dtype) instead of failing;
        /// each affected tensor is reported as a warning.
        #[arg(long = "allow-nonfinite")]
        allow_nonfinite: bool,
        /// No progress bar (it is only drawn when stderr is a terminal anyway).
        #[arg(long, short = 'q')]
        quiet: bool,
    },
}

/// One sequence's prompt ids (`--tokens 1,2,3`).
#[derive(Clone, Debug)]
struct Ids(Vec<u32>);

fn parse_ids(s: &str) -> Result<Ids, String> {
    s.split(',')
        .map(|t| t.trim().parse::<u32>().map_err(|e| format!("`{t}` is not a token id: {e}")))
        .collect::<Result<Vec<u32>, String>>()
        .map(Ids)
}

/// The KV cache element types `run` accepts.
/// `tessera bench --graphs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GraphsChoice {
    On,
    Off,
    Both,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum KvDType {
    F16,
    F32,
    Bf16,
}

impl From<KvDType> for DType {
    fn from(d: KvDType) -> DType {
        match d {
            KvDType::F16 => DType::F16,
            KvDType::F32 => DType::F32,
            KvDType::Bf16 => DType::BF16,
        }
    }
}

/// The weight dtypes `synth` accepts.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum WeightDType {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    Nvfp4,
}

impl From<WeightDType> for DType {
    fn from(d: WeightDType) -> DType {
        match d {
            WeightDType::F32 => DType::F32,
            WeightDType::F16 => DType::F16,
            WeightDType::Bf16 => DType::BF16,
            WeightDType::Q8_0 => DType::Q8_0,
            WeightDType::Nvfp4 => DType::NvFp4,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The commands that write files remove their unfinished outputs on SIGINT / SIGTERM.
    if matches!(cli.command, Command::Synth { .. } | Command::Convert { .. } | Command::Run { .. })
        && let Err(e) = tessera_files::exit_on_signals()
    {
        errln!("error: installing the SIGINT / SIGTERM handler: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Synth { preset, weights, vocab, output, quiet } => {
            run_synth(&preset, &weights, vocab.as_deref(), &output, quiet)
        }
        Command::Inspect { file } => inspect::run(&file),
        Command::Run {
            file,
            tokens,
            prompt,
            chat,
            stop,
            ignore_eos,
            n_new,
            seed,
            temperature,
            top_k,
            top_p,
            max_tokens_per_step,
            kv_dtype,
            dump_logits,
            stats,
            fusion,
            backend,
        } => {
            let params = SamplerParams { temperature, top_k, top_p, seed };
            let prompts = tokens.into_iter().map(|Ids(t)| t).collect();
            let args = run::RunArgs {
                prompts,
                n_new,
                params,
                max_tokens_per_step,
                kv_dtype: kv_dtype.into(),
                dump_logits,
                stats,
                texts: prompt,
                chat,
                stop,
                ignore_eos,
                fusion,
                backend,
            };
            run::run(&file, &args)
        }
        Command::Demo { backend } => demo::run(backend),
        Command::Loadgen(args) => loadgen::run(&args),
        Command::Serve {
            file,
            host,
            port,
            max_seqs,
            ctx,
            cache_tokens,
            queue,
            max_tokens_per_step,
            max_body,
            backend,
        } => serve::run(
            &file,
            &serve::ServeArgs {
                host,
                port,
                backend,
                max_seqs,
                ctx,
                cache_tokens,
                queue,
                max_tokens_per_step,
                max_body,
            },
        ),
        Command::Chat { file, temperature, top_k, top_p, seed, max_reply, context, system, backend } => {
            let params = SamplerParams { temperature, top_k, top_p, seed };
            chat::run(&file, &chat::ChatArgs { params, max_reply, context, system, backend })
        }
        Command::Tokenize { file, text, text_file, json, no_parse_special } => match (&text, &text_file) {
            (_, Some(p)) => tokenize::run(&file, tokenize::Text::File(p), json, !no_parse_special),
            (Some(t), None) => tokenize::run(&file, tokenize::Text::Arg(t), json, !no_parse_special),
            (None, None) => Err("tokenize: give the text or --file PATH".to_string()),
        },
        Command::Bench {
            file,
            preset,
            weights,
            prefill,
            widths,
            n_gen,
            prompt,
            ubatch,
            reps,
            kv_dtype,
            graphs,
            json,
            fusion,
            backend,
        } => {
            let model = match (file, preset) {
                (Some(file), _) => Ok(bench::Source::File(file)),
                (None, Some(p)) => preset_config(&p, &weights.set).map(|config| bench::Source::Preset {
                    name: p,
                    config: Box::new(config),
                    dtype: weights.dtype.into(),
                    seed: weights.seed,
                }),
                (None, None) => Err("bench: give a GGUF file or --preset".to_string()),
            };
            let graphs = match graphs {
                GraphsChoice::On => vec![true],
                GraphsChoice::Off => vec![false],
                GraphsChoice::Both => vec![true, false],
            };
            let args = model.map(|model| bench::BenchArgs {
                model,
                backend,
                prefill,
                widths,
                n_gen,
                prompt,
                ubatch,
                reps,
                kv_dtype: kv_dtype.into(),
                graphs,
                json,
                fusion,
            });
            args.and_then(|args| bench::bench(&args))
        }
        Command::Convert { from_hf, out, dtype, allow_nonfinite, quiet } => {
            let opts = tessera_models::convert::ConvertOptions { dtype: dtype.into(), allow_nonfinite };
            convert::run(&from_hf, &out, &opts, quiet)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The config of `preset` with `--set KEY=VALUE` overrides applied.
fn preset_config(preset: &str, overrides: &[String]) -> Result<ModelConfig, String> {
    let config = ModelConfig::preset(preset).map_err(|e| e.to_string())?;
    let pairs = overrides
        .iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("--set `{kv}`: expected KEY=VALUE"))?;
            Ok((k.trim(), v.trim()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    // (all applied, then checked once: some keys only make sense together)
    config.with_overrides(&pairs).map_err(|e| e.to_string())
}

fn run_synth(
    preset: &str,
    weights: &SynthWeights,
    vocab: Option<&Path>,
    output: &Path,
    quiet: bool,
) -> Result<(), String> {
    let (dtype, seed): (DType, u64) = (weights.dtype.into(), weights.seed);
    let inputs: Vec<&Path> = vocab.into_iter().collect();
    tessera_files::check_output(output, &inputs).map_err(|e| format!("{}: {e}", output.display()))?;
    let mut config = preset_config(preset, &weights.set)?;
    // The vocabulary sets vocab_size (after --set, which it overrides).
    let vocab = match vocab {
        None => None,
        Some(p) => {
            let f = GgufFile::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let v = SynthVocab::from_gguf(&f).map_err(|e| format!("{}: {e}", p.display()))?;
            config = config.with_override("vocab_size", &v.n_tokens.to_string()).map_err(|e| e.to_string())?;
            Some(v)
        }
    };
    let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(0) };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.set_message(format!("synth {preset} {dtype}"));
    let mut on_progress = |p: SynthProgress| {
        bar.set_length(p.total_bytes);
        bar.set_position(p.bytes_written);
    };
    let report = synthesize_with_vocab(&config, dtype, seed, output, vocab.as_ref(), Some(&mut on_progress))
        .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let with_vocab = vocab.map(|v| format!(", a vocabulary of {} tokens", v.n_tokens)).unwrap_or_default();
    outln!(
        "wrote {}: {} tensors, {} bytes of tensor data ({} parameters, {dtype} weights, seed {seed}{with_vocab})",
        output.display(),
        report.n_tensors,
        report.data_bytes,
        config.n_params()
    );
    Ok(())
}
