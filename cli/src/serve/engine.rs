//! The engine thread: owns the [`Engine`] (model, backend, caches) and runs its step loop. HTTP
//! handlers talk to it only through a channel of [`Cmd`]s, and it answers each request on that
//! request's own channel of [`SeqEvent`]s; sending never blocks, so the step loop never waits on
//! the network. Between two steps it takes every pending command; when idle it sleeps on the
//! channel.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use tessera_models::cache::SeqId;
use tessera_models::engine::{Engine, Event, Finish};
use tessera_models::sample::SamplerParams;
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;

/// A request's id, given by the server (the engine's sequence ids are its own).
pub type ReqId = u64;

/// What handlers ask of the engine thread.
pub enum Cmd {
    /// Queue a sequence; the answer starts with [`SeqEvent::Accepted`] or a rejection.
    Submit { id: ReqId, prompt: Vec<u32>, max_new: usize, params: SamplerParams, events: UnboundedSender<SeqEvent> },
    /// Drop the request's sequence (its client went away, or a stop string ended it) and free its
    /// cache blocks now. Unknown or finished ids are ignored.
    Cancel(ReqId),
}

/// What the engine thread tells one request, in order.
#[derive(Debug)]
pub enum SeqEvent {
    Accepted,
    /// `--max-seqs` sequences run and `--queue` wait already.
    Busy {
        running: usize,
        waiting: usize,
    },
    /// The engine refused the request (a check the handler did not make; a 400).
    Invalid(String),
    Token(u32),
    Finished(Finish),
    /// A step failed; the sequence is gone.
    Failed(String),
}

/// Limits of the engine thread.
pub struct Limits {
    /// Most sequences accepted at once, running and waiting: `--max-seqs` + `--queue`.
    pub max_active: usize,
}

/// A request the engine is working on.
struct Live {
    req: ReqId,
    events: UnboundedSender<SeqEvent>,
}

/// Runs commands and steps until every command sender is dropped and no sequence is left.
pub fn run(mut engine: Engine, commands: Receiver<Cmd>, limits: Limits, metrics: Arc<Metrics>) {
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let mut open = true;
    while open || !engine.is_idle() {
        // Idle: sleep until a command comes. Else take what is pending and step.
        if engine.is_idle() {
            match commands.recv() {
                Ok(c) => command(&mut engine, &mut live, c, &limits, &metrics),
                Err(_) => break,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => command(&mut engine, &mut live, c, &limits, &metrics),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if engine.is_idle() {
            gauges(&engine, &metrics);
            continue;
        }
        let t0 = Instant::now();
        let result = engine.step();
        metrics.step(t0.elapsed().as_secs_f64());
        match result {
            Ok(events) => {
                if events.is_empty() && engine.model().kv.n_sequences() == 0 && !engine.is_idle() {
                    // Nothing runs and the waiting sequences cannot be admitted (cannot happen
                    // with the sizes `serve` checks; never spin on it).
                    fail_all(&mut engine, &mut live, "a waiting sequence can never be admitted");
                }
                for ev in events {
                    deliver(&mut engine, &mut live, ev, &metrics);
                }
            }
            Err(e) => {
                errln!("serve: an engine step failed: {e}");
                fail_all(&mut engine, &mut live, &format!("the engine step failed: {e}"));
            }
        }
        gauges(&engine, &metrics);
    }
}

fn command(engine: &mut Engine, live: &mut HashMap<SeqId, Live>, cmd: Cmd, limits: &Limits, metrics: &Metrics) {
    match cmd {
        Cmd::Submit { id, prompt, max_new, params, events } => {
            if engine.n_active() >= limits.max_active {
                let running = engine.model().kv.n_sequences();
                let _ = events.send(SeqEvent::Busy { running, waiting: engine.n_active() - running });
                return;
            }
            match engine.submit(&prompt, max_new, params) {
                Ok(seq) => {
                    metrics.prompt_tokens(prompt.len());
                    if events.send(SeqEvent::Accepted).is_ok() {
                        live.insert(seq, Live { req: id, events });
                    } else {
                        let _ = engine.cancel(seq);
                    }
                }
                Err(e) => {
                    let _ = events.send(SeqEvent::Invalid(e.to_string()));
                }
            }
        }
        Cmd::Cancel(req) => {
            if let Some(seq) = live.iter().find(|(_, l)| l.req == req).map(|(s, _)| *s) {
                live.remove(&seq);
                let _ = engine.cancel(seq);
                metrics.cancelled();
            }
        }
    }
    gauges(engine, metrics);
}

/// Sends one step event to its request; a request whose receiver is gone is cancelled at once.
fn deliver(engine: &mut Engine, live: &mut HashMap<SeqId, Live>, ev: Event, metrics: &Metrics) {
    let (seq, msg) = match ev {
        Event::Token { seq, token } => {
            metrics.generated_token();
            (seq, SeqEvent::Token(token))
        }
        Event::Finished { seq, reason } => (seq, SeqEvent::Finished(reason)),
    };
    let Some(l) = live.get(&seq) else { return };
    let finished = matches!(msg, SeqEvent::Finished(_));
    if l.events.send(msg).is_err() && !finished {
        live.remove(&seq);
        let _ = engine.cancel(seq);
        metrics.cancelled();
    } else if finished {
        live.remove(&seq);
    }
}

/// Drops every sequence and tells its request why.
fn fail_all(engine: &mut Engine, live: &mut HashMap<SeqId, Live>, why: &str) {
    for (seq, l) in live.drain() {
        let _ = engine.cancel(seq);
        let _ = l.events.send(SeqEvent::Failed(why.to_string()));
    }
}

fn gauges(engine: &Engine, metrics: &Metrics) {
    let kv = &engine.model().kv;
    let running = kv.n_sequences();
    metrics.gauges(running, engine.n_active().saturating_sub(running), kv.used_blocks(), kv.config().n_blocks);
}
