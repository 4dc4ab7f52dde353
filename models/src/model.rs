//! The runtime every model family shares: a [`Model`] drives one
//! [`Architecture`] over resident weights and caches.
//!
//! What the runtime owns: the weights (uploaded once, prepared once by the architecture), the
//! paged KV cache and the recurrent-state cache sized from the architecture's per-layer
//! [`LayerCacheNeed`]s with each layer's cache memory, the planned step graphs kept per shape
//! [`Bucket`] (built by the architecture, rewritten by the fusion [`Pipeline`], planned once,
//! replayed), and stepping: sequences added on first use, cache space reserved all or nothing,
//! the packed inputs written, the logits (or the tokens sampled on the device) read back.
//!
//! Token layout inside a step graph: the tokens of every sequence of the step packed one after
//! the other, padded to the step's bucket ([`crate::batch`]): column `j` of every `[n_embd, N]`
//! activation is packed token `j`, and the ragged ops read which sequence owns it from the
//! `seq_offsets` input. Any mix of decode tokens and prompt chunks is one graph.

use std::collections::HashMap;
use std::ops::Range;

use tessera_graph::passes::{PassReport, PassRun, Pipeline, UnknownPass};
use tessera_graph::{
    Backend, BackendError, ExecError, Executable, Graph, GraphError, SessionOptions, SharedArenas, Tensor, TensorRef,
};
use tessera_ops::sample::SampleSettings;
use tessera_ops::{DType, TensorMeta};

use crate::arch::{Architecture, LayerCacheNeed, StepBuilder, StepLeaves};
use crate::batch::StepInputs;
use crate::cache::{AllocPolicy, CacheError, KvCacheConfig, PagedKvCache, RecurrentCache, RecurrentConfig, SeqId};
use crate::config::{ConfigError, ModelConfig};
use crate::gguf::GgufFile;
use crate::weights::{ModelWeights, WeightsError};

/// Why a model could not be loaded, built or stepped.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("bad batch: {why}")]
    BadBatch { why: String },
    #[error(transparent)]
    Synth(#[from] crate::synth::SynthError),
    #[error(transparent)]
    Pass(#[from] UnknownPass),
    /// The architecture's per-layer cache needs cannot be served (two attention layers with
    /// different K/V shapes, a zero dimension).
    #[error("cache needs of `{arch}`: {why}")]
    CacheNeeds { arch: String, why: String },
    /// A layer builder was used against what the architecture declared (a layer asking for a
    /// cache it did not declare).
    #[error("step graph: {why}")]
    Layer { why: String },
}

type R<T> = Result<T, ModelError>;

/// Cache sizes and load-time options of a [`Model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// KV blocks shared by all sequences.
    pub kv_blocks: usize,
    /// Cells per KV block.
    pub block_size: usize,
    /// Most tokens one sequence may hold.
    pub max_context: usize,
    /// KV cache element type: f16 (the default, as llama.cpp), f32 or bf16.
    pub kv_dtype: DType,
    /// How free KV blocks are handed out.
    pub policy: AllocPolicy,
    /// Sequences live at once (recurrent state slots).
    pub n_slots: usize,
    /// The attention's KV length (`n_kv`, the block table's width) is rounded up to a multiple
    /// of this; positions past a sequence's length are never read. 1 = exact. Decode steps keep one shape for
    /// `kv_pad` tokens, so their planned step graph (and on a GPU its captured CUDA graph) is
    /// replayed instead of built again every step. A GPU backend wants e.g. 256, the CPU 32.
    pub kv_pad: usize,
    /// Planned step graphs kept (one per shape [`Bucket`]); the least recently used are freed
    /// beyond it. They share one activation arena per backend (steps run one at a time), so a
    /// graph held costs its small input buffers and, on a GPU, its captured CUDA graph.
    pub step_graphs: usize,
    /// Stack the projections that read one input into one matrix at load
    /// ([`crate::layers::project::merge_groups`]):
    /// one matmul a group instead of one a weight (default on; `TESSERA_MERGE_PROJECTIONS=0`
    /// turns it off, to compare).
    pub merge_projections: bool,
    /// Steps of at most this many tokens run a MoE block's shared expert as one more slot of the
    /// routed experts ([`crate::layers::ffn::route_shared_expert`]: its weights stacked onto theirs at load, its gate
    /// logit a row of the router's); longer steps run it on its own, where the dense matmul beats
    /// one more expert in the grouped one. 0: never, and nothing is stacked (default 64;
    /// `TESSERA_ROUTE_SHARED_EXPERT=N` sets it, to compare).
    pub route_shared_expert: usize,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            kv_blocks: 64,
            block_size: 16,
            max_context: 1024,
            kv_dtype: DType::F16,
            policy: AllocPolicy::InOrder,
            n_slots: 4,
            kv_pad: 1,
            step_graphs: 64,
            merge_projections: std::env::var("TESSERA_MERGE_PROJECTIONS").map_or(true, |v| v != "0"),
            route_shared_expert: std::env::var("TESSERA_ROUTE_SHARED_EXPERT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(SHARED_EXPERT_ROUTED_TOKENS),
        }
    }
}

/// Default of [`ModelOptions::route_shared_expert`]: decode and short steps, where one more slot
/// in the routed experts' kernels beats the shared expert's own launches; a long prefill runs the
/// dense matmuls faster (docs/perf-log/fusion.md).
pub const SHARED_EXPERT_ROUTED_TOKENS: usize = 64;

/// Which logits [`Model::step`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// The last token of each sequence: `n_vocab` values per sequence.
    Last,
    /// Every token: `n_tokens * n_vocab` values per sequence, token-major.
    All,
}

/// One main layer's resident cache memory, as its [`LayerCacheNeed`] asked.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LayerMemory {
    None,
    /// K and V storage `[k_dim * n_head_kv, n_cells + 1]`.
    Attention {
        k: TensorRef,
        v: TensorRef,
    },
    /// Conv ring `[d_conv - 1, channels, n_slots]` and state `[S_k, S_v, H_v, n_slots]`.
    Recurrent {
        conv: TensorRef,
        state: TensorRef,
    },
}

impl LayerMemory {
    fn buffers(self) -> Option<(TensorRef, TensorRef)> {
        match self {
            LayerMemory::None => None,
            LayerMemory::Attention { k, v } => Some((k, v)),
            LayerMemory::Recurrent { conv, state } => Some((conv, state)),
        }
    }
}

/// A loaded model: an architecture, its resident weights, and the two caches with their backend
/// memory.
///
/// The caches keep every sequence's bookkeeping (the KV cache its length and positions even when
/// no layer attends); a model without attention (or recurrent) layers gets a one-layer cache of
/// unit dims for that bookkeeping, with no per-layer memory.
#[derive(Debug)]
pub struct Model {
    arch: Box<dyn Architecture>,
    /// The resident weights, by name.
    pub weights: ModelWeights,
    /// Block bookkeeping of the paged KV cache.
    pub kv: PagedKvCache,
    /// Slot bookkeeping of the recurrent-state cache.
    pub recurrent: RecurrentCache,
    layers: Vec<LayerMemory>,
    opts: ModelOptions,
    /// Planned step graphs by shape, replayed when a step of the same shape comes again.
    steps: StepCache,
    /// Where the last [`Model::step`]'s time went.
    last_times: StepTimes,
    /// The fusion passes run on every step graph before it is planned.
    passes: Pipeline,
    /// What the passes did to the step graph built last.
    pass_reports: Vec<PassReport>,
}

/// What a step graph's shape depends on: packed tokens and sequences (each rounded up by
/// [`crate::batch::bucket_len`]), the attention's KV length (rounded up by `kv_pad`) and which
/// logits it computes. Everything else in the graph (weights, cache memory, the config) is fixed
/// for the model's lifetime, and the mix of lengths inside a bucket is data, not shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// Packed tokens of all sequences, padding included.
    pub n_tokens: usize,
    /// Sequences, empty padding sequences included.
    pub n_seq: usize,
    /// KV positions the attention reads per sequence (the block table's width), padding
    /// included.
    pub n_kv: usize,
    /// Every token's logits are computed (else each sequence's last).
    pub all_logits: bool,
    /// The graph ends in the `sample` op: token ids come back instead of logits.
    pub sample: bool,
}

/// What a step returns.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Output<'a> {
    Logits(Logits),
    /// One token per sequence, picked on the device with these settings (one per sequence).
    Tokens(&'a [SampleSettings]),
}

/// One sequence's result of a step.
#[derive(Debug, Clone)]
enum SeqOut {
    Logits(Vec<f32>),
    Token(u32),
}

/// Where a step's time went, in seconds, summed over its graphs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// On the host before anything is queued: the step's inputs (positions, block table, offsets),
    /// finding the planned graph (or building and planning it) and writing the inputs.
    pub prepare: f64,
    /// Handing the planned tasks to the backend: launching (a replayed CUDA graph) or, on a
    /// synchronous backend (the CPU), computing.
    pub launch: f64,
    /// Waiting for the backend to finish and reading the results back.
    pub wait: f64,
}

impl StepTimes {
    /// All three, in seconds.
    pub fn total(&self) -> f64 {
        self.prepare + self.launch + self.wait
    }
}

impl std::ops::AddAssign for StepTimes {
    fn add_assign(&mut self, o: StepTimes) {
        self.prepare += o.prepare;
        self.launch += o.launch;
        self.wait += o.wait;
    }
}

/// A planned step graph with its per-step leaves.
#[derive(Debug)]
struct StepGraph {
    exe: Executable,
    io: StepIo,
    /// When it last ran (the cache's clock), for eviction.
    used: u64,
}

/// Planned step graphs kept per [`Bucket`], least recently used evicted beyond `capacity`, all
/// placed in one shared arena per backend.
#[derive(Debug, Default)]
struct StepCache {
    graphs: HashMap<Bucket, StepGraph>,
    arenas: SharedArenas,
    clock: u64,
    capacity: usize,
    stats: StepCacheStats,
}

/// What the step-graph cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCacheStats {
    /// Steps whose graph was built and planned.
    pub built: u64,
    /// Steps that reused a planned graph.
    pub reused: u64,
    /// Planned graphs dropped: to stay within the capacity, or placed in a shared arena since
    /// replaced by a larger one.
    pub evicted: u64,
    /// Bytes of the shared activation arenas (as large as the largest step planned, plus a
    /// quarter).
    pub arena_bytes: usize,
}

/// What the fusion passes do to one step graph ([`Model::fusion_summary`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusionSummary {
    /// Ops that run (live op nodes other than views: each is at least one kernel launch on a
    /// GPU) before the passes.
    pub ops_before: usize,
    /// The same after the passes.
    pub ops_after: usize,
    /// The ops that run after the passes by kind (op name, count), most first (ties by name):
    /// where the next fusion would save the most launches.
    pub kinds_after: Vec<(&'static str, usize)>,
    /// One report per enabled pass, in order.
    pub reports: Vec<PassReport>,
}

/// The names of the live op nodes that compute (views cost nothing at run time).
fn running_op_names(g: &Graph) -> impl Iterator<Item = &'static str> + '_ {
    g.live_nodes().into_iter().filter_map(|id| g.node(id).op().filter(|op| !op.is_view()).map(|op| op.name()))
}

/// Live op nodes that compute.
fn running_ops(g: &Graph) -> usize {
    running_op_names(g).count()
}

/// [`running_op_names`] counted by name, most first (ties by name).
fn running_op_kinds(g: &Graph) -> Vec<(&'static str, usize)> {
    let mut counts = std::collections::BTreeMap::new();
    for name in running_op_names(g) {
        *counts.entry(name).or_insert(0) += 1;
    }
    let mut kinds: Vec<_> = counts.into_iter().collect();
    kinds.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    kinds
}

/// A step graph's inputs and output.
#[derive(Debug, Clone, Copy)]
struct StepIo {
    leaves: StepLeaves,
    /// `[n_seq]`: the row of each sequence's last token (unless every row's logits are kept).
    last_rows: Option<Tensor>,
    /// `[4, n_seq]`: each sequence's sampling settings (when the graph ends in `sample`).
    settings: Option<Tensor>,
    /// Logits `[n_vocab, rows]`, or token ids i32 `[1, n_seq]`.
    out: Tensor,
}

impl StepIo {
    /// These handles in the graph the passes rewrote.
    fn remap(self, run: &PassRun) -> Result<StepIo, GraphError> {
        Ok(StepIo {
            leaves: self.leaves.remap(run)?,
            last_rows: self.last_rows.map(|t| run.tensor(t)).transpose()?,
            settings: self.settings.map(|t| run.tensor(t)).transpose()?,
            out: run.tensor(self.out)?,
        })
    }
}

fn alloc_zeroed(backend: &mut dyn Backend, ne: [usize; 4], dtype: DType) -> R<TensorRef> {
    let meta = TensorMeta::contiguous("cache", dtype, ne).map_err(GraphError::from)?;
    let bytes = meta.nbytes_contiguous();
    let buffer = backend.alloc(bytes)?;
    backend.write(buffer, 0, &vec![0u8; bytes])?;
    Ok(TensorRef { buffer, offset: 0, meta })
}

impl Model {
    /// Reads the config from `file` with the declarations of the family its
    /// `general.architecture` names ([`crate::arch::lookup`]; an unknown architecture or bad
    /// metadata is a [`ConfigError`]), loads the weights and allocates zeroed caches on
    /// `backend`.
    pub fn load(file: &GgufFile, backend: &mut dyn Backend, opts: ModelOptions) -> R<Model> {
        let config = ModelConfig::from_gguf(file)?;
        Self::with_config(file, config, backend, opts)
    }

    /// [`Model::load`] with an explicit config.
    pub fn with_config(
        file: &GgufFile,
        config: ModelConfig,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        config.validate()?;
        let weights = ModelWeights::load(file, &config, backend)?;
        Self::with_weights(config, weights, backend, opts)
    }

    /// A model of `config` with seeded synthetic weights uploaded straight to `backend`: the
    /// weights `tessera synth` would write with this dtype and seed (`synth::upload_weights`), with
    /// no file and no disk (what `tessera bench --preset` runs).
    pub fn synthetic(
        config: ModelConfig,
        weight: DType,
        seed: u64,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        let weights = crate::synth::upload_weights(&config, weight, seed, backend)?;
        Self::with_weights(config, weights, backend, opts)
    }

    /// A model of a shipped family's `config` over weights already on `backend`
    /// ([`Model::from_arch`] with [`crate::arch::for_config`]). On an error the weights are
    /// freed.
    pub fn with_weights(
        config: ModelConfig,
        mut weights: ModelWeights,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        match crate::arch::for_config(config) {
            Ok(arch) => Self::from_arch(arch, weights, backend, opts),
            Err(e) => {
                weights.free(backend);
                Err(e.into())
            }
        }
    }

    /// A model of any [`Architecture`] over weights already on `backend`: the architecture
    /// prepares them ([`Architecture::prepare_weights`]), then the caches its layers declare
    /// ([`Architecture::layer_caches`]) are allocated there, zeroed. On an error the weights and
    /// whatever was allocated are freed.
    pub fn from_arch(
        arch: Box<dyn Architecture>,
        mut weights: ModelWeights,
        backend: &mut dyn Backend,
        opts: ModelOptions,
    ) -> R<Model> {
        if let Err(e) = arch.prepare_weights(&mut weights, backend, &opts) {
            weights.free(backend);
            return Err(e.into());
        }
        match Self::assemble(arch, backend, opts) {
            Ok(mut m) => {
                m.weights = weights;
                Ok(m)
            }
            Err(e) => {
                weights.free(backend);
                Err(e)
            }
        }
    }

    /// Whether any layer holds KV cache memory, and whether any holds recurrent state (a family
    /// without one still has that cache's bookkeeping, with unit dims and no memory).
    pub fn caches_held(&self) -> (bool, bool) {
        let kv = self.layers.iter().any(|l| matches!(l, LayerMemory::Attention { .. }));
        let rec = self.layers.iter().any(|l| matches!(l, LayerMemory::Recurrent { .. }));
        (kv, rec)
    }

    /// A model of `arch` with its caches and no weights yet (the caller moves them in).
    fn assemble(arch: Box<dyn Architecture>, backend: &mut dyn Backend, opts: ModelOptions) -> R<Model> {
        let needs = arch.layer_caches();
        let (kv_shape, rec_shape) = cache_shapes(arch.name(), &needs)?;
        let count = |f: fn(&LayerCacheNeed) -> bool| needs.iter().filter(|n| f(n)).count().max(1);
        let n_attn = count(|n| matches!(n, LayerCacheNeed::Attention { .. }));
        let n_rec = count(|n| matches!(n, LayerCacheNeed::Recurrent { .. }));
        let (n_head_kv, k_dim, v_dim) = kv_shape.unwrap_or((1, 1, 1));
        let kv_cfg = KvCacheConfig {
            block_size: opts.block_size,
            max_context: opts.max_context,
            dtype: opts.kv_dtype,
            policy: opts.policy,
            ..KvCacheConfig::new(n_attn, n_head_kv, k_dim, v_dim, opts.kv_blocks)
        };
        let kv = PagedKvCache::new(kv_cfg)?;
        let ([conv_len, channels], [sk, sv, hv]) = rec_shape.unwrap_or(([1, 1], [1, 1, 1]));
        let rec_cfg = RecurrentConfig::new(n_rec, (conv_len, channels), (sk, sv, hv), opts.n_slots);
        let recurrent = RecurrentCache::new(rec_cfg)?;
        let steps = StepCache { capacity: opts.step_graphs.max(1), ..StepCache::default() };
        let mut model = Model {
            arch,
            weights: ModelWeights::default(),
            kv,
            recurrent,
            layers: Vec::new(),
            opts: ModelOptions { kv_pad: opts.kv_pad.max(1), ..opts },
            steps,
            last_times: StepTimes::default(),
            passes: tessera_graph::passes::standard(),
            pass_reports: Vec::new(),
        };
        model.passes.disable_from_env()?;
        for need in &needs {
            let (shapes, dtype) = match need {
                LayerCacheNeed::None => {
                    model.layers.push(LayerMemory::None);
                    continue;
                }
                LayerCacheNeed::Attention { .. } => ([model.kv.k_shape(), model.kv.v_shape()], opts.kv_dtype),
                LayerCacheNeed::Recurrent { .. } => {
                    ([model.recurrent.conv_shape(), model.recurrent.delta_shape()], DType::F32)
                }
            };
            // On an error, free what this model allocated so far (the caller frees the weights).
            let a = match alloc_zeroed(backend, shapes[0], dtype) {
                Ok(a) => a,
                Err(e) => {
                    model.free(backend);
                    return Err(e);
                }
            };
            let b = match alloc_zeroed(backend, shapes[1], dtype) {
                Ok(b) => b,
                Err(e) => {
                    backend.free(a.buffer);
                    model.free(backend);
                    return Err(e);
                }
            };
            model.layers.push(match need {
                LayerCacheNeed::Attention { .. } => LayerMemory::Attention { k: a, v: b },
                _ => LayerMemory::Recurrent { conv: a, state: b },
            });
        }
        Ok(model)
    }

    /// The architecture this model runs.
    pub fn arch(&self) -> &dyn Architecture {
        self.arch.as_ref()
    }

    /// The GGUF-declared config of a shipped family ([`Architecture::config`]).
    pub fn config(&self) -> Option<&ModelConfig> {
        self.arch.config()
    }

    /// Vocabulary size: token ids are `0..n_vocab`, and each logits row has `n_vocab` values.
    pub fn n_vocab(&self) -> usize {
        self.arch.n_vocab()
    }

    /// The options the model was made with (`kv_pad` at least 1).
    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }

    /// Frees the weights, caches and planned step graphs on `backend`.
    pub fn free(&mut self, backend: &mut dyn Backend) {
        self.free_on(&mut [backend]);
    }

    /// Frees the weights, caches and planned step graphs: on `backends`, those the model's steps
    /// ran on ([`Model::step_on`]), the first the one it was loaded on.
    pub fn free_on(&mut self, backends: &mut [&mut dyn Backend]) {
        for (_, mut sg) in self.steps.graphs.drain() {
            sg.exe.free(backends);
        }
        self.steps.arenas.free(backends);
        let Some(backend) = backends.first_mut() else { return };
        let backend = &mut **backend;
        self.steps.stats.arena_bytes = 0;
        self.weights.free(backend);
        for (a, b) in self.layers.drain(..).filter_map(LayerMemory::buffers) {
            backend.free(a.buffer);
            backend.free(b.buffer);
        }
    }

    /// Adds sequence `id` to both caches (its recurrent slot is zeroed before its first step).
    pub fn add_sequence(&mut self, id: SeqId) -> R<()> {
        self.recurrent.add_sequence(id)?;
        if let Err(e) = self.kv.add_sequence(id) {
            self.recurrent.remove_sequence(id)?;
            return Err(e.into());
        }
        Ok(())
    }

    /// Removes sequence `id` from both caches.
    pub fn remove_sequence(&mut self, id: SeqId) -> R<()> {
        self.kv.remove_sequence(id)?;
        self.recurrent.remove_sequence(id)?;
        Ok(())
    }

    /// Tokens sequence `id` holds.
    pub fn seq_len(&self, id: SeqId) -> R<usize> {
        Ok(self.kv.len(id)?)
    }

    /// Runs one step: appends `tokens` to each sequence (added on first use) and returns its
    /// logits, in batch order. Sequences are distinct and each has at least one token. Cache space
    /// for the whole batch is reserved first, all or nothing (a sequence past `max_context` or a
    /// full cache is an error before anything runs, and sequences this call added are removed
    /// again). An error while a graph runs (after reservation) leaves the reserved positions and
    /// any state already updated in place: the caller should remove the affected sequences.
    pub fn step(&mut self, backend: &mut dyn Backend, batch: &[(SeqId, &[u32])], which: Logits) -> R<Vec<Vec<f32>>> {
        self.step_on(&mut [backend], batch, which)
    }

    /// [`Model::step`] over several backends in order of preference: the first is the one the
    /// model was loaded on; an op it does not support runs on the next that does
    /// (`tessera_graph::schedule`), its inputs copied over and back.
    pub fn step_on(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        which: Logits,
    ) -> R<Vec<Vec<f32>>> {
        let out = self.step_as(backends, batch, Output::Logits(which))?;
        Ok(out.into_iter().map(|o| if let SeqOut::Logits(l) = o { l } else { Vec::new() }).collect())
    }

    /// [`Model::step`] with sampling on the device: the graph ends in the `sample` op over each
    /// sequence's last logits with that sequence's `settings` (temperature, top-k, top-p and
    /// its uniform draw, from [`crate::sample::Sampler::next_settings`]), and only the token ids
    /// (4 bytes a sequence, not `n_vocab * 4`) come back: the token
    /// [`crate::sample::Sampler::sample`] would pick from [`Model::step`]'s last logits.
    pub fn step_sample_on(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        settings: &[SampleSettings],
    ) -> R<Vec<u32>> {
        if settings.len() != batch.len() {
            let why = format!("{} sampling settings for {} sequences", settings.len(), batch.len());
            return Err(ModelError::BadBatch { why });
        }
        let out = self.step_as(backends, batch, Output::Tokens(settings))?;
        Ok(out.into_iter().map(|o| if let SeqOut::Token(t) = o { t } else { 0 }).collect())
    }

    /// [`Model::step_sample_on`] with greedy settings for every sequence: the argmax of each
    /// sequence's last logits (the lowest id on ties).
    pub fn step_greedy(&mut self, backend: &mut dyn Backend, batch: &[(SeqId, &[u32])]) -> R<Vec<u32>> {
        self.step_greedy_on(&mut [backend], batch)
    }

    /// [`Model::step_greedy`] over several backends (see [`Model::step_on`]).
    pub fn step_greedy_on(&mut self, backends: &mut [&mut dyn Backend], batch: &[(SeqId, &[u32])]) -> R<Vec<u32>> {
        self.step_sample_on(backends, batch, &vec![SampleSettings::greedy(); batch.len()])
    }

    fn step_as(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32])],
        what: Output<'_>,
    ) -> R<Vec<SeqOut>> {
        if backends.is_empty() {
            return Err(ExecError::NoBackend.into());
        }
        if batch.is_empty() {
            return Err(ModelError::BadBatch { why: "empty batch".into() });
        }
        for (id, toks) in batch {
            if toks.is_empty() {
                return Err(ModelError::BadBatch { why: format!("sequence {id} has no tokens") });
            }
            if let Some(&t) = toks.iter().find(|&&t| t as usize >= self.n_vocab()) {
                return Err(ModelError::BadBatch {
                    why: format!("token {t} of sequence {id} is outside the vocab of {}", self.n_vocab()),
                });
            }
        }
        let mut added = Vec::new();
        for (id, _) in batch {
            if !self.kv.contains(*id) {
                if let Err(e) = self.add_sequence(*id) {
                    for a in added {
                        let _ = self.remove_sequence(a);
                    }
                    return Err(e);
                }
                added.push(*id);
            }
        }
        let requests: Vec<(SeqId, usize)> = batch.iter().map(|(id, t)| (*id, t.len())).collect();
        let ranges = match self.kv.reserve_many(&requests) {
            Ok(r) => r,
            Err(e) => {
                for a in added {
                    let _ = self.remove_sequence(a);
                }
                return Err(e.into());
            }
        };
        self.last_times = StepTimes::default();
        self.clear_new_slots(&mut *backends[0])?;
        let packed: Vec<(SeqId, &[u32], Range<usize>)> =
            batch.iter().zip(ranges).map(|((id, toks), r)| (*id, *toks, r)).collect();
        self.run_step(backends, &packed, what)
    }

    /// Zeroes the recurrent slots handed out since the last step, in every recurrent layer.
    fn clear_new_slots(&mut self, backend: &mut dyn Backend) -> R<()> {
        let slots = self.recurrent.take_slots_to_clear();
        if slots.is_empty() {
            return Ok(());
        }
        let (conv_b, delta_b) = (self.recurrent.conv_bytes_per_slot(), self.recurrent.delta_bytes_per_slot());
        for l in &self.layers {
            if let LayerMemory::Recurrent { conv, state: delta } = l {
                for &s in &slots {
                    let s = s as usize;
                    backend.write(conv.buffer, conv.offset + s * conv_b, &vec![0u8; conv_b])?;
                    backend.write(delta.buffer, delta.offset + s * delta_b, &vec![0u8; delta_b])?;
                }
            }
        }
        Ok(())
    }

    /// Runs one packed step: lays the batch out in its bucket, finds (or builds) the bucket's
    /// planned graph, writes the inputs, runs it and reads each sequence's result back.
    fn run_step(
        &mut self,
        backends: &mut [&mut dyn Backend],
        batch: &[(SeqId, &[u32], Range<usize>)],
        what: Output<'_>,
    ) -> R<Vec<SeqOut>> {
        let t0 = std::time::Instant::now();
        let inp = StepInputs::new(&self.kv, &self.recurrent, batch, self.opts.kv_pad)?;
        let n_vocab = self.n_vocab();
        let bucket = Bucket {
            n_tokens: inp.n_tokens,
            n_seq: inp.n_seq,
            n_kv: inp.n_kv,
            all_logits: what == Output::Logits(Logits::All),
            sample: matches!(what, Output::Tokens(_)),
        };
        let sg = self.planned_step(backends, bucket)?;
        let mut s = sg.exe.session_on(backends.iter_mut().map(|b| -> &mut dyn Backend { &mut **b }).collect());
        let io = &sg.io;
        s.set_i32(io.leaves.tokens, &inp.tokens)?;
        // A leaf no op reads has no memory: the attention's leaves in a model whose blocks are
        // all gated DeltaNet (fewer than `full_attention_interval`), the state slots in one
        // without any.
        let l = &io.leaves;
        for (t, values) in [
            (l.positions, &inp.positions),
            (l.write_cells, &inp.write_cells),
            (l.block_table, &inp.block_table),
            (l.seq_offsets, &inp.seq_offsets),
            (l.kv_lens, &inp.kv_lens),
            (l.slots, &inp.slots),
        ] {
            if s.placement(t).is_some() {
                s.set_i32(t, values)?;
            }
        }
        if let Some(rows) = io.last_rows {
            s.set_i32(rows, &inp.last_rows)?;
        }
        if let (Some(t), Output::Tokens(settings)) = (io.settings, what) {
            let padding = std::iter::repeat_n(SampleSettings::greedy(), inp.n_seq - settings.len());
            let rows: Vec<f32> = settings.iter().copied().chain(padding).flat_map(|st| st.to_row()).collect();
            s.set_f32(t, &rows)?;
        }
        let t1 = std::time::Instant::now();
        s.run()?;
        let t2 = std::time::Instant::now();
        let n_seq = batch.len();
        let out = if bucket.sample {
            let ids = s.get(io.out)?;
            ids.chunks_exact(4)
                .take(n_seq)
                .map(|c| SeqOut::Token(i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32))
                .collect()
        } else {
            let all = s.get_f32(io.out)?;
            let rows = |s: usize| if bucket.all_logits { inp.rows(s) } else { s..s + 1 };
            (0..n_seq).map(|i| SeqOut::Logits(all[rows(i).start * n_vocab..rows(i).end * n_vocab].to_vec())).collect()
        };
        let t3 = std::time::Instant::now();
        drop(s);
        self.last_times += StepTimes {
            prepare: (t1 - t0).as_secs_f64(),
            launch: (t2 - t1).as_secs_f64(),
            wait: (t3 - t2).as_secs_f64(),
        };
        Ok(out)
    }

    /// The planned step graph of `bucket`: the cached one, or a new one built, planned and
    /// placed (evicting the least recently used beyond the capacity).
    fn planned_step(&mut self, backends: &mut [&mut dyn Backend], bucket: Bucket) -> R<&mut StepGraph> {
        // A graph placed on other backends than these is planned again.
        if self.steps.graphs.get(&bucket).is_some_and(|g| g.exe.n_backends() != backends.len())
            && let Some(mut old) = self.steps.graphs.remove(&bucket)
        {
            old.exe.free(backends);
        }
        // So is one placed in an arena since replaced by a larger one.
        let generation = Some(self.steps.arenas.generation());
        if self.steps.graphs.get(&bucket).is_some_and(|g| g.exe.arena_generation() != generation)
            && let Some(mut old) = self.steps.graphs.remove(&bucket)
        {
            old.exe.free(backends);
            self.steps.stats.evicted += 1;
        }
        self.steps.clock += 1;
        let clock = self.steps.clock;
        if self.steps.graphs.contains_key(&bucket) {
            self.steps.stats.reused += 1;
        } else {
            while self.steps.graphs.len() >= self.steps.capacity {
                let Some((&oldest, _)) = self.steps.graphs.iter().min_by_key(|(_, g)| g.used) else { break };
                if let Some(mut old) = self.steps.graphs.remove(&oldest) {
                    old.exe.free(backends);
                    self.steps.stats.evicted += 1;
                }
            }
            let sg = self.build_step(backends, bucket)?;
            self.steps.stats.built += 1;
            self.steps.stats.arena_bytes = self.steps.arenas.bytes();
            self.steps.graphs.insert(bucket, sg);
        }
        let sg = self.steps.graphs.get_mut(&bucket).expect("present or inserted above");
        sg.used = clock;
        Ok(sg)
    }

    /// Where the last [`Model::step`]'s time went.
    pub fn last_step_times(&self) -> StepTimes {
        self.last_times
    }

    /// What the step-graph cache has done.
    pub fn step_cache_stats(&self) -> StepCacheStats {
        self.steps.stats
    }

    /// The step graph of `bucket` (for tools and tests: DOT dumps, the memory planner's checks),
    /// with the bindings of its weight and cache leaves.
    pub fn step_graph(&self, bucket: Bucket) -> R<(Graph, Vec<(Tensor, TensorRef)>)> {
        let (b, _) = self.build_graph(bucket)?;
        Ok(b.finish())
    }

    /// The fusion passes run on every step graph (`tessera_graph::passes::standard`, minus
    /// those named in `TESSERA_DISABLE_PASSES`): switch passes here; step graphs planned
    /// before keep what they were built with.
    pub fn passes_mut(&mut self) -> &mut Pipeline {
        &mut self.passes
    }

    /// Frees the planned step graphs (not the arenas they share): the next step of each bucket is
    /// built again, with the passes as they are now.
    pub fn drop_step_graphs(&mut self, backends: &mut [&mut dyn Backend]) {
        for (_, mut sg) in self.steps.graphs.drain() {
            sg.exe.free(backends);
            self.steps.stats.evicted += 1;
        }
    }

    /// The fusion passes' names, in order, with whether each is on.
    pub fn passes(&self) -> Vec<(&'static str, bool)> {
        self.passes.passes()
    }

    /// What the passes did to the step graph built last (one report per enabled pass).
    pub fn pass_reports(&self) -> &[PassReport] {
        &self.pass_reports
    }

    /// What the enabled passes do to the step graph of `bucket` on `backend` (built and
    /// rewritten, not planned): the ops that run before and after, and each pass's report.
    pub fn fusion_summary(&self, backend: &dyn Backend, bucket: Bucket) -> R<FusionSummary> {
        let (b, _) = self.build_graph(bucket)?;
        let (g, _) = b.finish();
        let ops_before = running_ops(&g);
        let run = self.passes.run(g, &|op, inputs| backend.supports(op, inputs))?;
        let kinds_after = running_op_kinds(&run.graph);
        let ops_after = kinds_after.iter().map(|k| k.1).sum();
        Ok(FusionSummary { ops_before, ops_after, kinds_after, reports: run.reports })
    }

    /// Builds the step graph of `bucket`, runs the fusion passes on it (a fusion whose op the
    /// first backend lacks is skipped) and plans it.
    fn build_step(&mut self, backends: &mut [&mut dyn Backend], bucket: Bucket) -> R<StepGraph> {
        let (b, io) = self.build_graph(bucket)?;
        let (g, binds) = b.finish();
        let first = &*backends[0];
        let run = self.passes.run(g, &|op, inputs| first.supports(op, inputs))?;
        let io = io.remap(&run)?;
        let binds = binds.into_iter().map(|(t, r)| Ok((run.tensor(t)?, r))).collect::<Result<Vec<_>, GraphError>>()?;
        self.pass_reports = run.reports;
        let exe = Executable::scheduled_shared(
            run.graph,
            backends,
            SessionOptions::default(),
            &binds,
            &mut self.steps.arenas,
        )?;
        Ok(StepGraph { exe, io, used: 0 })
    }

    /// Builds the step graph of `bucket`: token ids in, logits (or sampled token ids) out. The
    /// architecture builds the trunk; the last-row gather, the LM head and sampling are added
    /// here.
    fn build_graph(&self, bucket: Bucket) -> R<(StepBuilder<'_>, StepIo)> {
        let Bucket { n_tokens: n, n_seq, n_kv, all_logits, sample } = bucket;
        if sample && all_logits {
            return Err(ModelError::BadBatch { why: "sampling steps keep only the last logits".into() });
        }
        let mut g = Graph::new();
        let leaves = StepLeaves {
            tokens: g.input("tokens", DType::I32, [n, 1, 1, 1])?,
            positions: g.input("positions", DType::I32, [4 * n, 1, 1, 1])?,
            write_cells: g.input("kv_write_cells", DType::I32, [n, 1, 1, 1])?,
            block_table: g.input("block_table", DType::I32, [n_kv, n_seq, 1, 1])?,
            seq_offsets: g.input("seq_offsets", DType::I32, [n_seq + 1, 1, 1, 1])?,
            kv_lens: g.input("kv_lens", DType::I32, [n_seq, 1, 1, 1])?,
            slots: g.input("state_slots", DType::I32, [n_seq, 1, 1, 1])?,
            decode: n <= n_seq,
        };
        let last_rows = if all_logits { None } else { Some(g.input("last_rows", DType::I32, [n_seq, 1, 1, 1])?) };
        let views = (self.kv.k_view(), self.kv.v_view());
        let mut b = StepBuilder::new(g, leaves, bucket, &self.weights, &self.layers, views, &self.opts);

        let mut h = self.arch.build(&mut b)?;
        if let Some(rows) = last_rows {
            h = b.g.get_rows(h, rows)?;
        }
        let head = b.param(self.arch.lm_head())?;
        let mut out = b.g.mul_mat(head, h)?;
        let settings = if sample { Some(b.g.input("sample_settings", DType::F32, [4, n_seq, 1, 1])?) } else { None };
        if let Some(st) = settings {
            out = b.g.sample(out, st)?; // i32 [1, n_seq]
        }
        b.g.mark_output(out)?;
        Ok((b, StepIo { leaves, last_rows, settings, out }))
    }
}

/// The K/V shape of an attention layer: `(n_head_kv, k_dim, v_dim)`.
type KvShape = (usize, usize, usize);
/// The state shape of a recurrent layer: `([d_conv - 1, channels], [S_k, S_v, H_v])`.
type RecurrentShape = ([usize; 2], [usize; 3]);

/// The one K/V shape of the attention layers and the one state shape of the recurrent layers
/// `needs` declare (`None` where no layer has that kind of cache).
fn cache_shapes(arch: &str, needs: &[LayerCacheNeed]) -> R<(Option<KvShape>, Option<RecurrentShape>)> {
    let bad = |why: String| ModelError::CacheNeeds { arch: arch.to_string(), why };
    let (mut kv, mut rec) = (None, None);
    for (il, need) in needs.iter().enumerate() {
        match *need {
            LayerCacheNeed::None => {}
            LayerCacheNeed::Attention { n_head_kv, k_dim, v_dim } => {
                let shape = (n_head_kv, k_dim, v_dim);
                if n_head_kv == 0 || k_dim == 0 || v_dim == 0 {
                    return Err(bad(format!("layer {il}: attention cache {shape:?} has a zero dimension")));
                }
                match kv {
                    Some(first) if first != shape => {
                        return Err(bad(format!(
                            "layer {il}: attention cache (n_head_kv, k_dim, v_dim) {shape:?} differs from an earlier \
                             layer's {first:?} (one paged KV cache serves every layer)"
                        )));
                    }
                    _ => kv = Some(shape),
                }
            }
            LayerCacheNeed::Recurrent { conv, state } => {
                let shape = (conv, state);
                if conv.contains(&0) || state.contains(&0) {
                    return Err(bad(format!("layer {il}: recurrent cache {shape:?} has a zero dimension")));
                }
                match rec {
                    Some(first) if first != shape => {
                        return Err(bad(format!(
                            "layer {il}: recurrent cache {shape:?} differs from an earlier layer's {first:?}"
                        )));
                    }
                    _ => rec = Some(shape),
                }
            }
        }
    }
    Ok((kv, rec))
}
