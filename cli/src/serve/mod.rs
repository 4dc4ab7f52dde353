//! `tessera serve FILE`: an OpenAI-compatible HTTP server over the engine (docs/SERVE.md).
//!
//! Threads: the engine ([`engine::run`]) has a thread of its own that owns the model and steps
//! it; the HTTP side is axum on a tokio runtime. Handlers parse and check a request, encode the
//! prompt (on tokio's blocking pool: a long prompt never stalls other connections), send the
//! engine thread a command and read the request's tokens back from its own channel, decoding
//! them to text (`text::TextStream`, with the `stop` strings). A handler that goes away (its
//! client disconnected) cancels its sequence through a drop guard, which frees its blocks at the
//! engine's next look at its commands.

mod engine;
mod metrics;
mod routes;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tessera_models::chat::ChatTemplate;
use tessera_models::config::ModelConfig;
use tessera_models::engine::{Engine, EngineConfig};
use tessera_models::model::{Model, ModelOptions};

use crate::backend::{self, BackendChoice};
use crate::{inspect, text};

/// What `tessera serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeArgs {
    pub host: String,
    /// 0: any free port (the one taken is printed).
    pub port: u16,
    pub backend: BackendChoice,
    /// Sequences generated at once (recurrent slots).
    pub max_seqs: usize,
    /// Most tokens one sequence holds: prompt plus generated.
    pub ctx: usize,
    /// Tokens the KV cache holds in all; default `max_seqs * ctx`.
    pub cache_tokens: Option<usize>,
    /// Accepted sequences that may wait for cache space beyond the running ones.
    pub queue: usize,
    /// Most tokens one engine step feeds.
    pub max_tokens_per_step: usize,
    /// Largest request body, in bytes.
    pub max_body: usize,
}

/// Cells per KV block.
const BLOCK: usize = 16;

/// Loads the model, starts the engine thread and serves until SIGINT / SIGTERM.
pub fn run(file: &Path, args: &ServeArgs) -> Result<(), String> {
    if args.max_seqs == 0 {
        return Err("--max-seqs: at least 1".into());
    }
    if args.ctx < 2 {
        return Err("--ctx: at least 2 tokens".into());
    }
    if args.max_tokens_per_step == 0 {
        return Err("--max-tokens-per-step: at least 1".into());
    }
    let gguf = inspect::open(file)?;
    let config = ModelConfig::from_gguf(&gguf).map_err(|e| format!("{}: model config: {e}", file.display()))?;
    if args.ctx > config.n_ctx_train {
        return Err(format!(
            "--ctx {}: more than the model's context length of {} ({}: {}.context_length)",
            args.ctx,
            config.n_ctx_train,
            file.display(),
            config.arch
        ));
    }
    let tok = text::tokenizer(&gguf, file)?;
    // Without a template the chat route says so; completions still work.
    let template = ChatTemplate::from_gguf(&gguf).map_err(|e| e.to_string());
    let cache_tokens = args.cache_tokens.unwrap_or(args.max_seqs.saturating_mul(args.ctx));
    if cache_tokens < args.ctx {
        return Err(format!("--cache-tokens {cache_tokens}: less than --ctx {}: no sequence would fit", args.ctx));
    }
    let ctx = args.ctx.next_multiple_of(BLOCK).min(config.n_ctx_train.max(args.ctx));
    let model_id = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let metrics = Arc::new(metrics::Metrics::default());
    let (commands, rx) = std::sync::mpsc::channel();
    let limits = engine::Limits { max_active: args.max_seqs + args.queue };
    let engine_metrics = metrics.clone();
    let (loaded_tx, loaded) = std::sync::mpsc::channel();
    let (choice, max_seqs, max_tokens_per_step) = (args.backend, args.max_seqs, args.max_tokens_per_step);
    let eog = tok.eog_ids().to_vec();
    let path = file.to_path_buf();
    // Backends are not Send: the engine is built on its own thread, which says how that went.
    let engine_thread = std::thread::Builder::new()
        .name("tessera-engine".into())
        .spawn(move || {
            let built = (|| {
                let backend::Opened { mut backend, description, kv_pad, .. } = backend::open(choice)?;
                let opts = ModelOptions {
                    kv_blocks: cache_tokens.div_ceil(BLOCK),
                    block_size: BLOCK,
                    max_context: ctx,
                    n_slots: max_seqs,
                    kv_pad,
                    ..ModelOptions::default()
                };
                let model =
                    Model::load(&gguf, backend.as_mut(), opts).map_err(|e| format!("{}: {e}", path.display()))?;
                drop(gguf);
                let mut engine =
                    Engine::new(model, backend, EngineConfig { max_tokens_per_step }).map_err(|e| e.to_string())?;
                engine.set_stop_tokens(&eog);
                Ok::<_, String>((engine, description))
            })();
            match built {
                Ok((engine, description)) => {
                    let _ = loaded_tx.send(Ok(description));
                    engine::run(engine, rx, limits, engine_metrics);
                }
                Err(e) => {
                    let _ = loaded_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| format!("starting the engine thread: {e}"))?;
    let description = match loaded.recv() {
        Ok(Ok(d)) => d,
        Ok(Err(e)) => {
            let _ = engine_thread.join();
            return Err(e);
        }
        Err(_) => return Err("the engine thread stopped while loading the model".into()),
    };
    let app = Arc::new(routes::App {
        tok,
        template,
        commands,
        model_id,
        ctx: args.ctx,
        max_body: args.max_body,
        metrics,
        next_id: AtomicU64::new(0),
        started: std::time::SystemTime::now(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(|e| format!("binding {}:{}: {e}", args.host, args.port))?;
        let addr: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
        errln!(
            "serving {} on {description}: {} sequences of {} tokens, a queue of {}",
            file.display(),
            args.max_seqs,
            args.ctx,
            args.queue
        );
        outln!("listening on http://{addr}");
        crate::output::flush();
        axum::serve(listener, routes::router(app.clone()))
            .with_graceful_shutdown(shutdown())
            .await
            .map_err(|e| format!("serving: {e}"))
    });
    // Dropping the last command sender lets the engine thread finish.
    drop(app);
    runtime.shutdown_background();
    let _ = engine_thread.join();
    served
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown() {
    let int = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = int => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = int.await;
}
