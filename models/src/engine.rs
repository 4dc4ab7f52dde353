//! A continuous-batching generation engine over one [`Model`] on one backend.
//!
//! [`Engine::submit`] queues a prompt; each [`Engine::step`] forms one micro-batch and runs one
//! [`Model::step`]:
//!
//! 1. every decoding sequence (prompt done) feeds its last sampled token: one token each;
//! 2. the rest of the step's token budget ([`EngineConfig::max_tokens_per_step`] minus the decode
//!    tokens) goes to prompt chunks, oldest sequence first, admitting waiting sequences as slots
//!    and blocks allow. A long prompt is fed in chunks over several steps, so it never stalls the
//!    decoding sequences.
//!
//! A sequence whose prompt completes in a step gets its first token sampled from that step's
//! logits; decoding sequences get one token per step. Sampling runs on the device
//! ([`Model::step_sample_on`]): each sequence's seeded [`Sampler`] supplies its settings and
//! uniform draw, the graph's `sample` op picks the token, and only token ids come back. When a
//! sequence has generated its `max_new_tokens`, or one of the stop tokens
//! ([`Engine::set_stop_tokens`]), it is finished ([`Event::Finished`]) and removed from the model,
//! returning its KV blocks and recurrent slot.
//!
//! With [`Engine::record_logits`] on, each step asks for the logits of every fed token
//! ([`Logits::All`]) and keeps them per sequence, in feeding order, until
//! [`Engine::take_logits`]: the logits of every processed position, as `tessera run
//! --dump-logits` writes them (sampling still uses each sequence's last row).
//!
//! Admission never overcommits: a sequence is admitted (added to the model) only when a recurrent
//! slot is free and the KV blocks for its whole lifetime (`prompt + max_new_tokens - 1` tokens:
//! the last sampled token is never fed) fit beside the lifetimes of the sequences already
//! admitted. So a running sequence never fails for lack of cache space.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use tessera_graph::Backend;
use tessera_ops::sample::SampleSettings;

use crate::cache::SeqId;
use crate::model::{Logits, Model, ModelError, StepTimes};
use crate::sample::{SampleError, Sampler, SamplerParams};

/// Why the engine refused a request or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    #[error("prompt token {token} is outside the vocab of {n_vocab}")]
    TokenOutOfVocab { token: u32, n_vocab: usize },
    #[error(
        "a prompt of {prompt} tokens plus {new} new tokens needs {needed} cache positions, more than the {max} a sequence can hold (max_context {max_context}, {cells} kv cells)"
    )]
    TooLong { prompt: usize, new: usize, needed: usize, max: usize, max_context: usize, cells: usize },
    #[error("bad engine config: {why}")]
    BadConfig { why: String },
    #[error("unknown sequence {id}")]
    UnknownSequence { id: SeqId },
}

type R<T> = Result<T, EngineError>;

/// Scheduling knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most tokens one step feeds (decode tokens plus prompt chunks), at least 1. Decode tokens
    /// are always all taken, even past the budget; prompt chunks get what is left.
    pub max_tokens_per_step: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_tokens_per_step: 64 }
    }
}

/// What a step produced, in batch order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Sequence `seq` generated `token`.
    Token { seq: SeqId, token: u32 },
    /// Sequence `seq` finished and was removed from the model.
    Finished { seq: SeqId, reason: Finish },
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It generated its `max_new_tokens`.
    Length,
    /// It generated one of the stop tokens ([`Engine::set_stop_tokens`]; that token is its last
    /// [`Event::Token`]).
    Stop,
}

/// Resident memory of the model, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// Every weight tensor as stored on the backend.
    pub weight_bytes: usize,
    /// K plus V of one token over all attention layers.
    pub kv_bytes_per_token: usize,
    /// Conv plus delta-rule state of one sequence over all recurrent layers.
    pub recurrent_bytes_per_sequence: usize,
    /// The whole KV cache (`kv_bytes_per_token * n_cells`).
    pub kv_cache_bytes: usize,
    /// The whole recurrent cache (`recurrent_bytes_per_sequence * n_slots`).
    pub recurrent_cache_bytes: usize,
    /// `kv_cache_bytes + recurrent_cache_bytes`.
    pub total_cache_bytes: usize,
}

/// Token counts and times of the steps run so far. A step with any prompt chunk counts as a
/// prefill step (its time and chunk tokens go to `prefill_*`; decode tokens riding along are
/// counted in `decode_tokens` but their time in `prefill_secs`); a step with only decode tokens
/// is a decode step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub steps: usize,
    /// Steps that fed prompt tokens.
    pub prefill_steps: usize,
    /// Steps that fed only decode tokens.
    pub decode_steps: usize,
    /// Where the prefill steps' time went (host preparation, launch, waiting for the device).
    pub prefill_times: StepTimes,
    /// Where the decode-only steps' time went.
    pub decode_times: StepTimes,
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    /// Decode tokens fed in any step.
    pub decode_tokens: usize,
    /// Decode tokens fed in decode-only steps.
    pub decode_only_tokens: usize,
    pub decode_secs: f64,
    /// Tokens sampled (generated).
    pub generated: usize,
}

impl EngineStats {
    /// Prompt tokens per second of the prefill steps (0 when none ran).
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill_secs)
    }

    /// Decode tokens per second of the decode-only steps (0 when none ran).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        rate(self.decode_only_tokens, self.decode_secs)
    }

    /// All tokens fed per second of all steps.
    pub fn tokens_per_sec(&self) -> f64 {
        rate(self.prefill_tokens + self.decode_tokens, self.prefill_secs + self.decode_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 { n as f64 / secs } else { 0.0 }
}

/// What a model step gave back: token ids sampled on the device, or logits to sample here.
enum Outcome {
    Tokens(Vec<u32>),
    Logits(Vec<Vec<f32>>),
}

/// One submitted sequence.
#[derive(Debug)]
struct Seq {
    id: SeqId,
    prompt: Vec<u32>,
    /// Prompt tokens fed so far.
    fed: usize,
    max_new: usize,
    generated: Vec<u32>,
    sampler: Sampler,
    /// KV blocks its whole lifetime needs (admission budget).
    blocks: usize,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.fed == self.prompt.len()
    }
}

/// A model, the backend it lives on, and the sequences being generated.
pub struct Engine {
    model: Model,
    backend: Box<dyn Backend>,
    /// Where ops `backend` does not support run ([`Engine::with_fallback`]).
    fallback: Option<Box<dyn Backend>>,
    cfg: EngineConfig,
    /// Admitted sequences (in the model), oldest first.
    running: Vec<Seq>,
    /// Submitted, not yet admitted, oldest first.
    waiting: VecDeque<Seq>,
    next_id: SeqId,
    stats: EngineStats,
    /// Whether steps keep the logits of every fed token ([`Engine::record_logits`]).
    record: bool,
    /// Recorded logits per sequence, `n_vocab` per fed token, in feeding order.
    recorded: BTreeMap<SeqId, Vec<f32>>,
    /// Tokens that end a sequence when generated ([`Engine::set_stop_tokens`]).
    stop_tokens: Vec<u32>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend.name())
            .field("cfg", &self.cfg)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl Engine {
    /// An engine over `model`, which must have been loaded on `backend` and hold no sequences.
    pub fn new(model: Model, backend: Box<dyn Backend>, cfg: EngineConfig) -> R<Engine> {
        Self::build(model, backend, None, cfg)
    }

    /// [`Engine::new`] with a second backend for the ops `backend` does not support (the CPU
    /// behind a GPU, say): each such op runs there, its inputs copied over and its result back
    /// (`tessera_graph::schedule`). Weights and caches stay on `backend`.
    pub fn with_fallback(
        model: Model,
        backend: Box<dyn Backend>,
        fallback: Box<dyn Backend>,
        cfg: EngineConfig,
    ) -> R<Engine> {
        Self::build(model, backend, Some(fallback), cfg)
    }

    fn build(
        model: Model,
        backend: Box<dyn Backend>,
        fallback: Option<Box<dyn Backend>>,
        cfg: EngineConfig,
    ) -> R<Engine> {
        if cfg.max_tokens_per_step == 0 {
            return Err(EngineError::BadConfig { why: "max_tokens_per_step must be at least 1".into() });
        }
        if model.kv.n_sequences() != 0 || model.recurrent.used_slots() != 0 {
            return Err(EngineError::BadConfig { why: "the model already holds sequences".into() });
        }
        Ok(Engine {
            model,
            backend,
            fallback,
            cfg,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 0,
            stats: Default::default(),
            record: false,
            recorded: BTreeMap::new(),
            stop_tokens: Vec::new(),
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The backend's name (`cpu`, ...).
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Starts the statistics afresh (benches measure one run at a time).
    pub fn reset_stats(&mut self) {
        self.stats = EngineStats::default();
    }

    /// Tokens that end a sequence when it generates one (typically the vocabulary's
    /// end-of-generation ids, `Tokenizer::eog_ids`): the sequence finishes with [`Finish::Stop`]
    /// before its `max_new_tokens`. Empty (the default): only the length ends a sequence.
    pub fn set_stop_tokens(&mut self, ids: &[u32]) {
        self.stop_tokens = ids.to_vec();
    }

    /// Keep (`true`) or stop keeping the logits of every fed token from the next step on; see
    /// [`Engine::take_logits`]. Off by default (then only the last row per sequence is computed).
    pub fn record_logits(&mut self, on: bool) {
        self.record = on;
    }

    /// The logits recorded for sequence `id` (running or finished) and forgets them:
    /// `n_vocab` values per token fed while recording was on, in feeding order (the prompt, then
    /// each generated token but the last, which is never fed). Empty when none were recorded.
    pub fn take_logits(&mut self, id: SeqId) -> Vec<f32> {
        self.recorded.remove(&id).unwrap_or_default()
    }

    /// Sequences submitted and not finished (running or waiting).
    pub fn n_active(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Whether nothing is left to run.
    pub fn is_idle(&self) -> bool {
        self.n_active() == 0
    }

    /// Most tokens one sequence can hold: `max_context` and the number of KV cells.
    pub fn max_sequence_tokens(&self) -> usize {
        self.model.kv.config().max_context.min(self.model.kv.n_cells())
    }

    /// Queues `prompt` to generate `max_new_tokens` tokens with `params`; returns its id. The
    /// prompt is checked now: non-empty, every token in the vocab, and `prompt + max_new_tokens
    /// - 1` positions within [`max_sequence_tokens`](Self::max_sequence_tokens).
    pub fn submit(&mut self, prompt: &[u32], max_new_tokens: usize, params: SamplerParams) -> R<SeqId> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if max_new_tokens == 0 {
            return Err(EngineError::NoNewTokens);
        }
        let n_vocab = self.model.n_vocab();
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfVocab { token, n_vocab });
        }
        let sampler = Sampler::new(params)?;
        let needed = prompt.len() + max_new_tokens - 1;
        let max = self.max_sequence_tokens();
        if needed > max {
            return Err(EngineError::TooLong {
                prompt: prompt.len(),
                new: max_new_tokens,
                needed,
                max,
                max_context: self.model.kv.config().max_context,
                cells: self.model.kv.n_cells(),
            });
        }
        let id = self.fresh_id();
        let blocks = self.model.kv.blocks_for_len(needed);
        self.waiting.push_back(Seq {
            id,
            prompt: prompt.to_vec(),
            fed: 0,
            max_new: max_new_tokens,
            generated: Vec::new(),
            sampler,
            blocks,
        });
        Ok(id)
    }

    /// An id no active sequence uses.
    fn fresh_id(&mut self) -> SeqId {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            // Not an active sequence, nor a finished one whose recorded logits are not taken yet.
            if !self.running.iter().chain(self.waiting.iter()).any(|s| s.id == id) && !self.recorded.contains_key(&id) {
                return id;
            }
        }
    }

    /// Drops sequence `id` (running or waiting), its recorded logits, and frees its cache space.
    pub fn cancel(&mut self, id: SeqId) -> R<()> {
        self.recorded.remove(&id);
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return Ok(());
        }
        let i = self.running.iter().position(|s| s.id == id).ok_or(EngineError::UnknownSequence { id })?;
        self.running.remove(i);
        self.model.remove_sequence(id)?;
        Ok(())
    }

    /// Admits waiting sequences while a slot is free and their lifetime blocks fit.
    fn admit(&mut self) -> R<()> {
        let total_blocks = self.model.kv.config().n_blocks;
        let n_slots = self.model.recurrent.config().n_slots;
        while let Some(next) = self.waiting.front() {
            let committed: usize = self.running.iter().map(|s| s.blocks).sum();
            if self.running.len() >= n_slots || committed + next.blocks > total_blocks {
                break;
            }
            let Some(seq) = self.waiting.pop_front() else { break };
            self.model.add_sequence(seq.id)?;
            self.running.push(seq);
        }
        Ok(())
    }

    /// Runs one micro-batch (see the [module docs](self)); returns its events in batch order,
    /// empty when nothing is left to run. On a model error every sequence of the batch is
    /// removed and the error returned.
    pub fn step(&mut self) -> R<Vec<Event>> {
        self.admit()?;
        // (index into running, tokens to feed).
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() {
                let last = *s.generated.last().ok_or_else(|| EngineError::BadConfig {
                    why: format!("sequence {} is decoding with no token", s.id),
                })?;
                plan.push((i, vec![last]));
            }
        }
        let n_decode = plan.len();
        let mut budget = self.cfg.max_tokens_per_step.saturating_sub(n_decode);
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if !s.decoding() {
                let n = (s.prompt.len() - s.fed).min(budget);
                plan.push((i, s.prompt[s.fed..s.fed + n].to_vec()));
                budget -= n;
            }
        }
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let n_prefill: usize = plan[n_decode..].iter().map(|(_, t)| t.len()).sum();
        let batch: Vec<(SeqId, &[u32])> = plan.iter().map(|(i, t)| (self.running[*i].id, t.as_slice())).collect();
        let t0 = Instant::now();
        // Unless every fed token's logits are recorded, sampling runs on the device and only token
        // ids come back: each sequence that gets a token this step draws its settings from its own
        // sampler (a prompt chunk that does not finish its prompt gets none, and its id is unused).
        let settings: Option<Vec<SampleSettings>> = (!self.record).then(|| {
            plan.iter()
                .map(|(i, toks)| {
                    let s = &mut self.running[*i];
                    let samples = s.decoding() || s.fed + toks.len() == s.prompt.len();
                    if samples { s.sampler.next_settings() } else { SampleSettings::greedy() }
                })
                .collect()
        });
        let mut backends: Vec<&mut dyn Backend> = vec![self.backend.as_mut()];
        if let Some(f) = self.fallback.as_mut() {
            backends.push(f.as_mut());
        }
        let result = if let Some(settings) = &settings {
            self.model.step_sample_on(&mut backends, &batch, settings).map(Outcome::Tokens)
        } else {
            let which = if self.record { Logits::All } else { Logits::Last };
            self.model.step_on(&mut backends, &batch, which).map(Outcome::Logits)
        };
        let secs = t0.elapsed().as_secs_f64();
        let outcome = match result {
            Ok(l) => l,
            Err(e) => {
                let mut ids: Vec<usize> = plan.iter().map(|(i, _)| *i).collect();
                ids.sort_unstable();
                for i in ids.into_iter().rev() {
                    let s = self.running.remove(i);
                    let _ = self.model.remove_sequence(s.id);
                }
                return Err(e.into());
            }
        };
        self.stats.steps += 1;
        self.stats.decode_tokens += n_decode;
        if n_prefill > 0 {
            self.stats.prefill_tokens += n_prefill;
            self.stats.prefill_secs += secs;
            self.stats.prefill_times += self.model.last_step_times();
            self.stats.prefill_steps += 1;
        } else {
            self.stats.decode_only_tokens += n_decode;
            self.stats.decode_secs += secs;
            self.stats.decode_times += self.model.last_step_times();
            self.stats.decode_steps += 1;
        }
        let n_vocab = self.model.n_vocab();
        let mut events = Vec::new();
        let mut finished = Vec::new();
        for (k, (i, toks)) in plan.iter().enumerate() {
            let s = &mut self.running[*i];
            if let (Outcome::Logits(logits), true) = (&outcome, self.record) {
                self.recorded.entry(s.id).or_default().extend_from_slice(&logits[k]);
            }
            if !s.decoding() {
                s.fed += toks.len();
                if !s.decoding() {
                    continue;
                }
            }
            let token = match &outcome {
                Outcome::Tokens(t) => t[k],
                // The last row: all of it with Logits::Last, the last n_vocab values with Logits::All.
                Outcome::Logits(l) => s.sampler.sample(&l[k][l[k].len().saturating_sub(n_vocab)..])?,
            };
            s.generated.push(token);
            self.stats.generated += 1;
            events.push(Event::Token { seq: s.id, token });
            let reason = if self.stop_tokens.contains(&token) {
                Some(Finish::Stop)
            } else {
                (s.generated.len() >= s.max_new).then_some(Finish::Length)
            };
            if let Some(reason) = reason {
                events.push(Event::Finished { seq: s.id, reason });
                finished.push(*i);
            }
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let s = self.running.remove(i);
            self.model.remove_sequence(s.id)?;
        }
        Ok(events)
    }

    /// Steps until every submitted sequence finished; returns each sequence's generated tokens.
    pub fn run_to_completion(&mut self) -> R<BTreeMap<SeqId, Vec<u32>>> {
        let mut out: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
        while !self.is_idle() {
            let events = self.step()?;
            if events.is_empty() && self.running.is_empty() && !self.waiting.is_empty() {
                return Err(EngineError::BadConfig { why: "a waiting sequence can never be admitted".into() });
            }
            for e in events {
                if let Event::Token { seq, token } = e {
                    out.entry(seq).or_default().push(token);
                }
            }
        }
        Ok(out)
    }

    /// The backend's counters (see `Backend::counters`).
    pub fn backend_counters(&self) -> Vec<(&'static str, u64)> {
        self.backend.counters()
    }

    /// Bytes of weights and caches (see [`MemoryReport`]).
    pub fn memory(&self) -> MemoryReport {
        memory(&self.model)
    }
}

impl Drop for Engine {
    /// Frees the model's weights and caches on the backend.
    fn drop(&mut self) {
        let mut backends: Vec<&mut dyn Backend> = vec![self.backend.as_mut()];
        if let Some(f) = self.fallback.as_mut() {
            backends.push(f.as_mut());
        }
        self.model.free_on(&mut backends);
    }
}

/// Bytes of `model`'s weights and caches (0 for a cache no layer of the family uses).
pub fn memory(model: &Model) -> MemoryReport {
    let weight_bytes = model.weights.tensor_bytes();
    let (kv, rec) = model.caches_held();
    let kv_cache_bytes = if kv { model.kv.total_bytes() } else { 0 };
    let recurrent_cache_bytes = if rec { model.recurrent.total_bytes() } else { 0 };
    MemoryReport {
        weight_bytes,
        kv_bytes_per_token: if kv { model.kv.bytes_per_token() } else { 0 },
        recurrent_bytes_per_sequence: if rec { model.recurrent.bytes_per_sequence() } else { 0 },
        kv_cache_bytes,
        recurrent_cache_bytes,
        total_cache_bytes: kv_cache_bytes + recurrent_cache_bytes,
    }
}
